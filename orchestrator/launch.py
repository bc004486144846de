"""`moesweep launch`: run (or resume) a sweep stage by stage, with the DB as the state of record.

Each stage registers its jobs (by content key), skips what already succeeded, claims the rest
atomically (so two launches never run one job twice), runs them on the executor and writes each
result in its own transaction as it arrives. A crash loses at most the jobs in flight.

Artifacts are checked before they are used again. A succeeded job is reused only if its own artifacts
match their records (size and mtime; the content hash where either moved) and the upstream artifacts it
read are still the ones recorded when it ran; a job runs only once the artifacts it reads match their
records, hashed in full (once per launch: a change that kept size and mtime is found before it is read),
and records the hashes of what it read (`HASHED`). Otherwise the job that wrote the artifact goes back to
`pending` with the error `stale: <why>`, the launch says so in one line and recomputes it (first, when a
later job is about to read it), and every job that had read other content than the recomputed one is
recomputed in turn; content found changed also makes stale every job that may have read it
(`stale_readers`). A device, FIFO, socket or symlink out of its job's folder is refused, never read. A background
thread heartbeats every job the launch holds, whatever the executor is doing.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from sqlalchemy.exc import OperationalError

from db.store import STALE_AFTER_S, Store, explain, home, owner_id
from orchestrator import configs as P
from orchestrator import hooks, mirror
from orchestrator.axes import AXES
from orchestrator.schema import artifact_root
from orchestrator.scope import Scope, competes, is_d2d
from orchestrator.spec import (
    SpecError,
    SweepSpec,
    check_local_paths,
    relaunch_name,
    spec_hash,
    spec_notes,
)
from orchestrator.stage import JobSpec, Stage, SweepContext, get_stage, stages, unique
from workers.core.artifacts import LAYOUT, is_url, same_content, sealed
from workers.core.artifacts import check as artifact_check
from workers.core.artifacts import name as artifact_name
from workers.core.shape import TeacherShape


@dataclass
class StageReport:
    stage: str
    total: int = 0
    cached: int = 0
    ran: int = 0
    failed: list[tuple[str, str]] = field(default_factory=list)  # (key, last error line)
    blocked: int = 0
    stale: int = 0  # succeeded jobs found stale (an artifact changed or an input was recomputed): recomputed


class Heartbeat:
    """The heartbeat of every job a launch holds, every `interval_s`, from a thread of its own (with its own
    connection from the store's pool) whatever the executor is doing: a long job that the serial executor
    runs in the orchestrator's thread is not taken over by another launch while its owner lives."""

    def __init__(self, store: Store, owner: str, held: Callable[[], list[str]], interval_s: float) -> None:
        self.store, self.owner, self.held, self.interval_s = store, owner, held, interval_s
        self.failures = 0
        self.last_error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="moesweep-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.store.heartbeat(self.held(), self.owner)
            except Exception as e:  # a busy or unreachable DB: the next beat tries again
                self.failures += 1
                self.last_error = str(e).splitlines()[0] if str(e) else type(e).__name__

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)


class ProgressLines:
    """Where the console is not a terminal (nohup, CI, a log file) rich draws no bars: every `interval_s`
    one line per stage in progress (and per job reporting its own progress) instead, plus one for a
    stage that finished since the last lines, so a log shows how far a launch is."""

    def __init__(self, progress: Progress, console: Console, interval_s: float) -> None:
        self.progress, self.console, self.interval_s = progress, console, interval_s
        self._reported: set[int] = set()  # finished tasks already printed as such
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="moesweep-progress-lines", daemon=True)

    def start(self) -> ProgressLines:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.print()

    def print(self) -> None:
        stamp = time.strftime("%H:%M:%S")
        for t in self.progress.tasks:
            if t.id in self._reported:
                continue
            if t.finished:
                self._reported.add(t.id)
            total = f"{t.total:g}" if t.total is not None else "?"
            name = t.description.strip()
            sub = t.description.startswith(" ")
            self.console.print(
                f"{stamp} {'  job ' if sub else 'stage '}{name}: {t.completed:g}/{total}"
                f"{' done' if t.finished else ''} ({_elapsed(t.elapsed)})",
                highlight=False,
                soft_wrap=True,
                markup=False,
            )

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)


def _elapsed(s: float | None) -> str:
    s = int(s or 0)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def progress_interval() -> float:
    """Seconds between progress lines when there is no terminal: $MOESWEEP_PROGRESS_S, else 30."""
    try:
        return max(0.1, float(os.environ.get("MOESWEEP_PROGRESS_S", "30")))
    except ValueError:
        return 30.0


