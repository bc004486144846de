"""Everything a lent GPU machine should measure, in one command, as one table.

A GPU machine is lent rarely and briefly, with torch but nothing else of ours (the rest travels as wheels:
docs/development.md, "On a GPU machine"), so this runs the whole check in one go, each step and command
within its own time limit, a failure never stopping the later steps. The steps run in the order c, a, b:
the benchmarks first (the figures only a GPU gives: MFU, the KD loss against its FLOP time, the
pre-distillation evaluation against its FLOP time, calibration against raw matmul), so a budget too short for
everything cuts the grid, which has run on a GPU before, not them:

  a  every test sweep (tests/sweeps/*.yaml but fake.yaml, whose stages only the tests fake) through
     `moesweep launch --executor serial` in one temporary MOESWEEP_HOME (the tiny teachers are trained by
     the first sweep that needs them, then reused): per sweep ok/failed, jobs, wall time and the first
     failure's last line. The workers put every model on the GPU whenever torch sees one (there is no
     sweep setting for it); `--device cpu` hides it from them (CUDA_VISIBLE_DEVICES empty).
  b  the paper's 350-configuration grid (sweeps/paper-qwen3-30b-a3b.yaml) on a random-weight teacher of
     Qwen3-30B-A3B's real shapes cut to 4 layers (H 2048, 128 experts top-8, I 768, vocab 151936, bf16),
     built and saved here, through `moesweep launch` with `--set` overrides: that teacher, the tiny corpus
     as jsonl files (no network), 128 × 512 calibration tokens, 32 × 512 perplexity windows, one distilled
     student per scoring (6 steps), an ARC-format multiple-choice task cut from the corpus (16 items);
     per stage: jobs, seconds each, Σ compute.
  c  the benchmarks at real shapes: bench_calibration.py, bench_fsdp.py (8 layers, checkpointing,
     accumulation 8), bench_predistill.py, bench_kd_loss.py and bench_edited.py (--preset real), each
     with --device where it takes one; a script that is missing or refuses a flag is recorded "not run: <its line>".
  d  the table (step, item, status, figure, note) on stdout, and gpu-check.md, gpu-check.json and
     gpu-check.log (every command's output, tails) in --out (default $OUT when set, else report/gpu-check),
     headed by the date, the card, torch, transformers and the commit, the needed modules that do not import
     and the locked packages' requirements left unmet (both checked before the first step, in a child process).

`--budget` (default 540 s: a 10-minute command with time left to install the wheels) bounds the whole run;
a step or command that finds too little time left is recorded "not run" (run it again with `--only`);
`--budget 0` sets no limits at all. `--quick` runs smaller shapes (the micro sweep only; a 2-layer teacher
of 16 experts and K 4 and 16; each benchmark's --smoke). Without CUDA it refuses in one line, except
`--device cpu --quick` (a check of this script: tests/test_gpu_check.py). Exit code 1 when a row failed.

  python benchmarks/gpu_check.py --commit abc123          # on the GPU machine, from the repository root
  python benchmarks/gpu_check.py --only c,d --budget 0    # the benchmarks alone, no time limits
  .venv/bin/python benchmarks/gpu_check.py --device cpu --quick --only a,d --out /tmp/gc
  .venv/bin/python benchmarks/gpu_check.py --carry held.txt --wheels .whl --python 3.12   # here, before
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import importlib.util
import json
import math
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
STEPS = {"a": "test sweeps", "b": "paper grid", "c": "benchmarks", "d": "report"}
ORDER = ("c", "a", "b", "d")  # the measurements first (module docstring)
STEP_S = {"a": 180.0, "b": 260.0, "c": 360.0}  # each step's own limit (seconds), within --budget
SWEEP_S = 120.0  # one test sweep
TEACHER_S = 120.0  # building and saving the grid's teacher
MIN_S = 5.0  # a command is not started with less time than this left
SKIP_SWEEPS = {"fake": "its stage functions are faked by the orchestrator tests (no model to load)"}
GRID_SWEEP = "paper-qwen3-30b-a3b"
GRID_NAME = "gpu-check-grid"
STATUSES = ("ok", "failed", "timeout", "not run")
LOG_TAIL = 20_000  # characters of each command's stdout and stderr kept in gpu-check.log
# the modules the steps import beyond torch: one missing is named in the report's header
NEEDED = (
    "transformers",
    "yaml",
    "pydantic",
    "sqlalchemy",
    "alembic",
    "typer",
    "rich",
    "lm_eval",
    "datasets",
    "scipy",
)

# the grid's teacher: Qwen3-30B-A3B's layer shapes (its config.json), and --quick's
REAL = dict(
    layers=4,
    hidden=2048,
    heads=32,
    kv_heads=4,
    head_dim=128,
    experts=128,
    top_k=8,
    moe_intermediate=768,
    intermediate=6144,
    vocab=151936,
    corpus_chars=2_000_000,
    tok_vocab=4096,
)
QUICK = dict(
    layers=2,
    hidden=64,
    heads=4,
    kv_heads=2,
    head_dim=16,
    experts=16,
    top_k=2,
    moe_intermediate=32,
    intermediate=128,
    vocab=None,  # the tokenizer's
    corpus_chars=300_000,
    tok_vocab=512,
)
ARC_ITEMS = 64  # multiple-choice items built from the corpus' test split (evaluate.limit reads 16)


# ---- rows and the report --------------------------------------------------------------------------------
@dataclass
class Row:
    """One line of the table: a sweep, a stage of the grid, a benchmark."""

    step: str
    item: str
    status: str
    figure: str = ""
    note: str = ""
    data: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status={self.status!r}: allowed {', '.join(STATUSES)}")


EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b.*")


def one_line(text: str, limit: int = 240) -> str:
    """What went wrong, from a command's output or a job's error: the last exception line of a traceback
    with the lines that continue it (a wrapped one), else the last non-empty line; whitespace collapsed,
    cut to `limit`."""
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    hits = [i for i, ln in enumerate(lines) if EXCEPTION.match(ln)]
    picked = lines[hits[-1] : hits[-1] + 3] if hits else lines[-1:]
    line = " ".join(" ".join(picked).split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _finite(value: Any) -> Any:
    """`value` with NaN and ±infinity as None, in every dict and list (strict JSON)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def header_lines(meta: dict[str, Any]) -> list[str]:
    missing = meta.get("missing") or []
    conflicts = meta.get("conflicts") or []
    return [
        f"date: {meta.get('date', '?')} · card: {meta.get('card', '?')} · torch {meta.get('torch', '?')} · "
        f"transformers {meta.get('transformers', '?')} · python {meta.get('python', '?')} · "
        f"commit {meta.get('commit', '?')}",
        f"device {meta.get('device', '?')} · {'quick' if meta.get('quick') else 'full shapes'} · "
        f"steps {','.join(meta.get('steps', []))} · budget {meta.get('budget', '?')}"
        + (f" · wall {meta['wall_s']:.0f} s" if meta.get("wall_s") else "")
        + (f" · missing modules: {', '.join(missing)}" if missing else ""),
        *([f"unmet requirements: {'; '.join(conflicts)}"] if conflicts else []),
    ]


