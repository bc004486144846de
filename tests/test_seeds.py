"""Seed repeats (`seeds: [1, 2, 3]`): planned as variants of the selected students with their own calibrate,
convert, ppl, distill and evaluate jobs (fake stage functions), and pooled over seeds in the report."""

from __future__ import annotations

import json

import pandas as pd
import pytest

import workers.run.calibrate
import workers.run.convert
from db.store import Store
from orchestrator import dryrun
from orchestrator.spec import load_spec
from tests.test_orchestrator import HERE, _launch, fake, fake_sweep  # noqa: F401  (the fake stage functions)

SEEDS = (HERE / "sweeps" / "fake.yaml").read_text() + "seeds: [1, 2, 3]\n"


@pytest.fixture
def seeded(fake, monkeypatch):  # noqa: F811  (the imported fixture)
    """The fake stages, with a calibration that depends on its seed and plans that depend on the calibration."""
    calibrate, convert = workers.run.calibrate.stage_calibrate, workers.run.convert.stage_convert

    def cal(p, cache, progress):
        out = calibrate(p, cache, progress)
        return {**out, "outputs": {"stats": f"seed{p['params']['seed']}"}}

    def conv(p, cache, progress):
        out = convert(p, cache, progress)
        out["outputs"]["plan_key"] += "|" + p["inputs"]["calibrate"]["stats"]
        return out

    monkeypatch.setattr("workers.run.calibrate.stage_calibrate", cal)
    monkeypatch.setattr("workers.run.convert.stage_convert", conv)
    fake[1]["fail"] = False
    return fake


def _jobs_of(store: Store, config_key: str) -> dict[str, dict]:
    cols, rows = store.query(
        "SELECT cj.stage, j.key, j.params_json FROM config_jobs cj JOIN jobs j ON j.id = cj.job_id "
        "JOIN configurations c ON c.id = cj.config_id WHERE c.config_key = :k",
        {"k": config_key},
    )
    return {stage: {"key": key, "params": json.loads(params)} for stage, key, params in rows}


def test_seed_repeats_are_variants_with_their_own_jobs(seeded, tmp_path):
    calls, state = seeded
    store = Store(state["db"])
    assert _launch(store, fake_sweep(tmp_path)) == 0  # the sweep without seeds
    before = {k for (k,) in store.query("SELECT key FROM jobs")[1]}
    n = len(calls)
    assert _launch(store, fake_sweep(tmp_path, SEEDS)) == 0
    new = calls[n:]
    assert not {k for _, k in new} & before  # the first seed is the sweep as written: nothing reruns

    picks = [
        ck
        for (ck,) in store.query(
            "SELECT config_key FROM configurations WHERE selected_for_distill = 1 AND kind = 'moe2dense' "
            "AND variant_of IS NULL ORDER BY config_key"
        )[1]
    ]
    reps = store.query(
        "SELECT v.config_key, v.variant, m.config_key FROM configurations v "
        "JOIN configurations m ON m.id = v.variant_of ORDER BY v.config_key"
    )[1]
    assert picks and reps == sorted((f"{ck}|seed={s}", f"seed={s}", ck) for ck in picks for s in (2, 3))
    # one further calibration per seed, shared by every repeat of that seed
    assert sorted(s for s, _ in new if s == "calibrate") == ["calibrate"] * 2
    seeds = {
        json.loads(p)["seed"]
        for (p,) in store.query("SELECT params_json FROM jobs WHERE stage = 'calibrate'")[1]
    }
    assert seeds == {1234, 1235, 1236}
    main = _jobs_of(store, picks[0])
    for s, offset in ((2, 1), (3, 2)):
        rep = _jobs_of(store, f"{picks[0]}|seed={s}")
        assert set(rep) == {"seed_convert", "seed_ppl", "distill", "evaluate"}
        assert rep["seed_convert"]["params"] == main["convert"]["params"]  # the same conversion …
        assert rep["seed_convert"]["key"] != main["convert"]["key"]  # … on another calibration
        assert rep["distill"]["params"]["settings"]["seed"] == offset  # data order: DistillSpec.seed + offset
        assert rep["evaluate"]["params"]["evaluate"]["runs"] == [{"seed": offset}]  # lm-eval's seeds
        assert all(rep[st]["key"] != main[st]["key"] for st in ("distill", "evaluate"))
    res = store.query(
        "SELECT variant, ppl_pre IS NOT NULL, avg_acc IS NOT NULL, plan_key LIKE '%seed1235' "
        "FROM results WHERE variant LIKE 'seed=%' ORDER BY variant"
    )[1]
    assert {r[0] for r in res} == {"seed=2", "seed=3"} and all(r[1] and r[2] for r in res)
    assert all(r[3] == (r[0] == "seed=2") for r in res)  # its plan comes from its own calibration
    n = len(calls)
    assert _launch(store, fake_sweep(tmp_path, SEEDS)) == 0 and len(calls) == n  # a relaunch reuses all of it


