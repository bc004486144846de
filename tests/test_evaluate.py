"""workers.evaluation.suites and workers.evaluation.evaluate: suites built offline, run through lm-eval's simple_evaluate on tiny models."""

from __future__ import annotations

import inspect
import json
import math
import shutil
import sys
from functools import partial
from pathlib import Path

import pytest
import torch
import yaml
from tiny_qwen3 import dense_qwen3

from workers.evaluation.evaluate import run_suite
from workers.evaluation.ppl import perplexity
from workers.evaluation.suites import PAPER, build_suite, validate_suite
from workers.tiny.tokenizer import train_tokenizer

MODULES = ("json", "textwrap", "string", "shlex", "fnmatch", "glob", "heapq", "bisect", "difflib", "base64")


def documents() -> list[dict]:
    """Held-out-corpus-like rows: docstrings (prose) and function sources (code) from the standard library."""
    import importlib

    prose, code = [], []
    for name in MODULES:
        mod = importlib.import_module(name)
        for _, obj in sorted(vars(mod).items()):
            if inspect.isfunction(obj) and obj.__module__ == name:
                doc = inspect.getdoc(obj) or ""
                if len(doc.split()) >= 16:
                    prose.append({"text": doc, "domain": "prose"})
                src = inspect.getsource(obj)
                if 200 < len(src) < 1500:
                    code.append({"text": src, "domain": "code"})
    # distinct endings: lm-eval 0.4.13 mis-scores rolling windows whose whole input repeats with another
    # continuation length (its logits cache gathers the leading, not trailing, positions), e.g. json.dump/dumps
    out, tails = [], set()
    for row in prose[:40] + code[:20]:
        if row["text"][-400:] not in tails:
            tails.add(row["text"][-400:])
            out.append(row)
    return out


def corpus_dir(tmp_path_factory, name: str, rows: list[dict]) -> Path:
    """A fresh tiny_dir whose corpus/test.jsonl holds `rows` (what the tiny suites are built from)."""
    d = tmp_path_factory.mktemp(name)
    (d / "corpus").mkdir()
    (d / "corpus" / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return corpus_dir(tmp_path_factory, "tiny", documents())


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return train_tokenizer([r["text"] for r in documents()], 512, tmp_path_factory.mktemp("tok"))


def dense(tok, seed: int):
    return dense_qwen3(len(tok), seed, max_positions=256)


@pytest.fixture(scope="module")
def model(tok):
    return dense(tok, 0)


def run(
    model, tok, suite, cache, key="model-a", tiny_dir=None, limit=None, batch_size=8, backend="hf", **kwargs
):
    """run_suite with `cache` as both its cache and its working folder (extra keywords: run_suite's own)."""
    return run_suite(
        model,
        tok,
        suite,
        model_key=key,
        cache_dir=str(cache),
        tiny_dir=str(tiny_dir) if tiny_dir else None,
        batch_size=batch_size,
        backend=backend,
        limit=limit,
        model_path=None,
        workdir=str(cache),
        **kwargs,
    )


# ---- the tiny suite --------------------------------------------------------------------------------
def test_tiny_suite_builds_word_boundary_choices(tiny_dir, tmp_path):
    docs = [json.loads(line) for line in (tiny_dir / "corpus" / "test.jsonl").read_text().splitlines()]
    mc, ppl = build_suite("tiny", tmp_path, str(tiny_dir))
    assert (mc.name, mc.headline, ppl.name, ppl.headline) == ("tiny_mc", "acc", "tiny_ppl", None)
    path = Path(mc.spec["dataset_kwargs"]["data_files"]["test"])
    assert path.is_absolute() and mc.spec["output_type"] == "multiple_choice"
    assert ppl.spec["output_type"] == "loglikelihood_rolling"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) >= 40
    for r in rows:
        assert len(r["choices"]) == 4 and 0 <= r["label"] < 4
        assert len({" ".join(c.split()) for c in r["choices"]}) == 4
        i, a, b = r["sources"][r["label"]]
        assert docs[i]["text"].startswith(r["context"] + r["choices"][r["label"]]), (
            "the correct choice continues the doc"
        )
        assert not r["context"][-1].isspace()
        for (j, a, b), choice in zip(r["sources"], r["choices"], strict=True):
            text = docs[j]["text"]
            assert text[a:b] == choice and choice[0].isspace() and len(choice.split()) == 4
            assert not text[a - 1].isspace() and (b == len(text) or text[b].isspace()), (
                "cut at word boundaries"
            )
            assert docs[j]["domain"] == docs[i]["domain"]
        assert len({j for j, _, _ in r["sources"]}) == 4, "distractors come from other documents"
    again = build_suite("tiny", tmp_path / "other", str(tiny_dir))
    assert (
        Path(again[0].spec["dataset_kwargs"]["data_files"]["test"]).read_bytes() == path.read_bytes()
    )  # seeded
    ppl_rows = [
        json.loads(line)
        for line in Path(ppl.spec["dataset_kwargs"]["data_files"]["test"]).read_text().splitlines()
    ]
    assert {r["text"] for r in ppl_rows} <= {d["text"] for d in docs}


