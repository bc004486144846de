"""execution.hooks: commands run when a launch ends (orchestrator/hooks.py), with the fake stage functions."""

from __future__ import annotations

import io
import json
import shlex
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from db.store import Store
from orchestrator.execute import SerialExecutor
from orchestrator.launch import launch
from orchestrator.spec import SpecError, load_spec
from tests.test_orchestrator import HERE, fake, fake_sweep  # noqa: F401  (the fake stage functions fixture)

BASE = (HERE / "sweeps" / "fake.yaml").read_text()
DUMP = """import json, os, sys
json.dump({k: v for k, v in os.environ.items() if k.startswith("MOESWEEP_")}, open(sys.argv[1], "w"))
print("hook output for the log")
"""


def _with_hooks(tmp_path: Path, hooks: str) -> Path:
    """The fake sweep with `execution.hooks: {hooks}` (and no retries: each failure is tried once)."""
    text = BASE.replace("execution: {retries: 1}", f"execution: {{retries: 0, hooks: {hooks}}}")
    assert "hooks" in text
    return fake_sweep(tmp_path, text)


def _dumping(tmp_path: Path, **extra: str) -> str:
    """Hooks that write their MOESWEEP_* environment to OUT/<event>.json: on_failure through the shell (a
    string), on_end and on_success as argv lists."""
    dump = tmp_path / "dump.py"
    dump.write_text(DUMP)
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    argv = lambda event: json.dumps([sys.executable, str(dump), str(out / f"{event}.json")])  # noqa: E731
    shell = f"{shlex.quote(sys.executable)} {shlex.quote(str(dump))} {shlex.quote(str(out))}/failure.json"
    hooks = {"on_end": argv("end"), "on_success": argv("success"), "on_failure": json.dumps(shell), **extra}
    return "{" + ", ".join(f"{k}: {v}" for k, v in hooks.items()) + "}"


def _run(store: Store, sweep: Path, **kw) -> tuple[int, list[str]]:
    """(exit code, the lines the launch wrote on its console)."""
    spec, path, text = load_spec(str(sweep))
    buf = io.StringIO()
    console = Console(file=buf, width=300, color_system=None)
    code = launch(
        spec, text, store, SerialExecutor(), console=console, show_progress=False, path=str(path), **kw
    )
    return code, buf.getvalue().splitlines()


def _seen(tmp_path: Path) -> dict[str, dict[str, str]]:
    """{event: the environment its hook saw}, and the files removed for the next launch."""
    out = {}
    for f in sorted((tmp_path / "out").glob("*.json")):
        out[f.stem] = json.loads(f.read_text())
        f.unlink()
    return out


def _db_counts(store: Store) -> dict[str, str]:
    rows = store.query("SELECT status, COUNT(*) FROM jobs GROUP BY status")[1]
    by = dict(rows)
    done = by.get("succeeded", 0) + by.get("failed", 0)
    return {
        "MOESWEEP_JOBS_SUCCEEDED": str(by.get("succeeded", 0)),
        "MOESWEEP_JOBS_FAILED": str(by.get("failed", 0)),
        "MOESWEEP_JOBS_PENDING": str(sum(by.values()) - done),
    }


def test_hooks_get_the_exit_code_and_the_counts(fake, tmp_path):  # noqa: F811
    calls, state = fake
    sweep = _with_hooks(tmp_path, _dumping(tmp_path))
    store = Store(state["db"])
    code, lines = _run(store, sweep)
    assert code == 1  # the deliberately failing conversions
    seen = _seen(tmp_path)
    assert set(seen) == {"failure", "end"}  # on_success did not run
    counts = _db_counts(store)
    assert counts["MOESWEEP_JOBS_FAILED"] == "2" and counts["MOESWEEP_JOBS_SUCCEEDED"] != "0"
    for event, env in seen.items():
        assert env["MOESWEEP_HOOK"] == {"failure": "on_failure", "end": "on_end"}[event]
        assert env["MOESWEEP_SWEEP"] == "fake" and env["MOESWEEP_EXIT_CODE"] == "1"
        assert env["MOESWEEP_DB"] == state["db"]
        assert {k: env[k] for k in counts} == counts
        summary = env["MOESWEEP_SUMMARY"]
        assert "\n" not in summary and summary.startswith("moesweep launch fake: ")
        assert "(exit 1)" in summary and f"{counts['MOESWEEP_JOBS_FAILED']} failed" in summary
    assert not [ln for ln in lines if "warning" in ln]
    log = tmp_path / "home" / "logs" / "hooks" / "fake.log"
    assert log.read_text().count("hook output for the log") == 2

    state["fail"] = False
    code, lines = _run(store, sweep, retry_failed=True)
    assert code == 0
    seen = _seen(tmp_path)
    assert set(seen) == {"success", "end"}  # on_failure did not run
    assert all(env["MOESWEEP_EXIT_CODE"] == "0" for env in seen.values())
    counts = _db_counts(store)
    assert counts["MOESWEEP_JOBS_FAILED"] == counts["MOESWEEP_JOBS_PENDING"] == "0"
    assert all({k: env[k] for k in counts} == counts for env in seen.values())
    assert not [ln for ln in lines if "warning" in ln]