class Runner:
    def __init__(
        self,
        store: Store,
        executor,
        sweep_id: int,
        spec: SweepSpec,
        *,
        retry_failed: bool,
        console: Console,
        progress: Progress | None,
        owner: str | None = None,
        stale_after_s: float = STALE_AFTER_S,
        wait_s: float = 1.0,
    ) -> None:
        self.store, self.executor, self.sweep_id, self.spec = store, executor, sweep_id, spec
        self.retry_failed = retry_failed
        self.owner = owner or owner_id()
        self.stale_after_s, self.wait_s = stale_after_s, wait_s
        self.console = console
        self.progress = progress
        self.claimed: set[str] = set()
        self._lock = threading.Lock()  # `claimed` is read by the heartbeat thread
        self.interrupted = False  # set by Ctrl-C: a job that fails now failed because of it
        self.signal: int | None = None  # the signal that interrupted the launch (SIGINT, SIGTERM)
        self.reports: list[StageReport] = []
        self._job_bars: dict[str, Any] = {}
        self.known: dict[str, tuple[Stage, JobSpec]] = {}  # every job this launch planned, by key
        self.cache_epoch = 0  # grows when an artifact is recomputed in place: workers drop what they loaded
        self._consumed: dict[str, dict[str, dict[str, str]]] = {}  # job key -> the input artifacts it reads
        self._recomputing: set[str] = set()
        self._announced: set[str] = set()  # stale jobs this launch already named on the console
        # (path, content hash) of the artifacts this launch hashed in full (or its jobs wrote): each is
        # hashed once per launch, before the first job that reads it runs
        self._verified: set[tuple[str, str]] = set()
        self._bridged: dict[tuple[str, str, str], bool] = {}  # (path, hash before `p1:`, `p1:` record)
        self.artifacts = artifacts_root(spec)  # None: artifacts stay under $MOESWEEP_HOME
        self.on_stored: Callable[[str, str], None] | None = None  # (stage, key) of each job it stores

    def held(self) -> list[str]:
        with self._lock:
            return list(self.claimed)

    # ---- one stage ---------------------------------------------------------------------------
    def run_stage(
        self, st: Stage, jobs: Iterable[JobSpec | None], rep: StageReport | None = None
    ) -> dict[str, dict[str, Any]]:
        """Run a stage's distinct jobs; returns {job key: outputs} of those that succeeded. A succeeded job
        is reused only if its artifacts are as recorded and its inputs are those it read; a job runs only
        once the artifacts it reads are as recorded (else their producer is recomputed first).
        `rep`: recompute jobs of a stage that already ran (counted in its report)."""
        stage = st.name
        jobs = unique(jobs)
        nested = rep is not None
        if rep is None:
            rep = StageReport(stage, total=len(jobs))
            self.reports.append(rep)
        if not jobs:
            return {}
        for j in jobs:
            self.known[j.key] = (st, j)
        self.store.register_jobs(self.sweep_id, [j.record() for j in jobs])
        bar = self.progress.add_task(f"{stage}", total=len(jobs)) if self.progress and not nested else None
        tries: dict[str, int] = {}
        checked: set[str] = set()  # succeeded jobs whose artifacts and inputs were checked in this call
        waited: set[str] = set()  # jobs another launch held: a failure there is not retried here
        pending = list(jobs)
        while pending:
            self._inputs_ready(pending)
            if self._check_reuse(st, [j for j in pending if j.key not in checked], rep):
                self._inputs_ready(pending)  # what the jobs just found stale read: hashed before they run
            checked.update(j.key for j in pending)
            rows = self.store.jobs([j.key for j in pending] + [d for j in pending for d in j.deps.values()])
            arts = self.store.artifacts(d for j in pending for d in j.deps.values())
            payloads, waiting = [], []
            for j in pending:
                status = rows[j.key]["status"]
                if status == "succeeded":
                    rep.cached += 1
                    self._advance(bar)
                    continue
                if status == "failed" and (
                    j.key in waited or not (self.retry_failed and tries.get(j.key, 0) == 0)
                ):
                    rep.failed.append((j.key, _last_line(rows[j.key]["error"])))
                    self._advance(bar)
                    continue
                if any(rows.get(d, {}).get("status") != "succeeded" for d in j.deps.values()):
                    rep.blocked += 1
                    self._advance(bar)
                    continue
                err = rows[j.key]["error"] or ""
                if status == "pending" and err.startswith("stale: ") and j.key not in self._announced:
                    self._announced.add(
                        j.key
                    )  # marked stale earlier (by `moesweep verify`, or a launch cut short)
                    self.console.print(
                        f"{stage} {j.key[:8]}…: {err[len('stale: ') :]}; recomputing",
                        highlight=False,
                        soft_wrap=True,
                    )
                    rep.stale += 1
                self._consumed[j.key] = self._read_inputs(j, arts)
                payloads.append(self._payload(st, j, rows, arts))
            retry: list[JobSpec] = []
            by_key = {j.key: j for j in pending}

            def claim(p: dict, waiting: list = waiting, by_key: dict = by_key) -> bool:
                """Taken right before the job starts, so concurrent launches share a stage's jobs."""
                if self.interrupted:  # Ctrl-C that a library swallowed: start nothing new
                    raise KeyboardInterrupt
                if not self.store.claim(p["key"], self.owner, retry_failed=self.retry_failed):
                    waiting.append(by_key[p["key"]])  # another launch holds it (or finished it)
                    return False
                with self._lock:
                    self.claimed.add(p["key"])
                tries[p["key"]] = tries.get(p["key"], 0) + 1
                return True

            def on_done(
                p: dict,
                result: dict | None,
                err: str | None,
                dt: float,
                retry: list = retry,
                by_key: dict = by_key,
            ) -> None:
                key = p["key"]
                stray = sorted(set(result or {}) - st.records - {"compute_s", "versions"})
                if err is None and stray:  # a record the stage does not declare is a bug in its run function
                    result, err = (
                        None,
                        f"stage {stage!r} returned {stray}; it declares records {sorted(st.records)}",
                    )
                if err is None and result is not None:
                    result = self._sealed(result)
                    try:
                        self.store.finish(
                            key,
                            self.owner,
                            result,
                            dt,
                            log_path=p["log_path"],
                            inputs=self._consumed.get(key),
                        )
                    except (
                        Exception
                    ) as e:  # e.g. a record the schema refuses: the job failed, the launch goes on
                        if self.interrupted:
                            raise KeyboardInterrupt from e
                        # the last line is what the launch's summary shows: what went wrong, not a link
                        result, err = (
                            None,
                            (
                                traceback.format_exc()
                                + f"recording its result failed: {explain(self.store.url, e)}"
                            ),
                        )
                if err is None and result is not None:
                    rep.ran += 1
                    self._advance(bar)
                else:
                    if self.interrupted:  # the job died of Ctrl-C: released by launch(), not a failure
                        raise KeyboardInterrupt
                    final = tries[key] > self.spec.execution.retries
                    self.store.fail(
                        key,
                        self.owner,
                        err or "no result",
                        final=final,
                        log_path=p["log_path"],
                        duration_s=dt,
                    )
                    if final:
                        rep.failed.append((key, _last_line(err)))
                        self._advance(bar)
                    else:
                        retry.append(by_key[key])
                with self._lock:
                    self.claimed.discard(key)
                self._consumed.pop(key, None)
                if err is None and result is not None and self.on_stored is not None:
                    self.on_stored(stage, key)  # e.g. its curves mirrored (orchestrator/mirror.py)

            for group in _by_shape(payloads).values():
                self.executor.run(group, on_done, self._on_progress, None, claim)
            others = self._wait_for_others(waiting)
            waited.update(j.key for j in others)
            pending = retry + others
        self._finish_bar(bar)
        return {
            k: json.loads(r["outputs_json"] or "{}")
            for k, r in self.store.jobs([j.key for j in jobs]).items()
            if r["status"] == "succeeded"
        }

    # ---- artifacts: checked before they are used again -----------------------------------------
    def _problem(self, rows: list[dict[str, Any]], full: bool = False) -> str | None:
        """One line on what is wrong with a job's artifacts (None: all as recorded). An artifact whose
        size or mtime moved but whose content is the same gets its new size and mtime stored. `full`:
        every artifact hashed (once per launch: one this launch hashed or wrote is checked as without).
        Content found other than recorded makes the jobs that may have read it stale (`stale_readers`)."""
        problems = []
        changed: dict[str, str] = {}
        for a in rows:
            # hashed once per launch: after that, size and mtime (a hash again only where either moved)
            c = artifact_check(a, full=full and (a["path"], a["content_hash"]) not in self._verified)
            if c.problem:
                problems.append(c.problem)
                if c.changed and a.get("content_hash"):
                    changed[a["path"]] = a["content_hash"]
                continue
            if c.mtime is not None or c.size is not None:
                self.store.update_artifact(a["id"], mtime=c.mtime, size_bytes=c.size)
            if full and a.get("content_hash"):
                self._verified.add((a["path"], a["content_hash"]))
        if changed:
            key = rows[0]["key"]
            up = f"{self.known[key][0].name} {key[:8]}…" if key in self.known else f"{key[:8]}…"
            stale_readers(self.store, key, changed, up)
        if not problems:
            return None
        return problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")

    def _hash_inputs(self, rows: list[dict[str, Any]]) -> str | None:
        """`_problem` of an upstream job's artifacts that a job is about to read, hashed in full: content
        that kept its size and mtime (bit rot, a `cp -p` or rsync restore) is found before it is read."""
        return self._problem(rows, full=True)

    def _read_inputs(self, j: JobSpec, arts: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
        """What a job about to run reads ({upstream key: {path: content hash}}), with `HASHED` when every
        one of those hashes is of the content as this launch hashed it (not only copied from the record)."""
        out: dict[str, Any] = _inputs_of(j, arts)
        read = [a for d in j.deps.values() for a in arts.get(d, [])]
        if j.deps and all((a["path"], a["content_hash"]) in self._verified for a in read):
            out[HASHED] = True
        return out

    def _sealed(self, result: dict[str, Any]) -> dict[str, Any]:
        """A job's result with its folder artifacts' hashes made `p1:` (over relative paths too), and its
        artifacts counted as hashed by this launch (their worker hashed them as it wrote them)."""
        if not result.get("artifacts"):
            return result
        arts = [sealed(a) for a in result["artifacts"]]
        self._verified.update((a["path"], a["content_hash"]) for a in arts if a.get("content_hash"))
        return {**result, "artifacts": arts}

    def _same(self, was: str | None, now: str | None, path: str, key: str) -> bool:
        """Whether a job that read `was` at `path` read what is recorded there now (`now`); a hash from
        before `p1:` against a `p1:` record of its recomputation is compared on the content (hashed once)."""
        if was == now:
            return True
        if not (was and now and now.startswith(LAYOUT)) or was.startswith(LAYOUT):
            return False
        k = (path, was, now)
        if k not in self._bridged:
            self._bridged[k] = same_content(path, was, now, key)
        return self._bridged[k]

    def _stale(self, st: Stage, key: str, why: str, rep: StageReport | None) -> bool:
        """Mark a succeeded job stale and say so in one line; False if it was not succeeded any more."""
        if not self.store.mark_stale(key, why):
            return False
        self._announced.add(key)
        self.console.print(f"{st.name} {key[:8]}…: {why}; recomputing", highlight=False, soft_wrap=True)
        if rep is not None:
            rep.stale += 1
        return True

    def _check_reuse(self, st: Stage, jobs: list[JobSpec], rep: StageReport) -> int:
        """Succeeded jobs about to be reused: their own artifacts as recorded, and every upstream artifact
        they read still the one recorded then (an upstream job recomputed with other content makes them
        stale too). Stale ones go back to pending and run in this call; returns how many."""
        rows = self.store.jobs(j.key for j in jobs)
        done = [j for j in jobs if rows.get(j.key, {}).get("status") == "succeeded"]
        if not done:
            return 0
        arts = self.store.artifacts([j.key for j in done] + [d for j in done for d in j.deps.values()])
        n = 0
        for j in done:
            why = self._problem(arts[j.key])
            recorded = json.loads(rows[j.key].get("inputs_json") or "null") or {}
            if why is None and recorded:
                now = _inputs_of(j, arts)
                for d in j.deps.values():
                    if d not in recorded:
                        continue
                    was, cur = recorded[d], now.get(d, {})
                    changed = sorted(
                        {
                            Path(p).name
                            for p in set(was) | set(cur)
                            if not self._same(was.get(p), cur.get(p), p, d)
                        }
                    )
                    if changed:
                        up = self.known[d][0].name if d in self.known else "upstream"
                        why = f"its input {up} {d[:8]}… was recomputed with other content ({', '.join(changed)})"
                        break
            if why is not None and self._stale(st, j.key, why, rep):
                n += 1
        return n

    def _will_run(self, row: dict[str, Any] | None) -> bool:
        status = (row or {}).get("status")
        return status in ("pending", "running") or (status == "failed" and self.retry_failed)

    def _inputs_ready(self, jobs: list[JobSpec]) -> None:
        """The artifacts these jobs read are checked: hashed in full (once per launch) for a job about to
        run, size and mtime (hash where either moved) for one that succeeded; a broken one's producer is
        marked stale and recomputed now, before anything reads it."""
        deps = list(
            dict.fromkeys(
                d for j in jobs for d in j.deps.values() if d in self.known and d not in self._recomputing
            )
        )
        if not deps:
            return
        rows = self.store.jobs(deps + [j.key for j in jobs])
        full = {d for j in jobs if self._will_run(rows.get(j.key)) for d in j.deps.values()}
        arts = self.store.artifacts(d for d in deps if rows.get(d, {}).get("status") == "succeeded")
        for d, recs in arts.items():
            why = self._hash_inputs(recs) if d in full else self._problem(recs)
            if why is None:
                continue
            st, spec = self.known[d]
            rep = next((r for r in reversed(self.reports) if r.stage == st.name), None)
            self._stale(st, d, why, rep)
            self._recomputing.add(d)
            try:
                self.run_stage(st, [spec], rep=rep or StageReport(st.name))
            finally:
                self._recomputing.discard(d)
            self.cache_epoch += 1  # workers drop what they loaded from the old artifact

    def _payload(
        self, st: Stage, j: JobSpec, rows: dict[str, dict], arts: dict[str, list[dict[str, Any]]]
    ) -> dict[str, Any]:
        """What a worker needs to run a job. With an artifact root the job runs in a local scratch folder and
        uploads its artifacts under `artifacts_url`; inputs recorded at URLs are listed in `fetch` (whatever
        the root is now: they were recorded there by an earlier launch)."""
        inputs = {role: json.loads(rows[d]["outputs_json"] or "{}") for role, d in j.deps.items()}
        root = home()
        payload = {
            "key": j.key,
            "stage": j.stage,
            "run": ":".join(st.run_ref()),
            "params": j.params,
            "inputs": inputs,
            "resident": j.resident,
            "cpus": j.cpus,
            "gpus": j.gpus,
            "custom": j.custom,
            "home": str(root),
            "workdir": str(root / "artifacts" / j.stage / j.key),
            "log_path": str(root / "logs" / j.stage / f"{j.key}.log"),
            "cache_epoch": self.cache_epoch,
        }
        if self.artifacts:
            payload["workdir"] = str(root / "scratch" / j.stage / j.key)
            payload["artifacts_url"] = f"{self.artifacts}/{j.stage}/{j.key}"
        fetch = _fetch_of(j, arts)
        if fetch:
            payload["fetch"] = fetch
        return payload

    def _wait_for_others(self, waiting: list[JobSpec]) -> list[JobSpec]:
        """Jobs another launch holds: wait while they run, taking over those whose owner died (on this host
        its process ended; elsewhere its heartbeat is older than `stale_after_s`). Returns them all once one
        is not running any more: to be claimed (released), reused (succeeded) or listed (failed)."""
        while waiting:
            self.store.release_stale(self.stale_after_s)
            rows = self.store.jobs([j.key for j in waiting])
            if any(rows[j.key]["status"] != "running" for j in waiting):
                return waiting
            time.sleep(self.wait_s)
        return []

    # ---- progress ------------------------------------------------------------------------------
    def _advance(self, bar) -> None:
        if self.progress is not None and bar is not None:
            self.progress.advance(bar)

    def _finish_bar(self, bar) -> None:
        for t in list(self._job_bars.values()):
            self.progress.remove_task(t)
        self._job_bars.clear()

    def _on_progress(
        self, key: str, done: float, total: float, desc: str, metrics: list | None = None
    ) -> None:
        if metrics:  # e.g. validation CE during distillation: in the DB while the job still runs
            self.store.add_partial_metrics(key, self.owner, metrics)
        if self.progress is not None and total:
            if key not in self._job_bars:
                self._job_bars[key] = self.progress.add_task(f"  {desc or key[:8]}", total=total)
            self.progress.update(self._job_bars[key], completed=done, total=total)

    def release_claimed(self) -> None:
        self.store.release(self.owner)
        with self._lock:
            self.claimed.clear()


def _inputs_of(j: JobSpec, arts: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, str]]:
    """{upstream job key: {artifact path: content hash}}: what a job reads, as recorded now."""
    return {d: {a["path"]: a["content_hash"] for a in arts.get(d, [])} for d in j.deps.values()}


