"""Knowledge distillation of a dense student from its teacher (paper §3.5, §4.3–4.4, Appendix J).

A readable nanoGPT-style loop in plain PyTorch: AdamW, linear warmup then cosine decay to min_lr,
gradient accumulation, gradient clipping, bf16 autocast on GPU (fp32 master weights) / fp32 on CPU.
The teacher is frozen (eval, no_grad); with ``teacher_top_k`` = k′ its MoE layers route every token to
their top-k′ experts while producing the KD targets (Eq. 6), through the family adapter's
``routing_top_k`` context manager: nothing is copied. Losses come from ``workers.training.losses`` by name and
are computed from the final hidden states, chunk by chunk through the LM head, so [tokens, vocab]
logits are never built for a whole micro-batch.

The same loop serves the multi-process paths (``workers.training.ddp``, ``workers.training.fsdp``): ``train_loop`` takes the
module to run forward through (DDP-wrapped or FSDP-sharded there) and a ``Ranks`` object that shards
batches and reduces numbers.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict
from typing import Any, NamedTuple

import torch
from torch import nn

from workers.core.steplog import StepLog
from workers.models.decoder import decoder_of
from workers.training.distill_spec import DTYPES, DistillSpec  # noqa: F401  (re-exported)
from workers.training.losses import LOSSES, KDLoss, head_cross_entropy, head_divergence, hidden_mse
from workers.training.ranks import Ranks


def lr_at(step: int, spec: DistillSpec) -> float:
    """Linear warmup over `warmup` steps to lr, then cosine decay reaching min_lr at the last step."""
    if step < spec.warmup:
        return spec.lr * (step + 1) / spec.warmup
    span = max(1, spec.steps - 1 - spec.warmup)
    ratio = min(1.0, (step - spec.warmup) / span)
    return spec.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (spec.lr - spec.min_lr)


def amp_dtype(spec: DistillSpec, device: torch.device) -> torch.dtype | None:
    """The autocast dtype (None = plain fp32)."""
    if spec.dtype == "bf16" or (spec.dtype == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return None


def _autocast(dtype: torch.dtype | None, device: torch.device) -> contextlib.AbstractContextManager:
    return torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


class ScaledHead(NamedTuple):
    """An output projection with the model's constant logit factor folded in: logits = weight·h + bias."""

    weight: torch.Tensor
    bias: torch.Tensor | None


def logit_factor(config: Any) -> float:
    """The constant the model multiplies into lm_head(h): Cohere's logit_scale, 1 / Granite's logits_scaling."""
    factor = 1.0
    if getattr(config, "logit_scale", None) is not None:
        factor *= float(config.logit_scale)
    if getattr(config, "logits_scaling", None) is not None:
        factor /= float(config.logits_scaling)
    return factor


def lm_head(model: nn.Module) -> nn.Linear | ScaledHead:
    """The output projection, with a constant logit factor (logit_factor) folded into its weight and bias (the
    student's stays differentiable); refuses models whose logits are more than that (softcap)."""
    cfg = getattr(model, "config", None)
    if getattr(cfg, "final_logit_softcapping", None) not in (None, 1, 1.0):
        raise ValueError(
            f"{type(model).__name__}: config.final_logit_softcapping is set; the chunked KD loss "
            "supports a linear lm_head"
        )
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise ValueError(
            f"{type(model).__name__}: output embeddings are {type(head).__name__}, expected nn.Linear"
        )
    factor = logit_factor(cfg)
    if factor == 1.0:
        return head
    return ScaledHead(head.weight * factor, None if head.bias is None else head.bias * factor)


