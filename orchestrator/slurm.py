"""`moesweep slurm NAME`: an sbatch script that runs a sweep on a Slurm allocation.

Inside the allocation the script starts a Ray cluster (the head on the first node, one worker per other
node, each by `srun`), waits until every node has joined, launches the sweep against it, and stops the
cluster whatever the launch's outcome, exiting with the launch's code. The database must be one every
node reaches (PostgreSQL: `MOESWEEP_DB`) and `MOESWEEP_HOME` (or the sweep's artifact root) shared, as
in any cluster run; the script refuses to start without `MOESWEEP_DB`. A resubmitted script resumes the
sweep: finished jobs are skipped.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field

TIME = re.compile(
    r"^(\d+-)?\d{1,3}(:\d{2}){0,2}$"
)  # Slurm's --time forms: MM, MM:SS, HH:MM:SS, D-HH[:MM[:SS]]


@dataclass
class SlurmJob:
    sweep: str  # a sweep name or sweep file path, as `moesweep launch` takes it
    nodes: int = 1
    gpus_per_node: int = 0
    cpus_per_node: int = 8
    time: str = "24:00:00"
    partition: str | None = None
    account: str | None = None
    resources: dict[str, float] = field(default_factory=dict)  # Ray custom resources per node
    port: int = 6379
    workdir: str = "."  # the moesweep checkout every node sees
    venv: str = ".venv"
    launch_args: list[str] = field(default_factory=list)  # e.g. ["--set", "grid.K=[4,8]"]

    def check(self) -> None:
        """One-line ValueError naming the option that is wrong."""
        if self.nodes < 1:
            raise ValueError(f"--nodes {self.nodes}: allowed: 1 or more")
        if self.gpus_per_node < 0:
            raise ValueError(f"--gpus-per-node {self.gpus_per_node}: allowed: 0 or more")
        if self.cpus_per_node < 1:
            raise ValueError(f"--cpus-per-node {self.cpus_per_node}: allowed: 1 or more")
        if not TIME.match(self.time):
            raise ValueError(f"--time {self.time!r}: allowed: Slurm's forms, e.g. 90, 12:00:00, 2-00:00:00")
        if not 1 <= self.port <= 65535:
            raise ValueError(f"--port {self.port}: allowed: 1 to 65535")
        for k, v in self.resources.items():
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k) or not isinstance(v, int | float) or v <= 0:
                raise ValueError(f"--resources {k}={v!r}: allowed: NAME=positive number")


def render(job: SlurmJob) -> str:
    """The sbatch script for `job` (checked first)."""
    job.check()
    q = shlex.quote
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", job.sweep.rsplit("/", 1)[-1].removesuffix(".yaml"))[:60]
    sbatch = [
        f"#SBATCH --job-name=moesweep-{name}",
        f"#SBATCH --nodes={job.nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --cpus-per-task={job.cpus_per_node}",
        f"#SBATCH --time={job.time}",
        f"#SBATCH --output=moesweep-{name}-%j.out",
    ]
    if job.gpus_per_node:
        sbatch.insert(3, f"#SBATCH --gpus-per-node={job.gpus_per_node}")
    if job.partition:
        sbatch.append(f"#SBATCH --partition={job.partition}")
    if job.account:
        sbatch.append(f"#SBATCH --account={job.account}")
    res = f" --resources {q(json.dumps(job.resources, sort_keys=True))}" if job.resources else ""
    node_args = f"--num-cpus {job.cpus_per_node} --num-gpus {job.gpus_per_node}{res}"
    launch = " ".join(
        ["moesweep", "launch", q(job.sweep), '--address "$HEAD_IP:$PORT"', *map(q, job.launch_args)]
    )
    return f"""#!/bin/bash
# Written by `moesweep slurm`: a Ray cluster on this allocation (head on the first node, a worker on each
# other node), then `moesweep launch` against it; the cluster is stopped whatever the launch's outcome.
{chr(10).join(sbatch)}
set -uo pipefail
cd {q(job.workdir)} || exit 2
source {q(job.venv)}/bin/activate || exit 2
: "${{MOESWEEP_DB:?set MOESWEEP_DB to a database every node reaches (PostgreSQL)}}"
export MOESWEEP_DB
PORT={job.port}
WAIT=${{MOESWEEP_SLURM_WAIT:-240}}  # seconds to wait for the head, then for every node to join
mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
HEAD=${{NODES[0]}}
HEAD_IP=$(srun --nodes=1 --ntasks=1 -w "$HEAD" hostname --ip-address | awk '{{print $1}}')
echo "moesweep: Ray head on $HEAD ($HEAD_IP:$PORT), {job.nodes} node(s)"
srun --nodes=1 --ntasks=1 -w "$HEAD" ray start --head --node-ip-address "$HEAD_IP" --port "$PORT" \\
  {node_args} --block &
PIDS=($!)
stop() {{ kill "${{PIDS[@]}}" 2>/dev/null; wait 2>/dev/null; }}
trap stop EXIT
alive() {{ python -c "import ray, sys; ray.init(address=sys.argv[1], logging_level='ERROR'); \
print(sum(1 for n in ray.nodes() if n['Alive']))" "$HEAD_IP:$PORT" 2>/dev/null | tail -n 1; }}
for _ in $(seq $((WAIT / 2 + 1))); do [ "$(alive)" -ge 1 ] 2>/dev/null && break; sleep 2; done
for NODE in "${{NODES[@]:1}}"; do
  srun --nodes=1 --ntasks=1 -w "$NODE" ray start --address "$HEAD_IP:$PORT" {node_args} --block &
  PIDS+=($!)
done
JOINED=0
for _ in $(seq $((WAIT / 2 + 1))); do
  JOINED=$(alive); JOINED=${{JOINED:-0}}
  [ "$JOINED" -ge {job.nodes} ] 2>/dev/null && break
  sleep 2
done
if ! [ "$JOINED" -ge {job.nodes} ] 2>/dev/null; then
  echo "moesweep: only $JOINED of {job.nodes} nodes joined the Ray cluster; not launching" >&2
  exit 3
fi
{launch}
CODE=$?
echo "moesweep: launch exited $CODE"
exit $CODE
"""
