"""Balanced OT assignment (DOT-MoE App. B.2–B.3) and the OT grouping built on it."""

from __future__ import annotations

import pytest
import torch

from tests.test_grouping import make_ctx
from workers.methods.grouping import get_grouping, rank_order
from workers.methods.planning import plan_layer
from workers.methods.scoring import ps
from workers.methods.sinkhorn import balanced_capacity, greedy_round, sinkhorn


def test_sinkhorn_marginals_and_temperature():
    a = torch.randn(12, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    cap = torch.tensor([4.0, 4.0, 4.0], dtype=torch.float64)
    m = sinkhorn(a, cap, tau=0.1, iters=200)
    torch.testing.assert_close(m.sum(1), torch.ones(12, dtype=torch.float64), atol=1e-8, rtol=0)
    torch.testing.assert_close(m.sum(0), cap, atol=1e-6, rtol=0)
    # a lower temperature makes the plan sharper (closer to a 0/1 matrix)
    sharp = sinkhorn(a, cap, tau=0.01, iters=500)
    assert float((sharp * (1 - sharp)).sum()) < float((m * (1 - m)).sum())


def test_sinkhorn_is_differentiable_to_the_affinity():
    a = torch.randn(6, 2, dtype=torch.float64, requires_grad=True)
    m = sinkhorn(a, torch.tensor([3.0, 3.0], dtype=torch.float64))
    (m[:, 0] * torch.arange(6.0, dtype=torch.float64)).sum().backward()
    assert a.grad is not None and bool(torch.isfinite(a.grad).all()) and float(a.grad.abs().sum()) > 0


def test_greedy_rounding_fills_every_bin_exactly():
    soft = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.7, 0.3], [0.6, 0.4]], dtype=torch.float64)
    # every row prefers bin 0; capacity 2 each: the two strongest go to 0, the rest overflow to 1
    assert greedy_round(soft, [2, 2]) == [0, 0, 1, 1]
    assert greedy_round(soft, [3, 1]) == [0, 0, 0, 1]
    assert balanced_capacity(10, 4) == [3, 3, 2, 2]
    with pytest.raises(ValueError, match="summing to n=4"):
        greedy_round(soft, [1, 1])
    with pytest.raises(ValueError, match="positive bin sizes"):
        sinkhorn(soft, torch.tensor([4.0, 0.0], dtype=torch.float64))


def test_ot_grouping_is_balanced_and_recovers_output_families():
    ctx = make_ctx(E=12, k=3, families=3, seed=3)
    scores = torch.arange(12, 0, -1, dtype=torch.float64)  # expert 0 best, then 1, 2: one per family
    groups = get_grouping("OT")(ctx, list(range(12)), scores, 3)
    assert sorted(len(g) for g in groups) == [4, 4, 4]
    assert sorted(sorted(g) for g in groups) == [[0, 3, 6, 9], [1, 4, 7, 10], [2, 5, 8, 11]]


