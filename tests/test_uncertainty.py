"""Honest comparisons: per-item scores kept from lm-eval samples and perplexity windows, stored packed
in item_scores, their standard errors, and a seeded paired bootstrap that covers a known difference."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
from alembic import command
from sqlalchemy import create_engine, inspect

import tests.test_evaluate as te
from analysis.load import load_items
from analysis.uncertainty import (
    NOT_DISTINGUISHABLE,
    Uncertainty,
    acc_replicates,
    benchmark_sizes,
    binomial_se,
    paired_diff,
    phrase,
    ppl_replicates,
)
from db.items import pack_ids, pack_values, unpack_ids, unpack_values
from db.store import Store
from tests.test_migrations import alembic_config
from workers.evaluation.evaluate import item_scores
from workers.evaluation.ppl import window_stats
from workers.run.evaluate import eval_items, item_stderr


def _pair(n: int, delta: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Two students on the same n items: A right where u < 0.55 + δ, B where u < 0.55 (true gap δ)."""
    u = rng.random(n)
    return (u < 0.55 + delta).astype(float), (u < 0.55).astype(float)


# ---- the bootstrap on synthetic per-item data with a known difference ------------------------------
def test_paired_bootstrap_covers_a_known_difference():
    rng = np.random.default_rng(7)
    hits = 0
    for _ in range(60):
        a, b = _pair(400, 0.05, rng)
        d = paired_diff(a, b)
        hits += d["ci"][0] <= 0.05 <= d["ci"][1]
    assert hits >= 52, f"95% intervals held the true difference {hits}/60 times"
    for _ in range(10):  # a large effect is told apart, no effect is not
        a, b = _pair(400, 0.15, rng)
        assert paired_diff(a, b)["distinguishable"]
        a, _ = _pair(400, 0.0, rng)
        same = paired_diff(a, a.copy())
        assert not same["distinguishable"] and same["ci"] == [0.0, 0.0]
    a, b = _pair(400, 0.05, np.random.default_rng(1))
    assert paired_diff(a, b) == paired_diff(a, b), "seeded: the same data give the same interval"


def test_unrelated_students_of_equal_accuracy_are_not_distinguishable():
    rng = np.random.default_rng(3)
    inside = sum(
        not paired_diff(*(rng.random((2, 300)) < 0.5).astype(float))["distinguishable"] for _ in range(40)
    )
    assert inside >= 34


def _items_frame(students: dict[int, dict[str, np.ndarray]], reverse: frozenset[int] = frozenset()):
    rows, tasks = [], []
    for cid, by_task in students.items():
        for task, vals in by_task.items():
            ids = np.arange(len(vals))
            if cid in reverse:  # stored in another order: alignment is by doc_id
                ids, vals = ids[::-1], vals[::-1]
            rows.append(
                {
                    "config_id": cid,
                    "stage": "post",
                    "task": task,
                    "subtask": task,
                    "step": -1,
                    "name": "acc",
                    "n": len(vals),
                    "ids": ids,
                    "vals": vals.astype(float),
                }
            )
            tasks.append(
                {
                    "config_id": cid,
                    "stage": "post",
                    "task": task,
                    "metric": "acc",
                    "headline": 1,
                    "value": float(vals.mean()),
                }
            )
    return pd.DataFrame(rows), pd.DataFrame(tasks)


def test_replicates_pair_items_by_doc_id_across_tasks():
    rng = np.random.default_rng(11)
    a1, b1 = _pair(300, 0.2, rng)
    a2, b2 = _pair(200, 0.0, rng)
    items, tasks = _items_frame({1: {"t1": a1, "t2": a2}, 2: {"t1": b1, "t2": b2}})
    rep = acc_replicates(items, tasks, [1, 2])
    assert rep.n == 500 and rep.point[1] == pytest.approx((a1.mean() + a2.mean()) / 2)
    reversed_, _ = _items_frame({1: {"t1": a1, "t2": a2}, 2: {"t1": b1, "t2": b2}}, frozenset({1}))
    again = acc_replicates(reversed_, tasks, [1, 2])
    assert np.allclose(again.reps[1], rep.reps[1]) and np.allclose(again.reps[2], rep.reps[2])
    unc = Uncertainty(rep, None)
    stated = 100 * (rep.point[1] - rep.point[2])
    d = unc.acc_diff([1], [2], stated)
    assert d["diff"] == pytest.approx(stated, abs=1e-4) and d["ci"][0] < stated < d["ci"][1]
    assert d["distinguishable"] and unc.acc_se([1]) > 0
    assert unc.acc_diff([1], [3], 0.0) is None, "a student without items gets no interval"


