"""With the serial executor a job runs in the launch's process with sys.stderr pointed at its log; the
launch's progress lines still go to the launch's own stream, never into a job's log."""

from __future__ import annotations

import io
import sys
import time
from pathlib import Path

from rich.console import Console

from db.store import Store
from orchestrator.execute import SerialExecutor
from orchestrator.launch import launch
from orchestrator.spec import load_spec
from tests.test_orchestrator import fake  # noqa: F401  (the fake stage functions fixture)


def test_progress_lines_stay_on_the_terminal_while_a_serial_job_runs(fake, monkeypatch, tmp_path):  # noqa: F811
    _, state = fake

    def slow_calibrate(p, cache, progress):
        time.sleep(1.0)  # long enough for several progress lines while the job's stderr is its log
        return {"outputs": {"stats": "fake"}}

    monkeypatch.setattr("workers.run.calibrate.stage_calibrate", slow_calibrate)
    terminal = io.StringIO()
    monkeypatch.setattr(sys, "stderr", terminal)
    console = Console(stderr=True)  # as the CLI's: it writes wherever sys.stderr points
    spec, path, text = load_spec(str(state["sweep"]))
    launch(spec, text, Store(state["db"]), SerialExecutor(), console=console, path=str(path), lines_s=0.05)
    logs = list((Path(tmp_path) / "home" / "logs" / "calibrate").glob("*.log"))
    assert logs, "the calibration job wrote a log"
    assert all("stage " not in f.read_text() for f in logs), [f.read_text()[:300] for f in logs]
    assert terminal.getvalue().count("stage calibrate: 0/1") >= 2, terminal.getvalue()[:500]
    assert console._file is None  # it follows sys.stderr again after the launch
