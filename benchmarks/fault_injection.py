"""Fault injection: a small real sweep is launched, faults are injected, and after each fault it is launched
again until it completes; its results are then compared with an uninterrupted run of the same sweep.

The sweep is tests/sweeps/crash.yaml (the whole pipeline at test size; `--smoke`: a smaller variant of it
written to the work folder). Its tiny teacher is trained once, by the reference run, and every other home
starts with a copy of that run's cache, so every run sees the same teacher. Each launch is a subprocess
(`moesweep launch` through this script's `_cli` mode, which applies the injected faults and then runs the
CLI unchanged) in a session of its own, so that a kill of its process group is a kill of the launch.

Faults (`--faults`, comma-separated):
  kill-serial      SIGKILL of the launch's process group at a random moment (seeded; uniform between 0.5 s
                   and the reference launch's wall time), serial executor; relaunched until the sweep
                   completes, in fresh homes until `--kills` kills were made
  kill-ray         the same with the Ray executor (`--num-cpus 2`, a local Ray)
  kill-ray-pid     SIGKILL of the launch's process only (as the OOM killer does), Ray executor
  ray-worker       a Ray worker process (`ray::JobWorker`) SIGKILLed while a convert job runs, then (in
                   another home) a distill job; the job fails, the launch goes on; relaunched with
                   --retry-failed
  raise            a convert job raises (the stage function patched in the launch's process; serial
                   executor); relaunched with --retry-failed without the fault
  nan              a ppl_pre job returns a NaN perplexity (a diverged model): recorded as value_kind nan,
                   the sweep completes at once; that configuration (not one the reference distills) is the
                   only row allowed to differ from the reference, and it must read ppl_pre_kind = nan
  db-lock          a second process holds BEGIN EXCLUSIVE on the SQLite file at a random moment of a launch,
                   for each of `--locks` seconds (10: below the 30 s busy timeout, the launch waits and goes
                   on; 40: a job's result cannot be written and it fails; 75: the launch stops with one
                   line, exit 2); relaunched with --retry-failed until complete
  disk-full        MOESWEEP_HOME/artifacts is a small tmpfs (needs root and `mount -t tmpfs`) that fills up
                   during distillation; then it is made larger and the sweep relaunched with --retry-failed
  corrupt          between launches of a completed sweep: the calibration statistics overwritten with
                   random bytes of the same size; then a distilled student truncated to half its size
  bitrot           a completed sweep's calibration statistics rot with their size and mtime kept (each
                   float tensor's elements in reverse order: still valid safetensors, other statistics,
                   as after bit rot or a `cp -p`/rsync restore of a bad copy), and one conversion's plan
                   is deleted, so that the relaunch recomputes a job that reads the statistics; then
                   `moesweep verify` (which must find everything as recorded) and a relaunch
  special          special files in place of artifacts of a completed sweep, each then relaunched: the
                   statistics a symlink to /dev/zero; a FIFO in a student's folder (its mtime restored),
                   found by `moesweep verify` first; a student's weights a symlink to an identical copy
                   outside the job's folder. A launch or verify that does not end within `--hang-s` is
                   killed and noted
  caches           the caches a recompute reads, in a completed sweep: every kept lm-eval task result edited
                   to accuracy 0.875 and resealed with a matching sha256, then the evaluations recomputed;
                   the cached tiny teacher's weights rotted (size and mtime kept), then the teacher
                   recomputed. (A planted pickle is tests/test_eval_cache.py's: it needs the exact requests
                   of an evaluation, which only an in-process run sees.)

Columns: injected faults; sweeps completed (a sweep is complete when a launch exits 0); rows lost (result
rows of the reference missing), duplicated (a configuration with several result rows, or a job with more
metric rows than in the same job of the reference), differing (a result row not equal to the reference's, exactly);
processes left: processes of that launch (its descendants and every process whose environment holds its
MOESWEEP_HOME, Ray's included, seen while it ran or when it ended) still alive `--settle-s` seconds after a launch ended, summed over launches; all gone: seconds
after the last launch of the fault kind until none of them was left (polled up to `--drain-s`).

  .venv/bin/python benchmarks/fault_injection.py                  # every fault, 20 kills per executor
  .venv/bin/python benchmarks/fault_injection.py --smoke          # 2 kills (serial), a raising job, corrupt,
                                                                  # bitrot, special
  .venv/bin/python benchmarks/fault_injection.py --smoke --faults bitrot,special   # only those
  .venv/bin/python benchmarks/fault_injection.py --faults kill-ray,kill-ray-pid --kills 5 --no-watchdog
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CRASH = REPO / "tests" / "sweeps" / "crash.yaml"
ALL = [
    "kill-serial",
    "kill-ray",
    "kill-ray-pid",
    "ray-worker",
    "raise",
    "nan",
    "db-lock",
    "disk-full",
    "corrupt",
    "bitrot",
    "special",
    "caches",
]
SMOKE = ["kill-serial", "raise", "corrupt", "bitrot", "special", "caches"]
RESULT_COLS = (
    "config_key",
    "kind",
    "baseline",
    "scoring",
    "grouping",
    "dp_scaling",
    "K",
    "ppl_pre",
    "ppl_pre_kind",
    "ppl_post",
    "avg_acc",
    "selected_for_distill",
    "duplicate_of IS NOT NULL",
)
LOCKER = (
    "import sqlite3, sys, time\n"
    "c = sqlite3.connect(sys.argv[1], isolation_level=None, timeout=60)\n"
    "c.execute('BEGIN EXCLUSIVE')\n"
    "print('locked', flush=True)\n"
    "time.sleep(float(sys.argv[2]))\n"
    "c.execute('COMMIT')\n"
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--smoke",
        action="store_true",
        help=f"seconds to a minute: {', '.join(SMOKE)} on a smaller variant of crash.yaml, 2 kills",
    )
    ap.add_argument("--faults", default=",".join(ALL), help=f"comma-separated, of: {', '.join(ALL)}")
    ap.add_argument(
        "--kills", type=int, default=20, help="SIGKILLs of the process group per executor (default 20)"
    )
    ap.add_argument(
        "--pid-kills", type=int, default=5, help="SIGKILLs of the launch's process alone (kill-ray-pid)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-cpus", type=int, default=2, help="CPUs of the local Ray")
    ap.add_argument(
        "--locks",
        default="10,40,75",
        help="seconds the database is locked, one launch each (the busy timeout is 30 s)",
    )
    ap.add_argument(
        "--settle-s",
        type=float,
        default=5.0,
        help="processes of a launch still alive this long after it ended are left behind",
    )
    ap.add_argument("--drain-s", type=float, default=120.0, help="how long to wait for the last of them")
    ap.add_argument(
        "--hang-s",
        type=float,
        default=300.0,
        help="bitrot, special: a launch or verify still running after this long is killed (a hang)",
    )
    ap.add_argument(
        "--no-watchdog",
        action="store_true",
        help="launch a local Ray as before the watchdog (orchestrator.execute): to measure the "
        "processes a killed launch leaves without it",
    )
    ap.add_argument("--work", default=None, help="work folder (default: a temp dir, removed afterwards)")
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    a = ap.parse_args(argv)
    a.faults = (
        SMOKE if a.smoke and a.faults == ",".join(ALL) else [f.strip() for f in a.faults.split(",") if f]
    )
    for f in a.faults:
        if f not in ALL:
            ap.error(f"--faults: {f!r}; allowed: {', '.join(ALL)}")
    if a.smoke:
        a.kills, a.pid_kills = min(a.kills, 2), min(a.pid_kills, 2)
    return a


# ---- the launch's process: faults injected, then the CLI as it is ----------------------------------
def cli(argv: list[str]) -> None:
    """`moesweep` with the faults of the environment injected in this process (FI_RAISE_KEY: that job
    raises; FI_NAN_KEY: that ppl_pre job returns a NaN perplexity; FI_NO_WATCHDOG: no local-Ray watchdog).
    Stage functions are looked up by name when a job runs, so the patched ones run (serial executor)."""
    sys.path.insert(0, str(REPO))
    import workers.run.convert as run_convert
    import workers.run.ppl_pre as run_ppl_pre

    raise_key, nan_key = os.environ.get("FI_RAISE_KEY"), os.environ.get("FI_NAN_KEY")
    if raise_key:
        convert = run_convert.stage_convert

        def failing_convert(payload, cache, progress):
            if payload["key"] == raise_key:
                raise RuntimeError("injected fault: this job raises")
            return convert(payload, cache, progress)

        run_convert.stage_convert = failing_convert
    if nan_key:
        ppl_pre = run_ppl_pre.stage_ppl_pre

        def diverged(payload, cache, progress):
            rec = ppl_pre(payload, cache, progress)
            if payload["key"] == nan_key:
                for m in rec["metrics"]:
                    m.update(value=float("nan"), value_kind="nan")
                rec["outputs"].update(ppl=float("nan"), value_kind="nan")
            return rec

        run_ppl_pre.stage_ppl_pre = diverged
    if os.environ.get("FI_NO_WATCHDOG"):
        import orchestrator.execute as ex

        ex._dies_with_this_process = contextlib.nullcontext
    from orchestrator.cli import app

    sys.argv = ["moesweep", *argv]
    app()


# ---- processes -----------------------------------------------------------------------------------
def processes(home: Path) -> set[tuple[int, int]]:
    """(pid, start time) of every process whose environment holds MOESWEEP_HOME=home: the launch, its local
    Ray's head processes, agents and workers (they inherit the environment of the launch)."""
    want = f"MOESWEEP_HOME={home}".encode()
    found = set()
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                if want not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{d}/stat") as f:
                found.add((int(d), int(f.read().rsplit(")", 1)[1].split()[19])))
        except (OSError, ValueError, IndexError):
            pass
    return found


