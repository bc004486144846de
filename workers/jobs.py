"""One function per stage: plain payload in, plain record out (the orchestrator writes the DB).

A payload is {"key", "stage", "params", "inputs": {role: upstream outputs}, "resident", "workdir",
...}. A record is {"outputs": {...}, "metrics": [...], "artifacts": [...], "plan_rows": [...],
"layer_diag": [...], "versions": {...}}. `cache` is the worker's memory between jobs: the
resident teacher, loaded calibration statistics and tokenized evaluation text.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from workers.runtime import runtime_versions
from workers.stages import STAGES

Progress = Callable[..., None] | None


def run_job(payload: dict[str, Any], cache: dict, progress: Progress = None) -> dict[str, Any]:
    workdir = Path(payload["workdir"])
    if workdir.exists():  # a half-written directory from a killed run is never trusted
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    record = STAGES[payload["stage"]](payload, cache, progress)
    record.setdefault("versions", runtime_versions())
    return record
