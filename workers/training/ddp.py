"""Multi-process distillation: the same loop and losses as `workers.training.distill`, data-parallel over ranks.

Every rank holds the frozen teacher and a replica of the student wrapped in torch's
DistributedDataParallel (backend nccl on GPUs, gloo on CPU). Every rank reads the same global
micro-batches [batch_size, seq_len] and keeps its own contiguous rows (batch_size must be divisible
by the number of ranks); DDP averages the gradients, so one optimizer step equals the single-process
step on the same global batch (tests/test_distill.py checks this with 2 gloo processes). Validation
windows are split across ranks and the NLL sums are all-reduced. Gradient sync is skipped on
accumulation micro-batches (``no_sync``).

How a run uses it
-----------------
The distill stage (a Ray job holding the GPUs of one node) writes a job file and launches torchrun::

    job = {"student": "<dir of the initial student (save_pretrained)>", "teacher": "<teacher dir or HF id>",
           "teacher_dtype": "bfloat16", "moe_teacher": true,
           "train": "<train.pt: LongTensor [steps·grad_accum·batch_size, seq_len]>", "val": "<val.pt>",
           "spec": {...DistillSpec fields...}, "out": "<dir>",
           "sharding": "ddp" | "fsdp", "teacher_offload": false}   # fsdp: workers/training/fsdp.py
    result = workers.training.ddp.launch(job, workdir, nproc=torch.cuda.device_count())
    # = python -m torch.distributed.run --standalone --nproc_per_node=N -m workers.training.ddp <workdir>/job.json
    # rank 0 writes <out>/student (save_pretrained) and <out>/result.json (what `distill` returns)

On a multi-node Ray cluster the same per-rank function runs under Ray Train, which creates the
process group itself::

    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer
    TorchTrainer(lambda cfg: workers.training.ddp.run_job(cfg), train_loop_config=job,
                 scaling_config=ScalingConfig(num_workers=8, use_gpu=True)).fit()

Memory: each GPU holds the whole teacher (e.g. Qwen3-30B-A3B in bf16 ≈ 61 GB) plus the student with
fp32 master weights, gradients and AdamW moments (16 bytes/parameter: ≈ 53 GB for the 3.3B student),
DDP's bucket copy of the gradients and autocast's bf16 weights: the paper's setting fits neither 80 GB
nor 141 GB cards (workers/training/memory_model.py). ``job["sharding"] = "fsdp"`` shards both (workers/training/fsdp.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from workers.training.distill import LOSSES, DistillSpec, KDStudent, train_loop
from workers.training.ranks import DistRanks


def distill_worker(
    student: nn.Module,
    teacher: nn.Module,
    adapter: Any,
    batches: Iterable[torch.Tensor],
    val: torch.Tensor,
    spec: DistillSpec,
    progress: Callable[[int, int], None] | None = None,
    on_val: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """`workers.training.distill.distill` on one rank of an initialised process group; every rank gets the
    same global `batches` and the same result (progress/on_val are called on rank 0 only)."""
    if not dist.is_initialized():
        raise ValueError("distill_worker: no process group; call torch.distributed.init_process_group first")
    ranks = DistRanks()
    dtype = next(student.parameters()).dtype
    student.float()  # fp32 master weights, as in `distill`
    device = next(student.parameters()).device
    kd = KDStudent(student, LOSSES[spec.loss], spec.tau, spec.hidden_weight, spec.logit_chunk)
    wrapped = DistributedDataParallel(kd, device_ids=[device.index] if device.type == "cuda" else None)
    lead = ranks.rank == 0
    try:
        return train_loop(
            student,
            wrapped,
            teacher,
            adapter,
            batches,
            val,
            spec,
            progress if lead else None,
            on_val if lead else None,
            ranks=ranks,
        )
    finally:
        student.to(dtype)


# ---- one rank of a launched job ---------------------------------------------------------------------
def _device() -> torch.device:
    if not torch.cuda.is_available():
        return torch.device("cpu")
    if "LOCAL_RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    return torch.device("cuda", torch.cuda.current_device())


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    """Run one rank of a job (see the module docstring); initialises the process group unless a launcher
    (Ray Train) already did. Rank 0 saves the student and result.json under job["out"]."""
    from transformers import AutoModelForCausalLM

    import workers.models.edited_model  # noqa: F401  (registers edited-MoE checkpoints with the Auto classes)

    sharding = job.get("sharding", "ddp")
    if sharding not in ("ddp", "fsdp"):
        raise ValueError(f"job.sharding: {sharding!r} is not allowed; allowed: ddp, fsdp")
    own_group = not dist.is_initialized()
    device = _device()
    if own_group:
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    # FSDP: loaded on the CPU; fully_shard moves each unit's shard to the device, so no rank holds it all
    place = device if sharding == "ddp" else torch.device("cpu")
    try:
        spec = DistillSpec(**job["spec"])
        teacher = (
            AutoModelForCausalLM.from_pretrained(
                job["teacher"], dtype=getattr(torch, job.get("teacher_dtype", "float32"))
            )
            .to(place)
            .eval()
        )
        student = AutoModelForCausalLM.from_pretrained(job["student"], dtype=torch.float32).to(place)
        adapter = None
        if job.get("moe_teacher", True):
            from workers.families import get_adapter

            adapter = get_adapter(teacher)
        train = torch.load(job["train"], weights_only=True)
        val = torch.load(job["val"], weights_only=True)
        batches = (train[i : i + spec.batch_size] for i in range(0, train.shape[0], spec.batch_size))
        out = Path(job["out"])
        if sharding == "fsdp":
            from workers.training.fsdp import fsdp_worker, save_student

            result = fsdp_worker(
                student, teacher, adapter, batches, val, spec, bool(job.get("teacher_offload"))
            )
            save_student(student, out / "student")  # collective: rank 0 gathers and writes
        else:
            result = distill_worker(student, teacher, adapter, batches, val, spec)
            if dist.get_rank() == 0:
                student.save_pretrained(out / "student")
        if dist.get_rank() == 0:
            out.mkdir(parents=True, exist_ok=True)
            (out / "result.json").write_text(json.dumps(result, indent=1))
        dist.barrier()
        return result
    finally:
        if own_group:
            dist.destroy_process_group()


def launch(
    job: dict[str, Any],
    workdir: str | Path,
    nproc: int,
    timeout: float | None = None,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Run `job` on `nproc` local processes with torchrun and return rank 0's result."""
    if nproc < 1:
        raise ValueError(f"nproc: {nproc} is not allowed; allowed: an integer >= 1")
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "job.json"
    path.write_text(json.dumps(job, indent=1))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "workers.training.ddp",
        str(path),
    ]
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        cwd=Path(__file__).resolve().parent.parent,
    )
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout)[-4000:]
        raise RuntimeError(f"torchrun exited with {proc.returncode}:\n{tail}")
    return json.loads((Path(job["out"]) / "result.json").read_text())


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: python -m workers.training.ddp JOB.json  (launched by torchrun)")
    run_job(json.loads(Path(args[0]).read_text()))


if __name__ == "__main__":
    main()
