"""Hooks: commands a sweep file runs when a launch ends (`execution.hooks`), e.g. a notifier.

`launch()` runs them once `run_launch` is over, whatever the outcome, except when the sweep was refused as
bad input (a SpecError: nothing ran). `on_failure` runs when the exit code is not 0 (a job failed or was
blocked, the database could not be used, a crash, Ctrl-C), `on_success` when it is 0, then `on_end` either
way. A hook gets the facts in its environment (`MOESWEEP_*`, see `environment`), reads nothing on its
standard input, and writes its output to `$MOESWEEP_HOME/logs/hooks/<sweep>.log` (appended, one header
line per run). It runs in a process group of its own for at most `timeout_s` seconds; then the whole group
is stopped (SIGTERM, SIGKILL a moment later). A hook that fails, times out or cannot start is one warning
line on the launch's console: it never changes the launch's exit code, and everything the launch
recorded is already in the database. Ctrl-C while a hook runs stops it and skips the hooks after it.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, OperationalError

from db.store import Store, StoreError, home
from orchestrator.schema import SpecError, one_line
from orchestrator.spec import Hooks, SweepSpec

KILL_GRACE_S = 2.0  # after SIGTERM, how long a hook's process group has before SIGKILL
DB_UNUSABLE = "stopped: the database could not be used"
OUTCOMES = {
    0: "all jobs succeeded",
    1: "some jobs failed or were blocked",
    2: DB_UNUSABLE,
    130: "interrupted",
    143: "terminated (SIGTERM)",
}


def ended(e: BaseException) -> tuple[int | None, str]:
    """(the exit code `moesweep launch` ends with when the launch raised `e`, what happened); None for a
    sweep refused as bad input, which runs no hook."""
    if isinstance(e, SpecError):
        return None, ""
    if isinstance(e, KeyboardInterrupt):
        return 130, OUTCOMES[130]
    if isinstance(e, StoreError):  # the command says it in one line and exits 2
        return 2, f"{DB_UNUSABLE}: {_first_line(e)}"
    if isinstance(e, OperationalError):
        return 1, f"{DB_UNUSABLE}: {_first_line(e)}"
    if isinstance(e, SystemExit):
        code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
        return code, f"exited {code}"
    return 1, f"crashed: {type(e).__name__}: {_first_line(e)}"


def _first_line(e: BaseException) -> str:
    lines = [ln for ln in str(e).splitlines() if ln.strip()]
    return one_line(lines[0])[:200] if lines else "(no message)"


def masked_url(url: str) -> str:
    """The database URL with its password masked (***)."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return url


def _counts(store: Store, sweep: str) -> dict[str, int]:
    """{succeeded, failed, pending} jobs of the sweep; pending: every job not finished (pending, or
    running in another launch)."""
    out = {"succeeded": 0, "failed": 0, "pending": 0}
    sid = store.sweep_id(sweep)
    if sid is None:
        return out
    for (_, status), n in store.job_counts(sid).items():
        out[status if status in ("succeeded", "failed") else "pending"] += n
    return out


def environment(spec: SweepSpec, store: Store, code: int, outcome: str) -> dict[str, str]:
    """The `MOESWEEP_*` variables a hook gets (beside the launch's own environment). The job counts are
    those of the whole sweep in the database; empty when they could not be read."""
    counts: dict[str, int] | None = None
    why = ""
    if not outcome.startswith(DB_UNUSABLE):  # no second wait on a database that did not answer
        try:
            counts = _counts(store, spec.name)
        except Exception as e:
            why = f" ({_first_line(e)})"
    jobs = (
        f"jobs: {counts['succeeded']} succeeded, {counts['failed']} failed, {counts['pending']} pending"
        if counts is not None
        else f"job counts unavailable{why}"
    )
    return {
        "MOESWEEP_SWEEP": spec.name,
        "MOESWEEP_EXIT_CODE": str(code),
        "MOESWEEP_DB": masked_url(store.url),
        "MOESWEEP_JOBS_SUCCEEDED": "" if counts is None else str(counts["succeeded"]),
        "MOESWEEP_JOBS_FAILED": "" if counts is None else str(counts["failed"]),
        "MOESWEEP_JOBS_PENDING": "" if counts is None else str(counts["pending"]),
        "MOESWEEP_SUMMARY": one_line(f"moesweep launch {spec.name}: {outcome} (exit {code}); {jobs}"),
    }


