"""Choosing the experts of a pruned MoE: super-expert detection and the selection that protects them,
on constructed statistics (workers/methods/pruning.py), plus the `forced` start of both selectors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from workers.core.types import ExpertWeights, LayerContext, LayerStats
from workers.methods.pruning import select_pruned, super_experts
from workers.methods.scoring import SCORINGS, reap
from workers.methods.selection import d_optimal_greedy, importance_kernel, log_det_objective, top_k

F64 = dict(dtype=torch.float64)


def stats(max_norm: list[float], count: list[float], reap_mean: list[float], seed: int = 0) -> LayerStats:
    """E experts with the given per-expert max routed norm, routed count and REAP mean (Σg‖f‖ / count);
    a random PSD Gram for the D-optimal selector."""
    E = len(max_norm)
    c = torch.tensor(count, **F64)
    a = torch.randn(E, 3 * E, generator=torch.Generator().manual_seed(seed), **F64)
    gram = a @ a.T
    z = torch.zeros(E, **F64)
    return LayerStats(
        n_tokens=100,
        count=c,
        sum_p=z,
        sum_p_sel=z,
        sum_sq=gram.diagonal().clone(),
        sum_gnorm_sel=torch.tensor(reap_mean, **F64) * c,
        sum_norm_sel=c,
        gram=gram,
        sum_pnorm_sel=z,
        max_norm_sel=torch.tensor(max_norm, **F64),
    )


def ctx(st: LayerStats, k: int = 2) -> LayerContext:
    E, H = st.num_experts, 4
    w = torch.zeros(E, 3, H, **F64)
    return LayerContext(
        stats=st,
        experts=ExpertWeights(gate=w, up=w, down=w.transpose(1, 2)),
        router_weight=torch.zeros(E, H, **F64),
        top_k=k,
        renormalized=True,
    )


# experts 3 and 5 are outliers (30 and 15 against a median of 1.15 over the routed experts); 6 is never
# routed; 3 and 5 have the lowest REAP scores, so REAP alone would drop them first
MAX = [1.0, 1.2, 0.9, 30.0, 1.1, 15.0, 0.0]
COUNT = [10, 12, 8, 2, 9, 3, 0]
REAP = [0.5, 0.8, 0.6, 0.1, 0.7, 0.2, 0.0]


def test_super_experts_are_the_outliers_over_the_median_of_routed_maxima():
    st = stats(MAX, COUNT, REAP)
    assert super_experts(st, 10.0) == [3, 5]  # threshold 10 × 1.15 = 11.5; largest first
    assert super_experts(st, 20.0) == [3]  # threshold 23
    assert super_experts(st, 40.0) == []
    # the median is over the routed experts only: 1.3 here (with the two never-routed zeros it would be
    # 1.1, and 12.9 > 10 × 1.1 would make expert 5 an outlier)
    m, cnt, r = [1.0, 1.0, 1.2, 1.4, 1.4, 12.9, 0.0, 0.0], [5] * 6 + [0, 0], [0.5] * 8
    assert super_experts(stats(m, cnt, r), 10.0) == []
    assert super_experts(stats(m, cnt, r), 9.0) == [5]  # 12.9 > 11.7
    # equal maxima: the lower id first
    assert super_experts(stats([1.0, 50.0, 1.0, 50.0, 1.0, 1.0, 0.0], COUNT, REAP), 10.0) == [1, 3]


def test_super_expert_errors():
    st = stats(MAX, COUNT, REAP)
    for bad in (0.5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="super-expert factor"):
            super_experts(st, bad)
    with pytest.raises(ValueError, match="lack max_norm_sel: recompute"):
        super_experts(dataclasses.replace(st, max_norm_sel=None), 10.0)
    assert super_experts(stats([0.0] * 3, [0, 0, 0], [0.0] * 3), 10.0) == []  # nothing routed


def test_protection_keeps_the_super_experts_and_fills_by_the_criterion():
    c = ctx(stats(MAX, COUNT, REAP))
    assert SCORINGS["REAP"].select(c, reap(c), 4).selected == [1, 4, 2, 0]  # REAP drops 3 and 5
    sel = select_pruned(c, "REAP", 4, super_factor=10.0)
    assert sel.selected == [3, 5, 1, 4] and sel.extras["protected"] == [3, 5]
    assert select_pruned(c, "REAP", 4).selected == [1, 4, 2, 0]  # no protection asked
    # more outliers than K: the K with the largest max norm
    c3 = ctx(stats([40.0, 1.0, 50.0, 1.0, 45.0, 1.0, 1.0], [5] * 7, REAP), k=2)
    sel = select_pruned(c3, "REAP", 2, super_factor=10.0)
    assert sel.selected == [2, 4] and sel.extras["super_experts"] == [2, 4, 0]


def test_protection_with_the_d_optimal_selector_continues_the_greedy_from_the_protected_set():
    c = ctx(stats(MAX, COUNT, REAP, seed=3))
    sel = select_pruned(c, "DO-REAP", 4, super_factor=10.0)
    assert sel.selected[:2] == [3, 5]
    kernel = importance_kernel(c.stats.gram, c.stats.n_tokens, reap(c))
    lam = sel.extras["lambda"]
    chosen = [3, 5]
    for _ in range(2):  # each later pick maximizes log det(𝒦_S + λI) given the picks before it
        rest = [e for e in range(7) if e not in chosen]
        gains = {e: log_det_objective(kernel, chosen + [e], lam, normalized=False) for e in rest}
        chosen.append(max(rest, key=lambda e: (gains[e], -e)))
    assert sel.selected == chosen


def test_forced_starts_and_their_errors():
    s = torch.tensor([0.1, 0.9, 0.5, 0.9], **F64)
    assert top_k(s, 3, forced=[0]) == [0, 1, 3]
    assert top_k(s, 2, forced=[2, 0]) == [2, 0]
    kernel = torch.eye(4, **F64) * torch.tensor([1.0, 4.0, 2.0, 3.0], **F64)
    assert d_optimal_greedy(kernel, 3, forced=[0]).selected == [0, 1, 3]
    for bad in ([0, 0], [4], [0, 1, 2, 3]):
        with pytest.raises(ValueError, match="forced="):
            top_k(s, 3, forced=bad)
        with pytest.raises(ValueError, match="forced="):
            d_optimal_greedy(kernel, 3, forced=bad)


def test_select_pruned_rejects_k_outside_k_to_e():
    c = ctx(stats(MAX, COUNT, REAP), k=2)
    for K in (1, 8):
        with pytest.raises(ValueError, match="k <= K <= E: 2..7"):
            select_pruned(c, "REAP", K)
