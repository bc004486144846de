"""Evaluation suites: what `evaluate.suite` in a sweep file names, turned into lm-eval task specs.

* "tiny": two local tasks built from the held-out corpus (tiny_dir/corpus/test.jsonl): a 4-way
  multiple-choice task (``tiny_mc``: context = a document prefix cut at a word boundary, correct
  choice = the next CONT_WORDS words, distractors = word spans of the same length from other test
  documents of the same domain) and a rolling-loglikelihood task (``tiny_ppl``: word/byte
  perplexity and bits per byte on whole test documents).
* "paper" (§4.1): Winogrande 5-shot, HellaSwag 10, ARC-Easy 25, ARC-Challenge 25, MMLU 5, with lm-eval's
  built-in task configs. The paper does not say acc or acc_norm; it follows Minitron (Muralidharan et
  al. 2024), which uses the Open LLM Leaderboard convention, so the headline is acc for Winogrande and
  MMLU and acc_norm for HellaSwag and both ARC sets (the paper's teacher HellaSwag 82.0 is an acc_norm
  value). Both metrics are stored either way.
* a custom list: entries {task, num_fewshot, data_dir | data_files, split, headline, limit}. ``task`` is an
  lm-eval built-in task or group name; with data_dir/data_files its own config is used with the data
  read from local JSON/JSONL files that have the HF dataset's field names (an offline copy).

Every built-in task is loaded through a generated YAML file that includes lm-eval's own file and sets
num_fewshot (and the local data): per-task few-shot counts never go through simple_evaluate's global
override. Generated files live under ``cache_dir/lm_eval_tasks`` and are indexed with
``TaskManager(include_path=..., include_defaults=False)``, so evaluation never scans all built-in tasks.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

SUITES = ("tiny", "paper")
CUSTOM_FIELDS = ("task", "num_fewshot", "data_dir", "data_files", "split", "headline", "limit")
HEADLINES = ("acc", "acc_norm")
# §4.1 few-shot counts; headline metric as argued in the module docstring
PAPER = (("winogrande", 5, "acc"), ("hellaswag", 10, "acc_norm"), ("arc_easy", 25, "acc_norm"),
         ("arc_challenge", 25, "acc_norm"), ("mmlu", 5, "acc"))
DEFAULT_HEADLINE = {name: h for name, _, h in PAPER}
# where lm-eval keeps the paper's tasks (saves indexing every built-in task, ~10 s)
BUILTIN_DIRS = {"winogrande": "winogrande", "hellaswag": "hellaswag", "arc_easy": "arc",
                "arc_challenge": "arc", "mmlu": "mmlu/default"}
TINY_VERSION = 1  # bump when the tiny task construction changes
CONT_WORDS = 4  # words per tiny_mc choice
N_CHOICES = 4


@dataclass
class SuiteTask:
    """One entry of a suite: what to hand to TaskManager.load and how to read its result."""

    name: str  # lm-eval task or group name (its key in the results)
    num_fewshot: int
    headline: str | None  # "acc" | "acc_norm"; None for perplexity tasks (not in the average)
    spec: str | dict[str, Any]  # a task/group name found under include_path, or an inline config dict
    include_path: str | None  # folder of generated YAML files to index
    limit: int | float | None  # per-task limit (None: the run's limit)
    config_sha: str  # sha256 of the task definition (generated YAML files or dict, data file hashes)


# ---- validation ---------------------------------------------------------------------------------
def validate_suite(suite: str | list[dict[str, Any]]) -> None:
    """Checks a suite value without touching files; one-line ValueError naming the problem."""
    if isinstance(suite, str):
        if suite not in SUITES:
            raise ValueError(f"unknown suite {suite!r}: allowed {', '.join(SUITES)} or a list of task entries")
        return
    if not isinstance(suite, list) or not suite:
        raise ValueError(f"suite must be one of {', '.join(SUITES)} or a non-empty list of task entries")
    seen = set()
    for i, e in enumerate(suite):
        if not isinstance(e, dict):
            raise ValueError(f"suite entry {i} must be a mapping with fields {', '.join(CUSTOM_FIELDS)}")
        bad = sorted(set(e) - set(CUSTOM_FIELDS))
        if bad:
            raise ValueError(f"suite entry {i}: unknown field(s) {', '.join(bad)}; allowed {', '.join(CUSTOM_FIELDS)}")
        name = e.get("task")
        if not isinstance(name, str) or not name:
            raise ValueError(f"suite entry {i}: task must be an lm-eval task or group name")
        if name in seen:
            raise ValueError(f"suite entry {i}: task {name!r} appears twice")
        seen.add(name)
        nf = e.get("num_fewshot", 0)
        if not isinstance(nf, int) or isinstance(nf, bool) or nf < 0:
            raise ValueError(f"suite entry {name!r}: num_fewshot must be an integer >= 0, got {nf!r}")
        if e.get("headline", "acc") not in HEADLINES:
            raise ValueError(f"suite entry {name!r}: headline must be one of {', '.join(HEADLINES)}, got {e['headline']!r}")
        lim = e.get("limit")
        if lim is not None and (isinstance(lim, bool) or not isinstance(lim, int | float) or lim <= 0):
            raise ValueError(f"suite entry {name!r}: limit must be a positive number or null, got {lim!r}")
        if "data_dir" in e and "data_files" in e:
            raise ValueError(f"suite entry {name!r}: give data_dir or data_files, not both")
        df = e.get("data_files")
        if df is not None and not (isinstance(df, str) or isinstance(df, dict) and df and all(
                isinstance(v, str) or isinstance(v, list) and all(isinstance(x, str) for x in v) for v in df.values())):
            raise ValueError(f"suite entry {name!r}: data_files must be a path or a mapping split -> path(s)")
        if "split" in e and not isinstance(e["split"], str):
            raise ValueError(f"suite entry {name!r}: split must be a split name such as test or validation")


def build_suite(suite: str | list[dict[str, Any]], cache_dir: str | Path, tiny_dir: str | None = None) -> list[SuiteTask]:
    """The suite's tasks, with every file they need written under cache_dir."""
    validate_suite(suite)
    cache = Path(cache_dir).resolve()
    if suite == "tiny":
        if not tiny_dir:
            raise ValueError("suite 'tiny' needs tiny_dir (the tiny teacher's directory with corpus/test.jsonl)")
        return tiny_tasks(Path(tiny_dir), cache / "tiny_tasks")
    entries = [{"task": n, "num_fewshot": k, "headline": h} for n, k, h in PAPER] if suite == "paper" else suite
    return [builtin_task(e, cache / "lm_eval_tasks") for e in entries]


