"""Diagnostics of a selection: effective rank (paper Fig. 3) and selection overlap (Fig. 2).

Pure tensor code: no transformers import.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from workers.core.types import LayerStats


def effective_rank(matrix: torch.Tensor) -> float:
    """Roy & Vetterli (2007): exp of the Shannon entropy of the normalized singular values.

    1 for a rank-one matrix, n for a multiple of the n×n identity; 0.0 for an all-zero matrix
    (where it is undefined). For a PSD kernel the singular values are its eigenvalues.
    """
    m = matrix.detach().to("cpu", torch.float64)
    if m.numel() == 0:
        return 0.0
    sv = torch.linalg.svdvals(m)
    total = float(sv.sum())
    if not total > 0:
        return 0.0
    p = sv / total
    p = p[p > 0]
    return math.exp(float(-(p * p.log()).sum()))


def jaccard(a: Iterable[int], b: Iterable[int]) -> float:
    """|A ∩ B| / |A ∪ B| of two expert sets (1.0 when both are empty)."""
    sa, sb = set(a), set(b)
    union = sa | sb
    return len(sa & sb) / len(union) if union else 1.0


def stats_from_tokens(p: torch.Tensor, routed: torch.Tensor, g: torch.Tensor, f: torch.Tensor) -> LayerStats:
    """Reference reduction of token-level records to LayerStats (the sums calibration keeps: counts, Σp, Σp over routed tokens, Σ‖f‖², REAP/REAP-p/EAN sums, the max routed ‖f‖, the Gram matrix, Σf, Σppᵀ; not Σxxᵀ, which needs the inputs), for tests and small checks.

    p [N, E] router softmax over all experts; routed [N, E] bool, e ∈ S(t); g [N, E] the weight the
    model applied (ignored outside S(t)); f [N, E, d] every expert's output on every token.
    """
    p, g, f = (t.detach().to("cpu", torch.float64) for t in (p, g, f))
    m = routed.detach().to("cpu", torch.float64)
    norm = f.norm(dim=-1)
    return LayerStats(
        n_tokens=p.shape[0],
        count=m.sum(0),
        sum_p=p.sum(0),
        sum_p_sel=(m * p).sum(0),
        sum_sq=(norm * norm).sum(0),
        sum_gnorm_sel=(m * g * norm).sum(0),
        sum_norm_sel=(m * norm).sum(0),
        gram=torch.einsum("ned,nfd->ef", f, f),
        sum_pnorm_sel=(m * p * norm).sum(0),
        max_norm_sel=(m * norm).amax(0),
        sum_out=f.sum(0),
        gram_p=p.T @ p,
    )
