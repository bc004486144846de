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
* generative tasks (``GENERATIVE``), listed apart from the suite (``evaluate.generative``): GSM8K,
  GSM8K-Platinum, MATH, HumanEval, MBPP through lm-eval's ``generate_until`` configs, and ``tiny_gen``
  (the next word of a held-out document, exact match on the first generated word) built from the tiny
  corpus. Each declares what it needs (a GPU, its data, running model-written code); a worker checks
  that before running it (workers/evaluation/evaluate.py) and records an unmet need instead of a number.
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
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

SUITES = ("tiny", "paper")
CUSTOM_FIELDS = ("task", "num_fewshot", "data_dir", "data_files", "split", "headline", "limit")
HEADLINES = ("acc", "acc_norm")
# §4.1 few-shot counts; headline metric as argued in the module docstring
PAPER = (
    ("winogrande", 5, "acc"),
    ("hellaswag", 10, "acc_norm"),
    ("arc_easy", 25, "acc_norm"),
    ("arc_challenge", 25, "acc_norm"),
    ("mmlu", 5, "acc"),
)
DEFAULT_HEADLINE = {name: h for name, _, h in PAPER}
# where lm-eval keeps the paper's tasks (saves indexing every built-in task, ~10 s)
BUILTIN_DIRS = {
    "winogrande": "winogrande",
    "hellaswag": "hellaswag",
    "arc_easy": "arc",
    "arc_challenge": "arc",
    "mmlu": "mmlu/default",
    "gsm8k": "gsm8k",
    "gsm8k_platinum": "gsm8k_platinum",
    "hendrycks_math": "hendrycks_math",
    "humaneval": "humaneval",
    "mbpp": "mbpp",
}
TINY_VERSION = 1  # bump when the tiny task construction changes
CONT_WORDS = 4  # words per tiny_mc choice
N_CHOICES = 4
GEN_FIELDS = ("task", "num_fewshot", "limit", "data_dir", "data_files", "split")
TINY_GEN_TOKS = 8  # tiny_gen: enough tokens for one word of the tiny tokenizer, few enough for a CPU


@dataclass(frozen=True)
class GenerativeTask:
    """A generative task a sweep may list by name: what lm-eval runs, which score is kept, what it needs.

    `requires`: gpu (generation is too slow on CPU for real models; `evaluate.allow_cpu` overrides it for
    small ones), data (the Hugging Face datasets it reads: reachable over the network, in the local cache,
    or given as data_dir/data_files), modules (Hugging Face `evaluate` modules its metric loads)."""

    name: str  # the name a sweep lists and the `task` its rows are stored under
    lm_eval: str | None  # lm-eval task or group name; None for tiny_gen (an inline config)
    metric: str  # lm-eval metric name of the score
    filter: str  # lm-eval filter of the score ("none" when the task has none)
    num_fewshot: int  # lm-eval's own default for the task
    executes_code: bool  # scored by running model-written code (HF_ALLOW_CODE_EVAL + confirm flag)
    requires: dict[str, Any]

    @property
    def score(self) -> str:
        """The stored metric name: lm-eval's metric, with its filter unless that is "none"."""
        return self.metric if self.filter == "none" else f"{self.metric}:{self.filter}"


GENERATIVE = {
    g.name: g
    for g in (
        GenerativeTask(
            "gsm8k",
            "gsm8k",
            "exact_match",
            "strict-match",
            5,
            False,
            {"gpu": True, "data": ("openai/gsm8k",)},
        ),
        GenerativeTask(
            "gsm8k_platinum",
            "gsm8k_platinum",
            "exact_match",
            "strict-match",
            5,
            False,
            {"gpu": True, "data": ("madrylab/gsm8k-platinum",)},
        ),
        GenerativeTask(
            "math",
            "hendrycks_math",
            "exact_match",
            "none",
            0,
            False,
            {"gpu": True, "data": ("EleutherAI/hendrycks_math",)},
        ),
        GenerativeTask(
            "humaneval",
            "humaneval",
            "pass_at_k",
            "create_test",
            0,
            True,
            {"gpu": True, "data": ("openai/openai_humaneval",), "modules": ("evaluate-metric/code_eval",)},
        ),
        GenerativeTask(
            "mbpp",
            "mbpp",
            "pass_at_1",
            "none",
            3,
            True,
            {
                "gpu": True,
                "data": ("google-research-datasets/mbpp",),
                "modules": ("evaluate-metric/code_eval",),
            },
        ),
        GenerativeTask("tiny_gen", None, "exact_match", "first-word", 0, False, {"gpu": True, "data": ()}),
    )
}


