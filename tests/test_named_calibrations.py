"""Named calibrations (`calibrations: {name: section}`, a sub-grid's `calibration: <name>`): which
configuration is calibrated by which calibrate job, the keys of sweeps without them, the errors, seed001's
per-method passes, and a tiny sweep run end to end (two calibrations of the tiny corpus)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from sweep_runs import launched_twice, planned, spec_of

from orchestrator import dryrun
from orchestrator.spec import SpecError, check_local_paths, load_spec
from orchestrator.stage import SweepContext
from orchestrator.stages.calibrate import calibration_params, plan_note

HERE = Path(__file__).parent
SEED001 = "seed001-router-kd-qwen3-30b-a3b"
REAP = "moe|REAP|K=4|recovery=none"
WEIGHTS = "moe|Weights|K=4|recovery=none"
REAP_VALID = f"{REAP}|calibration=valid"
TRAIN_N, VALID_N, SEQ = 16, 8, 64

# the tiny teacher calibrated two ways: the calibration section (16 windows of the train split) and
# `valid` (8 windows of the valid split); REAP on both (one plain key, one with the tail), Weights on `valid`
SWEEP: dict[str, Any] = {
    "name": "named-calibrations",
    "description": "a pruned MoE on each of two tiny-corpus calibrations",
    "teacher": {
        "source": "tiny",
        "label": "micro-qwen3moe-e8",
        "tiny": {
            "experts": 8,
            "top_k": 2,
            "hidden": 32,
            "layers": 2,
            "heads": 2,
            "kv_heads": 1,
            "moe_intermediate": 32,
            "vocab": 512,
            "steps": 40,
            "batch_size": 8,
            "seq_len": 64,
            "corpus_chars": 300000,
            "eval_windows": 16,
        },
    },
    "calibration": {
        "data": {"source": "tiny", "split": "train"},
        "n_samples": TRAIN_N,
        "seq_len": SEQ,
        "batch_size": 8,
    },
    "calibrations": {
        "valid": {
            "data": {"source": "tiny", "split": "valid"},
            "n_samples": VALID_N,
            "seq_len": SEQ,
            "batch_size": 8,
        }
    },
    "grid": [
        {"output": ["moe"], "scoring": ["REAP"], "K": [4], "recovery": ["none"]},
        {
            "output": ["moe"],
            "scoring": ["REAP", "Weights"],
            "K": [4],
            "recovery": ["none"],
            "calibration": "valid",
        },
    ],
    "ppl": {"data": {"source": "tiny", "split": "test"}, "seq_len": SEQ, "max_windows": 4},
    "select": None,
    "execution": {"retries": 0},
}


def job_keys(ctx: SweepContext) -> dict[str, dict[str, str]]:
    return {stage: {k: j.key for k, j in jobs.items()} for stage, jobs in ctx.jobs.items()}


# ---- planning ----------------------------------------------------------------------------------------
def test_each_configuration_is_calibrated_by_its_sections_job(tmp_path):
    spec = spec_of(SWEEP, tmp_path)
    ctx = planned(spec)
    by_key = {c["config_key"]: c for c in ctx.configs}
    assert list(by_key) == [REAP, REAP_VALID, WEIGHTS]
    assert [by_key[k].get("calibration") for k in by_key] == [None, "valid", "valid"]
    # the same conversion twice, not a variant of one another: both compete in the selection rule
    axes = ("output", "scoring", "K", "recovery", "kind", "settings")
    assert {a: by_key[REAP_VALID][a] for a in axes} == {a: by_key[REAP][a] for a in axes}
    assert by_key[REAP_VALID].get("variant") is None and by_key[REAP_VALID].get("variant_of") is None
    cal, conv = ctx.jobs["calibrate"], ctx.jobs["convert"]
    assert cal[REAP_VALID].key == cal[WEIGHTS].key != cal[REAP].key  # the rows naming `valid` share its job
    assert cal[REAP_VALID].params == {
        "teacher": cal[REAP].params["teacher"],
        **calibration_params(spec.calibrations["valid"]),
    }
    assert (
        cal[REAP_VALID].params["data"]["split"] == "valid" and cal[REAP_VALID].params["n_samples"] == VALID_N
    )
    assert cal[REAP_VALID].deps == cal[REAP].deps  # the same teacher job
    assert conv[REAP_VALID].params == conv[REAP].params
    assert conv[REAP_VALID].deps["calibrate"] == cal[REAP_VALID].key != conv[REAP].deps["calibrate"]
    assert len({j.key for j in conv.values()}) == 3
    assert (
        by_key[REAP_VALID]["note"] == f"calibrated by calibrations.valid: {VALID_N} windows of {SEQ} tokens"
    )
    assert "note" not in by_key[REAP]
    rows = {r["stage"]: r for r in dryrun.plan_counts(spec)[0]}
    assert (rows["calibrate"]["named"], rows["calibrate"]["distinct"]) == (3, 2)


def test_the_calibration_sections_job_is_that_of_the_sweep_without_named_calibrations(tmp_path):
    raw = copy.deepcopy(SWEEP)
    del raw["calibrations"]
    raw["grid"] = raw["grid"][:1]
    plain, ours = planned(spec_of(raw, tmp_path, "plain.yaml")), planned(spec_of(SWEEP, tmp_path))
    for stage, jobs in job_keys(plain).items():
        assert jobs == {k: v for k, v in job_keys(ours)[stage].items() if k in jobs}, stage
    # a named section calibrating on the calibration section's data is that section's job
    same = copy.deepcopy(SWEEP)
    same["calibrations"]["valid"] = copy.deepcopy(SWEEP["calibration"])
    ctx = planned(spec_of(same, tmp_path, "same.yaml"))
    assert (
        ctx.jobs["calibrate"][REAP_VALID].key
        == ctx.jobs["calibrate"][REAP].key
        == plain.jobs["calibrate"][REAP].key
    )
    assert plan_note(ctx) == f"1 pass of {SEQ}-token windows: calibration, valid: {TRAIN_N}"


@pytest.mark.parametrize(
    "sweep",
    [
        str(HERE / "sweeps" / "micro.yaml"),
        str(HERE / "sweeps" / "dcdm.yaml"),
        str(HERE / "sweeps" / "single_source.yaml"),
        "tiny",
    ],
)
def test_sweeps_without_them_plan_the_same_configurations_and_jobs(sweep, tmp_path):
    """An unused `calibrations` section plans nothing: the configurations, their keys and every job key are
    those of the sweep as written, and no configuration carries a calibration name or a note."""
    spec, path, _ = load_spec(sweep)
    raw = yaml.safe_load(path.read_text())
    raw["calibrations"] = {"unused": {"data": {"source": "tiny", "split": "valid"}, "n_samples": 4}}
    plain, extra = planned(spec), planned(spec_of(raw, tmp_path))
    assert plain.configs == extra.configs
    assert not any("calibration" in c or "note" in c for c in plain.configs if c.get("variant") is None)
    assert job_keys(plain) == job_keys(extra)
    assert plan_note(plain) == plan_note(extra) and "unused" not in plan_note(extra)
    assert plain.spec.calibration.model_dump() == extra.spec.calibration.model_dump()


def test_keys_get_a_tail_only_where_sub_grids_calibrate_a_configuration_two_ways(tmp_path):
    raw = copy.deepcopy(SWEEP)
    raw["calibrations"]["code"] = {
        "data": {"source": "tiny", "split": "train:code"},
        "n_samples": 4,
        "seq_len": SEQ,
    }
    raw["grid"] = [
        {"output": ["moe"], "scoring": ["REAP"], "K": [4], "recovery": ["none"], "calibration": "valid"},
        {"output": ["moe"], "scoring": ["REAP"], "K": [4], "recovery": ["none"], "calibration": "code"},
        {"output": ["moe"], "scoring": ["Weights"], "K": [4], "recovery": ["none"], "calibration": "code"},
    ]
    ctx = planned(spec_of(raw, tmp_path))
    keys = [c["config_key"] for c in ctx.configs]
    assert keys == [REAP_VALID, f"{REAP}|calibration=code", WEIGHTS]  # neither REAP keeps the plain key
    cal = ctx.jobs["calibrate"]
    assert cal[f"{REAP}|calibration=code"].key == cal[WEIGHTS].key != cal[REAP_VALID].key
    assert plan_note(ctx) == f"2 passes of {SEQ}-token windows: valid: {VALID_N}; code: 4"


def test_the_plan_note_gives_each_pass_its_windows_where_they_differ(tmp_path):
    raw = copy.deepcopy(SWEEP)
    raw["calibrations"]["valid"]["seq_len"] = 32
    assert plan_note(planned(spec_of(raw, tmp_path))) == (
        f"2 passes of token windows: calibration: {TRAIN_N} of {SEQ}; valid: {VALID_N} of 32"
    )


def test_a_named_section_may_read_chat_data():
    spec = load_spec(SEED001)[0]
    spec.calibrations["cfes"].sources["code"].data.format = "chat"
    spec.calibrations["cfes"].sources["code"].data.prompt_field = "question"
    check_local_paths(
        spec, "x.yaml"
    )  # calibrations.* is read with the teacher's tokenizer, as calibration.* is


# ---- errors --------------------------------------------------------------------------------------------
def two_sources(first: str = "prose", **extra: Any) -> dict[str, Any]:
    """A calibration section mixing the tiny corpus's prose (named `first`) and code halves, 8 windows."""
    return {
        "sources": {
            first: {"data": {"source": "tiny", "split": "train:prose"}, "weight": 1},
            "code": {"data": {"source": "tiny", "split": "train:code"}, "weight": 1},
        },
        "n_samples": 8,
        "seq_len": SEQ,
        **extra,
    }


