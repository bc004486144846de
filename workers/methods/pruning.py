"""Which experts a pruned MoE keeps (REAP paper, Sec. 4: the same E' per layer, the lowest-scoring
experts dropped), optionally always keeping "super experts".

Super experts: the REAP paper does not define them (its repository has an option to always keep
max-activation outliers). Our rule, per layer: expert e is a super expert iff its largest routed output
norm m_e = max_{t: e∈S(t)} ‖f_e(t)‖ (LayerStats.max_norm_sel) exceeds `factor` × the median of m over
the layer's experts routed at least once (and m_e > 0). The median, not the mean or the max, so one
huge outlier cannot hide a second one; experts never routed are left out of the median (their m is 0
by convention, not an observation). Pure tensor code: no transformers import.
"""

from __future__ import annotations

import math

import torch

from workers.core.types import LayerContext, LayerStats
from workers.methods.scoring import get_scoring
from workers.methods.selection import Selection

DEFAULT_SUPER_FACTOR = 10.0  # an expert's peak routed output ≥ 10× the layer's typical peak


def super_experts(stats: LayerStats, factor: float = DEFAULT_SUPER_FACTOR) -> list[int]:
    """The layer's super experts (module docstring), largest max_norm_sel first, ties → lower id."""
    if not (math.isfinite(factor) and factor >= 1):
        raise ValueError(f"super-expert factor={factor}: must be a finite number >= 1")
    stats.require("max_norm_sel")
    m = stats.max_norm_sel.detach().to("cpu", torch.float64)
    routed = stats.count.detach().to("cpu") > 0
    if not bool(routed.any()):
        return []
    threshold = factor * float(torch.quantile(m[routed], 0.5))
    out = [e for e in range(m.shape[0]) if bool(routed[e]) and float(m[e]) > threshold and float(m[e]) > 0]
    return sorted(out, key=lambda e: (-float(m[e]), e))


def select_pruned(ctx: LayerContext, scoring: str, K: int, super_factor: float | None = None) -> Selection:
    """The K experts one layer keeps: by the scoring's own rule (top-K of its score, or the D-optimal
    greedy for DO-*), after the layer's super experts when `super_factor` is given (all of them if
    there are at most K, else the K with the largest max_norm_sel). Extras: `super_experts` (all the
    layer's outliers, largest first) and `protected` (those kept because of it) when protecting."""
    sc = get_scoring(scoring)
    E, k = ctx.stats.num_experts, ctx.top_k
    if not k <= K <= E:
        raise ValueError(f"K={K} out of range; a pruned layer keeps k <= K <= E: {k}..{E}")
    scores = sc.score(ctx).to("cpu", torch.float64)
    if scores.shape != (E,) or not bool(torch.isfinite(scores).all()):
        raise ValueError(f"scoring {scoring!r} gave invalid scores; need {E} finite values")
    if super_factor is None:
        return sc.select(ctx, scores, K)
    outliers = super_experts(ctx.stats, super_factor)
    protected = outliers[:K]
    sel = sc.select(ctx, scores, K, forced=tuple(protected))
    return Selection(sel.selected, {**sel.extras, "super_experts": outliers, "protected": protected})