def base_forward(
    model: nn.Module, ids: torch.Tensor, hidden: bool
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(final hidden states [B, T, H], every decoder layer's output (if `hidden`)) without the LM head."""
    out = decoder_of(model)(input_ids=ids, output_hidden_states=hidden, use_cache=False)
    return out.last_hidden_state, (list(out.hidden_states[1:]) if hidden else [])


class KDStudent(nn.Module):
    """The student and its distillation loss as one module, so DDP sees the whole forward pass."""

    def __init__(self, student: nn.Module, loss: KDLoss, tau: float, hidden_weight: float, chunk: int):
        super().__init__()
        self.student = student
        self.kd = loss
        self.tau = tau
        self.hidden_weight = hidden_weight
        self.chunk = chunk

    def forward(
        self,
        ids: torch.Tensor,
        t_last: torch.Tensor | None = None,
        t_head: torch.Tensor | None = None,
        t_hidden: list[torch.Tensor] | None = None,
        t_bias: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, int]:
        """The KD loss; without teacher states, (Σ NLL, tokens) of next-token prediction where `mask` [B, T−1]
        is true: validation through this module, since a sharded root has its parameters only in forward."""
        if t_last is None:
            h, _ = base_forward(self.student, ids, False)
            head = lm_head(self.student)
            return head_cross_entropy(
                h[:, :-1], head.weight, ids[:, 1:], mask=mask, chunk=self.chunk, bias=head.bias
            )
        s_last, s_hidden = base_forward(self.student, ids, self.kd.uses_hidden)
        head = lm_head(self.student)
        loss = head_divergence(
            self.kd.token_loss,
            t_last,
            t_head,
            s_last,
            head.weight,
            self.tau,
            chunk=self.chunk,
            teacher_bias=t_bias,
            student_bias=head.bias,
        )
        if self.kd.uses_hidden:  # intermediate loss (§3.5, Minitron)
            loss = loss + self.hidden_weight * hidden_mse(t_hidden, s_hidden)
        return loss


# ---- ranks: one process, or one of several (workers.training.ddp) ------------------------------------------


@torch.no_grad()
def val_ce(
    model: nn.Module,
    val: torch.Tensor,
    batch_size: int,
    chunk: int,
    amp: torch.dtype | None,
    ranks: Ranks = Ranks(),
    through: nn.Module | None = None,
) -> float:
    """Mean next-token cross-entropy (nats/token) over the validation windows [n, T]; `through` is a
    KDStudent(model) (or its sharded root) to run the windows through instead of `model` itself."""
    head = lm_head(model)
    device = (
        head.weight.device
    )  # where the model computes (a teacher offloaded by FSDP keeps its shards on the CPU)
    was_training = model.training
    model.eval()
    rows, real = ranks.val_rows(val)
    total = torch.zeros((), dtype=torch.float64, device=device)
    count = torch.zeros((), dtype=torch.float64, device=device)
    for i in range(0, rows.shape[0], batch_size):
        ids = rows[i : i + batch_size].to(device)
        mask = (
            None if real is None else real[i : i + batch_size, None].expand(-1, ids.shape[1] - 1).to(device)
        )
        with _autocast(amp, device):
            if through is not None:
                s, n = through(ids, mask=mask)
            else:
                h, _ = base_forward(model, ids, False)
                s, n = head_cross_entropy(
                    h[:, :-1], head.weight, ids[:, 1:], mask=mask, chunk=chunk, bias=head.bias
                )
        total += s.double()
        count += n
    model.train(was_training)
    total, count = ranks.sum(total), ranks.sum(count)
    return float(total / count.clamp(min=1))


def _teacher_routing(teacher: nn.Module, adapter: Any, spec: DistillSpec) -> dict[str, Any] | None:
    if spec.teacher_top_k is None:
        return None
    if adapter is None:
        raise ValueError("DistillSpec.teacher_top_k: expanded routing needs an MoE teacher (adapter is None)")
    n_exp = adapter.num_experts(teacher)
    if spec.teacher_top_k > n_exp:
        raise ValueError(
            f"DistillSpec.teacher_top_k: {spec.teacher_top_k} is not allowed; allowed: 1..{n_exp}"
        )
    renorm = adapter.renormalized(teacher) if spec.teacher_renormalize is None else spec.teacher_renormalize
    return {"top_k": spec.teacher_top_k, "renormalize": bool(renorm), "native_top_k": adapter.top_k(teacher)}


def _routing(teacher: nn.Module, adapter: Any, routing: dict | None) -> contextlib.AbstractContextManager:
    if routing is None:
        return contextlib.nullcontext()
    return adapter.routing_top_k(teacher, routing["top_k"], routing["renormalize"])


def _check_intermediate(student: nn.Module, teacher: nn.Module) -> None:
    sc, tc = student.config, teacher.config
    for key in ("num_hidden_layers", "hidden_size"):
        if getattr(sc, key, None) != getattr(tc, key, None):
            raise ValueError(
                f"DistillSpec.loss: 'intermediate' needs equal {key} in student and teacher "
                f"({getattr(sc, key, None)} vs {getattr(tc, key, None)})"
            )


def _checkpointing(model: nn.Module, on: bool) -> None:
    """HF activation checkpointing of the decoder layers (non-reentrant: works under DDP)."""
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
        if on:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.activation_checkpointing_disable()
    elif on:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()


def make_optimizer(student: nn.Module, spec: DistillSpec) -> torch.optim.AdamW:
    """AdamW (Table 9); weight decay on matrices only, not on norms and biases (nanoGPT convention)."""
    params = [p for p in student.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": spec.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=spec.lr, betas=spec.betas)


def _next_batch(it: Iterator[torch.Tensor], i: int, spec: DistillSpec) -> torch.Tensor:
    try:
        ids = next(it)
    except StopIteration:
        raise ValueError(
            f"batches: ran out after {i} micro-batches; the budget needs steps × grad_accum = "
            f"{spec.steps * spec.grad_accum}"
        ) from None
    if tuple(ids.shape) != (spec.batch_size, spec.seq_len):
        raise ValueError(
            f"batches: micro-batch {i} has shape {tuple(ids.shape)}; expected [batch_size, seq_len] = "
            f"[{spec.batch_size}, {spec.seq_len}]"
        )
    return ids


def train_loop(
    student: nn.Module,
    forward_module: nn.Module,
    teacher: nn.Module,
    adapter: Any,
    batches: Iterable[torch.Tensor],
    val: torch.Tensor,
    spec: DistillSpec,
    progress: Callable[[int, int], None] | None = None,
    on_val: Callable[[dict[str, Any]], None] | None = None,
    ranks: Ranks = Ranks(),
) -> dict[str, Any]:
    """The loop behind `distill` and `workers.training.ddp`: `forward_module` wraps KDStudent(student) (or is it)."""
    device = next(student.parameters()).device
    amp = amp_dtype(spec, device)
    kd = LOSSES[spec.loss]
    if kd.uses_hidden:
        _check_intermediate(student, teacher)
    routing = _teacher_routing(teacher, adapter, spec)
    teacher.eval()
    t_head = lm_head(teacher)
    records: list[dict[str, Any]] = []

    def record(value: float, who: str, step: int) -> None:
        rec = {"value": value, "who": who, "step": step, "tokens": step * spec.tokens_per_step}
        records.append(rec)
        if on_val is not None:
            on_val(rec)

    # the teacher's validation CE, once (its native routing, and the expanded one used for the targets)
    teacher_ce = {"teacher": val_ce(teacher, val, spec.batch_size, spec.logit_chunk, amp, ranks)}
    if routing is not None:
        with _routing(teacher, adapter, routing):
            teacher_ce[f"teacher_k{routing['top_k']}"] = val_ce(
                teacher, val, spec.batch_size, spec.logit_chunk, amp, ranks
            )

    through = forward_module if ranks.collective_forward else None

    def evaluate(step: int) -> None:
        record(val_ce(student, val, spec.batch_size, spec.logit_chunk, amp, ranks, through), "student", step)
        for who, value in teacher_ce.items():  # same steps, so the curves can be drawn side by side
            record(value, who, step)

    torch.manual_seed(spec.seed)
    opt = make_optimizer(student, spec)
    if spec.grad_checkpoint:
        _checkpointing(student, True)
    student.train()
    evaluate(0)
    loss_curve: list[float] = []
    it = iter(batches)
    tokens = 0
    steplog = StepLog("distill", spec.steps)
    for step in range(spec.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, spec)
        step_loss = torch.zeros((), device=device)
        for micro in range(spec.grad_accum):
            ids = _next_batch(it, step * spec.grad_accum + micro, spec)
            tokens += ids.numel()
            ids = ranks.shard(ids).to(device)
            with torch.no_grad(), _autocast(amp, device), _routing(teacher, adapter, routing):
                t_last, t_hidden = base_forward(teacher, ids, kd.uses_hidden)
            with ranks.no_sync(forward_module, micro == spec.grad_accum - 1), _autocast(amp, device):
                loss = forward_module(ids, t_last, t_head.weight, t_hidden, t_head.bias) / spec.grad_accum
            loss.backward()
            step_loss += loss.detach().float()
        if spec.grad_clip:
            torch.nn.utils.clip_grad_norm_(student.parameters(), spec.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_curve.append(float(ranks.sum(step_loss) / ranks.world))
        done = step + 1
        if ranks.rank == 0:
            steplog(done, loss_curve[-1], tokens)
        if done % spec.eval_every == 0 or done == spec.steps:
            evaluate(done)
        if progress is not None:
            progress(done, spec.steps)
    student.eval()
    if spec.grad_checkpoint:
        _checkpointing(student, False)
    return {
        "val": records,
        "loss_curve": loss_curve,
        "tokens": tokens,
        "teacher_routing": routing,
        "settings": asdict(spec),
    }


def distill(
    student: nn.Module,
    teacher: nn.Module,
    adapter: Any,
    batches: Iterable[torch.Tensor],
    val: torch.Tensor,
    spec: DistillSpec,
    progress: Callable[[int, int], None] | None = None,
    on_val: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Distill `student` (trained in place) from `teacher`; `adapter` is the teacher's FamilyAdapter
    (None for a dense teacher, e.g. the D2D baseline). `batches` yields LongTensor [batch_size, seq_len]
    micro-batches (grad_accum per step); `val` is LongTensor [n, seq_len].

    Returns {"val": [{"value", "who", "step", "tokens"}], "loss_curve": [per-step loss], "tokens": int,
    "teacher_routing": {"top_k", "renormalize", "native_top_k"} | None, "settings": dict}. Validation CE
    (nats/token) of the student is measured at step 0, every eval_every steps and at the end; the
    teacher's once, and recorded at the same steps. `on_val(record)` sees each record as it is made.
    The student keeps fp32 master weights during training and gets its original dtype back at the end.
    """
    dtype = next(student.parameters()).dtype
    if dtype != torch.float32:
        student.float()
    kd_module = KDStudent(student, LOSSES[spec.loss], spec.tau, spec.hidden_weight, spec.logit_chunk)
    try:
        return train_loop(student, kd_module, teacher, adapter, batches, val, spec, progress, on_val)
    finally:
        if dtype != torch.float32:
            student.to(dtype)