def _with(change) -> dict[str, Any]:
    raw = copy.deepcopy(SWEEP)
    change(raw)
    return raw


@pytest.mark.parametrize(
    "change, expect",
    [
        (
            lambda r: r["grid"][1].update(calibration="vaild"),
            "grid: sub-grid 2: calibration 'vaild' is not a name in calibrations; allowed: valid",
        ),
        (
            lambda r: r.pop("calibrations"),
            "grid: sub-grid 2: calibration 'valid' is not a name in calibrations; allowed: none: the sweep has "
            "no calibrations section",
        ),
        (lambda r: r.update(calibrations={}), "calibrations: name at least one calibration"),
        (
            lambda r: r["calibrations"].update({"a.b": r["calibrations"]["valid"]}),
            "calibrations: 'a.b' is not a calibration name; allowed: letters, digits",
        ),
        (
            lambda r: r["calibrations"].update({"dcdm": r["calibrations"]["valid"]}),
            "calibrations: 'dcdm': `calibration=dcdm` is the DCDM mixture's key tail; rename it",
        ),
        (
            lambda r: r["calibrations"]["valid"].update(
                data=None,
                sources={
                    "a": {"data": {"source": "tiny"}, "weight": 1},
                    "b": {"data": {"source": "tiny"}, "weight": 1},
                },
                single_source={"n_samples": 2},
            ),
            "calibrations: valid.single_source: single-source variants come from the calibration section only",
        ),
        (
            lambda r: r["calibrations"]["valid"].update(n_samples=0),
            "calibrations.valid.n_samples: Input should be greater than 0",
        ),
        (
            lambda r: r["calibrations"]["valid"].update(seqlen=8),
            "calibrations.valid.seqlen: unknown key; allowed: data, sources",
        ),
    ],
)
def test_bad_sections_and_names_are_one_line_errors(tmp_path, change, expect):
    with pytest.raises(SpecError) as e:
        spec_of(_with(change), tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and expect in msg, msg


@pytest.mark.parametrize(
    "change, expect",
    [
        (
            lambda r: r.update(dcdm={"apply_to": {"scoring": "REAP"}}),
            f"dcdm.apply_to: {{'scoring': 'REAP'}} matches {REAP_VALID}, calibrated by calibrations.valid; DCDM mixes",
        ),
        (
            lambda r: (
                r.update(seeds=[0, 1]),
                r["grid"].append({"scoring": ["SF"], "grouping": ["RR"], "K": [2], "calibration": "valid"}),
            ),
            "seeds: a selected dense student is repeated on the calibration section's seeds; SF|RR|uniform|K=2 is "
            "calibrated by calibrations.valid",
        ),
        (
            lambda r: (
                r.update(calibration=two_sources("valid", single_source={"apply_to": {"scoring": "REAP"}})),
            ),
            f"calibrations.valid: configuration {REAP_VALID} would be both a single-source variant and a named "
            "calibration's; rename the calibration",
        ),
    ],
)
def test_conflicts_with_other_calibration_features_are_one_line_errors(tmp_path, change, expect):
    raw = _with(change)
    if "dcdm" in raw:  # DCDM mixes named sources
        raw["calibration"] = two_sources()
    spec = spec_of(raw, tmp_path)
    with pytest.raises(SpecError) as e:
        planned(spec)
    msg = str(e.value)
    assert "\n" not in msg and expect in msg, msg


def test_single_source_applies_to_the_calibration_sections_configurations_only(tmp_path):
    raw = copy.deepcopy(SWEEP)
    raw["calibration"] = two_sources(single_source={"n_samples": 4})
    keys = [c["config_key"] for c in planned(spec_of(raw, tmp_path)).configs]
    assert keys == [REAP, REAP_VALID, WEIGHTS, f"{REAP}|calibration=prose", f"{REAP}|calibration=code"]
    raw["calibration"]["single_source"]["apply_to"] = {"scoring": "Weights"}  # only a named one's
    with pytest.raises(
        SpecError, match="matches no configuration of the grid that the calibration section calibrates"
    ):
        planned(spec_of(raw, tmp_path))


# ---- seed001 ---------------------------------------------------------------------------------------------
def test_seed001_calibrates_each_method_as_its_authors_did():
    spec = load_spec(SEED001)[0]
    ctx = planned(spec)
    cal = ctx.jobs["calibrate"]
    by_method: dict[str, Any] = {}
    for c in ctx.configs:
        if c["kind"] == "teacher":
            continue
        method = c.get("scoring") or c.get("editing") or c.get("merging")
        assert "|calibration=" not in c["config_key"]  # one calibration per configuration: plain keys
        by_method.setdefault(method, set()).add(cal[c["config_key"]].key)
    assert all(len(keys) == 1 for keys in by_method.values())  # with and without Router KD: one pass
    job = {m: next(j for j in cal.values() if j.key == next(iter(k))) for m, k in by_method.items()}
    assert len({j.key for j in job.values()}) == 5  # MoBE reads no statistics: it shares REAP's pass
    assert job["MoBE"].key == job["REAP"].key

    def shape(p: dict[str, Any]) -> tuple:
        data = p.get("data") or {}
        srcs = {n: (s["data"]["path"], s["n_samples"]) for n, s in (p.get("sources") or {}).items()}
        return data.get("path"), p.get("n_samples"), srcs, p["seq_len"], p.get("sample_tokens", 0)

    c4 = "allenai/c4"
    assert shape(job["REAP"].params) == (
        None,
        None,
        {"c4": (c4, 1024), "code": ("theblackcat102/evol-codealpaca-v1", 1024)},
        2048,
        0,
    )
    assert job["REAP"].params["sources"]["code"]["data"]["format"] == "chat"
    assert shape(job["CFES"].params) == (
        None,
        None,
        {"c4": (c4, 11), "math": ("open-r1/OpenR1-Math-220k", 11), "code": ("microsoft/rStar-Coder", 10)},
        4096,
        2048,
    )
    assert shape(job["TD-MoE"].params) == (c4, 256, {}, 2048, 0)
    assert shape(job["HC-SMoE"].params) == (c4, 4, {}, 2048, 0)
    assert shape(job["M-SMoE"].params) == (c4, 1024, {}, 512, 0)
    rows = {r["stage"]: r for r in dryrun.plan_counts(spec)[0]}
    assert (rows["calibrate"]["named"], rows["calibrate"]["distinct"]) == (12, 5)
    assert rows["calibrate"]["note"] == (
        "5 passes of token windows: calibration: mixed c4 1024 + code 1024 of 2048; "
        "cfes: mixed c4 11 + math 11 + code 10 of 4096; td_moe: 256 of 2048; hc_smoe: 4 of 2048; m_smoe: 1024 of 512"
    )


def test_seed001s_csv_rows_state_the_calibration_it_plans():
    import csv

    path = HERE.parent / "analysis" / "data" / "method_implementations.csv"
    rows = {r["method"]: r for r in csv.DictReader(path.open()) if r["paper"] == "router_kd"}
    assert "256 whitening samples of 2,048 tokens" in rows["TD-MoE"]["calibration"]
    assert "Number_SENTENCES=4" in rows["HC-SMoE"]["calibration"] and "c4" in rows["HC-SMoE"]["calibration"]
    assert "fits the expert weights" in rows["MoBE"]["calibration"]
    assert "50/50" in rows["REAP"]["calibration"]


# ---- a sweep ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("named_calibrations")
    path = tmp / "named.yaml"
    path.write_text(yaml.safe_dump(SWEEP, sort_keys=False))
    with launched_twice(path, tmp) as launched:
        yield launched


@pytest.mark.slow
def test_each_pruned_moe_is_converted_on_its_calibration(run):
    store = run["store"]
    assert run["code"] == 0
    cal = {
        ck: (key, json.loads(params), json.loads(outputs))
        for ck, key, params, outputs in store.query(
            "SELECT c.config_key, j.key, j.params_json, j.outputs_json FROM config_jobs cj "
            "JOIN configurations c ON c.id = cj.config_id JOIN jobs j ON j.id = cj.job_id "
            "WHERE cj.stage = 'calibrate'"
        )[1]
    }
    assert set(cal) == {REAP, REAP_VALID, WEIGHTS}
    assert cal[REAP_VALID][0] == cal[WEIGHTS][0] != cal[REAP][0]
    assert cal[REAP][2]["n_tokens"] == TRAIN_N * SEQ and cal[REAP][1]["data"]["split"] == "train"
    assert cal[REAP_VALID][2]["n_tokens"] == VALID_N * SEQ and cal[REAP_VALID][1]["data"]["split"] == "valid"
    # what `moesweep sql` reads: each configuration's note names its calibration, and each was measured
    got = dict(
        store.query(
            "SELECT c.config_key, c.note FROM configurations c JOIN results r ON r.config_id = c.id "
            "WHERE r.ppl_pre IS NOT NULL"
        )[1]
    )
    note = f"calibrated by calibrations.valid: {VALID_N} windows of {SEQ} tokens"
    assert got == {REAP: None, REAP_VALID: note, WEIGHTS: note}


@pytest.mark.slow
def test_a_relaunch_runs_nothing(run):
    assert run["code2"] == 0
    assert run["again"] == run["jobs"] and all(status == "succeeded" for *_, status in run["jobs"])
