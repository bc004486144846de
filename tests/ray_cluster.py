"""A two-node Ray cluster on this machine for the tests, and fake stage functions its workers can import.

`LocalCluster` starts a head node (`ray start --head --block`) and a worker node (`ray start --address
... --block`), each a process of its own with its own temporary folder, ports and resources, the way
the recipe in docs/scale.md starts them on separate machines. Every process either starts carries a token in
its environment; `stop()` ends both nodes (SIGTERM, then SIGKILL) and kills whatever still carries the
token, so nothing is left behind even when a test fails. No `ray stop`: it would end every Ray on the
machine. The fake stage functions stand in for the real ones in the workers (the launch is real).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TOKEN_ENV = "MOESWEEP_TEST_RAY_CLUSTER"
RAY = str(Path(sys.executable).parent / "ray")

NODES = """
import json, sys, time
import ray
ray.init(address=sys.argv[1], include_dashboard=False, log_to_driver=False, configure_logging=False)
t0 = time.monotonic()
while True:
    alive = [n for n in ray.nodes() if n["Alive"]]
    if len(alive) >= int(sys.argv[2]) or time.monotonic() - t0 > 120:
        break
    time.sleep(0.5)
print(json.dumps({n["NodeID"]: n["Resources"] for n in alive}))
"""

# a launch whose stage functions are this module's fakes: the registry's `run` references are swapped in
# the driver (workers resolve them by name); MOESWEEP_TEST_RAY_TEMP attaches the driver to the node with
# that temporary folder (as a launch on that node's machine would), else to the head
DRIVER = """
import dataclasses, functools, json, os, sys
import ray
from orchestrator import stage as S
from tests.ray_cluster import FAKES
if os.environ.get("MOESWEEP_TEST_RAY_TEMP"):
    ray.init = functools.partial(ray.init, _temp_dir=os.environ["MOESWEEP_TEST_RAY_TEMP"])
registered = S.stages()
for s in registered:
    S.unregister(s.name)
for s in registered:
    S.register(dataclasses.replace(s, run=FAKES[s.name]) if s.name in FAKES else s)
from orchestrator.cli import app
sys.argv = ["moesweep", *sys.argv[1:]]
try:
    app()
finally:
    if ray.is_initialized():
        print("driver-node", ray.get_runtime_context().get_node_id(), flush=True)
"""


def free_ports(n: int) -> list[int]:
    """`n` distinct TCP ports free on loopback right now."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class LocalCluster:
    """A head and a worker node; `address`, `nodes` ({node id: resources}), `head_temp`, `worker_temp`."""

    def __init__(self, head_resources: dict[str, float], worker_resources: dict[str, float]) -> None:
        self.token = uuid.uuid4().hex
        # short: Ray's unix sockets live under it (at most 107 bytes)
        self.top = Path(tempfile.mkdtemp(prefix="msray-", dir="/tmp" if os.path.isdir("/tmp") else None))
        self.head_temp, self.worker_temp = str(self.top / "h"), str(self.top / "w")
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "MOESWEEP_"))}
        self.env.update(
            {
                TOKEN_ENV: self.token,
                "PYTHONPATH": str(ROOT),
                "OMP_NUM_THREADS": "1",
                "RAY_USAGE_STATS_ENABLED": "0",
                "HF_HUB_OFFLINE": "1",
                "HF_DATASETS_OFFLINE": "1",
                # a token of its own (not ~/.ray/auth_token, which would switch the head to token
                # auth while a node started with --address stays without)
                "RAY_AUTH_MODE": "token",
                "RAY_AUTH_TOKEN": uuid.uuid4().hex + uuid.uuid4().hex,
            }
        )
        self.procs: list[subprocess.Popen] = []
        self.address = ""
        self.nodes: dict[str, dict[str, float]] = {}
        self.resources = (head_resources, worker_resources)

    def _node(self, name: str, args: list[str], resources: dict[str, float]) -> None:
        p = free_ports(24)
        cmd = [
            RAY,
            "start",
            "--block",
            "--num-cpus",
            "1",
            "--num-gpus",
            "0",
            "--resources",
            json.dumps(resources),
            "--node-ip-address",
            "127.0.0.1",
            "--object-store-memory",
            str(100 << 20),
            "--node-manager-port",
            str(p[0]),
            "--object-manager-port",
            str(p[1]),
            "--dashboard-agent-listen-port",
            str(p[2]),
            "--dashboard-agent-grpc-port",
            str(p[3]),
            "--metrics-export-port",
            str(p[4]),
            "--runtime-env-agent-port",
            str(p[5]),
            "--worker-port-list",
            ",".join(map(str, p[8:])),
            "--disable-usage-stats",
            *args,
        ]
        log = open(self.top / f"{name}.log", "w")  # noqa: SIM115  (the node's own output, kept for failures)
        self.procs.append(
            subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=self.top, start_new_session=True
            )
        )
        log.close()

    def start(self) -> LocalCluster:
        (gcs,) = free_ports(1)
        self.address = f"127.0.0.1:{gcs}"
        self._node(
            "head",
            ["--head", "--port", str(gcs), "--include-dashboard", "false", "--temp-dir", self.head_temp],
            self.resources[0],
        )
        self._wait_for_file(Path(self.head_temp) / "ray_current_cluster", "head")
        self._node("worker", ["--address", self.address, "--temp-dir", self.worker_temp], self.resources[1])
        out = subprocess.run(
            [sys.executable, "-c", NODES, self.address, "2"],
            capture_output=True,
            text=True,
            env=self.env,
            cwd=self.top,
            timeout=180,
        )
        if out.returncode != 0:
            raise RuntimeError(f"the cluster did not come up: {out.stderr[-2000:]}{self.logs()}")
        self.nodes = json.loads(out.stdout.strip().splitlines()[-1])
        if len(self.nodes) != 2:
            raise RuntimeError(f"expected 2 nodes, found {self.nodes}{self.logs()}")
        return self

    def _wait_for_file(self, path: Path, name: str, timeout: float = 120) -> None:
        t0 = time.monotonic()
        while not path.exists():
            if any(p.poll() is not None for p in self.procs) or time.monotonic() - t0 > timeout:
                raise RuntimeError(f"the {name} node did not start{self.logs()}")
            time.sleep(0.2)

    def node_with(self, resource: str) -> str:
        return next(n for n, res in self.nodes.items() if res.get(resource))

    def logs(self) -> str:
        return "".join(
            f"\n--- {f.name}\n{f.read_text(errors='replace')[-3000:]}" for f in sorted(self.top.glob("*.log"))
        )

    def stop(self) -> None:
        """Worker first, then head: SIGTERM (Ray's own clean-up), SIGKILL after 20 s; then every process
        still carrying this cluster's token."""
        for p in reversed(self.procs):
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        deadline = time.monotonic() + 30
        while (left := marked(self.token)) and time.monotonic() < deadline:
            for pid in left:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.2)
        shutil.rmtree(self.top, ignore_errors=True)