def _gone(pid: int) -> bool:
    """Whether process `pid` has ended (a zombie nobody reaped yet counts as ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")


def test_a_failing_or_hanging_hook_is_one_warning_and_changes_nothing(fake, tmp_path):  # noqa: F811
    calls, state = fake
    pidfile = tmp_path / "bg.pid"
    # on_failure leaves a child in the background and hangs: both are stopped at the timeout
    hang = json.dumps(f"sleep 300 & echo $! > {shlex.quote(str(pidfile))}; wait")
    sweep = _with_hooks(
        tmp_path, f"{{on_failure: {hang}, on_end: 'echo to the log; exit 3', timeout_s: 0.5}}"
    )
    store = Store(state["db"])
    code, lines = _run(store, sweep)
    assert code == 1  # as without hooks
    warnings = [ln for ln in lines if "warning:" in ln]
    assert len(warnings) == 2, lines
    assert "hook on_failure" in warnings[0] and "timed out after 0.5s" in warnings[0]
    assert "hook on_end" in warnings[1] and "exited 3" in warnings[1]
    log = tmp_path / "home" / "logs" / "hooks" / "fake.log"
    assert all(str(log) in w for w in warnings) and "to the log" in log.read_text()
    pid = int(pidfile.read_text())
    deadline = time.monotonic() + 30  # a bound on the wait, not a timing check
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(pid), "the hook's background child outlived the timeout"
    # what the launch computed is kept: the failed jobs are recorded as without hooks
    assert store.query("SELECT COUNT(*) FROM jobs WHERE status = 'failed'")[1] == [(2,)]

    state["fail"] = False
    missing = json.dumps([str(tmp_path / "no-such-program")])
    sweep = _with_hooks(tmp_path, f"{{on_success: {missing}}}")
    code, lines = _run(store, sweep, retry_failed=True)
    assert code == 0
    warnings = [ln for ln in lines if "warning:" in ln]
    assert len(warnings) == 1 and "hook on_success" in warnings[0] and "could not start" in warnings[0]


def test_an_interrupted_or_crashed_launch_runs_on_failure_and_on_end(fake, tmp_path, monkeypatch):  # noqa: F811
    calls, state = fake
    sweep = _with_hooks(tmp_path, _dumping(tmp_path))
    store = Store(state["db"])

    def interrupted(p, cache, progress):
        raise KeyboardInterrupt

    import workers.run.ppl_pre

    ppl_pre = workers.run.ppl_pre.stage_ppl_pre
    monkeypatch.setattr("workers.run.ppl_pre.stage_ppl_pre", interrupted)
    code, _ = _run(store, sweep)
    assert code == 130
    seen = _seen(tmp_path)
    assert set(seen) == {"failure", "end"}
    assert all(env["MOESWEEP_EXIT_CODE"] == "130" for env in seen.values())
    assert "interrupted" in seen["end"]["MOESWEEP_SUMMARY"]

    def crash(*a, **k):
        raise RuntimeError("a bug in the summary")

    monkeypatch.setattr("workers.run.ppl_pre.stage_ppl_pre", ppl_pre)
    monkeypatch.setattr("orchestrator.launch._summary", crash)
    with pytest.raises(RuntimeError):  # the crash still reaches the caller (a traceback, exit 1)
        _run(store, sweep)
    seen = _seen(tmp_path)
    assert set(seen) == {"failure", "end"}
    assert all(env["MOESWEEP_EXIT_CODE"] == "1" for env in seen.values())
    assert "crashed: RuntimeError: a bug in the summary" in seen["end"]["MOESWEEP_SUMMARY"]


def test_ctrl_c_during_a_hook_stops_it_and_skips_the_rest(fake, tmp_path):  # noqa: F811
    import os
    import signal
    import threading

    calls, state = fake
    # the hook says it runs, then hangs; the Ctrl-C (SIGINT to the launch's process) comes while it runs
    started = tmp_path / "hook-started"
    hang = f"touch {shlex.quote(str(started))}; sleep 300"
    sweep = _with_hooks(tmp_path, _dumping(tmp_path, on_failure=json.dumps(hang)))

    def ctrl_c() -> None:
        deadline = time.monotonic() + 120
        while not started.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(
            os.getpid(), signal.SIGINT
        )  # Python runs the handler in the main thread, inside the hook's wait

    threading.Thread(target=ctrl_c, daemon=True).start()
    code, lines = _run(Store(state["db"]), sweep)
    assert code == 1  # the launch's own code
    warnings = [ln for ln in lines if "warning:" in ln]
    assert len(warnings) == 1 and "hook on_failure interrupted (Ctrl-C)" in warnings[0], lines
    assert _seen(tmp_path) == {}  # on_end skipped


def test_a_refused_launch_and_a_dry_run_run_no_hook(fake, tmp_path, monkeypatch):  # noqa: F811
    calls, state = fake
    sweep = _with_hooks(tmp_path, _dumping(tmp_path))
    # refused as bad input before anything ran (a teacher folder that is not there): no hook
    bad = tmp_path / "bad" / "fake.yaml"
    bad.parent.mkdir()
    bad.write_text(sweep.read_text().replace(str(tmp_path / "teacher"), str(tmp_path / "nowhere")))
    spec, path, text = load_spec(str(bad))
    with pytest.raises(SpecError, match="teacher.model"):
        launch(spec, text, Store(state["db"]), SerialExecutor(), console=Console(quiet=True), path=str(path))
    assert _seen(tmp_path) == {}

    from orchestrator.cli import app

    monkeypatch.setenv("MOESWEEP_DB", f"sqlite:///{tmp_path}/dry.db")
    res = CliRunner().invoke(app, ["launch", str(sweep), "--dry-run"])
    assert res.exit_code == 0, res.output
    assert _seen(tmp_path) == {} and not calls


@pytest.mark.parametrize(
    "hooks, expect",
    [
        (
            "{on_fail: echo}",
            "execution.hooks.on_fail: unknown key; allowed: on_end, on_failure, on_success, timeout_s",
        ),
        ("{on_end: echo, timeout_s: 0}", "execution.hooks.timeout_s: Input should be greater than 0 (got 0)"),
        ("{timeout_s: '60'}", "execution.hooks.timeout_s: Input should be a valid number"),
        (
            "{on_end: 5}",
            "execution.hooks.on_end: expected a shell command (a string, run by sh -c) or an argv list",
        ),
        ("{on_end: ' '}", "execution.hooks.on_end: an empty command"),
        ("{on_failure: []}", "execution.hooks.on_failure: an empty list"),
        ("{on_success: [notify, 3]}", "execution.hooks.on_success: item 1 is 3"),
        ("notify-me", "execution.hooks: expected a mapping of on_end, on_failure, on_success, timeout_s"),
    ],
)
def test_a_bad_hooks_section_is_one_line(tmp_path, hooks, expect):
    f = tmp_path / "bad.yaml"
    f.write_text(BASE.replace("execution: {retries: 1}", f"execution: {{retries: 1, hooks: {hooks}}}"))
    with pytest.raises(SpecError) as e:
        load_spec(str(f))
    msg = str(e.value)
    assert msg.startswith(f"{f}: {expect}") and "\n" not in msg


def test_a_sweep_without_hooks_is_as_before():
    spec, _, _ = load_spec(str(HERE / "sweeps" / "fake.yaml"))
    assert spec.execution.hooks is None


def test_sigterm_stops_the_launch_like_ctrl_c_and_runs_the_hooks(fake, monkeypatch, tmp_path):  # noqa: F811
    """A batch system's time limit sends SIGTERM: the launch releases its jobs, runs on_failure and on_end
    with exit code 143 and restores the handler it replaced; nothing is left claimed."""
    import os
    import signal

    calls, state = fake
    sweep = _with_hooks(tmp_path, _dumping(tmp_path))
    store = Store(state["db"])

    def terminated(p, cache, progress):
        os.kill(os.getpid(), signal.SIGTERM)  # delivered to the main thread: the launch's handler
        time.sleep(5)  # the handler interrupts this
        raise AssertionError("SIGTERM did not interrupt the job")

    monkeypatch.setattr("workers.run.ppl_pre.stage_ppl_pre", terminated)
    before = signal.getsignal(signal.SIGTERM)
    code, _ = _run(store, sweep)
    assert code == 143
    assert signal.getsignal(signal.SIGTERM) is before
    seen = _seen(tmp_path)
    assert set(seen) == {"failure", "end"}
    assert all(env["MOESWEEP_EXIT_CODE"] == "143" for env in seen.values())
    assert "terminated (SIGTERM)" in seen["end"]["MOESWEEP_SUMMARY"]
    assert store.query("SELECT COUNT(*) FROM jobs WHERE status = 'running'")[1] == [(0,)]
