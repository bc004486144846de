"""Benchmark of the orchestration overhead: a sweep's wall time against its jobs' own compute time.

One sweep (default tests/sweeps/micro.yaml; `--sweep tiny` for the embedded default) is launched
with `orchestrator.launch.launch` in a fresh MOESWEEP_HOME per executor, through the Ray executor
(RayExecutor(num_cpus=--cpus)) and through the serial executor, one after the other in one run.
From the DB it reads each job's compute_s (time inside the worker's stage function) and duration_s
(submit → result, seen by the orchestrator), and reports:

  wall        time of the launch() call (Ray's own start-up, ray.init, is reported beside it, not in it)
  Σ compute   the sum of compute_s over the jobs the launch ran
  ideal       the shortest schedule those compute times allow: stages run one after another (each
              needs the previous one's outputs), and within a stage a lower bound of any schedule on
              C CPUs is max(Σ_j cpus_j·compute_j / C, max_j compute_j). Serial: ideal = Σ compute.
  overhead    (wall − ideal) / ideal: everything that is not a job's own work (DB transactions, job
              dispatch, actor start-up, model reloads, waiting at stage boundaries for stragglers).
Where it goes: time outside executor.run (orchestrator: register/claim/link/select in the DB), DB
writes of results (on_done), and per job duration_s − compute_s (dispatch, payload, actor start).
Target (issue): overhead ≤ 10%. No assert on timings: it only prints.

  .venv/bin/python benchmarks/bench_orchestration.py                 # micro sweep, Ray (2 CPUs) and serial
  .venv/bin/python benchmarks/bench_orchestration.py --sweep tiny    # the embedded default (long)
  .venv/bin/python benchmarks/bench_orchestration.py --sweep tiny --quick --seed-cache .moesweep/bench/cache/tiny
  .venv/bin/python benchmarks/bench_orchestration.py --smoke         # seconds: does it still run? (serial, micro)
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
MICRO = REPO / "tests" / "sweeps" / "micro.yaml"  # the smallest real sweep (the whole pipeline at test size)
sys.path.insert(0, str(REPO))
from machine import cpu_name  # noqa: E402  (benchmarks/machine.py, beside this script)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--sweep", default=str(MICRO), help="sweep name or YAML path (default: tests/sweeps/micro.yaml)"
    )
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="a seconds-long run through the same code paths (checks the script runs; its timings mean "
        "nothing): the serial executor on tests/sweeps/micro.yaml",
    )
    ap.add_argument("--executors", default="ray,serial", help="comma-separated: ray, serial")
    ap.add_argument("--cpus", type=int, default=2, help="CPUs of the local Ray (RayExecutor(num_cpus=...))")
    ap.add_argument("--home", default=None, help="parent of the fresh MOESWEEP_HOMEs (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the homes (DB, logs, artifacts) afterwards")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="shorten the sweep's compute, keep its grid and resources: dense teacher 100 steps, "
        "5 distillation steps, evaluate.limit 16 (less compute, same fixed costs)",
    )
    ap.add_argument(
        "--seed-cache",
        default=None,
        help="a cache/tiny directory copied into each fresh home first (teachers trained before are "
        "then cache hits, as in a home that ran a sweep before)",
    )
    a = ap.parse_args(argv)
    if a.smoke:
        if a.quick or a.seed_cache:
            ap.error("--smoke runs tests/sweeps/micro.yaml as it is: no --quick, no --seed-cache")
        a.sweep, a.executors = str(MICRO), "serial"
    a.executors = [e.strip() for e in a.executors.split(",") if e.strip()]
    for e in a.executors:
        if e not in ("ray", "serial"):
            ap.error(f"--executors: {e!r}; allowed: ray, serial")
    return a


class TimedExecutor:
    """Delegates to an executor, timing each executor.run (one per stage and resource shape) and the
    orchestrator's result callbacks (DB writes) inside it. Whatever else the orchestrator passes to
    run (progress, poll, claim, ...) and any other attribute it reads go to the executor unchanged."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.name = inner, inner.name
        self.run_s: dict[str, float] = defaultdict(float)
        self.on_done_s: dict[str, float] = defaultdict(float)

    def run(
        self, payloads: list[dict[str, Any]], on_done: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> None:
        stage = payloads[0]["stage"] if payloads else "?"

        def timed_done(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return on_done(*a, **kw)
            finally:
                self.on_done_s[stage] += time.perf_counter() - t0

        t0 = time.perf_counter()
        try:
            self.inner.run(payloads, timed_done, *args, **kwargs)
        finally:
            self.run_s[stage] += time.perf_counter() - t0

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name: str) -> Any:  # only called for attributes not set above
        return getattr(self.inner, name)


def ideal_stage(rows: list[dict[str, Any]], cpus_total: float | None) -> float:
    """Lower bound of a stage's makespan: serial = Σ t; on C CPUs = max(Σ c·t / C, max t)."""
    ts = [r["compute_s"] for r in rows]
    if cpus_total is None:
        return sum(ts)
    work = sum(r["cpus"] * r["compute_s"] for r in rows)
    return max(work / cpus_total, max(ts))


def job_rows(store) -> list[dict[str, Any]]:
    """The jobs that succeeded (a fresh home: every one of them ran in this launch)."""
    cols, rows = store.query("SELECT key, stage, duration_s, compute_s FROM jobs WHERE status = 'succeeded'")
    return [dict(zip(cols, r, strict=True)) for r in rows]


def quick_sweep(name: str, root: Path) -> str:
    """A copy of the sweep with --quick's shorter trainings and evaluation; returns its path."""
    import yaml

    from orchestrator.spec import load_spec

    raw = yaml.safe_load(load_spec(name)[2])
    raw["name"] = f"{raw['name']}-quick"
    dense = raw.get("dense_teacher")
    if dense and dense.get("source", "tiny") == "tiny":
        dense["tiny"] = {**(dense.get("tiny") or {}), "steps": 100}
    if raw.get("distill"):
        raw["distill"]["settings"] = {
            **raw["distill"].get("settings", {}),
            "steps": 5,
            "eval_every": 5,
            "warmup": min(5, raw["distill"].get("settings", {}).get("warmup", 5)),
        }
    if raw.get("evaluate"):
        raw["evaluate"]["limit"] = 16
    path = root / f"{raw['name']}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return str(path)


def run_one(kind: str, a: argparse.Namespace, root: Path) -> dict[str, Any]:
    from rich.console import Console

    from db.store import Store
    from orchestrator.launch import launch
    from orchestrator.spec import load_spec

    home = root / kind
    shutil.rmtree(home, ignore_errors=True)
    if a.seed_cache:
        shutil.copytree(a.seed_cache, home / "cache" / "tiny")
    os.environ["MOESWEEP_HOME"] = str(home)  # payloads read it (artifacts, logs, tiny-teacher cache)
    spec, _, text = load_spec(a.sweep)
    store = Store(f"sqlite:///{home / 'moesweep.db'}")
    t0 = time.perf_counter()
    if kind == "ray":
        from orchestrator.execute import RayExecutor

        inner = RayExecutor(num_cpus=a.cpus)
    else:
        from orchestrator.execute import SerialExecutor

        inner = SerialExecutor()
    init_s = time.perf_counter() - t0
    ex = TimedExecutor(inner)
    sink = io.StringIO()
    t0 = time.perf_counter()
    code = launch(spec, text, store, ex, console=Console(file=sink, width=120), show_progress=False)
    wall = time.perf_counter() - t0
    actor_s = actor_start(inner) if kind == "ray" else None
    if kind == "ray":
        import ray

        ray.shutdown()

    rows = job_rows(store)
    if kind == "ray":  # cpus per job, from the sweep's resources (the DB keeps params, not resources)
        cpus_of: dict[str, float] = {}
        for r in rows:
            r["cpus"] = cpus_of.setdefault(r["stage"], spec.resources(r["stage"]).cpus)
    by_stage: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by_stage[r["stage"]].append(r)
    cap = float(a.cpus) if kind == "ray" else None
    stages = []
    for st in ("teacher", "dense_teacher", "calibrate", "convert", "ppl_pre", "distill", "evaluate"):
        if st not in by_stage:
            continue
        rs = by_stage[st]
        stages.append(
            {
                "stage": st,
                "jobs": len(rs),
                "compute": sum(r["compute_s"] for r in rs),
                "max": max(r["compute_s"] for r in rs),
                "ideal": None,
                "run": None,
                "db": None,
                "gap": sum(r["duration_s"] - r["compute_s"] for r in rs),
            }
        )
    # teacher and dense_teacher run in one executor call (one stage of the launch loop)
    merged: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        merged["teacher" if r["stage"] == "dense_teacher" else r["stage"]].append(r)
    ideal = sum(ideal_stage(rs, cap) for rs in merged.values())
    for s in stages:
        key = "teacher" if s["stage"] == "dense_teacher" else s["stage"]
        if s["stage"] != "dense_teacher":
            s["ideal"] = ideal_stage(merged[key], cap)
            s["run"] = ex.run_s.get(key, 0.0) + (
                ex.run_s.get("dense_teacher", 0.0) if key == "teacher" else 0.0
            )
            s["db"] = ex.on_done_s.get(key, 0.0) + (
                ex.on_done_s.get("dense_teacher", 0.0) if key == "teacher" else 0.0
            )
    gaps = sorted(r["duration_s"] - r["compute_s"] for r in rows)
    return {
        "kind": kind,
        "code": code,
        "wall": wall,
        "init": init_s,
        "actor": actor_s,
        "jobs": len(rows),
        "compute": sum(r["compute_s"] for r in rows),
        "ideal": ideal,
        "stages": stages,
        "inside_run": sum(ex.run_s.values()),
        "db_results": sum(ex.on_done_s.values()),
        "gaps": gaps,
        "home": home,
    }


def actor_start(inner: Any) -> float:
    """Seconds for one fresh job actor (as the executor makes them) to be ready."""
    from orchestrator.execute import _worker_actor

    ray = inner.ray
    t0 = time.perf_counter()
    actor = _worker_actor(ray).options(num_cpus=1).remote(inner.hub, 1)
    ray.get(actor.__ray_ready__.remote())
    took = time.perf_counter() - t0
    ray.kill(actor)
    return took


def machine() -> str:
    return f"{cpu_name()}, {os.cpu_count()} CPUs visible, load average {os.getloadavg()[0]:.1f} at start"


def pct(x: float, base: float) -> str:
    return f"{100 * x / base:6.1f}%" if base > 0 else "   n/a"


def report(r: dict[str, Any], cpus: int) -> None:
    head = (
        f"executor {r['kind']}"
        + (f" (RayExecutor(num_cpus={cpus}))" if r["kind"] == "ray" else "")
        + f": exit code {r['code']}, {r['jobs']} jobs"
    )
    print(head)
    print(
        f"  {'stage':14s} {'jobs':>5s} {'Σcompute':>9s} {'max job':>8s} {'ideal':>8s} {'in run':>8s} "
        f"{'DB write':>8s} {'Σ(dur−comp)':>11s}"
    )
    for s in r["stages"]:
        f = lambda v: f"{v:8.2f}" if v is not None else f"{'':8s}"  # noqa: E731
        print(
            f"  {s['stage']:14s} {s['jobs']:5d} {s['compute']:9.2f} {s['max']:8.2f} {f(s['ideal'])} "
            f"{f(s['run'])} {f(s['db'])} {s['gap']:11.2f}"
        )
    g = r["gaps"]
    q = statistics.quantiles(g, n=10) if len(g) >= 2 else g * 9
    outside = r["wall"] - r["inside_run"]
    print(
        f"  wall {r['wall']:.2f}s   Σ compute {r['compute']:.2f}s   ideal {r['ideal']:.2f}s   "
        f"overhead (wall − ideal)/ideal = {pct(r['wall'] - r['ideal'], r['ideal']).strip()}"
    )
    print(f"  wall / Σ compute = {r['wall'] / r['compute']:.3f}")
    print(
        f"  where: outside executor.run (plan, register/claim/link/select in the DB) {outside:.2f}s; "
        f"inside it {r['inside_run']:.2f}s, of which result writes to the DB {r['db_results']:.2f}s"
    )
    print(
        f"  per job duration_s − compute_s: median {statistics.median(g) * 1e3:.1f} ms, "
        f"p90 {q[-1] * 1e3:.1f} ms, max {max(g) * 1e3:.1f} ms, Σ {sum(g):.2f}s"
    )
    if r["kind"] == "ray":
        print(
            f"  Ray start-up (not in wall): ray.init {r['init']:.2f}s; one fresh job actor ready in "
            f"{r['actor']:.2f}s"
        )
    print()


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    root = Path(a.home) if a.home else Path(tempfile.mkdtemp(prefix="bench_orch_"))
    root.mkdir(parents=True, exist_ok=True)
    import torch

    if a.quick:
        a.sweep = quick_sweep(a.sweep, root)
    print(
        f"machine : {machine()} (torch {torch.__version__}, {torch.get_num_threads()} threads in this process)"
    )
    print(
        f"sweep   : {a.sweep}; fresh MOESWEEP_HOME per executor under {root}"
        + (f"; tiny cache seeded from {a.seed_cache}" if a.seed_cache else "")
    )
    print()
    results = []
    try:
        for kind in a.executors:
            r = run_one(kind, a, root)
            results.append(r)
            report(r, a.cpus)
    finally:
        if not a.keep and not a.home:
            shutil.rmtree(root, ignore_errors=True)
    if len(results) == 2:
        x, y = results
        print(f"{x['kind']} wall / {y['kind']} wall = {x['wall'] / y['wall']:.2f}")
    return 0 if all(r["code"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