# ---- the tiny suite -----------------------------------------------------------------------------
def tiny_tasks(tiny_dir: Path, out: Path, n_mc: int = 200, n_ppl: int = 64, seed: int = 1234) -> list[SuiteTask]:
    """tiny_mc and tiny_ppl from tiny_dir/corpus/test.jsonl, as inline lm-eval configs with absolute paths."""
    src = Path(tiny_dir) / "corpus" / "test.jsonl"
    if not src.is_file():
        raise ValueError(f"tiny_dir {tiny_dir} has no corpus/test.jsonl (written by the tiny teacher stage)")
    raw = src.read_bytes()
    docs = [json.loads(line) for line in raw.decode().splitlines() if line.strip()]
    key = _sha(json.dumps([hashlib.sha256(raw).hexdigest(), n_mc, n_ppl, seed, CONT_WORDS, TINY_VERSION]))[:16]
    folder = Path(out) / key
    mc_path, ppl_path = folder / "mc.jsonl", folder / "ppl.jsonl"
    if not (mc_path.is_file() and ppl_path.is_file()):
        folder.mkdir(parents=True, exist_ok=True)
        _write_jsonl(mc_path, mc_items(docs, n_mc, seed))
        rng = random.Random(seed)
        keep = sorted(rng.sample(range(len(docs)), min(n_ppl, len(docs))))
        _write_jsonl(ppl_path, [{"text": docs[i]["text"], "domain": docs[i].get("domain", "")} for i in keep])
    mc = {
        "task": "tiny_mc", "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(mc_path)}},
        "test_split": "test", "output_type": "multiple_choice", "num_fewshot": 0,
        "doc_to_text": "context", "doc_to_choice": "choices", "doc_to_target": "label", "target_delimiter": "",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                        {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True}],
        "metadata": {"version": TINY_VERSION},
    }
    ppl = {
        "task": "tiny_ppl", "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(ppl_path)}},
        "test_split": "test", "output_type": "loglikelihood_rolling", "num_fewshot": 0,
        "doc_to_text": "", "doc_to_target": "text",
        "metric_list": [{"metric": m, "aggregation": a, "higher_is_better": False} for m, a in
                        (("word_perplexity", "weighted_perplexity"), ("byte_perplexity", "weighted_perplexity"),
                         ("bits_per_byte", "bits_per_byte"))],
        "metadata": {"version": TINY_VERSION},
    }
    return [SuiteTask(cfg["task"], 0, headline, cfg, None, None,
                      _sha(json.dumps(cfg, sort_keys=True) + _file_sha(Path(path))))
            for cfg, headline, path in ((mc, "acc", mc_path), (ppl, None, ppl_path))]