# in `jobs.inputs_json`: every hash in it is of the content as the launch hashed it right before the job
# ran (a job recorded without it, as every job was before, has hashes copied from the upstream records)
HASHED = "~hashed"


def stale_readers(
    store: Store, producer: str, changed: dict[str, str], label: str
) -> list[tuple[str, str, str]]:
    """An artifact of `producer` (`label` names it) was found with other content than recorded
    (`changed`: {path: recorded hash}): every succeeded job that read one of them goes back to pending
    (`stale: …`), unless it recorded the hash of the content it read (`HASHED`) and that is the recorded
    one (it read the content as recorded, before it changed). Returns (stage, key, why) of those marked."""
    _, rows = store.query(
        "SELECT stage, key, inputs_json FROM jobs WHERE status = 'succeeded' AND inputs_json LIKE :p",
        {"p": f'%"{producer}"%'},
    )
    out = []
    for stage, key, text in rows:
        inputs = json.loads(text or "null") or {}
        read = inputs.get(producer)
        touched = [p for p in changed if isinstance(read, dict) and p in read]
        if not touched or (inputs.get(HASHED) and all(read[p] == changed[p] for p in touched)):
            continue
        names = ", ".join(sorted({artifact_name(p) for p in touched}))
        why = f"it may have read {names} of {label}, found changed since it was recorded"
        if store.mark_stale(key, why):
            out.append((stage, key, why))
    return out