def test_perplexity_replicates_and_window_standard_error():
    rng = np.random.default_rng(5)
    tok = np.full(50, 128.0)
    base = rng.normal(3.0, 0.3, 50) * tok
    rows = [
        {
            "config_id": c,
            "stage": "pre",
            "task": "",
            "subtask": "",
            "step": -1,
            "name": name,
            "n": 50,
            "ids": np.arange(50),
            "vals": vals,
        }
        for c, nll in ((1, base), (2, base + 0.05 * tok))
        for name, vals in (("nll", nll), ("tokens", tok))
    ]
    rep = ppl_replicates(pd.DataFrame(rows), [1, 2])
    assert rep.point[1] == pytest.approx(math.exp(base.sum() / tok.sum()))
    d = Uncertainty(None, rep).ppl_diff([2], [1], rep.point[2] - rep.point[1])
    assert d["distinguishable"] and d["ci"][0] > 0, "a uniform shift of every window is told apart"
    se, n = window_stats(list(base), list(tok))
    assert n == 50 and se == pytest.approx(
        rep.point[1] * np.std(base / tok, ddof=1) / math.sqrt(50), rel=1e-9
    )
    assert window_stats([1.0], [3]) == (None, 1)


def test_binomial_standard_error_from_published_sizes():
    sizes = benchmark_sizes()
    assert sizes["winogrande"] == 1267 and sizes["mmlu"] == 14042 and sizes["rte"] == 277
    tasks = pd.DataFrame(
        [
            {"config_id": 1, "stage": "post", "task": "winogrande", "headline": 1, "value": 0.5},
            {"config_id": 1, "stage": "post", "task": "arc_easy", "headline": 1, "value": 0.7},
            {"config_id": 2, "stage": "post", "task": "unknown", "headline": 1, "value": 0.5},
        ]
    )
    se = binomial_se(tasks, [1, 2])
    assert set(se) == {1}
    assert se[1][0] == pytest.approx(math.sqrt(0.25 / 1267 + 0.21 / 2376) / 2) and se[1][1] == 1267 + 2376
    d = Uncertainty(None, None, {1: se[1], 3: se[1]}).acc_diff([1], [3], 0.5)
    assert d["diff"] == 0.5 and not d["distinguishable"] and phrase(d).startswith(f" — {NOT_DISTINGUISHABLE}")


# ---- per-item scores from lm-eval's logged samples --------------------------------------------------
def _sample(doc_id: int, acc: float, lls: list[float]) -> dict:
    return {
        "doc_id": doc_id,
        "metrics": ["acc", "acc_norm"],
        "acc": acc,
        "acc_norm": 1.0 - acc,
        "filtered_resps": [[ll, False] for ll in lls],
        "doc_hash": "",
        "prompt_hash": "",
        "target_hash": "",
    }


def test_item_scores_from_samples_and_their_records():
    samples = [
        _sample(2, 1.0, [-1.0, -2.0]),
        _sample(0, 0.0, [-3.0, -1.0, -2.5]),
        _sample(1, 1.0, [-0.5, -4.0]),
    ]
    it = item_scores("leaf", samples)
    assert it["doc_ids"] == [0, 1, 2] and it["metrics"] == {
        "acc": [0.0, 1.0, 1.0],
        "acc_norm": [1.0, 0.0, 0.0],
    }
    assert it["loglik_doc"] == [0, 0, 0, 1, 1, 2, 2] and it["loglik"] == [
        -3.0,
        -1.0,
        -2.5,
        -0.5,
        -4.0,
        -1.0,
        -2.0,
    ]
    with pytest.raises(ValueError, match="doc_id twice"):
        item_scores("leaf", [*samples, _sample(1, 0.0, [-1.0])])
    # lm-eval's stderr: sample sd / sqrt(n)
    assert item_stderr([it], "acc", 2 / 3) == pytest.approx(np.std([0, 1, 1], ddof=1) / math.sqrt(3))
    other = item_scores("leaf2", [_sample(0, 1.0, [-1.0]), _sample(1, 1.0, [-1.0])])
    assert item_stderr([it, other], "acc", 0.8) == pytest.approx(
        np.std([0, 1, 1, 1, 1], ddof=1) / math.sqrt(5)
    )
    macro = (2 / 3 + 1.0) / 2  # a group's unweighted mean: the leaves' SEs combine
    assert item_stderr([it, other], "acc", macro) == pytest.approx(
        np.std([0, 1, 1], ddof=1) / math.sqrt(3) / 2
    )
    res = {"runs": [{"tasks": [{"task": "suite_task", "items": [it]}]}]}
    recs = eval_items(res, repeated=False)
    assert [(r["name"], r["step"], len(r["doc_ids"])) for r in recs] == [
        ("acc", -1, 3),
        ("acc_norm", -1, 3),
        ("loglik", -1, 7),
    ]


