"""One layer's conversion plan: score → select K → k groups → merge weights → α (Algorithm 1, lines 1–4, 8).

Pure tensor code: no transformers import. workers.methods.merge turns a plan into the dense FFN.
"""

from __future__ import annotations

import hashlib
import json

import torch

from workers.core.types import LayerContext, LayerPlan
from workers.methods.diagnostics import effective_rank
from workers.methods.grouping import get_grouping
from workers.methods.pruning import select_pruned
from workers.methods.scaling import get_scaling, merge_weights
from workers.methods.scoring import acp, get_scoring
from workers.methods.selection import importance_kernel


def selected_kernel_rank(ctx: LayerContext, importance: torch.Tensor, selected: list[int]) -> float:
    """Effective rank of 𝒦_S, 𝒦_ij = sqrt(I_i I_j)·G_ij, G = gram/N (Fig. 3)."""
    idx = torch.as_tensor(selected, dtype=torch.long)
    kernel = importance_kernel(ctx.stats.gram, ctx.stats.n_tokens, importance)
    return effective_rank(kernel[idx][:, idx])


def plan_layer(layer: int, ctx: LayerContext, scoring: str, grouping: str, scaling: str, K: int) -> LayerPlan:
    """Algorithm 1 for one layer.

    `extras`: `effective_rank` of 𝒦_S built with the scoring's own base score (CP for CP/DO-CP, ACP for
    ACP/DO-ACP, SF for SF, …: every registered scoring has a base score ≥ 0), `effective_rank_acp`
    of 𝒦_S built with ACP whatever the scoring (one kernel to compare scorings on), and for D-optimal
    scorings `lambda` and `log_det` (= log det(I + 𝒦_S/λ)) plus `log_gains`.
    """
    sc, group_fn, scale_fn = get_scoring(scoring), get_grouping(grouping), get_scaling(scaling)
    E, k = ctx.stats.num_experts, ctx.top_k
    if not k <= K <= E:
        raise ValueError(f"K={K} out of range; allowed k <= K <= E: {k}..{E}")
    scores = sc.score(ctx).to("cpu", torch.float64)
    if scores.shape != (E,) or not bool(torch.isfinite(scores).all()) or bool((scores < 0).any()):
        raise ValueError(
            f"scoring {scoring!r} gave invalid scores for layer {layer}; need {E} finite values >= 0"
        )
    sel = sc.select(ctx, scores, K)
    groups = group_fn(ctx, sel.selected, scores, k)
    alpha = scale_fn(ctx, groups, scores, sel.selected)
    extras = {
        "effective_rank": selected_kernel_rank(ctx, scores, sel.selected),
        "effective_rank_acp": selected_kernel_rank(ctx, acp(ctx), sel.selected),
        **sel.extras,
    }
    return LayerPlan(
        layer=layer,
        selected=list(sel.selected),
        scores=scores.tolist(),
        groups=groups,
        merge_weights=merge_weights(groups, scores),
        alpha=[float(a) for a in alpha],
        extras=extras,
    )


def select_layer(
    layer: int, ctx: LayerContext, scoring: str, K: int, super_ids: list[int] | None = None
) -> LayerPlan:
    """The kept experts of one layer for a smaller-MoE output: the scoring's K selected experts, each its
    own group (weight 1, α 1: a pruned MoE keeps its router, so nothing is merged or scaled). With
    `super_ids` (the layer's super experts by the configuration's rule, largest first), they are kept
    first (workers.methods.pruning.select_pruned)."""
    sc = get_scoring(scoring)
    E = ctx.stats.num_experts
    if not ctx.top_k <= K <= E:
        raise ValueError(f"K={K} out of range; allowed k <= K <= E: {ctx.top_k}..{E}")
    scores = sc.score(ctx).to("cpu", torch.float64)
    sel = (
        select_pruned(ctx, scoring, K, super_ids=super_ids)
        if super_ids is not None
        else sc.select(ctx, scores, K)
    )
    kept = sorted(sel.selected)
    extras = {"effective_rank": selected_kernel_rank(ctx, scores, kept), **sel.extras}
    if super_ids is not None:  # ids stay in plan.json; their counts become layer_diag rows
        extras["super_expert_ids"] = extras.pop("super_experts", [])
        extras["protected_ids"] = extras.pop("protected", [])
        extras["super_experts"] = len(extras["super_expert_ids"])
        extras["protected"] = len(extras["protected_ids"])
    return LayerPlan(
        layer=layer,
        selected=list(sel.selected),
        scores=scores.tolist(),
        groups=[[e] for e in kept],
        merge_weights=[[1.0] for _ in kept],
        alpha=[1.0] * len(kept),
        extras=extras,
    )


def plan_signature(plans: list[LayerPlan]) -> str:
    """sha256 of the plans' signatures (layer order does not matter): equal students ⇔ equal signature."""
    sigs = sorted((p.signature() for p in plans), key=lambda s: s[0])
    return hashlib.sha256(json.dumps(sigs, separators=(",", ":")).encode()).hexdigest()
