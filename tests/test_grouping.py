"""Groupings (paper §3.3, Appendix G, Appendix F.2)."""

from __future__ import annotations

import itertools

import pytest
import torch

import workers.methods.grouping as grouping
from workers.core.types import ExpertWeights, LayerContext
from workers.methods.diagnostics import stats_from_tokens
from workers.methods.grouping import (
    GROUPINGS,
    average_linkage_cut,
    cosine_distance_from_gram,
    get_grouping,
    weight_gram,
)


def make_ctx(
    E: int = 10,
    k: int = 2,
    H: int = 6,
    inter: int = 5,
    N: int = 64,
    d: int = 6,
    seed: int = 0,
    families: int | None = None,
) -> LayerContext:
    """Random layer. With `families`, expert e's weights, router row and outputs are its family's plus small noise."""
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    fam = [e % families for e in range(E)] if families else list(range(E))
    nb = families or E
    base_w = [rnd(nb, inter, H), rnd(nb, inter, H), rnd(nb, H, inter)]
    gate, up, down = (w[fam] + 0.05 * rnd(*w[fam].shape) for w in base_w)
    router = rnd(nb, H)[fam] + 0.05 * rnd(E, H)
    f = rnd(N, nb, d)[:, fam] + 0.05 * rnd(N, E, d)
    p = rnd(N, E).softmax(-1)
    routed = torch.zeros(N, E, dtype=torch.bool).scatter_(1, p.topk(k, dim=1).indices, True)
    stats = stats_from_tokens(p, routed, p * routed, f)
    return LayerContext(
        stats=stats,
        experts=ExpertWeights(gate=gate, up=up, down=down),
        router_weight=router,
        top_k=k,
        renormalized=True,
    )


def scores_for(E: int, seed: int = 1) -> torch.Tensor:
    return torch.rand(E, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def as_partition(groups: list[list[int]]) -> set[frozenset[int]]:
    return {frozenset(g) for g in groups}


@pytest.mark.parametrize("name", list(GROUPINGS))
def test_groups_partition_the_selected_set_into_exactly_k_nonempty_groups(name):
    ctx = make_ctx(E=12, k=3)
    s = scores_for(12)
    for K, k in [(3, 3), (4, 3), (7, 3), (12, 3), (6, 1), (9, 4), (5, 5)]:
        selected = torch.randperm(12, generator=torch.Generator().manual_seed(K * 7 + k))[:K].tolist()
        groups = GROUPINGS[name](ctx, selected, s, k)
        assert len(groups) == k and all(groups)
        assert sorted(e for g in groups for e in g) == sorted(selected)
        # Canonical order: members by (score desc, id), groups by best member.
        for g in groups:
            assert g == sorted(g, key=lambda e: (-float(s[e]), e))
        firsts = [float(s[g[0]]) for g in groups]
        assert firsts == sorted(firsts, reverse=True)
        # Deterministic and independent of the order the selector listed the experts in.
        assert GROUPINGS[name](ctx, list(reversed(selected)), s, k) == groups


def test_round_robin_matches_appendix_g_by_hand():
    s = torch.tensor([0.1, 0.9, 0.5, 0.7, 0.3, 0.8, 0.2], dtype=torch.float64)
    # ranks: 1(.9) 5(.8) 3(.7) 2(.5) 4(.3) 6(.2) 0(.1); rank r → group r mod 3
    assert GROUPINGS["RR"](make_ctx(E=7), list(range(7)), s, 3) == [[1, 2, 0], [5, 4], [3, 6]]
    # Equal scores: ties by lower id.
    assert GROUPINGS["RR"](make_ctx(E=7), [6, 2, 4, 0], torch.ones(7, dtype=torch.float64), 2) == [
        [0, 4],
        [2, 6],
    ]


def test_k_equal_K_gives_identical_singletons_for_every_grouping():
    ctx = make_ctx(E=10, k=4)
    s = scores_for(10, seed=3)
    selected = [7, 2, 9, 4]
    expected = [[e] for e in sorted(selected, key=lambda e: -float(s[e]))]
    for name in GROUPINGS:
        assert GROUPINGS[name](ctx, selected, s, 4) == expected, name


@pytest.mark.parametrize("name", ["WC", "RC", "OC"])
def test_clusterings_recover_well_separated_families(name):
    """Appendix F.2 (exact recovery under separation) for OC; WC and RC on weights/router rows likewise."""
    E, fams = 12, 3
    ctx = make_ctx(E=E, k=fams, families=fams, seed=4)
    groups = GROUPINGS[name](ctx, list(range(E)), scores_for(E), fams)
    assert as_partition(groups) == {frozenset(range(f, E, fams)) for f in range(fams)}


def test_anchor_based_assigns_by_router_cosine_to_the_top_scored_anchors():
    E = 6
    router = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.9, 0.1], [0.2, 1.0], [-1.0, 0.05], [3.0, 3.2]])
    ctx = make_ctx(E=E, H=2)
    ctx.router_weight = router
    s = torch.tensor([0.9, 0.8, 0.1, 0.2, 0.3, 0.05], dtype=torch.float64)
    # anchors 0 and 1; 2 → 0, 3 → 1, 4 (cos −1 vs ~0.05) → 1, 5 (3.2 > 3.0) → 1
    assert GROUPINGS["AB"](ctx, list(range(E)), s, 2) == [[0, 2], [1, 4, 3, 5]]
    # Anchors are the best scored, not the router's; a zero router row has cosine 0 → first anchor on ties.
    router2 = router.clone()
    router2[3] = 0.0
    ctx.router_weight = router2
    assert GROUPINGS["AB"](ctx, [0, 1, 3], s, 2) == [[0, 3], [1]]


