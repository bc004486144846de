"""Input-scaled experts (ExpertWeights.input_scaled: the router weight multiplies the expert's input, f_e(w·x),
as in Llama-4): the concatenated FFN of Algorithm 1 puts α_g on block g's gate and up rows, and is then exactly
Σ_g f_g(α_g h). Pure tensors, checked against a hand loop."""

from __future__ import annotations

import pytest
import torch

from workers.core.types import DenseFFN, ExpertWeights, LayerPlan
from workers.methods.merge import build_dense_ffn, concat_blocks, ffn_forward, routed_forward

E, W, H = 5, 4, 6


def experts(input_scaled: bool, biases: bool = False) -> ExpertWeights:
    g = torch.Generator().manual_seed(0)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    kw = dict(gate_bias=r(E, W), up_bias=r(E, W), down_bias=r(E, H)) if biases else {}
    return ExpertWeights(gate=r(E, W, H), up=r(E, W, H), down=r(E, H, W), input_scaled=input_scaled, **kw)


def hand_expert(ex: ExpertWeights, members: list[int], mw: list[float], h: torch.Tensor) -> torch.Tensor:
    """The merged expert Σ_e w_e W_e of `members` on h, written out (silu(g)·u)."""
    gate = sum(w * ex.gate[e] for e, w in zip(members, mw, strict=True))
    up = sum(w * ex.up[e] for e, w in zip(members, mw, strict=True))
    down = sum(w * ex.down[e] for e, w in zip(members, mw, strict=True))
    gi, ui = h @ gate.T, h @ up.T
    if ex.gate_bias is not None:
        gi = gi + sum(w * ex.gate_bias[e] for e, w in zip(members, mw, strict=True))
        ui = ui + sum(w * ex.up_bias[e] for e, w in zip(members, mw, strict=True))
    y = (torch.nn.functional.silu(gi) * ui) @ down.T
    if ex.down_bias is not None:
        y = y + sum(w * ex.down_bias[e] for e, w in zip(members, mw, strict=True))
    return y


PLAN = LayerPlan(
    layer=0,
    selected=[1, 3, 0, 4],
    scores=[1.0] * E,
    groups=[[1, 3], [0, 4]],
    merge_weights=[[0.3, 0.7], [0.6, 0.4]],
    alpha=[0.7, 0.45],
)


@pytest.mark.parametrize("biases", [False, True])
def test_input_scaled_dense_ffn_is_the_sum_of_groups_on_scaled_inputs(biases):
    ex = experts(True, biases)
    h = torch.randn(9, H, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) * 2
    ffn = build_dense_ffn(ex, PLAN)
    want = sum(
        hand_expert(ex, g, mw, a * h)
        for g, mw, a in zip(PLAN.groups, PLAN.merge_weights, PLAN.alpha, strict=True)
    )
    torch.testing.assert_close(ffn_forward(ffn, h), want, rtol=1e-10, atol=1e-10)
    # and it is not the output-scaled combination: the two conventions really differ here
    out_scaled = sum(
        a * hand_expert(ex, g, mw, h)
        for g, mw, a in zip(PLAN.groups, PLAN.merge_weights, PLAN.alpha, strict=True)
    )
    assert not torch.allclose(ffn_forward(ffn, h), out_scaled, atol=1e-3)


def test_output_scaled_experts_keep_alpha_on_the_down_projection():
    ex = experts(False, biases=True)
    h = torch.randn(9, H, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    ffn = build_dense_ffn(ex, PLAN)
    want = sum(
        a * hand_expert(ex, g, mw, h)
        for g, mw, a in zip(PLAN.groups, PLAN.merge_weights, PLAN.alpha, strict=True)
    )
    torch.testing.assert_close(ffn_forward(ffn, h), want, rtol=1e-10, atol=1e-10)


def test_singleton_groups_reproduce_the_routed_combination():
    """K = k singletons with α = the router's weights (the same on every token): the dense FFN equals the
    routed layer Σ_j f_{e_j}(w_j h), and routed_forward computes that layer."""
    ex = experts(True)
    h = torch.randn(7, H, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    idx, w = [4, 1], [0.8, 0.35]
    plan = LayerPlan(
        layer=0, selected=idx, scores=[1.0] * E, groups=[[4], [1]], merge_weights=[[1.0], [1.0]], alpha=w
    )
    routed = routed_forward(ex, h, torch.tensor([w] * 7, dtype=torch.float64), torch.tensor([idx] * 7))
    want = sum(hand_expert(ex, [e], [1.0], a * h) for e, a in zip(idx, w, strict=True))
    torch.testing.assert_close(routed, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ffn_forward(build_dense_ffn(ex, plan), h), want, rtol=1e-10, atol=1e-10)


def test_concat_blocks_input_scaled_rows():
    ex = experts(True)
    a = DenseFFN(gate=ex.gate[0], up=ex.up[0], down=ex.down[0])
    b = DenseFFN(gate=ex.gate[1], up=ex.up[1], down=ex.down[1])
    out = concat_blocks([a, b], [2.0, 0.5], input_scaled=True)
    # exact: one elementwise product by a power of two (exact in binary), and stacking (copied bytes)
    assert torch.equal(out.gate[:W], 2.0 * a.gate) and torch.equal(out.up[W:], 0.5 * b.up)
    assert torch.equal(out.down, torch.cat([a.down, b.down], dim=1))
