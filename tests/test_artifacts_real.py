"""Artifact checks on the real stages (a test-size sweep, serial executor): real teacher folders and
safetensors statistics, checked by size and mtime, recomputed when deleted or overwritten."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest
from rich.console import Console

from db.store import Store
from orchestrator.execute import SerialExecutor
from orchestrator.launch import launch
from orchestrator.spec import load_spec

HERE = Path(__file__).parent

pytestmark = pytest.mark.slow


def _launch(store: Store) -> tuple[int, list[str]]:
    spec, path, text = load_spec(str(HERE / "sweeps" / "crash.yaml"))
    buf = io.StringIO()
    code = launch(
        spec,
        text,
        store,
        SerialExecutor(),
        console=Console(file=buf, width=300),
        show_progress=False,
        path=str(path),
    )
    return code, [ln for ln in buf.getvalue().splitlines() if "recomputing" in ln]


def test_deleted_teacher_and_overwritten_statistics_on_the_real_stages(tmp_path, monkeypatch):
    monkeypatch.setenv("MOESWEEP_HOME", str(tmp_path / "home"))
    store = Store(f"sqlite:///{tmp_path}/r.db")
    assert _launch(store)[0] == 0
    results = "SELECT config_id, ppl_pre, ppl_post, avg_acc FROM results ORDER BY config_id"
    before = store.query(results)[1]
    jobs = store.query("SELECT key, finished_at FROM jobs ORDER BY key")[1]
    arts = dict(
        store.query("SELECT kind, path FROM artifacts WHERE kind IN ('model', 'calibration_stats')")[1]
    )
    stats, teacher = Path(arts["calibration_stats"]), Path(arts["model"])
    assert teacher.is_dir() and any(teacher.iterdir())

    # a relaunch checks every artifact by size and mtime and runs nothing
    assert _launch(store) == (0, [])
    assert store.query("SELECT key, finished_at FROM jobs ORDER BY key")[1] == jobs

    # the statistics overwritten with same-size garbage, the teacher folder deleted
    size = stats.stat().st_size
    stats.write_bytes(os.urandom(size))
    for f in sorted(teacher.rglob("*"), reverse=True):
        f.unlink() if f.is_file() else f.rmdir()
    teacher.rmdir()
    code, lines = _launch(store)
    assert code == 0, lines
    # both recomputed to the same content (safetensors hashed with its header's keys sorted): nothing else runs
    assert len(lines) == 2 and lines[0].startswith("teacher ") and "model is missing" in lines[0], lines
    assert (
        lines[1].startswith("calibrate ")
        and "stats.safetensors changed since it was recorded (same size" in lines[1]
    ), lines
    rerun = {k for k, f in store.query("SELECT key, finished_at FROM jobs ORDER BY key")[1]} - {
        k for k, f in jobs if (k, f) in set(store.query("SELECT key, finished_at FROM jobs")[1])
    }
    assert len(rerun) == len(lines)  # every job that ran again was named on the console, once
    assert teacher.is_dir() and stats.stat().st_size == size
    assert store.query(results)[1] == before
    assert store.query("SELECT COUNT(*) FROM jobs WHERE status <> 'succeeded'")[1] == [(0,)]
