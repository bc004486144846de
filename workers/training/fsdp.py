"""Sharded distillation: the same loop and losses as `workers.training.distill`, with FSDP (torch's `fully_shard`).

Why FSDP2 and not DeepSpeed ZeRO-3: it is part of torch (no second runtime, no config file, no
engine that owns the optimizer step), so the loop in `workers.training.distill` runs unchanged, parameters are
plain DTensors that `clip_grad_norm_`, AdamW and the state-dict helpers understand, and it runs on
gloo/CPU, so the equality with the single-process loop is tested in CI without a GPU.

What is sharded (each of N ranks holds 1/N of it, dim-0 shards):

- the student's fp32 parameters (the master weights), their gradients and AdamW's moments: each
  decoder layer is its own FSDP unit, then the root (KDStudent: embeddings, final norm, LM head);
  a unit's parameters are all-gathered for its forward and again for its backward. On CUDA
  (``dtype`` auto/bf16) the gathered parameters are bf16 and gradients are reduce-scattered in fp32
  (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``); on CPU everything is fp32.
- the frozen teacher, inference only: each decoder layer, then its base model, resharded after every
  forward. Its LM head is left whole on every rank (the chunked KD loss multiplies by it outside the
  teacher's forward). ``teacher_offload`` keeps the teacher's shards in host memory instead
  (``CPUOffloadPolicy``), gathered to the GPU layer by layer.

Activation checkpointing is ``DistillSpec.grad_checkpoint`` (HF's non-reentrant checkpointing of the
student's decoder layers, whole or selective, inside their FSDP units). With ``DistillSpec.compile`` each
layer's forward (the checkpoint included) is compiled after sharding, one compiled function per layer class;
the units' gather and reshard hooks run around it in eager mode. Gradients are reduce-scattered after every
micro-batch and accumulated in the shards. Validation pads each rank's windows to the same count
(masked out), since every forward is a collective. Rank 0 gathers the full state dict and saves a
normal HF checkpoint (`save_student`). Launch: ``workers.training.ddp.launch`` with ``job["sharding"] = "fsdp"``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from workers.models.decoder import decoder_of
from workers.training.distill import LOSSES, DistillSpec, KDStudent, amp_dtype, train_loop
from workers.training.ranks import DistRanks


class FSDPRanks(DistRanks):
    """A rank whose forwards are collectives: validation windows are padded to the same count per rank."""

    collective_forward = True

    def val_rows(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        per = -(-x.shape[0] // self.world)
        rows = self.shard(x, even=False)
        real = torch.zeros(per, dtype=torch.bool)
        real[: rows.shape[0]] = True
        pad = x[:1].expand(per - rows.shape[0], -1)
        return torch.cat([rows, pad]), real


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of an HF causal LM (`model.base_model.layers`): one FSDP unit each."""
    layers = getattr(decoder_of(model), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(
            f"{type(model).__name__}: no base_model.layers; FSDP shards one decoder layer per unit"
        )
    return layers


def mixed_precision(amp: torch.dtype | None) -> MixedPrecisionPolicy:
    """Gathered parameters in `amp` (bf16 on CUDA), gradients reduced in fp32; None: all fp32."""
    if amp is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=amp, reduce_dtype=torch.float32)


def shard_student(kd: KDStudent, mesh: DeviceMesh, mp: MixedPrecisionPolicy) -> nn.Module:
    """Shard the student per decoder layer, then the root (KDStudent: embeddings, norm, LM head)."""
    for layer in decoder_layers(kd.student):
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    return fully_shard(kd, mesh=mesh, mp_policy=mp)


def shard_teacher(teacher: nn.Module, mesh: DeviceMesh, device: torch.device, offload: bool) -> None:
    """Shard the frozen teacher per decoder layer, then its base model; the LM head stays whole (moved to
    `device`). Every unit reshards after its forward (there is no backward); `offload` keeps the shards
    in host memory."""
    policy: OffloadPolicy = OffloadPolicy()
    if offload:
        policy = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda")
    for p in teacher.parameters():
        p.requires_grad_(False)
    for layer in decoder_layers(teacher):
        fully_shard(layer, mesh=mesh, reshard_after_forward=True, offload_policy=policy)
    fully_shard(decoder_of(teacher), mesh=mesh, reshard_after_forward=True, offload_policy=policy)
    teacher.get_output_embeddings().to(device)


def local_numel(module: nn.Module) -> int:
    """Parameter elements this rank holds (its shards; whole tensors where not sharded)."""
    return sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in module.parameters())


def _gather_ints(value: int) -> list[int]:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return [int(v) for v in out]


def fsdp_worker(
    student: nn.Module,
    teacher: nn.Module,
    adapter: Any,
    batches: Iterable[torch.Tensor],
    val: torch.Tensor,
    spec: DistillSpec,
    teacher_offload: bool = False,
    progress: Callable[[int, int], None] | None = None,
    on_val: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """`workers.training.distill.distill` on one rank of an initialised process group, student and teacher sharded
    (they may start on the CPU: `fully_shard` moves each unit's shard to this rank's device). Every rank
    gets the same global `batches` and the same result; result["shards"] has each rank's parameter
    elements of student and teacher. The student stays sharded: save it with `save_student`."""
    if not dist.is_initialized():
        raise ValueError("fsdp_worker: no process group; call torch.distributed.init_process_group first")
    ranks = FSDPRanks()
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    mesh = init_device_mesh(device.type, (ranks.world,))
    student.float()  # fp32 master weights, as in `distill`
    shard_teacher(teacher.eval(), mesh, device, teacher_offload)
    kd = KDStudent(student, LOSSES[spec.loss], spec.tau, spec.hidden_weight, spec.logit_chunk)
    root = shard_student(kd, mesh, mixed_precision(amp_dtype(spec, device)))
    shards = {
        "student": _gather_ints(local_numel(student)),
        "teacher": _gather_ints(local_numel(teacher)),
        "student_total": sum(p.numel() for p in student.parameters()),
        "teacher_total": sum(p.numel() for p in teacher.parameters()),
    }
    lead = ranks.rank == 0
    result = train_loop(
        student,
        root,
        teacher,
        adapter,
        batches,
        val,
        spec,
        progress if lead else None,
        on_val if lead else None,
        ranks=ranks,
    )
    root.reshard()  # the root keeps its gathered (bf16) parameters after a no-grad forward: free them
    return {**result, "shards": shards}


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """The whole state dict on rank 0 (CPU tensors), None elsewhere; every rank must call it (all-gathers
    one tensor at a time, so no rank ever holds more than one whole tensor beyond its shards)."""
    lead = dist.get_rank() == 0
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        full = t.full_tensor() if isinstance(t, DTensor) else t
        if lead:
            out[name] = full.detach().cpu().clone()
    return out if lead else None


def save_student(student: nn.Module, path: str | Path) -> None:
    """Rank 0 writes the sharded student as a normal HF checkpoint (save_pretrained); collective."""
    state = full_state_dict(student)
    if state is not None:
        student.save_pretrained(path, state_dict=state)
