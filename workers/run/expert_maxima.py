"""Run function of the stage `expert_maxima`: the teacher's per-expert max activations (REAP's super-expert
statistic) over the calibration windows, one pass per calibration source, resident or streamed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from workers.run.runtime import artifact, device, resident_teacher, teacher_path, windows


def stage_expert_maxima(payload: dict, cache: dict, progress) -> dict:
    """The same windows as the calibrate job of these parameters (each source's own), through the resident
    teacher, or with `streamed` (as its calibration) read from its shards one decoder layer at a time; every
    source's maxima kept apart in one file (a conversion takes the max over the sources its calibration
    weights count)."""
    from workers.calibration.calibrate import calibration_sources
    from workers.calibration.expert_maxima import collect_maxima, save_maxima
    from workers.families import get_adapter

    p = payload["params"]
    if p.get("streamed"):
        run, tok, model = _streamed_teacher(payload, p.get("offload_hidden", False))
    else:
        model, tok = resident_teacher(payload, cache)
        run = collect_maxima
    adapter = get_adapter(model)
    sources = calibration_sources(p)
    per_source = {}
    for name, src in sources.items():
        ids = windows(payload, cache, tok, src["data"], p["seq_len"], src["n_samples"], p["seed"])
        mask = torch.ones_like(ids)
        batches = [
            (ids[i : i + p["batch_size"]].to(device()), mask[i : i + p["batch_size"]].to(device()))
            for i in range(0, len(ids), p["batch_size"])
        ]
        cb = (lambda i, n, name=name: progress(i, n, f"expert_maxima {name}")) if progress else None
        per_source[name] = run(model, adapter, batches, chunk_tokens=p["chunk_tokens"], progress=cb)
    path = Path(payload["workdir"]) / "expert_maxima.safetensors"
    keys = [k for k in ("teacher", "data", "sources", "seq_len", "n_samples", "seed") if k in p]
    save_maxima(
        per_source,
        {name: src["weight"] for name, src in sources.items()},
        path,
        metadata={k: json.dumps(p[k], sort_keys=True) for k in keys},
    )
    return {
        "outputs": {
            "maxima": str(path),
            "layers": sorted(next(iter(per_source.values()))),
            "sources": list(sources),
        },
        "artifacts": [artifact("expert_maxima", path)],
    }


def _streamed_teacher(payload: dict, offload: bool) -> tuple[Any, Any, Any]:
    """(collect_maxima's stand-in reading the teacher one layer at a time, the tokenizer, the teacher's
    meta-device skeleton): nothing of the teacher is loaded until a pass runs."""
    from transformers import AutoTokenizer

    from workers.calibration.expert_maxima import streamed_maxima
    from workers.calibration.streamed import StreamedTeacher, checkpoint_dir
    from workers.run.runtime import DTYPES

    ref = payload["params"]["teacher"]
    path = teacher_path(payload)
    teacher = StreamedTeacher(checkpoint_dir(path, ref.get("revision")), DTYPES[ref.get("dtype", "float32")])
    tok = AutoTokenizer.from_pretrained(path, revision=ref.get("revision"))

    def run(model, adapter, batches, **kw: Any) -> dict:
        return streamed_maxima(teacher, adapter, batches, offload=offload, **kw)

    return run, tok, teacher.model