@dataclass
class SuiteTask:
    """One entry of a suite: what to hand to TaskManager.load and how to read its result."""

    name: str  # lm-eval task or group name (its key in the results)
    num_fewshot: int
    headline: str | None  # "acc" | "acc_norm"; None for perplexity and generative tasks (not in the average)
    spec: str | dict[str, Any]  # a task/group name found under include_path, or an inline config dict
    include_path: str | None  # folder of generated YAML files to index
    limit: int | float | None  # per-task limit (None: the run's limit)
    config_sha: str  # sha256 of the task definition (generated YAML files or dict, data file hashes)
    generative: GenerativeTask | None = None  # set for a declared generative task

    @property
    def label(self) -> str:
        """The task name rows are stored under (a generative task's declared name, e.g. math)."""
        return self.generative.name if self.generative else self.name


# ---- validation ---------------------------------------------------------------------------------
def validate_suite(suite: str | list[dict[str, Any]]) -> None:
    """Checks a suite value without touching files; one-line ValueError naming the problem."""
    if isinstance(suite, str):
        if suite not in SUITES:
            raise ValueError(
                f"unknown suite {suite!r}: allowed {', '.join(SUITES)} or a list of task entries"
            )
        return
    if not isinstance(suite, list) or not suite:
        raise ValueError(f"suite must be one of {', '.join(SUITES)} or a non-empty list of task entries")
    seen = set()
    for i, e in enumerate(suite):
        if not isinstance(e, dict):
            raise ValueError(f"suite entry {i} must be a mapping with fields {', '.join(CUSTOM_FIELDS)}")
        bad = sorted(set(e) - set(CUSTOM_FIELDS))
        if bad:
            raise ValueError(
                f"suite entry {i}: unknown field(s) {', '.join(bad)}; allowed {', '.join(CUSTOM_FIELDS)}"
            )
        name = e.get("task")
        if not isinstance(name, str) or not name:
            raise ValueError(f"suite entry {i}: task must be an lm-eval task or group name")
        if name in seen:
            raise ValueError(f"suite entry {i}: task {name!r} appears twice")
        seen.add(name)
        if e.get("headline", "acc") not in HEADLINES:
            raise ValueError(
                f"suite entry {name!r}: headline must be one of {', '.join(HEADLINES)}, got {e['headline']!r}"
            )
        _check_fields(e, f"suite entry {name!r}")
        if name in GENERATIVE:
            raise ValueError(f"suite entry {name!r} is a generative task: list it under evaluate.generative")


def _check_fields(e: dict[str, Any], what: str) -> None:
    """The fields suite and generative entries share: num_fewshot, limit, data_dir | data_files, split."""
    nf = e.get("num_fewshot", 0)
    if not isinstance(nf, int) or isinstance(nf, bool) or nf < 0:
        raise ValueError(f"{what}: num_fewshot must be an integer >= 0, got {nf!r}")
    lim = e.get("limit")
    if lim is not None and (isinstance(lim, bool) or not isinstance(lim, int | float) or lim <= 0):
        raise ValueError(f"{what}: limit must be a positive number or null, got {lim!r}")
    if "data_dir" in e and "data_files" in e:
        raise ValueError(f"{what}: give data_dir or data_files, not both")
    df = e.get("data_files")
    if df is not None and not (
        isinstance(df, str)
        or isinstance(df, dict)
        and df
        and all(
            isinstance(v, str) or isinstance(v, list) and all(isinstance(x, str) for x in v)
            for v in df.values()
        )
    ):
        raise ValueError(f"{what}: data_files must be a path or a mapping split -> path(s)")
    if "split" in e and not isinstance(e["split"], str):
        raise ValueError(f"{what}: split must be a split name such as test or validation")


