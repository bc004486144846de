"""The whole pipeline on a test-size sweep: the real Ray executor and the real DB; kill -9 and resume.

`micro.yaml` trains its own small MoE and dense teachers (a few dozen steps), converts, evaluates,
selects, distills and evaluates again, exactly as `moesweep launch tiny` does at full size.
"""

from __future__ import annotations

import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

from db.store import Store
from orchestrator.launch import launch
from orchestrator.spec import load_spec

HERE = Path(__file__).parent
ROOT = HERE.parent
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

pytestmark = pytest.mark.slow


def _results(store: Store, sweep: str) -> list[tuple]:
    cols = ", ".join(("c." if c == "config_key" else "r.") + c for c in RESULT_COLS)
    return store.query(
        f"SELECT {cols} FROM results r JOIN configurations c ON c.id = r.config_id "
        f"WHERE r.sweep = :s ORDER BY c.config_key",
        {"s": sweep},
    )[1]


@pytest.fixture(scope="module")
def ray_run(tmp_path_factory):
    """One launch of the micro sweep through Ray (2 CPUs), then a relaunch of the same sweep."""
    import ray

    from orchestrator.execute import RayExecutor

    home = tmp_path_factory.mktemp("ray_home")
    old = os.environ.get("MOESWEEP_HOME")
    os.environ["MOESWEEP_HOME"] = str(home)
    try:
        store = Store(f"sqlite:///{home}/moesweep.db")
        spec, _, text = load_spec(str(HERE / "sweeps" / "micro.yaml"))
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
        try:
            code = launch(spec, text, store, RayExecutor(), console=Console(quiet=True), show_progress=False)
            jobs_before = store.query("SELECT key, attempts, finished_at FROM jobs ORDER BY key")[1]
            metrics_before = store.query("SELECT COUNT(*) FROM metrics")[1]
            t0 = time.perf_counter()
            code2 = launch(spec, text, store, RayExecutor(), console=Console(quiet=True), show_progress=False)
            relaunch_s = time.perf_counter() - t0
        finally:
            ray.shutdown()
        yield {
            "store": store,
            "home": home,
            "code": code,
            "code2": code2,
            "relaunch_s": relaunch_s,
            "jobs_before": jobs_before,
            "metrics_before": metrics_before,
        }
    finally:
        if old is None:
            os.environ.pop("MOESWEEP_HOME", None)
        else:
            os.environ["MOESWEEP_HOME"] = old


