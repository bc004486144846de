"""A local Ray started by a launch ends with it: when the launch is SIGKILLed (its whole process group, as
a kill of a terminal's job does, or its process alone, as the OOM killer does), every process its Ray
started (gcs_server, raylet, agents, workers, idle workers) is killed by the watchdog, which then exits."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow

DRIVER = """
import os, sys, time
import ray
from orchestrator import execute
ex = execute.RayExecutor(num_cpus=1)
ex._start()
ray.get(execute._worker_actor(ray).options(num_cpus=1).remote(ex.hub, 1).__ray_ready__.remote())
print(execute._WATCHDOGS[0].pid, flush=True)
time.sleep(600)
"""


def _marked(token: bytes) -> set[int]:
    found = set()
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if token in Path(f"/proc/{d}/environ").read_bytes():
                    found.add(int(d))
            except OSError:
                pass
    return found


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the watchdog reads /proc")
@pytest.mark.parametrize("group", [True, False], ids=["process-group", "process-alone"])
def test_a_killed_launch_leaves_no_ray_process_behind(tmp_path, group):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "MOESWEEP_"))}
    env.update(PYTHONPATH=str(ROOT), MOESWEEP_HOME=str(tmp_path), OMP_NUM_THREADS="1")
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        watchdog = int(driver.stdout.readline())
        environ = Path(f"/proc/{watchdog}/cmdline").read_bytes().split(b"\0")
        token = next(a for a in environ if a.startswith(b"MOESWEEP_LOCAL_RAY="))
        ray_procs = _marked(token)
        names = {
            Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")[0].rsplit(b"/", 1)[-1] for p in ray_procs
        }
        assert {b"raylet", b"gcs_server"} <= names and b"ray::JobWorker" in {n.strip() for n in names}, names
    finally:
        if group:
            os.killpg(driver.pid, signal.SIGKILL)
        else:
            driver.kill()
        driver.wait()
    t0 = time.monotonic()
    while not _gone(watchdog) and time.monotonic() - t0 < 120:  # the watchdog exits once none is left
        time.sleep(0.1)
    assert _gone(watchdog)
    assert not [p for p in ray_procs if not _gone(p)]
    assert not _marked(token)
