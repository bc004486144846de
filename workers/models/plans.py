"""The plan functions of the outputs (workers/models/outputs.py registers each with its student builder): per
MoE layer, what an output keeps (a dense plan, the experts a pruned MoE keeps, a merged MoE's clusters, an
edited MoE's factors); and plans as JSON rows. Each takes (layers, the job's params, the output's own
settings, the method's settings, the resident teacher or None) and returns (plans, a file written beside them
or None)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

Layers = Iterator[tuple[int, Any]]  # (layer, its LayerContext), in layer order, each looked up once


def dense_plans(
    layers: Layers, p: dict[str, Any], own: dict[str, Any], settings: dict[str, Any], teacher: tuple | None
) -> tuple[list, None]:
    """A dense student's plan per layer (Algorithm 1): the K kept experts by the scoring, grouped into k
    groups and scaled; `own` setting `shared_gate` (mean, else 1.0) scales a shared expert's output."""
    from workers.families.base import SHARED_GATE_DEFAULT, shared_gate_scales
    from workers.methods.planning import plan_layer

    scoring_settings, rerun = _scoring_settings(p, settings, teacher)
    _no_method_settings(settings, scoring_settings, "a dense student", ("shared_gate",))
    gate, K = own.get("shared_gate"), p["K"]

    def dense_plan(layer: int, ctx) -> Any:
        plan = plan_layer(layer, ctx, p["scoring"], p["grouping"], p["dp_scaling"], K)
        if gate is not None and gate != SHARED_GATE_DEFAULT:  # the default builds the student as before
            scale = shared_gate_scales({layer: ctx.stats}, gate)[layer]
            plan.extras["student"] = {**plan.extras.get("student", {}), "shared_scale": scale}
        return plan

    return _scored_plans(layers, scoring_settings, rerun, dense_plan), None


def moe_plans(
    layers: Layers, p: dict[str, Any], own: dict[str, Any], settings: dict[str, Any], teacher: tuple | None
) -> tuple[list, None]:
    """The K experts a pruned MoE keeps per layer (REAP paper, Sec. 4), after its super experts when `own`
    has `super_experts`: a factor (ours) or 'reap' (REAP's rule, from p["expert_maxima"]: the expert_maxima
    stage's {layer: [E] max activation}, loaded by the conversion job)."""
    from workers.methods.planning import select_layer
    from workers.methods.pruning import super_expert_rule

    scoring_settings, rerun = _scoring_settings(p, settings, teacher)
    _no_method_settings(settings, scoring_settings, "a pruned MoE", ("super_experts",))
    rule = super_expert_rule(own.get("super_experts"), p.get("expert_maxima"))
    return _scored_plans(
        layers,
        scoring_settings,
        rerun,
        lambda layer, ctx: select_layer(
            layer, ctx, p["scoring"], p["K"], None if rule is None else rule(layer, ctx.stats)
        ),
    ), None


def merged_plans(
    layers: Layers, p: dict[str, Any], own: dict[str, Any], settings: dict[str, Any], teacher: tuple | None
) -> tuple[list, None]:
    """A merged MoE's K clusters per layer (HC-SMoE, M-SMoE), the merging's settings checked by it."""
    from workers.methods.moe_merging import merge_layer

    return [merge_layer(layer, ctx, p["merging"], p["K"], settings) for layer, ctx in layers], None


def edited_plans(
    layers: Layers, p: dict[str, Any], own: dict[str, Any], settings: dict[str, Any], teacher: tuple | None
) -> tuple[list, Path]:
    """Every expert factorised (MoBE, TD-MoE), the factors saved beside the plan: their sha256 enters every
    plan, so a refit that differs is another student."""
    import hashlib

    from safetensors.torch import save_file

    from workers.methods.editing import edit_layer

    plans, tensors = [], {}
    for layer, ctx in layers:
        plan, fac = edit_layer(layer, ctx, p["editing"], p["K"], settings)
        plans.append(plan)
        tensors.update(fac)
    path = Path(p["workdir"]) / "factors.safetensors"
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(path))
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    for plan in plans:
        plan.extras["student"] = {**plan.extras.get("student", {}), "factors_sha256": sha}
    return plans, path


def _no_method_settings(
    settings: dict[str, Any], scoring_settings: dict[str, Any] | None, what: str, own: tuple[str, ...]
) -> None:
    """Settings left after the output's own are the scoring's: an error when its scoring takes none."""
    if settings and scoring_settings is None:
        raise ValueError(f"settings {', '.join(sorted(settings))}: {what} takes {', '.join(own)}")


def _scoring_settings(p: dict[str, Any], settings: dict[str, Any], teacher: tuple | None) -> tuple:
    """(the method settings, checked, or None when the configuration's scoring takes none; the selector's
    `(layer, kept so far, sample) -> sample` re-run of the teacher, or None): a selector takes settings when
    it has `parse_settings`, and re-runs the teacher when its `layer_inputs` says so (sequential inputs)."""
    from workers.methods.scoring import get_scoring

    select = get_scoring(p["scoring"]).select
    if not hasattr(select, "parse_settings"):
        return None, None
    select.parse_settings(settings)
    return settings, select.layer_inputs(settings, teacher) if hasattr(select, "layer_inputs") else None


def _scored_plans(layers: list, settings: dict[str, Any] | None, rerun, plan_one) -> list:
    """plan_one(layer, ctx) per layer in order; a scoring that takes settings gets them on its context and,
    with `rerun`, the token sample re-run through the earlier layers as they were compressed
    (`recon_input_seconds` records the re-run)."""
    import time
    from dataclasses import replace

    if settings is None:
        return [plan_one(layer, ctx) for layer, ctx in layers]
    plans: list = []
    for layer, ctx in layers:
        ctx = replace(ctx, settings=settings)  # the cached contexts are shared: never changed in place
        seconds = None
        if rerun is not None and plans and ctx.stats.sample is not None:
            t0 = time.perf_counter()
            sample = rerun(layer, {pl.layer: list(pl.selected) for pl in plans}, ctx.stats.sample)
            ctx = replace(ctx, stats=replace(ctx.stats, sample=sample))
            seconds = time.perf_counter() - t0
        plan = plan_one(layer, ctx)
        if seconds is not None:
            plan.extras["recon_input_seconds"] = seconds
        plans.append(plan)
    return plans


def plan_to_dict(pl) -> dict[str, Any]:
    from dataclasses import asdict

    return asdict(pl)


def load_plans(path: str):
    from workers.core.types import LayerPlan

    return [LayerPlan(**d) for d in json.loads(Path(path).read_text())]
