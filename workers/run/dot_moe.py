"""Run function of the stage `dot_moe`: a dense model turned into an MoE by DOT-MoE, aligned and scored."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from workers.run.common import _metric, _train_batches
from workers.run.runtime import (
    artifact,
    load_model,
    resident_teacher,
)
from workers.run.students import ppl_record


def stage_dot_moe(payload: dict, cache: dict, progress) -> dict:
    """Align one dense model into an MoE (DOT-MoE §3, App. D), extract it (App. E), save it, and record its
    perplexity at every `eval_top_k` (Table 8: inference sparsity without retraining) beside the dense
    model's. Metrics: `ppl` (stage dot_moe, who student, step = the evaluated top-k; who dense, step -1),
    the per-step loss and its terms, parameter counts."""
    from workers.baselines.dot_moe import active_params, align, extract, install, save_assignment
    from workers.baselines.dot_moe_spec import DotMoeSpec
    from workers.models.dot_moe_hf import set_top_k

    p = payload["params"]
    spec = DotMoeSpec(**p["settings"])
    if p["source"] == "dense_teacher":
        dense, tok = resident_teacher(payload, cache, role="dense_teacher")
        dense = copy.deepcopy(dense)
    else:
        dense, tok = load_model(
            payload["inputs"]["distill"]["path"], p.get("teacher", {}).get("dtype", "float32")
        )
    with torch.no_grad():
        dense_ppl = ppl_record(dense, tok, payload, cache, "dot_moe")
    ffns = install(dense, p["experts"], p["top_k"], p["method"], spec)
    cb = (lambda i, n: progress(i, n, "dot_moe")) if progress else None
    batches = _train_batches(
        payload, cache, tok, spec, spec.steps * spec.batch_size
    )  # streamed if the data is
    rec = align(dense, ffns, batches, spec, progress=cb)
    moe = extract(dense, ffns, spec.combine)
    work = Path(payload["workdir"])
    out, assign = work / "moe", work / "dot_assignment.safetensors"
    moe.save_pretrained(out)
    tok.save_pretrained(out)
    save_assignment(ffns, assign)
    info = {
        "method": p["method"],
        "source": p["source"],
        "experts": p["experts"],
        "top_k": p["top_k"],
        "combine": spec.combine,
    }
    metrics = [{**dense_ppl, "who": "dense", "extra": {**dense_ppl["extra"], **info}}]
    ppl: dict[str, float | None] = {}
    with torch.no_grad():
        for k in p["eval_top_k"]:
            set_top_k(moe, k)
            m = ppl_record(moe, tok, payload, cache, "dot_moe")
            ppl[str(k)] = m["value"]
            metrics.append(
                {
                    **m,
                    "who": "student",
                    "step": k,
                    "extra": {**m["extra"], **info, "active_fraction": k / p["experts"]},
                }
            )
    set_top_k(moe, p["top_k"])
    for r in rec["curve"]:
        metrics += [
            _metric(
                f"train_{t}" if t != "loss" else "train_loss",
                r[t],
                stage="dot_moe",
                who="student",
                step=r["step"],
            )
            for t in ("loss", "kl", "ce", "z", "balance", "tau")
        ]
    tokens = rec["steps"] * spec.batch_size * spec.seq_len
    metrics += [
        _metric("params", float(sum(t.numel() for t in moe.parameters())), stage="dot_moe", who="student"),
        _metric("active_params", float(active_params(moe, p["top_k"])), stage="dot_moe", who="student"),
        _metric("trainable_params", float(rec["trainable_params"]), stage="dot_moe", who="student"),
        _metric("dot_tokens", float(tokens), stage="dot_moe", n_tokens=tokens, extra=info),
    ]
    outputs = {
        "path": str(out),
        "ppl": ppl,
        "dense_ppl": dense_ppl["value"],
        "padded_neurons": ffns[0].n - ffns[0].d,
        "expert_width": ffns[0].s,
        "steps": rec["steps"],
        **info,
    }
    return {
        "outputs": outputs,
        "metrics": metrics,
        "artifacts": [artifact("moe", out), artifact("dot_assignment", assign)],
    }