def markdown(meta: dict[str, Any], rows: list[Row]) -> str:
    """The report as markdown: a title, two lines of facts, one table."""
    lines = ["# GPU check", "", *(f"{ln}  " for ln in header_lines(meta)), ""]
    lines += ["| step | item | status | figure | note |", "| --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(
            f"| {r.step} | {_cell(r.item)} | {_cell(r.status)} | {_cell(r.figure)} | {_cell(r.note)} |"
        )
    counts = {s: sum(r.status == s for r in rows) for s in STATUSES}
    lines += ["", "rows: " + ", ".join(f"{n} {s}" for s, n in counts.items() if n)]
    return "\n".join(lines) + "\n"


def report_json(meta: dict[str, Any], rows: list[Row]) -> str:
    doc = {**meta, "rows": [asdict(r) for r in rows]}
    return json.dumps(_finite(doc), indent=1, allow_nan=False) + "\n"


# ---- running commands -----------------------------------------------------------------------------------
@dataclass
class Done:
    """What a command did: exit code (None when it was killed at its limit), output, seconds."""

    rc: int | None
    out: str
    err: str
    wall: float
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.rc == 0

    def problem(self) -> str:
        """Its last line on stderr (else stdout) for a failure; the limit for a command killed there."""
        if self.timed_out:
            return f"killed at its limit of {self.wall:.0f} s"
        return one_line(self.err) or one_line(self.out) or f"exit code {self.rc}"


