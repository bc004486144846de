"""Downstream evaluation of one model on a suite with lm-eval's ``simple_evaluate`` (after distillation).

The HF backend wraps the in-memory model (no checkpoint needed); the vLLM backend (the ``[gpu]`` extra)
loads ``model_path`` (the model is saved to ``workdir`` first when there is none). lm-eval's own
response cache (`use_cache`, a SqliteDict of pickles) is not used: whoever can write a pickle where it
is read runs code in the evaluating process, and the stored task results below already spare re-runs.
Task hashes are lm-eval's own (sha256 over every sample's doc, prompt and target hashes, as its
EvaluationTracker computes them); the stored results JSON leaves the samples out, but each task keeps
its per-item scores (`items`: per leaf task, lm-eval's doc_id, every numeric per-sample metric such as
acc / acc_norm, and each choice's log-likelihood), so a comparison between models evaluated on the same
items can be paired and recomputed.

Generative tasks (workers/evaluation/suites.py GENERATIVE) run only when what they declare is here: a GPU (unless
allow_cpu), their data (the hub reachable, the dataset in the local cache, or a local copy), permission to
run model-written code (allow_code_eval). Otherwise they are reported in `not_run` with a one-line reason
and no number. Several runs of one model (`runs`: seed, num_fewshot, limit) are evaluated one after the
other; each task's result of a run is stored under cache_dir/runs/<model key>/ and read back, not
recomputed, when the same model, task definition, run settings and evaluation code ask for it again.
A stored result is read back only when it verifies: it carries the key it was stored under and the sha256
of its content, and its accuracies are what its per-item scores give (`_stored_problem`); one that does
not (edited, truncated, another run's file) is recomputed and replaced, with one line on stderr.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from workers.evaluation.suites import (
    GENERATIVE,
    GenerativeTask,
    SuiteTask,
    build_generative,
    build_suite,
    validate_generative,
)

BACKENDS = ("hf", "vllm")
RUN_FIELDS = ("seed", "num_fewshot", "limit")
_ACC = ("acc", "acc_stderr", "acc_norm", "acc_norm_stderr")
# the per-task sections of a simple_evaluate result (kept with a stored task result)
# what a simple_evaluate result says about when and on what it ran (recorded in the job's outputs, not in
# lm_eval_results.json, whose content is hashed: identical runs write identical files)
_VOLATILE = (
    "date",
    "start_time",
    "end_time",
    "total_evaluation_time_seconds",
    "git_hash",
    "upper_git_hash",
    "pretty_env_info",
)
_SECTIONS = (
    "results",
    "groups",
    "group_subtasks",
    "configs",
    "versions",
    "n-shot",
    "higher_is_better",
    "n-samples",
)


def run_suite(
    model,
    tok,
    suite: str | list[dict[str, Any]],
    model_key: str,
    cache_dir: str,
    tiny_dir: str | None,
    batch_size: int,
    backend: str,
    limit: int | float | None,
    model_path: str | None,
    workdir: str | None,
    *,
    generative: list[str | dict[str, Any]] = (),
    allow_cpu: bool = False,
    allow_code_eval: bool = False,
    runs: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Evaluate one model on a suite (and generative tasks), once per run. Top level: the first run's
    per-task rows and headline average, the tasks not run ({task: reason}); `runs`: every run's."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if not model_key:
        raise ValueError(
            "model_key must be a non-empty content key of the model (it keys the stored task results)"
        )
    validate_runs(runs)
    import lm_eval

    entries = validate_generative(list(generative))
    lm = functools.cache(lambda: _make_lm(backend, model, tok, batch_size, model_path, workdir))
    env = Evaluation(
        lm, model_key, Path(cache_dir).resolve(), tiny_dir, backend, limit, allow_cpu, allow_code_eval
    )
    done = [env.one_run(suite, entries, r) for r in (runs or [{}])]
    first = done[0]
    results = first["results_json"] if runs is None else {"runs": [r["results_json"] for r in done]}
    return {
        "tasks": first["tasks"],
        "average": first["average"],
        "not_run": first["not_run"],
        "backend": backend,
        "lm_eval_version": lm_eval.__version__,
        "results_json": results,
        "runs": [{k: v for k, v in r.items() if k != "results_json"} for r in done],
        "run_info": {k: str(v) for k, v in env.run_info.items()},
    }


def validate_runs(runs: list[dict[str, Any]] | None) -> None:
    """Runs are distinct mappings of seed / num_fewshot (integers >= 0) and limit (> 0); one-line errors."""
    if runs is None:
        return
    if not isinstance(runs, list) or not runs:
        raise ValueError("runs must be a non-empty list of {seed, num_fewshot, limit} mappings (or null)")
    for i, r in enumerate(runs):
        bad = sorted(set(r) - set(RUN_FIELDS)) if isinstance(r, dict) else ["(not a mapping)"]
        if bad:
            raise ValueError(
                f"runs entry {i}: unknown field(s) {', '.join(bad)}; allowed {', '.join(RUN_FIELDS)}"
            )
        for f in ("seed", "num_fewshot"):
            v = r.get(f)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise ValueError(f"runs entry {i}: {f} must be an integer >= 0, got {v!r}")
        lim = r.get("limit")
        if lim is not None and (isinstance(lim, bool) or not isinstance(lim, int | float) or lim <= 0):
            raise ValueError(f"runs entry {i}: limit must be a positive number, got {lim!r}")
        if r in runs[:i]:
            raise ValueError(
                f"runs entry {i} repeats entry {runs.index(r)} ({r}): it would give the same numbers"
            )


# ---- what a generative task needs --------------------------------------------------------------------
def unmet(g: GenerativeTask, entry: dict[str, Any], allow_cpu: bool, allow_code_eval: bool) -> str | None:
    """Why a declared generative task cannot run here (one line), or None when it can."""
    if g.requires.get("gpu") and not allow_cpu and not gpu_available():
        return "needs a GPU (none here); evaluate.allow_cpu: true runs it on the CPU (small models)"
    if g.executes_code and not allow_code_eval:
        return (
            "is scored by running model-written code; evaluate.allow_code_eval: true allows it "
            "(sets HF_ALLOW_CODE_EVAL=1 and confirms lm-eval's unsafe-code prompt)"
        )
    local = "data_dir" in entry or "data_files" in entry
    for ds in () if local else g.requires.get("data", ()):
        if hub_offline() and not hf_cached(ds, "dataset"):
            return (
                f"needs the dataset {ds}: the Hugging Face hub is offline here and it is not in the local cache; "
                "data_dir or data_files can point at a local copy"
            )
    for mod in g.requires.get("modules", ()):
        if importlib.util.find_spec("evaluate") is None:
            return f"needs the `evaluate` package for its metric ({mod})"
        if hub_offline() and not hf_cached(mod, "module"):
            return f"needs the metric module {mod}: the Hugging Face hub is offline here and it is not in the local cache"
    return None


def gpu_available() -> bool:
    import torch

    return torch.cuda.is_available()


def hub_offline() -> bool:
    return any(
        os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
        for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    )


def hf_cached(repo: str, kind: str) -> bool:
    """Whether a dataset (or an `evaluate` metric module) is in one of the local Hugging Face caches."""
    from huggingface_hub import constants

    org, _, name = repo.partition("/")
    if kind == "dataset":
        import datasets.config

        places = [
            Path(datasets.config.HF_DATASETS_CACHE) / f"{org}___{name}",
            Path(constants.HF_HUB_CACHE) / f"datasets--{org}--{name}",
        ]
    else:
        import evaluate.config

        places = [
            Path(evaluate.config.HF_MODULES_CACHE) / "evaluate_modules" / "metrics" / f"{org}--{name}",
            Path(constants.HF_HUB_CACHE) / f"spaces--{org}--{name}",
        ]
    return any(p.exists() for p in places)


@contextlib.contextmanager
def _code_eval(allowed: bool):
    """HF_ALLOW_CODE_EVAL=1 while lm-eval scores model-written code (only when the sweep allows it)."""
    before = os.environ.get("HF_ALLOW_CODE_EVAL")
    if allowed:
        os.environ["HF_ALLOW_CODE_EVAL"] = "1"
    try:
        yield
    finally:
        if allowed and before is None:
            os.environ.pop("HF_ALLOW_CODE_EVAL", None)
        elif allowed:
            os.environ["HF_ALLOW_CODE_EVAL"] = before


# ---- one run ------------------------------------------------------------------------------------
class Evaluation:
    """What every run of one model shares: the lm-eval model (made on first need), caches and settings."""

    def __init__(
        self,
        lm,
        model_key: str,
        cache: Path,
        tiny_dir: str | None,
        backend: str,
        limit: int | float | None,
        allow_cpu: bool,
        allow_code_eval: bool,
    ) -> None:
        self.lm, self.tiny_dir, self.backend, self.limit = lm, tiny_dir, backend, limit
        self.allow_cpu, self.allow_code_eval, self.cache = allow_cpu, allow_code_eval, cache
        self.stored = cache / "runs" / hashlib.sha256(model_key.encode()).hexdigest()[:24]
        self.run_info: dict[str, Any] = {}

    def one_run(
        self, suite: str | list[dict[str, Any]], entries: list[dict[str, Any]], run: dict[str, Any]
    ) -> dict[str, Any]:
        """One run: its tasks (those already stored read back), rows, average, tasks not run, results JSON."""
        tasks = build_suite(suite, self.cache, self.tiny_dir, num_fewshot=run.get("num_fewshot"))
        not_run: dict[str, str] = {}
        for e in entries:
            t, reason = self._generative(e, run.get("num_fewshot"))
            if t is None:
                not_run[e["task"]] = reason
            else:
                tasks.append(t)
        limits = {
            t.label: run["limit"]
            if run.get("limit") is not None
            else t.limit
            if t.limit is not None
            else self.limit
            for t in tasks
        }
        keys = {t.label: self._stored_key(t, limits[t.label], run.get("seed")) for t in tasks}
        paths = {label: self.stored / f"{label}-{key[:24]}.json" for label, key in keys.items()}
        stored = {}
        for label, p in paths.items():
            if p.is_file():
                doc, problem = _read_stored(p, keys[label], label)
                if problem is None:
                    stored[label] = doc
                else:
                    print(f"evaluate: cache {p} did not verify ({problem}): recomputed", file=sys.stderr)
        todo = [t for t in tasks if t.label not in stored]
        merged: dict[str, Any] = {}
        hashes: dict[str, str] = {}
        per_item: dict[str, list[dict[str, Any]]] = {}
        if todo:
            self._evaluate(todo, limits, run.get("seed"), merged, hashes, per_item)
        rows = []
        for t in tasks:
            if t.label not in stored:
                items = [per_item[leaf] for leaf in _leaves(merged, t.name) if leaf in per_item]
                stored[t.label] = {
                    "row": _row(t, merged, hashes) | {"items": items},
                    "sections": _sections(merged, t.name),
                }
                _write_json(paths[t.label], _seal({"key": keys[t.label], **stored[t.label]}))
            else:
                _merge(merged, stored[t.label]["sections"])
            rows.append(stored[t.label]["row"])
        heads = [r[r["headline"]] for r in rows if r["headline"]]
        merged["task_hashes"] = {r["task"]: r["task_hash"] for r in rows} | hashes
        merged["moesweep"] = {
            "run": run,
            "not_run": not_run,
            "backend": self.backend,
            "tasks": [
                {
                    "task": t.label,
                    "num_fewshot": t.num_fewshot,
                    "headline": t.headline,
                    "limit": limits[t.label],
                    "config_sha": t.config_sha,
                }
                for t in tasks
            ],
        }
        fresh = {t.label for t in todo}
        return {
            "settings": run,
            "tasks": rows,
            "average": sum(heads) / len(heads) if heads else None,
            "not_run": not_run,
            "reused": [t.label for t in tasks if t.label not in fresh],
            "results_json": merged,
        }

    def _generative(self, entry: dict[str, Any], num_fewshot: int | None) -> tuple[SuiteTask | None, str]:
        """The task, or None and why it cannot run here (its needs unmet, its local data missing)."""
        reason = unmet(GENERATIVE[entry["task"]], entry, self.allow_cpu, self.allow_code_eval)
        if reason:
            return None, reason
        try:
            return build_generative(entry, self.cache, self.tiny_dir, num_fewshot), ""
        except ValueError as e:  # one line: its local data or the tiny corpus is not there
            return None, str(e)

    def _stored_key(self, t: SuiteTask, limit: int | float | None, seed: int | None) -> str:
        """The key of a task's result for these run settings: everything that shapes it (its file name
        holds the first 24 hex digits, the file itself all of them)."""
        blob = json.dumps([t.label, t.config_sha, limit, seed, self.backend, _versions(), _code_sha()])
        return hashlib.sha256(blob.encode()).hexdigest()

    def _evaluate(
        self,
        tasks: list[SuiteTask],
        limits: dict[str, Any],
        seed: int | None,
        merged: dict[str, Any],
        hashes: dict[str, str],
        per_item: dict[str, dict[str, Any]],
    ) -> None:
        import lm_eval
        from lm_eval.tasks import TaskManager

        includes = sorted({t.include_path for t in tasks if t.include_path})
        manager = TaskManager(include_path=includes or None, include_defaults=False)
        seeds = (
            {}
            if seed is None
            else {
                k: seed
                for k in ("random_seed", "numpy_random_seed", "torch_random_seed", "fewshot_random_seed")
            }
        )
        code = any(t.generative and t.generative.executes_code for t in tasks)
        by_limit: dict[Any, list[SuiteTask]] = {}
        for t in tasks:
            by_limit.setdefault(limits[t.label], []).append(t)
        for lim, group in by_limit.items():
            with _code_eval(code and self.allow_code_eval):
                res = lm_eval.simple_evaluate(
                    model=self.lm(),
                    tasks=[t.spec for t in group],
                    task_manager=manager,
                    limit=lim,
                    log_samples=True,
                    confirm_run_unsafe_code=code and self.allow_code_eval,
                    **seeds,
                )
            samples = res.pop("samples", None) or {}
            # when and where it ran differs between identical runs: kept out of the stored results
            self.run_info |= {k: res.pop(k) for k in _VOLATILE if k in res}
            hashes |= {name: _hash_samples(s) for name, s in samples.items()}
            per_item |= {name: item_scores(name, s) for name, s in samples.items()}
            _merge(merged, res)


@functools.cache
def _code_sha() -> str:
    """The evaluation code a stored result was computed with (this module and the suite builder)."""
    here = Path(__file__).parent
    return hashlib.sha256(b"".join((here / f).read_bytes() for f in ("evaluate.py", "suites.py"))).hexdigest()


@functools.cache
def _versions() -> list[str]:
    from importlib.metadata import version

    return [version(p) for p in ("lm_eval", "torch", "transformers")]


def _sections(res: dict[str, Any], name: str) -> dict[str, Any]:
    """The parts of a simple_evaluate result about one task (and its subtasks), to store with its row."""
    names = {name, *_leaves(res, name), *res.get("group_subtasks", {}).get(name, [])}
    return {
        k: {n: v for n, v in res[k].items() if n in names} for k in _SECTIONS if isinstance(res.get(k), dict)
    }


def _digest(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _seal(body: dict[str, Any]) -> dict[str, Any]:
    """`body` as JSON reads it back, with the sha256 of that content (`sha256`) beside it."""
    body = json.loads(json.dumps(body, default=str))
    return {**body, "sha256": _digest(body)}


def _read_stored(path: Path, key: str, label: str) -> tuple[dict[str, Any] | None, str | None]:
    """A stored task result and None, or None and why it is not trusted (one line)."""
    try:
        doc = json.loads(path.read_text())
        problem = _stored_problem(doc, key, label)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        problem = f"unreadable: {type(e).__name__}: {e}".replace("\n", " ")
    return (doc, None) if problem is None else (None, problem)


def _stored_problem(doc: Any, key: str, label: str) -> str | None:
    """Why a stored result is not what was stored for `key` (None: it verifies). Its content hash catches
    an edit, truncation or decay of the file (not one that rewrites the hash too); its key, another run's
    file under this name; and its accuracies are recomputed from its per-item scores, so an edited
    aggregate shows even with the hash rewritten."""
    if not isinstance(doc, dict) or "sha256" not in doc:
        return "no content hash"
    body = {k: v for k, v in doc.items() if k != "sha256"}
    if _digest(body) != doc["sha256"]:
        return "its content does not match its sha256"
    if body.get("key") != key or set(body) != {"key", "row", "sections"}:
        return "it was stored for other settings"
    row = body["row"]
    if row["task"] != label:
        return f"it holds task {row['task']!r}"
    return _items_disagree(row, body["sections"])


def _items_disagree(row: dict[str, Any], sections: dict[str, Any]) -> str | None:
    """Where a row's n, acc or acc_norm (and each leaf's in lm-eval's results) is not what its per-item
    scores give; None when they agree or it has no per-item scores of that metric."""
    items = row.get("items") or []
    if not items:
        return None
    n = sum(len(i["doc_ids"]) for i in items)
    if n != row["n"]:
        return f"n is {row['n']} but it has {n} per-item scores"
    results = sections.get("results", {})
    for m in ("acc", "acc_norm"):
        scores = [i["metrics"].get(m) for i in items]
        if row.get(m) is None or not all(scores) or any(math.isnan(x) for s in scores for x in s):
            continue
        means = [sum(s) / len(s) for s in scores]
        for i, mean in zip(items, means, strict=True):
            leaf = results.get(i["subtask"], {}).get(f"{m},none")
            if leaf is not None and not _close(leaf, mean):
                return f"{i['subtask']} {m} is {leaf} but its per-item scores give {mean}"
        pooled = sum(sum(s) for s in scores) / n
        if not (_close(row[m], pooled) or _close(row[m], sum(means) / len(means))):
            return f"{m} is {row[m]} but its per-item scores give {pooled}"
    return None


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


def _write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, default=str, sort_keys=True))
    tmp.replace(path)


def _make_lm(backend: str, model, tok, batch_size: int, model_path: str | None, workdir: str | None):
    if backend == "hf":
        from lm_eval.models.huggingface import HFLM

        return HFLM(pretrained=model, tokenizer=tok, batch_size=batch_size)
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise ImportError(
            "backend 'vllm' needs the vllm package: install the [gpu] extra "
            "(pip install 'moesweep[gpu]') or use backend 'hf'"
        ) from None
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
    return VLLM(
        pretrained=model_path,
        batch_size=batch_size,
        dtype="auto",
        enable_prefix_caching=False,
        gpu_memory_utilization=round(max(0.1, 0.9 * free / total), 3),
    )


def _hash_samples(samples: list[dict[str, Any]]) -> str:
    """lm-eval's task hash (loggers/evaluation_tracker.py): sha256 over doc+prompt+target hashes."""
    joined = "".join(s["doc_hash"] + s["prompt_hash"] + s["target_hash"] for s in samples)
    return hashlib.sha256(joined.encode()).hexdigest()