def validate_generative(entries: list[str | dict[str, Any]]) -> list[dict[str, Any]]:
    """Generative task entries (a declared name, or {task, num_fewshot, limit, data_dir | data_files, split})
    as mappings; one-line ValueError naming an unknown task and the declared ones."""
    if not isinstance(entries, list):
        raise ValueError("generative must be a list of task names or entries")
    out, seen = [], set()
    for i, e in enumerate(entries):
        e = {"task": e} if isinstance(e, str) else e
        if not isinstance(e, dict):
            raise ValueError(
                f"generative entry {i} must be a task name or a mapping with fields {', '.join(GEN_FIELDS)}"
            )
        bad = sorted(set(e) - set(GEN_FIELDS))
        if bad:
            raise ValueError(
                f"generative entry {i}: unknown field(s) {', '.join(bad)}; allowed {', '.join(GEN_FIELDS)}"
            )
        name = e.get("task")
        if name not in GENERATIVE:
            raise ValueError(f"unknown generative task {name!r}; allowed: {', '.join(GENERATIVE)}")
        if name in seen:
            raise ValueError(f"generative task {name!r} appears twice")
        seen.add(name)
        if name == "tiny_gen" and ("data_dir" in e or "data_files" in e or "split" in e):
            raise ValueError(
                "generative task 'tiny_gen' is built from the tiny corpus; it takes no data_dir, "
                "data_files or split"
            )
        _check_fields(e, f"generative task {name!r}")
        out.append(e)
    return out


def build_suite(
    suite: str | list[dict[str, Any]],
    cache_dir: str | Path,
    tiny_dir: str | None = None,
    num_fewshot: int | None = None,
) -> list[SuiteTask]:
    """The suite's tasks, with every file they need written under cache_dir. `num_fewshot` (a run's
    setting) replaces every task's few-shot count except the perplexity task's (lm-eval has none there)."""
    validate_suite(suite)
    cache = Path(cache_dir).resolve()
    if suite == "tiny":
        return tiny_tasks(_tiny_dir(tiny_dir, "suite 'tiny'"), cache / "tiny_tasks", num_fewshot=num_fewshot)
    entries = (
        [{"task": n, "num_fewshot": k, "headline": h} for n, k, h in PAPER] if suite == "paper" else suite
    )
    if num_fewshot is not None:
        entries = [e | {"num_fewshot": num_fewshot} for e in entries]
    return [builtin_task(e, cache / "lm_eval_tasks") for e in entries]


def build_generative(
    entry: dict[str, Any], cache_dir: str | Path, tiny_dir: str | None = None, num_fewshot: int | None = None
) -> SuiteTask:
    """One declared generative task (an entry of validate_generative) as a SuiteTask, its files written."""
    g = GENERATIVE[entry["task"]]
    cache = Path(cache_dir).resolve()
    nf = num_fewshot if num_fewshot is not None else entry.get("num_fewshot", g.num_fewshot)
    if g.lm_eval is None:
        t = tiny_gen_task(
            _tiny_dir(tiny_dir, "generative task 'tiny_gen'"), cache / "tiny_tasks", num_fewshot=nf
        )
        return replace(t, limit=entry.get("limit"), generative=g)
    t = builtin_task(
        {k: v for k, v in entry.items()} | {"task": g.lm_eval, "num_fewshot": nf}, cache / "lm_eval_tasks"
    )
    return replace(t, headline=None, generative=g)


def _tiny_dir(tiny_dir: str | None, what: str) -> Path:
    if not tiny_dir:
        raise ValueError(f"{what} needs tiny_dir (the tiny teacher's directory with corpus/test.jsonl)")
    return Path(tiny_dir)


# ---- the tiny suite -----------------------------------------------------------------------------
def _tiny_docs(tiny_dir: Path) -> tuple[bytes, list[dict[str, Any]]]:
    src = Path(tiny_dir) / "corpus" / "test.jsonl"
    if not src.is_file():
        raise ValueError(f"tiny_dir {tiny_dir} has no corpus/test.jsonl (written by the tiny teacher stage)")
    raw = src.read_bytes()
    return raw, [json.loads(line) for line in raw.decode().splitlines() if line.strip()]


