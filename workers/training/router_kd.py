"""Router knowledge distillation: retrain only a compressed MoE's routers against the original model
("the Router KD paper" §4, Eqs. 1–3; settings App. F, Table 1).

θ_S = (θ_R, θ_E): the routers θ_R (found by role through the family adapter's ``router_parameters``)
are trained, everything else θ_E (experts, attention, embeddings, norms, shared experts, buffers) is
frozen. The loss is the forward KL of the next-token distributions, teacher → student, masked on
padding and normalised per sequence:

    L_RKD(x) = τ² / N_x · Σ_t m_{t+1} · KL(p_T^(t) ‖ p_S^(t)),   N_x = Σ_t m_{t+1} + ε

averaged over the sequences of an optimizer step (``kd_loss_norm="per_sequence"``), or
Σ m·KL / Σ m over its target tokens (``"per_token"``, the main distillation's normalisation).

Gradients reach the routers through the model's own routing forward: the soft gating weights of the
selected experts; the top-k choice itself is not differentiated (no straight-through, no noise). With a
renormalising router (Qwen3-MoE with norm_topk_prob, Mixtral, GPT-OSS) a token's gradient reaches only
its selected experts' rows; with an unrenormalised softmax (DeepSeek-V2, OLMoE/Qwen2-MoE without
norm_topk_prob) the full denominator sends gradient to every row (``router_renorm`` in the record).

Choices where the paper is silent (see RouterKDSpec for the numbers): AdamW over fp32 master copies of
the router tensors (the model keeps its own dtype, e.g. bf16; after each step the masters are rounded
into it), linear decay to 0 with no warm-up, clipping of the routers' global grad norm, weight decay
on router matrices only, no auxiliary load-balancing loss, the student run in eval mode (no dropout,
no router jitter: with θ_E frozen the objective is deterministic), the given order of `batches` each
epoch (shuffling is the data side's business).

The result's ``router_delta`` (router tensors by parameter name, in the model's dtype) is all that
differs from the student it was trained from (its parent): ``save_router_delta`` stores it as
safetensors with the parent's hash in the metadata, ``apply_router_delta`` puts it into a fresh copy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from workers.core.steplog import StepLog
from workers.models.decoder import decoder_of
from workers.training.distill import lm_head
from workers.training.losses import head_weighted_divergence, token_forward_kl
from workers.training.router_kd_spec import RouterKDSpec

DELTA_FORMAT = "moesweep.router_delta.v1"

Batch = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


# ---- which tensors ----------------------------------------------------------------------------------
def named_router_parameters(model: nn.Module, adapter: Any) -> dict[str, nn.Parameter]:
    """The adapter's router parameters (θ_R), keyed by their names in ``model.named_parameters()``."""
    params = adapter.router_parameters(model)
    names = {id(p): n for n, p in model.named_parameters()}
    out: dict[str, nn.Parameter] = {}
    for p in params:
        if id(p) not in names:
            raise ValueError(
                f"{type(adapter).__name__}.router_parameters gave a tensor that is not a "
                "parameter of the model"
            )
        out[names[id(p)]] = p
    if len(out) != len(params):
        raise ValueError(f"{type(adapter).__name__}.router_parameters gave a parameter twice")
    return out


