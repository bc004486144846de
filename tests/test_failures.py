"""Failures surface everywhere: a job whose log cannot be written still runs or fails and is recorded;
every launch that waits on (or finds) a failed job lists it and exits non-zero; `status` tells dead
owners from live ones; a long job is heartbeated while it runs, so a second launch waits for it
instead of running it again."""

from __future__ import annotations

import errno
import io
import socket
import threading
import time
from pathlib import Path

from rich.console import Console
from typer.testing import CliRunner

import workers.run.calibrate
import workers.run.convert
from db.store import Store
from orchestrator import execute
from orchestrator.cli import app
from orchestrator.execute import SerialExecutor, run_payload
from orchestrator.launch import launch
from orchestrator.spec import load_spec
from tests.test_orchestrator import fake, fake_sweep  # noqa: F401  (the fake stage functions fixture)

HERE = Path(__file__).parent


def chatty_job(payload, cache, progress):
    print("loading the model ...")
    if payload["params"].get("fail"):
        raise ValueError("boom: the job's own error")
    return {"outputs": {"ok": 1}}


def _payload(tmp_path: Path, log_path: str, fail: bool) -> dict:
    return {
        "key": "k" * 32,
        "stage": "toy",
        "run": "tests.test_failures:chatty_job",
        "params": {"fail": fail},
        "inputs": {},
        "workdir": str(tmp_path / "work"),
        "log_path": log_path,
    }


class FullDisk:
    """A log file on a disk that just filled up: every write and flush fails with ENOSPC."""

    def write(self, text):
        raise OSError(errno.ENOSPC, "No space left on device")

    flush = write

    def close(self):
        pass