def tiny_tasks(
    tiny_dir: Path,
    out: Path,
    n_mc: int = 200,
    n_ppl: int = 64,
    seed: int = 1234,
    num_fewshot: int | None = None,
) -> list[SuiteTask]:
    """tiny_mc and tiny_ppl from tiny_dir/corpus/test.jsonl, as inline lm-eval configs with absolute paths.
    tiny_mc has only a test split: with num_fewshot > 0 lm-eval draws the shots from the other test rows."""
    raw, docs = _tiny_docs(tiny_dir)
    key = _sha(json.dumps([hashlib.sha256(raw).hexdigest(), n_mc, n_ppl, seed, CONT_WORDS, TINY_VERSION]))[
        :16
    ]
    folder = Path(out) / key
    mc_path, ppl_path = folder / "mc.jsonl", folder / "ppl.jsonl"
    if not (mc_path.is_file() and ppl_path.is_file()):
        folder.mkdir(parents=True, exist_ok=True)
        _write_jsonl(mc_path, mc_items(docs, n_mc, seed))
        rng = random.Random(seed)
        keep = sorted(rng.sample(range(len(docs)), min(n_ppl, len(docs))))
        _write_jsonl(ppl_path, [{"text": docs[i]["text"], "domain": docs[i].get("domain", "")} for i in keep])
    mc = {
        "task": "tiny_mc",
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(mc_path)}},
        "test_split": "test",
        "output_type": "multiple_choice",
        "num_fewshot": num_fewshot or 0,
        "doc_to_text": "context",
        "doc_to_choice": "choices",
        "doc_to_target": "label",
        "target_delimiter": "",
        "metric_list": [
            {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
            {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True},
        ],
        "metadata": {"version": TINY_VERSION},
    }
    ppl = {
        "task": "tiny_ppl",
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(ppl_path)}},
        "test_split": "test",
        "output_type": "loglikelihood_rolling",
        "num_fewshot": 0,
        "doc_to_text": "",
        "doc_to_target": "text",
        "metric_list": [
            {"metric": m, "aggregation": a, "higher_is_better": False}
            for m, a in (
                ("word_perplexity", "weighted_perplexity"),
                ("byte_perplexity", "weighted_perplexity"),
                ("bits_per_byte", "bits_per_byte"),
            )
        ],
        "metadata": {"version": TINY_VERSION},
    }
    return [
        SuiteTask(
            cfg["task"],
            cfg["num_fewshot"],
            headline,
            cfg,
            None,
            None,
            _sha(json.dumps(cfg, sort_keys=True) + _file_sha(Path(path))),
        )
        for cfg, headline, path in ((mc, "acc", mc_path), (ppl, None, ppl_path))
    ]


def tiny_gen_task(
    tiny_dir: Path, out: Path, n: int = 100, seed: int = 4321, num_fewshot: int = 0
) -> SuiteTask:
    """tiny_gen: a held-out document cut after a word; the model continues it greedily (TINY_GEN_TOKS tokens)
    and scores when its first generated word is the document's next word (exact match, lm-eval's
    generate_until with a regex filter)."""
    raw, docs = _tiny_docs(tiny_dir)
    key = _sha(json.dumps([hashlib.sha256(raw).hexdigest(), "gen", n, seed, TINY_VERSION]))[:16]
    path = Path(out) / key / "gen.jsonl"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_jsonl(path, gen_items(docs, n, seed))
    cfg = {
        "task": "tiny_gen",
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(path)}},
        "test_split": "test",
        "output_type": "generate_until",
        "num_fewshot": num_fewshot,
        "doc_to_text": "context",
        "doc_to_target": "answer",
        "target_delimiter": "",
        "generation_kwargs": {"until": ["\n\n"], "max_gen_toks": TINY_GEN_TOKS, "do_sample": False},
        "filter_list": [
            {
                "name": "first-word",
                "filter": [{"function": "regex", "regex_pattern": FIRST_WORD}, {"function": "take_first"}],
            }
        ],
        "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
        "metadata": {"version": TINY_VERSION},
    }
    return SuiteTask(
        "tiny_gen",
        num_fewshot,
        None,
        cfg,
        None,
        None,
        _sha(json.dumps(cfg, sort_keys=True) + _file_sha(path)),
    )


