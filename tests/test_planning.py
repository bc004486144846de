"""plan_layer (Algorithm 1), merge weights (Eq. 1), α rules (Appendix H, §4.6) and plan signatures."""

from __future__ import annotations

import copy
import math
import re

import pytest
import torch

import workers.methods.scoring as scoring
from workers.core.types import ExpertWeights, LayerContext
from workers.methods.diagnostics import stats_from_tokens
from workers.methods.grouping import GROUPINGS
from workers.methods.merge import build_dense_ffn, ffn_forward
from workers.methods.planning import plan_layer, plan_signature
from workers.methods.scaling import SCALINGS, merge_weights
from workers.methods.scoring import SCORINGS, Scoring, cp


def make_ctx(
    E: int = 10, k: int = 2, H: int = 6, inter: int = 4, N: int = 96, seed: int = 0, renormalized: bool = True
) -> LayerContext:
    """A real (tiny) MoE layer: hidden states → router softmax → top-k → every expert's output."""
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    experts = ExpertWeights(gate=rnd(E, inter, H), up=rnd(E, inter, H), down=rnd(E, H, inter))
    router = rnd(E, H)
    h = rnd(N, H)
    p = (h @ router.T).softmax(-1)
    routed = torch.zeros(N, E, dtype=torch.bool).scatter_(1, p.topk(k, dim=1).indices, True)
    g = p * routed
    if renormalized:
        g = g / g.sum(1, keepdim=True)
    f = torch.stack([ffn_forward(experts, h, expert=e) for e in range(E)], dim=1)
    stats = stats_from_tokens(p, routed, g, f)
    stats.sample = {"x": h, "p": p}  # the tokens themselves, for reconstruction-loss scorings
    return LayerContext(
        stats=stats, experts=experts, router_weight=router, top_k=k, renormalized=renormalized
    )


@pytest.mark.parametrize("scoring_name", list(SCORINGS))
def test_every_combination_gives_a_valid_plan(scoring_name):
    from dataclasses import replace

    # max activations as the expert_maxima pass would give them (max_activations reads them)
    ctx = replace(make_ctx(E=10, k=3), maxima=torch.linspace(0.1, 2.0, 10).roll(3))
    for grouping_name in GROUPINGS:
        for scaling_name in SCALINGS:
            for K in (3, 5, 10):
                plan = plan_layer(2, ctx, scoring_name, grouping_name, scaling_name, K)
                s = SCORINGS[scoring_name].score(ctx)
                assert plan.layer == 2 and len(plan.selected) == K == len(set(plan.selected))
                assert plan.scores == s.tolist()  # exact: the same scoring function on the same statistics
                # k non-empty groups partitioning the selected set
                assert len(plan.groups) == 3 and all(plan.groups)
                assert sorted(e for g in plan.groups for e in g) == sorted(plan.selected)
                # Eq. 1: w_e = s_e / Σ_G s, each group's weights sum to 1
                for grp, ws in zip(plan.groups, plan.merge_weights, strict=True):
                    assert math.isclose(sum(ws), 1.0, rel_tol=1e-12)
                    total = sum(float(s[e]) for e in grp)
                    if total > 0:
                        assert ws == pytest.approx([float(s[e]) / total for e in grp], rel=1e-12)
                assert len(plan.alpha) == 3
                assert plan.extras["effective_rank"] >= 0 and plan.extras["effective_rank_acp"] >= 0
                assert ("lambda" in plan.extras) == scoring_name.startswith("DO-")


def test_alpha_rules():
    ctx = make_ctx(E=12, k=3)
    s = SCORINGS["PS"].score(ctx)
    uni = plan_layer(0, ctx, "PS", "RR", "uniform", 9)
    assert uni.alpha == [1 / 3] * 3  # Eq. 155
    prop = plan_layer(0, ctx, "PS", "RR", "proportional", 9)
    sel_total = sum(float(s[e]) for e in prop.selected)
    assert prop.alpha == pytest.approx(
        [sum(float(s[e]) for e in g) / sel_total for g in prop.groups]
    )  # Eq. 156
    assert math.isclose(sum(prop.alpha), 1.0, rel_tol=1e-12)
    # avg_cp (§4.6): each group's mean CP, whatever the scoring (here SF, whose scores differ from CP).
    c = cp(ctx)
    for name in ("SF", "ACP", "DO-CP"):
        pl = plan_layer(0, ctx, name, "RR", "avg_cp", 6)
        assert pl.alpha == pytest.approx([sum(float(c[e]) for e in g) / len(g) for g in pl.groups], rel=1e-12)
    # K = k, non-renormalized router: α_g = CP of the group's single expert (the MoE's mean weight on it).
    ds = make_ctx(E=12, k=3, renormalized=False)
    pl = plan_layer(0, ds, "SF", "RR", "avg_cp", 3)
    assert pl.alpha == pytest.approx([float(cp(ds)[g[0]]) for g in pl.groups], rel=1e-12)


