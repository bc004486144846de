"""What a conversion writes: the `output` axis of a sweep's grid.

`dense`: the core paper's dense student (the kept experts grouped, merged and concatenated into one
FFN, Algorithm 1). The other three are smaller MoEs that keep a router (top-k and renormalisation rule
unchanged), each built from the same calibration statistics:
- `moe`: pruned — the teacher's own class keeping the selected experts of every layer and their router
  rows (the REAP paper's pruning; with K = k it is the dense student's exact counterpart with
  input-dependent gates instead of the static α);
- `merged`: the E experts merged into K clusters, each stored once (HC-SMoE, M-SMoE:
  workers/methods/moe_merging.py): with the seeds' summed gates (`router_rows: summed`, the default) the
  router keeps its E rows and every member computes its cluster's expert (a registered class tying the members:
  workers/models/merged_model.py); with a router collapsed to K rows (`weighted`, `dominant`) the teacher's
  class with K experts;
- `edited`: every expert kept but factorised to the parameter budget of K experts (MoBE, TD-MoE:
  workers/methods/editing.py), a registered model class that stores the factors (workers/models/edited_model.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from torch import nn

from workers.core.types import LayerPlan
from workers.families.base import FamilyAdapter, check_output
from workers.models.plans import dense_plans, edited_plans, merged_plans, moe_plans


def dense_student(
    model: nn.Module,
    adapter: FamilyAdapter,
    plans: list[LayerPlan],
    share_weights: bool,
    plan_path: str | None = None,
) -> nn.Module:
    from workers.models.convert import build_student_from_plans

    scales = {
        p.layer: p.extras["student"]["shared_scale"]
        for p in plans
        if "shared_scale" in p.extras.get("student", {})
    }  # setting shared_gate: mean (else 1.0)
    return build_student_from_plans(
        model, adapter, plans, share_weights=share_weights, shared_scale=scales or None
    )


def moe_student(
    model: nn.Module,
    adapter: FamilyAdapter,
    plans: list[LayerPlan],
    share_weights: bool,
    plan_path: str | None = None,
) -> nn.Module:
    """The teacher with only each layer's selected experts (real, smaller tensors; router rows sliced)."""
    return adapter.pruned_moe_student(model, {p.layer: sorted(p.selected) for p in plans})


def merged_student(
    model: nn.Module,
    adapter: FamilyAdapter,
    plans: list[LayerPlan],
    share_weights: bool,
    plan_path: str | None = None,
) -> nn.Module:
    """Each layer's clusters merged into one expert each (stored once): router_rows `summed` keeps the E
    router rows and ties every member to its cluster's expert (workers.models.merged_model); `weighted` and
    `dominant` collapse the router to K rows in the teacher's class with K experts (the family adapter)."""
    from workers.methods.moe_merging import merged_layers

    experts = {p.layer: adapter.expert_weights(model, p.layer) for p in plans}
    merged = merged_layers(plans, experts)
    rules = sorted({m.router_rows for m in merged.values()})
    if "summed" not in rules:
        return adapter.merged_moe_student(model, merged)
    if rules != ["summed"]:
        raise ValueError(f"router_rows {rules} across layers: one merged MoE has one router rule")
    from workers.models.merged_model import summed_moe_student

    methods = sorted({str(p.extras["student"].get("merge")) for p in plans})
    return summed_moe_student(model, adapter, merged, methods[0] if len(methods) == 1 else ", ".join(methods))


def edited_student(
    model: nn.Module,
    adapter: FamilyAdapter,
    plans: list[LayerPlan],
    share_weights: bool,
    plan_path: str | None = None,
) -> nn.Module:
    """Every expert factorised as its conversion fitted it (the factors file beside the plan)."""
    from safetensors.torch import load_file

    from workers.models.edited_model import edited_moe_student

    if plan_path is None:
        raise ValueError(
            "an edited MoE is built from the factors saved beside its plan: plan_path is required"
        )
    factors = load_file(str(Path(plan_path).with_name("factors.safetensors")))
    return edited_moe_student(model, adapter, plans, factors)


@dataclass(frozen=True)
class Output:
    """An output, worker side: `plan` (layers, params, own settings, method settings, teacher) -> (plans, a
    file beside them or None) and `build` (teacher, adapter, plans, share_weights, plan_path) -> the student;
    `settings`: its own settings (the rest of a sub-grid's settings are its method's). The torch-free facts
    every reader needs (its method axis, whether it keeps a router, its kind, its label) are db/axes.py's
    OUTPUTS; a test holds the two registries to the same names and settings."""

    plan: Callable[..., tuple[list, Path | None]]
    build: Callable[..., nn.Module]
    settings: tuple[str, ...] = ()


OUTPUTS = {
    "dense": Output(dense_plans, dense_student, ("shared_gate",)),
    "moe": Output(moe_plans, moe_student, ("super_experts",)),
    "merged": Output(merged_plans, merged_student),
    "edited": Output(edited_plans, edited_student),
}


def convert_plans(
    contexts: Mapping, p: dict[str, Any], teacher: tuple | None = None
) -> tuple[list, Path | None]:
    """Per MoE layer, what the configuration's output keeps (its `plan`), and the file written beside the
    plans, if any. `p["settings"]`: those of the output (its own, e.g. `super_experts`) and of the method it
    names (a scoring takes settings when its selector has `parse_settings`: they reach it as
    LayerContext.settings). `teacher`: the resident (model, adapter), for scorings that re-run it
    (sequential inputs). `contexts` is looked up once per layer, in layer order (a streamed teacher's are read
    from its shards then)."""
    name = p.get("output", "dense")
    if name not in OUTPUTS:
        raise ValueError(f"output={name!r}; allowed: {', '.join(OUTPUTS)}")
    out = OUTPUTS[name]
    settings = dict(p.get("settings") or {})
    own = {k: settings.pop(k) for k in list(settings) if k in out.settings}
    maxima = p.get(
        "expert_maxima"
    )  # {layer: [E]} of the expert_maxima pass, where the configuration needs it
    layers = (  # one look-up per layer, in order
        (layer, contexts[layer] if maxima is None else replace(contexts[layer], maxima=maxima.get(layer)))
        for layer in sorted(contexts)
    )
    return out.plan(layers, p, own, settings, teacher)


def write_student(
    output: str,
    model: nn.Module,
    adapter: FamilyAdapter,
    plans: list[LayerPlan],
    share_weights: bool,
    plan_path: str | None = None,
) -> nn.Module:
    """The `output` student of `plans` (one-line ValueError where the family cannot write that output)."""
    if output not in OUTPUTS:
        raise ValueError(f"output={output!r}; allowed: {', '.join(OUTPUTS)}")
    check_output(adapter, output)
    return OUTPUTS[output].build(model, adapter, plans, share_weights=share_weights, plan_path=plan_path)