FIRST_WORD = r"^\s*(\S+)"  # tiny_gen's answer: the first word the model writes


def gen_items(
    docs: list[dict[str, Any]], n: int, seed: int, min_ctx: int = 8, max_ctx: int = 40
) -> list[dict[str, Any]]:
    """Rows {context, answer, source}: context = a document up to the end of a word, answer = its next word."""
    rng = random.Random(seed)
    order = list(range(len(docs)))
    rng.shuffle(order)
    rows = []
    for i in order:
        spans = [m.span() for m in re.finditer(r"\S+", docs[i]["text"])]
        if len(spans) <= min_ctx:
            continue
        cut = rng.randint(min_ctx, min(max_ctx, len(spans) - 1))
        a, b = spans[cut]
        rows.append(
            {
                "context": docs[i]["text"][: spans[cut - 1][1]],
                "answer": docs[i]["text"][a:b],
                "source": [i, a, b],
                "domain": docs[i].get("domain", ""),
            }
        )
        if len(rows) == n:
            break
    if not rows:
        raise ValueError(f"the test corpus has no document of more than {min_ctx} words for tiny_gen")
    return rows


def mc_items(
    docs: list[dict[str, Any]],
    n: int,
    seed: int,
    cont_words: int = CONT_WORDS,
    min_ctx: int = 8,
    max_ctx: int = 40,
) -> list[dict[str, Any]]:
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
        context = text[: spans[i][cut - 1][1]]
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
        rows.append(
            {
                "context": context,
                "choices": [docs[j]["text"][a:b] for j, a, b in choices],
                "label": label,
                "sources": [list(c) for c in choices],
                "domain": docs[i].get("domain", ""),
            }
        )
        if len(rows) == n:
            break
    if not rows:
        raise ValueError(
            f"the test corpus has too few documents of >= {min_ctx + cont_words} words for tiny_mc"
        )
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
        raise ValueError(
            f"task {name!r} is a group of {len(leaves)} tasks: use data_dir with one folder per "
            "subtask (named by its dataset_name or task name), not data_files"
        )
    files: dict[str, dict[str, Any]] = {}
    for leaf in leaves:
        over: dict[str, Any] = {"include": str(index[leaf].yaml_path), "task": leaf, "num_fewshot": nf}
        if data != (None, None):
            over |= _local_data(name, leaf, index[leaf].cfg or {}, entry, nf)
        files[f"{leaf}.yaml"] = over
    for g in groups:
        files[f"{g}.yaml"] = {"include": str(index[g].yaml_path)}
    text = json.dumps(files, sort_keys=True)
    data_shas = sorted(
        _file_sha(Path(p))
        for f in files.values()
        for ps in (f.get("dataset_kwargs") or {}).get("data_files", {}).values()
        for p in (ps if isinstance(ps, list) else [ps])
    )
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
                hits = [
                    folder / f"{split}{ext}"
                    for ext in (".jsonl", ".json")
                    if (folder / f"{split}{ext}").is_file()
                ]
                if hits:
                    found[split] = [str(hits[0])]
                    break
    if eval_split not in found:
        raise ValueError(
            f"task {leaf!r}: no local file for its evaluation split {eval_split!r} (expected "
            f"{eval_split}.jsonl or {eval_split}.json in data_dir, a data_files entry, or set split)"
        )
    for key, split in splits.items():
        if split and split not in found:
            splits[key] = None
    shots = splits["fewshot_split"] or splits["training_split"] or splits["validation_split"]
    if nf > 0 and (shots is None or shots == eval_split):
        raise ValueError(
            f"task {leaf!r}: num_fewshot {nf} needs a local few-shot split "
            f"({cfg.get('fewshot_split') or cfg.get('training_split')!r}) besides {eval_split!r}"
        )
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
        raise ValueError(
            f"unknown lm-eval task {name!r}; paper tasks: {', '.join(BUILTIN_DIRS)}"
            + (f"; similar names: {', '.join(near)}" if near else "")
        )
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
                    raise ValueError(
                        f"group {n!r} defines inline tasks; only groups of named tasks are supported"
                    )
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
