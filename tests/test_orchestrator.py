"""The launch loop with fake stage functions: dedupe, resume, failures, non-finite results, selection."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
from rich.console import Console

from db.store import Store
from orchestrator import dryrun
from orchestrator.execute import SerialExecutor
from orchestrator.launch import launch
from orchestrator.spec import SpecError, load_spec

HERE = Path(__file__).parent


def _num(*parts) -> float:
    return (
        10 + int(hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:6], 16) % 1000 / 10
    )


@pytest.fixture
def fake(monkeypatch, tmp_path):
    """Replace every stage by a cheap deterministic function; record each call."""
    calls: list[tuple[str, str]] = []
    state = {"fail": True, "live": [], "db": f"sqlite:///{tmp_path}/r.db"}

    def calibrate(p, cache, progress):
        return {"outputs": {"stats": "fake"}}

    def convert(p, cache, progress):
        q = p["params"]
        if state["fail"] and q["scoring"] == "CP" and q["K"] == 4:
            raise ValueError("boom: a deliberately failing method")
        g = "*" if q["K"] == 2 else q.get("grouping")
        return {
            "outputs": {"plan_key": f"{q.get('output')}|{q['scoring']}|{g}|{q.get('dp_scaling')}|{q['K']}"},
            "plan_rows": [
                {
                    "layer": 0,
                    "expert": 1,
                    "score": 0.5,
                    "selected_rank": 0,
                    "group_idx": 0,
                    "merge_weight": 1.0,
                    "alpha": 0.5,
                }
            ],
        }

    def ppl_pre(p, cache, progress):
        s = p["params"]["student"]
        v = float("inf") if s.get("plan_key", "").startswith("dense|SF|WC") else _num(s)
        return {"outputs": {"ppl": v}, "metrics": [{"name": "ppl", "stage": "pre", "value": v}]}

    def distill(p, cache, progress):
        # validation CE reported while the job runs is in the DB before the job ends (Figure 5 live)
        progress(
            1,
            2,
            "distill",
            metrics=[{"name": "val_ce", "stage": "train", "who": "student", "step": 0, "value": 4.0}],
        )
        seen = Store(state["db"], migrate=False).query(
            "SELECT m.value FROM metrics m JOIN jobs j ON j.id = m.job_id WHERE j.key = :k AND m.name = 'val_ce'",
            {"k": p["key"]},
        )[1]
        state["live"].append(seen)
        return {
            "outputs": {"path": "nowhere"},
            "metrics": [{"name": "val_ce", "stage": "train", "who": "student", "step": 0, "value": 3.0}],
        }

    def evaluate(p, cache, progress):
        v = _num(p["params"]["student"], p["key"]) / 1000
        return {
            "outputs": {},
            "metrics": [
                {"name": "ppl", "stage": "post", "value": 5.0},
                {"name": "acc", "stage": "post", "task": "t", "value": v, "headline": 1},
            ],
        }

    def router_kd(p, cache, progress):
        return {
            "outputs": {"delta": "nowhere"},
            "metrics": [
                {"name": "train_loss", "stage": "router_kd", "who": "student", "step": 0, "value": 1.0}
            ],
        }

    fns = dict(
        calibrate=calibrate,
        convert=convert,
        ppl_pre=ppl_pre,
        distill=distill,
        evaluate=evaluate,
        router_kd=router_kd,
    )
    for name, fn in fns.items():

        def wrapped(p, cache, progress, fn=fn, name=name):
            calls.append((name, p["key"]))
            return fn(p, cache, progress)

        monkeypatch.setattr(
            f"workers.run.{name}.stage_{name}", wrapped
        )  # what the registry's run references resolve to
    monkeypatch.setenv("MOESWEEP_HOME", str(tmp_path / "home"))
    state["sweep"] = fake_sweep(tmp_path)
    return calls, state


def fake_sweep(tmp_path: Path, text: str | None = None) -> Path:
    """tests/sweeps/fake.yaml with its teacher pointing at a local config (E = 8, k = 2, no weights)."""
    from transformers import Qwen3MoeConfig

    teacher = tmp_path / "teacher"
    if not teacher.exists():
        Qwen3MoeConfig(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=16,
            moe_intermediate_size=8,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
        ).save_pretrained(teacher)
    f = tmp_path / "fake.yaml"
    f.write_text((text or (HERE / "sweeps" / "fake.yaml").read_text()).replace("fake/teacher", str(teacher)))
    return f


def _launch(store: Store, sweep: Path, **kw) -> int:
    spec, path, text = load_spec(str(sweep))
    return launch(
        spec,
        text,
        store,
        SerialExecutor(),
        console=Console(quiet=not os.environ.get("MOESWEEP_TEST_VERBOSE")),
        show_progress=False,
        path=str(path),
        **kw,
    )


def _results(store: Store) -> list[tuple]:
    return store.query(
        'SELECT scoring, grouping, "K", kind, baseline, ppl_pre, ppl_pre_kind, selected_for_distill, '
        "duplicate_of IS NOT NULL, avg_acc FROM results WHERE sweep = 'fake' ORDER BY config_id"
    )[1]


def test_failures_dedupe_resume_and_retry(fake, tmp_path):
    calls, state = fake
    store = Store(state["db"])
    assert _launch(store, state["sweep"]) == 1  # a failing method fails the launch at the end, not at once
    # the failing conversion was tried 1 + retries times, then recorded with its traceback
    failed = store.query("SELECT attempts, error FROM jobs WHERE status = 'failed'")[1]
    assert len(failed) == 2 and all(a == 2 and "boom" in e for a, e in failed)
    rows = _results(store)
    by = {(r[0], r[1], r[2]): r for r in rows if r[3] == "moe2dense"}
    assert by[("CP", "RR", 4)][5] is None and by[("CP", "RR", 2)][5] is not None  # the rest went on
    # K = k: every grouping is the same student -> one job, the second config marked duplicate
    assert by[("SF", "RR", 2)][8] == 0 and by[("SF", "WC", 2)][8] == 1
    assert by[("SF", "RR", 2)][5] == by[("SF", "WC", 2)][5]
    # a diverged perplexity is a result with value_kind 'inf', not a failure
    assert by[("SF", "WC", 4)][5] is None and by[("SF", "WC", 4)][6] == "inf"
    # selection: per scoring x grouping the lowest finite ppl_pre; baselines are distilled too
    assert by[("SF", "WC", 2)][7] == 1 and by[("SF", "WC", 4)][7] == 0
    ppl_jobs = [k for s, k in calls if s == "ppl_pre"]
    assert len(ppl_jobs) == len(set(ppl_jobs))  # no student evaluated twice
    assert state["live"] and all(seen == [(4.0,)] for seen in state["live"])
    # the final record replaced the early one: one row per (job, name, who, step)
    assert store.query("SELECT DISTINCT value FROM metrics WHERE name = 'val_ce'")[1] == [(3.0,)]
    assert store.query(
        "SELECT DISTINCT distill_tokens, distill_loss FROM configurations WHERE selected_for_distill = 1"
    )[1] == [("8", None)]  # loss/k' mark variants only
    distilled = {r[4] or f"{r[0]}{r[1]}" for r in rows if r[9] is not None}
    assert "random_ffn" in distilled and len(distilled) >= 4

    n = len(calls)
    assert _launch(store, state["sweep"]) == 1  # resume: nothing new runs, the failure is still reported
    assert len(calls) == n and _results(store) == rows

    done = {k for (k,) in store.query("SELECT key FROM jobs WHERE status = 'succeeded'")[1]}
    state["fail"] = False
    assert _launch(store, state["sweep"], retry_failed=True) == 0
    assert {s for s, _ in calls[n:]} >= {"convert", "ppl_pre"}
    assert not done & {k for _, k in calls[n:]}  # nothing that had succeeded ran again
    assert store.query("SELECT COUNT(*) FROM jobs WHERE status <> 'succeeded'")[1] == [(0,)]
    # no duplicated result rows, one configuration per grid point
    assert store.query("SELECT COUNT(*), COUNT(DISTINCT config_key) FROM configurations")[1][0] == (10, 10)


def test_bad_sweep_files_give_one_line_errors(tmp_path):
    base = (HERE / "sweeps" / "fake.yaml").read_text()
    cases = {
        "grid:\n  scoring: [SF, NOPE]": "grid.scoring",
        "grid:\n  scoring: [SF]\n  colour: [red]": "grid.colour: unknown key",
        "grid:\n  scoring: [SF]\n  dp_scaling: [sqrt]": "grid.dp_scaling: unknown dp_scaling 'sqrt'; allowed:",
    }
    for patch, expect in cases.items():
        f = tmp_path / "bad.yaml"
        head, _, _ = base.partition("grid:")
        f.write_text(head + patch + "\n  K: [2]\n")
        with pytest.raises(SpecError) as e:
            load_spec(str(f))
        msg = str(e.value)
        assert str(f) in msg and expect in msg and "\n" not in msg


def test_dry_run_of_the_paper_sweep_plans_350_35_35():
    spec, _, _ = load_spec("paper-qwen3-30b-a3b")
    rows = {r["stage"]: r for r in dryrun.plan_counts(spec)[0]}
    assert rows["calibrate"]["named"] == 350 and rows["calibrate"]["distinct"] == 1
    assert rows["convert"]["named"] == 350 and rows["convert"]["distinct"] == 350
    # K = k = 8: the five groupings give one student per scoring x scaling (7 x 2 x 4 duplicates), + 8 others
    assert rows["ppl_pre"]["named"] == 358 and rows["ppl_pre"]["distinct"] == 350 - 56 + 8
    assert rows["select"]["distinct"] == 35
    assert "35 selected" in rows["distill"]["note"]


def test_variants_and_the_selection_rule_are_stored_as_identities(fake, tmp_path):
    calls, state = fake
    state["fail"] = False
    text = (
        (HERE / "sweeps" / "fake.yaml")
        .read_text()
        .replace(
            "  settings: {steps: 1, batch_size: 1, seq_len: 8}",
            "  settings: {steps: 1, batch_size: 1, seq_len: 8}\n"
            "  variants: [{loss: reverse_kl}, {steps: 2, teacher_top_k: 4}]\n"
            "  variants_on: {scoring: SF, grouping: RR}",
        )
    )
    store = Store(state["db"])
    assert _launch(store, fake_sweep(tmp_path, text)) == 0
    rows = store.query(
        "SELECT v.config_key, v.variant, m.config_key, v.distill_loss, v.teacher_top_k, "
        "v.distill_tokens FROM configurations v JOIN configurations m ON m.id = v.variant_of "
        "ORDER BY v.config_key"
    )[1]
    main = store.query(
        "SELECT config_key FROM configurations WHERE scoring = 'SF' AND grouping = 'RR' "
        "AND selected_for_distill = 1 AND variant_of IS NULL"
    )[1][0][0]
    assert rows == [
        (f"{main}|variant=0", "loss=reverse_kl", main, "reverse_kl", None, "8"),
        (f"{main}|variant=1", "steps=2,teacher_top_k=4", main, None, 4, "16"),
    ]
    # the results view carries them, and each variant was distilled and evaluated on its own
    res = store.query(
        "SELECT variant, avg_acc IS NOT NULL FROM results WHERE variant_of IS NOT NULL ORDER BY variant"
    )[1]
    assert res == [("loss=reverse_kl", 1), ("steps=2,teacher_top_k=4", 1)]
    rule = store.query("SELECT select_json FROM sweep_info WHERE sweep = 'fake'")[1][0][0]
    assert json.loads(rule) == {
        "best_by": "ppl_pre",
        "per": ["scoring", "grouping"],
        "over": ["K", "dp_scaling"],
    }
    n = len(calls)
    assert _launch(store, fake_sweep(tmp_path, text)) == 0 and len(calls) == n  # a relaunch reuses all of it