def lm_eval_choice_ll(model, tok, context: str, choice: str, max_len: int) -> float:
    """log p(choice | context) the way lm-eval's HF backend encodes and truncates a causal request."""
    whole = tok(context + choice)["input_ids"]
    n_ctx = len(tok(context)["input_ids"])
    seq = whole[-(max_len + 1) :]
    n = len(whole) - n_ctx
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([seq[:-1]])).logits[0], -1)
    return float(logp[torch.arange(len(seq) - 1 - n, len(seq) - 1), torch.tensor(seq[-n:])].sum())


def test_tiny_suite_runs_and_matches_direct_scoring(model, tok, tiny_dir, tmp_path):
    n = 16
    res = run(model, tok, "tiny", tmp_path, tiny_dir=tiny_dir, limit=n)
    mc, ppl = res["tasks"]
    assert mc["task"] == "tiny_mc" and mc["n"] == n and mc["num_fewshot"] == 0 and mc["headline"] == "acc"
    assert mc["acc_stderr"] > 0 and mc["acc_norm_stderr"] > 0
    rows = [
        json.loads(line)
        for line in Path(
            build_suite("tiny", tmp_path, str(tiny_dir))[0].spec["dataset_kwargs"]["data_files"]["test"]
        )
        .read_text()
        .splitlines()
    ]
    max_len = res["results_json"]["max_length"]
    acc = acc_norm = 0
    for r in rows[:n]:
        lls = [lm_eval_choice_ll(model, tok, r["context"], c, max_len) for c in r["choices"]]
        norm = [ll / len(c) for ll, c in zip(lls, r["choices"], strict=True)]
        acc += lls.index(max(lls)) == r["label"]
        acc_norm += norm.index(max(norm)) == r["label"]
    assert acc != acc_norm, "the rows must tell acc and acc_norm apart for this check to mean anything"
    assert mc["acc"] == pytest.approx(acc / n) and mc["acc_norm"] == pytest.approx(acc_norm / n)
    assert res["average"] == pytest.approx(mc["acc"]), (
        "the perplexity task has no headline and stays out of the average"
    )

    assert ppl["acc"] is None and ppl["n"] == n and ppl["headline"] is None
    assert set(ppl["other"]) == {"word_perplexity", "byte_perplexity", "bits_per_byte"}
    # lm-eval's bits_per_byte = our rolling-window Σ NLL over the same documents / bytes / ln 2
    texts = [
        json.loads(line)["text"]
        for line in Path(
            build_suite("tiny", tmp_path, str(tiny_dir))[1].spec["dataset_kwargs"]["data_files"]["test"]
        )
        .read_text()
        .splitlines()[:n]
    ]
    nll = sum(
        perplexity(
            model, tok, [t], seq_len=max_len, batch_size=4, add_bos=True, device="cpu", windows="rolling"
        )["sum_nll"]
        for t in texts
    )
    n_bytes = sum(len(t.encode()) for t in texts)
    assert ppl["other"]["bits_per_byte"] == pytest.approx(nll / n_bytes / math.log(2), rel=1e-5)
    assert ppl["other"]["byte_perplexity"] == pytest.approx(math.exp(nll / n_bytes), rel=1e-5)

    assert all(len(t["task_hash"]) == 64 for t in res["tasks"]) and res["backend"] == "hf"
    import lm_eval

    assert res["lm_eval_version"] == lm_eval.__version__
    rj = res["results_json"]
    assert "samples" not in rj and set(rj["task_hashes"]) >= {"tiny_mc", "tiny_ppl"}
    json.dumps(rj, default=str)  # storable as the artifact
    # when and where it ran is kept apart: the stored results of identical runs are identical files
    assert not {"date", "start_time", "end_time", "total_evaluation_time_seconds", "git_hash"} & set(rj)
    assert "date" in res["run_info"]
    shutil.rmtree(tmp_path / "runs")  # computed afresh, not read back
    again = run(model, tok, "tiny", tmp_path, tiny_dir=tiny_dir, limit=n)
    assert again["runs"][0]["reused"] == []
    assert json.dumps(again["results_json"], sort_keys=True, default=str) == json.dumps(
        rj, sort_keys=True, default=str
    )


