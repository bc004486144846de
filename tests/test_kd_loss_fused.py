"""The fused chunked KD loss (workers/training/losses.py, impl="fused") against the autograd reference
(impl="autograd"): the same values and gradients for every loss in LOSSES, temperature, mask and chunk size;
bf16 against a float64 reference; and the structure: one pass, no [N, V] tensor, no matmul in backward."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from workers.training import losses
from workers.training.losses import (
    LOSSES,
    head_divergence,
    head_weighted_divergence,
    hidden_mse,
    token_forward_kl,
    token_reverse_kl,
)

N, H, V = 11, 6, 17  # 11 tokens: chunk 4 leaves a last chunk of 3
F64 = dict(rtol=1e-10, atol=1e-12)  # float64: the two orders of the same sums differ by rounding only
MASKS = {
    "none": None,
    "partial": torch.tensor([1, 0, 1, 1, 0, 1, 1, 1, 0, 1, 1], dtype=torch.bool),
    # tokens 4..7 off: with chunk 4 the whole second chunk is masked
    "masked_chunk": torch.tensor([1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 0], dtype=torch.bool),
    "all_masked": torch.zeros(N, dtype=torch.bool),
}


def inputs(seed: int, dtype: torch.dtype = torch.float64, bias: bool = False, layers: int = 2) -> dict:
    """Teacher/student final hidden states [2, N/2..] ~ N(0, 1), heads ~ N(0, 1/H) (logits ~ N(0, 1)), and
    `layers` intermediate hidden states per model for the intermediate loss."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)

    return dict(
        th=r(N, H),
        tw=r(V, H, scale=H**-0.5),
        tb=r(V) if bias else None,
        sh=r(N, H),
        sw=r(V, H, scale=H**-0.5),
        sb=r(V) if bias else None,
        t_layers=[r(N, H) for _ in range(layers)],
        s_layers=[r(N, H) for _ in range(layers)],
    )


STUDENT = ("sh", "sw", "sb")


def kd_loss(name: str, x: dict, impl: str, tau: float, mask, chunk: int, hidden_weight: float = 0.7):
    """The distillation loss the training loop computes for LOSSES[name] (workers/training/distill.py
    KDStudent): head divergence, plus hidden_weight · hidden-state MSE for the intermediate loss; returns the
    loss and its gradients w.r.t. the student's final hidden states, head weight, bias and layer outputs."""
    kd = LOSSES[name]
    leaves = {k: x[k].clone().requires_grad_(True) for k in STUDENT if x[k] is not None}
    layers = [h.clone().requires_grad_(True) for h in x["s_layers"]]
    loss = head_divergence(
        kd.token_loss,
        x["th"],
        x["tw"],
        leaves["sh"],
        leaves["sw"],
        tau,
        mask,
        chunk,
        teacher_bias=x["tb"],
        student_bias=leaves.get("sb"),
        impl=impl,
    )
    if kd.uses_hidden:
        loss = loss + hidden_weight * hidden_mse(x["t_layers"], layers, mask)
    wrt = list(leaves.values()) + (layers if kd.uses_hidden else [])
    return loss.detach(), torch.autograd.grad(loss, wrt)


