"""Scorings against their formulas (paper §3.2, Appendix C; REAP paper Eq. 9, Eq. 13)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from workers.core.types import ExpertWeights, LayerContext, LayerStats
from workers.methods.diagnostics import stats_from_tokens
from workers.methods.scoring import (
    SCORINGS,
    Scoring,
    acp,
    cp,
    ean,
    get_scoring,
    pp,
    ps,
    reap,
    reap_p,
    select_d_optimal,
    sf,
)
from workers.methods.selection import d_optimal_greedy, importance_kernel, top_k


def ctx_from_stats(stats: LayerStats, k: int, H: int = 4, inter: int = 3, seed: int = 0) -> LayerContext:
    gen = torch.Generator().manual_seed(seed)
    E = stats.num_experts
    experts = ExpertWeights(
        gate=torch.randn(E, inter, H, generator=gen),
        up=torch.randn(E, inter, H, generator=gen),
        down=torch.randn(E, H, inter, generator=gen),
    )
    return LayerContext(
        stats=stats,
        experts=experts,
        router_weight=torch.randn(E, H, generator=gen),
        top_k=k,
        renormalized=True,
    )


def hand_ctx() -> LayerContext:
    """4 tokens, 4 experts, top-2; expert 3 is never selected. Outputs are 1-d so norms are |f|."""
    p = torch.tensor(
        [[0.5, 0.3, 0.2, 0.0], [0.2, 0.5, 0.3, 0.0], [0.6, 0.1, 0.3, 0.0], [0.4, 0.4, 0.2, 0.0]],
        dtype=torch.float64,
    )
    routed = torch.tensor([[1, 1, 0, 0], [0, 1, 1, 0], [1, 0, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    g = routed * p / (routed * p).sum(1, keepdim=True)  # renormalized top-k
    f = torch.tensor(
        [[2.0, 1.0, 0.0, 1.0], [2.0, 1.0, 4.0, 1.0], [2.0, 1.0, 0.0, 1.0], [2.0, 1.0, 0.0, 1.0]],
        dtype=torch.float64,
    )[..., None]
    return ctx_from_stats(stats_from_tokens(p, routed, g, f), k=2)


def test_registry_names_are_exactly_the_papers_plus_reap_family():
    assert set(SCORINGS) == {
        "SF",
        "PP",
        "PS",
        "CP",
        "ACP",
        "DO-CP",
        "DO-ACP",
        "REAP",
        "REAP-p",
        "DO-REAP",
        "EAN",
        "frequency",
        "Weights",
        "max_activations",
        "RL-exhaustive",
        "RL-greedy",
        "CFES",
    }
    assert all(isinstance(s, Scoring) for s in SCORINGS.values())


def test_each_scoring_matches_hand_computed_values():
    ctx = hand_ctx()
    close = lambda a, b: torch.testing.assert_close(a, torch.tensor(b, dtype=torch.float64))  # noqa: E731
    close(sf(ctx), [3 / 4, 3 / 4, 2 / 4, 0.0])
    close(pp(ctx), [1.7 / 4, 1.3 / 4, 1.0 / 4, 0.0])
    close(ps(ctx), [1.5 / 4, 1.2 / 4, 0.6 / 4, 0.0])
    close(cp(ctx), [0.5, 0.4, 0.3, 0.0])  # 1.5/3, 1.2/3, 0.6/2, never selected → 0
    close(acp(ctx), [0.5 * 2.0, 0.4 * 1.0, 0.3 * 2.0, 0.0])  # CP · sqrt(mean f²): RMS 2, 1, sqrt(16/4)=2
    # REAP: mean over routed tokens of g·|f|; g = p renormalized over the token's two experts.
    close(
        reap(ctx),
        [
            (0.5 / 0.8 * 2 + 0.6 / 0.9 * 2 + 0.5 * 2) / 3,
            (0.3 / 0.8 + 0.5 / 0.8 + 0.5) / 3,
            (0.3 / 0.8 * 4 + 0.3 / 0.9 * 0) / 2,
            0.0,
        ],
    )
    # REAP-p: the same mean with the raw softmax p (not renormalized over the token's two experts)
    close(
        reap_p(ctx), [(0.5 * 2 + 0.6 * 2 + 0.4 * 2) / 3, (0.3 + 0.5 + 0.4) / 3, (0.3 * 4 + 0.3 * 0) / 2, 0.0]
    )
    close(ean(ctx), [6.0, 3.0, 4.0, 0.0])  # Σ over routed tokens of |f|
    # The registry wires the same functions.
    for name, fn in [
        ("SF", sf),
        ("PP", pp),
        ("PS", ps),
        ("CP", cp),
        ("ACP", acp),
        ("DO-CP", cp),
        ("DO-ACP", acp),
        ("REAP", reap),
        ("REAP-p", reap_p),
        ("DO-REAP", reap),
        ("EAN", ean),
        ("frequency", sf),
    ]:
        torch.testing.assert_close(SCORINGS[name].score(ctx), fn(ctx))
        assert SCORINGS[name].score(ctx).dtype == torch.float64


def random_token_ctx(seed: int, E: int = 12, k: int = 3, N: int = 200, d: int = 5) -> LayerContext:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(N, E, generator=gen, dtype=torch.float64) * 2
    p = logits.softmax(-1)
    routed = torch.zeros(N, E, dtype=torch.bool).scatter_(1, p.topk(k, dim=1).indices, True)
    f = torch.randn(N, E, d, generator=gen, dtype=torch.float64)
    return ctx_from_stats(stats_from_tokens(p, routed, p * routed, f), k=k, seed=seed)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_ps_equals_sf_times_cp(seed):
    """Appendix C: PS decomposes as SF × CP, elementwise."""
    ctx = random_token_ctx(seed)
    torch.testing.assert_close(ps(ctx), sf(ctx) * cp(ctx), rtol=1e-12, atol=1e-15)


def test_acp_and_reap_differ_as_the_digest_says():
    """ACP uses the all-token RMS and raw p; REAP the routed-token mean of g·‖f‖ (they differ in which
    tokens and which weights they average)."""
    ctx = random_token_ctx(5)
    s = ctx.stats
    rms = (s.sum_sq / s.n_tokens).sqrt()
    torch.testing.assert_close(acp(ctx), cp(ctx) * rms)
    torch.testing.assert_close(reap(ctx), s.sum_gnorm_sel / s.count)
    assert not torch.allclose(acp(ctx), reap(ctx))


def test_never_selected_experts_score_zero_not_nan():
    from dataclasses import replace

    ctx = hand_ctx()
    # the max-activation pass records 0 for an expert no token was routed to (expert 3 here)
    ctx = replace(ctx, maxima=torch.tensor([0.7, 1.5, 0.2, 0.0] + [0.3] * (ctx.stats.num_experts - 4)))
    for name in SCORINGS:
        s = SCORINGS[name].score(ctx)
        assert torch.isfinite(s).all() and float(s[3]) == 0.0, (
            name
        )  # exact: its sums are 0; a 0 set, or 0 times a finite


def test_top_k_breaks_ties_by_lower_id():
    s = torch.tensor([0.5, 0.9, 0.5, 0.9, 0.1], dtype=torch.float64)
    assert top_k(s, 3) == [1, 3, 0]
    assert top_k(s, 5) == [1, 3, 0, 2, 4]


def test_independent_selectors_are_top_k_and_do_selectors_use_the_greedy():
    ctx = random_token_ctx(7)
    for name in ("SF", "PP", "PS", "CP", "ACP", "REAP", "REAP-p", "EAN", "frequency"):
        sc = SCORINGS[name]
        assert sc.select(ctx, sc.score(ctx), 5).selected == top_k(sc.score(ctx), 5)
    for name in ("DO-CP", "DO-ACP", "DO-REAP"):
        sc = SCORINGS[name]
        sel = sc.select(ctx, sc.score(ctx), 5)
        E = ctx.stats.num_experts
        kernel_trace = float((sc.score(ctx) * torch.diagonal(ctx.stats.gram) / ctx.stats.n_tokens).sum())
        assert math.isclose(sel.extras["lambda"], kernel_trace / (5 * E), rel_tol=1e-12)
        assert len(set(sel.selected)) == 5


def test_do_reap_is_the_greedy_on_the_reap_kernel_and_differs_from_reap_top_k():
    """DO-REAP: greedy D-optimal on 𝒦 = sqrt(REAP_i REAP_j)·G_ij; on random layers it does not
    collapse to REAP's top-K."""
    differs = False
    for seed in range(6):
        ctx = random_token_ctx(seed, E=12, k=3)
        got = SCORINGS["DO-REAP"].select(ctx, reap(ctx), 4).selected
        want = d_optimal_greedy(importance_kernel(ctx.stats.gram, ctx.stats.n_tokens, reap(ctx)), 4).selected
        assert got == want == select_d_optimal(ctx, reap(ctx), 4).selected
        differs |= sorted(got) != sorted(top_k(reap(ctx), 4))
    assert differs