class Context:
    """What the steps share: the device, the sizes, the temporary folder, the time left, the log."""

    def __init__(
        self, device: str, quick: bool, work: Path, budget: float | None, sweeps: list[str] | None = None
    ) -> None:
        self.device, self.quick, self.work, self.sweeps = device, quick, work, sweeps
        self.start = time.monotonic()
        self.deadline = None if not budget else self.start + budget
        self.step_deadline: float | None = None
        self.log: list[str] = []

    def left(self) -> float:
        """Seconds left to the current step (its own limit and the overall budget)."""
        ends = [d for d in (self.deadline, self.step_deadline) if d is not None]
        return min(ends) - time.monotonic() if ends else math.inf

    def limit(self, cap: float) -> float | None:
        """A command's limit: `cap`, or less when less is left; None when too little is left to start one.
        Without a budget there are no limits (infinity)."""
        if self.deadline is None:
            return math.inf
        left = self.left()
        return None if left < MIN_S else min(cap, left)

    def env(self, home: Path | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MOESWEEP_")}
        paths = [str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
        env.update(
            PYTHONPATH=os.pathsep.join(paths),
            PYTHONUNBUFFERED="1",
            HF_HUB_OFFLINE="1",
            HF_DATASETS_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            TOKENIZERS_PARALLELISM="false",
        )
        if home is not None:
            env["MOESWEEP_HOME"] = str(home)
        if self.device == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""  # the workers and benchmarks pick CUDA whenever torch sees it
        return env

    def run(self, label: str, cmd: list[str], timeout: float, env: dict[str, str], cwd: Path = ROOT) -> Done:
        """`cmd` in a process group of its own, killed with its children at `timeout` seconds."""
        logs = self.work / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        safe = re.sub(r"[^A-Za-z0-9_.-]+", "-", label)
        out_p, err_p = logs / f"{safe}.out", logs / f"{safe}.err"
        t0 = time.monotonic()
        with out_p.open("wb") as fo, err_p.open("wb") as fe:
            p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=fo, stderr=fe, start_new_session=True)
            timed_out = False
            try:
                p.wait(timeout=None if math.isinf(timeout) else timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:  # at its limit, interrupted, or ended: nothing it started outlives it
                with_group(p.pid, signal.SIGKILL)
                p.wait()
        wall = time.monotonic() - t0
        out = out_p.read_text(errors="replace")
        err = err_p.read_text(errors="replace")
        done = Done(None if timed_out else p.returncode, out, err, wall, timed_out)
        self.log.append(
            f"===== {label}: {' '.join(cmd)}\n"
            f"exit {'killed at the limit' if timed_out else p.returncode} after {wall:.1f} s\n"
            f"--- stdout (tail)\n{out[-LOG_TAIL:]}\n--- stderr (tail)\n{err[-LOG_TAIL:]}\n"
        )
        return done


def with_group(pid: int, sig: int) -> None:
    """Send `sig` to the process group `pid` leads (one this script started), if it is still there."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class GpuPeak:
    """The largest GPU memory in use (nvidia-smi, every 0.5 s, all processes) while the block runs;
    None without nvidia-smi or on `--device cpu`."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.peak_mib: float | None = None
        self._p: subprocess.Popen | None = None
        self._t: threading.Thread | None = None

    def __enter__(self) -> GpuPeak:
        smi = shutil.which("nvidia-smi")
        if self.device != "cuda" or smi is None:
            return self
        cmd = [smi, "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0", "-lms", "500"]
        try:
            self._p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            return self
        self._t = threading.Thread(target=self._read, daemon=True)
        self._t.start()
        return self

    def _read(self) -> None:
        assert self._p is not None and self._p.stdout is not None
        for line in self._p.stdout:
            try:
                mib = float(line.strip())
            except ValueError:
                continue
            self.peak_mib = mib if self.peak_mib is None else max(self.peak_mib, mib)

    def __exit__(self, *exc: object) -> None:
        if self._p is not None:
            self._p.terminate()
            try:
                self._p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._p.kill()
                self._p.wait()
        if self._t is not None:
            self._t.join(timeout=5)

    def note(self) -> str:
        return "" if self.peak_mib is None else f"GPU memory peak {self.peak_mib / 1024:.1f} GiB (nvidia-smi)"


def moesweep(*args: str) -> list[str]:
    """The `moesweep` command (orchestrator.cli's app) run by this Python: the GPU machine has the project
    on PYTHONPATH, not installed."""
    return [sys.executable, "-c", "from orchestrator.cli import app; app()", *args]


def join(*parts: str) -> str:
    return "; ".join(p for p in parts if p)


# ---- what a sweep left in its database ----------------------------------------------------------------
def sweep_facts(db: Path, name: str) -> dict[str, Any]:
    """Jobs of sweep `name` per stage (launch order) and status, with compute seconds, and its failures'
    last lines, read from the SQLite file the launch wrote. Empty when there is no such file or sweep."""
    facts: dict[str, Any] = {"stages": [], "failures": [], "configurations": 0, "grid": 0}
    if not db.is_file():
        return facts
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        sid = con.execute("SELECT id FROM sweeps WHERE name = ?", (name,)).fetchone()
        if sid is None:
            return facts
        rows = con.execute(
            "SELECT j.stage, j.status, COUNT(*), SUM(j.compute_s), MAX(j.compute_s), "
            "MIN(COALESCE(st.position, 999)) FROM jobs j JOIN sweep_jobs sj ON sj.job_id = j.id "
            "LEFT JOIN stages st ON st.name = j.stage WHERE sj.sweep_id = ? GROUP BY j.stage, j.status "
            "ORDER BY 6, 1, 2",
            (sid[0],),
        ).fetchall()
        stages: dict[str, dict[str, Any]] = {}
        for stage, status, n, total, longest, _ in rows:
            s = stages.setdefault(stage, {"stage": stage, "jobs": 0, "by_status": {}, "compute_s": 0.0})
            s["jobs"] += n
            s["by_status"][status] = n
            if status == "succeeded":
                s["compute_s"] += total or 0.0
                s["longest_s"] = longest
        facts["stages"] = list(stages.values())
        facts["failures"] = [
            {"stage": stage, "error": one_line(error or "") or "(no error recorded)"}
            for stage, error in con.execute(
                "SELECT j.stage, j.error FROM jobs j JOIN sweep_jobs sj ON sj.job_id = j.id "
                "WHERE sj.sweep_id = ? AND j.status = 'failed' ORDER BY j.finished_at, j.id",
                (sid[0],),
            )
        ]
        facts["configurations"], facts["grid"] = con.execute(
            "SELECT COUNT(*), COALESCE(SUM(kind = 'moe2dense'), 0) FROM configurations WHERE sweep_id = ?",
            (sid[0],),
        ).fetchone()
    finally:
        con.close()
    return facts


def jobs_figure(facts: dict[str, Any]) -> tuple[int, int]:
    """(jobs, succeeded) over every stage."""
    jobs = sum(s["jobs"] for s in facts["stages"])
    ok = sum(s["by_status"].get("succeeded", 0) for s in facts["stages"])
    return jobs, ok


def launch_row(step: str, item: str, done: Done, facts: dict[str, Any], peak: GpuPeak) -> Row:
    """A launch's row: ok only when it exited 0 and every job of the sweep succeeded."""
    jobs, ok = jobs_figure(facts)
    failures = facts["failures"]
    first = f"{failures[0]['stage']}: {failures[0]['error']}" if failures else ""
    if done.timed_out:
        status, note = "timeout", join(done.problem(), first)
    elif failures:
        status, note = "failed", f"{len(failures)} failed job(s), first {first}"
    elif not done.ok:
        status, note = "failed", done.problem()
    elif not jobs or ok < jobs:
        status, note = "failed", f"{jobs - ok} of {jobs} jobs neither succeeded nor failed"
    else:
        status, note = "ok", ""
    figure = f"{ok}/{jobs} jobs succeeded in {done.wall:.1f} s" if jobs else f"no jobs ({done.wall:.1f} s)"
    data = {"wall_s": round(done.wall, 2), "rc": done.rc, "jobs": jobs, "succeeded": ok, **facts}
    if peak.peak_mib is not None:
        data["gpu_peak_mib"] = peak.peak_mib
    return Row(step, item, status, figure, join(note, peak.note()), data)


# ---- a: the test sweeps ----------------------------------------------------------------------------------
def sweep_names() -> list[str]:
    """tests/sweeps/*.yaml by name: micro first (it trains the teachers the others reuse), crash last (a
    smaller micro for the kill tests: the first to give way when time runs short)."""
    names = sorted(p.stem for p in (ROOT / "tests" / "sweeps").glob("*.yaml"))
    return sorted(names, key=lambda n: (n != "micro", n == "crash"))


def step_sweeps(ctx: Context) -> list[Row]:
    names = ctx.sweeps or (["micro"] if ctx.quick else sweep_names())
    home = ctx.work / "home-sweeps"
    rows = []
    for name in names:
        path = ROOT / "tests" / "sweeps" / f"{name}.yaml"
        item = f"sweep {name}"
        if name in SKIP_SWEEPS:
            rows.append(Row("a", item, "not run", note=SKIP_SWEEPS[name]))
            continue
        if not path.is_file():
            rows.append(Row("a", item, "not run", note=f"no tests/sweeps/{name}.yaml"))
            continue
        limit = ctx.limit(SWEEP_S)
        if limit is None:
            rows.append(Row("a", item, "not run", note="the time for this step was spent"))
            continue
        with GpuPeak(ctx.device) as peak:
            done = ctx.run(
                f"a-{name}", moesweep("launch", str(path), "--executor", "serial"), limit, ctx.env(home)
            )
        rows.append(launch_row("a", item, done, sweep_facts(home / "moesweep.db", name), peak))
        print_row(rows[-1])
    return rows


# ---- b: the paper grid on a teacher of real shapes --------------------------------------------------------
def teacher_config(s: dict[str, Any], tok: Any = None):
    """The grid teacher's Qwen3-MoE config: shapes `s` (REAL or QUICK), the vocabulary of `tok` where `s`
    names none, and its special token ids."""
    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.insert(0, str(ROOT / "benchmarks"))
    from common import qwen3_moe_config  # benchmarks/common.py, beside this script

    return qwen3_moe_config(
        **{k: v for k, v in s.items() if k not in ("vocab", "corpus_chars", "tok_vocab")},
        vocab=s["vocab"] or len(tok),
        tokenizer=tok,
        tie_word_embeddings=False,
        max_position_embeddings=4096,
    )


def make_teacher(out: Path, quick: bool, device: str) -> dict[str, Any]:
    """A random-weight Qwen3-MoE teacher saved to out/teacher with the tiny corpus' tokenizer, and the data
    the grid reads: the corpus' jsonl splits and out/arc/test.jsonl, an ARC-format multiple-choice task
    cut from the test split (the question: a document's first words; the answer: the next words; the
    distractors: the same span of other documents). Returns what the grid's overrides need."""
    sys.path.insert(0, str(ROOT))
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from workers.core.tiny_corpus import read_split
    from workers.tiny.spec import TinyTeacherSpec
    from workers.tiny.teacher import prepare_data

    s = QUICK if quick else REAL
    t0 = time.perf_counter()
    d = prepare_data(TinyTeacherSpec(corpus_chars=s["corpus_chars"], vocab=s["tok_vocab"]))
    tok = AutoTokenizer.from_pretrained(d["tokenizer_dir"])
    data_s = time.perf_counter() - t0
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    cfg = teacher_config(s, tok)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    if device == "cuda":
        torch.cuda.synchronize()
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    model.save_pretrained(out / "teacher")
    tok.save_pretrained(out / "teacher")
    save_s = time.perf_counter() - t0
    corpus = Path(d["corpus_dir"])
    docs = [r["text"].split() for r in read_split(corpus, "test")]
    docs = [w for w in docs if len(w) >= 40][:ARC_ITEMS]
    if len(docs) < 4:
        raise ValueError(f"corpus_chars={s['corpus_chars']}: too few test documents for the ARC-format task")
    (out / "arc").mkdir(parents=True, exist_ok=True)
    with (out / "arc" / "test.jsonl").open("w", encoding="utf-8") as f:
        for i, words in enumerate(docs):
            spans = [" ".join(docs[(i + j) % len(docs)][24:32]) for j in range(4)]
            answer = i % 4
            spans[0], spans[answer] = spans[answer], spans[0]
            row = {
                "id": f"q{i}",
                "question": " ".join(words[:24]),
                "choices": {"text": spans, "label": list("ABCD")},
                "answerKey": "ABCD"[answer],
            }
            f.write(json.dumps(row) + "\n")
    return {
        "dir": str(out / "teacher"),
        "corpus": str(corpus),
        "arc": str(out / "arc" / "test.jsonl"),
        "dtype": "bfloat16" if dtype == torch.bfloat16 else "float32",
        "experts": s["experts"],
        "top_k": s["top_k"],
        "layers": s["layers"],
        "vocab": cfg.vocab_size,
        "params": sum(p.numel() for p in model.parameters()),
        "bytes": sum(f.stat().st_size for f in (out / "teacher").glob("*.safetensors")),
        "data_s": round(data_s, 2),
        "build_s": round(build_s, 2),
        "save_s": round(save_s, 2),
    }


def grid_overrides(t: dict[str, Any], quick: bool) -> list[str]:
    """`--set` overrides that run sweeps/paper-qwen3-30b-a3b.yaml's grid (scorings × groupings × scalings;
    its K, or 4 and 16 with --quick) on the saved teacher, offline and small."""
    seq, n_cal, windows, steps = (64, 16, 8, 2) if quick else (512, 128, 32, 6)
    corpus = Path(t["corpus"])

    def jsonl(split: str) -> dict[str, str]:
        return {"source": "jsonl", "path": str(corpus / f"{split}.jsonl")}

    sets: dict[str, Any] = {
        "name": GRID_NAME,
        "teacher": {
            "source": "hf",
            "model": t["dir"],
            "dtype": t["dtype"],
            "num_experts": t["experts"],
            "top_k": t["top_k"],
        },
        "dense_teacher": None,  # the d2d baseline's Qwen3-32B: not offline
        "calibration": {"data": jsonl("train"), "n_samples": n_cal, "seq_len": seq, "batch_size": 8},
        "ppl": {"data": jsonl("test"), "seq_len": seq, "batch_size": 8, "max_windows": windows},
        "select": {"best_by": "ppl_pre", "per": ["scoring"], "over": ["grouping", "K", "dp_scaling"]},
        "distill": {
            "settings": {
                "steps": steps,
                "batch_size": 4,
                "seq_len": seq,
                "lr": 1.0e-4,
                "min_lr": 1.0e-5,
                "warmup": 1,
                "eval_every": max(1, steps // 2),
                "val_windows": 4,
                "dtype": "auto",
                "grad_checkpoint": True,
            },
            "data": jsonl("train"),
            "val_data": jsonl("valid"),
        },
        "evaluate": {
            "suite": [{"task": "arc_easy", "num_fewshot": 0, "data_files": t["arc"], "limit": 16}],
            "batch_size": 16,
        },
        "baselines": ["teacher", "random_ffn"],
        "execution": {"retries": 0},
    }
    if quick:
        sets["grid.K"] = [4, 16]
    return [f"{k}={flow(v)}" for k, v in sets.items()]


def flow(v: Any) -> str:
    """`v` as a YAML flow value: JSON, but a float always with a dot (PyYAML reads 1e-05 as a string)."""
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))}: {flow(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list | tuple):
        return "[" + ", ".join(flow(x) for x in v) + "]"
    if isinstance(v, float) and math.isfinite(v):
        mantissa, e, exponent = repr(v).partition("e")
        return (mantissa if "." in mantissa else mantissa + ".0") + e + exponent
    return json.dumps(v)


def step_grid(ctx: Context) -> list[Row]:
    rows: list[Row] = []
    home = ctx.work / "home-grid"
    out = ctx.work / "grid"
    limit = ctx.limit(TEACHER_S)
    if limit is None:
        return [Row("b", "grid teacher", "not run", note="the time for this step was spent")]
    cmd = [sys.executable, str(Path(__file__).resolve()), "--make-teacher", str(out), "--device", ctx.device]
    done = ctx.run("b-teacher", cmd + (["--quick"] if ctx.quick else []), limit, ctx.env(home))
    made = last_json(done.out)
    if not done.ok or made is None:
        status = "timeout" if done.timed_out else "failed"
        rows.append(Row("b", "grid teacher", status, note=done.problem()))
        rows.append(Row("b", "grid launch", "not run", note="no teacher"))
        return rows
    rows.append(
        Row(
            "b",
            "grid teacher",
            "ok",
            f"built in {made['build_s']:.1f} s, saved in {made['save_s']:.1f} s",
            f"{made['layers']} layers, {made['experts']} experts top-{made['top_k']}, vocab {made['vocab']}, "
            f"{size(made['params'])} params, {size(made['bytes'])}B {made['dtype']}; "
            f"corpus and tokenizer {made['data_s']:.1f} s",
            made,
        )
    )
    print_row(rows[-1])
    limit = ctx.limit(STEP_S["b"])
    if limit is None:
        rows.append(Row("b", "grid launch", "not run", note="the time for this step was spent"))
        return rows
    sets = [a for o in grid_overrides(made, ctx.quick) for a in ("--set", o)]
    with GpuPeak(ctx.device) as peak:
        done = ctx.run(
            "b-launch", moesweep("launch", GRID_SWEEP, "--executor", "serial", *sets), limit, ctx.env(home)
        )
    facts = sweep_facts(home / "moesweep.db", GRID_NAME)
    row = launch_row("b", "grid launch", done, facts, peak)
    if facts["grid"]:
        row.figure = f"{facts['grid']} configurations: {row.figure}"
    rows.append(row)
    print_row(row)
    for s in facts["stages"]:
        ok = s["by_status"].get("succeeded", 0)
        failed = s["by_status"].get("failed", 0)
        other = s["jobs"] - ok - failed
        status = "ok" if ok == s["jobs"] else "failed" if failed else "not run"
        each = s["compute_s"] / ok if ok else 0.0
        figure = f"{ok} jobs, {each:.3f} s each" if ok else "no job succeeded"
        note = join(
            f"Σ {s['compute_s']:.1f} s compute" if ok else "",
            f"{failed} failed" if failed else "",
            f"{other} not finished" if other else "",
        )
        rows.append(Row("b", f"grid stage {s['stage']}", status, figure, note, s))
        print_row(rows[-1])
    return rows


def size(n: float) -> str:
    """1.23 G, 45.6 M, 789 k."""
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} "


