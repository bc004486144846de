"""Downstream evaluation of one model on a suite with lm-eval's ``simple_evaluate`` (after distillation).

The HF backend wraps the in-memory model (no checkpoint needed); the vLLM backend (the ``[gpu]`` extra)
loads ``model_path`` (the model is saved to ``workdir`` first when there is none). lm-eval's response
cache ignores model identity, so each (model_key, backend) gets its own cache file under cache_dir.
Task hashes are lm-eval's own (sha256 over every sample's doc, prompt and target hashes, as its
EvaluationTracker computes them); the stored results JSON leaves the samples out.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import Any

from workers.suites import SuiteTask, build_suite

BACKENDS = ("hf", "vllm")
_ACC = ("acc", "acc_stderr", "acc_norm", "acc_norm_stderr")


def run_suite(model, tok, suite: str | list[dict[str, Any]], model_key: str, cache_dir: str, tiny_dir: str | None,
              batch_size: int, backend: str, limit: int | float | None, model_path: str | None,
              workdir: str | None) -> dict[str, Any]:
    """Evaluate one model on a suite; per-task rows, the unweighted average of headline metrics, the results JSON."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if not model_key:
        raise ValueError("model_key must be a non-empty content key of the model (it keys lm-eval's response cache)")
    import lm_eval
    from lm_eval.tasks import TaskManager

    tasks = build_suite(suite, cache_dir, tiny_dir)
    lm = _make_lm(backend, model, tok, batch_size, model_path, workdir)
    key = hashlib.sha256(model_key.encode()).hexdigest()[:24]
    cache = Path(cache_dir).resolve() / "responses" / key / backend
    cache.mkdir(parents=True, exist_ok=True)
    includes = sorted({t.include_path for t in tasks if t.include_path})
    manager = TaskManager(include_path=includes or None, include_defaults=False)

    by_limit: dict[Any, list[SuiteTask]] = {}
    for t in tasks:
        by_limit.setdefault(t.limit if t.limit is not None else limit, []).append(t)
    merged: dict[str, Any] = {}
    hashes: dict[str, str] = {}
    for lim, group in by_limit.items():
        res = lm_eval.simple_evaluate(model=lm, tasks=[t.spec for t in group], task_manager=manager,
                                      use_cache=str(cache / "lm"), limit=lim, log_samples=True)
        samples = res.pop("samples", None) or {}
        hashes |= {name: _hash_samples(s) for name, s in samples.items()}
        _merge(merged, res)
    rows = [_row(t, merged, hashes) for t in tasks]
    heads = [r[r["headline"]] for r in rows if r["headline"]]
    merged["task_hashes"] = {r["task"]: r["task_hash"] for r in rows} | hashes
    merged["moesweep"] = {"suite": suite, "model_key": model_key, "backend": backend, "limit": limit,
                          "tasks": [{"task": t.name, "num_fewshot": t.num_fewshot, "headline": t.headline,
                                     "limit": t.limit, "config_sha": t.config_sha} for t in tasks]}
    return {"tasks": rows, "average": sum(heads) / len(heads) if heads else None, "backend": backend,
            "lm_eval_version": lm_eval.__version__, "results_json": merged}


def _make_lm(backend: str, model, tok, batch_size: int, model_path: str | None, workdir: str | None):
    if backend == "hf":
        from lm_eval.models.huggingface import HFLM

        return HFLM(pretrained=model, tokenizer=tok, batch_size=batch_size)
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise ImportError("backend 'vllm' needs the vllm package: install the [gpu] extra "
                          "(pip install 'moesweep[gpu]') or use backend 'hf'") from None
    from lm_eval.models.vllm_causallms import VLLM

    if model_path is None:
        if workdir is None:
            raise ValueError("backend 'vllm' needs model_path, or workdir to save the in-memory model to")
        model_path = str(Path(workdir) / "vllm_model")
        model.save_pretrained(model_path)
        tok.save_pretrained(model_path)
    import torch

    # leave room for what this process already holds on the GPU (e.g. the model used for perplexity)
    free, total = torch.cuda.mem_get_info() if torch.cuda.is_available() else (1, 1)
    # prefix caching off: prompt logprobs have depended on request order with it on (vllm#42019)
    return VLLM(pretrained=model_path, batch_size=batch_size, dtype="auto", enable_prefix_caching=False,
                gpu_memory_utilization=round(max(0.1, 0.9 * free / total), 3))


def _hash_samples(samples: list[dict[str, Any]]) -> str:
    """lm-eval's task hash (loggers/evaluation_tracker.py): sha256 over doc+prompt+target hashes."""
    joined = "".join(s["doc_hash"] + s["prompt_hash"] + s["target_hash"] for s in samples)
    return hashlib.sha256(joined.encode()).hexdigest()


def _merge(into: dict[str, Any], res: dict[str, Any]) -> None:
    """Fold one simple_evaluate result into another: per-task sections are unioned, the rest kept first."""
    for k, v in res.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict) and k != "config":
            into[k] = into[k] | v
        else:
            into.setdefault(k, v)


def _leaves(res: dict[str, Any], name: str) -> list[str]:
    subs = res.get("group_subtasks", {}).get(name)
    if not subs:
        return [name]
    return [leaf for s in subs for leaf in _leaves(res, s)]


def _row(t: SuiteTask, res: dict[str, Any], hashes: dict[str, str]) -> dict[str, Any]:
    metrics = res.get("results", {}).get(t.name) or res.get("groups", {}).get(t.name)
    if metrics is None:
        raise ValueError(f"lm-eval returned no results for task {t.name!r}")
    values: dict[str, float] = {}
    for k, v in metrics.items():
        metric, _, filt = k.partition(",")
        if filt and isinstance(v, int | float) and not isinstance(v, bool):
            values[metric if filt == "none" else f"{metric}:{filt}"] = float(v)
    if t.headline and t.headline not in values:
        raise ValueError(f"task {t.name!r} reports no {t.headline}; set headline to one of "
                         f"{', '.join(m for m in ('acc', 'acc_norm') if m in values) or 'nothing available'}")
    leaves = _leaves(res, t.name)
    n = sum(int(res.get("n-samples", {}).get(leaf, {}).get("effective", 0)) for leaf in leaves)
    shots = res.get("n-shot", {})
    if t.name in hashes:
        task_hash = hashes[t.name]
    elif all(leaf in hashes for leaf in leaves):
        task_hash = hashlib.sha256("".join(f"{leaf}:{hashes[leaf]}" for leaf in sorted(leaves)).encode()).hexdigest()
    else:
        task_hash = t.config_sha
    return {
        "task": t.name,
        **{m: _finite(values.get(m)) for m in _ACC},
        "n": n,
        "num_fewshot": int(shots.get(t.name, shots.get(leaves[0], t.num_fewshot))),
        "headline": t.headline,
        "task_hash": task_hash,
        "other": {k: v for k, v in sorted(values.items()) if k not in _ACC},
    }


def _finite(v: float | None) -> float | None:
    return v if v is None or math.isfinite(v) else None