def test_stored_results_are_keyed_by_model_key(model, tok, tiny_dir, tmp_path):
    other = dense(tok, 7)
    a = run(model, tok, "tiny", tmp_path, key="model-a", tiny_dir=tiny_dir, limit=4)
    same_key = run(other, tok, "tiny", tmp_path, key="model-a", tiny_dir=tiny_dir, limit=4)
    own_key = run(other, tok, "tiny", tmp_path, key="model-b", tiny_dir=tiny_dir, limit=4)
    bpb = [r["tasks"][1]["other"]["bits_per_byte"] for r in (a, same_key, own_key)]
    assert bpb[1] == bpb[0], "same key: read back from the stored results"
    assert bpb[2] != bpb[0], "another key: the other model is really evaluated"
    assert len(list((tmp_path / "runs").iterdir())) == 2
    assert not (tmp_path / "responses").exists(), "no lm-eval response cache (pickles) under cache_dir"


# ---- offline copies of real benchmarks --------------------------------------------------------------
WINO = [
    {
        "sentence": "The trophy does not fit into the suitcase because the _ is too large.",
        "option1": "trophy",
        "option2": "suitcase",
        "answer": "1",
    },
    {
        "sentence": "The trophy does not fit into the suitcase because the _ is too small.",
        "option1": "trophy",
        "option2": "suitcase",
        "answer": "2",
    },
    {
        "sentence": "Anna poured water from the bottle into the cup until the _ was full.",
        "option1": "bottle",
        "option2": "cup",
        "answer": "2",
    },
    {
        "sentence": "Anna poured water from the bottle into the cup until the _ was empty.",
        "option1": "bottle",
        "option2": "cup",
        "answer": "1",
    },
    {
        "sentence": "Sam lent his umbrella to Tom because _ was going out into the rain.",
        "option1": "Sam",
        "option2": "Tom",
        "answer": "2",
    },
]
ARC = [
    {
        "id": "q1",
        "question": "Which gas do green plants take in from the air to make food?",
        "choices": {"text": ["oxygen", "carbon dioxide", "helium", "neon"], "label": ["A", "B", "C", "D"]},
        "answerKey": "B",
    },
    {
        "id": "q2",
        "question": "Which of these will melt an ice cube fastest?",
        "choices": {
            "text": ["a warm hand", "a freezer", "a shadow", "a cold plate"],
            "label": ["A", "B", "C", "D"],
        },
        "answerKey": "A",
    },
    {
        "id": "q3",
        "question": "How many legs does a spider have?",
        "choices": {"text": ["six", "eight", "ten"], "label": ["1", "2", "3"]},
        "answerKey": "2",
    },
    {
        "id": "q4",
        "question": "What force pulls a dropped ball toward the ground?",
        "choices": {"text": ["magnetism", "friction", "gravity", "wind"], "label": ["A", "B", "C", "D"]},
        "answerKey": "C",
    },
]


