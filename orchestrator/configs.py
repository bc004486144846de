"""Sweep spec → the teacher's shape and the sweep's configurations (the rows of `results`).

("Plan" in moesweep means a conversion plan: kept experts, groups, merge weights and α per layer.
What the orchestrator builds from a sweep is its configurations and their jobs.)

Stages (orchestrator/stages/) turn the configurations into content-keyed jobs: a job's key hashes its
stage, parameters, upstream keys, the code that computes it and library versions, so a calibration is
shared by every configuration and every sweep that names it, and configurations whose students are
provably identical share one evaluation.
"""

from __future__ import annotations

from typing import Any

from orchestrator.axes import AXES
from orchestrator.schema import SpecError
from orchestrator.spec import SweepSpec
from orchestrator.stages.calibrate import named_configs, single_source_configs
from orchestrator.stages.convert import grid_configs
from orchestrator.stages.teacher import teacher_label  # noqa: F401  (re-exported: the dry run names the teacher)
from workers.core.shape import TeacherShape


def stated_shape(spec: SweepSpec) -> TeacherShape:
    """The teacher's shape as far as the sweep file tells (the tiny teacher's settings, or what an HF
    teacher's section states; what it cannot tell is None): what a dry run plans with, without downloading
    or importing torch. `shape_source` names where it was read."""
    if spec.teacher.source == "tiny":
        from workers.tiny.spec import TinyTeacherSpec

        t = TinyTeacherSpec(**spec.teacher.tiny)
        return TeacherShape("qwen3_moe", "qwen3_moe", t.experts, t.top_k, True, 0, t.layers)
    t = spec.teacher
    return TeacherShape(None, None, t.num_experts, t.top_k, t.renormalize, t.shared_experts, None)


def shape_source(spec: SweepSpec) -> str:
    """Where `stated_shape` reads the teacher's shape."""
    return "tiny teacher settings" if spec.teacher.source == "tiny" else "sweep file"


def model_shape(spec: SweepSpec, path: str | None = None) -> TeacherShape:
    """The teacher's shape from its model config, through its family adapter (config only, no weights).
    A sweep file that states E, k, renormalisation or shared experts differently is a one-line error."""
    from workers.families import teacher_shape

    t = spec.teacher
    if t.source == "tiny":
        from types import SimpleNamespace

        from workers.tiny.spec import TinyTeacherSpec
        from workers.tiny.teacher import moe_config

        config = moe_config(
            TinyTeacherSpec(**t.tiny),
            SimpleNamespace(bos_token_id=None, eos_token_id=None, pad_token_id=None),
        )
    else:
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(t.model, revision=t.revision)
        except (OSError, ValueError) as e:
            raise SpecError(
                f"{path}: teacher.model: cannot read the config of {t.model!r}: {str(e).splitlines()[0]}"
            ) from None
    try:
        s = teacher_shape(config)
    except ValueError as e:
        hint = " (`moesweep families` describes each)" if "unsupported model_type" in str(e) else ""
        raise SpecError(f"{path}: teacher.model: {str(e).splitlines()[0]}{hint}") from None
    stated = {
        "num_experts": t.num_experts,
        "top_k": t.top_k,
        "renormalize": t.renormalize,
        "shared_experts": t.shared_experts,
    }
    for name, value in stated.items():
        if value is not None and value != getattr(s, name):
            raise SpecError(
                f"{path}: teacher.{name}: {value!r}, but the model's config says {getattr(s, name)!r} "
                f"({s.family}); remove it or write {getattr(s, name)!r}"
            )
    return s


def check_k(spec: SweepSpec, shape: TeacherShape) -> None:
    from orchestrator.stages.convert import subgrids

    E, k = shape.num_experts, shape.top_k
    for K in sorted({K for g in subgrids(spec) for K in g.K}):
        if k is not None and K < k:
            raise SpecError(f"grid.K: {K} is below the router's top-k ({k}); allowed: {k} ≤ K ≤ {E}")
        if E is not None and K > E:
            raise SpecError(f"grid.K: {K} exceeds the number of experts ({E}); allowed: {k} ≤ K ≤ {E}")


def build_configs(spec: SweepSpec, shape: TeacherShape) -> list[dict[str, Any]]:
    """Every configuration of the sweep: the grid (a sub-grid's named calibration noted on its configurations),
    the teacher, the baselines (d2d: one per candidate) and the grid's variants calibrated on one source
    alone (calibration.single_source)."""
    from workers.core.registry import registry_names

    check_k(spec, shape)
    model = teacher_label(spec)
    family = shape.family
    try:
        configs = [dict(c, family=family) for c in grid_configs(spec, model, shape.top_k)]
    except ValueError as e:
        raise SpecError(str(e)) from None
    if family is not None:
        from workers.families import adapter_named

        refused = adapter_named(family).refused_outputs
        for out in sorted({c["output"] for c in configs if c.get("output") in refused}):
            allowed = ", ".join(o for o in AXES["output"].allowed() if o not in refused)
            raise SpecError(f"grid.output: {out}: {family} {refused[out]}; allowed for {family}: {allowed}")
    if spec.distill is None and any(c.get("recovery") == "full_kd" for c in configs):
        raise SpecError(
            "grid.recovery: full_kd distils the smaller MoE with the distill section's settings; "
            "add a distill section or use none / router_kd"
        )
    for b in spec.baselines:
        if b == "d2d":
            continue  # candidates are configurations of their own, added below
        configs.append(
            {
                "config_key": "teacher" if b == "teacher" else f"baseline:{b}",
                "model": model,
                "kind": "teacher" if b == "teacher" else "baseline",
                "family": family,
                "baseline": None if b == "teacher" else b,
                "teacher_variant": spec.teacher.variant,
                "top_k": shape.top_k,
            }
        )
    if "d2d" in spec.baselines:
        for name in registry_names("workers.baselines.baselines", "_CANDIDATES"):
            configs.append(
                {
                    "config_key": f"baseline:d2d:{name}",
                    "model": model,
                    "kind": "baseline",
                    "baseline": f"d2d:{name}",
                }
            )
    named_configs(spec, configs)
    # last, so the configurations of a sweep without them are stored in the order they always were
    configs += single_source_configs(spec, configs)
    seen: set[str] = set()
    for c in configs:
        if c["config_key"] in seen:  # a named calibration's key tail is a single-source variant's
            raise SpecError(
                f"calibrations.{c.get('calibration') or c.get('calibration_source')}: configuration "
                f"{c['config_key']} would be both a single-source variant and a named calibration's; "
                "rename the calibration"
            )
        seen.add(c["config_key"])
    return configs


def select_json(spec: SweepSpec) -> str | None:
    """The sweep's selection rule as stored with the sweep (analysis reads it, never re-infers it)."""
    import json

    return None if spec.select is None else json.dumps(spec.select.model_dump(), sort_keys=True)


def select_best(rows: list[dict[str, Any]], per: list[str], over: list[str]) -> list[dict[str, Any]]:
    """For each group of `per` axes, the row with the lowest finite ppl_pre over `over` (§4.1)."""
    from db.select_rule import select_best_rows

    return select_best_rows(rows, per, over, "ppl_pre")


def distill_tokens(settings: dict[str, Any]) -> str:
    """A distillation's token budget as shown in tables (e.g. "98k", "0.3B")."""
    from workers.training.distill_spec import DistillSpec

    return human_tokens(DistillSpec(**settings).tokens)


def human_tokens(n: int) -> str:
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= div:
            return f"{n / div:.3g}{unit}"
    return str(n)
