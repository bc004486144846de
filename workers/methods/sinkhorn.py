"""Balanced assignment by entropic optimal transport (DOT-MoE, App. B.2.1 Algorithm 1 and B.3.2).

`sinkhorn` is the log-domain Sinkhorn-Knopp iteration: rows (items) carry mass 1, columns (bins) the
given capacities; `greedy_round` turns its soft plan into a hard assignment that fills every bin exactly
to its capacity. Used by the OT grouping (workers/methods/grouping.py) and meant for DOT-MoE's neuron → expert
assignment. Pure tensor code.
"""

from __future__ import annotations

import math

import torch


def sinkhorn(
    affinity: torch.Tensor, capacity: torch.Tensor, tau: float = 0.1, iters: int = 50
) -> torch.Tensor:
    """M_soft [n, m] with rows summing to 1 and columns to `capacity` [m] (Σ capacity = n) after `iters`
    log-domain iterations on the kernel affinity/τ (DOT-MoE, App. B.2.1, Algorithm 1). Differentiable."""
    n, m = affinity.shape
    cap = capacity.to(device=affinity.device, dtype=affinity.dtype)  # a CPU capacity for a CUDA affinity
    if cap.shape != (m,) or bool((cap <= 0).any()) or not math.isclose(float(cap.sum()), n, rel_tol=1e-9):
        raise ValueError(f"capacity {capacity.tolist()}: need {m} positive bin sizes summing to n={n}")
    if not tau > 0 or iters < 1:
        raise ValueError(f"tau={tau}, iters={iters}: need tau > 0 and iters >= 1")
    k = affinity / tau
    log_cap = cap.log()
    u = torch.zeros(n, dtype=affinity.dtype, device=affinity.device)
    v = log_cap.clone()
    for _ in range(iters):
        u = -torch.logsumexp(k + v[None, :], dim=1)  # rows → mass 1
        v = log_cap - torch.logsumexp(k + u[:, None], dim=0)  # columns → their capacity
    return torch.exp(k + u[:, None] + v[None, :])


def greedy_round(soft: torch.Tensor, capacity: list[int]) -> list[int]:
    """Each row's bin: visit (row, bin) pairs by descending soft mass (ties: lower flat index) and assign
    a row to a bin while both are free (DOT-MoE, App. B.3.2). Every bin ends exactly at its capacity.

    The same assignment as that sequential visit, computed in at most m vectorised phases: until the first
    bin fills, every free row takes its first remaining pair; so each phase assigns the first pair of every
    free row up to the pair that fills a bin, then carries on after it with that bin closed."""
    n, m = soft.shape
    if len(capacity) != m or sum(capacity) != n or min(capacity) < 0:
        raise ValueError(f"capacity {capacity}: need {m} non-negative bin sizes summing to n={n}")
    flat = soft.detach().to("cpu", torch.float64).reshape(-1)
    order = torch.sort(-flat, stable=True).indices  # descending mass; equal masses keep flat-index order
    rows, bins = order // m, order % m
    owner = torch.full((n,), -1, dtype=torch.long)
    cap = torch.tensor(capacity, dtype=torch.long)
    while bool((owner < 0).any()):
        live = (owner[rows] < 0) & (cap[bins] > 0)
        rows, bins = rows[live], bins[live]  # pairs still possible, in visiting order
        # each free row's first remaining pair: its lowest position among the live pairs
        seen_at = torch.full((n,), rows.numel(), dtype=torch.long).scatter_reduce(
            0, rows, torch.arange(rows.numel()), reduce="amin"
        )
        is_first = seen_at[rows] == torch.arange(rows.numel())
        pos = is_first.nonzero().squeeze(1)  # visiting positions of the first pairs
        fb = bins[pos]
        # how many first pairs each bin has received up to and including each one (in visiting order)
        rank = torch.zeros_like(fb)
        by_bin = torch.sort(fb, stable=True).indices
        counts = torch.bincount(fb, minlength=m)
        starts = torch.cumsum(counts, 0) - counts
        rank[by_bin] = torch.arange(fb.numel()) - starts[fb[by_bin]]
        fills = rank == cap[fb] - 1
        last = int(pos[fills].min()) if bool(fills.any()) else int(pos.max())
        take = pos <= last
        owner[rows[pos[take]]] = fb[take]
        cap -= torch.bincount(fb[take], minlength=m)
        rows, bins = rows[last + 1 :], bins[last + 1 :]
    return owner.tolist()


def balanced_capacity(n: int, m: int) -> list[int]:
    """n items over m bins as evenly as possible: the first n mod m bins hold one more."""
    if not 1 <= m <= n:
        raise ValueError(f"{n} items into {m} bins: need 1 <= bins <= items")
    q, r = divmod(n, m)
    return [q + 1 if b < r else q for b in range(m)]
