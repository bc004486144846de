"""Sweeps written by a test: loaded from a dict, planned as a dry run plans them, or launched twice on the
serial executor (a whole tiny sweep, then a relaunch that should run nothing)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator import configs as P
from orchestrator.spec import load_spec
from orchestrator.stage import SweepContext, stages

JOBS = "SELECT key, attempts, finished_at, status FROM jobs ORDER BY key"


def spec_of(raw: dict[str, Any], tmp_path: Path, name: str = "x.yaml"):
    """The spec of the sweep file `raw` written as tmp_path/name."""
    path = tmp_path / name
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return load_spec(str(path))[0]


def planned(spec) -> SweepContext:
    """Every job a dry run plans (the stages planned from results plan nothing here)."""
    shape = P.stated_shape(spec)
    ctx = SweepContext(spec, shape, P.build_configs(spec, shape))
    for st in stages():
        if st.estimate is None:
            ctx.jobs[st.name] = st.jobs(ctx)
    return ctx


def launch_serial(spec, text: str, store, path: Path | str, **kw: Any) -> int:
    """`moesweep launch` of a loaded sweep on the serial executor, quietly unless `kw` gives a console (`kw`:
    launch's other options); its exit code."""
    from rich.console import Console

    from orchestrator.execute import SerialExecutor
    from orchestrator.launch import launch

    kw = {"console": Console(quiet=True), "show_progress": False, **kw}
    return launch(spec, text, store, SerialExecutor(), path=str(path), **kw)


@contextmanager
def launched_twice(sweep: Path | str, tmp: Path) -> Iterator[dict[str, Any]]:
    """Launch `sweep` into a SQLite store under `tmp` (MOESWEEP_HOME at tmp/home while the block lasts),
    then launch it again. Yields the exit codes (code, code2), the jobs table after each launch (jobs,
    again), the store and the loaded spec."""
    from db.store import Store

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MOESWEEP_HOME", str(tmp / "home"))
        spec, path, text = load_spec(str(sweep))
        store = Store(f"sqlite:///{tmp}/r.db")
        code = launch_serial(spec, text, store, path)
        jobs = store.query(JOBS)[1]
        code2 = launch_serial(spec, text, store, path)
        again = store.query(JOBS)[1]
        yield {"code": code, "code2": code2, "jobs": jobs, "again": again, "store": store, "spec": spec}