def test_zero_score_fallbacks():
    """CP is 0 for never-selected experts: a zero-sum group merges uniformly; all-zero kept scores → α ∝ |G|."""
    s = torch.tensor([0.0, 0.0, 0.4, 0.0, 0.6], dtype=torch.float64)
    assert merge_weights([[2, 4], [0, 1, 3]], s) == [[0.4, 0.6], [1 / 3, 1 / 3, 1 / 3]]
    ctx = make_ctx(E=5)
    assert SCALINGS["proportional"](ctx, [[0], [1, 3]], s, [0, 1, 3]) == [1 / 3, 2 / 3]
    assert SCALINGS["proportional"](ctx, [[4], [0, 2]], s, [4, 0, 2]) == [0.6, 0.4]


def test_k_equal_K_makes_grouping_irrelevant():
    """§3.1/Appendix C: with K = k every group is one expert, so all five groupings give one student."""
    ctx = make_ctx(E=10, k=3)
    for name in ("SF", "ACP", "DO-ACP"):
        plans = {g: plan_layer(1, ctx, name, g, "proportional", 3) for g in GROUPINGS}
        sigs = {g: plan_signature([p]) for g, p in plans.items()}
        assert len({p.signature() for p in plans.values()}) == 1 and len(set(sigs.values())) == 1
        assert all(w == [1.0] for w in plans["RR"].merge_weights)
    # ... while for K > k the groupings do differ somewhere (otherwise the test above proves nothing).
    sigs = {plan_signature([plan_layer(1, ctx, "ACP", g, "proportional", 8)]) for g in GROUPINGS}
    assert len(sigs) > 1


def test_plan_signature_equal_iff_plans_equal_and_ignores_layer_order():
    ctx = make_ctx(E=10, k=2)
    a = [plan_layer(layer, ctx, "CP", "RR", "uniform", 4) for layer in range(3)]
    b = [plan_layer(layer, ctx, "CP", "RR", "uniform", 4) for layer in range(3)]
    sig = plan_signature(a)
    assert re.fullmatch(r"[0-9a-f]{64}", sig)  # a sha256 hex digest
    assert plan_signature(b) == sig and plan_signature(list(reversed(b))) == sig
    b[1].extras["note"] = 1.0  # extras and scores are not part of the student
    b[1].scores = [0.0] * 10
    assert plan_signature(b) == sig
    b[1].alpha = [0.6, 0.4]
    assert plan_signature(b) != sig
    c = [plan_layer(layer, ctx, "CP", "RR", "proportional", 4) for layer in range(3)]
    assert plan_signature(c) != sig
    # the order of the groups (the dense FFN's blocks) does not change the student; α stays with its group
    c_sig = plan_signature(c)
    d = copy.deepcopy(c)
    d[0].groups, d[0].merge_weights, d[0].alpha = (
        d[0].groups[::-1],
        d[0].merge_weights[::-1],
        d[0].alpha[::-1],
    )
    assert plan_signature(d) == c_sig
    assert c[0].alpha[0] != c[0].alpha[1]
    d[0].alpha = d[0].alpha[::-1]
    assert plan_signature(d) != c_sig


def test_determinism():
    ctx = make_ctx(E=12, k=3, seed=5)
    for name in ("DO-ACP", "REAP"):
        for g in GROUPINGS:
            assert plan_layer(0, ctx, name, g, "uniform", 7) == plan_layer(0, ctx, name, g, "uniform", 7)


def test_plan_builds_the_dense_ffn_it_describes():
    """Appendix A: with K = k, the dense FFN from the plan is Σ_g α_g f_{e_g}(h) exactly."""
    ctx = make_ctx(E=8, k=2)
    plan = plan_layer(0, ctx, "ACP", "RR", "proportional", 2)
    h = torch.randn(5, 6, dtype=torch.float64)
    want = sum(
        a * ffn_forward(ctx.experts, h, expert=g[0]) for a, g in zip(plan.alpha, plan.groups, strict=True)
    )
    torch.testing.assert_close(ffn_forward(build_dense_ffn(ctx.experts, plan), h), want)