def mc_items(docs: list[dict[str, Any]], n: int, seed: int, cont_words: int = CONT_WORDS,
             min_ctx: int = 8, max_ctx: int = 40) -> list[dict[str, Any]]:
    """Multiple-choice rows {context, choices, label, sources}; every cut is at a word boundary.

    context = doc[:end of word i-1]; correct = doc[end of word i-1 : end of word i+cont_words-1] (so it
    starts with the document's own whitespace); each distractor is such a span from another document
    of the same domain. sources[j] = [doc index, start, end] of choice j, for checking.
    """
    spans = [[m.span() for m in re.finditer(r"\S+", d["text"])] for d in docs]
    by_domain: dict[str, list[int]] = {}
    for i, s in enumerate(spans):
        if len(s) > cont_words:
            by_domain.setdefault(docs[i].get("domain", ""), []).append(i)
    rng = random.Random(seed)
    order = [i for i in range(len(docs)) if len(spans[i]) >= min_ctx + cont_words]
    rng.shuffle(order)
    rows = []
    for i in order:
        pool = [j for j in by_domain.get(docs[i].get("domain", ""), []) if j != i]
        if len(pool) < N_CHOICES - 1:
            pool = [j for js in by_domain.values() for j in js if j != i]
        if len(pool) < N_CHOICES - 1:
            continue
        cut = rng.randint(min_ctx, min(max_ctx, len(spans[i]) - cont_words))
        text = docs[i]["text"]
        context = text[:spans[i][cut - 1][1]]
        correct = (i, spans[i][cut - 1][1], spans[i][cut + cont_words - 1][1])
        choices = [correct]
        for j in rng.sample(pool, len(pool)):
            k = rng.randint(1, len(spans[j]) - cont_words)
            cand = (j, spans[j][k - 1][1], spans[j][k + cont_words - 1][1])
            if _words(docs, cand) not in {_words(docs, c) for c in choices}:
                choices.append(cand)
            if len(choices) == N_CHOICES:
                break
        if len(choices) < N_CHOICES:
            continue
        label = rng.randrange(N_CHOICES)
        choices[0], choices[label] = choices[label], choices[0]
        rows.append({"context": context, "choices": [docs[j]["text"][a:b] for j, a, b in choices], "label": label,
                     "sources": [list(c) for c in choices], "domain": docs[i].get("domain", "")})
        if len(rows) == n:
            break
    if not rows:
        raise ValueError(f"the test corpus has too few documents of >= {min_ctx + cont_words} words for tiny_mc")
    return rows


def _words(docs: list[dict[str, Any]], span: tuple[int, int, int]) -> str:
    j, a, b = span
    return " ".join(docs[j]["text"][a:b].split())


# ---- built-in lm-eval tasks (the paper suite and custom lists) ----------------------------------
def builtin_task(entry: dict[str, Any], out: Path) -> SuiteTask:
    """A built-in task/group with its few-shot count (and, for an offline copy, local data) as YAML overrides."""
    name, nf = entry["task"], int(entry.get("num_fewshot", 0))
    index = _builtin_index(name)
    leaves, groups = _members(index, name)
    data = entry.get("data_dir"), entry.get("data_files")
    if data[1] is not None and len(leaves) > 1:
        raise ValueError(f"task {name!r} is a group of {len(leaves)} tasks: use data_dir with one folder per "
                         "subtask (named by its dataset_name or task name), not data_files")
    files: dict[str, dict[str, Any]] = {}
    for leaf in leaves:
        over: dict[str, Any] = {"include": str(index[leaf].yaml_path), "task": leaf, "num_fewshot": nf}
        if data != (None, None):
            over |= _local_data(name, leaf, index[leaf].cfg or {}, entry, nf)
        files[f"{leaf}.yaml"] = over
    for g in groups:
        files[f"{g}.yaml"] = {"include": str(index[g].yaml_path)}
    text = json.dumps(files, sort_keys=True)
    data_shas = sorted(_file_sha(Path(p)) for f in files.values()
                       for ps in (f.get("dataset_kwargs") or {}).get("data_files", {}).values()
                       for p in (ps if isinstance(ps, list) else [ps]))
    sha = _sha(text + json.dumps(data_shas) + _lm_eval_version())
    folder = Path(out) / f"{name}-{sha[:16]}"
    if not folder.is_dir():
        tmp = folder.with_name(f"{folder.name}.{os.getpid()}.tmp")
        tmp.mkdir(parents=True, exist_ok=True)
        for fname, cfg in files.items():
            (tmp / fname).write_text(yaml.safe_dump(cfg, sort_keys=True))
        try:
            tmp.rename(folder)
        except OSError:  # another worker wrote the same folder first
            shutil.rmtree(tmp, ignore_errors=True)
    headline = entry.get("headline", DEFAULT_HEADLINE.get(name, "acc"))
    return SuiteTask(name, nf, headline, name, str(folder), entry.get("limit"), sha)


