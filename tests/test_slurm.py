"""`moesweep slurm`: the sbatch script it writes, and what that script does on an allocation, run here with
stand-ins for Slurm (`scontrol`, `srun`), Ray's node count and `moesweep` that record each call."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from orchestrator.slurm import SlurmJob, render

SHIMS = {
    "scontrol": 'printf "gpu-a\\ngpu-b\\ngpu-c\\n"',
    # srun -w NODE CMD...: records the node and the command; `ray start --block` stays up until killed
    "srun": 'node=""; while [ "$1" != "${1#-}" ]; do [ "$1" = -w ] && { node=$2; shift; }; shift; done\n'
    'echo "srun $node $*" >> "$LOG"\n'
    'case "$*" in hostname*) echo "10.1.2.3 fe80::1";; *--block*) exec sleep 3017;; esac',
    # the number of nodes up: the `ray start` calls so far, unless NODES_UP fixes it
    "python": 'echo "python $*" >> "$LOG"; echo "${NODES_UP:-$(grep -c "ray start" "$LOG")}"',
    "moesweep": 'echo "moesweep $*" >> "$LOG"; exit "${LAUNCH_CODE:-0}"',
}


@pytest.fixture
def allocation(tmp_path):
    """A checkout folder whose `.venv/bin/activate` puts the stand-ins first on PATH."""
    bin_ = tmp_path / "venv" / "bin"
    bin_.mkdir(parents=True)
    for name, body in SHIMS.items():
        (bin_ / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_ / name).chmod(0o755)
    (bin_ / "activate").write_text(f'export PATH="{bin_}:$PATH"\n')
    return tmp_path


def _run(allocation: Path, script: str, **env: str) -> tuple[int, list[str], str]:
    path = allocation / "job.sbatch"
    path.write_text(script)
    log = allocation / "calls.log"
    log.write_text("")
    base = {k: v for k, v in os.environ.items() if k not in ("MOESWEEP_DB", "NODES_UP", "LAUNCH_CODE")}
    p = subprocess.run(
        ["bash", str(path)],
        env=base | {"LOG": str(log), "SLURM_JOB_NODELIST": "gpu-[a-c]", **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    return p.returncode, log.read_text().splitlines(), p.stdout + p.stderr


def _job(allocation: Path, **kw) -> SlurmJob:
    return SlurmJob("tiny", workdir=str(allocation), venv=str(allocation / "venv"), **kw)


def _sleepers(allocation: Path) -> int:
    out = subprocess.run(["pgrep", "-f", "sleep 3017"], capture_output=True, text=True).stdout.split()
    return len(out)


def test_the_script_starts_the_head_then_the_workers_then_launches_and_stops_the_cluster(allocation):
    before = _sleepers(allocation)
    job = _job(
        allocation, nodes=3, gpus_per_node=8, resources={"a100_80g": 8}, launch_args=["--set", "grid.K=[4,8]"]
    )
    code, calls, out = _run(
        allocation, render(job), MOESWEEP_DB="postgresql+psycopg://u@db/m", LAUNCH_CODE="7"
    )
    assert code == 7, out  # the launch's exit code is the job's
    srun = [c for c in calls if c.startswith("srun")]
    assert srun[0] == "srun gpu-a hostname --ip-address"
    assert srun[1].startswith(
        "srun gpu-a ray start --head --node-ip-address 10.1.2.3 --port 6379 --num-cpus 8"
    )
    assert '--num-gpus 8 --resources {"a100_80g": 8} --block' in srun[1]
    assert sorted(c.split()[1] for c in srun[2:]) == ["gpu-b", "gpu-c"]  # started in the background
    assert all("ray start --address 10.1.2.3:6379" in c for c in srun[2:])
    launch = [c for c in calls if c.startswith("moesweep")]
    assert launch == ["moesweep launch tiny --address 10.1.2.3:6379 --set grid.K=[4,8]"]
    assert calls.index(launch[0]) > calls.index(srun[-1])  # after every node joined
    deadline = time.monotonic() + 10
    while _sleepers(allocation) > before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _sleepers(allocation) == before  # every `ray start` step was stopped


def test_the_script_refuses_without_a_shared_database_and_when_nodes_do_not_join(allocation):
    job = _job(allocation, nodes=3)
    code, calls, out = _run(allocation, render(job))
    assert code != 0 and "set MOESWEEP_DB" in out and calls == []
    code, calls, out = _run(
        allocation,
        render(job),
        MOESWEEP_DB="postgresql+psycopg://u@db/m",
        NODES_UP="2",
        MOESWEEP_SLURM_WAIT="1",
    )
    assert code == 3 and "only 2 of 3 nodes joined" in out
    assert not [c for c in calls if c.startswith("moesweep")]


def test_the_sbatch_header_and_bad_options():
    text = render(
        SlurmJob(
            "sweeps/seed002-reap-qwen3-30b-a3b.yaml",
            nodes=2,
            gpus_per_node=4,
            time="2-00:00:00",
            partition="gpu",
            account="lab",
        )
    )
    header = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    assert header == [
        "#SBATCH --job-name=moesweep-seed002-reap-qwen3-30b-a3b",
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=4",
        "#SBATCH --cpus-per-task=8",
        "#SBATCH --time=2-00:00:00",
        "#SBATCH --output=moesweep-seed002-reap-qwen3-30b-a3b-%j.out",
        "#SBATCH --partition=gpu",
        "#SBATCH --account=lab",
    ]
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0
    for kw, msg in (
        ({"nodes": 0}, "--nodes 0"),
        ({"time": "tomorrow"}, "--time 'tomorrow'"),
        ({"port": 70000}, "--port 70000"),
        ({"resources": {"bad name": 1}}, "--resources bad name=1"),
    ):
        with pytest.raises(ValueError, match=msg):
            render(SlurmJob("tiny", **kw))


def test_the_command_writes_the_script_and_refuses_bad_input_in_one_line(tmp_path):
    from typer.testing import CliRunner

    from orchestrator.cli import app

    sweep = str(Path(__file__).parent / "sweeps" / "micro.yaml")
    out = tmp_path / "micro.sbatch"
    r = CliRunner().invoke(
        app, ["slurm", sweep, "--nodes", "2", "--resource", "a100_80g=8", "--out", str(out)]
    )
    assert r.exit_code == 0, r.output
    text = out.read_text()
    assert "#SBATCH --nodes=2" in text and "--resources '{\"a100_80g\": 8.0}'" in text
    assert f"moesweep launch {sweep} --address" in text
    for args, msg in (
        (["nonesuch-sweep"], "nonesuch-sweep"),
        ([sweep, "--resource", "a100"], "--resource 'a100'"),
        ([sweep, "--nodes", "0"], "--nodes 0"),
        ([sweep, "--out", str(out / "under-a-file")], f"--out {out / 'under-a-file'}: cannot write it:"),
    ):
        bad = CliRunner().invoke(app, ["slurm", *args])
        assert bad.exit_code == 2 and msg in bad.output and len(bad.output.strip().splitlines()) == 1, (
            bad.output
        )