def item_scores(subtask: str, samples: list[dict[str, Any]]) -> dict[str, Any]:
    """One leaf task's per-item scores from lm-eval's logged samples, sorted by doc_id: every numeric
    per-sample metric (acc, acc_norm, exact_match, ...) and, for log-likelihood tasks, each choice's
    log-likelihood (`loglik`, ragged: `loglik_doc` repeats the doc_id once per choice). lm-eval logs one
    sample per document and filter: a task with several filters (gsm8k's strict-match and flexible-extract)
    gets each metric per filter, named as lm-eval names its results (`exact_match,strict-match`)."""
    by_filter: dict[str, list[dict[str, Any]]] = {}
    for s in samples:
        by_filter.setdefault(str(s.get("filter", "none")), []).append(s)
    if len(by_filter) > 1:
        parts = {f: item_scores(subtask, [{**s, "filter": f} for s in ss]) for f, ss in by_filter.items()}
        first = next(iter(parts.values()))
        if any(p["doc_ids"] != first["doc_ids"] for p in parts.values()):
            raise ValueError(f"task {subtask!r}: lm-eval's filters logged different documents")
        first["metrics"] = {f"{m},{f}": v for f, p in parts.items() for m, v in p["metrics"].items()}
        return first
    rows = sorted(samples, key=lambda s: int(s["doc_id"]))
    doc_ids = [int(s["doc_id"]) for s in rows]
    if len(set(doc_ids)) != len(doc_ids):
        raise ValueError(
            f"task {subtask!r}: lm-eval logged a doc_id twice; per-item scores need one sample per doc"
        )
    names = [m for m in rows[0].get("metrics", []) if _number(rows[0].get(m))] if rows else []
    metrics = {m: [float(s[m]) if _number(s.get(m)) else math.nan for s in rows] for m in names}
    loglik, loglik_doc = [], []
    for d, s in zip(doc_ids, rows, strict=True):
        for r in s.get("filtered_resps") or []:
            if isinstance(r, list | tuple) and r and _number(r[0]):  # (log-likelihood, is_greedy)
                loglik.append(float(r[0]))
                loglik_doc.append(d)
    return {
        "subtask": subtask,
        "doc_ids": doc_ids,
        "metrics": metrics,
        "loglik": loglik,
        "loglik_doc": loglik_doc,
    }