def assert_same(fused, ref, tol: dict) -> None:
    (lf, gf), (lr, gr) = fused, ref
    torch.testing.assert_close(lf, lr, **tol)
    assert len(gf) == len(gr)
    for a, b in zip(gf, gr, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("chunk", [1, 4, 64])  # one token at a time; 11 = 4 + 4 + 3; one chunk larger than N
@pytest.mark.parametrize("mask", sorted(MASKS))
@pytest.mark.parametrize("tau", [1.0, 2.5])
@pytest.mark.parametrize("name", sorted(LOSSES))
def test_fused_equals_autograd_in_float64(name, tau, mask, chunk):
    x = inputs(seed=sum(map(ord, f"{name}{tau}{mask}{chunk}")), bias=chunk == 4)
    m = MASKS[mask]
    fused = kd_loss(name, x, "fused", tau, m, chunk)
    ref = kd_loss(name, x, "autograd", tau, m, chunk)
    assert_same(fused, ref, F64)
    if mask == "all_masked":
        # no token counts: the loss is 0 (0 / max(0, 1), the hidden MSE too) and every gradient is 0
        assert fused[0].item() == 0.0  # exact: every term is multiplied by a zero weight
        assert all(not g.any() for g in fused[1])  # exact: zero weights scale each gradient row to 0


@pytest.mark.parametrize("tau", [1.0, 2.5])
@pytest.mark.parametrize("name", sorted(LOSSES))
def test_compiled_equals_autograd_in_float64(name, tau, monkeypatch):
    """impl="compiled" (what distillation takes where `distill.compile` is on): the closed forms' fusable twins
    through torch.compile (inductor compiles them for the CPU here), chunks of 4, 4 and 3 tokens (one
    dynamic-shape graph), a partial mask and biases; every chunk went through the compiled function."""
    calls = []
    real = losses.call_compiled
    monkeypatch.setattr(losses, "call_compiled", lambda fn, *a: calls.append(fn.__name__) or real(fn, *a))
    x = inputs(seed=sum(map(ord, f"compiled{name}{tau}")), bias=True)
    got = kd_loss(name, x, "compiled", tau, MASKS["partial"], 4)
    assert_same(got, kd_loss(name, x, "autograd", tau, MASKS["partial"], 4), F64)
    fusable = "_reverse_kl_fusable" if name == "reverse_kl" else "_forward_kl_fusable"
    assert calls == [fusable] * 3


@pytest.mark.parametrize("name", ["forward_kl", "reverse_kl"])
def test_weighted_divergence_with_gradient_to_the_weights(name):
    """head_weighted_divergence (Router KD's per-sequence weights), weights that need a gradient too: ∂/∂w_t is
    token t's divergence; ScaledHead-style heads (weight · logit factor) pass the gradient to the leaf."""
    x = inputs(seed=5, bias=True)
    w0 = torch.rand(N, dtype=torch.float32, generator=torch.Generator().manual_seed(1))
    out = {}
    for impl in ("fused", "autograd"):
        sh = x["sh"].clone().requires_grad_(True)
        sw = x["sw"].clone().requires_grad_(True)
        sb = x["sb"].clone().requires_grad_(True)
        w = w0.clone().requires_grad_(True)
        factor = 0.37  # workers/training/distill.py lm_head folds a constant logit factor into the head
        total = head_weighted_divergence(
            LOSSES[name].token_loss,
            x["th"].reshape(1, N, H),
            x["tw"] * 2.0,
            sh.reshape(1, N, H),
            sw * factor,
            w.reshape(1, N),
            tau=1.5,
            chunk=3,
            teacher_bias=x["tb"] * 2.0,
            student_bias=sb * factor,
            impl=impl,
        )
        out[impl] = (total.detach(), torch.autograd.grad(total, [sh, sw, sb, w]))
    assert_same(out["fused"], out["autograd"], F64)
    rows = LOSSES[name].token_loss(
        F.linear(x["th"], x["tw"] * 2.0, x["tb"] * 2.0),
        F.linear(x["sh"], x["sw"] * 0.37, x["sb"] * 0.37),
        1.5,
    )
    torch.testing.assert_close(out["fused"][1][3], rows.float(), rtol=1e-6, atol=1e-7)  # ∂/∂w_t = ℓ_t (fp32)


def test_any_token_loss_goes_through_the_fused_pass_by_autograd_on_each_chunk():
    """A token loss without a closed form here: its gradient w.r.t. each chunk's logits comes from autograd on
    that chunk (still one pass); the result is the reference's."""

    def symmetric(t: torch.Tensor, s: torch.Tensor, tau: float) -> torch.Tensor:
        return 0.5 * token_forward_kl(t, s, tau) + 0.5 * token_reverse_kl(t, s, tau)

    x = inputs(seed=8)
    out = {}
    for impl in ("fused", "autograd"):
        sh, sw = x["sh"].clone().requires_grad_(True), x["sw"].clone().requires_grad_(True)
        loss = head_divergence(symmetric, x["th"], x["tw"], sh, sw, 2.0, MASKS["partial"], 4, impl=impl)
        out[impl] = (loss.detach(), torch.autograd.grad(loss, [sh, sw]))
    assert_same(out["fused"], out["autograd"], F64)


@pytest.mark.parametrize("name", ["forward_kl", "reverse_kl"])
def test_non_finite_logits_give_the_references_answer(name):
    """Where a probability is 0 its term is 0 (token_*_kl's convention), also at a −inf logit; a NaN teacher
    row (garbage under the padding mask) counts as nothing in forward KL's value (and makes reverse KL NaN):
    the closed forms would give NaN where the reference does not, so such a call is redone on the exact path.
    Gradients are the reference's too, NaN included."""
    x = inputs(seed=9, bias=True)
    x["tb"][3] = x["sb"][3] = -math.inf  # neither model ever predicts token 3
    x["tb" if name == "forward_kl" else "sb"][5] = -math.inf  # the model whose probabilities weigh: token 5
    nan_row = x["th"].clone().index_fill_(0, torch.tensor([1]), math.nan)  # token 1 is masked out
    for th in (x["th"], nan_row):
        y = dict(x, th=th)
        fused = kd_loss(name, y, "fused", 1.0, MASKS["partial"], 4)
        ref = kd_loss(name, y, "autograd", 1.0, MASKS["partial"], 4)
        assert_same(fused, ref, dict(F64, equal_nan=True))
        if th is x["th"]:  # reverse KL's gradient is NaN, as autograd's: 0 · (log p_S = −inf) in its chain
            assert math.isfinite(fused[0].item())
            assert all(g.isfinite().all() for g in fused[1]) == (name == "forward_kl")
        elif name == "forward_kl":  # the loss ignores the NaN row; autograd's gradient does not (0 · NaN)
            assert math.isfinite(fused[0].item()) and fused[1][0][1].isnan().all()


def test_teacher_gets_no_gradient_and_no_grad_mode_gives_the_same_value():
    x = inputs(seed=10, bias=True)
    th, tw, tb = (x[k].clone().requires_grad_(True) for k in ("th", "tw", "tb"))
    sh = x["sh"].clone().requires_grad_(True)
    loss = head_divergence(token_forward_kl, th, tw, sh, x["sw"], 2.5, None, 4, tb, x["sb"])
    loss.backward()
    assert th.grad is None and tw.grad is None and tb.grad is None and sh.grad is not None
    with torch.no_grad():  # evaluation (Router KD's held-out loss): no gradient is computed at all
        for impl in ("fused", "autograd"):
            v = head_divergence(token_forward_kl, th, tw, sh, x["sw"], 2.5, None, 4, tb, x["sb"], impl=impl)
            assert not v.requires_grad
            torch.testing.assert_close(v, loss.detach(), **F64)


def test_zero_tokens():
    """An empty batch: loss 0, gradients of the inputs' shapes, all 0 (as the reference)."""
    x = inputs(seed=11)
    for impl in ("fused", "autograd"):
        sh = torch.zeros(0, H, dtype=torch.float64, requires_grad=True)
        sw = x["sw"].clone().requires_grad_(True)
        loss = head_divergence(token_reverse_kl, x["th"][:0], x["tw"], sh, sw, 1.0, None, 4, impl=impl)
        gh, gw = torch.autograd.grad(loss, [sh, sw], materialize_grads=True)  # the reference leaves sw out
        assert loss.item() == 0.0  # exact: a sum over no tokens
        assert gh.shape == (0, H) and not gw.any()  # exact: no token contributes


def test_bad_impl():
    x = inputs(seed=12)
    with pytest.raises(ValueError, match=r"impl='fast': allowed fused, compiled, autograd"):
        head_divergence(token_forward_kl, x["th"], x["tw"], x["sh"], x["sw"], impl="fast")


# ---- bf16 ------------------------------------------------------------------------------------------
BF16 = 2e-2  # max error / max magnitude: bf16 carries 8 bits, ~0.4% per rounding of logits and gradients


def scaled_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("name", ["forward_kl", "reverse_kl"])
@pytest.mark.parametrize("autocast", [False, True])
def test_bf16_against_a_float64_reference(name, autocast):
    """bf16 tensors (or fp32 ones under CPU bf16 autocast, as distillation runs): the fused loss and gradients
    are within BF16 (max error / max magnitude) of the float64 reference and no worse than autograd's bf16 run
    (to 0.5% of the magnitude); gradients come back in the inputs' dtypes."""
    x64 = inputs(seed=13, bias=True)
    ref = kd_loss(name, x64, "autograd", 2.0, MASKS["partial"], 4)
    low = torch.float32 if autocast else torch.bfloat16
    xl = {k: (v.to(low) if torch.is_tensor(v) else [h.to(low) for h in v]) for k, v in x64.items()}
    got = {}
    for impl in ("fused", "autograd"):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            got[impl] = kd_loss(name, xl, impl, 2.0, MASKS["partial"], 4)
    loss, grads = got["fused"]
    assert all(g.dtype == low for g in grads)
    errs = [scaled_error(loss, ref[0])] + [scaled_error(g, r) for g, r in zip(grads, ref[1], strict=True)]
    base = [scaled_error(got["autograd"][0], ref[0])] + [
        scaled_error(g, r) for g, r in zip(got["autograd"][1], ref[1], strict=True)
    ]
    assert max(errs) < BF16, errs
    assert all(e <= b + 5e-3 for e, b in zip(errs, base, strict=True)), (errs, base)


# ---- structure: one pass, [chunk, V] at most, no matmul in backward ------------------------------------
class OpLog(TorchDispatchMode):
    """Every aten op run while active: its name and the largest number of elements of its outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else [out]
        self.ops.append((func.__name__, max([o.numel() for o in outs if torch.is_tensor(o)], default=0)))
        return out


MATMULS = ("mm", "addmm", "bmm", "linear", "matmul", "addmm_", "baddbmm")


def logged(impl: str, n: int, chunk: int, vocab: int) -> tuple[OpLog, OpLog]:
    g = torch.Generator().manual_seed(0)
    th, sh = torch.randn(n, 4, generator=g), torch.randn(n, 4, generator=g).requires_grad_(True)
    tw, sw = torch.randn(vocab, 4, generator=g), torch.randn(vocab, 4, generator=g).requires_grad_(True)
    with OpLog() as fwd:
        loss = head_divergence(token_forward_kl, th, tw, sh, sw, 1.0, None, chunk, impl=impl)
    with OpLog() as bwd:
        loss.backward()
    return fwd, bwd


def test_fused_pass_is_one_pass_with_chunk_sized_buffers():
    n, chunk, vocab = 40, 8, 97
    fwd, bwd = logged("fused", n, chunk, vocab)
    chunks = n // chunk
    matmuls = [op for op, _ in fwd.ops if op.split(".")[0] in MATMULS]
    # per chunk: teacher logits, student logits, the hidden-state gradient and the head's (accumulated)
    assert len(matmuls) == 4 * chunks, matmuls
    biggest = max(numel for _, numel in fwd.ops + bwd.ops)
    assert biggest == chunk * vocab  # never [N, V]: the largest tensor is one chunk's logits
    assert not [op for op, _ in bwd.ops if op.split(".")[0] in MATMULS]  # backward only scales
    assert max(numel for _, numel in bwd.ops) <= vocab * 4  # the saved [V, H] and [N, H] gradients, scaled
    # the reference, seen by the same log: its backward recomputes both logits and multiplies again
    fwd_ref, bwd_ref = logged("autograd", n, chunk, vocab)
    assert len([op for op, _ in bwd_ref.ops if op.split(".")[0] in MATMULS]) >= 4 * chunks
    assert max(numel for _, numel in bwd_ref.ops) == chunk * vocab


def test_fp32_products_branch_with_out_dtype_emulated(monkeypatch):
    """On CUDA with bf16, torch's mm/addmm take out_dtype=float32 (`fp32_products`): logits and gradient
    products come out in fp32 and the head's gradient accumulates in place. CPU has no such kernel, so this
    emulates it (fp32 products of the bf16 operands) to run that branch here: same answer within BF16, and
    every product went through it."""
    assert not losses.fp32_products(torch.device("cpu"), torch.bfloat16)  # CPU: the plain branch
    real_mm, calls = torch.mm, []

    def mm(a, b, *, out_dtype=None, out=None):
        if out_dtype is None:
            return real_mm(a, b) if out is None else real_mm(a, b, out=out)
        assert out_dtype == torch.float32 and a.dtype == b.dtype == torch.bfloat16 and out is None
        calls.append("mm")
        return real_mm(a.float(), b.float())

    def addmm(acc, a, b, *, out_dtype, out):
        assert out is acc and acc.dtype == out_dtype == torch.float32 and a.dtype == b.dtype == torch.bfloat16
        calls.append("addmm")
        return acc.add_(real_mm(a.float(), b.float()))

    x64 = inputs(seed=14, bias=True)
    ref = kd_loss("forward_kl", x64, "autograd", 1.0, MASKS["partial"], 4)
    xl = {k: (v.to(torch.bfloat16) if torch.is_tensor(v) else v) for k, v in x64.items()}
    plain = kd_loss("forward_kl", xl, "fused", 1.0, MASKS["partial"], 4)
    monkeypatch.setattr(losses, "fp32_products", lambda device, dtype: dtype == torch.bfloat16)
    monkeypatch.setattr(torch, "mm", mm)
    monkeypatch.setattr(torch, "addmm", addmm)
    got = kd_loss("forward_kl", xl, "fused", 1.0, MASKS["partial"], 4)
    chunks = 3  # 11 tokens in chunks of 4
    # per chunk: 2 logits + the hidden-state gradient; the head's gradient: 1 mm, then addmm in place
    assert calls.count("mm") == 3 * chunks + 1 and calls.count("addmm") == chunks - 1, calls
    for g, p, r in zip([got[0], *got[1]], [plain[0], *plain[1]], [ref[0], *ref[1]], strict=True):
        assert g.dtype == p.dtype
        assert scaled_error(g, r) < BF16