def test_a_job_whose_log_cannot_be_written_still_runs_and_its_error_is_kept(tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    nowhere = str(blocker / "logs" / "x.log")  # its folder cannot be made: a file is in the way
    result, err = run_payload(_payload(tmp_path, nowhere, fail=False), {}, None)
    assert err is None and result["outputs"] == {"ok": 1}
    result, err = run_payload(_payload(tmp_path, nowhere, fail=True), {}, None)
    assert result is None and "ValueError: boom: the job's own error" in err
    assert "its log is incomplete: cannot write the log" in err.splitlines()[-1]

    monkeypatch.setattr(execute, "open", lambda *a, **k: FullDisk(), raising=False)  # opens, then fills up
    result, err = run_payload(_payload(tmp_path, str(tmp_path / "x.log"), fail=True), {}, None)
    assert result is None and "boom" in err and "No space left on device" in err.splitlines()[-1]


def _launch(store: Store, sweep: Path, console: Console | None = None, **kw) -> int:
    spec, path, text = load_spec(str(sweep))
    return launch(
        spec,
        text,
        store,
        SerialExecutor(),
        console=console or Console(quiet=True),
        show_progress=False,
        path=str(path),
        **kw,
    )


def test_a_full_disk_while_a_job_fails_records_it_failed_and_the_launch_goes_on(fake, monkeypatch):  # noqa: F811
    calls, state = fake
    real_open = open

    def no_space(path, *a, **k):
        if str(path).endswith(".log"):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_open(path, *a, **k)

    monkeypatch.setattr(execute, "open", no_space, raising=False)
    store = Store(state["db"])
    assert _launch(store, state["sweep"]) == 1  # the deliberately failing conversions, nothing else
    failed = store.query("SELECT stage, error FROM jobs WHERE status = 'failed'")[1]
    assert len(failed) == 2 and all(
        s == "convert" and "boom" in e and "No space left" in e for s, e in failed
    )
    assert store.query("SELECT COUNT(*) FROM jobs WHERE status IN ('running', 'pending')")[1] == [(0,)]
    assert {s for s, _ in calls} == {"calibrate", "convert", "ppl_pre", "distill", "evaluate"}  # it went on


def _thread(results: dict, name: str, store_url: str, sweep: Path, **kw) -> threading.Thread:
    def run():
        buf = io.StringIO()
        try:
            results[name] = _launch(
                Store(store_url, migrate=False), sweep, Console(file=buf, width=300), **kw
            )
        finally:
            results[name + "_out"] = buf.getvalue()
            results[name + "_end"] = time.monotonic()

    return threading.Thread(target=run, name=name)


def _wait_running(store: Store, stage: str, owner: str, timeout: float = 60) -> None:
    t0 = time.monotonic()
    while not store.query(
        "SELECT 1 FROM jobs WHERE stage = :s AND status = 'running' AND owner = :o", {"s": stage, "o": owner}
    )[1]:
        assert time.monotonic() - t0 < timeout, f"no {stage} job running for {owner}"
        time.sleep(0.02)


def test_a_launch_waiting_on_a_job_that_fails_elsewhere_lists_it_and_exits_non_zero(
    fake,  # noqa: F811
    monkeypatch,
    tmp_path,
):
    calls, state = fake
    slow_fail = workers.run.convert.stage_convert

    def convert(p, cache, progress):
        if p["params"]["scoring"] == "CP" and p["params"]["K"] == 4:
            time.sleep(2.0)  # long enough for the other launch to be waiting on it
        return slow_fail(p, cache, progress)

    monkeypatch.setattr("workers.run.convert.stage_convert", convert)
    sweep = fake_sweep(
        tmp_path,
        (HERE / "sweeps" / "fake.yaml")
        .read_text()
        .replace("execution: {retries: 1}", "execution: {retries: 0}"),
    )
    store = Store(state["db"])
    res: dict = {}
    a = _thread(res, "a", state["db"], sweep, owner="host-a:1", heartbeat_s=0.2, stale_after_s=30)
    a.start()
    _wait_running(store, "convert", "host-a:1")
    b = _thread(res, "b", state["db"], sweep, owner="host-b:2", heartbeat_s=0.2, stale_after_s=30)
    b.start()
    a.join(120)
    b.join(120)
    failed = [k for (k,) in store.query("SELECT key FROM jobs WHERE status = 'failed'")[1]]
    assert len(failed) == 2
    owners = {o for (o,) in store.query("SELECT owner FROM jobs WHERE status = 'failed'")[1]}
    assert res["a"] == 1 and res["b"] == 1, (res["a_out"], res["b_out"])
    for name in ("a", "b"):  # whichever launch ran a failing job, both list both failures
        out = res[name + "_out"]
        assert "2 job(s) failed" in out and all(
            f"convert {k[:12]}: ValueError: boom" in out for k in failed
        ), out
    assert "host-a:1" in owners  # (a ran at least the first one; b waited on it)
    assert len([k for s, k in calls if s == "convert" and k in failed]) == 2  # each failing job ran once


def test_a_long_job_is_heartbeated_so_a_second_launch_waits_instead_of_running_it_again(fake, monkeypatch):  # noqa: F811
    calls, state = fake
    quick = workers.run.calibrate.stage_calibrate

    def calibrate(p, cache, progress):
        time.sleep(3.0)  # the serial executor's thread is busy here: only the heartbeat thread beats
        state["calibrated_at"] = time.monotonic()
        return quick(p, cache, progress)

    monkeypatch.setattr("workers.run.calibrate.stage_calibrate", calibrate)
    state["fail"] = False

    def two_launches(db: str, heartbeat_s: float) -> dict:
        store = Store(db)
        res: dict = {}
        a = _thread(
            res, "a", db, state["sweep"], owner="host-a:1", heartbeat_s=heartbeat_s, stale_after_s=1.0
        )
        a.start()
        _wait_running(store, "calibrate", "host-a:1")
        b = _thread(
            res, "b", db, state["sweep"], owner="host-b:2", heartbeat_s=heartbeat_s, stale_after_s=1.0
        )
        b.start()
        a.join(120)
        b.join(120)
        res["calibrations"] = sum(1 for s, _ in calls if s == "calibrate")
        calls.clear()
        return res

    res = two_launches(state["db"], heartbeat_s=0.2)
    assert res["a"] == 0 and res["b"] == 0, (res["a_out"], res["b_out"])
    assert res["calibrations"] == 1  # b waited for it, never ran it
    assert res["b_end"] > state["calibrated_at"]  # and went on only once a's calibration was done
    store = Store(state["db"])
    assert store.query("SELECT owner FROM jobs WHERE stage = 'calibrate'")[1] == [("host-a:1",)]

    # the control: without heartbeats while it runs, the second launch takes the job over and runs it again
    res = two_launches(state["db"].replace("r.db", "control.db"), heartbeat_s=100)
    assert res["calibrations"] == 2


def test_status_marks_jobs_of_dead_owners(fake):  # noqa: F811
    calls, state = fake
    state["fail"] = False
    store = Store(state["db"])
    assert _launch(store, state["sweep"]) == 0
    keys = [k for (k,) in store.query("SELECT key FROM jobs WHERE stage = 'convert' ORDER BY key")[1]]
    gone_here = f"{socket.gethostname()}:999999"  # this host, a process that has ended
    with store.tx() as c:
        for key, owner, age in (
            (keys[0], gone_here, "0 seconds"),
            (keys[1], "elsewhere:1", "-2 hours"),
            (keys[2], "elsewhere:2", "0 seconds"),
        ):
            c.exec_driver_sql(
                "UPDATE jobs SET status = 'running', owner = ?, "
                f"heartbeat_at = datetime('now', '{age}') WHERE key = ?",
                (owner, key),
            )
    r = CliRunner().invoke(app, ["status", "fake", "--db", state["db"]])
    assert r.exit_code == 0, r.output
    assert "dead = 2 job(s) marked running whose launch is gone" in r.output.replace("\n", " ")
    row = next(ln for ln in r.output.splitlines() if ln.strip("│ ").startswith("convert"))
    cells = [c.strip() for c in row.strip("│").split("│")]
    assert cells[:4] == ["convert", str(len(keys) - 3), "1", "2"]  # succeeded, running, dead
