"""Distillation losses, named by direction (paper §3.5, Eq. 5; §4.3 Table 5). Pure torch.

Conventions, shared by every function here:
- ``forward_kl`` is KL(teacher ‖ student) = Σ_v p_T (log p_T − log p_S), the paper's default (Eq. 5);
  ``reverse_kl`` is KL(student ‖ teacher) = Σ_v p_S (log p_S − log p_T). Teacher arguments come first.
- Temperature τ softens both distributions (logits / τ) and the divergence is multiplied by τ²
  (Hinton et al. 2015) so gradient magnitudes stay comparable across τ; at τ = 1 (the paper's
  setting, Table 9) it is the plain KL.
- Reduction is the mean over the tokens where ``mask`` is true (Eq. 5: 1/|T| Σ_t); no mask = all tokens.
- Softmaxes are computed in fp32 over at most ``chunk`` tokens at a time, so no [N, V] fp32 tensor
  is built for the whole batch; when gradients are needed each chunk is recomputed in backward
  (activation checkpointing), so autograd does not keep every chunk's [chunk, V] either.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from workers.training.distill_spec import DEFAULT_CHUNK


def _kl_rows(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """Σ_v p (log p − log q) per row; terms with p = 0 are 0 (also when log p = log q = −inf)."""
    p = log_p.exp()
    return torch.where(p > 0, p * (log_p - log_q), torch.zeros_like(p)).sum(-1)


def _fp32(x: torch.Tensor) -> torch.Tensor:
    """At least fp32 (bf16/fp16 logits are upcast; fp64 stays fp64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def token_forward_kl(
    teacher_logits: torch.Tensor, student_logits: torch.Tensor, tau: float = 1.0
) -> torch.Tensor:
    """Per-token τ²·KL(p_T^τ ‖ p_S^τ), fp32, shape [n]."""
    lt = F.log_softmax(_fp32(teacher_logits) / tau, dim=-1)
    ls = F.log_softmax(_fp32(student_logits) / tau, dim=-1)
    return _kl_rows(lt, ls) * tau**2


def token_reverse_kl(
    teacher_logits: torch.Tensor, student_logits: torch.Tensor, tau: float = 1.0
) -> torch.Tensor:
    """Per-token τ²·KL(p_S^τ ‖ p_T^τ), fp32, shape [n]."""
    lt = F.log_softmax(_fp32(teacher_logits) / tau, dim=-1)
    ls = F.log_softmax(_fp32(student_logits) / tau, dim=-1)
    return _kl_rows(ls, lt) * tau**2


TokenLoss = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


def _check(tau: float, chunk: int) -> None:
    if not tau > 0:
        raise ValueError(f"tau must be > 0, got {tau}")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1 tokens, got {chunk}")


def _flat_mask(mask: torch.Tensor | None, n: int, device: torch.device) -> torch.Tensor:
    if mask is None:
        return torch.ones(n, dtype=torch.bool, device=device)
    m = mask.reshape(-1).to(device=device, dtype=torch.bool)
    if m.numel() != n:
        raise ValueError(f"mask has {m.numel()} entries, expected one per token ({n})")
    return m


def _chunked_sum(
    fn: Callable[..., torch.Tensor], tensors: Sequence[torch.Tensor], mask: torch.Tensor, chunk: int
) -> torch.Tensor:
    """Σ over chunks of fn(*chunk_tensors, chunk_mask); checkpointed when a chunk needs gradients."""
    total = None
    n = mask.numel()
    for i in range(0, n, chunk):
        parts = [t[i : i + chunk] for t in tensors]
        m = mask[i : i + chunk]
        if torch.is_grad_enabled() and any(p.requires_grad for p in parts):
            s = checkpoint(fn, *parts, m, use_reentrant=False)
        else:
            s = fn(*parts, m)
        total = s if total is None else total + s
    if total is None:  # zero tokens: a zero that still connects to the graph
        total = sum((t.sum() * 0.0 for t in tensors), torch.zeros((), device=mask.device))
    return total


def _divergence(
    token_loss: TokenLoss,
    teacher_logits: torch.Tensor,
    student_logits: torch.Tensor,
    tau: float,
    mask: torch.Tensor | None,
    chunk: int,
) -> torch.Tensor:
    _check(tau, chunk)
    if teacher_logits.shape != student_logits.shape:
        raise ValueError(
            f"teacher logits {tuple(teacher_logits.shape)} and student logits "
            f"{tuple(student_logits.shape)} must have the same shape"
        )
    v = student_logits.shape[-1]
    t = teacher_logits.reshape(-1, v)
    s = student_logits.reshape(-1, v)
    m = _flat_mask(mask, s.shape[0], s.device)

    def fn(tc: torch.Tensor, sc: torch.Tensor, mc: torch.Tensor) -> torch.Tensor:
        return (token_loss(tc, sc, tau) * mc).sum()

    return _chunked_sum(fn, [t, s], m, chunk) / m.sum().clamp(min=1)


def forward_kl(
    teacher_logits: torch.Tensor,
    student_logits: torch.Tensor,
    tau: float = 1.0,
    mask: torch.Tensor | None = None,
    chunk: int = DEFAULT_CHUNK,
) -> torch.Tensor:
    """Mean over tokens of τ²·KL(teacher ‖ student) (Eq. 5). Logits [..., V]; mask [...] or None."""
    return _divergence(token_forward_kl, teacher_logits, student_logits, tau, mask, chunk)


def reverse_kl(
    teacher_logits: torch.Tensor,
    student_logits: torch.Tensor,
    tau: float = 1.0,
    mask: torch.Tensor | None = None,
    chunk: int = DEFAULT_CHUNK,
) -> torch.Tensor:
    """Mean over tokens of τ²·KL(student ‖ teacher) (§3.5, the reverse direction)."""
    return _divergence(token_reverse_kl, teacher_logits, student_logits, tau, mask, chunk)


def hidden_mse(
    teacher_hidden: Sequence[torch.Tensor],
    student_hidden: Sequence[torch.Tensor],
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean over layers of the masked per-token mean squared error, averaged over channels (fp32).

    The intermediate loss's hidden-state term "across all layers" (§3.5, Minitron): each pair is one
    layer's output [..., H] in teacher and student; sizes must agree (same depth and width).
    """
    if len(teacher_hidden) != len(student_hidden) or not teacher_hidden:
        raise ValueError(
            f"hidden_mse needs the same non-zero number of layers, got {len(teacher_hidden)} "
            f"teacher and {len(student_hidden)} student"
        )
    total = None
    for th, sh in zip(teacher_hidden, student_hidden, strict=True):
        if th.shape != sh.shape:
            raise ValueError(
                f"hidden states differ in shape: teacher {tuple(th.shape)} vs student {tuple(sh.shape)}"
            )
        err = (_fp32(sh) - _fp32(th).to(sh.device)).pow(2).mean(-1).reshape(-1)
        m = _flat_mask(mask, err.shape[0], err.device)
        layer = (err * m).sum() / m.sum().clamp(min=1)
        total = layer if total is None else total + layer
    return total / len(teacher_hidden)


def intermediate(
    teacher_logits: torch.Tensor,
    student_logits: torch.Tensor,
    teacher_hidden: Sequence[torch.Tensor],
    student_hidden: Sequence[torch.Tensor],
    tau: float = 1.0,
    mask: torch.Tensor | None = None,
    hidden_weight: float = 1.0,
    chunk: int = DEFAULT_CHUNK,
) -> torch.Tensor:
    """Logit KL(teacher ‖ student) + hidden_weight · hidden-state MSE over all layers (§3.5, Table 5)."""
    return forward_kl(teacher_logits, student_logits, tau, mask, chunk) + hidden_weight * hidden_mse(
        teacher_hidden, student_hidden, mask
    )


# ---- from final hidden states: the LM head is applied chunk by chunk ------------------------------
def head_divergence(
    token_loss: TokenLoss,
    teacher_hidden: torch.Tensor,
    teacher_head: torch.Tensor,
    student_hidden: torch.Tensor,
    student_head: torch.Tensor,
    tau: float = 1.0,
    mask: torch.Tensor | None = None,
    chunk: int = DEFAULT_CHUNK,
    teacher_bias: torch.Tensor | None = None,
    student_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Like forward_kl/reverse_kl, from the two models' final hidden states [..., H] and LM-head weights
    [V, H]: the [chunk, V] logits exist only inside one chunk (and again in its backward), never [N, V].

    The teacher's logits are recomputed inside the checkpointed chunk instead of being stored.
    """
    m = _flat_mask(mask, student_hidden.reshape(-1, student_hidden.shape[-1]).shape[0], student_hidden.device)
    total = head_weighted_divergence(
        token_loss,
        teacher_hidden,
        teacher_head,
        student_hidden,
        student_head,
        m,
        tau,
        chunk,
        teacher_bias,
        student_bias,
    )
    return total / m.sum().clamp(min=1)


def head_weighted_divergence(
    token_loss: TokenLoss,
    teacher_hidden: torch.Tensor,
    teacher_head: torch.Tensor,
    student_hidden: torch.Tensor,
    student_head: torch.Tensor,
    weights: torch.Tensor,
    tau: float = 1.0,
    chunk: int = DEFAULT_CHUNK,
    teacher_bias: torch.Tensor | None = None,
    student_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Σ_t w_t · ℓ_t: the per-token divergence weighted by `weights` [...] (one float per token), summed.

    Like head_divergence (chunked through the LM heads, teacher logits recomputed in the chunk), but the
    caller owns the normalisation, e.g. Router KD's per-sequence 1/N_x ("the Router KD paper" §4, Eq. 3)."""
    _check(tau, chunk)
    s = student_hidden.reshape(-1, student_hidden.shape[-1])
    t = teacher_hidden.reshape(-1, teacher_hidden.shape[-1])
    if s.shape[0] != t.shape[0]:
        raise ValueError(f"teacher has {t.shape[0]} tokens, student {s.shape[0]}")
    if teacher_head.shape[0] != student_head.shape[0]:
        raise ValueError(
            f"vocabularies differ: teacher {teacher_head.shape[0]}, student {student_head.shape[0]}"
        )
    w = weights.reshape(-1).to(device=s.device, dtype=torch.float32)
    if w.numel() != s.shape[0]:
        raise ValueError(f"weights has {w.numel()} entries, expected one per token ({s.shape[0]})")
    t = t.to(s.device)

    def fn(tc: torch.Tensor, sc: torch.Tensor, wc: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            tl = F.linear(tc.to(teacher_head.dtype), teacher_head, teacher_bias).to(sc.device)
        sl = F.linear(sc, student_head, student_bias)
        return (token_loss(tl, sl, tau) * wc).sum()

    return _chunked_sum(fn, [t, s], w, chunk)


def head_cross_entropy(
    hidden: torch.Tensor,
    head: torch.Tensor,
    labels: torch.Tensor,
    mask: torch.Tensor | None = None,
    chunk: int = DEFAULT_CHUNK,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, int]:
    """(Σ NLL, number of tokens) of next-token labels from final hidden states, chunked over tokens.

    hidden [..., H] and labels [...] are already aligned (hidden at t predicts labels at t)."""
    _check(1.0, chunk)
    h = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1).to(h.device)
    m = _flat_mask(mask, h.shape[0], h.device)

    def fn(hc: torch.Tensor, yc: torch.Tensor, mc: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hc, head, bias).float()
        return (F.cross_entropy(logits, yc, reduction="none") * mc).sum()

    return _chunked_sum(fn, [h, y], m, chunk), int(m.sum())


# ---- registry ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class KDLoss:
    """A distillation loss by name: its per-token logit divergence and whether it adds hidden-state MSE."""

    name: str
    token_loss: TokenLoss
    uses_hidden: bool
    doc: str


LOSSES: dict[str, KDLoss] = {
    "forward_kl": KDLoss("forward_kl", token_forward_kl, False, "KL(teacher ‖ student) on logits (Eq. 5)"),
    "reverse_kl": KDLoss("reverse_kl", token_reverse_kl, False, "KL(student ‖ teacher) on logits"),
    "intermediate": KDLoss(
        "intermediate",
        token_forward_kl,
        True,
        "KL(teacher ‖ student) on logits + hidden_weight · MSE of every layer's output",
    ),
}
