"""A configuration's conversion plans: per MoE layer, what its output keeps (a dense plan, the experts a
pruned MoE keeps, a merged MoE's clusters, an edited MoE's factors), and plans as JSON rows. The same code
serves a conversion job, a DCDM round and a student built from a stored plan."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

OUTPUT_SETTINGS = {"dense": ("shared_gate",), "moe": ("super_experts",), "merged": (), "edited": ()}


def convert_plans(
    contexts: Mapping, p: dict[str, Any], teacher: tuple | None = None
) -> tuple[list, Path | None]:
    """Per MoE layer, what the configuration's output keeps: a dense plan (Algorithm 1), the experts a
    pruned MoE keeps, the clusters of a merged MoE, or an edited MoE's factors (saved beside the plan;
    their sha256 enters every plan, so a refit that differs is another student). `settings`: those of
    the output (`super_experts`: a factor (ours) or 'reap' (REAP's rule), workers.methods.pruning) and of the method it names (a scoring
    takes settings when its selector has `parse_settings`: they reach it as LayerContext.settings).
    `teacher`: the resident (model, adapter), for scorings that re-run it (sequential inputs). `contexts`
    is looked up once per layer, in layer order (a streamed teacher's are read from its shards then)."""
    from workers.families.base import SHARED_GATE_DEFAULT, shared_gate_scales
    from workers.methods.planning import plan_layer, select_layer

    output, K = p.get("output", "dense"), p["K"]
    settings = dict(p.get("settings") or {})
    own = {k: settings.pop(k) for k in list(settings) if k in OUTPUT_SETTINGS[output]}
    layers = ((layer, contexts[layer]) for layer in sorted(contexts))  # one look-up per layer, in order
    scoring_settings, rerun = (
        _scoring_settings(p, settings, teacher) if output in ("dense", "moe") else (None, None)
    )
    if output == "moe":
        if settings and scoring_settings is None:
            raise ValueError(
                f"settings {', '.join(sorted(settings))}: a pruned MoE takes "
                f"{', '.join(OUTPUT_SETTINGS['moe'])}"
            )
        from workers.methods.pruning import super_expert_rule

        # super experts by our factor (each layer's statistics) or REAP's rule (p["expert_maxima"]: the
        # expert_maxima stage's {layer: [E] max activation}, loaded by the conversion job)
        rule = super_expert_rule(own.get("super_experts"), p.get("expert_maxima"))
        return _scored_plans(
            layers,
            scoring_settings,
            rerun,
            lambda layer, ctx: select_layer(
                layer, ctx, p["scoring"], K, None if rule is None else rule(layer, ctx.stats)
            ),
        ), None
    if output == "merged":
        from workers.methods.moe_merging import merge_layer

        return [merge_layer(layer, ctx, p["merging"], K, settings) for layer, ctx in layers], None
    if output == "edited":
        import hashlib

        from safetensors.torch import save_file

        from workers.methods.editing import edit_layer

        plans, tensors = [], {}
        for layer, ctx in layers:
            plan, fac = edit_layer(layer, ctx, p["editing"], K, settings)
            plans.append(plan)
            tensors.update(fac)
        path = Path(p["workdir"]) / "factors.safetensors"
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(path))
        sha = hashlib.sha256(path.read_bytes()).hexdigest()
        for plan in plans:
            plan.extras["student"] = {**plan.extras.get("student", {}), "factors_sha256": sha}
        return plans, path
    if settings and scoring_settings is None:
        raise ValueError(
            f"settings {', '.join(sorted(settings))}: a dense student takes "
            f"{', '.join(OUTPUT_SETTINGS['dense'])}"
        )
    gate = own.get("shared_gate")

    def dense_plan(layer: int, ctx) -> Any:
        plan = plan_layer(layer, ctx, p["scoring"], p["grouping"], p["dp_scaling"], K)
        if gate is not None and gate != SHARED_GATE_DEFAULT:  # the default builds the student as before
            scale = shared_gate_scales({layer: ctx.stats}, gate)[layer]
            plan.extras["student"] = {**plan.extras.get("student", {}), "shared_scale": scale}
        return plan

    return _scored_plans(layers, scoring_settings, rerun, dense_plan), None


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
