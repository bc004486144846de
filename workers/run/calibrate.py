"""Run function of the stage `calibrate`: the teacher's routing and expert statistics, resident or streamed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from workers.run.common import _metric
from workers.run.runtime import (
    artifact,
    device,
    resident_teacher,
    teacher_path,
    windows,
)


def stage_calibrate(payload: dict, cache: dict, progress) -> dict:
    """One pass of the teacher over each calibration source's own windows; every source's statistics are
    kept apart in one file (mixed with the sources' weights when they are loaded). `streamed`: the teacher
    is read from its shards one decoder layer at a time (workers.calibration.streamed), never resident."""
    from workers.calibration.calibrate import (
        calibration_sources,
        collect_stats,
        save_source_stats,
        source_tokens,
        stats_to,
    )
    from workers.families import get_adapter

    p = payload["params"]
    if p.get("streamed"):
        run, tok, model = _streamed_teacher(payload, p.get("offload_hidden", False))
    else:
        model, tok = resident_teacher(payload, cache)
        run = collect_stats
    adapter = get_adapter(model)
    sources = calibration_sources(p)
    n_sample = p.get("sample_tokens", 0)  # absent (= 0) unless set: older job keys stay what they were
    per_source = {}
    for name, src in sources.items():
        ids = windows(payload, cache, tok, src["data"], p["seq_len"], src["n_samples"], p["seed"])
        mask = torch.ones_like(ids)
        batches = [
            (ids[i : i + p["batch_size"]].to(device()), mask[i : i + p["batch_size"]].to(device()))
            for i in range(0, len(ids), p["batch_size"])
        ]
        cb = (lambda i, n, name=name: progress(i, n, f"calibrate {name}")) if progress else None
        stats = run(
            model,
            adapter,
            batches,
            chunk_tokens=p["chunk_tokens"],
            progress=cb,
            sample_tokens=n_sample,
            sample_seed=p["seed"],
        )
        per_source[name] = stats_to(stats, "cpu")  # the next source's pass gets the device memory back
    path = Path(payload["workdir"]) / "stats.safetensors"
    keys = [
        k for k in ("teacher", "data", "sources", "seq_len", "n_samples", "seed", "sample_tokens") if k in p
    ]
    save_source_stats(
        per_source,
        {name: src["weight"] for name, src in sources.items()},
        path,
        metadata={k: json.dumps(p[k], sort_keys=True) for k in keys},
    )
    counts = {name: source_tokens(stats) for name, stats in per_source.items()}
    listed = {
        name: {"n_tokens": counts[name], "weight": float(src["weight"]), "n_samples": src["n_samples"]}
        for name, src in sources.items()
    }
    streamed = {"streamed": True} if p.get("streamed") else {}  # convert then reads the teacher streamed too
    return {
        "outputs": {
            "stats": str(path),
            "n_tokens": sum(counts.values()),
            "layers": sorted(stats),
            "sources": listed,
            **streamed,
        },
        "metrics": [
            _metric("calib_tokens", float(n), stage="calib", task=name, n_tokens=n)
            for name, n in counts.items()
        ],
        "artifacts": [artifact("calibration_stats", path)],
    }


def _streamed_teacher(payload: dict, offload: bool) -> tuple[Any, Any, Any]:
    """(collect_stats's stand-in reading the teacher one layer at a time, the tokenizer, the teacher's
    meta-device skeleton): nothing of the teacher is loaded until a pass runs."""
    from transformers import AutoTokenizer

    from workers.calibration.streamed import StreamedTeacher, checkpoint_dir, streamed_stats
    from workers.run.runtime import DTYPES

    ref = payload["params"]["teacher"]
    path = teacher_path(payload)
    teacher = StreamedTeacher(checkpoint_dir(path, ref.get("revision")), DTYPES[ref.get("dtype", "float32")])
    tok = AutoTokenizer.from_pretrained(path, revision=ref.get("revision"))

    def run(model, adapter, batches, **kw: Any) -> dict:
        return streamed_stats(teacher, adapter, batches, offload=offload, **kw)

    return run, tok, teacher.model