def log_path(sweep: str) -> Path:
    return home() / "logs" / "hooks" / f"{sweep}.log"


def shown_command(cmd: str | list[str], limit: int | None = 60) -> str:
    """The command as one line (an argv as the shell would write it), cut to `limit` characters."""
    text = one_line(cmd if isinstance(cmd, str) else shlex.join(cmd))
    return text if limit is None or len(text) <= limit else text[: limit - 1] + "…"


def run_hooks(spec: SweepSpec, store: Store, code: int, console: Console, outcome: str | None = None) -> None:
    """Run the hooks of `spec` for a launch that exits `code` (`outcome`: what happened, in words; by
    default said by the code). Never raises: a problem is one warning line on `console`."""
    hooks = spec.execution.hooks
    todo = hooks.commands(code) if hooks is not None else []
    if not todo:
        return
    outcome = outcome or OUTCOMES.get(code, f"exited {code}")
    event = todo[0][0]
    try:
        env = {**os.environ, **environment(spec, store, code, outcome)}
        log = log_path(spec.name)
        for event, cmd in todo:
            problem = run_one(event, cmd, {**env, "MOESWEEP_HOOK": event}, hooks, log)
            if problem:
                _warn(console, f"hook {event} ({shown_command(cmd)}) {problem}")
    except KeyboardInterrupt:
        _warn(console, f"hook {event} interrupted (Ctrl-C): stopped, and the hooks after it skipped")
    except Exception as e:  # a hook is an extra: whatever went wrong, the launch's outcome stands
        _warn(console, f"hook {event} could not run: {_first_line(e)}")


def run_one(event: str, cmd: str | list[str], env: dict[str, str], hooks: Hooks, log: Path) -> str | None:
    """Run one hook; None when it exited 0, else what went wrong (for one warning line). Ctrl-C while it
    runs stops its process group and is raised again."""
    argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
    where = f"its output: {log}"
    try:
        log.parent.mkdir(parents=True, exist_ok=True)
        out: Any = log.open("ab")
    except OSError as e:
        out, where = None, f"its output is not kept: cannot write {log}: {e.strerror or e}"
    try:
        _note(
            out,
            f"{time.strftime('%Y-%m-%d %H:%M:%S')} {event}, exit {env['MOESWEEP_EXIT_CODE']}: {shown_command(cmd, None)}",
        )
        try:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out if out is not None else subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # its own process group: stopped as one, out of reach of Ctrl-C
                close_fds=True,
            )
        except OSError as e:
            what = f"{e.strerror}: {e.filename}" if e.strerror and e.filename else e.strerror or str(e)
            status = f"could not start: {what}"
        except ValueError as e:  # e.g. a variable of the launch's environment that exec refuses
            status = f"could not start: {e}"
        else:
            try:
                rc = proc.wait(timeout=hooks.timeout_s)
            except subprocess.TimeoutExpired:
                stop(proc)
                status = f"timed out after {hooks.timeout_s:g}s and was stopped"
            except BaseException:
                stop(proc)
                _note(out, f"{event} interrupted: stopped")
                raise
            else:
                status = f"was killed by signal {-rc}" if rc < 0 else f"exited {rc}"
                if rc == 0:
                    _note(out, f"{event} exited 0")
                    return None
        _note(out, f"{event} {status}")
        return f"{status}; {where}"
    finally:
        if out is not None:
            out.close()


def _note(out: Any, line: str) -> None:
    """A line of the hook log of its own (a header, an outcome), after what the hook wrote."""
    if out is not None:
        out.write(f"==== {one_line(line)}\n".encode())
        out.flush()


def stop(proc: subprocess.Popen) -> None:
    """Stop a hook's whole process group: SIGTERM, then SIGKILL once the hook ended or KILL_GRACE_S passed
    (what it started in the background is stopped too)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        if sig == signal.SIGTERM:
            try:
                proc.wait(timeout=KILL_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
    try:
        proc.wait(timeout=KILL_GRACE_S)
    except subprocess.TimeoutExpired:  # a process that SIGKILL does not end (uninterruptible I/O)
        pass


def _warn(console: Console, message: str) -> None:
    console.print(f"[yellow]warning:[/] {escape(one_line(message))}", highlight=False, soft_wrap=True)
