"""What a conversion writes: the `output` axis of a sweep's grid.

`dense`: the core paper's dense student (the kept experts grouped, merged and concatenated into one
FFN, Algorithm 1). `moe`: a smaller MoE of the teacher's own class keeping the selected experts of every
layer and their router rows, routing among them with the same top-k and renormalisation rule (the REAP
paper's pruning; with K = k it is the dense student's exact counterpart with input-dependent gates
instead of the static α). Both are built from the same calibration statistics and scorings.
"""

from __future__ import annotations

from torch import nn

from workers.families.base import FamilyAdapter
from workers.types import LayerPlan


def dense_student(model: nn.Module, adapter: FamilyAdapter, plans: list[LayerPlan], share_weights: bool) -> nn.Module:
    from workers.convert import build_student_from_plans

    return build_student_from_plans(model, adapter, plans, share_weights=share_weights)


def moe_student(model: nn.Module, adapter: FamilyAdapter, plans: list[LayerPlan], share_weights: bool) -> nn.Module:
    """The teacher with only each layer's selected experts (real, smaller tensors; router rows sliced)."""
    return adapter.pruned_moe_student(model, {p.layer: sorted(p.selected) for p in plans})


OUTPUTS = {
    "dense": dense_student,
    "moe": moe_student,
}