def descendants(root: int) -> set[tuple[int, int]]:
    """(pid, start time) of the processes under `root` (a process that renames itself, as Ray's agents do,
    may overwrite the environment that /proc shows: the launch's own children are counted by descent too)."""
    table: dict[int, tuple[int, int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                table[int(d)] = (int(fields[1]), int(fields[19]))
            except (OSError, ValueError, IndexError):
                pass
    kids: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        kids.setdefault(ppid, []).append(pid)
    out, todo = set(), list(kids.get(root, []))
    while todo:
        pid = todo.pop()
        if (pid, table[pid][1]) not in out:
            out.add((pid, table[pid][1]))
            todo += kids.get(pid, [])
    return out


def alive(procs: set[tuple[int, int]]) -> set[tuple[int, int]]:
    left = set()
    for pid, start in procs:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[19]) == start and fields[0] != "Z":
                left.add((pid, start))
        except (OSError, ValueError, IndexError):
            pass
    return left


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


# ---- launches ------------------------------------------------------------------------------------
@dataclass
class Kind:
    name: str
    injected: int = 0
    completed: int = 0
    lost: int = 0
    duplicated: int = 0
    differing: int = 0
    left: int = 0
    gone_s: float = 0.0
    launches: int = 0
    notes: list[str] = field(default_factory=list)
    procs: set = field(default_factory=set)  # every process of its launches seen (to drain at the end)
    left_names: dict = field(default_factory=dict)
    counted: set = field(default_factory=set)


class Bench:
    def __init__(self, a: argparse.Namespace, work: Path) -> None:
        self.a, self.work = a, work
        self.rng = random.Random(a.seed)
        self.sweep = work / "sweep.yaml"
        self.refs: dict[str, Path] = {}
        self.ref_wall: dict[str, float] = {}
        self.n = 0

    def env(self, home: Path, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MOESWEEP_", "FI_", "RAY_ADDRESS"))}
        env.update(
            MOESWEEP_HOME=str(home),
            PYTHONPATH=str(REPO),
            OMP_NUM_THREADS="1",
            HF_HUB_OFFLINE="1",
            HF_DATASETS_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            TOKENIZERS_PARALLELISM="false",
            RAY_DEDUP_LOGS="0",
            **extra,
        )
        if self.a.no_watchdog:
            env["FI_NO_WATCHDOG"] = "1"
        return env

    def start(self, home: Path, executor: str, retry: bool = False, **extra: str) -> subprocess.Popen:
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "_cli",
            "launch",
            str(self.sweep),
            "--executor",
            executor,
            "--db",
            f"sqlite:///{home}/moesweep.db",
        ]
        if executor == "ray":
            cmd += ["--num-cpus", str(self.a.num_cpus)]
        if retry:
            cmd.append("--retry-failed")
        log = open(home.parent / f"{home.name}.launches.log", "a")  # noqa: SIM115  (closed by the child's end)
        log.write(f"\n==== {' '.join(cmd[2:])} {extra}\n")
        log.flush()
        p = subprocess.Popen(
            cmd, cwd=self.work, env=self.env(home, **extra), stdout=log, stderr=log, start_new_session=True
        )
        log.close()
        return p

    def ended(self, kind: Kind, home: Path, seen: set) -> None:
        """A launch ended: its processes (seen while it ran, and any found now) still alive after settle_s."""
        seen = seen | processes(home)
        kind.procs |= seen
        kind.launches += 1
        t0 = time.monotonic()
        while alive(seen) and time.monotonic() - t0 < self.a.settle_s:
            time.sleep(0.1)
        left = alive(seen) - kind.counted  # (one left by an earlier launch of the same home is counted once)
        kind.counted |= left
        kind.left += len(left)
        for pid, _ in left:
            name = cmdline(pid).split(" ")[0].rsplit("/", 1)[-1] or "?"
            kind.left_names[name] = kind.left_names.get(name, 0) + 1

    def wait(self, p: subprocess.Popen, home: Path, seconds: float | None) -> tuple[int | None, set]:
        """Wait for the launch to end (rc) or `seconds` (None: it still runs); the processes seen meanwhile."""
        seen: set = set()
        t0 = time.monotonic()
        while p.poll() is None and (seconds is None or time.monotonic() - t0 < seconds):
            seen |= processes(home) | descendants(p.pid)
            time.sleep(0.25)
        return p.poll(), seen

    def kill(self, p: subprocess.Popen, group: bool = True) -> None:
        with contextlib.suppress(ProcessLookupError):
            if group:
                os.killpg(p.pid, signal.SIGKILL)
            else:
                os.kill(p.pid, signal.SIGKILL)
        p.wait()

    def run_to_end(
        self, kind: Kind, home: Path, executor: str, retry: bool = False, limit_s: float = 900, **extra: str
    ) -> int:
        p = self.start(home, executor, retry, **extra)
        rc, seen = self.wait(p, home, limit_s)
        if rc is None:
            self.kill(p)
            rc = -9
            kind.notes.append(f"a launch ran {limit_s:.0f} s and was killed")
        self.ended(kind, home, seen)
        return rc

    def complete(
        self, kind: Kind, home: Path, executor: str, retry: bool = True, limit_s: float = 900
    ) -> bool:
        """Relaunch (with --retry-failed) until a launch exits 0; at most 4 launches."""
        for _ in range(4):
            rc = self.run_to_end(kind, home, executor, retry=retry, limit_s=limit_s)
            if rc == 0:
                kind.completed += 1
                return True
            kind.notes.append(f"a relaunch exited {rc}")
        return False

    def home(self, tag: str) -> Path:
        """A fresh MOESWEEP_HOME holding a copy of the reference run's cache (the same teacher)."""
        self.n += 1
        home = self.work / f"{tag}-{self.n}"
        home.mkdir()
        shutil.copytree(self.refs["serial"] / "cache", home / "cache")
        return home

    def reference(self, executor: str) -> Path:
        if executor not in self.refs:
            home = self.work / f"ref-{executor}"
            home.mkdir()
            if "serial" in self.refs:
                shutil.copytree(self.refs["serial"] / "cache", home / "cache")
            t0 = time.monotonic()
            rc = self.run_to_end(Kind("ref"), home, executor)
            self.ref_wall[executor] = time.monotonic() - t0
            if rc != 0:
                raise SystemExit(f"the reference run ({executor}) exited {rc}; see {home}.launches.log")
            self.refs[executor] = home
            print(
                f"reference ({executor}): {self.ref_wall[executor]:.1f} s, "
                f"{len(snapshot(home)[0])} result rows",
                flush=True,
            )
        return self.refs[executor]

    # ---- comparison ----------------------------------------------------------------------------
    def compare(self, kind: Kind, home: Path, executor: str, allowed: dict[str, tuple] | None = None) -> None:
        ref_rows, ref_metrics = snapshot(self.reference(executor))
        rows, metrics = snapshot(home)
        by_key: dict[str, list[tuple]] = {}
        for r in rows:
            by_key.setdefault(r[0], []).append(r)
        ref = {r[0]: r for r in ref_rows}
        kind.lost += sum(1 for k in ref if k not in by_key)
        kind.duplicated += sum(len(v) - 1 for v in by_key.values() if len(v) > 1)
        kind.duplicated += sum(1 for k, n in metrics.items() if k in ref_metrics and n > ref_metrics[k])
        extra = [k for k in metrics if k not in ref_metrics]
        if extra:  # e.g. what a selection moved by a failure distilled: kept, linked to no configuration
            linked = one(
                home,
                "SELECT COUNT(*) FROM config_jobs cj JOIN jobs j ON j.id = cj.job_id WHERE j.key IN "
                f"({', '.join('?' * len(extra))})",
                *extra,
            )
            kind.notes.append(
                f"{len(extra)} job(s) that the reference does not have, {linked} of them linked to "
                "a configuration"
            )
        for k, rs in by_key.items():
            if allowed and k in allowed:
                if not allowed[k](rs[0]):
                    kind.differing += 1
                continue
            if k not in ref or rs[0] != ref[k]:
                kind.differing += 1

    # ---- the faults ----------------------------------------------------------------------------
    def kills(self, kind: Kind, executor: str, group: bool = True) -> None:
        self.reference(executor)
        hi = max(1.0, self.ref_wall[executor])
        want = self.a.kills if group else self.a.pid_kills
        while kind.injected < want:
            home = self.home(kind.name)
            done = False
            for _ in range(100):
                p = self.start(home, executor, retry=True)
                rc, seen = self.wait(p, home, self.rng.uniform(0.5, hi) if kind.injected < want else 900)
                if rc is None:
                    seen |= processes(home) | descendants(p.pid)
                    self.kill(p, group)
                    kind.injected += 1
                    self.ended(kind, home, seen)
                    continue
                self.ended(kind, home, seen)
                if rc == 0:
                    done = True
                    break
                kind.notes.append(f"a launch exited {rc} after a kill")
            if done:
                kind.completed += 1
                self.compare(kind, home, executor)

    def ray_worker(self, kind: Kind) -> None:
        """In a fresh home per stage: a worker is killed while a job of that stage runs; then resumed."""
        self.reference("ray")
        for stage in ("convert", "distill"):
            home = self.home(kind.name)
            p = self.start(home, "ray", retry=True)
            seen: set = set()
            killed = False
            while p.poll() is None:
                seen |= processes(home) | descendants(p.pid)
                if not killed and running(home, stage):
                    workers = [pid for pid, _ in processes(home) if cmdline(pid).startswith("ray::JobWorker")]
                    if workers:
                        os.kill(self.rng.choice(sorted(workers)), signal.SIGKILL)
                        kind.injected += 1
                        killed = True
                time.sleep(0.05)
            self.ended(kind, home, seen)
            failed = count(home, "status = 'failed'")
            kind.notes.append(
                f"worker killed in {stage}: launch exited {p.returncode}, {failed} job(s) failed"
                if killed
                else f"no worker was seen running a {stage} job"
            )
            if self.complete(kind, home, "ray"):
                self.compare(kind, home, "ray")

    def raising(self, kind: Kind) -> None:
        ref = self.reference("serial")
        key = one(
            ref,
            "SELECT j.key FROM results r JOIN config_jobs cj ON cj.config_id = r.config_id "
            "AND cj.stage = 'convert' JOIN jobs j ON j.id = cj.job_id WHERE r.kind = 'moe2dense' "
            "AND r.selected_for_distill = 1 ORDER BY j.key LIMIT 1",
        )  # the failure moves the selection
        home = self.home(kind.name)
        rc = self.run_to_end(kind, home, "serial", FI_RAISE_KEY=key)
        kind.injected += 1
        err = one(home, "SELECT error FROM jobs WHERE key = ?", key) or ""
        kind.notes.append(
            f"the raising launch exited {rc}; the job is "
            f"{one(home, 'SELECT status FROM jobs WHERE key = ?', key)}"
            + (" with the injected error" if "injected fault" in err else "")
        )
        if self.complete(kind, home, "serial"):
            self.compare(kind, home, "serial")

    def nan(self, kind: Kind) -> None:
        ref = self.reference("serial")
        cfg, key = one(
            ref,
            "SELECT c.config_key, j.key FROM results r JOIN configurations c ON c.id = r.config_id "
            "JOIN config_jobs cj ON cj.config_id = c.id AND cj.stage = 'ppl_pre' "
            "JOIN jobs j ON j.id = cj.job_id WHERE r.kind = 'moe2dense' AND r.K = 4 "
            "AND r.selected_for_distill = 0 ORDER BY c.config_key LIMIT 1",
            row=True,
        )
        home = self.home(kind.name)
        rc = self.run_to_end(kind, home, "serial", FI_NAN_KEY=key)
        kind.injected += 1
        if rc == 0:
            kind.completed += 1
        else:
            kind.notes.append(f"the launch with a NaN exited {rc}")
        before = one(home, "SELECT attempts FROM jobs WHERE key = ?", key)
        rc2 = self.run_to_end(kind, home, "serial")
        if rc2 != 0 or one(home, "SELECT attempts FROM jobs WHERE key = ?", key) != before:
            kind.notes.append(f"the relaunch after the NaN exited {rc2} or ran it again")
        i = RESULT_COLS.index("ppl_pre_kind")
        self.compare(kind, home, "serial", {cfg: lambda r: r[i] == "nan" and r[i - 1] is None})
        got = one(
            home,
            "SELECT r.ppl_pre_kind FROM results r JOIN configurations c ON c.id = r.config_id "
            "WHERE c.config_key = ?",
            cfg,
        )
        kind.notes.append(f"{cfg}: ppl_pre_kind = {got}")

    def db_lock(self, kind: Kind) -> None:
        self.reference("serial")
        for hold in [float(x) for x in self.a.locks.split(",") if x]:
            home = self.home(kind.name)
            p = self.start(home, "serial")
            rc, seen = self.wait(p, home, self.rng.uniform(3.0, max(3.5, 0.7 * self.ref_wall["serial"])))
            if rc is None:
                locker = subprocess.Popen(
                    [sys.executable, "-c", LOCKER, str(home / "moesweep.db"), str(hold)],
                    stdout=subprocess.PIPE,
                    text=True,
                )
                locker.stdout.readline()
                kind.injected += 1
                rc, more = self.wait(p, home, None)
                seen |= more
                locker.wait()
            else:
                kind.notes.append("the launch ended before the lock")
            self.ended(kind, home, seen)
            kind.notes.append(f"lock of {hold:.0f} s: the launch exited {rc}")
            if rc == 0:
                kind.completed += 1
                self.compare(kind, home, "serial")
            elif self.complete(kind, home, "serial"):
                self.compare(kind, home, "serial")

    def disk_full(self, kind: Kind) -> None:
        self.reference("serial")
        home = self.home(kind.name)
        arts = home / "artifacts"
        arts.mkdir()
        size = 1200 if not self.a.smoke else 1000
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}k", "tmpfs", str(arts)],
            capture_output=True,
            text=True,
        )
        if r.returncode != 0:
            kind.notes.append(f"skipped: cannot mount a tmpfs ({r.stderr.strip() or r.returncode})")
            return
        try:
            rc = self.run_to_end(kind, home, "serial")
            full = count(home, "status = 'failed' AND error LIKE '%No space left%'")
            kind.injected += 1
            kind.notes.append(
                f"{size} KiB of artifacts: the launch exited {rc}, {full} job(s) failed for no space left"
            )
            subprocess.run(["mount", "-o", "remount,size=64m", str(arts)], check=True)
            if self.complete(kind, home, "serial"):
                self.compare(kind, home, "serial")
        finally:
            subprocess.run(["umount", "-l", str(arts)], capture_output=True)

    def corrupt(self, kind: Kind) -> None:
        self.reference("serial")
        home = self.home(kind.name)
        rc = self.run_to_end(kind, home, "serial")  # a completed sweep, whose artifacts are then broken
        if rc != 0:
            kind.notes.append(f"the first launch exited {rc}")
            return
        for what in ("stats", "student"):
            if what == "stats":
                path = Path(one(home, "SELECT path FROM artifacts WHERE kind = 'calibration_stats'"))
                path.write_bytes(random.Random(self.a.seed).randbytes(path.stat().st_size))
            else:
                folder = Path(
                    one(
                        home,
                        "SELECT a.path FROM artifacts a JOIN jobs j ON j.id = a.job_id "
                        "WHERE j.stage = 'distill' ORDER BY j.key LIMIT 1",
                    )
                )
                path = max((f for f in folder.rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
                with open(path, "r+b") as f:
                    f.truncate(path.stat().st_size // 2)
            kind.injected += 1
            if self.complete(kind, home, "serial", retry=False):
                self.compare(kind, home, "serial")
            kind.notes.append(f"{what}: {count(home, 'attempts > 1')} job(s) recomputed so far")

    def verify(self, kind: Kind, home: Path) -> tuple[int | None, str]:
        """`moesweep verify` of the home's database: (exit code or None when killed after --hang-s, output)."""
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "_cli",
            "verify",
            "--db",
            f"sqlite:///{home}/moesweep.db",
        ]
        try:
            r = subprocess.run(
                cmd, cwd=self.work, env=self.env(home), capture_output=True, text=True, timeout=self.a.hang_s
            )
        except subprocess.TimeoutExpired:
            kind.notes.append(f"verify ran {self.a.hang_s:.0f} s and was killed")
            return None, ""
        return r.returncode, r.stdout + r.stderr

    def bitrot(self, kind: Kind) -> None:
        self.reference("serial")
        home = self.home(kind.name)
        if self.run_to_end(kind, home, "serial") != 0:
            kind.notes.append("the first launch exited non-zero")
            return
        stats = Path(one(home, "SELECT path FROM artifacts WHERE kind = 'calibration_stats'"))
        rot_keeping_mtime(stats)
        plan = Path(
            one(
                home,
                "SELECT a.path FROM artifacts a JOIN jobs j ON j.id = a.job_id "
                "WHERE j.stage = 'convert' AND a.kind = 'plan' ORDER BY j.key LIMIT 1",
            )
        )
        plan.unlink()  # its conversion runs again, reading the statistics
        kind.injected += 1
        if self.complete(kind, home, "serial", retry=False, limit_s=self.a.hang_s):
            self.compare(kind, home, "serial")
        rc, out = self.verify(kind, home)
        kind.notes.append(
            f"verify after the relaunch exited {rc}"
            + (" (everything as recorded)" if rc == 0 else f": {out.strip().splitlines()[-1:]}")
        )
        if rc != 0 and self.complete(kind, home, "serial", retry=False, limit_s=self.a.hang_s):
            self.compare(kind, home, "serial")
        kind.notes.append(f"{count(home, 'attempts > 1')} job(s) recomputed")

    def special(self, kind: Kind) -> None:
        self.reference("serial")
        home = self.home(kind.name)
        if self.run_to_end(kind, home, "serial") != 0:
            kind.notes.append("the first launch exited non-zero")
            return
        for what in ("dev-zero", "fifo", "outside"):
            student = Path(
                one(
                    home,
                    "SELECT a.path FROM artifacts a JOIN jobs j ON j.id = a.job_id "
                    "WHERE j.stage = 'distill' ORDER BY j.key LIMIT 1",
                )
            )
            if what == "dev-zero":
                stats = Path(one(home, "SELECT path FROM artifacts WHERE kind = 'calibration_stats'"))
                stats.unlink()
                stats.symlink_to("/dev/zero")
            elif what == "fifo":
                st = student.stat()
                os.mkfifo(student / "pipe")
                for p in (student / "pipe", student):  # size and mtime as recorded: only verify sees it
                    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
                rc, out = self.verify(kind, home)
                said = [ln for ln in out.splitlines() if "refused" in ln]
                kind.notes.append(f"fifo: verify exited {rc}" + (f": {said[0]}" if said else ""))
            else:
                weights = max((f for f in student.rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
                outside = home / "elsewhere" / weights.name
                outside.parent.mkdir(exist_ok=True)
                shutil.copy2(weights, outside)  # the same bytes, size and mtime
                weights.unlink()
                weights.symlink_to(outside)
            kind.injected += 1
            if self.complete(kind, home, "serial", retry=False, limit_s=self.a.hang_s):
                self.compare(kind, home, "serial")
            else:
                kind.notes.append(f"{what}: the sweep did not complete")
        kind.notes.append(f"{count(home, 'attempts > 1')} job(s) recomputed")

    def caches(self, kind: Kind) -> None:
        """The caches a recompute reads: every kept lm-eval task result edited to accuracy 0.875 and
        resealed with a matching sha256 (an edit that rewrites the hash too), then the evaluations
        recomputed; the cached tiny teacher's weights rotted, then the teacher recomputed."""
        import json

        sys.path.insert(0, str(REPO))
        from workers.evaluation.evaluate import _seal

        self.reference("serial")
        home = self.home(kind.name)
        if self.run_to_end(kind, home, "serial") != 0:
            kind.notes.append("the first launch exited non-zero")
            return
        stored = sorted((home / "lm_eval_cache" / "runs").glob("*/*.json"))
        for f in stored:
            doc = {k: v for k, v in json.loads(f.read_text()).items() if k != "sha256"}
            for m in ("acc", "acc_norm"):
                if doc["row"].get(m) is not None:
                    doc["row"][m] = 0.875
            f.write_text(json.dumps(_seal(doc)))
        for row in _q(
            home,
            "SELECT a.path FROM artifacts a JOIN jobs j ON j.id = a.job_id WHERE j.stage = 'evaluate' AND a.kind = 'lm_eval_results'",
        ):
            Path(row[0]).unlink()  # each evaluation runs again, reading the kept results
        kind.injected += 1
        kind.notes.append(f"evaluation cache: {len(stored)} kept task results edited and resealed")
        if self.complete(kind, home, "serial", retry=False, limit_s=self.a.hang_s):
            self.compare(kind, home, "serial")
        models = [d for d in (home / "cache" / "tiny" / "model").glob("*") if d.is_dir()]
        for d in models:
            rot_keeping_mtime(max((f for f in d.rglob("*.safetensors")), key=lambda f: f.stat().st_size))
        teacher = one(
            home,
            "SELECT a.path FROM artifacts a JOIN jobs j ON j.id = a.job_id WHERE j.stage = 'teacher' AND a.kind = 'model'",
        )
        shutil.rmtree(teacher)  # the teacher runs again, from its cache
        kind.injected += 1
        kind.notes.append(f"tiny teacher cache: {len(models)} cached model(s) rotted")
        if self.complete(kind, home, "serial", retry=False, limit_s=self.a.hang_s):
            self.compare(kind, home, "serial")
        kind.notes.append(f"{count(home, 'attempts > 1')} job(s) recomputed")

    def drain(self, kind: Kind) -> None:
        t0 = time.monotonic()
        while alive(kind.procs) and time.monotonic() - t0 < self.a.drain_s:
            time.sleep(0.2)
        kind.gone_s = time.monotonic() - t0 if alive(kind.procs) else max(0.0, time.monotonic() - t0)
        if alive(kind.procs):
            kind.notes.append(
                f"{len(alive(kind.procs))} process(es) still alive after {self.a.drain_s:.0f} s"
            )


# ---- the database ----------------------------------------------------------------------------------
def _q(home: Path, sql: str, *args):
    with contextlib.closing(sqlite3.connect(f"file:{home}/moesweep.db?mode=ro", uri=True, timeout=60)) as c:
        return c.execute(sql, args).fetchall()


def one(home: Path, sql: str, *args, row: bool = False):
    rows = _q(home, sql, *args)
    if not rows:
        return None
    return rows[0] if row else rows[0][0]


def count(home: Path, where: str) -> int:
    return one(home, f"SELECT COUNT(*) FROM jobs WHERE {where}")


def running(home: Path, stage: str) -> bool:
    try:
        return bool(_q(home, "SELECT 1 FROM jobs WHERE stage = ? AND status = 'running' LIMIT 1", stage))
    except sqlite3.OperationalError:
        return False


def snapshot(home: Path) -> tuple[list[tuple], dict[str, int]]:
    """The result rows (by configuration, in order) and the number of metric rows of each job."""
    cols = ", ".join(("c." if c == "config_key" else "r.") + c for c in RESULT_COLS)
    rows = _q(
        home,
        f"SELECT {cols} FROM results r JOIN configurations c ON c.id = r.config_id ORDER BY c.config_key",
    )
    metrics = dict(
        _q(home, "SELECT j.key, COUNT(m.id) FROM jobs j LEFT JOIN metrics m ON m.job_id = j.id GROUP BY j.id")
    )
    return rows, metrics


def rot_keeping_mtime(path: Path) -> None:
    """A safetensors file with each float tensor's elements in reverse order: valid, of the same size,
    with other values; its mtime as it was."""
    import json
    import struct

    import numpy as np

    st = path.stat()
    data = bytearray(path.read_bytes())
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + n])
    dtypes = {"F64": np.float64, "F32": np.float32, "F16": np.float16}
    for t in header.values():
        if isinstance(t, dict) and t.get("dtype") in dtypes:
            a, b = (8 + n + o for o in t["data_offsets"])
            data[a:b] = np.frombuffer(bytes(data[a:b]), dtype=dtypes[t["dtype"]])[::-1].tobytes()
    assert bytes(data) != path.read_bytes() and len(data) == st.st_size
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def smoke_sweep(text: str) -> str:
    """crash.yaml with a smaller grid (2 conversions), one baseline and a shorter evaluation."""
    import yaml

    spec = yaml.safe_load(text)
    spec.update(name="crash", baselines=["teacher"])
    spec["grid"].update(scoring=["SF"], grouping=["RR"], K=[2, 4])
    spec["evaluate"]["limit"] = 4
    return yaml.safe_dump(spec, sort_keys=False)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from machine import cpu_name

    work = Path(a.work).resolve() if a.work else Path(tempfile.mkdtemp(prefix="moesweep-faults-"))
    work.mkdir(parents=True, exist_ok=True)
    b = Bench(a, work)
    text = CRASH.read_text()
    b.sweep.write_text(smoke_sweep(text) if a.smoke else text)
    print(
        f"fault injection: {', '.join(a.faults)}; seed {a.seed}; {os.cpu_count()} CPUs ({cpu_name()}); "
        f"work folder {work}" + ("; local Ray without the watchdog" if a.no_watchdog else ""),
        flush=True,
    )
    kinds: list[Kind] = []
    t_all = time.monotonic()
    try:
        b.reference("serial")
        for f in a.faults:
            kind = Kind(f)
            kinds.append(kind)
            t0 = time.monotonic()
            {
                "kill-serial": lambda k: b.kills(k, "serial"),
                "kill-ray": lambda k: b.kills(k, "ray"),
                "kill-ray-pid": lambda k: b.kills(k, "ray", group=False),
                "ray-worker": b.ray_worker,
                "raise": b.raising,
                "nan": b.nan,
                "db-lock": b.db_lock,
                "disk-full": b.disk_full,
                "corrupt": b.corrupt,
                "bitrot": b.bitrot,
                "special": b.special,
                "caches": b.caches,
            }[f](kind)
            b.drain(kind)
            print(
                f"{f}: {kind.injected} fault(s), {kind.launches} launches, {time.monotonic() - t0:.0f} s",
                flush=True,
            )
    finally:
        if not (a.keep or a.work):
            shutil.rmtree(work, ignore_errors=True)
    print()
    print(
        f"| fault | injected | sweeps completed | rows lost | rows duplicated | rows differing | "
        f"processes left ({a.settle_s:.0f} s after a launch ended) | all gone after |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for k in kinds:
        names = ", ".join(f"{n} ×{c}" for n, c in sorted(k.left_names.items()))
        print(
            f"| {k.name} | {k.injected} | {k.completed} | {k.lost} | {k.duplicated} | {k.differing} | "
            f"{k.left}{f' ({names})' if names else ''} | {k.gone_s:.1f} s |"
        )
    print()
    for k in kinds:
        for n in dict.fromkeys(k.notes):
            print(f"  {k.name}: {n}")
    print(f"total {time.monotonic() - t_all:.0f} s")
    bad = sum(k.lost + k.duplicated + k.differing for k in kinds)
    incomplete = [k.name for k in kinds if k.injected and not k.completed]
    if incomplete:
        print(f"never completed: {', '.join(incomplete)}")
    return 1 if bad or incomplete else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["_cli"]:
        cli(sys.argv[2:])
    else:
        sys.exit(main())