def test_reap_ties_go_to_the_lower_expert_id():
    """Two experts with the same routed mean of g·‖f‖ (different counts): top-K keeps the lower id."""
    ctx = hand_ctx()
    s = ctx.stats
    count = torch.tensor([2.0, 4.0, 1.0, 3.0], dtype=torch.float64)
    gnorm = torch.tensor([1.0, 2.0, 0.25, 0.75], dtype=torch.float64)  # REAP = 0.5, 0.5, 0.25, 0.25
    tied = dataclasses.replace(s, count=count, sum_gnorm_sel=gnorm)
    ctx = dataclasses.replace(ctx, stats=tied)
    assert reap(ctx).tolist() == [
        0.5,
        0.5,
        0.25,
        0.25,
    ]  # exact: one division each, the quotients representable
    for K, want in ((1, [0]), (2, [0, 1]), (3, [0, 1, 2])):
        assert SCORINGS["REAP"].select(ctx, reap(ctx), K).selected == want


def test_reap_p_without_its_sum_says_recompute():
    ctx = hand_ctx()
    ctx = dataclasses.replace(ctx, stats=dataclasses.replace(ctx.stats, sum_pnorm_sel=None))
    with pytest.raises(ValueError, match="lack sum_pnorm_sel: recompute the calibration statistics"):
        reap_p(ctx)


def test_bad_inputs_give_one_line_errors():
    with pytest.raises(ValueError, match=r"unknown scoring 'XX'; allowed: SF, PP") as e:
        get_scoring("XX")
    assert "\n" not in str(e.value)
    empty = LayerStats(
        n_tokens=0,
        count=torch.zeros(3),
        sum_p=torch.zeros(3),
        sum_p_sel=torch.zeros(3),
        sum_sq=torch.zeros(3),
        sum_gnorm_sel=torch.zeros(3),
        sum_norm_sel=torch.zeros(3),
        gram=torch.zeros(3, 3),
    )
    with pytest.raises(ValueError, match="n_tokens=0"):
        sf(ctx_from_stats(empty, k=1))
    with pytest.raises(ValueError, match="K=4 out of range"):
        top_k(torch.ones(3), 4)
