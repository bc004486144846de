"""Run function of the stage `router_kd`: train a smaller MoE's routers against the teacher's."""

from __future__ import annotations

from pathlib import Path

from workers.run.common import _metric, _recipe_hash
from workers.run.runtime import (
    artifact,
    resident_teacher,
    sequences,
    windows,
)
from workers.run.students import make_student


def stage_router_kd(payload: dict, cache: dict, progress) -> dict:
    """Retrain only the routers of a smaller MoE against its teacher (the Router KD paper, §4); the
    result is a router delta: the router tensors and the identity of the student they apply to."""
    from workers.families import get_adapter
    from workers.training.router_kd import calibration_batches, router_kd, save_router_delta
    from workers.training.router_kd_spec import RouterKDSpec

    p = payload["params"]
    spec = RouterKDSpec(**p["settings"])
    student, tok = make_student(payload, cache, p["student"], for_training=True)
    teacher, _ = resident_teacher(payload, cache)
    if spec.packing:  # windows cut from the concatenated documents
        batches = calibration_batches(
            windows(payload, cache, tok, p["data"], spec.max_len, spec.max_samples, spec.seed), spec
        )
    else:  # the paper's: one document per sequence, truncated, right-padded
        ids, mask = sequences(payload, cache, tok, p["data"], spec.max_len, spec.max_samples, spec.seed)
        batches = calibration_batches(ids, spec, attention_mask=mask)
    cb = (lambda i, n: progress(i, n, "router_kd")) if progress else None
    rec = router_kd(student, teacher, get_adapter(student), batches, spec, progress=cb)
    path = Path(payload["workdir"]) / "router_delta.safetensors"
    save_router_delta(
        path,
        rec["router_delta"],
        parent_hash=_recipe_hash(p["student"]),
        metadata={"kd_loss_norm": rec["kd_loss_norm"], "steps": rec["steps"]},
    )
    metrics = [
        _metric("train_loss", v, stage="router_kd", who="student", step=i)
        for i, v in enumerate(rec["loss_curve"])
    ]
    metrics += [
        _metric("trainable_params", float(rec["trainable_params"]), stage="router_kd"),
        _metric(
            "kd_tokens",
            float(rec["tokens"]),
            stage="router_kd",
            n_tokens=rec["tokens"],
            extra={
                "router_renorm": rec["router_renorm"],
                "kd_loss_norm": rec["kd_loss_norm"],
                "steps": rec["steps"],
                "sequences": rec["sequences"],
            },
        ),
    ]
    return {
        "outputs": {"delta": str(path), "parent": _recipe_hash(p["student"]), "steps": rec["steps"]},
        "metrics": metrics,
        "artifacts": [artifact("router_delta", path)],
    }