# ---- batches ---------------------------------------------------------------------------------------
def calibration_batches(
    ids: torch.Tensor, spec: RouterKDSpec, attention_mask: torch.Tensor | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One epoch of micro-batches from calibration sequences ids [N, T] (right-padded where
    `attention_mask` [N, T] has zeros): the first max_samples sequences with at least 2 real tokens,
    truncated to max_len, batch_size per micro-batch, columns that are padding in every row dropped."""
    if ids.dim() != 2:
        raise ValueError(f"ids: shape {tuple(ids.shape)}, expected [sequences, tokens]")
    mask = torch.ones_like(ids) if attention_mask is None else attention_mask.to(ids.device).long()
    if mask.shape != ids.shape:
        raise ValueError(f"attention_mask: shape {tuple(mask.shape)}, expected {tuple(ids.shape)} like ids")
    ids, mask = ids[:, : spec.max_len], mask[:, : spec.max_len]
    keep = torch.nonzero(mask.sum(-1) >= 2).flatten()[: spec.max_samples]
    ids, mask = ids[keep], mask[keep]
    out = []
    for i in range(0, ids.shape[0], spec.batch_size):
        m = mask[i : i + spec.batch_size]
        width = int(m.sum(-1).max())
        out.append((ids[i : i + spec.batch_size, :width], m[:, :width]))
    return out


def _unpack(batch: Batch, i: int, spec: RouterKDSpec | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask) of micro-batch `i`, checked: right padding, ≥ 2 real tokens and, with a
    spec, at most [batch_size, max_len]."""
    ids, mask = (batch, torch.ones_like(batch)) if isinstance(batch, torch.Tensor) else batch
    if ids.dim() != 2 or tuple(mask.shape) != tuple(ids.shape) or ids.shape[0] < 1:
        raise ValueError(
            f"batches: micro-batch {i} has ids {tuple(ids.shape)} and mask {tuple(mask.shape)}; "
            "expected two [rows, tokens] tensors of one shape"
        )
    if spec is not None and (ids.shape[0] > spec.batch_size or ids.shape[1] > spec.max_len):
        raise ValueError(
            f"batches: micro-batch {i} has shape {tuple(ids.shape)}; at most [batch_size, max_len] = "
            f"[{spec.batch_size}, {spec.max_len}] (see calibration_batches)"
        )
    m = mask.long()
    if not bool(((m == 0) | (m == 1)).all()) or bool((m[:, 1:] > m[:, :-1]).any()):
        raise ValueError(f"batches: micro-batch {i}: the attention mask must be 0/1 and right-padded")
    if bool((m.sum(-1) < 2).any()):
        raise ValueError(f"batches: micro-batch {i} has a sequence with fewer than 2 real tokens (no target)")
    return ids, m


# ---- the loss --------------------------------------------------------------------------------------
def _last_hidden(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return decoder_of(model)(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state


def kd_sum(
    student: nn.Module,
    teacher: nn.Module,
    ids: torch.Tensor,
    mask: torch.Tensor,
    norm: str,
    tau: float,
    norm_eps: float,
    chunk: int,
) -> tuple[torch.Tensor, float]:
    """(Σ of the unnormalised loss terms, their count) of one micro-batch; the loss is sum / count over
    any set of micro-batches. per_sequence: Σ_x τ²/N_x Σ_t m_{t+1} KL_t over sequences, count = sequences
    (Eq. 3, mean over sequences); per_token: Σ τ² m KL, count = target tokens. Only target positions
    (m_{t+1} = 1) reach the LM heads, so padding costs nothing and cannot leak NaNs."""
    device = next(student.parameters()).device
    ids, mask = ids.to(device), mask.to(device)
    target = mask[:, 1:].bool()  # m_{t+1}: the token predicted at position t is real
    n_x = target.sum(-1, keepdim=True).float()
    if norm == "per_sequence":
        weights, count = (target.float() / (n_x + norm_eps))[target], float(ids.shape[0])
    else:
        weights, count = torch.ones(int(target.sum()), device=device), float(target.sum())
    with torch.no_grad():
        t_last = _last_hidden(
            teacher, ids.to(next(teacher.parameters()).device), mask.to(next(teacher.parameters()).device)
        )[:, :-1]
    s_last = _last_hidden(student, ids, mask)[:, :-1]
    t_head, s_head = lm_head(teacher), lm_head(student)
    total = head_weighted_divergence(
        token_forward_kl,
        t_last[target.to(t_last.device)],
        t_head.weight,
        s_last[target],
        s_head.weight,
        weights,
        tau,
        chunk,
        teacher_bias=t_head.bias,
        student_bias=s_head.bias,
    )
    return total, count


def router_kd_loss(student: nn.Module, teacher: nn.Module, batch: Batch, spec: RouterKDSpec) -> torch.Tensor:
    """The Router KD loss of one batch (ids [B, T] or (ids, right-padded attention mask)) under
    spec.kd_loss_norm, with gradients to whatever in the student requires them."""
    ids, mask = _unpack(batch, 0)
    total, count = kd_sum(
        student, teacher, ids, mask, spec.kd_loss_norm, spec.tau, spec.norm_eps, spec.logit_chunk
    )
    return total / max(count, 1.0)


@torch.no_grad()
def heldout_kd(student: nn.Module, teacher: nn.Module, batches: Sequence[Batch], spec: RouterKDSpec) -> float:
    """The Router KD loss over held-out micro-batches (mean over all their sequences, or tokens)."""
    was = student.training
    student.eval()
    total, count = 0.0, 0.0
    for i, b in enumerate(batches):
        ids, mask = _unpack(b, i)
        s, c = kd_sum(
            student, teacher, ids, mask, spec.kd_loss_norm, spec.tau, spec.norm_eps, spec.logit_chunk
        )
        total, count = total + float(s), count + c
    student.train(was)
    return total / max(count, 1.0)


# ---- training --------------------------------------------------------------------------------------
def lr_factor(step: int, steps: int) -> float:
    """Linear decay from 1 at step 0 towards 0 after the last step, no warm-up (HF's linear schedule)."""
    return max(0.0, (steps - step) / steps)


def router_kd(
    student: nn.Module,
    teacher: nn.Module,
    adapter: Any,
    batches: Sequence[Batch],
    spec: RouterKDSpec,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Train `student`'s routers in place against `teacher` (frozen, not modified).

    `adapter` is the student's FamilyAdapter. `batches` is one epoch of micro-batches (a sequence, so the
    schedule knows its length), each ids [b ≤ batch_size, T ≤ max_len] or (ids, right-padded attention
    mask); see calibration_batches. Every epoch goes through them in the given order; grad_accum
    micro-batches make one optimizer step (a last short group is a step too). `progress(step, steps)`.

    Returns {"loss_curve": [per-step loss], "steps", "micro_batches", "sequences", "tokens" (real input
    tokens), "kd_targets" (Σ m), "trainable_params", "router_params" (names), "router_renorm",
    "kd_loss_norm", "settings", "router_delta": {name: tensor, model dtype, cpu}}.
    """
    batches = list(batches)
    checked = [_unpack(b, i, spec) for i, b in enumerate(batches)]
    sequences = sum(ids.shape[0] for ids, _ in checked)
    if not checked:
        raise ValueError("batches: empty; Router KD needs at least one micro-batch")
    if sequences > spec.max_samples:
        raise ValueError(
            f"batches: {sequences} sequences in one epoch exceed RouterKDSpec.max_samples="
            f"{spec.max_samples} (see calibration_batches)"
        )
    routers = named_router_parameters(student, adapter)
    teacher_storage = {q.untyped_storage().data_ptr() for q in teacher.parameters()}
    shared = [n for n, p in routers.items() if p.untyped_storage().data_ptr() in teacher_storage]
    if shared:
        raise ValueError(
            f"student router {shared[0]} shares its tensor with the teacher; training it would "
            "change the teacher (build the student with copied weights)"
        )
    groups = [checked[i : i + spec.grad_accum] for i in range(0, len(checked), spec.grad_accum)]
    steps = spec.epochs * len(groups)

    requires = {n: p.requires_grad for n, p in student.named_parameters()}
    was_training = student.training
    masters = {n: nn.Parameter(p.detach().float().clone()) for n, p in routers.items()}
    decay = [m for m in masters.values() if m.dim() >= 2]
    rest = [m for m in masters.values() if m.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": spec.weight_decay}, {"params": rest, "weight_decay": 0.0}],
        lr=spec.lr,
        betas=spec.betas,
        eps=spec.eps,
    )
    torch.manual_seed(spec.seed)
    loss_curve: list[float] = []
    tokens = targets = 0
    steplog = StepLog("router_kd", steps)
    try:
        student.requires_grad_(False)
        for p in routers.values():
            p.requires_grad_(True)
            p.grad = None
        student.eval()
        step = 0
        for _ in range(spec.epochs):
            for group in groups:
                count = sum(
                    float(ids.shape[0]) if spec.kd_loss_norm == "per_sequence" else float(mask[:, 1:].sum())
                    for ids, mask in group
                )
                step_loss = 0.0
                for ids, mask in group:
                    total, _ = kd_sum(
                        student,
                        teacher,
                        ids,
                        mask,
                        spec.kd_loss_norm,
                        spec.tau,
                        spec.norm_eps,
                        spec.logit_chunk,
                    )
                    loss = total / max(count, 1.0)
                    loss.backward()
                    step_loss += float(loss.detach())
                    tokens += int(mask.sum())
                    targets += int(mask[:, 1:].sum())
                for n, m in masters.items():
                    g = routers[n].grad
                    m.grad = None if g is None else g.detach().float()
                    routers[n].grad = None
                if spec.grad_clip:
                    torch.nn.utils.clip_grad_norm_(list(masters.values()), spec.grad_clip)
                for g in opt.param_groups:
                    g["lr"] = spec.lr * lr_factor(step, steps)
                opt.step()
                opt.zero_grad(set_to_none=True)
                with torch.no_grad():
                    for n, p in routers.items():
                        p.copy_(masters[n])
                loss_curve.append(step_loss)
                step += 1
                steplog(step, float(step_loss), targets)
                if progress is not None:
                    progress(step, steps)
    finally:
        for n, p in student.named_parameters():
            p.requires_grad_(requires[n])
            if n in routers:
                p.grad = None
        student.train(was_training)
    return {
        "loss_curve": loss_curve,
        "steps": steps,
        "micro_batches": spec.epochs * len(checked),
        "sequences": spec.epochs * sequences,
        "tokens": tokens,
        "kd_targets": targets,
        "trainable_params": sum(p.numel() for p in routers.values()),
        "router_params": list(routers),
        "router_renorm": bool(adapter.renormalized(student)),
        "kd_loss_norm": spec.kd_loss_norm,
        "settings": asdict(spec),
        "router_delta": {n: p.detach().cpu().clone() for n, p in routers.items()},
    }


# ---- the delta artifact ----------------------------------------------------------------------------
def apply_router_delta(model: nn.Module, delta: dict[str, torch.Tensor], adapter: Any = None) -> list[str]:
    """Copy the delta's router tensors into `model` (in place, in the model's dtype); returns the names.
    The names must be exactly the model's router parameters (by role, through `adapter`, default: the
    model's own), with their shapes."""
    if adapter is None:
        from workers.families import get_adapter

        adapter = get_adapter(model)
    routers = named_router_parameters(model, adapter)
    if set(delta) != set(routers):
        missing, extra = sorted(set(routers) - set(delta)), sorted(set(delta) - set(routers))
        raise ValueError(
            f"router delta does not match the model's routers: missing {missing}, not routers {extra}"
        )
    for n, p in routers.items():
        if tuple(delta[n].shape) != tuple(p.shape):
            raise ValueError(
                f"router delta {n}: shape {tuple(delta[n].shape)}, the model has {tuple(p.shape)}"
            )
    with torch.no_grad():
        for n, p in routers.items():
            p.copy_(delta[n].to(device=p.device, dtype=p.dtype))
    return list(routers)


def save_router_delta(
    path: str | Path, delta: dict[str, torch.Tensor], parent_hash: str, metadata: dict[str, Any] | None = None
) -> None:
    """One safetensors file: the router tensors by parameter name; metadata format, parent_hash (the
    checkpoint the delta applies to) and `metadata` (as strings)."""
    from safetensors.torch import save_file

    if not delta:
        raise ValueError("router delta is empty: nothing to save")
    if not parent_hash:
        raise ValueError("parent_hash: the hash of the checkpoint the delta applies to is required")
    meta = {str(k): str(v) for k, v in (metadata or {}).items()}
    meta.update({"format": DELTA_FORMAT, "parent_hash": str(parent_hash)})
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file({n: t.detach().cpu().contiguous() for n, t in delta.items()}, str(path), metadata=meta)


def load_router_delta(
    path: str | Path, parent_hash: str | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(router tensors, metadata) of a saved delta; with `parent_hash`, refuses a delta made for
    another parent."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(path), framework="pt") as fh:
        meta = dict(fh.metadata() or {})
    if meta.get("format") != DELTA_FORMAT:
        raise ValueError(f"{path}: format {meta.get('format')!r}, not a router delta ({DELTA_FORMAT})")
    if parent_hash is not None and meta.get("parent_hash") != parent_hash:
        raise ValueError(
            f"{path}: router delta of parent {meta.get('parent_hash')!r}, not of {parent_hash!r}"
        )
    return load_file(str(path)), meta