def write(path: Path, rows: list[dict], as_array: bool = False) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows) if as_array else "".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_offline_winogrande_and_arc_with_per_task_fewshot(model, tok, tmp_path):
    data = tmp_path / "data"
    write(data / "wino" / "train.jsonl", WINO[2:])
    write(data / "wino" / "validation.jsonl", WINO)
    arc_train = write(data / "arc" / "train.json", ARC[::-1], as_array=True)
    arc_test = write(data / "arc" / "test.jsonl", ARC)
    write(data / "challenge" / "ARC-Challenge" / "train.jsonl", ARC[1:])  # HF layout: one folder per config
    write(data / "challenge" / "ARC-Challenge" / "test.jsonl", ARC)
    suite = [
        {"task": "winogrande", "num_fewshot": 2, "data_dir": str(data / "wino")},
        {
            "task": "arc_easy",
            "num_fewshot": 3,
            "data_files": {"train": str(arc_train), "test": str(arc_test)},
        },
        {
            "task": "arc_challenge",
            "num_fewshot": 1,
            "data_dir": str(data / "challenge"),
            "limit": 2,
            "headline": "acc",
        },
    ]
    res = run(model, tok, suite, tmp_path / "cache")
    rows = {t["task"]: t for t in res["tasks"]}
    assert [t["task"] for t in res["tasks"]] == ["winogrande", "arc_easy", "arc_challenge"]
    assert [rows[n]["num_fewshot"] for n in rows] == [2, 3, 1]
    assert [rows[n]["n"] for n in rows] == [len(WINO), len(ARC), 2]
    assert [rows[n]["headline"] for n in rows] == ["acc", "acc_norm", "acc"]
    assert rows["winogrande"]["acc_norm"] is None and 0 <= rows["winogrande"]["acc"] <= 1
    assert rows["winogrande"]["acc"] * len(WINO) == pytest.approx(
        round(rows["winogrande"]["acc"] * len(WINO))
    )
    heads = [rows["winogrande"]["acc"], rows["arc_easy"]["acc_norm"], rows["arc_challenge"]["acc"]]
    assert res["average"] == pytest.approx(sum(heads) / 3)
    cfg = res["results_json"]["configs"]
    assert {cfg[n]["num_fewshot"] for n in ("arc_easy",)} == {3} and cfg["winogrande"]["num_fewshot"] == 2
    assert cfg["arc_easy"]["doc_to_text"] == "Question: {{question}}\nAnswer:", "lm-eval's own config is used"
    assert cfg["arc_easy"]["dataset_path"] == "json" and cfg["arc_challenge"]["dataset_path"] == "json"
    assert res["results_json"]["n-shot"] == {"winogrande": 2, "arc_easy": 3, "arc_challenge": 1}
    # the task hash covers the prompts, so it changes with the few-shot count
    zero = run(model, tok, [{**suite[1], "num_fewshot": 0}], tmp_path / "cache")
    assert (
        zero["tasks"][0]["num_fewshot"] == 0
        and zero["tasks"][0]["task_hash"] != rows["arc_easy"]["task_hash"]
    )