def last_json(text: str) -> dict[str, Any] | None:
    """The last line of `text` that is a JSON object."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(value, dict):
                return value
    return None


# ---- c: the benchmarks -------------------------------------------------------------------------------------
Parsed = tuple[str, str, dict[str, Any]]  # figure, note, numbers


def _num(pattern: str, text: str) -> float | None:
    m = re.search(pattern, text, flags=re.MULTILINE)
    return float(m.group(1)) if m else None


def parse_calibration(out: str) -> Parsed:
    d = {
        "loop_over_batched": _num(r"^loop / batched\s*:\s*([\d.]+)x", out),
        "raw_throughput_pct": _num(r"^batched / raw throughput\s*:\s*([\d.]+)%", out),
        "collect_over_forward": _num(r"^collect_stats / forward\s*:\s*([\d.]+)x", out),
        "peak_gib": _num(r"^peak GPU memory\s*:\s*([\d.]+) GiB", out),
        "previous_raw_pct": _num(r"^previous / raw\s*:\s*([\d.]+)%", out),
        "traffic_ratio": _num(r"^non-matmul traffic/token:.*\(([\d.]+)x less now\)", out),
    }
    if d["raw_throughput_pct"] is None:
        return generic(out)
    figure = f"batched {d['raw_throughput_pct']:.1f}% of raw matmul, {d['loop_over_batched']:.2f}× the loop"
    note = join(
        f"previous pass {d['previous_raw_pct']:.1f}%" if d["previous_raw_pct"] is not None else "",
        f"non-matmul traffic {d['traffic_ratio']:.2f}× less" if d["traffic_ratio"] is not None else "",
        f"collect_stats {d['collect_over_forward']:.2f}× a forward" if d["collect_over_forward"] else "",
        f"peak {d['peak_gib']:.1f} GiB" if d["peak_gib"] is not None else "",
    )
    return figure, note, d


# its JSON line's keys the figure shows, or that only repeat the command's settings; the others go in the note
FSDP_SHOWN = {
    "tokens_per_s",
    "mfu",
    "peak_gb_per_rank",
    "model_gb_per_rank",
    "step_s",
    "loss_curve",
    "device",
}
FSDP_SETTINGS = {"ranks", "layers", "seq_len", "sequences_per_rank", "accum", "grad_accum", "steps"}


def parse_fsdp(out: str) -> Parsed:
    d = last_json(out)
    if d is None or "tokens_per_s" not in d:
        return generic(out)
    mfu = d.get("mfu")
    figure = f"{d['tokens_per_s']:,.0f} tokens/s" + (f", MFU {100 * mfu:.1f}%" if mfu is not None else "")
    peak = d.get("peak_gb_per_rank")
    extra = [f"{k} {compact(v)}" for k, v in d.items() if k not in FSDP_SHOWN | FSDP_SETTINGS and numeric(v)]
    note = join(
        f"peak {max(peak):.1f} GB vs model {d.get('model_gb_per_rank')} GB" if peak else "",
        f"step {d['step_s']} s" if "step_s" in d else "",
        ", ".join(extra),
    )
    return figure, note, {k: v for k, v in d.items() if k != "loss_curve"}


def parse_predistill(out: str) -> Parsed:
    ratio = _num(r"^naive / in-memory, per configuration.*?:\s*([\d.]+)x", out)
    dppl = _num(r"^max relative \|Δppl\|.*?:\s*([\d.eE+-]+)", out)
    if ratio is None:
        return generic(out)
    m = re.search(r"^json\s*:\s*(\{.*\})\s*$", out, flags=re.MULTILINE)
    d: dict[str, Any] = json.loads(m.group(1)) if m else {}
    d.update(ratio=ratio, max_rel_dppl=dppl)
    return f"{ratio:.1f}× naive / in-memory", f"max |Δppl| {dppl:.1e}" if dppl is not None else "", d


def numeric(v: Any) -> bool:
    if isinstance(v, bool):
        return False
    if isinstance(v, int | float):
        return True
    return isinstance(v, dict) and bool(v) and all(numeric(x) for x in v.values())


def compact(v: Any) -> str:
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} {compact(x)}" for k, x in v.items()) + "}"
    return f"{v:.4g}" if isinstance(v, float) else str(v)


RATIO_LINE = re.compile(r"^\s*([^\s:][^:]{1,70}?)\s*:\s*(-?[\d.,]+\s*(?:x|×|%)).*$", re.MULTILINE)


def generic(out: str) -> Parsed:
    """A script this one does not know the output of: its ratio lines ("name : 1.23x"), else its JSON line,
    else its last line."""
    hits = [f"{m.group(1)} {m.group(2).replace(' ', '')}" for m in RATIO_LINE.finditer(out)]
    if hits:
        return hits[0], "; ".join(hits[1:4]), {"ratios": hits}
    d = last_json(out)
    if d is not None:
        shown = [f"{k} {compact(v)}" for k, v in d.items() if numeric(v)]
        return ", ".join(shown[:2]), ", ".join(shown[2:6]), d
    return one_line(out), "", {}


@dataclass(frozen=True)
class Bench:
    script: str
    full: tuple[str, ...]
    parse: Callable[[str], Parsed]
    cap: float  # seconds


BENCHES = (
    Bench("bench_calibration", ("--preset", "real"), parse_calibration, 120.0),
    Bench(
        "bench_fsdp",
        ("--preset", "real", "--layers", "8", "--checkpointing", "--accum", "8"),
        parse_fsdp,
        150.0,
    ),
    Bench("bench_predistill", ("--preset", "real"), parse_predistill, 120.0),
    Bench("bench_kd_loss", ("--preset", "real"), generic, 90.0),
    Bench("bench_edited", ("--preset", "real"), generic, 90.0),
)
REFUSED = re.compile(r"error: (unrecognized arguments|argument |the following arguments|invalid choice)")


def run_bench(ctx: Context, b: Bench, folder: Path = ROOT / "benchmarks") -> Row:
    """One benchmark: its full command (or --smoke with --quick), --device where the script takes one."""
    script = folder / f"{b.script}.py"
    item = f"{b.script}.py"
    if not script.is_file():
        return Row("c", item, "not run", note=f"no {script.name} in {folder.name}/")
    args = ["--smoke"] if ctx.quick else list(b.full)
    if '"--device"' in script.read_text(encoding="utf-8", errors="replace"):
        args += ["--device", ctx.device]
    shown = " ".join([script.name, *args])
    limit = ctx.limit(b.cap)
    if limit is None:
        return Row("c", item, "not run", note=f"{shown}: the time for this step was spent")
    cwd = ctx.work / f"c-{b.script}"  # its caches and files stay out of the checkout
    cwd.mkdir(parents=True, exist_ok=True)
    with GpuPeak(ctx.device) as peak:
        done = ctx.run(
            f"c-{b.script}", [sys.executable, str(script), *args], limit, ctx.env(cwd / "home"), cwd
        )
    if done.rc == 2 and REFUSED.search(done.err):
        return Row("c", item, "not run", note=f"{shown}: {one_line(done.err)}")
    if not done.ok:
        status = "timeout" if done.timed_out else "failed"
        return Row("c", item, status, note=f"{shown}: {done.problem()}", data={"wall_s": round(done.wall, 2)})
    figure, note, data = b.parse(done.out)
    data = {**data, "wall_s": round(done.wall, 2), "command": shown, "gpu_peak_mib": peak.peak_mib}
    seen = "" if "peak" in note else peak.note()  # the script's own peak when it prints one
    return Row("c", item, "ok", figure, join(note, seen, f"{done.wall:.0f} s", shown), data)


def step_benchmarks(ctx: Context) -> list[Row]:
    rows = []
    for b in BENCHES:
        rows.append(run_bench(ctx, b))
        print_row(rows[-1])
    return rows


# ---- the wheels a GPU machine needs ----------------------------------------------------------------------
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)")
# never carried: the machine's own torch; Ray (the check runs the serial executor); the development tools
NOT_CARRIED = {"torch", "ray", "pytest", "ruff", "uv", "selenium", "psycopg", "psycopg-binary"}
ALWAYS_CARRIED = {"transformers"}  # its version is part of every job key and picks the experts' kernels


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def ours(lock: str) -> list[tuple[str, str]]:
    """(name, version) of each locked package (requirements/lock.txt's text) a GPU machine may lack: all but
    NOT_CARRIED."""
    pins = [m for m in map(PIN.match, lock.splitlines()) if m is not None]
    return [(m[1], m[2]) for m in pins if canonical(m[1]) not in NOT_CARRIED]


def carry_pins(lock: str, have: str) -> list[str]:
    """`NAME==VERSION` of the locked packages (requirements/lock.txt's text) a GPU machine must be given as
    wheels, from what it holds (`pip list --format=freeze` lines, or bare names): the ones it lacks, and
    transformers unless it holds the locked version. What it holds at another version stays its own: a
    carried copy would shadow the build its other packages were compiled against (numpy, for one)."""
    held: dict[str, str | None] = {}
    for line in have.splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            held[canonical(name.strip())] = version.strip() or None
    pins = []
    for name, version in ours(lock):
        key = canonical(name)
        if key not in held or (key in ALWAYS_CARRIED and held[key] != version):
            pins.append(f"{name}=={version}")
    return pins


PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
)  # a x86-64 Linux GPU box


def fetch_wheels(
    pins: list[str], folder: Path, python: str, run: Callable[..., Any] = subprocess.run
) -> tuple[list[str], list[str]]:
    """Each pin as a wheel in `folder` for CPython `python` (e.g. "3.12") on x86-64 Linux, downloaded as
    published, else built here from its source distribution (`pip wheel`: right for pure-Python packages,
    which is what lacks a wheel among ours). (pins built from source, pins that failed)."""
    folder.mkdir(parents=True, exist_ok=True)
    where = [f"--platform={p}" for p in PLATFORMS]
    pip = [sys.executable, "-m", "pip"]
    built, failed = [], []
    for pin in pins:
        download = [*pip, "download", "-q", "--no-deps", "--only-binary=:all:", f"--python-version={python}"]
        got = run([*download, "--implementation=cp", *where, "-d", str(folder), pin], capture_output=True)
        if got.returncode == 0:
            continue
        made = run([*pip, "wheel", "-q", "--no-deps", "-w", str(folder), pin], capture_output=True)
        (built if made.returncode == 0 else failed).append(pin)
    return built, failed


# ---- the whole check -------------------------------------------------------------------------------------
def print_row(r: Row) -> None:
    print(
        f"[{r.step}] {r.item}: {r.status}" + "".join(f" · {x}" for x in (r.figure, r.note) if x), flush=True
    )


def run_steps(
    ctx: Context, steps: list[tuple[str, Callable[[Context], list[Row]]]], caps: dict[str, float] = STEP_S
) -> list[Row]:
    """Each step within its own limit; one that raises is a failed row, and the next one runs."""
    rows: list[Row] = []
    for letter, fn in steps:
        if ctx.deadline is not None and ctx.deadline - time.monotonic() < MIN_S:
            rows.append(Row(letter, STEPS.get(letter, letter), "not run", note="the --budget was spent"))
            continue
        if ctx.deadline is not None:  # without a budget a step runs to its end
            ctx.step_deadline = time.monotonic() + caps.get(letter, math.inf)
        try:
            rows += fn(ctx)
        except Exception as e:  # a step's own bug must not cost the steps after it
            rows.append(
                Row(
                    letter,
                    STEPS.get(letter, letter),
                    "failed",
                    note=f"{type(e).__name__}: {' '.join(str(e).split())}"[:240],
                )
            )
            print_row(rows[-1])
        finally:
            ctx.step_deadline = None
    return rows


PROBE = """
import json, sys
sys.path.insert(0, sys.argv[2])
import gpu_check
print(json.dumps(gpu_check.environment(sys.argv[1], json.loads(sys.argv[3]), json.loads(sys.argv[4]))))
"""


def environment(device: str, modules: list[str], dists: list[str]) -> dict[str, Any]:
    """What the probe reports, computed in its child: Python, torch, the card, transformers, the needed
    modules that cannot be imported (with why), and the requirements the installed packages do not meet."""
    import platform

    import torch

    d: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__}
    d["cuda"] = torch.cuda.is_available()
    d["card"] = torch.cuda.get_device_name() if d["cuda"] and device == "cuda" else None
    try:
        import transformers

        d["transformers"] = transformers.__version__
    except Exception as e:
        d["transformers"] = f"not importable ({type(e).__name__})"
    d["missing"] = unimportable(modules)
    d["conflicts"] = requirement_conflicts(dists)
    return d


def unimportable(modules: list[str]) -> list[str]:
    """The modules that do not import here: the name alone where it is absent, else the name and the error's
    line (a carried wheel installed beside the machine's own packages may find one too old)."""
    out = []
    for m in modules:
        if importlib.util.find_spec(m) is None:
            out.append(m)
            continue
        try:
            importlib.import_module(m)
        except Exception as e:  # whatever it raises, the report names it in one line
            out.append(f"{m} ({type(e).__name__}: {' '.join(str(e).split())[:120]})")
    return out


def requirement_conflicts(dists: list[str]) -> list[str]:
    """The requirements of the installed distributions among `dists` (extras aside, markers evaluated here)
    that this environment does not meet, e.g. "datasets 5.2.0 needs pyarrow>=24.0.0, has 19.0.1": wheels
    installed with --no-deps next to a machine's own packages are checked as `pip check` would, for ours
    alone (the machine's other packages are not this check's business)."""
    from importlib import metadata

    try:
        from packaging.requirements import InvalidRequirement, Requirement
    except ImportError:
        return ["not checked: the packaging module is missing"]
    out = set()
    for name in dists:
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        for text in dist.requires or []:
            try:
                req = Requirement(text)
            except InvalidRequirement:
                continue
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            who = f"{dist.metadata['Name'] or name} {dist.version} needs {req.name}{req.specifier}"
            try:
                have = metadata.version(req.name)
            except metadata.PackageNotFoundError:
                out.add(f"{who}, absent")
                continue
            if not req.specifier.contains(have, prereleases=True):
                out.add(f"{who}, has {have}")
    return sorted(out)


def probe(device: str) -> dict[str, Any]:
    """`environment` as a child process sees it (so this process never holds a CUDA context while the steps
    measure), checking the needed modules and the locked packages' requirements."""
    lock = (ROOT / "requirements" / "lock.txt").read_text(encoding="utf-8")
    dists = [name for name, _ in ours(lock)]
    here = str(Path(__file__).resolve().parent)
    cmd = [sys.executable, "-c", PROBE, device, here, json.dumps(NEEDED), json.dumps(dists)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    got = last_json(r.stdout)
    if r.returncode != 0 or got is None:
        raise SystemExit(f"gpu_check: torch could not be imported: {one_line(r.stderr) or r.returncode}")
    return got


def commit() -> str:
    """The checked-out commit ("+changes" when the tree differs from it), or "unknown" without git."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=30
        )
        if head.returncode != 0:
            return "unknown (no git checkout)"
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout.strip()
        return head.stdout.strip() + (" +changes" if dirty else "")
    except (OSError, subprocess.TimeoutExpired):
        return "unknown (no git)"


def refuse(message: str) -> None:
    """One line on stderr, exit 2."""
    print(f"gpu_check: {message}", file=sys.stderr)
    raise SystemExit(2)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="a,b,c,d", help="steps to run, comma-separated from a, b, c, d")
    ap.add_argument("--quick", action="store_true", help="smaller shapes (a check of the script, minutes)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument(
        "--out", type=Path, default=None, help="output folder (default: $OUT, else report/gpu-check)"
    )
    ap.add_argument(
        "--budget",
        type=float,
        default=540.0,
        help="seconds for the whole run, within which each step and command has its own limit; "
        "0: no limits at all (default 540)",
    )
    ap.add_argument("--sweeps", default=None, help="step a: these test sweeps (comma-separated names)")
    ap.add_argument(
        "--commit", default=None, help="the commit to report (default: git's, where there is git)"
    )
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder (homes, teacher, logs)")
    ap.add_argument(
        "--carry",
        type=Path,
        default=None,
        metavar="HELD",
        help="print the locked packages to carry as wheels to a machine that holds the packages HELD lists "
        "(its `pip list --format=freeze`, or names one a line), one NAME==VERSION a line, and exit",
    )
    ap.add_argument(
        "--wheels",
        type=Path,
        default=None,
        metavar="DIR",
        help="with --carry: also put those packages in DIR as wheels for the machine's Python (--python)",
    )
    ap.add_argument(
        "--python",
        default="3.12",
        help="with --wheels: the GPU machine's Python version, MAJOR.MINOR (default 3.12)",
    )
    ap.add_argument("--make-teacher", type=Path, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    steps = [s.strip() for s in a.only.split(",") if s.strip()]
    bad = [s for s in steps if s not in STEPS]
    if bad or not steps:
        refuse(f"--only {a.only!r}: allowed steps a, b, c, d (comma-separated)")
    a.steps = [s for s in ORDER if s in steps]
    if a.budget < 0 or not math.isfinite(a.budget):
        refuse(f"--budget {a.budget:g}: allowed a number of seconds >= 0 (0: no limit)")
    if a.device == "cpu" and not a.quick and a.make_teacher is None and a.carry is None:
        refuse("--device cpu: only with --quick (the real shapes would take hours on a CPU)")
    if a.wheels is not None and a.carry is None:
        refuse("--wheels: only with --carry HELD (which packages to fetch)")
    if not re.fullmatch(r"3\.\d+", a.python):
        refuse(f"--python {a.python!r}: allowed a CPython version MAJOR.MINOR, e.g. 3.12")
    a.sweeps = [s.strip() for s in a.sweeps.split(",") if s.strip()] if a.sweeps else None
    if a.out is None:
        a.out = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "report" / "gpu-check"
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.carry is not None:
        if not a.carry.is_file():
            refuse(f"--carry {a.carry}: no such file (the machine's `pip list --format=freeze`)")
        lock = (ROOT / "requirements" / "lock.txt").read_text(encoding="utf-8")
        pins = carry_pins(lock, a.carry.read_text(encoding="utf-8"))
        print("\n".join(pins), flush=True)
        if a.wheels is None:
            return 0
        built, failed = fetch_wheels(pins, a.wheels, a.python)
        files = sorted(a.wheels.glob("*.whl"))
        mib = sum(f.stat().st_size for f in files) / 2**20
        print(
            f"gpu_check: {a.wheels}: {len(files)} wheels, {mib:.1f} MiB for CPython {a.python}"
            + (f"; built here from source: {', '.join(built)}" if built else "")
            + (f"; FAILED: {', '.join(failed)}" if failed else ""),
            file=sys.stderr,
        )
        return 1 if failed else 0
    if a.make_teacher is not None:  # step b's child: build and save the teacher, print what it made
        print(json.dumps(make_teacher(a.make_teacher, a.quick, a.device)), flush=True)
        return 0
    t0 = time.monotonic()
    meta: dict[str, Any] = probe(a.device)
    if a.device == "cuda" and not meta["cuda"]:
        refuse(
            "torch sees no CUDA device; without one only `--device cpu --quick` runs (a check of this script)"
        )
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from machine import cpu_name  # benchmarks/machine.py, beside this script

    meta.update(
        date=dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        card=meta.get("card") or f"cpu: {cpu_name()}",
        commit=a.commit or commit(),
        device=a.device,
        quick=a.quick,
        steps=a.steps,
        budget=f"{a.budget:.0f} s" if a.budget else "none",
        argv=sys.argv[1:] if argv is None else argv,
    )
    print("\n".join(header_lines(meta)), flush=True)
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    ctx = Context(a.device, a.quick, work, a.budget or None, a.sweeps)
    plan = {"a": step_sweeps, "b": step_grid, "c": step_benchmarks}
    try:
        rows = run_steps(ctx, [(s, plan[s]) for s in a.steps if s in plan])
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"kept: {work}", flush=True)
    meta["wall_s"] = round(time.monotonic() - t0, 1)
    if "d" in a.steps:
        md = markdown(meta, rows)
        print("\n" + md, flush=True)
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "gpu-check.md").write_text(md, encoding="utf-8")
        (a.out / "gpu-check.json").write_text(report_json(meta, rows), encoding="utf-8")
        (a.out / "gpu-check.log").write_text("\n".join(ctx.log), encoding="utf-8")
        print(f"written: {a.out}/gpu-check.md, gpu-check.json, gpu-check.log", flush=True)
    return 1 if any(r.status in ("failed", "timeout") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