def test_a_task_with_several_filters_gets_each_metric_per_filter():
    """lm-eval logs one sample per document and filter (gsm8k: strict-match, flexible-extract)."""

    def gen(doc_id: int, f: str, em: float) -> dict:
        return {
            "doc_id": doc_id,
            "filter": f,
            "metrics": ["exact_match"],
            "exact_match": em,
            "filtered_resps": ["7"],
        }

    samples = [gen(1, "strict-match", 0.0), gen(0, "strict-match", 1.0), gen(0, "flexible-extract", 1.0)]
    samples.append(gen(1, "flexible-extract", 1.0))
    it = item_scores("gsm8k", samples)
    assert it["doc_ids"] == [0, 1] and it["metrics"] == {
        "exact_match,strict-match": [1.0, 0.0],
        "exact_match,flexible-extract": [1.0, 1.0],
    }
    with pytest.raises(ValueError, match="filters logged different documents"):
        item_scores("gsm8k", samples[:3])


# ---- stored packed, read back, and in the results view ---------------------------------------------
def test_item_scores_are_stored_packed_and_read_back(tmp_path):
    assert unpack_ids(pack_ids([3, 1, 2])).tolist() == [3, 1, 2]
    assert unpack_values(pack_values([0.5, math.nan])).tolist()[0] == 0.5
    store = Store(f"sqlite:///{tmp_path}/i.db")
    sid = store.upsert_sweep("s")
    ids = store.upsert_configs(sid, [{"config_key": "a", "model": "m", "kind": "moe2dense"}])
    store.register_jobs(sid, [{"key": "j" * 64, "stage": "ppl_pre", "params": {}}])
    assert store.claim("j" * 64, "me")
    nll = [300.0, 320.0, 310.0]
    tok = [100.0, 100.0, 100.0]
    se, n = window_stats(nll, tok)
    ppl = math.exp(sum(nll) / 300)
    result = {
        "metrics": [{"name": "ppl", "stage": "pre", "value": ppl, "stderr": se, "total": n}],
        "item_scores": [
            {"stage": "pre", "name": "nll", "doc_ids": [0, 1, 2], "values": nll},
            {"stage": "pre", "name": "tokens", "doc_ids": [0, 1, 2], "values": tok},
        ],
    }
    assert store.finish("j" * 64, "me", result, 0.1)
    store.link([(ids["a"], "ppl_pre", store.jobs(["j" * 64])["j" * 64]["id"])])
    items = load_items(store.engine, ["s"])
    assert list(items["name"]) == ["nll", "tokens"] and items["vals"][0].tolist() == nll
    assert items["ids"][1].tolist() == [0, 1, 2]
    _, rows = store.query("SELECT ppl_pre, ppl_pre_se, ppl_pre_n FROM results")
    assert rows == [(pytest.approx(ppl), pytest.approx(se), 3)]
    with pytest.raises(Exception, match="3 ids but 2 values"):
        store._write_records(
            None, {"item_scores": [{"name": "nll", "doc_ids": [0, 1, 2], "values": [1.0, 2.0]}]}, job_id=1
        )


def test_migration_0006_down_and_up(tmp_path):
    store = Store(f"sqlite:///{tmp_path}/m.db")
    plain = create_engine(store.url)  # the alembic CLI's engine (foreign keys off)
    cfg = alembic_config(store.url)
    with plain.begin() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, "0005")
    assert "item_scores" not in inspect(plain).get_table_names()
    assert "config_items" not in inspect(plain).get_view_names()
    with plain.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")
    plain.dispose()
    _, rows = store.query("SELECT avg_acc_se, avg_acc_n, ppl_post_se, ppl_post_n FROM results")
    assert rows == [] and "item_scores" in inspect(store.engine).get_table_names()


# ---- through lm-eval itself, and read back from the stored result -----------------------------------
def test_lm_eval_items_match_its_scores_and_survive_reuse(tmp_path):
    docs = te.documents()
    (tmp_path / "tiny" / "corpus").mkdir(parents=True)
    (tmp_path / "tiny" / "corpus" / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in docs))
    tok = te.train_tokenizer([r["text"] for r in docs], 512, tmp_path / "tok")
    model, n = te.dense(tok, 0), 12
    res = te.run(model, tok, "tiny", tmp_path / "cache", tiny_dir=tmp_path / "tiny", limit=n)
    mc = res["tasks"][0]
    (it,) = mc["items"]
    assert it["doc_ids"] == list(range(n)) and len(it["loglik"]) == 4 * n  # four choices each
    assert np.mean(it["metrics"]["acc"]) == pytest.approx(mc["acc"])
    assert item_stderr(mc["items"], "acc", mc["acc"]) == pytest.approx(mc["acc_stderr"])
    again = te.run(model, tok, "tiny", tmp_path / "cache", tiny_dir=tmp_path / "tiny", limit=n)  # read back
    assert again["runs"][0]["reused"] and again["tasks"][0]["items"] == mc["items"]
    recs = eval_items(again, repeated=False)
    assert {(r["task"], r["name"]) for r in recs} >= {
        ("tiny_mc", "acc"),
        ("tiny_mc", "acc_norm"),
        ("tiny_mc", "loglik"),
    }