def marked(token: str) -> set[int]:
    """Live processes whose environment carries `TOKEN_ENV=token` (zombies excluded)."""
    needle, found = f"{TOKEN_ENV}={token}".encode(), set()
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if (
                    needle in Path(f"/proc/{d}/environ").read_bytes().split(b"\0")
                    and Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
                ):
                    found.add(int(d))
            except (OSError, IndexError):
                pass
    return found


def launch(
    cluster: LocalCluster | None,
    sweep: Path,
    db: str,
    home: Path,
    *,
    temp_dir: str | None = None,
    **popen: Any,
) -> subprocess.Popen:
    """`moesweep launch SWEEP --address ADDRESS --db DB` with the fake stages, as a process of its own
    (`cluster` None: `--executor serial`)."""
    env = {k: v for k, v in (cluster.env if cluster else os.environ).items() if k != TOKEN_ENV}
    env.update(MOESWEEP_HOME=str(home), PYTHONPATH=str(ROOT))  # (not the cluster's: stop() leaves it alone)
    if temp_dir:
        env["MOESWEEP_TEST_RAY_TEMP"] = temp_dir
    where = ["--address", cluster.address] if cluster else ["--executor", "serial"]
    return subprocess.Popen(
        [sys.executable, "-c", DRIVER, "launch", str(sweep), *where, "--db", db],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **popen,
    )


# a sweep for the fake stages (tests/test_orchestrator.py's fake_sweep points its teacher at a local config):
# 1 calibration (on a node with `head_only`), 4 conversions (on nodes with `gpu_like`), 4 perplexities
SWEEP = """name: cluster
description: fake stages on a two-node Ray cluster
teacher: {source: hf, model: fake/teacher, num_experts: 8, top_k: 2}
calibration: {n_samples: 4, seq_len: 8}
grid: {scoring: [SF, CP], grouping: [RR], dp_scaling: [uniform], K: [2, 4]}
execution:
  retries: 0
  resources: {calibrate: {cpus: 1, custom: {head_only: 1}}, convert: {cpus: 1, custom: {gpu_like: 1}}}
"""


# ---- fake stage functions: cheap, deterministic, and each run appends a line to $MOESWEEP_HOME/runs.jsonl --------
def _ran(p: dict[str, Any]) -> None:
    time.sleep(0.2)  # long enough for two launches of one sweep to overlap
    line = json.dumps({"stage": p["stage"], "key": p["key"], "pid": os.getpid()}) + "\n"
    with open(Path(p["home"]) / "runs.jsonl", "a") as f:
        f.write(line)


def _num(p: dict[str, Any]) -> float:
    """A number from what the job read (the same wherever the sweep's files are)."""
    digest = hashlib.sha256(json.dumps([p["stage"], p["inputs"]], sort_keys=True).encode()).hexdigest()
    return 10 + int(digest[:6], 16) % 1000 / 10


def calibrate(p, cache, progress):
    _ran(p)
    return {"outputs": {"stats": "fake"}}


def convert(p, cache, progress):
    _ran(p)
    q = p["params"]  # (as tests/test_orchestrator.py's fake: K = k makes every grouping one student)
    g = "*" if q["K"] == 2 else q.get("grouping")
    return {"outputs": {"plan_key": f"{q.get('output')}|{q['scoring']}|{g}|{q.get('dp_scaling')}|{q['K']}"}}


def ppl_pre(p, cache, progress):
    _ran(p)
    v = _num(p)
    return {"outputs": {"ppl": v}, "metrics": [{"name": "ppl", "stage": "pre", "value": v}]}


def distill(p, cache, progress):
    _ran(p)
    return {"outputs": {"path": "nowhere"}}


def evaluate(p, cache, progress):
    _ran(p)
    return {
        "outputs": {},
        "metrics": [{"name": "acc", "stage": "post", "task": "t", "value": _num(p) / 100, "headline": 1}],
    }


FAKES = {
    name: f"tests.ray_cluster:{name}" for name in ("calibrate", "convert", "ppl_pre", "distill", "evaluate")
}
