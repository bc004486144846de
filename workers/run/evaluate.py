"""Run function of the stage `evaluate`: lm-eval suites on a student, with per-item scores and errors."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from workers.run.common import _metric, _recipe_hash
from workers.run.runtime import (
    artifact,
    load_model,
    resident_teacher,
    teacher_path,
    tiny_dir,
)
from workers.run.students import make_student, ppl_record


def stage_evaluate(payload: dict, cache: dict, progress) -> dict:
    from workers.evaluation.evaluate import run_suite

    p = payload["params"]
    ev = p["evaluate"]
    kind = p["student"]["type"]
    saved: list[dict[str, Any]] = []
    if kind == "distilled":
        path = payload["inputs"]["distill"]["path"]
        model, tok = load_model(path)
    elif kind == "teacher":
        model, tok = resident_teacher(payload, cache)
        path = teacher_path(payload)
    else:  # a student built from its recipe (a smaller MoE, with its routers retrained by Router KD or not)
        model, tok = recovered_student(payload, cache, p["student"])
        path = str(Path(payload["workdir"]) / "student")
        if ev["backend"] == "vllm" or ev.get("save"):  # vLLM loads a checkpoint from disk
            model.save_pretrained(path)
            tok.save_pretrained(path)
            saved.append(artifact("student", Path(path)))
    metrics, items = [], []
    if ev.get("ppl", True):
        with torch.no_grad():
            metrics.append(ppl_record(model, tok, payload, cache, "post", items))
    if ev["backend"] == "vllm" and kind != "teacher":  # vLLM loads it from disk itself
        del model
        model = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    res = run_suite(
        model,
        tok,
        ev["suite"],
        model_key=evaluated_model_key(payload),
        cache_dir=str(Path(payload["home"]) / "lm_eval_cache"),
        tiny_dir=tiny_dir(payload),
        batch_size=ev["batch_size"],
        backend=ev["backend"],
        limit=ev.get("limit"),
        model_path=path,
        workdir=payload["workdir"],
        generative=ev.get("generative") or [],
        allow_cpu=ev.get("allow_cpu", False),
        allow_code_eval=ev.get("allow_code_eval", False),
        runs=ev.get("runs"),
    )
    metrics += eval_metrics(res, repeated=ev.get("runs") is not None)
    items += eval_items(res, repeated=ev.get("runs") is not None)
    out = Path(payload["workdir"]) / "lm_eval_results.json"
    out.write_text(json.dumps(res["results_json"], indent=1, default=str, sort_keys=True))
    outputs = {"avg": res.get("average"), **({"student": saved[0]["path"]} if saved else {})}
    if res.get("run_info"):  # when and on what lm-eval ran: here, not in the hashed results file
        outputs["lm_eval_run"] = res["run_info"]
    if res["not_run"]:
        outputs["not_run"] = res["not_run"]
    if ev.get("runs") is not None:
        outputs["runs"] = [
            {"step": i, **r["settings"], "avg": r["average"], "reused": r["reused"]}
            for i, r in enumerate(res["runs"])
        ]
    return {
        "outputs": outputs,
        "metrics": metrics,
        "artifacts": [artifact("lm_eval_results", out), *saved],
        "item_scores": items,
    }


def recovered_student(payload: dict, cache: dict, recipe: dict[str, Any]):
    """The student a recipe names, with a Router KD delta applied when the recipe says so."""
    if recipe["type"] != "router_kd":
        return make_student(payload, cache, recipe, for_training=False)
    from workers.training.router_kd import apply_router_delta, load_router_delta

    student, tok = make_student(payload, cache, recipe["base"], for_training=True)
    delta, _ = load_router_delta(
        payload["inputs"]["router_kd"]["delta"], parent_hash=_recipe_hash(recipe["base"])
    )
    apply_router_delta(student, delta)
    return student, tok


def evaluated_model_key(payload: dict) -> str:
    """A content key of the evaluated model alone (its recipe and the upstream outputs it is built from),
    not of the evaluation: a run added to the evaluate section finds the runs stored for the same model."""
    import hashlib

    p = payload["params"]
    blob = json.dumps(
        {"student": p["student"], "teacher": p["teacher"], "inputs": payload["inputs"]},
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def eval_metrics(res: dict[str, Any], repeated: bool) -> list[dict[str, Any]]:
    """Metric rows of run_suite's result: each run's scores with their n (`total`), in `step` = the run's
    index when the section lists runs (-1 otherwise), and one row per task not run (value NULL,
    value_kind 'skipped', its reason in extra)."""
    from workers.evaluation.suites import GENERATIVE

    rows = []
    for i, run in enumerate(res["runs"]):
        step = i if repeated else -1
        common = {
            "backend": res.get("backend"),
            "lm_eval": res.get("lm_eval_version"),
            **({"run": run["settings"]} if repeated else {}),
        }
        for t in run["tasks"]:
            extra = common | {"task_hash": t.get("task_hash")}
            for metric in ("acc", "acc_norm"):
                if t.get(metric) is None:
                    continue
                se = item_stderr(t.get("items") or [], metric, t[metric])
                rows.append(
                    _metric(
                        metric,
                        t[metric],
                        stage="post",
                        task=t["task"],
                        step=step,
                        stderr=t.get(f"{metric}_stderr") if se is None else se,
                        total=t.get("n"),
                        num_fewshot=t.get("num_fewshot"),
                        headline=int(metric == t["headline"]),
                        extra=extra,
                    )
                )
            for name, value in sorted(t.get("other", {}).items()):
                if name.endswith("_stderr") or name.partition(":")[0].endswith("_stderr"):
                    continue
                stderr = t["other"].get(_stderr_name(name))
                rows.append(
                    _metric(
                        name,
                        value,
                        stage="post",
                        task=t["task"],
                        step=step,
                        total=t.get("n"),
                        num_fewshot=t.get("num_fewshot"),
                        stderr=stderr,
                        extra=extra | ({"score": True} if name == t.get("score") else {}),
                    )
                )
        for task, reason in sorted(run["not_run"].items()):
            rows.append(
                _metric(
                    GENERATIVE[task].score,
                    None,
                    stage="post",
                    task=task,
                    step=step,
                    value_kind="skipped",
                    extra=common | {"not_run": reason},
                )
            )
    return rows


def eval_items(res: dict[str, Any], repeated: bool) -> list[dict[str, Any]]:
    """item_scores records of run_suite's result: per run, task, leaf task and per-sample metric (and the
    choices' log-likelihoods), keyed by lm-eval's doc_id so students are paired on the same items."""
    out = []
    for i, run in enumerate(res["runs"]):
        step = i if repeated else -1
        for t in run["tasks"]:
            for it in t.get("items") or []:
                common = {"stage": "post", "task": t["task"], "subtask": it["subtask"], "step": step}
                for name, vals in sorted(it["metrics"].items()):
                    out.append(common | {"name": name, "doc_ids": it["doc_ids"], "values": vals})
                if it["loglik"]:
                    out.append(
                        common | {"name": "loglik", "doc_ids": it["loglik_doc"], "values": it["loglik"]}
                    )
    return out


def item_stderr(items: list[dict[str, Any]], metric: str, value: float) -> float | None:
    """Standard error of a task's metric from its per-item scores (sample sd / √n, as lm-eval's): over all
    items when `value` is their mean (one task, or a group weighted by size), else the macro mean's over
    its leaf tasks. None without items."""
    leaves = [[x for x in it["metrics"].get(metric, []) if not math.isnan(x)] for it in items]
    leaves = [v for v in leaves if v]
    flat = [x for v in leaves for x in v]
    if len(flat) < 2:
        return None

    def var(v: list[float]) -> float:
        m = sum(v) / len(v)
        return sum((x - m) ** 2 for x in v) / (len(v) - 1) if len(v) > 1 else 0.0

    if abs(sum(flat) / len(flat) - value) < 1e-6:
        return math.sqrt(var(flat) / len(flat))
    return math.sqrt(sum(var(v) / len(v) for v in leaves)) / len(leaves)


def _stderr_name(name: str) -> str:
    metric, sep, filt = name.partition(":")
    return f"{metric}_stderr{sep}{filt}"
