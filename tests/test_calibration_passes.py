"""How the calibration pass reads its expert outputs (workers/calibration/calibrate.py, LayerAccumulator):
each chunk's [E, t, H] outputs are read once after they are written (by the Gram's GEMM) plus their k
routed rows; Σ_t f comes from the activations through down; the SiLU activation's compiled kernel gives
eager's values and falls back to eager when it cannot compile."""

from __future__ import annotations

import warnings

import pytest
import torch
from families_cases import make_teacher
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from workers.calibration import calibrate
from workers.calibration.calibrate import LayerAccumulator, collect_stats
from workers.core import compiled as compiled_mod
from workers.core.types import STATS_TENSORS, ExpertWeights
from workers.families import get_adapter
from workers.methods import experts as experts_mod
from workers.methods.experts import all_expert_activations, all_expert_down, all_expert_outputs

GEMMS = {"mm", "bmm", "addmm", "baddbmm"}


class Readers(TorchDispatchMode):
    """Every non-GEMM, non-view op that takes a tensor of `numel` elements (of any shape) as an input."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.ops = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._schema.name.split("::")[-1]
        if name not in GEMMS and not func.is_view:
            ins = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            if any(t.numel() == self.numel for t in ins):
                self.ops.append(name)
        return out


def random_experts(E: int = 6, D: int = 5, H: int = 8, bias: bool = False, seed: int = 0) -> ExpertWeights:
    g = torch.Generator().manual_seed(seed)
    gu = torch.randn(E, 2 * D, H, generator=g, dtype=torch.float64)
    b = (lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)) if bias else (lambda *s: None)
    return ExpertWeights(
        gate=gu[:, :D],
        up=gu[:, D:],
        down=torch.randn(E, H, D, generator=g, dtype=torch.float64),
        gate_bias=b(E, D),
        up_bias=b(E, D),
        down_bias=b(E, H),
    )


def decision(T: int, E: int, k: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(T, E, generator=g, dtype=torch.float64).softmax(-1)
    w, idx = p.topk(k, dim=-1)
    return p, w, idx


@pytest.mark.parametrize("bias", [False, True])
def test_each_chunk_output_is_read_once_after_the_gram_besides_its_routed_rows(bias):
    ew = random_experts(bias=bias)
    T, chunk = 12, 12
    x = torch.randn(T, 8, dtype=torch.float64)
    p, w, idx = decision(T, 6, 2)
    mask = torch.ones(T, dtype=torch.bool)
    mask[-3:] = False
    acc = LayerAccumulator(ew, chunk)
    with Readers(6 * chunk * 8) as seen:  # the chunk's [E, t, H] outputs (x, a and the sums have other sizes)
        acc.update(x, p, w, idx, mask)
    # the routed rows' gather; with biases also the down bias added to the GEMM's output (the experts' own
    # arithmetic) and the padding rows zeroed
    assert seen.ops == (["add_", "where", "index_select"] if bias else ["index_select"])


@pytest.mark.parametrize("bias", [False, True])
def test_sums_against_the_outputs_themselves(bias):
    """Σ_t f (from Σ_t a through down, + n·b), Σ‖f‖² (the Gram's diagonal) and the routed norms equal what
    the [E, T, H] outputs give directly, over real tokens only, for chunks that split the batch unevenly."""
    ew = random_experts(bias=bias, seed=3)
    T = 11
    x = torch.randn(T, 8, dtype=torch.float64)
    p, w, idx = decision(T, 6, 2, seed=4)
    mask = torch.ones(T, dtype=torch.bool)
    mask[[2, 7]] = False
    acc = LayerAccumulator(ew, 4)
    acc.update(x, p, w, idx, mask)
    st = acc.finish()
    f = all_expert_outputs(ew, x)[:, mask]  # [E, real, H]
    torch.testing.assert_close(st.sum_out, f.sum(1), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(st.sum_sq, f.square().sum((1, 2)), rtol=1e-12, atol=0)
    norms = f.norm(dim=-1)  # [E, real]
    sel = idx[mask]
    want = torch.zeros(6, dtype=torch.float64).index_add_(
        0, sel.reshape(-1), norms.gather(0, sel.T).T.reshape(-1)
    )
    torch.testing.assert_close(st.sum_norm_sel, want, rtol=1e-12, atol=0)


def test_compiled_swiglu_gives_the_eager_activations():
    """The fused kernel (inductor compiles it for the CPU here) against eager's in-place silu_·mul_, over
    chunk lengths that differ (one dynamic-shape graph); fp32, a few ulps."""
    g = torch.Generator().manual_seed(5)
    gu = torch.randn(4, 14, 16, generator=g)
    ew = ExpertWeights(gate=gu[:, :7], up=gu[:, 7:], down=torch.randn(4, 16, 7, generator=g))
    for T in (5, 9, 3):
        x = torch.randn(T, 16, generator=g)
        got = all_expert_activations(ew, x, compiled=True)
        want = all_expert_activations(ew, x, compiled=False)
        torch.testing.assert_close(got, want, rtol=4 * torch.finfo(torch.float32).eps, atol=1e-6)


def test_compiled_swiglu_only_on_cuda_half_by_default_and_eager_when_it_cannot_compile(monkeypatch):
    calls = []
    real = compiled_mod.call_compiled
    monkeypatch.setattr(
        experts_mod, "call_compiled", lambda fn, *a: calls.append(fn.__name__) or real(fn, *a)
    )
    ew = random_experts()
    x = torch.randn(3, 8, dtype=torch.float64)
    all_expert_activations(ew, x)
    assert calls == []  # CPU: eager, in place
    all_expert_activations(ew, x, compiled=True)
    assert calls == ["swiglu"]

    def broken(*_):
        raise RuntimeError("no compiler here\nsecond line")

    monkeypatch.setattr(compiled_mod, "_FAILED", {})
    monkeypatch.setattr(compiled_mod, "_compiled", lambda fn: broken)
    with pytest.warns(
        UserWarning, match=r"^compiled swiglu unavailable \(RuntimeError: no compiler here\); eager$"
    ):
        got = all_expert_activations(ew, x, compiled=True)
    # exact: the fallback is the eager path itself, on the same inputs
    torch.testing.assert_close(got, all_expert_activations(ew, x, compiled=False), rtol=0, atol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: later calls are eager without a word
        all_expert_activations(ew, x, compiled=True)


def test_statistics_with_the_compiled_activation_equal_eager(monkeypatch):
    """A whole calibration pass with the compiled SwiGLU forced (what a CUDA bf16 run takes) against the
    eager pass on the same fp32 teacher."""
    model = make_teacher("qwen3_moe", seed=0, dtype=torch.float32, experts_implementation="eager")
    adapter = get_adapter(model)
    ids = torch.randint(3, 64, (2, 9), generator=torch.Generator().manual_seed(2))
    batches = [(ids, torch.ones_like(ids))]
    eager = collect_stats(model, adapter, batches, chunk_tokens=7)
    calls = []

    class Compiled(LayerAccumulator):
        @staticmethod
        def expert_outputs(experts, x, fused):
            calls.append(x.shape[0])
            a = all_expert_activations(experts, x, fused, compiled=True)
            assert a.is_contiguous()  # the fused kernel's own buffer, not eager's in-place view
            return a, all_expert_down(experts, a)

    monkeypatch.setattr(calibrate, "LayerAccumulator", Compiled)
    compiled = collect_stats(model, adapter, batches, chunk_tokens=7)
    assert calls and set(calls) == {7, 4}  # 18 tokens in chunks of 7
    for layer, st in eager.items():
        for name in STATS_TENSORS:
            want, got = getattr(st, name), getattr(compiled[layer], name)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()), msg=name)