def test_micro_sweep_through_ray_fills_the_database(ray_run):
    store = ray_run["store"]
    assert ray_run["code"] == 0
    assert store.query("SELECT COUNT(*) FROM jobs WHERE status <> 'succeeded'")[1] == [(0,)]
    # the teachers are visibly trained: held-out perplexity far below a random-init model's
    trained = dict(
        store.query(
            "SELECT j.stage || ':' || m.who, m.value FROM metrics m JOIN jobs j ON j.id = m.job_id "
            "WHERE m.name = 'ppl' AND m.stage = 'train'"
        )[1]
    )
    for stage in ("teacher", "dense_teacher"):
        assert trained[f"{stage}:teacher"] < 0.7 * trained[f"{stage}:random_init"]

    rows = {r[0]: dict(zip(RESULT_COLS, r, strict=True)) for r in _results(store, "micro")}
    grid = [r for r in rows.values() if r["kind"] == "moe2dense"]
    assert len(grid) == 2 * 2 * 1 * 2
    assert all(r["ppl_pre"] is not None and r["ppl_pre_kind"] == "finite" for r in grid)
    # K = k: both groupings are one student -> one of the two is a duplicate with the same number
    for s in ("SF", "DO-ACP"):
        a, b = rows[f"{s}|RR|uniform|K=2"], rows[f"{s}|OC|uniform|K=2"]
        assert (
            a["ppl_pre"] == b["ppl_pre"]
            and a["duplicate_of IS NOT NULL"] + b["duplicate_of IS NOT NULL"] == 1
        )
    # one (K, scaling) per scoring x grouping is distilled and evaluated
    picked = [r for r in grid if r["selected_for_distill"]]
    assert len(picked) == 4 and all(r["ppl_post"] is not None and r["avg_acc"] is not None for r in picked)
    for r in picked:
        pair = [g for g in grid if (g["scoring"], g["grouping"]) == (r["scoring"], r["grouping"])]
        assert r["ppl_pre"] == min(g["ppl_pre"] for g in pair)
    # baselines and the teacher row
    assert rows["teacher"]["ppl_pre"] is not None and rows["teacher"]["avg_acc"] is not None
    for b in ("baseline:random_ffn", "baseline:random_init"):
        assert rows[b]["ppl_post"] is not None
    # a random-init student is far worse than any converted one before distillation
    assert rows["baseline:random_init"]["ppl_pre"] > max(r["ppl_pre"] for r in grid)
    d2d = [r for k, r in rows.items() if k.startswith("baseline:d2d:")]
    assert len(d2d) >= 2 and sum(r["selected_for_distill"] for r in d2d) == 1
    # the stored plans: K rows per layer for every conversion, groups in 0..k-1
    n = store.query("SELECT COUNT(*), MAX(group_idx) FROM selections WHERE sweep = 'micro' AND K = 4")[1][0]
    assert n[0] == 4 * 4 * 2 and n[1] == 1  # 4 configs x 4 kept experts x 2 layers; k = 2 groups
    # validation curves of student and teacher during distillation (Figure 5)
    whos = {w for (w,) in store.query("SELECT DISTINCT who FROM curves WHERE sweep = 'micro'")[1]}
    assert whos == {"student", "teacher"}
    # every job logged to its own file, whose path is in the DB
    logs = store.query("SELECT log_path FROM jobs")[1]
    assert all(p and Path(p).exists() for (p,) in logs)


def test_relaunch_does_no_work_twice(ray_run):
    store = ray_run["store"]
    assert ray_run["code2"] == 0
    assert (
        store.query("SELECT key, attempts, finished_at FROM jobs ORDER BY key")[1] == ray_run["jobs_before"]
    )
    assert store.query("SELECT COUNT(*) FROM metrics")[1] == ray_run["metrics_before"]


# ---- kill -9 at several points, relaunch, compare with an uninterrupted run ----------------------
def _launch_cmd(home: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "orchestrator.cli",
        "launch",
        str(HERE / "sweeps" / "crash.yaml"),
        "--executor",
        "serial",
        "--db",
        f"sqlite:///{home}/moesweep.db",
    ]