def _local_data(name: str, leaf: str, cfg: dict[str, Any], entry: dict[str, Any], nf: int) -> dict[str, Any]:
    """Overrides that point one built-in task at local JSON/JSONL files with the HF field names."""
    splits = {k: cfg.get(k) for k in ("training_split", "validation_split", "test_split", "fewshot_split")}
    eval_key = "test_split" if splits["test_split"] else "validation_split"
    if entry.get("split"):
        splits["test_split"], eval_key = entry["split"], "test_split"
    eval_split = splits[eval_key]
    found: dict[str, list[str]] = {}
    if entry.get("data_files") is not None:
        df = entry["data_files"]
        df = {eval_split: df} if isinstance(df, str) else df
        for split, paths in df.items():
            found[split] = [_existing(name, p) for p in ([paths] if isinstance(paths, str) else paths)]
    else:
        root = Path(entry["data_dir"]).expanduser().resolve()
        if not root.is_dir():
            raise ValueError(f"task {name!r}: data_dir {root} is not a folder")
        folders = [root / d for d in (cfg.get("dataset_name"), leaf) if d] + [root]
        for split in {s for s in splits.values() if s}:
            for folder in folders:
                hits = [folder / f"{split}{ext}" for ext in (".jsonl", ".json") if (folder / f"{split}{ext}").is_file()]
                if hits:
                    found[split] = [str(hits[0])]
                    break
    if eval_split not in found:
        raise ValueError(f"task {leaf!r}: no local file for its evaluation split {eval_split!r} (expected "
                         f"{eval_split}.jsonl or {eval_split}.json in data_dir, a data_files entry, or set split)")
    for key, split in splits.items():
        if split and split not in found:
            splits[key] = None
    shots = splits["fewshot_split"] or splits["training_split"] or splits["validation_split"]
    if nf > 0 and (shots is None or shots == eval_split):
        raise ValueError(f"task {leaf!r}: num_fewshot {nf} needs a local few-shot split "
                         f"({cfg.get('fewshot_split') or cfg.get('training_split')!r}) besides {eval_split!r}")
    return {"dataset_path": "json", "dataset_name": None, "dataset_kwargs": {"data_files": found}, **splits}


@functools.cache
def _builtin_index(name: str) -> dict[str, Any]:
    """lm-eval's index entries of the built-in folder holding `name` (only that folder when known)."""
    import lm_eval.tasks
    from lm_eval.tasks import TaskManager

    root = Path(lm_eval.tasks.__file__).parent
    if name in BUILTIN_DIRS:
        return TaskManager(include_path=str(root / BUILTIN_DIRS[name]), include_defaults=False).task_index
    index = _all_builtins()
    if name not in index:
        near = sorted(n for n in index if n.startswith(name[:4]))[:8]
        raise ValueError(f"unknown lm-eval task {name!r}; paper tasks: {', '.join(BUILTIN_DIRS)}"
                         + (f"; similar names: {', '.join(near)}" if near else ""))
    return index


@functools.lru_cache(maxsize=1)
def _all_builtins() -> dict[str, Any]:
    from lm_eval.tasks import TaskManager

    return TaskManager().task_index


def _members(index: dict[str, Any], name: str) -> tuple[list[str], list[str]]:
    """(leaf tasks, groups) reachable from name: groups by their task lists, tags by their members."""
    from lm_eval.tasks._index import Kind

    leaves: list[str] = []
    groups: list[str] = []

    def walk(n: str) -> None:
        e = index.get(n)
        if e is None:
            raise ValueError(f"lm-eval task {n!r} (part of {name!r}) is not in lm-eval's index")
        if e.kind == Kind.GROUP:
            groups.append(n)
            items = (e.cfg or {}).get("task", [])
            for item in items if isinstance(items, list) else [items]:
                if isinstance(item, dict):
                    raise ValueError(f"group {n!r} defines inline tasks; only groups of named tasks are supported")
                walk(item)
        elif e.kind == Kind.TAG:
            for t in sorted(e.tags):
                walk(t)
        elif e.kind == Kind.TASK:
            if n not in leaves:
                leaves.append(n)
        else:
            raise ValueError(f"lm-eval task {n!r} is a Python class task; only YAML tasks are supported")

    walk(name)
    return leaves, groups


# ---- small helpers -------------------------------------------------------------------------------
def _existing(name: str, path: str) -> str:
    p = Path(path).expanduser().resolve()
    if not p.is_file():
        raise ValueError(f"task {name!r}: data file {p} does not exist")
    return str(p)


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    tmp.replace(path)


def _file_sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _lm_eval_version() -> str:
    from importlib.metadata import version

    return version("lm_eval")
