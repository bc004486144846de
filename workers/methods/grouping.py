"""Partition the K kept experts into the k groups that become the dense FFN's blocks (paper §3.3, Appendix G).

Every grouping is `(ctx, selected, scores, k) -> list[list[int]]` and returns exactly k non-empty groups.
Output order is canonical: experts are ranked by (score desc, id asc); members are listed in rank
order and groups are ordered by their best-ranked member. With K = k every grouping therefore
returns the same singletons. Pure tensor code.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from workers.core.registry import lookup
from workers.core.types import LayerContext
from workers.methods.clustering import agglomerate

Grouping = Callable[[LayerContext, list[int], torch.Tensor, int], list[list[int]]]

# WC: how many elements of stacked expert weights go through one matmul (bounds peak memory).
WC_CHUNK_ELEMENTS = 1 << 25


def rank_order(selected: list[int], scores: torch.Tensor) -> list[int]:
    """The kept experts by descending score, ties → lower id."""
    s = scores.detach().to("cpu", torch.float64)
    return sorted(selected, key=lambda e: (-float(s[e]), e))


def canonical(groups: list[list[int]], order: list[int], k: int) -> list[list[int]]:
    """Members in rank order, groups by their best-ranked member; checks exactly k non-empty groups."""
    pos = {e: i for i, e in enumerate(order)}
    out = sorted((sorted(g, key=pos.__getitem__) for g in groups if g), key=lambda g: pos[g[0]])
    if len(out) != k or sorted(e for g in out for e in g) != sorted(order):
        raise ValueError(
            f"grouping produced {len(out)} groups over {sum(map(len, out))} experts; "
            f"needs exactly k={k} non-empty groups partitioning the {len(order)} kept experts"
        )
    return out


def _check(selected: list[int], k: int) -> None:
    if len(set(selected)) != len(selected):
        raise ValueError(f"selected experts {selected} contain duplicates")
    if not 1 <= k <= len(selected):
        raise ValueError(f"k={k} groups for K={len(selected)} kept experts; allowed 1 <= k <= K")


def cosine_distance_from_gram(gram: torch.Tensor) -> torch.Tensor:
    """d_ij = 1 − G_ij / sqrt(G_ii G_jj), with ρ_ij = 0 where G_ii G_jj = 0 (Appendix G, Eq. 153–154)."""
    g = gram.detach().to("cpu", torch.float64)
    g = 0.5 * (g + g.T)
    diag = torch.diagonal(g).clamp_min(0)
    denom = (diag[:, None] * diag[None, :]).sqrt()
    rho = torch.where(denom > 0, g / denom.clamp_min(1e-300), torch.zeros_like(g))
    d = (1.0 - rho).clamp(0.0, 2.0)
    d.fill_diagonal_(0.0)
    return d


def average_linkage_cut(dist: torch.Tensor, k: int) -> list[list[int]]:
    """Average-linkage agglomerative clustering stopped at exactly k clusters (Appendix F.2, Def. F.2).
    Returns clusters of row indices (workers.methods.clustering.agglomerate: ties → lowest ids)."""
    return agglomerate(dist, k, "average")


def _cluster(dist: torch.Tensor, order: list[int], k: int) -> list[list[int]]:
    return canonical([[order[i] for i in c] for c in average_linkage_cut(dist, k)], order, k)


def weight_gram(ctx: LayerContext, experts: list[int]) -> torch.Tensor:
    """⟨w_i, w_j⟩ of the concatenated flattened gate, up and down matrices (biases excluded), float64.

    The full E×E Gram is computed once per ExpertWeights (chunked matmuls on the weights' device) and
    memoized on it, keyed by the tensors' identity and in-place version counters, so a sweep that
    groups the same layer many times pays for it once.
    """
    w = ctx.experts
    tensors = (w.gate, w.up, w.down)
    key = tuple((t.data_ptr(), t._version, tuple(t.shape)) for t in tensors)
    cached = getattr(w, "_weight_gram_cache", None)
    if cached is None or cached[0] != key:
        E = w.num_experts
        full = torch.zeros(E, E, dtype=torch.float64)
        for t in tensors:
            rows = max(1, WC_CHUNK_ELEMENTS // max(1, E * t.shape[2]))
            for start in range(0, t.shape[1], rows):
                x = t[:, start : start + rows].reshape(E, -1).float()
                full += (x @ x.T).to("cpu", torch.float64)
        cached = (key, full)
        w._weight_gram_cache = cached
    idx = torch.as_tensor(experts, dtype=torch.long)
    return cached[1][idx][:, idx]


def round_robin(ctx: LayerContext, selected: list[int], scores: torch.Tensor, k: int) -> list[list[int]]:
    """RR: sort by descending score, rank r → group r mod k (Appendix G)."""
    _check(selected, k)
    order = rank_order(selected, scores)
    return canonical([order[g::k] for g in range(k)], order, k)


def weight_clustering(
    ctx: LayerContext, selected: list[int], scores: torch.Tensor, k: int
) -> list[list[int]]:
    """WC: agglomerative clustering, cosine distance on concatenated flattened gate/up/down (Appendix G).

    The paper does not name WC's linkage; average linkage is used, as for OC and HC-SMoE.
    """
    _check(selected, k)
    order = rank_order(selected, scores)
    return _cluster(cosine_distance_from_gram(weight_gram(ctx, order)), order, k)


def _router_gram(ctx: LayerContext, experts: list[int]) -> torch.Tensor:
    r = ctx.router_weight.detach()[
        torch.as_tensor(experts, dtype=torch.long, device=ctx.router_weight.device)
    ]
    r = r.to("cpu", torch.float64)
    return r @ r.T


def router_clustering(
    ctx: LayerContext, selected: list[int], scores: torch.Tensor, k: int
) -> list[list[int]]:
    """RC: agglomerative clustering, cosine distance on router weight vectors (Appendix G; average linkage)."""
    _check(selected, k)
    order = rank_order(selected, scores)
    return _cluster(cosine_distance_from_gram(_router_gram(ctx, order)), order, k)


def anchor_based(ctx: LayerContext, selected: list[int], scores: torch.Tensor, k: int) -> list[list[int]]:
    """AB: the k top-scored are anchors; each other expert joins the anchor of highest router cosine (Appendix G).

    Ties in cosine go to the better-scored anchor.
    """
    _check(selected, k)
    order = rank_order(selected, scores)
    rho = 1.0 - cosine_distance_from_gram(_router_gram(ctx, order))  # ρ, with ρ = 0 for zero vectors
    groups = [[a] for a in order[:k]]
    for i in range(k, len(order)):
        sims = rho[i, :k].tolist()
        groups[max(range(k), key=lambda a: (sims[a], -a))].append(order[i])
    return canonical(groups, order, k)


def output_clustering(
    ctx: LayerContext, selected: list[int], scores: torch.Tensor, k: int
) -> list[list[int]]:
    """OC: average-linkage on 1 − Ḡ_ij / sqrt(V̄_i V̄_j), Ḡ = gram/N, V̄_i = Ḡ_ii (Appendix G, Eq. 153–154)."""
    _check(selected, k)
    order = rank_order(selected, scores)
    idx = torch.as_tensor(order, dtype=torch.long)
    gbar = ctx.stats.gram.detach().to("cpu", torch.float64)[idx][:, idx] / max(1, ctx.stats.n_tokens)
    return _cluster(cosine_distance_from_gram(gbar), order, k)


OT_TAU, OT_ITERS = 0.1, 50  # DOT-MoE's Sinkhorn settings (Table 6)


def ot_grouping(ctx: LayerContext, selected: list[int], scores: torch.Tensor, k: int) -> list[list[int]]:
    """OT: a balanced AB/OC (DOT-MoE's assignment, App. B.2–B.3, applied to expert grouping). The k
    top-scored experts anchor the groups: each heads its own group, placed before any transport, so two
    near-duplicate top experts never share one. The other K − k experts are transported into the remaining
    capacity K/k − 1 per group (when k does not divide K, the best-ranked anchors' groups hold one more):
    the affinity of expert e to group g is the cosine of e's and anchor g's outputs on calibration tokens
    (Ḡ as in OC); log-domain Sinkhorn (τ = 0.1, 50 iterations) with mass 1 per expert, then greedy
    rounding, so every group gets exactly its capacity."""
    from workers.methods.sinkhorn import balanced_capacity, greedy_round, sinkhorn

    _check(selected, k)
    order = rank_order(selected, scores)
    groups = [[a] for a in order[:k]]  # the anchors, one per group, before any transport
    rest = order[k:]
    if rest:
        idx = torch.as_tensor(order, dtype=torch.long)
        gbar = ctx.stats.gram.detach().to("cpu", torch.float64)[idx][:, idx] / max(1, ctx.stats.n_tokens)
        rho = 1.0 - cosine_distance_from_gram(gbar)  # [K, K], ρ = 0 for a zero output
        room = [c - 1 for c in balanced_capacity(len(order), k)]  # each anchor already fills one place
        bins = [g for g in range(k) if room[g] > 0]  # K < 2k leaves some groups at their anchor alone
        cap = [room[g] for g in bins]
        soft = sinkhorn(rho[k:][:, bins], torch.tensor(cap, dtype=torch.float64), OT_TAU, OT_ITERS)
        # Exact ties (equal soft masses) go to the better-ranked expert and group; equal scores → lower id.
        for e, b in zip(rest, greedy_round(soft, cap), strict=True):
            groups[bins[b]].append(e)
    return canonical(groups, order, k)


GROUPINGS: dict[str, Grouping] = {
    "RR": round_robin,
    "WC": weight_clustering,
    "RC": router_clustering,
    "AB": anchor_based,
    "OC": output_clustering,
    "OT": ot_grouping,
}


def get_grouping(name: str) -> Grouping:
    return lookup(GROUPINGS, name, "grouping")
