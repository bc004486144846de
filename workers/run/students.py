"""A student built from its recipe (a plan, a D2D candidate, a recovered MoE) and its perplexity record."""

from __future__ import annotations

import copy
import json
from typing import Any

import torch

from workers.models.plans import load_plans
from workers.run.common import _metric
from workers.run.runtime import (
    device,
    eval_texts,
    resident_teacher,
    windows,
)


def make_student(payload: dict, cache: dict, recipe: dict[str, Any], *, for_training: bool):
    """The student a recipe names. For evaluation only, plan students share the teacher's tensors."""
    from workers.families import get_adapter

    kind = recipe["type"]
    if kind == "d2d":
        return d2d_student(payload, cache, recipe["candidate"])
    model, tok = resident_teacher(payload, cache)
    if kind == "teacher":
        return (copy.deepcopy(model) if for_training else model), tok
    adapter = get_adapter(model)
    if kind == "plan":
        from workers.models.outputs import write_student

        plan_path = payload["inputs"]["convert"]["plan_path"]
        plans = load_plans(plan_path)
        student = write_student(
            recipe.get("output", "dense"),
            model,
            adapter,
            plans,
            share_weights=not for_training,
            plan_path=plan_path,
        )
    elif kind == "random_ffn":
        from workers.baselines.baselines import random_ffn_student

        student = random_ffn_student(model, adapter, seed=recipe.get("seed", 0))
    elif kind == "random_init":
        from workers.baselines.baselines import random_init_student

        student = random_init_student(model, adapter, seed=recipe.get("seed", 0))
    else:
        raise ValueError(f"unknown student type {kind!r}")
    return student.to(device()), tok


def d2d_student(payload: dict, cache: dict, candidate: str):
    """Minitron-style pruning of the dense teacher (Appendix M)."""
    from workers.baselines.baselines import d2d_candidates, prune_dense

    dense, tok = resident_teacher(payload, cache, role="dense_teacher")
    cands = {c["name"]: c for c in d2d_candidates(dense, target_params=moe_student_params(payload))}
    c = payload["params"].get("calibration") or {}
    ids = windows(
        payload,
        cache,
        tok,
        c.get("data", {"source": "tiny", "split": "train"}),
        c.get("seq_len", 128),
        c.get("n_samples", 64),
        c.get("seed", 0),
    )
    batches = [ids[i : i + 8].to(device()) for i in range(0, len(ids), 8)]
    return prune_dense(dense, cands[candidate], batches).to(device()), tok


def moe_student_params(payload: dict) -> int | None:
    """Parameter count of the MoE→dense student at K = k, from the MoE teacher's config alone (built on
    the meta device: nothing is downloaded but the config). None for the tiny teacher, whose dense twin
    carries the number itself (workers.baselines.baselines.d2d_target)."""
    ref = payload["params"].get("moe_teacher") or {}
    if ref.get("source") != "hf":
        return None
    from transformers import AutoConfig, AutoModelForCausalLM

    from workers.families import get_adapter

    config = AutoConfig.from_pretrained(ref["model"], revision=ref.get("revision"))
    with torch.device("meta"):
        moe = AutoModelForCausalLM.from_config(config)
        adapter = get_adapter(moe)
        layer = adapter.moe_layers(moe)[0]
        shared = adapter.shared_ffn(moe, layer)
        width = adapter.top_k(moe) * adapter.expert_weights(moe, layer).intermediate + (
            shared.width if shared else 0
        )
        student = AutoModelForCausalLM.from_config(adapter.student_config(moe, width))
    return sum(p.numel() for p in student.parameters())


def ppl_record(
    model, tok, payload: dict, cache: dict, stage: str, items: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """The ppl metric with its standard error over windows (n = `total` = windows); `items`, when given,
    gains the per-window item scores (Σ NLL and scored tokens per window) for paired comparisons."""
    from workers.evaluation.ppl import compile_setting, perplexity, text_ids, window_stats

    pp = payload["params"]["ppl"]
    texts = eval_texts(payload, cache, pp["data"])
    key = json.dumps(["ppl_ids", pp["data"], tok.name_or_path, len(tok)], sort_keys=True)
    if key not in cache:  # every student of this worker's teacher is scored on the same tokens
        cache[key] = text_ids(tok, texts)
    r = perplexity(
        model,
        tok,
        texts,
        seq_len=pp["seq_len"],
        batch_size=pp["batch_size"],
        add_bos=pp["add_bos"],
        device=device(),
        max_windows=pp.get("max_windows"),
        windows=pp.get("windows", "disjoint"),
        ids=cache[key],
        compile_layers=compile_setting(pp.get("compile", "auto"), device()),
    )
    se, n = window_stats(r["window_nll"], r["window_tokens"])
    metric = _metric(
        "ppl",
        r["ppl"],
        stage=stage,
        sum_nll=r["sum_nll"],
        n_tokens=r["n_tokens"],
        stderr=se,
        total=n,
        value_kind=r["value_kind"],
        extra={"protocol": r["protocol"], "data": pp["data"]},
    )
    if items is not None:
        items += [
            {"stage": stage, "name": name, "doc_ids": list(range(n)), "values": [float(v) for v in vals]}
            for name, vals in (("nll", r["window_nll"]), ("tokens", r["window_tokens"]))
        ]
    return metric
