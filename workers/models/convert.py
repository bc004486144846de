"""From calibration statistics and conversion plans to a dense student (paper §3, Algorithm 1).

Family-free: everything model-specific goes through the FamilyAdapter. Building is cheap enough to
run once per configuration with the teacher resident: the student is assembled on the meta device
and, with share_weights=True, reuses the teacher's attention/embedding/norm tensors (no copy);
only the FFN tensors are new.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from torch import nn

from workers.core.types import DenseFFN, LayerContext, LayerPlan, LayerStats
from workers.families.base import FamilyAdapter
from workers.methods.merge import build_dense_ffn


def layer_contexts(
    model: nn.Module, adapter: FamilyAdapter, stats: dict[int, LayerStats]
) -> dict[int, LayerContext]:
    """One LayerContext per MoE layer that has statistics (experts as views of the teacher)."""
    moe = adapter.moe_layers(model)
    extra = sorted(set(stats) - set(moe))
    if extra:
        raise ValueError(f"stats: layers {extra} are not MoE layers; MoE layers are {moe}")
    k, renorm = adapter.top_k(model), adapter.renormalized(model)
    out: dict[int, LayerContext] = {}
    for layer in moe:
        if layer not in stats:
            continue
        experts = adapter.expert_weights(model, layer)
        if stats[layer].num_experts != experts.num_experts:
            raise ValueError(
                f"stats[{layer}]: {stats[layer].num_experts} experts, the model has {experts.num_experts}"
            )
        out[layer] = LayerContext(
            stats=stats[layer],
            experts=experts,
            router_weight=adapter.router_weight(model, layer),
            top_k=k,
            renormalized=renorm,
        )
    return out


def plan_ffns(
    model: nn.Module,
    adapter: FamilyAdapter,
    plans: list[LayerPlan],
    progress: Callable[[int, int], None] | None = None,
) -> dict[int, DenseFFN]:
    """Algorithm 1 per planned layer (merge, scale, concatenate), with the router's constant factor
    (DeepSeek routed_scaling_factor) multiplied into α so the student keeps the teacher's scale."""
    moe = set(adapter.moe_layers(model))
    scale = adapter.routed_scaling(model)
    ffns: dict[int, DenseFFN] = {}
    for i, plan in enumerate(plans):
        if plan.layer not in moe:
            raise ValueError(f"plan.layer={plan.layer} is not an MoE layer; MoE layers are {sorted(moe)}")
        if plan.layer in ffns:
            raise ValueError(f"plan.layer={plan.layer} appears twice")
        if scale != 1.0:
            plan = replace(plan, alpha=[a * scale for a in plan.alpha])
        ffns[plan.layer] = build_dense_ffn(adapter.expert_weights(model, plan.layer), plan)
        if progress is not None:
            progress(i + 1, len(plans))
    return ffns


def build_student_from_plans(
    model: nn.Module,
    adapter: FamilyAdapter,
    plans: list[LayerPlan],
    share_weights: bool,
    progress: Callable[[int, int], None] | None = None,
    shared_scale: dict[int, float] | None = None,
) -> nn.Module:
    """The dense student of a set of plans (one per MoE layer; dense layers come from the teacher,
    zero-padded). share_weights=True: non-FFN tensors are the teacher's own (do not train it).
    `shared_scale`: per layer, the static scale of a gated shared expert (default 1.0)."""
    ffns = plan_ffns(model, adapter, plans, progress)
    return adapter.build_student(model, ffns, share_weights=share_weights, shared_scale=shared_scale)