# ---- suite definitions and bad input -----------------------------------------------------------------
def test_paper_suite_definition(tmp_path):
    tasks = build_suite("paper", tmp_path)
    assert [(t.name, t.num_fewshot, t.headline) for t in tasks] == [
        ("winogrande", 5, "acc"),
        ("hellaswag", 10, "acc_norm"),
        ("arc_easy", 25, "acc_norm"),
        ("arc_challenge", 25, "acc_norm"),
        ("mmlu", 5, "acc"),
    ]
    assert [(n, k) for n, k, _ in PAPER] == [(t.name, t.num_fewshot) for t in tasks]
    for t in tasks:
        files = {p.stem: yaml.safe_load(p.read_text()) for p in Path(t.include_path).glob("*.yaml")}
        leaves = [f for f in files.values() if "task" in f]
        assert leaves and all(f["num_fewshot"] == t.num_fewshot for f in leaves), (
            "few-shot set per task, not globally"
        )
        assert all(Path(f["include"]).is_file() for f in files.values())
    mmlu = {p.stem for p in Path(tasks[-1].include_path).glob("*.yaml")}
    assert len(mmlu) == 57 + 5 and {"mmlu", "mmlu_stem", "mmlu_anatomy"} <= mmlu


def test_bad_suites_are_one_line_errors(tmp_path):
    cases = [
        ("bogus", "allowed tiny, paper"),
        ([], "non-empty list"),
        ([{"task": "arc_easy", "shots": 3}], "allowed task, num_fewshot"),
        ([{"task": "arc_easy", "headline": "f1"}], "headline must be one of acc, acc_norm"),
        ([{"task": "arc_easy", "num_fewshot": -1}], "num_fewshot"),
        ([{"task": "arc_easy"}, {"task": "arc_easy"}], "twice"),
        ([{"task": "arc_easy", "data_dir": "x", "data_files": "y"}], "not both"),
    ]
    for suite, msg in cases:
        with pytest.raises(ValueError, match=msg) as e:
            validate_suite(suite)
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="needs tiny_dir"):
        build_suite("tiny", tmp_path)
    write(tmp_path / "arc" / "test.jsonl", ARC)
    with pytest.raises(ValueError, match="few-shot split"):
        build_suite([{"task": "arc_easy", "num_fewshot": 5, "data_dir": str(tmp_path / "arc")}], tmp_path)
    with pytest.raises(ValueError, match="evaluation split 'validation'"):
        build_suite([{"task": "winogrande", "data_dir": str(tmp_path / "arc")}], tmp_path)
    with pytest.raises(ValueError, match="does not exist"):
        build_suite([{"task": "arc_easy", "data_files": str(tmp_path / "missing.jsonl")}], tmp_path)
    with pytest.raises(ValueError, match="use data_dir"):
        build_suite([{"task": "mmlu", "data_files": str(tmp_path / "arc" / "test.jsonl")}], tmp_path)