def test_ot_grouping_uneven_and_singletons():
    ctx = make_ctx(E=10, k=4, seed=5)
    scores = torch.rand(10, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    sel = list(range(10))
    groups = get_grouping("OT")(ctx, sel, scores, 4)
    assert sorted(len(g) for g in groups) == [2, 2, 3, 3] and sorted(e for g in groups for e in g) == sel
    assert groups == get_grouping("OT")(ctx, sel, scores, 4)  # deterministic
    order = rank_order(sel[:4], scores)
    assert get_grouping("OT")(ctx, sel[:4], scores, 4) == [[e] for e in order]  # K = k: singletons


def sequential_rounding(soft: torch.Tensor, capacity: list[int]) -> list[int]:
    """DOT-MoE App. B.3.2 as written: visit the (row, bin) pairs by descending mass (ties: lower flat index)
    and assign a row to a bin while both are free."""
    n, m = soft.shape
    flat = soft.reshape(-1).tolist()
    owner, cap = [-1] * n, list(capacity)
    for idx in sorted(range(n * m), key=lambda i: (-flat[i], i)):
        i, e = divmod(idx, m)
        if owner[i] == -1 and cap[e] > 0:
            owner[i], cap[e] = e, cap[e] - 1
    return owner


@pytest.mark.parametrize("ties", [False, True])
def test_greedy_rounding_is_the_sequential_visit(ties):
    g = torch.Generator().manual_seed(3)
    for trial in range(150):
        n = int(torch.randint(1, 40, (1,), generator=g))
        m = int(torch.randint(1, min(n, 9) + 1, (1,), generator=g))
        soft = torch.rand(n, m, generator=g, dtype=torch.float64)
        if ties:  # few distinct values: many equal masses, decided by the flat index
            soft = (soft * 3).floor() / 3
        cap = balanced_capacity(n, m) if trial % 2 else _random_capacity(n, m, g)
        assert greedy_round(soft, cap) == sequential_rounding(soft, cap), (n, m, cap)


def _random_capacity(n: int, m: int, g: torch.Generator) -> list[int]:
    cuts = sorted(int(c) for c in torch.randint(0, n + 1, (m - 1,), generator=g))
    return [b - a for a, b in zip([0, *cuts], [*cuts, n], strict=True)]  # zeros allowed


def test_greedy_rounding_at_real_shape_is_fast_enough_to_run_per_step():
    """Qwen3-8B's FFN into 96 experts (12288 x 96): one call, the whole assignment balanced (no timing assert:
    the benchmark's job; this checks the vectorised path at that size)."""
    soft = torch.rand(12288, 96, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    owner = greedy_round(soft, [128] * 96)
    assert sorted(torch.bincount(torch.tensor(owner), minlength=96).tolist()) == [128] * 96


def _near_duplicate_top_two(seed: int):
    """A random layer and kept set whose two top-scored kept experts have near-identical outputs
    (cosine ≈ 1 − 5e-7), with K a multiple of k."""
    g = torch.Generator().manual_seed(seed)
    k = int(torch.randint(2, 5, (1,), generator=g))
    K = k * int(torch.randint(2, 5, (1,), generator=g))
    E = K + int(torch.randint(0, 5, (1,), generator=g))
    ctx = make_ctx(E=E, seed=seed)
    selected = torch.randperm(E, generator=g)[:K].tolist()
    scores = torch.rand(E, generator=g, dtype=torch.float64)
    top = sorted(selected, key=lambda e: (-float(scores[e]), e))  # the statement: score desc, ties → lower id
    f = torch.randn(64, E, 6, generator=g, dtype=torch.float64)
    f[:, top[1]] = f[:, top[0]] + 1e-3 * torch.randn(64, 6, generator=g, dtype=torch.float64)
    ctx.stats.gram = torch.einsum("ned,nfd->ef", f, f)
    ctx.stats.n_tokens = 64
    return ctx, selected, scores, k, K, top[:k]


def test_ot_near_duplicate_top_experts_each_anchor_their_own_balanced_group():
    """The k top-scored experts anchor the groups: over 200 random layers whose two top experts are
    near-duplicates, every anchor lies in a different group, heads it, and every group holds K/k experts."""
    for seed in range(200):
        ctx, selected, scores, k, K, anchors = _near_duplicate_top_two(seed)
        groups = get_grouping("OT")(ctx, selected, scores, k)
        assert len(groups) == k and sorted(e for g in groups for e in g) == sorted(selected), seed
        assert [len(g) for g in groups] == [K // k] * k, (seed, groups)
        assert [sum(a in g for a in anchors) for g in groups] == [1] * k, (seed, anchors, groups)
        assert [g[0] for g in groups] == anchors, (seed, anchors, groups)  # each anchor heads its group


def test_ot_anchors_head_their_groups_in_the_plan():
    """Through plan_layer (PS scores, top-K selection): the plan's group g starts with the g-th best-scored
    kept expert and gives it the group's largest merge weight, even when the two best have parallel outputs;
    K = 10, k = 3: group sizes 4, 3, 3 (the best-ranked anchor's group holds the extra expert)."""
    for seed in range(10):
        ctx = make_ctx(E=12, k=3, seed=seed)
        s = ps(ctx)
        best = sorted(range(12), key=lambda e: (-float(s[e]), e))
        f = torch.randn(64, 12, 6, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        f[:, best[1]] = f[:, best[0]] * 1.01
        ctx.stats.gram = torch.einsum("ned,nfd->ef", f, f)
        plan = plan_layer(0, ctx, "PS", "OT", "uniform", 10)
        assert sorted(plan.selected) == sorted(best[:10])
        assert [g[0] for g in plan.groups] == best[:3], (seed, plan.groups)
        assert [len(g) for g in plan.groups] == [4, 3, 3]
        assert all(w[0] == max(w) for w in plan.merge_weights)


def test_ot_exact_ties_go_to_the_lower_id():
    """Equal scores and identical outputs (every affinity and soft mass exactly equal): the anchors are the
    lowest ids, and the rest fill the groups in id order, the lower ids to the lower-id anchor."""
    E = 8
    ctx = make_ctx(E=E, seed=0)
    ctx.stats.gram = torch.full((E, E), 2.5, dtype=torch.float64)
    ones = torch.ones(E, dtype=torch.float64)
    assert get_grouping("OT")(ctx, [5, 3, 7, 0, 6, 1, 4, 2], ones, 2) == [[0, 2, 3, 4], [1, 5, 6, 7]]
    assert get_grouping("OT")(ctx, [7, 6, 5, 4, 3, 2], ones, 3) == [[2, 5], [3, 6], [4, 7]]