def _number(v: Any) -> bool:
    return isinstance(v, int | float)  # a bool metric (correct or not) counts as 0 / 1


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
        raise ValueError(
            f"task {t.name!r} reports no {t.headline}; set headline to one of "
            f"{', '.join(m for m in ('acc', 'acc_norm') if m in values) or 'nothing available'}"
        )
    leaves = _leaves(res, t.name)
    n = sum(int(res.get("n-samples", {}).get(leaf, {}).get("effective", 0)) for leaf in leaves)
    shots = res.get("n-shot", {})
    if t.name in hashes:
        task_hash = hashes[t.name]
    elif all(leaf in hashes for leaf in leaves):
        task_hash = hashlib.sha256(
            "".join(f"{leaf}:{hashes[leaf]}" for leaf in sorted(leaves)).encode()
        ).hexdigest()
    else:
        task_hash = t.config_sha
    g = t.generative
    if g and g.score not in values:
        raise ValueError(
            f"generative task {g.name!r}: lm-eval reported no {g.score} (it reported "
            f"{', '.join(sorted(values)) or 'nothing'})"
        )
    return {
        "task": t.label,
        **{m: _finite(values.get(m)) for m in _ACC},
        "n": n,
        "num_fewshot": int(shots.get(t.name, shots.get(leaves[0], t.num_fewshot))),
        "headline": t.headline,
        "task_hash": task_hash,
        "score": g.score if g else None,  # a generative task's score (among `other`)
        "other": {k: v for k, v in sorted(values.items()) if k not in _ACC},
    }


def _finite(v: float | None) -> float | None:
    return v if v is None or math.isfinite(v) else None
