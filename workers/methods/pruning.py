"""Which experts a pruned MoE keeps (REAP paper, Sec. 4: the same E' per layer, the lowest-scoring
experts dropped), optionally always keeping "super experts", by one of two rules.

Ours (`super_experts: <factor>`), per layer: expert e is a super expert iff its largest routed output
norm m_e = max_{t: e∈S(t)} ‖f_e(t)‖ (LayerStats.max_norm_sel) exceeds `factor` × the median of m over
the layer's experts routed at least once (and m_e > 0). The median, not the mean or the max, so one
huge outlier cannot hide a second one; experts never routed are left out of the median (their m is 0
by convention, not an observation).

REAP's (`super_experts: reap`), the rule of the REAP repository (CerebrasResearch/reap,
model_util.get_super_expert_indices, used by prune.py with perserve_super_experts): a[l, e] is expert
e's largest signed output element over the tokens routed to it (observer `max_activations`: the
unweighted f_e(x), floored at 0; computed by the expert_maxima pass, never by calibration). Expert e of
layer l is super iff a[l, e] > max(the 99.5th percentile of a over all layers and experts, max(a) / 10),
and only the first ⌊0.75·L⌋ MoE layers may hold one. The threshold is global: a layer may have none.

Pure tensor code: no transformers import.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import torch

from workers.core.types import LayerContext, LayerStats
from workers.methods.scoring import get_scoring
from workers.methods.selection import Selection

DEFAULT_SUPER_FACTOR = 10.0  # an expert's peak routed output ≥ 10× the layer's typical peak
REAP_RULE = "reap"  # the `super_experts` value that asks for REAP's rule
REAP_QUANTILE = 0.995  # REAP repository: the 99.5th percentile of every layer's maxima …
REAP_MAX_DIVISOR = 10.0  # … or the largest maximum / 10, whichever is larger
REAP_LAYER_FRACTION = 0.75  # only the first int(0.75·L) MoE layers may hold super experts

# (layer, its statistics) -> the layer's super experts, largest first
SuperRule = Callable[[int, LayerStats], list[int]]


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


def _reap_table(maxima: torch.Tensor) -> torch.Tensor:
    """`maxima` [L, E] checked, as float64 on the CPU."""
    if maxima.ndim != 2 or 0 in maxima.shape:
        raise ValueError(f"maxima of shape {tuple(maxima.shape)}: need [MoE layers, experts], both > 0")
    a = maxima.detach().to("cpu", torch.float64)
    if not bool(torch.isfinite(a).all()):
        raise ValueError("maxima must be finite (a max activation is >= 0, 0 for an expert never routed)")
    return a


def reap_threshold(maxima: torch.Tensor) -> float:
    """REAP's super-expert threshold over maxima [L, E]: max(99.5th percentile, largest / 10)."""
    a = _reap_table(maxima).flatten()
    # REAP repository, model_util.get_super_expert_indices: torch.quantile (linear) over all layers
    return max(float(torch.quantile(a, REAP_QUANTILE)), float(a.max()) / REAP_MAX_DIVISOR)


def reap_super_experts(maxima: torch.Tensor) -> list[list[int]]:
    """REAP's super experts (module docstring) of maxima [L, E] (the MoE layers in order): per layer,
    the experts above the threshold, largest maximum first, ties → lower id; none past ⌊0.75·L⌋."""
    a = _reap_table(maxima)
    threshold = reap_threshold(a)
    first = int(a.shape[0] * REAP_LAYER_FRACTION)  # int() as REAP: 48 layers → 36, 2 → 1
    out = []
    for layer in range(a.shape[0]):
        ids = [e for e in range(a.shape[1]) if layer < first and float(a[layer, e]) > threshold]
        out.append(sorted(ids, key=lambda e, r=a[layer]: (-float(r[e]), e)))
    return out


def super_expert_rule(setting: object, maxima: Mapping[int, torch.Tensor] | None = None) -> SuperRule | None:
    """The `super_experts` setting of a pruned MoE as a rule: None (not set: nothing protected), a factor
    (ours, on each layer's own statistics) or 'reap' (REAP's, on `maxima`: {MoE layer: [E] max activation},
    the file of the expert_maxima stage). Anything else: a one-line ValueError naming both forms."""
    if setting is None:
        return None
    if setting == REAP_RULE:
        if maxima is None:
            raise ValueError(
                "super_experts=reap needs the per-expert max activations of the expert_maxima stage; "
                "none reached this conversion"
            )
        layers = sorted(maxima)
        table = dict(zip(layers, reap_super_experts(torch.stack([maxima[i] for i in layers])), strict=True))

        def reap(layer: int, stats: LayerStats) -> list[int]:
            if layer not in table:
                raise ValueError(f"layer {layer} has no max activations; the maxima file has layers {layers}")
            if maxima[layer].numel() != stats.num_experts:
                raise ValueError(
                    f"layer {layer}: {maxima[layer].numel()} max activations for {stats.num_experts} experts"
                )
            return table[layer]

        return reap
    ok = isinstance(setting, int | float) and not isinstance(setting, bool)
    if not (ok and math.isfinite(setting) and setting >= 1):
        raise ValueError(
            f"super_experts={setting!r}; allowed: a number >= 1 (ours: above factor x the layer's median "
            "peak routed output norm) or 'reap' (REAP's rule on max activations, first 75% of layers)"
        )
    factor = float(setting)
    return lambda layer, stats: super_experts(stats, factor)


def _check_ids(ids: Sequence[int], E: int) -> list[int]:
    out = [int(e) for e in ids]
    if len(set(out)) != len(out) or not all(0 <= e < E for e in out):
        raise ValueError(f"super_ids={out}: need distinct expert ids in 0..{E - 1}")
    return out


def select_pruned(
    ctx: LayerContext,
    scoring: str,
    K: int,
    super_factor: float | None = None,
    super_ids: Sequence[int] | None = None,
) -> Selection:
    """The K experts one layer keeps: by the scoring's own rule (top-K of its score, or the D-optimal
    greedy for DO-*), after the layer's super experts when protecting (all of them if there are at
    most K, else the first K). The super experts are `super_ids` (given, largest first: e.g. REAP's rule
    over every layer) or those of our rule with `super_factor`; one of the two at most. Extras:
    `super_experts` (all the layer's outliers, largest first) and `protected` (those kept because of it)
    when protecting."""
    sc = get_scoring(scoring)
    E, k = ctx.stats.num_experts, ctx.top_k
    if not k <= K <= E:
        raise ValueError(f"K={K} out of range; a pruned layer keeps k <= K <= E: {k}..{E}")
    if super_factor is not None and super_ids is not None:
        raise ValueError("super_factor and super_ids: give one (our rule's factor or the ids), not both")
    scores = sc.score(ctx).to("cpu", torch.float64)
    if scores.shape != (E,) or not bool(torch.isfinite(scores).all()):
        raise ValueError(f"scoring {scoring!r} gave invalid scores; need {E} finite values")
    if super_factor is None and super_ids is None:
        return sc.select(ctx, scores, K)
    outliers = super_experts(ctx.stats, super_factor) if super_ids is None else _check_ids(super_ids, E)
    protected = outliers[:K]
    sel = sc.select(ctx, scores, K, forced=tuple(protected))
    return Selection(sel.selected, {**sel.extras, "super_experts": outliers, "protected": protected})