def test_effective_rank_extra_and_do_lambda():
    ctx = make_ctx(E=10, k=2)
    pl = plan_layer(0, ctx, "DO-CP", "RR", "uniform", 4)
    c = cp(ctx)
    gbar = ctx.stats.gram / ctx.stats.n_tokens
    kernel = c.sqrt()[:, None] * gbar * c.sqrt()[None, :]
    assert math.isclose(pl.extras["lambda"], float(kernel.trace()) / (4 * 10), rel_tol=1e-12)
    idx = torch.as_tensor(pl.selected)
    ev = torch.linalg.eigvalsh(kernel[idx][:, idx]).clamp_min(0)
    prob = ev / ev.sum()
    prob = prob[prob > 0]
    assert math.isclose(
        pl.extras["effective_rank"], math.exp(float(-(prob * prob.log()).sum())), rel_tol=1e-9
    )
    assert 1.0 <= pl.extras["effective_rank"] <= 4.0


def test_adding_a_scoring_is_one_function_and_one_registry_line(monkeypatch):
    def ones(ctx: LayerContext) -> torch.Tensor:
        return torch.ones(ctx.stats.num_experts, dtype=torch.float64)

    monkeypatch.setitem(scoring.SCORINGS, "ONES", Scoring(ones))
    monkeypatch.setitem(scoring.SCORINGS, "DO-ONES", Scoring(ones, scoring.select_d_optimal))
    ctx = make_ctx(E=6, k=2)
    assert plan_layer(0, ctx, "ONES", "RR", "proportional", 4).selected == [0, 1, 2, 3]
    assert "lambda" in plan_layer(0, ctx, "DO-ONES", "RR", "proportional", 4).extras


def test_bad_K_and_names_give_one_line_errors(monkeypatch):
    ctx = make_ctx(E=6, k=2)
    cases = [
        (dict(K=1), r"K=1 out of range; allowed k <= K <= E: 2\.\.6"),
        (dict(K=7), r"K=7 out of range; allowed k <= K <= E: 2\.\.6"),
        (dict(scoring="XX"), r"unknown scoring 'XX'; allowed: SF, PP, PS, CP, ACP, DO-CP, DO-ACP"),
        (dict(grouping="XX"), r"unknown grouping 'XX'; allowed: RR, WC, RC, AB, OC"),
        (dict(scaling="XX"), r"unknown dp_scaling 'XX'; allowed: uniform, proportional, avg_cp"),
    ]
    for bad, msg in cases:
        kw = dict(scoring="CP", grouping="RR", scaling="uniform", K=3) | bad
        with pytest.raises(ValueError, match=msg) as e:
            plan_layer(0, ctx, **kw)
        assert "\n" not in str(e.value)
    monkeypatch.setitem(scoring.SCORINGS, "NEG", Scoring(lambda c: -torch.ones(6, dtype=torch.float64)))
    with pytest.raises(ValueError, match="scoring 'NEG' gave invalid scores for layer 0"):
        plan_layer(0, ctx, "NEG", "RR", "uniform", 3)


def test_bf16_experts_are_merged_in_fp32():
    """Eq. 1 on bf16 weights: the average is formed in fp32 and rounded once, not per product."""
    import torch

    from workers.core.types import ExpertWeights
    from workers.methods.merge import merge_group

    g = torch.Generator().manual_seed(0)
    full = [torch.randn(5, 8, 16, generator=g) for _ in range(2)] + [torch.randn(5, 16, 8, generator=g)]
    ex = ExpertWeights(*(t.to(torch.bfloat16) for t in full))
    w = [0.1, 0.2, 0.3, 0.4]
    merged = merge_group(ex, [0, 1, 2, 4], w)
    exact = sum(wi * ex.gate[e].double() for wi, e in zip(w, [0, 1, 2, 4], strict=True))
    assert merged.gate.dtype == torch.bfloat16
    # Rounded once: within half a bf16 ulp (2^-8 relative) of the exact average, plus 1e-6 for fp32's own rounding
    # (whose last bit BLAS may set differently; not bitwise). Rounding each product to bf16 misses this by far.
    torch.testing.assert_close(merged.gate.double(), exact, rtol=2.0**-8, atol=1e-6)
    per_product = sum(
        (wi * ex.gate[e].double()).to(torch.bfloat16) for wi, e in zip(w, [0, 1, 2, 4], strict=True)
    )
    assert not torch.allclose(per_product.double(), exact, rtol=2.0**-8, atol=1e-6)