def _fetch_of(j: JobSpec, arts: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, str]]:
    """{upstream job's prefix: {artifact URL: content hash}} for the upstream artifacts recorded at URLs. A
    job's artifacts were uploaded under `<root>/<stage>/<its key>/`, so its prefix ends at its key."""
    out: dict[str, dict[str, str]] = {}
    for d in j.deps.values():
        for a in arts.get(d, []):
            path = a["path"]
            if is_url(path) and f"/{d}/" in path:
                out.setdefault(path[: path.index(f"/{d}/") + len(d) + 1], {})[path] = a["content_hash"]
    return out


def artifacts_root(spec: SweepSpec) -> str | None:
    """Where jobs upload their artifacts: the sweep's `execution.artifacts`, else `$MOESWEEP_ARTIFACTS`, else
    None (each job writes into `$MOESWEEP_HOME/artifacts/<stage>/<key>/`, as before)."""
    if spec.execution.artifacts:
        return spec.execution.artifacts
    value = os.environ.get("MOESWEEP_ARTIFACTS", "").strip()
    if not value:
        return None
    try:
        return artifact_root(value)
    except ValueError as e:
        raise SpecError(f"MOESWEEP_ARTIFACTS: {e}") from None


def _by_shape(payloads: list[dict[str, Any]]) -> dict[tuple, list[dict[str, Any]]]:
    out: dict[tuple, list[dict[str, Any]]] = {}
    for p in payloads:
        out.setdefault((p["cpus"], p["gpus"], tuple(sorted(p.get("custom", {}).items()))), []).append(p)
    return out


