"""Distillation losses, named by direction (paper §3.5, Eq. 5; §4.3 Table 5). Pure torch.

Conventions, shared by every function here:
- ``forward_kl`` is KL(teacher ‖ student) = Σ_v p_T (log p_T − log p_S), the paper's default (Eq. 5);
  ``reverse_kl`` is KL(student ‖ teacher) = Σ_v p_S (log p_S − log p_T). Teacher arguments come first.
- Temperature τ softens both distributions (logits / τ) and the divergence is multiplied by τ²
  (Hinton et al. 2015) so gradient magnitudes stay comparable across τ; at τ = 1 (the paper's
  setting, Table 9) it is the plain KL.
- Reduction is the mean over the tokens where ``mask`` is true (Eq. 5: 1/|T| Σ_t); no mask = all tokens.
- Softmaxes are computed in fp32 over at most ``chunk`` tokens at a time, so no [N, V] fp32 tensor
  is built for the whole batch. From logits, a chunk that needs gradients is recomputed in backward
  (activation checkpointing). From hidden states (``head_divergence``, ``head_weighted_divergence``) the
  default is one fused pass: each chunk's logits are computed once, and its loss and its gradients
  (student hidden states, head weight and bias) in the same step; backward only scales those gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from workers.core.compiled import call_compiled
from workers.core.matmul import fp32_products
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
IMPLS = ("fused", "compiled", "autograd")  # how head_divergence / head_weighted_divergence compute: see below


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
    impl: str = "fused",
) -> torch.Tensor:
    """Like forward_kl/reverse_kl, from the two models' final hidden states [..., H] and LM-head weights
    [V, H]: the [chunk, V] logits exist only inside one chunk, never [N, V].

    impl="fused" (default) computes the loss and its gradients in one pass over the chunks
    (`_FusedHeadDivergence`); impl="compiled" is that pass with each chunk's divergence and gradient w.r.t. the
    logits in torch.compile'd kernels (forward/reverse KL; eager where it cannot compile); impl="autograd" is
    the reference: autograd through checkpointed chunks, whose logits are recomputed in backward. A mask with
    no true entry gives 0 (and zero gradients).
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
        impl,
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
    impl: str = "fused",
) -> torch.Tensor:
    """Σ_t w_t · ℓ_t: the per-token divergence weighted by `weights` [...] (one float per token), summed.

    Like head_divergence (chunked through the LM heads, the same `impl` choice), but the caller owns the
    normalisation, e.g. Router KD's per-sequence 1/N_x ("the Router KD paper" §4, Eq. 3)."""
    _check(tau, chunk)
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}: allowed {', '.join(IMPLS)}")
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
    if impl == "autograd":
        return _head_autograd(
            token_loss, t, teacher_head, teacher_bias, s, student_head, student_bias, w, tau, chunk
        )
    compiled = impl == "compiled"
    args = (t, teacher_head, teacher_bias, s, student_head, student_bias, w, token_loss, tau, chunk, compiled)
    differentiable = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in args[3:7])

    def run(exact: bool) -> torch.Tensor:
        if differentiable:
            return _FusedHeadDivergence.apply(*args, exact)
        return _fused_pass(*args, exact, grads=False)[0]

    if token_loss not in _ANALYTIC:
        return run(True)
    total = run(False)
    if bool(torch.isnan(total)):
        # the closed forms differ from token_loss only in rows they make NaN (non-finite logits): redo exactly
        total = run(True)
    return total


