"""Run function of the stages `convert` and `seed_convert`: a configuration's conversion plans."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from workers.models.outputs import convert_plans
from workers.models.plans import plan_to_dict
from workers.run.runtime import (
    artifact,
    device,
    resident_teacher,
    teacher_path,
)


def stage_convert(payload: dict, cache: dict, progress) -> dict:
    from workers.calibration.calibrate import load_stats
    from workers.families import get_adapter
    from workers.methods.planning import plan_signature
    from workers.models.convert import layer_contexts

    p = {**payload["params"], "workdir": payload["workdir"]}
    stats_path = payload["inputs"]["calibrate"]["stats"]
    weights = p.get("calibration_weights")  # a DCDM mixture's weights (None: the file's own)
    maxima = payload["inputs"].get("expert_maxima")  # planned only for `super_experts: reap`
    if maxima is not None:
        from workers.calibration.expert_maxima import load_maxima

        p["expert_maxima"] = load_maxima(maxima["maxima"], weights=weights)
    if payload["inputs"]["calibrate"].get("streamed"):  # a streamed teacher: one layer's experts at a time
        plans, factors = convert_plans(
            _streamed_contexts(payload, load_stats(stats_path, weights=weights)), p
        )
    else:
        model, _ = resident_teacher(payload, cache)
        adapter = get_adapter(model)
        ckey = ("contexts", stats_path, json.dumps(weights, sort_keys=True))
        if ckey not in cache:
            cache[ckey] = layer_contexts(model, adapter, load_stats(stats_path, weights=weights))
        plans, factors = convert_plans(cache[ckey], p, teacher=(model, adapter))
    plan_key = plan_signature(plans)
    path = Path(payload["workdir"]) / "plan.json"
    path.write_text(json.dumps([plan_to_dict(pl) for pl in plans], indent=1))
    artifacts = [artifact("plan", path)]
    if (
        factors is not None
    ):  # an edited MoE's factors, beside its plan (workers.models.outputs.edited_student)
        artifacts.append(artifact("factors", factors))
    rows, diag = [], []
    for pl in plans:
        member = {
            e: (g, w)
            for g, (grp, ws) in enumerate(zip(pl.groups, pl.merge_weights, strict=True))
            for e, w in zip(grp, ws, strict=True)
        }
        for rank, e in enumerate(pl.selected):
            g, w = member[e]
            rows.append(
                {
                    "layer": pl.layer,
                    "expert": e,
                    "score": float(pl.scores[e]),
                    "selected_rank": rank,
                    "group_idx": g,
                    "merge_weight": float(w),
                    "alpha": float(pl.alpha[g]),
                }
            )
        diag += [
            {"layer": pl.layer, "name": k, "value": float(v)}
            for k, v in sorted(pl.extras.items())
            if isinstance(v, int | float)
        ]
    return {
        "outputs": {"plan_key": plan_key, "plan_path": str(path)},
        "plan_rows": rows,
        "layer_diag": diag,
        "artifacts": artifacts,
    }


def _streamed_contexts(payload: dict, stats: dict) -> Any:
    """The conversion contexts of a streamed teacher (workers.calibration.streamed.StreamedContexts): each layer's
    experts read from the shards onto the device when its plan is made."""
    from workers.calibration.streamed import StreamedContexts, StreamedTeacher, checkpoint_dir
    from workers.families import get_adapter
    from workers.run.runtime import DTYPES

    ref = payload["params"]["teacher"]
    teacher = StreamedTeacher(
        checkpoint_dir(teacher_path(payload), ref.get("revision")), DTYPES[ref.get("dtype", "float32")]
    )
    return StreamedContexts(teacher, get_adapter(teacher.model), stats, device())
