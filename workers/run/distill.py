"""Run function of the stage `distill`: distill a student from its teacher, in one process or several."""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from typing import Any

import torch

from workers.run.common import _metric, _train_batches
from workers.run.runtime import (
    artifact,
    resident_teacher,
    teacher_path,
    windows,
)
from workers.run.students import make_student


def stage_distill(payload: dict, cache: dict, progress) -> dict:
    from workers.families import get_adapter
    from workers.training.distill import DistillSpec, distill

    p = payload["params"]
    spec = DistillSpec(**p["settings"])
    recipe = p["student"]
    student, tok = make_student(payload, cache, recipe, for_training=True)
    role = "dense_teacher" if recipe["type"] == "d2d" else "teacher"
    teacher, _ = resident_teacher(payload, cache, role=role)
    adapter = get_adapter(teacher) if role == "teacher" else None
    n_train = spec.steps * spec.batch_size * spec.grad_accum
    val = windows(payload, cache, tok, p["val_data"], spec.seq_len, spec.val_windows, spec.seed + 2)
    out = Path(payload["workdir"]) / "student"
    procs = _processes(p.get("processes", 1))
    sharding = _sharding(p.get("sharding"), procs)
    if (
        sharding != "none"
    ):  # ddp or fsdp over this job's GPUs (or CPU processes): torchrun, same loop and losses
        train = windows(payload, cache, tok, p["data"], spec.seq_len, n_train, spec.seed + 1)
        student.to("cpu")  # saved from here; the ranks load their own copies
        with _off_device(teacher):
            rec = _distill_multiprocess(
                payload,
                student,
                tok,
                teacher_path(payload, role),
                role,
                train,
                val,
                spec,
                procs,
                sharding,
                bool(p.get("teacher_offload")),
            )
    else:
        cb = (lambda i, n, *_: progress(i, n, "distill")) if progress else None
        stream = (
            (lambda r: progress(r["step"], spec.steps, "distill", metrics=[_val_metric(r)]))
            if progress
            else None
        )
        rec = distill(
            student,
            teacher,
            adapter,
            _train_batches(payload, cache, tok, spec, n_train),
            val,
            spec,
            progress=cb,
            on_val=stream,
        )
        student.save_pretrained(out)
        tok.save_pretrained(out)
    metrics = [_val_metric(r) for r in rec["val"]]
    metrics += [
        _metric("train_loss", v, stage="train", who="student", step=i)
        for i, v in enumerate(rec["loss_curve"])
    ]
    metrics.append(
        _metric(
            "distill_tokens",
            float(rec["tokens"]),
            stage="train",
            n_tokens=rec["tokens"],
            extra={
                "teacher_routing": rec.get("teacher_routing"),
                "processes": procs,
                **({"sharding": sharding} if "sharding" in p else {}),
            },
        )
    )
    return {
        "outputs": {"path": str(out), "tokens": rec["tokens"]},
        "metrics": metrics,
        "artifacts": [artifact("student", out)],
    }


def _val_metric(r: dict[str, Any]) -> dict[str, Any]:
    return _metric("val_ce", r["value"], stage="train", who=r["who"], step=r["step"], n_tokens=r["tokens"])


def _processes(value: int | str) -> int:
    """`distill.processes`: an integer, or "gpus" = one process per GPU this job holds (at least 1)."""
    if value == "gpus":
        return max(1, torch.cuda.device_count())
    return int(value)


def _sharding(value: str | None, procs: int) -> str:
    """`distill.sharding`: as set, else none for one process and ddp for more (the behaviour before it)."""
    if value is None:
        return "none" if procs == 1 else "ddp"
    if value == "none" and procs != 1:
        raise ValueError(f"distill.sharding: 'none' runs one process; processes must be 1, got {procs}")
    return value


@contextlib.contextmanager
def _off_device(model):
    """The (resident) model moved to the CPU for the block and back: the ranks need this job's GPU memory."""
    where = next(model.parameters()).device
    try:
        model.to("cpu")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        yield
    finally:
        model.to(where)


def _distill_multiprocess(
    payload: dict,
    student,
    tok,
    teacher_dir: str,
    role: str,
    train: torch.Tensor,
    val: torch.Tensor,
    spec,
    procs: int,
    sharding: str = "ddp",
    teacher_offload: bool = False,
) -> dict[str, Any]:
    """Run workers.training.ddp under torchrun (see its docstring; sharding ddp or fsdp); rank 0 writes the student
    into workdir/student."""
    from dataclasses import asdict

    from workers.training.ddp import launch

    work = Path(payload["workdir"])
    init = work / "init_student"
    student.save_pretrained(init)
    torch.save(train, work / "train.pt")
    torch.save(val, work / "val.pt")
    ref = payload["params"]["teacher"]
    job = {
        "student": str(init),
        "teacher": teacher_dir,
        "teacher_dtype": ref.get("dtype", "float32"),
        "moe_teacher": role == "teacher",
        "train": str(work / "train.pt"),
        "val": str(work / "val.pt"),
        "spec": asdict(spec),
        "out": str(work),
        "sharding": sharding,
        "teacher_offload": teacher_offload,
    }
    rec = launch(job, work / "ddp", nproc=procs)
    tok.save_pretrained(work / "student")
    shutil.rmtree(init)
    return rec
