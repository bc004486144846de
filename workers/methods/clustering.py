"""Agglomerative clustering of items from their pairwise distances, stopped at exactly M clusters: the one
clustering of the methods (HC-SMoE's merging, workers/methods/moe_merging.py; the dense student's WC, RC and OC
groupings, workers/methods/grouping.py). Pure tensor code.

Why not scipy's `linkage`: equal distances. This one joins, among equally close pairs, the one whose smallest
member ids are lexicographically smallest, and computes every cluster distance from the original pairwise
distances (never updated incrementally), so equal distances stay exactly equal and the result is the same on
every machine; scipy leaves that order to its implementation. Away from ties the two give the same clusters
(tests/test_grouping.py checks against a direct transcription of average linkage)."""

from __future__ import annotations

import math

import torch

LINKAGES = ("average", "single", "complete")


def _linkage_row(d: torch.Tensor, labels: torch.Tensor, members: list[int], linkage: str) -> torch.Tensor:
    """[E] distance from the cluster `members` to every cluster (indexed by its label = smallest member id;
    entries of non-labels are meaningless), from the ORIGINAL pairwise distances: recomputed, never updated
    incrementally, so equal cluster distances stay exactly equal for the tie rule."""
    block = d[members]  # [|C|, E]
    E = d.shape[0]
    if linkage == "average":  # UPGMA: mean over member pairs
        sums = torch.zeros(E, dtype=d.dtype).index_add_(0, labels, block.sum(0))
        sizes = torch.zeros(E, dtype=d.dtype).index_add_(0, labels, torch.ones(E, dtype=d.dtype))
        return sums / (len(members) * sizes.clamp(min=1))
    reduce, col = ("amin", block.min(0).values) if linkage == "single" else ("amax", block.max(0).values)
    return torch.zeros(E, dtype=d.dtype).scatter_reduce_(0, labels, col, reduce=reduce, include_self=False)


def agglomerate(d: torch.Tensor, M: int, linkage: str = "average") -> list[list[int]]:
    """Agglomerative clustering of E items with pairwise distances d [E, E] into M clusters.

    Starts from singletons and repeatedly joins the closest pair of clusters until M remain. Cluster
    distance (`linkage`): `average` = mean of the original member-pair distances (UPGMA; for a singleton
    k this is HC-SMoE's update D_{α,k} = Σ_{i∈C_α} D_{i,k}/|C_α|), `single` = min, `complete` = max.
    Ties (exactly equal distances): the pair (a, b), a < b the clusters' smallest member ids, that is
    lexicographically smallest. Returns clusters with sorted members, ordered by smallest member."""
    E = d.shape[0]
    if linkage not in LINKAGES:
        raise ValueError(f"linkage={linkage!r}; allowed: {', '.join(LINKAGES)}")
    if not 1 <= M <= E:
        raise ValueError(f"M={M} clusters out of range 1..{E}")
    d = d.detach().to("cpu", torch.float64)
    d = (d + d.T) / 2  # exactly symmetric: the search reads the upper triangle only
    clusters: dict[int, list[int]] = {e: [e] for e in range(E)}  # smallest member id → members
    labels = torch.arange(E)  # item → its cluster's smallest member id
    cd = d.clone()  # cluster distances indexed by smallest member id; inf = inactive or diagonal
    cd.fill_diagonal_(math.inf)
    while len(clusters) > M:
        best = cd.min()
        # nonzero lists row-major: the first hit is the lexicographically smallest pair
        i, j = (int(v) for v in torch.nonzero(torch.triu(cd == best, diagonal=1))[0])
        clusters[i] = sorted(clusters[i] + clusters.pop(j))
        labels[labels == j] = i
        cd[j, :], cd[:, j] = math.inf, math.inf
        active = torch.tensor([r for r in clusters if r != i], dtype=torch.long)
        row = _linkage_row(d, labels, clusters[i], linkage)
        cd[i, active] = cd[active, i] = row[active]
    return [clusters[r] for r in sorted(clusters)]