def _env(home: Path) -> dict[str, str]:
    return {**os.environ, "MOESWEEP_HOME": str(home), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _succeeded(db: Path) -> int:
    if not db.exists():
        return 0
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as c:
            return c.execute("SELECT COUNT(*) FROM jobs WHERE status = 'succeeded'").fetchone()[0]
    except sqlite3.OperationalError:  # schema not there yet
        return 0


def _run_and_kill_at(home: Path, n_succeeded: int, timeout: float = 400) -> bool:
    """Launch; SIGKILL the whole process group once `n_succeeded` jobs have succeeded. True if killed."""
    proc = subprocess.Popen(
        _launch_cmd(home),
        env=_env(home),
        cwd=ROOT,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    t0 = time.monotonic()
    while proc.poll() is None and time.monotonic() - t0 < timeout:
        if _succeeded(home / "moesweep.db") >= n_succeeded:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return True
        time.sleep(0.05)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError("launch did not finish in time")
    return False


def _snapshot(home: Path) -> tuple[list[tuple], list[tuple], dict[str, tuple]]:
    store = Store(f"sqlite:///{home}/moesweep.db", migrate=False)
    res = _results(store, "crash")
    per_job = store.query(
        "SELECT j.stage, COUNT(m.id) FROM jobs j LEFT JOIN metrics m ON m.job_id = j.id "
        "GROUP BY j.id ORDER BY j.key"
    )[1]
    done = {
        k: (a, f)
        for k, a, f in store.query("SELECT key, attempts, finished_at FROM jobs WHERE status = 'succeeded'")[
            1
        ]
    }
    store.engine.dispose()
    return res, per_job, done


def test_kill_9_at_several_points_then_resume_equals_an_uninterrupted_run(tmp_path):
    ref, crash = tmp_path / "ref", tmp_path / "crash"
    assert (
        subprocess.run(_launch_cmd(ref), env=_env(ref), cwd=ROOT, capture_output=True, timeout=600).returncode
        == 0
    )
    ref_rows, ref_per_job, _ = _snapshot(ref)
    # the crashed home reuses the cached teacher (same bytes), so both runs see the same model
    shutil.copytree(ref / "cache", crash / "cache")

    seen: dict[str, tuple] = {}
    kills = 0
    for point in (1, 4, 9, 14, 19, 23):  # after the teacher, in convert, ppl_pre, distill, evaluate
        if not _run_and_kill_at(crash, point):
            break
        kills += 1
        _, _, done = _snapshot(crash)
        for key, state in seen.items():  # a job that had succeeded was never run again
            assert done[key] == state, f"job {key} ran again after it succeeded"
        seen = done
    assert kills >= 3
    final = subprocess.run(_launch_cmd(crash), env=_env(crash), cwd=ROOT, capture_output=True, timeout=600)
    assert final.returncode == 0, final.stderr.decode()[-2000:]
    rows, per_job, done = _snapshot(crash)
    for key, state in seen.items():
        assert done[key] == state
    assert rows == ref_rows  # identical result rows, none duplicated
    assert per_job == ref_per_job  # the same metrics per job: nothing written twice


def test_two_concurrent_launches_and_ctrl_c(tmp_path):
    """Two launches of one sweep on one DB share its jobs without running any job twice; Ctrl-C keeps
    what finished and leaves nothing claimed."""
    home = tmp_path / "home"
    procs = [
        subprocess.Popen(
            _launch_cmd(home), env=_env(home), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        for _ in range(2)
    ]
    codes = [p.wait(timeout=600) for p in procs]
    assert codes == [0, 0], [p.stderr.read().decode()[-1500:] for p in procs]
    store = Store(f"sqlite:///{home}/moesweep.db", migrate=False)
    assert store.query("SELECT COUNT(*), MAX(attempts), MIN(attempts) FROM jobs")[1][0][1:] == (1, 1)
    assert store.query("SELECT COUNT(*) FROM jobs WHERE status <> 'succeeded'")[1] == [(0,)]
    owners = {o.rsplit(":", 1)[1] for (o,) in store.query("SELECT owner FROM jobs")[1]}
    assert len(owners) == 2  # jobs are claimed as they start, so both launches did part of the work

    # Ctrl-C in the middle of a fresh sweep (new DB, cached teacher): exit 130, nothing left running
    db2 = tmp_path / "ctrlc.db"
    cmd = [*_launch_cmd(home)[:-1], f"sqlite:///{db2}"]
    proc = subprocess.Popen(cmd, env=_env(home), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    t0 = time.monotonic()
    while _succeeded(db2) < 5 and time.monotonic() - t0 < 300:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    rc = proc.wait(timeout=120)
    assert rc == 130, proc.stderr.read().decode()[-3000:]
    with sqlite3.connect(db2) as c:
        status = dict(c.execute("SELECT status, COUNT(*) FROM jobs GROUP BY status").fetchall())
    assert status.get("running", 0) == 0 and status["succeeded"] >= 5
    assert subprocess.run(cmd, env=_env(home), cwd=ROOT, capture_output=True, timeout=600).returncode == 0


def test_report_from_the_micro_run(ray_run, tmp_path):
    """`moesweep report` on a real (test-size) run, side by side with the imported paper numbers."""
    from analysis.load import load_frames
    from analysis.reference import reference_sweeps
    from analysis.report import write_report

    store = ray_run["store"]
    store.import_reference(reference_sweeps())
    ref = [s["name"] for s in reference_sweeps()]
    paths = write_report(
        load_frames(store.engine, ["micro"]), "micro", tmp_path / "r", load_frames(store.engine, ref)
    )
    names = {p.name for p in paths}
    assert "index.md" in names and any(n.endswith(".tex") for n in names)
    for p in paths:
        assert p.stat().st_size > 100
        if p.suffix == ".png":
            assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        if p.suffix == ".pdf":
            assert p.read_bytes()[:5] == b"%PDF-"
    figures = {p.stem for p in paths if p.suffix == ".png"}
    # the run has plans (Figure 2 overlap, Figure 3 effective rank) and distillation curves (Figure 5)
    assert any("overlap" in f for f in figures) and any("rank" in f for f in figures)
    assert any("curve" in f or "val" in f for f in figures), figures
    grid = next(p for p in paths if p.suffix == ".tex" and "ppl" in p.stem).read_text()
    assert "\\toprule" in grid and "DO-ACP" in grid


def test_export_a_distilled_student_of_the_micro_run(ray_run, tmp_path):
    """`moesweep export`: the distilled student as a folder transformers loads, with the same weights as
    the checkpoint the sweep wrote, a card naming its recipe and scores; a second export into the same
    folder, an unknown key and a changed checkpoint are one-line refusals that write nothing."""
    import json

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from typer.testing import CliRunner

    from orchestrator.cli import app

    store = ray_run["store"]
    url = str(store.engine.url)
    key, acc = store.query(
        "SELECT config_key, avg_acc FROM results WHERE sweep = 'micro' AND kind = 'moe2dense' "
        "AND selected_for_distill = 1 AND variant IS NULL ORDER BY config_id LIMIT 1"
    )[1][0]
    out = tmp_path / "student"
    r = CliRunner().invoke(app, ["export", key, "--out", str(out), "--db", url])
    assert r.exit_code == 0, r.output
    facts = json.loads((out / "moesweep.json").read_text())
    assert facts["config_key"] == key and facts["provenance"]["stage"] == "distill"
    assert facts["scores"]["avg_acc"] == acc and facts["output"] == "dense" and facts["registers"] is None
    card = (out / "README.md").read_text()
    assert key in card and facts["provenance"]["job_key"] in card
    (src,) = store.query(
        "SELECT a.path FROM artifacts a JOIN config_jobs cj ON cj.job_id = a.job_id "
        "JOIN configurations c ON c.id = cj.config_id WHERE c.config_key = :k AND cj.stage = 'distill' "
        "AND a.kind = 'student'",
        {"k": key},
    )[1][0]
    loaded, original = AutoModelForCausalLM.from_pretrained(out), AutoModelForCausalLM.from_pretrained(src)
    ids = AutoTokenizer.from_pretrained(out)("a test of the exported student", return_tensors="pt").input_ids
    with torch.no_grad():
        # exact: the same weights file read twice, the same CPU kernels
        assert torch.equal(loaded(ids).logits, original(ids).logits)

    again = CliRunner().invoke(app, ["export", key, "--out", str(out), "--db", url])
    assert (
        again.exit_code != 0 and "not empty" in again.output and len(again.output.strip().splitlines()) == 1
    )
    unknown = CliRunner().invoke(app, ["export", "nonesuch", "--out", str(tmp_path / "x"), "--db", url])
    assert unknown.exit_code != 0 and "no configuration 'nonesuch'" in unknown.output
    assert not (tmp_path / "x").exists()

    weights = next(Path(src).glob("*.safetensors"))
    saved = weights.read_bytes()
    try:
        weights.write_bytes(saved[:-8] + bytes(8))  # the checkpoint changed after it was recorded
        bad = CliRunner().invoke(app, ["export", key, "--out", str(tmp_path / "y"), "--db", url])
        assert bad.exit_code != 0 and "changed since it was recorded" in bad.output
        assert not (tmp_path / "y").exists()
    finally:
        weights.write_bytes(saved)