def test_dry_run_names_the_seed_repeats(tmp_path):
    spec, _, _ = load_spec(str(fake_sweep(tmp_path, SEEDS)))
    rows = {r["stage"]: r for r in dryrun.plan_counts(spec)[0]}
    assert rows["calibrate"]["distinct"] == 3
    assert "2 more seed(s)" in rows["seed_convert"]["note"]
    assert "2 seed repeats of each selected student" in rows["distill"]["note"]


def test_pooling_over_seeds_on_synthetic_rows():
    import analysis.uncertainty as U

    rows = pd.DataFrame(
        [  # two students (1, 2), each with two repeats; a baseline (3) without any
            {"config_id": 1, "variant": None, "variant_of": None, "avg": 0.50},
            {"config_id": 2, "variant": None, "variant_of": None, "avg": 0.40},
            {"config_id": 3, "variant": None, "variant_of": None, "avg": 0.30},
            {"config_id": 4, "variant": "seed=2", "variant_of": 1, "avg": 0.52},
            {"config_id": 5, "variant": "seed=3", "variant_of": 1, "avg": 0.48},
            {"config_id": 6, "variant": "seed=2", "variant_of": 2, "avg": 0.45},
            {"config_id": 7, "variant": "seed=3", "variant_of": 2, "avg": 0.38},
            {
                "config_id": 8,
                "variant": "loss=reverse_kl",
                "variant_of": 1,
                "avg": 0.10,
            },  # an ablation, not a seed
        ]
    )
    sv = U.SeedValues.of(rows, "avg")
    assert sv.values == {
        1: {"main": 0.50, "seed=2": 0.52, "seed=3": 0.48},
        2: {"main": 0.40, "seed=2": 0.45, "seed=3": 0.38},
    }
    p = U.pooled(sv.values[1], 100.0)
    assert p["values"] == [50.0, 52.0, 48.0] and p["mean"] == 50.0 and p["sd"] == pytest.approx(2.0)
    t = sv.diff([1], [2], 100.0)  # per seed: 10, 7, 10 pp
    assert t["diffs"] == pytest.approx([10.0, 7.0, 10.0]) and t["mean"] == pytest.approx(9.0)
    assert t["sd"] == pytest.approx(3**0.5, abs=1e-4) and t["n"] == 3
    assert t["ci"] == pytest.approx([9.0 - 4.302653, 9.0 + 4.302653], abs=1e-3)  # t(2) · sd / √3 = 4.3027
    assert t["survives"]
    assert sv.diff([1], [3]) is None  # the baseline has no repeats: judged on its items alone
    item = {"diff": 10.0, "ci": [2.0, 18.0], "distinguishable": True}
    assert U.with_seeds(item, t)["distinguishable"] and U.verdict(U.with_seeds(item, t)) is None
    noisy = {**t, "survives": False}
    assert U.verdict(U.with_seeds(item, noisy)) == U.NOT_ACROSS_SEEDS
    assert U.verdict(U.with_seeds({**item, "distinguishable": False}, t)) == U.NOT_DISTINGUISHABLE
    assert U.with_seeds(item, None) == item
