"""Run function of the stage `expert_maxima`: the teacher's per-expert max activations (REAP's super-expert
statistic) over the calibration windows, one pass per calibration source."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from workers.run.runtime import artifact, device, resident_teacher, windows


def stage_expert_maxima(payload: dict, cache: dict, progress) -> dict:
    """The same windows as the calibrate job of these parameters (each source's own), through the resident
    teacher; every source's maxima kept apart in one file (a conversion takes the max over the sources
    its calibration weights count)."""
    from workers.calibration.calibrate import calibration_sources
    from workers.calibration.expert_maxima import collect_maxima, save_maxima
    from workers.families import get_adapter

    p = payload["params"]
    model, tok = resident_teacher(payload, cache)
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
        per_source[name] = collect_maxima(
            model, adapter, batches, chunk_tokens=p["chunk_tokens"], progress=cb
        )
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