def _head_autograd(
    token_loss: TokenLoss,
    t: torch.Tensor,
    teacher_head: torch.Tensor,
    teacher_bias: torch.Tensor | None,
    s: torch.Tensor,
    student_head: torch.Tensor,
    student_bias: torch.Tensor | None,
    w: torch.Tensor,
    tau: float,
    chunk: int,
) -> torch.Tensor:
    """The reference: autograd through each chunk's logits, checkpointed (teacher and student logits are
    recomputed in backward), so autograd keeps no chunk's [chunk, V]."""

    def fn(tc: torch.Tensor, sc: torch.Tensor, wc: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            tl = F.linear(tc.to(teacher_head.dtype), teacher_head, teacher_bias).to(sc.device)
        sl = F.linear(sc, student_head, student_bias)
        return (token_loss(tl, sl, tau) * wc).sum()

    return _chunked_sum(fn, [t, s], w, chunk)


# ---- the fused pass: loss and gradients in one walk over the chunks (paper §3.5, Eq. 5) -------------
def _softened_log_probs(logits: torch.Tensor, tau: float) -> torch.Tensor:
    """log_softmax(fp32(logits) / τ) on a chunk's own logits (divided in place, fp32 logits need no copy)."""
    if tau == 1.0:
        return F.log_softmax(logits, -1, dtype=torch.promote_types(logits.dtype, torch.float32))
    return F.log_softmax(_fp32(logits).div_(tau), -1)


def _out_like(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Where an elementwise op on x writes a result of `dtype`: x itself (in place) when the dtypes agree."""
    return x if x.dtype == dtype else torch.empty_like(x, dtype=dtype)


def _forward_kl_closed(
    tl: torch.Tensor, sl: torch.Tensor, tau: float, a: torch.Tensor | None, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """token_forward_kl's rows and, when `a` = w·τ [c, 1] is given, the gradient of Σ_t w_t ℓ_t w.r.t. the
    student logits: w τ (p_S Σ_v p_T − p_T), written in out_dtype. The chunk's logits are consumed."""
    lt = _softened_log_probs(tl, tau)
    del tl
    ls = _softened_log_probs(sl, tau)
    del sl
    pt = lt.exp()
    rows = lt.sub_(ls).mul_(pt).sum(-1) * tau**2
    del lt
    if a is None:
        return rows, None
    ps = ls.exp_()
    ps.mul_(pt.sum(-1, keepdim=True) * a)
    return rows, torch.addcmul(ps, pt, a, value=-1.0, out=_out_like(ps, out_dtype))


def _reverse_kl_closed(
    tl: torch.Tensor, sl: torch.Tensor, tau: float, a: torch.Tensor | None, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """token_reverse_kl's rows and, with `a` = w·τ [c, 1], their weighted sum's gradient w.r.t. the student
    logits: w τ p_S (log p_S − log p_T + 1 − KL − Σ_v p_S) (KL = the row's unscaled divergence)."""
    lt = _softened_log_probs(tl, tau)
    del tl
    ls = _softened_log_probs(sl, tau)
    del sl
    ps = ls.exp()
    pd = ls.sub_(lt).mul_(ps)  # p_S (log p_S − log p_T)
    del lt
    kl = pd.sum(-1)
    rows = kl * tau**2
    if a is None:
        return rows, None
    pd.addcmul_(ps, (1.0 - kl - ps.sum(-1)).unsqueeze(-1))
    return rows, torch.mul(pd, a, out=_out_like(pd, out_dtype))


_ANALYTIC = {token_forward_kl: _forward_kl_closed, token_reverse_kl: _reverse_kl_closed}


# The same closed forms written without in-place ops, for torch.compile (impl="compiled"): inductor fuses each
# into a few kernels (the two log-softmax reductions, then the rows and the gradient in one pass), where eager
# makes ~20 passes over the chunk's [chunk, V] buffers.
def _log_probs_fusable(tl: torch.Tensor, sl: torch.Tensor, tau: float) -> tuple[torch.Tensor, torch.Tensor]:
    return F.log_softmax(_fp32(tl) / tau, -1), F.log_softmax(_fp32(sl) / tau, -1)


def _forward_kl_fusable(
    tl: torch.Tensor, sl: torch.Tensor, tau: float, a: torch.Tensor | None, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    lt, ls = _log_probs_fusable(tl, sl, tau)
    pt = lt.exp()
    rows = ((lt - ls) * pt).sum(-1) * tau**2
    if a is None:
        return rows, None
    return rows, ((ls.exp() * pt.sum(-1, keepdim=True) - pt) * a).to(out_dtype)


def _reverse_kl_fusable(
    tl: torch.Tensor, sl: torch.Tensor, tau: float, a: torch.Tensor | None, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    lt, ls = _log_probs_fusable(tl, sl, tau)
    ps = ls.exp()
    pd = (ls - lt) * ps
    kl = pd.sum(-1)
    rows = kl * tau**2
    if a is None:
        return rows, None
    return rows, ((pd + ps * (1.0 - kl - ps.sum(-1)).unsqueeze(-1)) * a).to(out_dtype)


_FUSABLE = {_forward_kl_closed: _forward_kl_fusable, _reverse_kl_closed: _reverse_kl_fusable}


def _closed_form(
    closed: Callable[..., tuple[torch.Tensor, torch.Tensor | None]],
    compiled: bool,
    tl: torch.Tensor,
    sl: torch.Tensor,
    tau: float,
    a: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """closed(...) itself, or with `compiled` its fusable twin through torch.compile (eager where it cannot
    compile: workers.core.compiled)."""
    if compiled:
        out = call_compiled(_FUSABLE[closed], tl, sl, tau, a, out_dtype)
        if out is not None:
            return out
    return closed(tl, sl, tau, a, out_dtype)


def _autograd_rows(
    token_loss: TokenLoss, tl: torch.Tensor, sl: torch.Tensor, tau: float, w: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """token_loss's rows and, with weights `w` [c], Σ_t w_t ℓ_t's gradient w.r.t. sl by autograd on this chunk
    alone (any token_loss; the logits are not recomputed)."""
    if w is None:
        return token_loss(tl, sl, tau), None
    with torch.enable_grad():
        leaf = sl.detach().requires_grad_(True)
        rows = token_loss(tl, leaf, tau)
        (grad,) = torch.autograd.grad((rows * w).sum(), leaf)
    return rows.detach(), grad


def _compute_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype F.linear would multiply `weight` in here: autocast's, where it is on and applies, else its own."""
    dev = weight.device.type
    if torch.is_autocast_enabled(dev) and weight.dtype in (torch.float32, torch.float16, torch.bfloat16):
        return torch.get_autocast_dtype(dev)
    return weight.dtype


def _logits(h: torch.Tensor, head: torch.Tensor, bias: torch.Tensor | None, fp32: bool) -> torch.Tensor:
    """A chunk's logits h·headᵀ + bias in the compute dtype; fp32 straight from the GEMM where torch allows
    (`fp32_products`), which also spares the softmax its upcast."""
    if not fp32:
        return F.linear(h, head, bias)
    out = torch.mm(h, head.T, out_dtype=torch.float32)
    return out if bias is None else out.add_(bias)


def _product(a: torch.Tensor, b: torch.Tensor, fp32: bool) -> torch.Tensor:
    """a @ b in their dtype, result in at least fp32 (out_dtype where torch has it, else upcast)."""
    if fp32:
        return torch.mm(a, b, out_dtype=torch.float32)
    return _fp32(torch.mm(a, b))


def _accumulate(acc: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor, fp32: bool) -> torch.Tensor:
    """acc += a @ b with acc in at least fp32 (in place in the GEMM where torch allows)."""
    if acc is None:
        return _product(a, b, fp32)
    if fp32:
        return torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    if acc.dtype == a.dtype:
        return acc.addmm_(a, b)
    return acc.add_(torch.mm(a, b))


def _fused_pass(
    t: torch.Tensor,
    teacher_head: torch.Tensor,
    teacher_bias: torch.Tensor | None,
    s: torch.Tensor,
    student_head: torch.Tensor,
    student_bias: torch.Tensor | None,
    w: torch.Tensor,
    token_loss: TokenLoss,
    tau: float,
    chunk: int,
    compiled: bool,
    exact: bool,
    grads: bool | tuple[bool, bool, bool, bool],
) -> tuple[torch.Tensor, ...]:
    """(Σ_t w_t ℓ_t, ∂/∂s [N, H], ∂/∂student_head, ∂/∂student_bias, ∂/∂w = ℓ [N]) in one walk over the chunks:
    each chunk's teacher and student logits are computed once (matmuls in the compute dtype), their
    divergence and its gradient w.r.t. the logits come from the closed forms (or, `exact`, from autograd
    on that chunk), and the gradient is pushed through the head at once. `grads` says which of the four
    gradients to return (None for the others); t and s are [N, H], w [N] fp32."""
    want_h, want_w, want_b, want_rows = (grads,) * 4 if isinstance(grads, bool) else grads
    want_b = want_b and student_bias is not None
    want_logits = want_h or want_w or want_b
    dev = s.device
    cdt_t, cdt_s = _compute_dtype(teacher_head), _compute_dtype(student_head)
    loss_dtype = torch.promote_types(torch.promote_types(cdt_t, cdt_s), torch.float32)
    n = s.shape[0]
    total = torch.zeros((), dtype=loss_dtype, device=dev)
    rows_all = torch.empty(n, dtype=loss_dtype, device=dev) if want_rows else None
    grad_h = torch.empty_like(s) if want_h else None
    grad_head = grad_bias = None
    with torch.autocast(dev.type, enabled=False):
        fp32, fp32_t = fp32_products(dev, cdt_s), fp32_products(dev, cdt_t)
        wt = teacher_head.to(cdt_t)
        bt = None if teacher_bias is None else teacher_bias.to(cdt_t)
        ws = student_head.to(cdt_s)
        bs = None if student_bias is None else student_bias.to(cdt_s)
        for i in range(0, n, chunk):
            tc, sc, wc = t[i : i + chunk].to(cdt_t), s[i : i + chunk].to(cdt_s), w[i : i + chunk]
            # the logits are passed inline, so the callee owns them and frees each once consumed
            if exact:  # token_loss sees the logits in the compute dtype, as the reference's
                rows, g = _autograd_rows(
                    token_loss, F.linear(tc, wt, bt), F.linear(sc, ws, bs), tau, wc if want_logits else None
                )
            else:
                a = (wc.to(loss_dtype) * tau).unsqueeze(-1) if want_logits else None
                closed = _ANALYTIC[token_loss]
                rows, g = _closed_form(
                    closed, compiled, _logits(tc, wt, bt, fp32_t), _logits(sc, ws, bs, fp32), tau, a, cdt_s
                )
            total = total + (rows * wc).sum()
            if want_rows:
                rows_all[i : i + chunk] = rows
            if g is None:
                continue
            g = g.to(cdt_s)
            if want_h:
                grad_h[i : i + chunk] = _product(g, ws, fp32)
            if want_w:
                grad_head = _accumulate(grad_head, g.T, sc, fp32)
            if want_b:
                gb = g.sum(0, dtype=torch.promote_types(g.dtype, torch.float32))
                grad_bias = gb if grad_bias is None else grad_bias.add_(gb)
    if want_w:
        grad_head = torch.zeros_like(student_head) if grad_head is None else grad_head.to(student_head.dtype)
    if want_b:
        grad_bias = torch.zeros_like(student_bias) if grad_bias is None else grad_bias.to(student_bias.dtype)
    return total, grad_h, grad_head, grad_bias, None if rows_all is None else rows_all.to(w.dtype)


class _FusedHeadDivergence(torch.autograd.Function):
    """Σ_t w_t ℓ_t through the two LM heads, with its gradients computed in forward by `_fused_pass` (each
    chunk's logits exist once, never [N, V]); backward only scales them by the incoming gradient. The
    teacher gets no gradient."""

    @staticmethod
    def forward(
        ctx: Any,
        t: torch.Tensor,
        teacher_head: torch.Tensor,
        teacher_bias: torch.Tensor | None,
        s: torch.Tensor,
        student_head: torch.Tensor,
        student_bias: torch.Tensor | None,
        w: torch.Tensor,
        token_loss: TokenLoss,
        tau: float,
        chunk: int,
        compiled: bool,
        exact: bool,
    ) -> torch.Tensor:
        total, *saved = _fused_pass(
            t,
            teacher_head,
            teacher_bias,
            s,
            student_head,
            student_bias,
            w,
            token_loss,
            tau,
            chunk,
            compiled,
            exact,
            grads=tuple(ctx.needs_input_grad[3:7]),
        )
        ctx.save_for_backward(*saved)
        return total

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        scaled = [None if g is None else g * grad_out for g in ctx.saved_tensors]
        return (None, None, None, *scaled, None, None, None, None, None)


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
