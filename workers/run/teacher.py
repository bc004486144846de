"""Run function of the stages `teacher` and `dense_teacher`: load or train the teacher, record its size."""

from __future__ import annotations

from pathlib import Path

from workers.run.common import _metric
from workers.run.runtime import (
    artifact,
)


def stage_teacher(payload: dict, cache: dict, progress) -> dict:
    from workers.tiny.teacher import TinyTeacherSpec, train_tiny_dense, train_tiny_teacher

    spec = TinyTeacherSpec(**payload["params"]["tiny"])
    out = Path(payload["workdir"]) / "model"
    train = train_tiny_dense if payload["params"]["kind"] == "dense_teacher" else train_tiny_teacher
    rec = train(spec, out, progress=progress, cache_dir=Path(payload["home"]) / "cache" / "tiny")
    metrics = [
        _metric("ppl", rec["valid_ppl_teacher"], stage="train", who="teacher"),
        _metric("ppl", rec["valid_ppl_random_init"], stage="train", who="random_init"),
        _metric("params", float(rec["params"]), stage="train", who="teacher"),
    ]
    metrics += [
        _metric("train_loss", loss, stage="train", who="teacher", step=i)
        for i, loss in enumerate(rec["train_loss_curve"])
    ]
    keep = {k: v for k, v in rec.items() if k != "train_loss_curve"}
    return {"outputs": {"path": str(out), **keep}, "metrics": metrics, "artifacts": [artifact("model", out)]}