def slow_average_linkage(dist: torch.Tensor, k: int) -> set[frozenset[int]]:
    """Definition F.2 literally: merge the pair of clusters with the smallest mean pairwise distance."""
    clusters = [[i] for i in range(dist.shape[0])]
    while len(clusters) > k:
        pairs = itertools.combinations(range(len(clusters)), 2)
        a, b = min(pairs, key=lambda ab: float(dist[clusters[ab[0]]][:, clusters[ab[1]]].mean()))
        clusters[a] = clusters[a] + clusters.pop(b)
    return {frozenset(c) for c in clusters}


@pytest.mark.parametrize("seed", range(5))
def test_average_linkage_cut_equals_the_definition(seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(11, 4, generator=gen, dtype=torch.float64)
    dist = cosine_distance_from_gram(x @ x.T)
    for k in (1, 2, 4, 7, 11):
        assert {frozenset(c) for c in average_linkage_cut(dist, k)} == slow_average_linkage(dist, k)


def test_tied_distances_still_give_exactly_k_groups():
    """Identical experts (all distances 0) must not collapse the cut below k clusters."""
    E = 8
    ctx = make_ctx(E=E, k=3)
    ctx.stats.gram = torch.ones(E, E, dtype=torch.float64) * 5
    ctx.router_weight = torch.ones(E, 6)
    ctx.experts.gate[:] = ctx.experts.gate[0]
    ctx.experts.up[:] = ctx.experts.up[0]
    ctx.experts.down[:] = ctx.experts.down[0]
    for name in GROUPINGS:
        groups = GROUPINGS[name](ctx, list(range(E)), scores_for(E), 3)
        assert len(groups) == 3 and all(groups), name


def test_oc_distance_is_one_minus_normalized_gram():
    ctx = make_ctx(E=5)
    g = ctx.stats.gram / ctx.stats.n_tokens
    d = cosine_distance_from_gram(g)
    v = torch.diagonal(g)
    torch.testing.assert_close(d[1, 3], 1 - g[1, 3] / (v[1] * v[3]).sqrt())
    assert float(d[2, 2]) == 0.0  # exact: the diagonal is set to 0
    # Zero-output expert: ρ = 0, d = 1 (Eq. 153).
    g0 = g.clone()
    g0[0, :] = 0
    g0[:, 0] = 0
    assert float(cosine_distance_from_gram(g0)[0, 4]) == 1.0  # exact: ρ is set to 0, and 1 − 0 = 1


def test_weight_gram_is_the_flattened_concatenation_gram_in_chunks(monkeypatch):
    ctx = make_ctx(E=6, H=5, inter=7)
    monkeypatch.setattr(grouping, "WC_CHUNK_ELEMENTS", 40)  # forces several chunks per projection
    idx = [4, 0, 3]
    flat = torch.cat([t[idx].reshape(3, -1) for t in (ctx.experts.gate, ctx.experts.up, ctx.experts.down)], 1)
    torch.testing.assert_close(weight_gram(ctx, idx), flat @ flat.T, rtol=1e-5, atol=1e-5)
    # Memoized per ExpertWeights, but an in-place change of the weights is seen.
    ctx.experts.up[0].mul_(3.0)
    flat = torch.cat([t[idx].reshape(3, -1) for t in (ctx.experts.gate, ctx.experts.up, ctx.experts.down)], 1)
    torch.testing.assert_close(weight_gram(ctx, idx), flat @ flat.T, rtol=1e-5, atol=1e-5)


def test_bad_inputs_give_one_line_errors():
    ctx = make_ctx(E=6)
    with pytest.raises(ValueError, match=r"unknown grouping 'XX'; allowed: RR, WC, RC, AB, OC"):
        get_grouping("XX")
    with pytest.raises(ValueError, match=r"k=4 groups for K=3"):
        GROUPINGS["RR"](ctx, [0, 1, 2], scores_for(6), 4)
    with pytest.raises(ValueError, match="duplicates"):
        GROUPINGS["OC"](ctx, [0, 1, 1], scores_for(6), 2)
