"""Run one job: plain payload in, plain record out (the orchestrator writes the DB).

A payload is {"key", "stage", "run": "module:function", "params", "inputs": {role: upstream outputs},
"resident", "workdir", ...}. A record is {"outputs": {...}, "metrics": [...], "artifacts": [...],
"plan_rows": [...], "layer_diag": [...], "versions": {...}}. `cache` is the worker's memory between
jobs: the resident teacher, loaded calibration statistics and tokenized evaluation text.
"""

from __future__ import annotations

import importlib
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from workers.runtime import runtime_versions

Progress = Callable[..., None] | None


def resolve(ref: str) -> Callable[..., dict[str, Any]]:
    """'module:function' → the function (a stage's run function, named by the orchestrator's registry)."""
    module, _, name = ref.partition(":")
    obj: Any = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def run_job(payload: dict[str, Any], cache: dict, progress: Progress = None) -> dict[str, Any]:
    workdir = Path(payload["workdir"])
    if workdir.exists():  # a half-written directory from a killed run is never trusted
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    record = resolve(payload["run"])(payload, cache, progress)
    record.setdefault("versions", runtime_versions())
    return record