def _last_line(err: str | None) -> str:
    lines = [ln for ln in (err or "").strip().splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


# ---- the whole sweep ------------------------------------------------------------------------------
def prepare(spec: SweepSpec, path: str | None = None) -> tuple[TeacherShape, list[dict[str, Any]]]:
    """Everything that can be wrong with a sweep before anything runs (data paths, the teacher's shape
    against its config, K against it): (the teacher's shape, the configurations). SpecError otherwise."""
    where = path or spec.name
    check_local_paths(spec, where)
    artifacts_root(spec)  # $MOESWEEP_ARTIFACTS is checked here too
    shape = P.model_shape(spec, where)
    return shape, P.build_configs(spec, shape)


def launch(
    spec: SweepSpec, spec_text: str, store: Store, executor, *, console: Console | None = None, **kw: Any
) -> int:
    """Run the sweep (`run_launch`), its progress on `console` (default: stderr), then the sweep's hooks
    (`execution.hooks`, orchestrator/hooks.py) with the exit code, whatever the outcome (failed jobs, a
    crash, Ctrl-C) but a sweep refused as bad input. A console that writes wherever sys.stderr points at
    the time is held to the stream of this launch's start while it runs: the serial executor points
    sys.stderr at each job's log during the job, and the launch's progress lines and bars belong on the
    terminal, not in job logs."""
    console = console or Console(stderr=True)
    follows = console._file is None  # rich resolves sys.stderr / sys.stdout at each write
    if follows:
        console.file = console.file
    code: int | None = None
    outcome: str | None = None
    try:
        code = run_launch(spec, spec_text, store, executor, console=console, **kw)
        return code
    except BaseException as e:
        code, outcome = hooks.ended(e)
        raise
    finally:
        try:
            if code is not None:
                hooks.run_hooks(spec, store, code, console, outcome)
        finally:
            if follows:
                console._file = None


def run_launch(
    spec: SweepSpec,
    spec_text: str,
    store: Store,
    executor,
    *,
    retry_failed: bool = False,
    console: Console | None = None,
    show_progress: bool = True,
    path: str | None = None,
    prepared: tuple[TeacherShape, list[dict[str, Any]]] | None = None,
    owner: str | None = None,
    heartbeat_s: float = 10.0,
    stale_after_s: float = STALE_AFTER_S,
    lines_s: float | None = None,
    scope: Scope | None = None,
) -> int:
    """Run the sweep; returns the process exit code (0 = everything succeeded). `owner` (default
    host:pid) names this launch on the jobs it claims; it heartbeats them every `heartbeat_s`, and takes
    over another host's running job only when its heartbeat is older than `stale_after_s`. Progress shows
    as bars on a terminal, else as lines every `lines_s` (default: progress_interval()). `scope`: a
    partial launch (--until, --only; orchestrator/scope.py), checked against the sweep here."""
    console = console or Console(stderr=True)
    shape, configs = prepared or prepare(spec, path)
    scope = scope or Scope()
    scope.prepare(spec, configs)
    before = store.stored_spec_hash(spec.name)
    if before not in (None, spec_hash(spec_text)):
        console.print(
            f"sweep {spec.name}: its spec differs from the last launch's (an edited file, other --set "
            "overrides); the stored spec is replaced and every finished job whose inputs are unchanged is "
            "reused",
            highlight=False,
            soft_wrap=True,
        )
    sid = store.upsert_sweep(
        spec.name,
        spec_yaml=spec_text,
        spec_hash=spec_hash(spec_text),
        description=spec.description,
        select_json=P.select_json(spec),
    )
    store.record_stages(s.name for s in stages())  # readers order stages by it (the dashboard)
    store.release_stale(stale_after_s)
    cfg_ids = store.upsert_configs(sid, configs)
    as_lines = show_progress and not console.is_terminal
    progress = Progress(
        TextColumn("{task.description:<28}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        disable=not show_progress or as_lines,
        transient=False,
    )
    runner = Runner(
        store,
        executor,
        sid,
        spec,
        retry_failed=retry_failed,
        console=console,
        progress=progress,
        owner=owner,
        stale_after_s=stale_after_s,
    )
    ctx = _context(spec, shape, configs, store, sid, cfg_ids)
    ctx.run_now = lambda name, jobs: _run_round(runner, ctx, scope, name, jobs)
    ctx.job_metrics = lambda keys, name: _job_metrics(store, keys, name)
    mirror.attach(runner, spec, store, ctx, console)  # execution.mirror: each job's curves once stored
    previous = _on_sigint(runner)
    beat = Heartbeat(store, runner.owner, runner.held, heartbeat_s).start()
    lines = ProgressLines(progress, console, lines_s or progress_interval()).start() if as_lines else None
    planned: dict[str, tuple[Stage, JobSpec]] = {}  # a partial launch: every job planned, by key
    ran: set[str] = set()  # … and those it ran
    chosen: list[str] | None = None
    try:
        with progress:
            for stage in scope.stages():
                jobs = stage.jobs(ctx)
                ctx.jobs[stage.name] = jobs
                kept = scope.keep(stage.name, jobs, ctx.configs)
                if scope.partial:
                    for j in jobs.values():
                        planned.setdefault(j.key, (stage, j))
                    _run_upstream(runner, ctx, kept.values(), planned, ran)
                    ran.update(j.key for j in kept.values())
                ctx.outputs[stage.name] = runner.run_stage(stage, kept.values())
                _link(store, cfg_ids, kept, stage.name, scope.considered(stage.name, ctx.configs))
                if stage.identity:
                    _mark_duplicates(
                        store,
                        cfg_ids,
                        _linked(store, sid, stage.name)
                        if scope.partial
                        else {k: j.key for k, j in jobs.items()},
                        ctx,
                    )
                if stage.after is not None:
                    stage.after(ctx)
            chosen = _select_early(spec, scope, ctx)
        if runner.interrupted:
            raise KeyboardInterrupt
    except BaseException as e:
        # after Ctrl-C any exception is the interrupt's (e.g. a DB call cut mid-statement that re-raises
        # as an OperationalError during its rollback)
        if isinstance(e, OperationalError) and not runner.interrupted:
            # the database could not be used (locked past the busy timeout, gone): one line, not a traceback;
            # what finished is kept, and the jobs this launch held are taken over by the next one (its owner
            # is gone then), so nothing is released here through a database that is not answering
            console.print(
                f"[red]error:[/] {explain(store.url, e)}; the jobs that finished are kept and "
                "`moesweep launch` resumes",
                highlight=False,
                soft_wrap=True,
            )
            return 2
        if not (isinstance(e, KeyboardInterrupt) or runner.interrupted):
            raise
        store.engine.dispose()  # a connection interrupted mid-statement is never reused
        try:
            runner.release_claimed()
        except Exception as err:  # the next launch releases them anyway: their owner is gone
            console.print(
                f"[yellow]could not release the jobs in flight now ({err}); the next launch will[/]"
            )
        term = runner.signal == signal.SIGTERM
        console.print(
            f"[yellow]{'terminated (SIGTERM)' if term else 'interrupted'}[/]: finished jobs are kept; "
            "`moesweep launch` resumes."
        )
        return 143 if term else 130
    finally:
        if lines is not None:
            lines.stop()
            lines.print()  # where every stage ended
        beat.stop()
        if beat.failures:
            console.print(
                f"[yellow]warning:[/] {beat.failures} heartbeat(s) could not be written "
                f"(last: {beat.last_error})",
                highlight=False,
                soft_wrap=True,
            )
        for sig, handler in (previous or {}).items():
            signal.signal(sig, handler)
        executor.close()
    code = _summary(console, runner.reports, store, sid)
    if scope.partial:
        _partial_note(console, spec, scope, chosen, path, spec_text)
    return code


def _run_upstream(
    runner: Runner,
    ctx: SweepContext,
    jobs: Iterable[JobSpec],
    planned: dict[str, tuple[Stage, JobSpec]],
    ran: set[str],
) -> None:
    """A partial launch: run the jobs these jobs read that earlier stages planned but left out (e.g. the
    calibration of a seed repeat), each before what reads it, counted in its own stage's report."""
    order: list[tuple[Stage, JobSpec]] = []

    def visit(j: JobSpec) -> None:
        for d in j.deps.values():
            if d in ran or d not in planned:
                continue
            ran.add(d)
            visit(planned[d][1])
            order.append(planned[d])

    for j in jobs:
        visit(j)
    for st, j in order:
        rep = next((r for r in reversed(runner.reports) if r.stage == st.name), None)
        if rep is None:
            rep = StageReport(st.name)
            runner.reports.append(rep)
        rep.total += 1
        ctx.outputs.setdefault(st.name, {}).update(runner.run_stage(st, [j], rep=rep))


def _run_round(
    runner: Runner, ctx: SweepContext, scope: Scope, name: str, jobs: dict[str, JobSpec]
) -> dict[str, dict[str, Any]]:
    """A round of jobs of a stage that plans in rounds (distill.search's rungs), run while it plans: those
    this launch's scope keeps, counted in a report of their own (`<stage> rounds`); {job key: outputs} of
    those that succeeded. The stage's plan names the jobs it keeps again, found done then."""
    label = f"{name} rounds"
    rep = next((r for r in runner.reports if r.stage == label), None)
    if rep is None:
        rep = StageReport(label)
        runner.reports.append(rep)
    kept = unique(scope.keep(name, jobs, ctx.configs).values())
    rep.total += len(kept)
    return runner.run_stage(get_stage(name), kept, rep=rep)


def _job_metrics(store: Store, keys: list[str], name: str) -> list[dict[str, Any]]:
    """The metric rows named `name` of the jobs `keys`: key, who, task, step, value."""
    if not keys:
        return []
    marks = {f"k{i}": k for i, k in enumerate(keys)}
    cols, rows = store.query(
        "SELECT j.key, m.who, m.task, m.step, m.value FROM metrics m JOIN jobs j ON j.id = m.job_id "
        f"WHERE m.name = :name AND j.key IN ({', '.join(':' + k for k in marks)})",
        {"name": name, **marks},
    )
    return [dict(zip(("key", "who", "task", "step", "value"), r, strict=True)) for r in rows]


def _select_early(spec: SweepSpec, scope: Scope, ctx: SweepContext) -> list[str] | None:
    """A launch that stopped before distillation but ran the stage the selection rule reads stores the
    selection (the configurations a full launch distils); None when it does not apply."""
    names = [s.name for s in scope.stages()]
    best_by = spec.select.best_by if spec.select is not None else "ppl_pre"
    if spec.distill is None or "distill" in names or best_by not in names or ctx.select is None:
        return None
    return ctx.select()


def _partial_note(
    console: Console,
    spec: SweepSpec,
    scope: Scope,
    chosen: list[str] | None,
    path: str | None,
    spec_text: str,
) -> None:
    """What a partial launch left out, and how the rest runs (by the sweep's name, or its file's path where
    the name does not find that file, with the same --set overrides)."""
    names = [s.name for s in scope.stages()]
    left = [s.name for s in stages() if s.name not in names]
    parts = [f"partial launch ({scope.describe()})"]
    if left:
        parts.append(f"stages not run: {', '.join(left)}")
    if scope.only:
        group = f", and up to {scope.best_by} the {len(scope.group)} their selection compares them with"
        parts.append(
            f"{len(scope.only)} configuration(s), those derived from them" + (group if scope.group else "")
        )
    if chosen is not None:
        parts.append(f"selected for distillation: {len(chosen)} configuration(s)")
    sets = "".join(f" --set {shlex.quote(o)}" for o in spec_notes(spec_text)[1])
    console.print(
        "; ".join(parts)
        + f". `moesweep launch {relaunch_name(spec.name, path)}{sets}` runs the rest and reuses every job done",
        highlight=False,
        soft_wrap=True,
        markup=False,
    )


def _context(
    spec: SweepSpec, shape, configs: list[dict[str, Any]], store: Store, sid: int, cfg_ids: dict[str, int]
) -> SweepContext:
    """The sweep context with the launcher's hooks: the selection rule, new configurations, fields."""
    ctx = SweepContext(spec, shape, configs)
    chosen: list[str] | None = None

    def select() -> list[str]:
        nonlocal chosen
        if chosen is None:
            chosen = _select(spec, store, sid, cfg_ids)
        return chosen

    def add_configs(new: list[dict[str, Any]]) -> None:
        rows = [{k: v for k, v in c.items() if k != "variant_of"} for c in new]
        cfg_ids.update(store.upsert_configs(sid, rows))
        store.set_config_fields(
            {
                cfg_ids[c["config_key"]]: {"variant_of": cfg_ids[c["variant_of"]]}
                for c in new
                if c.get("variant_of")
            }
        )
        known = {c["config_key"] for c in ctx.configs}
        ctx.configs.extend(c for c in new if c["config_key"] not in known)

    def set_fields(values: dict[str, dict[str, Any]]) -> None:
        store.set_config_fields({cfg_ids[ck]: v for ck, v in values.items() if ck in cfg_ids})

    ctx.select, ctx.add_configs, ctx.set_fields = select, add_configs, set_fields
    return ctx


def _on_sigint(runner: Runner):
    """Ctrl-C marks the runner interrupted before Python raises KeyboardInterrupt, so a job whose library
    turns the interrupt into another exception is released, not recorded as failed. SIGTERM (a batch
    system's time limit, `kill`) is the same stop: its jobs released, the sweep's hooks run, exit 143.
    Main thread only. Returns the handlers it replaced, to restore."""

    def handler(signum, frame):
        runner.interrupted = True
        runner.signal = signum
        signal.default_int_handler(signal.SIGINT, frame)

    try:
        return {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    except ValueError:  # not the main thread: keep Python's default behaviour
        return None


def _link(
    store: Store,
    cfg_ids: dict[str, int],
    jobs: dict[str, JobSpec],
    stage: str,
    considered: set[str] | None = None,
) -> None:
    """config_jobs: which job produced a configuration's numbers for a stage. A configuration the stage
    has no job for now (an earlier launch's selection distilled it, this one's does not) loses its link;
    in a partial launch only among the `considered` configurations (the others keep theirs)."""
    linked = {ck: j for ck, j in jobs.items() if ck in cfg_ids}
    store.unlink(
        (cid for ck, cid in cfg_ids.items() if ck not in linked and (considered is None or ck in considered)),
        stage,
    )
    if not linked:
        return
    rows = store.jobs(j.key for j in linked.values())
    store.link([(cfg_ids[ck], stage, rows[j.key]["id"]) for ck, j in linked.items() if j.key in rows])


def _linked(store: Store, sid: int, stage: str) -> dict[str, str]:
    """{config key: the key of the job linked to it for `stage`}: what a partial launch marks duplicates
    by (the configurations it did not run keep the jobs earlier launches linked)."""
    _, rows = store.query(
        "SELECT c.config_key, j.key FROM config_jobs cj JOIN configurations c ON c.id = cj.config_id "
        "JOIN jobs j ON j.id = cj.job_id WHERE c.sweep_id = :s AND cj.stage = :st",
        {"s": sid, "st": stage},
    )
    return dict(rows)


def _mark_duplicates(store: Store, cfg_ids: dict[str, int], jobs: dict[str, str], ctx: SweepContext) -> None:
    """Configurations sharing one student (the same job, and the same values of the axes that change a
    student after its conversion, such as recovery) are marked duplicates of the first of them. `jobs`:
    {config key: its job's key}."""
    later = [a.name for a in AXES.values() if a.after_student]
    known = {c["config_key"] for c in ctx.configs}
    first: dict[tuple, int] = {}
    updates: dict[int, dict[str, Any]] = {}
    mine = ((ck, k) for ck, k in jobs.items() if ck in cfg_ids and ck in known)
    for ck, key in sorted(mine, key=lambda kv: cfg_ids[kv[0]]):
        cid = cfg_ids[ck]
        ident = (key, *(ctx.config(ck).get(a) for a in later))
        first.setdefault(ident, cid)
        updates[cid] = {"duplicate_of": None if first[ident] == cid else first[ident]}
    store.set_config_fields(updates)


def _select(spec: SweepSpec, store: Store, sid: int, cfg_ids: dict[str, int]) -> list[str]:
    """The selection rule between stages (the paper: best (K, scaling) per scoring×grouping)."""
    cols, rows = store.query("SELECT * FROM results WHERE sweep = :s", {"s": spec.name})
    rows = [dict(zip(cols, r, strict=True)) for r in rows]
    key_of = {cid: ck for ck, cid in cfg_ids.items()}
    main = [r for r in rows if r.get("variant_of") is None and r["config_id"] in key_of]
    # the rule picks dense students to distill (a smaller MoE is recovered by its own `recovery` axis);
    # duplicates compete too: same numbers
    moe = [r for r in main if competes(r)]
    picked = P.select_best(moe, spec.select.per, spec.select.over) if spec.select else moe
    chosen = [key_of[r["config_id"]] for r in picked]
    base = [r for r in main if r["kind"] == "baseline"]
    chosen += [key_of[r["config_id"]] for r in base if not is_d2d(r)]
    d2d = [dict(r, family="d2d") for r in base if is_d2d(r)]
    chosen += [key_of[r["config_id"]] for r in P.select_best(d2d, ["family"], ["baseline"])]
    store.set_config_fields(
        {r["config_id"]: {"selected_for_distill": int(key_of[r["config_id"]] in chosen)} for r in main}
    )
    return chosen


def _summary(console: Console, reports: list[StageReport], store: Store, sid: int) -> int:
    t = Table(title="moesweep launch", show_lines=False)
    for col in ("stage", "jobs", "cached", "ran", "failed", "blocked", "stale"):
        t.add_column(col, justify="right" if col != "stage" else "left")
    failures = []
    for r in reports:
        if r.total:
            t.add_row(
                r.stage,
                str(r.total),
                str(r.cached),
                str(r.ran),
                str(len(r.failed)),
                str(r.blocked),
                str(r.stale),
            )
        failures += [(r.stage, k, e) for k, e in r.failed]
    console.print(t)
    console.print(f'results: {store.shown}   (try: moesweep sql "SELECT * FROM results")')
    blocked = sum(r.blocked for r in reports)
    if failures:
        console.print(
            f"[red]{len(failures)} job(s) failed[/] (moesweep status shows them; "
            "--retry-failed runs them again):"
        )
        for stage, key, err in failures[:20]:
            console.print(f"  {stage} {key[:12]}: {err}", highlight=False)
    if blocked:
        console.print(f"[red]{blocked} job(s) blocked[/]: a job they read did not succeed", highlight=False)
    return 1 if failures or blocked else 0