def test_vllm_backend_without_vllm_is_a_one_line_error(model, tok, tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # as if the [gpu] extra were not installed
    with pytest.raises(ImportError, match=r"install the \[gpu\] extra"):
        run(model, tok, "tiny", tmp_path, key="k", tiny_dir=tiny_dir, batch_size=4, backend="vllm", limit=2)
    with pytest.raises(ValueError, match="backend must be one of hf, vllm"):
        run(model, tok, "tiny", tmp_path, key="k", tiny_dir=tiny_dir, batch_size=4, backend="tpu", limit=2)


# ---- generative tasks and repeated runs --------------------------------------------------------------
NUMBERS = (
    "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen twenty"
).split()


def counting_corpus(n_docs: int = 40, seed: int = 0) -> list[dict]:
    """Documents a tiny model learns in seconds: half count up (the next word is predictable), half are
    shuffled number words (it is not), so exact match lands strictly between 0 and 1."""
    import random

    rng = random.Random(seed)
    docs = []
    for i in range(n_docs):
        start = rng.randrange(0, 6)
        words = NUMBERS[start : start + 14] if i % 2 == 0 else rng.sample(NUMBERS, 14)
        docs.append({"text": " ".join(words), "domain": "prose"})
    return docs


def trained_counter(tok, docs: list[dict], steps: int = 150):
    """The dense tiny model fitted briefly to the counting documents (greedy decoding then gets some right)."""
    model = dense(tok, 1).train()
    ids = [torch.tensor(tok(d["text"], add_special_tokens=False)["input_ids"]) for d in docs]
    n = min(len(x) for x in ids)
    batch = torch.stack([x[:n] for x in ids])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        loss = model(batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def greedy_first_word(model, tok, context: str, max_new: int) -> str:
    """Greedy continuation as lm-eval's HF backend makes it (context without special tokens, cut at
    "\\n\\n" and at EOS), then the tiny_gen filter: the first whitespace-separated word, or "[invalid]"."""
    import re

    from workers.evaluation.suites import FIRST_WORD

    ids = tok(context, add_special_tokens=False)["input_ids"]
    new: list[int] = []
    with torch.no_grad():
        for _ in range(max_new):
            nxt = int(model(torch.tensor([ids + new])).logits[0, -1].argmax())
            if nxt == tok.eos_token_id:
                break
            new.append(nxt)
    text = tok.decode(new, skip_special_tokens=True).split("\n\n")[0]
    found = re.findall(FIRST_WORD, text)
    return found[0].strip() if found else "[invalid]"


@pytest.fixture(scope="module")
def counting_dir(tmp_path_factory) -> Path:
    return corpus_dir(tmp_path_factory, "counting", counting_corpus())


def test_generative_declarations_validate():
    from orchestrator.stages.evaluate import Evaluate
    from workers.evaluation.evaluate import validate_runs
    from workers.evaluation.suites import GENERATIVE, validate_generative

    assert {"gsm8k", "gsm8k_platinum", "math", "humaneval", "mbpp", "tiny_gen"} <= set(GENERATIVE)
    assert all(g.requires["gpu"] for g in GENERATIVE.values())
    assert {n for n, g in GENERATIVE.items() if g.executes_code} == {"humaneval", "mbpp"}
    assert validate_generative(["gsm8k", {"task": "mbpp", "limit": 5}]) == [
        {"task": "gsm8k"},
        {"task": "mbpp", "limit": 5},
    ]
    cases = [
        (["gsm9k"], f"unknown generative task 'gsm9k'; allowed: {', '.join(GENERATIVE)}"),
        ([{"task": "gsm8k", "shots": 3}], "unknown field"),
        ([{"task": "gsm8k", "num_fewshot": -1}], "num_fewshot must be"),
        (["gsm8k", "gsm8k"], "twice"),
        ([{"task": "tiny_gen", "data_dir": "/x"}], "built from the tiny corpus"),
    ]
    for entries, msg in cases:
        with pytest.raises(ValueError, match=msg) as e:
            validate_generative(entries)
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="is a generative task: list it under evaluate.generative"):
        validate_suite([{"task": "gsm8k"}])
    for runs, msg in [
        ([], "non-empty"),
        ([{"seeds": 1}], "unknown field"),
        ([{"seed": -1}], "seed must be"),
        ([{"limit": 0}], "limit must be"),
        ([{"seed": 1}, {"seed": 1}], "repeats entry 0"),
    ]:
        with pytest.raises(ValueError, match=msg):
            validate_runs(runs)
    with pytest.raises(ValueError, match="unknown generative task 'gsm9k'"):
        Evaluate(generative=["gsm9k"])
    assert Evaluate(generative=["tiny_gen"], allow_cpu=True, runs=[{"seed": 0}, {"seed": 1}]).runs[1] == {
        "seed": 1
    }


def test_unmet_generative_tasks_are_recorded_as_not_run(model, tok, tiny_dir, tmp_path, monkeypatch):
    import workers.evaluation.evaluate as we
    from workers.run.evaluate import eval_metrics

    monkeypatch.setattr(we, "gpu_available", lambda: False)
    monkeypatch.setattr(we, "hf_cached", lambda repo, kind: False)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    gen = ["tiny_gen", "gsm8k", "humaneval", {"task": "mbpp", "data_dir": str(tmp_path / "no-such-folder")}]
    go = partial(run, model, tok, "tiny", tmp_path, key="m", tiny_dir=tiny_dir, batch_size=4, limit=2)
    res = go(generative=gen)
    assert set(res["not_run"]) == {"tiny_gen", "gsm8k", "humaneval", "mbpp"}
    assert all(r.startswith("needs a GPU") for r in res["not_run"].values())
    assert [t["task"] for t in res["tasks"]] == ["tiny_mc", "tiny_ppl"], "the suite itself still ran"
    res = go(generative=gen[1:], allow_cpu=True)
    why = res["not_run"]
    assert "needs the dataset openai/gsm8k" in why["gsm8k"] and "offline" in why["gsm8k"]
    assert "allow_code_eval" in why["humaneval"] and "allow_code_eval" in why["mbpp"]
    assert res["runs"][0]["reused"] == ["tiny_mc", "tiny_ppl"], (
        "the suite's results were stored by the first call"
    )
    monkeypatch.setattr(we, "hf_cached", lambda repo, kind: kind == "module")  # as if code_eval were cached
    res = go(generative=gen[3:], allow_cpu=True, allow_code_eval=True)
    assert "no-such-folder is not a folder" in res["not_run"]["mbpp"], "its local data is missing"
    assert all("\n" not in r for r in why.values())
    rows = [m for m in eval_metrics(res, repeated=False) if m["task"] == "mbpp"]
    assert rows == [
        {
            "name": "pass_at_1",
            "value": None,
            "stage": "post",
            "task": "mbpp",
            "step": -1,
            "value_kind": "skipped",
            "extra": {"backend": "hf", "lm_eval": res["lm_eval_version"], "not_run": res["not_run"]["mbpp"]},
        }
    ]


def test_tiny_gen_runs_through_lm_eval_and_matches_a_hand_count(tok, counting_dir, tmp_path):
    from workers.evaluation.suites import TINY_GEN_TOKS, build_generative

    docs = counting_corpus()
    model = trained_counter(tok, docs)
    n = 20
    res = run(
        model,
        tok,
        "tiny",
        tmp_path,
        key="counter",
        tiny_dir=counting_dir,
        batch_size=1,
        limit=n,
        generative=["tiny_gen"],
        allow_cpu=True,
    )
    assert res["not_run"] == {}
    row = next(t for t in res["tasks"] if t["task"] == "tiny_gen")
    assert row["n"] == n and row["score"] == "exact_match:first-word" and row["headline"] is None
    spec = build_generative({"task": "tiny_gen"}, tmp_path, str(counting_dir)).spec
    assert (
        spec["output_type"] == "generate_until" and spec["generation_kwargs"]["max_gen_toks"] == TINY_GEN_TOKS
    )
    items = [
        json.loads(line)
        for line in Path(spec["dataset_kwargs"]["data_files"]["test"]).read_text().splitlines()
    ]
    for it in items:
        i, a, b = it["source"]
        assert docs[i]["text"][a:b] == it["answer"] and docs[i]["text"].startswith(
            it["context"] + " " + it["answer"]
        )
    hits = sum(
        greedy_first_word(model, tok, it["context"], TINY_GEN_TOKS) == it["answer"] for it in items[:n]
    )
    assert 0 < hits < n, "some items right and some wrong, or the comparison could not fail"
    assert row["other"]["exact_match:first-word"] == pytest.approx(hits / n)
    assert res["average"] == pytest.approx(res["tasks"][0]["acc"]), (
        "a generative score stays out of the average"
    )


def test_two_runs_of_one_checkpoint_give_two_rows_with_their_n(model, tok, tiny_dir, tmp_path):
    from workers.run.evaluate import eval_metrics

    runs = [{"limit": 3}, {"limit": 5, "seed": 1}]
    res = run(model, tok, "tiny", tmp_path, key="m2", tiny_dir=tiny_dir, batch_size=4, runs=runs)
    assert [r["settings"] for r in res["runs"]] == runs and [r["reused"] for r in res["runs"]] == [[], []]
    acc = [m for m in eval_metrics(res, repeated=True) if m["name"] == "acc" and m["task"] == "tiny_mc"]
    assert [(m["step"], m["total"], m["extra"]["run"]) for m in acc] == [(0, 3, runs[0]), (1, 5, runs[1])]
    metrics = eval_metrics(res, repeated=True)
    assert all(m["total"] in (3, 5) for m in metrics), "every score carries its n"
    assert len({(m["name"], m["task"], m["step"]) for m in metrics}) == len(metrics), "unique per the DB key"
    # a third run added later: the stored two are read back, not recomputed (no model is needed for them)
    more = run(None, tok, "tiny", tmp_path, key="m2", tiny_dir=tiny_dir, batch_size=4, runs=runs)
    assert [r["reused"] for r in more["runs"]] == [["tiny_mc", "tiny_ppl"]] * 2
    assert more["runs"][1]["tasks"] == res["runs"][1]["tasks"]
    added = run(
        model, tok, "tiny", tmp_path, key="m2", tiny_dir=tiny_dir, batch_size=4, runs=[*runs, {"limit": 4}]
    )
    assert [r["reused"] for r in added["runs"]] == [["tiny_mc", "tiny_ppl"]] * 2 + [[]]
    assert [t["n"] for t in added["runs"][2]["tasks"]] == [4, 4]


def test_launch_prints_one_line_per_task_not_run(capsys):
    from types import SimpleNamespace

    from orchestrator.stage import JobSpec
    from orchestrator.stages.evaluate import after

    jobs = {ck: JobSpec("evaluate", {"model": ck}, code={"x": "y"}) for ck in ("a", "b", "c")}
    why = "needs a GPU (none here); evaluate.allow_cpu: true runs it on the CPU (small models)"
    outputs = {
        jobs["a"].key: {"avg": 0.3, "not_run": {"gsm8k": why}},
        jobs["b"].key: {"not_run": {"gsm8k": why}},
        jobs["c"].key: {"avg": 0.2},
    }
    after(SimpleNamespace(jobs={"evaluate": jobs}, outputs={"evaluate": outputs}))
    assert capsys.readouterr().err.splitlines() == [f"evaluate: gsm8k not run (2 models): {why}"]


def test_an_evaluate_job_runs_without_lm_evals_git_probe(tmp_path, monkeypatch):
    """lm-eval's `git describe` of the working directory (noise on the terminal outside a checkout, and a
    hash that says nothing about the job) is switched off in an evaluate job's environment."""
    import lm_eval.evaluator as evaluator

    import orchestrator.execute as ex
    import workers.run.jobs as jobs

    monkeypatch.setattr(evaluator, "get_git_commit_hash", evaluator.get_git_commit_hash)  # restored after
    seen = {}

    import subprocess

    git_runs = []
    real = subprocess.check_output
    monkeypatch.setattr(
        subprocess, "check_output", lambda cmd, *a, **k: git_runs.append(cmd) or real(cmd, *a, **k)
    )

    def fake_run_job(payload, cache, cb):
        seen[payload["stage"]] = evaluator.get_git_commit_hash()
        return {"outputs": {}}

    monkeypatch.setattr(jobs, "run_job", fake_run_job)
    monkeypatch.chdir(tmp_path)  # not a git checkout
    result, err = ex.run_payload({"key": "k" * 32, "stage": "evaluate", "log_path": None}, {}, None)
    assert err is None and seen == {"evaluate": None} and git_runs == []  # git was never asked
