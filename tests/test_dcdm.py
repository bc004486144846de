"""Dynamic Calibration Dataset Mixing ("Compressing Large MoE Models via Efficient Pruning and Data-Aware
Calibration", §4.2, Algorithm 2): the softmax update and the stopping rule on hand numbers, the mix of
the DCDM weights, a run on the tiny teacher's two domains (prose, code) through a whole sweep, and the
sweep file's errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from sweep_runs import launch_serial, spec_of

from orchestrator.spec import SpecError, load_spec
from workers.calibration.dcdm import DCDMSpec, sample_counts, softmax_weights, stop_reason

HERE = Path(__file__).parent
SWEEP = HERE / "sweeps" / "dcdm.yaml"
MOE = "moe|REAP|K=3|recovery=none"
MIX = f"{MOE}|calibration=dcdm"


# ---- the update and the stopping rule ---------------------------------------------------------------
def test_softmax_update_on_hand_numbers():
    w = softmax_weights({"code": 1.0, "math": 0.0, "web": 0.0})
    e = math.e
    assert w == pytest.approx({"code": e / (e + 2), "math": 1 / (e + 2), "web": 1 / (e + 2)}, rel=1e-12)
    # the paper's reported 2:1:1 needs d_code − d_math = ln 2 (no temperature)
    assert softmax_weights({"code": math.log(2), "math": 0.0, "web": 0.0}) == pytest.approx(
        {"code": 0.5, "math": 0.25, "web": 0.25}, rel=1e-12
    )
    # τ = 0.5 doubles the differences; a common shift changes nothing; large d does not overflow
    assert softmax_weights({"a": 1.0, "b": 0.0}, 0.5)["a"] == pytest.approx(e**2 / (e**2 + 1), rel=1e-12)
    assert softmax_weights({"a": 1001.0, "b": 1000.0}) == pytest.approx(softmax_weights({"a": 1.0, "b": 0.0}))
    with pytest.raises(ValueError, match="not finite"):
        softmax_weights({"a": float("nan"), "b": 0.0})


def test_largest_remainder_counts():
    assert sample_counts({"a": 0.5, "b": 0.3, "c": 0.2}, 32) == {"a": 16, "b": 10, "c": 6}  # 16, 9.6, 6.4
    assert sample_counts({"a": 0.5, "b": 0.25, "c": 0.25}, 32) == {
        "a": 16,
        "b": 8,
        "c": 8,
    }  # the paper's 2:1:1
    assert sample_counts({"a": 1 / 3, "b": 1 / 3, "c": 1 / 3}, 32) == {
        "a": 11,
        "b": 11,
        "c": 10,
    }  # ties: order
    assert sample_counts({"a": 0.99, "b": 0.01}, 10) == {"a": 9, "b": 1}  # at least one per domain
    assert sample_counts({"a": 0.99, "b": 0.01}, 1) == {"a": 1, "b": 0}  # unless n is too small


def test_stopping_rule_on_hand_numbers():
    a, b = {"x": 0.5, "y": 0.5}, {"x": 0.8, "y": 0.2}  # counts of 4: (2, 2) and (3, 1)
    assert stop_reason([a], 4, 1e-3) is None
    assert stop_reason([a, b], 4, 1e-3) is None
    assert stop_reason([a, {"x": 0.55, "y": 0.45}], 4, 1e-3) == "counts"  # (2, 2) again
    # counts that differ (500400 vs 500000 of 10⁶) but no weight moved by tol
    assert stop_reason([a, {"x": 0.5004, "y": 0.4996}], 10**6, 1e-3) == "tol"
    back = {"x": 0.45, "y": 0.55}  # quotas 1.8, 2.2 -> (2, 2): the counts of round 0, not of round 1
    assert stop_reason([a, b, back], 4, 1e-3) == "cycle"
    assert stop_reason([a, b, {"x": 0.7, "y": 0.3}], 4, 1e-3) == "counts"


def _two_domain_loop(monkeypatch, spec: DCDMSpec, n_samples: int, tmp_path: Path, state: dict):
    """run_dcdm over two stub domains, code and prose (10 tokens each, no model: the test fakes compress
    and domain_discrepancy), with `state["round"]` following the loop's progress."""
    import workers.calibration.dcdm as D

    monkeypatch.setattr("workers.calibration.calibrate.source_tokens", lambda stats: 10)
    return D.run_dcdm(
        None,
        None,
        {"code": {0: None}, "prose": {0: None}},
        {"code": "code", "prose": "prose"},
        spec,
        n_samples,
        {},
        tmp_path,
        "cpu",
        progress=lambda i, n: state.update(round=i),
    )


def test_the_loop_stops_on_a_two_cycle(monkeypatch, tmp_path):
    """Discrepancies that flip with the round (the domain given more data is then served better) make the
    weights oscillate between two mixes: the loop stops when an earlier round's counts come back, with the
    last round's weights (those its compression used), every round logged."""
    import workers.calibration.dcdm as D

    state = {"round": 0}

    def fake_compress(model, adapter, per_source, weights, params, workdir):
        return [dict(weights)], torch.nn.Identity(), workdir / "plan.json"

    def fake_discrepancy(teacher, student, domain, batch_size, device):
        worse = "code" if state["round"] % 2 == 0 else "prose"  # code on rounds 1, 3, …; prose on 2, 4, …
        return {"kl": 2.0 if domain == worse else 0.0, "nll_teacher": 1.0, "nll_student": 1.0, "tokens": 1}

    monkeypatch.setattr(D, "compress", fake_compress)
    monkeypatch.setattr(D, "domain_discrepancy", fake_discrepancy)
    res = _two_domain_loop(monkeypatch, DCDMSpec(max_iters=10), 32, tmp_path, state)
    hi = math.exp(2) / (math.exp(2) + 1)
    used = [r["weights"] for r in res.rounds]
    assert used[0] == {"code": 0.5, "prose": 0.5}
    assert used[1]["code"] == pytest.approx(hi) and used[2]["code"] == pytest.approx(1 - hi)
    assert [r["counts"] for r in res.rounds] == [
        {"code": 16, "prose": 16},
        {"code": 28, "prose": 4},
        {"code": 4, "prose": 28},
    ]
    assert res.stop == "cycle" and len(res.rounds) == 3  # w³ = w¹: counts (28, 4) again
    assert res.trajectory[3] == pytest.approx(used[1])
    assert res.weights == used[2] and res.plans == [used[2]]


def test_the_loop_runs_to_max_iters_when_the_weights_keep_moving(monkeypatch, tmp_path):
    import workers.calibration.dcdm as D

    state = {"round": 0}
    monkeypatch.setattr(
        D, "compress", lambda m, a, p, w, params, wd: ([w], torch.nn.Identity(), wd / "p.json")
    )
    monkeypatch.setattr(
        D,
        "domain_discrepancy",
        lambda t, s, domain, bs, dev: {
            "kl": 0.0,
            "nll_teacher": 1.0,
            "nll_student": 1.0 + (0.3 * (state["round"] + 1) if domain == "code" else 0.0),
            "tokens": 1,
        },
    )
    res = _two_domain_loop(monkeypatch, DCDMSpec(max_iters=3, metric="log_ppl"), 1000, tmp_path, state)
    assert res.stop == "max_iters" and len(res.rounds) == 3
    assert [round(r["discrepancy"]["code"], 12) for r in res.rounds] == [0.3, 0.6, 0.9]  # the log-ppl gap


# ---- mixing with the DCDM weights ----------------------------------------------------------------------
def test_mixing_with_dcdm_weights_is_the_hand_reweighting(tmp_path):
    from test_calibration_mixture import synthetic

    from workers.calibration.calibrate import STAT_FIELDS, load_stats, save_source_stats

    a, b = synthetic(10, 1), synthetic(30, 2)
    path = tmp_path / "stats.safetensors"
    save_source_stats({"prose": {0: a}, "code": {0: b}}, {"prose": 1.0, "code": 1.0}, path)
    w = softmax_weights({"prose": 0.2, "code": 0.2 + math.log(4)})  # code 0.8, prose 0.2
    mixed = load_stats(path, weights=w)[0]
    lam_a, lam_b = 0.2 * 40 / 10, 0.8 * 40 / 30  # λ_s = w_s · N / N_s
    assert mixed.n_tokens == 40
    for name in STAT_FIELDS:
        want = (
            torch.maximum(getattr(a, name), getattr(b, name))
            if name == "max_norm_sel"
            else lam_a * getattr(a, name) + lam_b * getattr(b, name)
        )
        torch.testing.assert_close(getattr(mixed, name), want, rtol=1e-12, atol=0, msg=name)


# ---- a sweep -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from db.store import Store

    tmp = tmp_path_factory.mktemp("dcdm")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MOESWEEP_HOME", str(tmp / "home"))
        spec, path, text = load_spec(str(SWEEP))
        store = Store(f"sqlite:///{tmp}/r.db")
        code = launch_serial(spec, text, store, path)
        yield {"code": code, "store": store, "spec": spec}


def _rows(store, sql: str, **params) -> list[tuple]:
    return store.query(sql, params)[1]


def _dcdm_outputs(store) -> dict:
    ((out,),) = _rows(store, "SELECT outputs_json FROM jobs WHERE stage = 'dcdm'")
    return json.loads(out)


@pytest.mark.slow
def test_every_round_is_in_the_database(run):
    store = run["store"]
    assert run["code"] == 0
    out = _dcdm_outputs(store)
    n = out["rounds"]
    assert 1 <= n <= 6 and out["stop"] in ("counts", "tol", "cycle", "max_iters")
    weights = _rows(
        store,
        "SELECT m.task, m.step, m.value FROM config_metrics m JOIN results r "
        "ON r.config_id = m.config_id WHERE r.config_key = :k AND m.name = 'dcdm_weight'",
        k=MOE,
    )
    assert sorted((t, s) for t, s, _ in weights) == sorted(
        (t, s) for s in range(n + 1) for t in ("code", "prose")
    )
    for task, step, value in weights:
        assert value == pytest.approx(out["trajectory"][step][task], rel=1e-12)
    disc = _rows(
        store,
        "SELECT m.task, m.step, m.value FROM config_metrics m JOIN results r "
        "ON r.config_id = m.config_id WHERE r.config_key = :k AND m.name = 'dcdm_discrepancy'",
        k=MOE,
    )
    assert len(disc) == 2 * n
    for task, step, value in disc:
        assert value == pytest.approx(out["history"][step - 1]["discrepancy"][task], rel=1e-12)
    ppl = _rows(
        store,
        "SELECT m.task, m.who, m.step FROM config_metrics m JOIN results r "
        "ON r.config_id = m.config_id WHERE r.config_key = :k AND m.name = 'dcdm_ppl'",
        k=MOE,
    )
    assert (
        len([r for r in ppl if r[1] == "student"]) == 2 * n
        and len([r for r in ppl if r[1] == "teacher"]) == 2
    )
    # the dense configuration is not in apply_to: no DCDM there
    assert not _rows(
        store,
        "SELECT 1 FROM config_metrics m JOIN results r ON r.config_id = m.config_id "
        "WHERE r.config_key = 'SF|RR|uniform|K=2' AND m.name LIKE 'dcdm%'",
    )
    assert not _rows(store, "SELECT 1 FROM results WHERE config_key = 'SF|RR|uniform|K=2|calibration=dcdm'")


@pytest.mark.slow
def test_weights_move_toward_the_domain_served_worst(run):
    store = run["store"]
    out = _dcdm_outputs(store)
    d1 = out["history"][0]["discrepancy"]
    worst, best = max(d1, key=d1.get), min(d1, key=d1.get)
    assert d1[worst] > d1[best] * 1.05, d1  # the two domains are served differently
    w0, w1 = out["trajectory"][0], out["trajectory"][1]
    assert w0 == {"code": 0.5, "prose": 0.5}
    assert w1[worst] > 0.5 > w1[best]
    assert w1 == pytest.approx(softmax_weights(d1, 0.01), rel=1e-12)
    assert out["weights"][worst] > 0.5  # the final mix kept the move


@pytest.mark.slow
def test_the_logged_discrepancy_is_the_kl_of_the_round_one_student(run):
    """Recomputed apart: the teacher and the pruned MoE of round 1's plan on the code domain's held-out
    windows, KL(teacher ‖ student) per token in float64."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from workers.core.data import DataSpec, load_texts, token_windows
    from workers.families import get_adapter

    store = run["store"]
    out = _dcdm_outputs(store)
    ((teacher_out,),) = _rows(store, "SELECT outputs_json FROM jobs WHERE stage = 'teacher'")
    tdir = json.loads(teacher_out)["path"]
    teacher = AutoModelForCausalLM.from_pretrained(tdir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tdir)
    plans = json.loads((Path(out["plan_path"]).parent.parent / "round1" / "plan.json").read_text())
    student = get_adapter(teacher).pruned_moe_student(
        teacher, {p["layer"]: sorted(p["selected"]) for p in plans}
    )
    d = run["spec"].dcdm.settings
    texts = load_texts(DataSpec(source="tiny", split="valid:code"), tiny_dir=tdir)
    ids = token_windows(tok, texts, run["spec"].calibration.seq_len, d["n_eval"], d["seed"])
    with torch.no_grad():
        lt = torch.log_softmax(teacher(input_ids=ids).logits[:, :-1].double(), -1)
        ls = torch.log_softmax(student.eval()(input_ids=ids).logits[:, :-1].double(), -1)
    kl = torch.nn.functional.kl_div(ls, lt, log_target=True, reduction="sum").item() / ls[..., 0].numel()
    assert out["history"][0]["discrepancy"]["code"] == pytest.approx(kl, rel=1e-4)


@pytest.mark.slow
def test_the_final_mixture_is_a_configuration_of_its_own(run):
    store = run["store"]
    out = _dcdm_outputs(store)
    ((variant, note, ppl, acc, plan_key),) = _rows(
        store,
        "SELECT r.variant, c.note, r.ppl_pre, r.avg_acc, r.plan_key FROM results r JOIN configurations c "
        "ON c.id = r.config_id WHERE r.config_key = :k",
        k=MIX,
    )
    assert variant == "calibration=dcdm" and MOE in note and out["stop"] in note
    assert ppl is not None and math.isfinite(ppl) and acc is not None  # ppl_pre and evaluate ran for it
    assert _rows(
        store,
        "SELECT 1 FROM config_jobs cj JOIN results r ON r.config_id = cj.config_id "
        "WHERE r.config_key = :k AND cj.stage = 'ppl_pre'",
        k=MIX,
    )
    # its conversion mixes the statistics with the DCDM weights and so reproduces DCDM's final plan
    convert = {
        k: json.loads(p)
        for k, p in _rows(
            store,
            "SELECT r.config_key, j.params_json FROM config_jobs cj JOIN results r ON r.config_id = cj.config_id "
            "JOIN jobs j ON j.id = cj.job_id WHERE cj.stage = 'convert'",
        )
    }
    assert convert[MIX]["calibration_weights"] == out["weights"]
    assert (
        "calibration_weights" not in convert[MOE]
        and "calibration_weights" not in convert["SF|RR|uniform|K=2"]
    )
    assert plan_key == out["plan_key"]
    ((base_plan,),) = _rows(store, "SELECT plan_key FROM results WHERE config_key = :k", k=MOE)
    assert out["history"][0]["plan_key"] == base_plan  # round 1 mixes 1:1, the calibration's own weights


@pytest.mark.slow
def test_the_dcdm_weights_mix_the_calibration_file(run):
    from test_calibration_mixture import assert_same

    from workers.calibration.calibrate import load_source_stats, load_stats, mix_stats

    store = run["store"]
    w = _dcdm_outputs(store)["weights"]
    ((calib,),) = _rows(store, "SELECT outputs_json FROM jobs WHERE stage = 'calibrate'")
    path = json.loads(calib)["stats"]
    per = load_source_stats(path)
    mixed, want = load_stats(path, weights=w), mix_stats(per, w)
    for layer in want:
        assert_same(mixed[layer], want[layer], exact=False)
    n = {name: next(iter(s.values())).n_tokens for name, s in per.items()}
    lam = {name: w[name] / sum(w.values()) * sum(n.values()) / n[name] for name in w}
    layer = min(want)
    torch.testing.assert_close(mixed[layer].count, sum(lam[s] * per[s][layer].count for s in per))


def test_existing_configurations_keep_their_keys(tmp_path):
    """A dcdm section adds jobs; the convert jobs of the grid's configurations stay the same."""
    from orchestrator import dryrun
    from orchestrator.stage import SweepContext

    spec, _, _ = load_spec(str(SWEEP))
    raw = yaml.safe_load(SWEEP.read_text())
    del raw["dcdm"]
    plain = spec_of(raw, tmp_path)
    shape = dryrun.P.stated_shape(spec)

    def convert_keys(s) -> dict[str, str]:
        ctx = SweepContext(s, shape, dryrun.P.build_configs(s, shape))
        from orchestrator.stage import stages

        for st in stages():
            ctx.jobs[st.name] = st.jobs(ctx) if st.name in ("teacher", "calibrate", "dcdm", "convert") else {}
        return {k: j.key for k, j in ctx.jobs["convert"].items()}

    assert convert_keys(spec) == convert_keys(plain)
    rows = {r["stage"]: r for r in dryrun.plan_counts(spec)[0]}
    assert rows["dcdm"]["named"] == 1


# ---- errors ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "change, expect",
    [
        # the settings: DCDMSpec's own checks, then the field's type as strictly as the schema's own fields
        ({"temperature": 0}, "dcdm.temperature: must be a finite number > 0 (got 0)"),
        ({"temperature": float("inf")}, "dcdm.temperature: must be a finite number > 0 (got inf)"),
        ({"temperature": True}, "dcdm.temperature: must be a number (got True)"),
        ({"temperature": 10**400}, "dcdm.temperature: must be a finite number (got 1000"),
        ({"tol": -1}, "dcdm.tol: must be a finite number >= 0 (got -1)"),
        ({"metric": "l2"}, "dcdm.metric: allowed kl, log_ppl (got 'l2')"),
        ({"w0": "sizes"}, "dcdm.w0: allowed uniform, tokens (got 'sizes')"),
        ({"max_iters": 0}, "dcdm.max_iters: must be a positive integer (got 0)"),
        ({"max_iters": 2.0}, "dcdm.max_iters: must be a positive integer (got 2.0)"),
        ({"max_iters": True}, "dcdm.max_iters: must be an integer (got True)"),
        ({"n_eval": -1}, "dcdm.n_eval: must be a positive integer (got -1)"),
        ({"seq_len": 1}, "dcdm.seq_len: must be an integer >= 2 (got 1)"),
        ({"seed": "x"}, "dcdm.seed: must be an integer (got 'x')"),
        ({"seed": False}, "dcdm.seed: must be an integer (got False)"),
        ({"colour": 1}, "dcdm.colour: unknown key"),
        ({"settings": {"metric": "kl"}}, "dcdm.settings: unknown key"),  # the settings are flat keys
        ({"apply_to": {"colour": "red"}}, "dcdm.apply_to: 'colour' is not an axis; allowed: output, scoring"),
        ({"apply_to": {"K": []}}, "dcdm.apply_to: K: a value or a non-empty list of values"),
        (
            {"held_out": {"web": {"source": "tiny"}}},
            "dcdm: held_out: 'web' is not a calibration source; allowed: prose, code",
        ),
        (
            {"held_out": {"code": {"source": "tiny", "split": "valid:math"}}},
            "dcdm.held_out: code: split='valid:math': the tiny corpus has domains prose, code",
        ),
        ({"held_out": {"code": {"source": "jsonl"}}}, "dcdm.held_out.code: source 'jsonl' needs a path"),
    ],
)
def test_malformed_dcdm_sections_are_one_line(tmp_path, change, expect):
    raw = yaml.safe_load(SWEEP.read_text())
    raw["dcdm"] = {**raw["dcdm"], **change}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    with pytest.raises(SpecError) as e:
        load_spec(str(path))
    assert "\n" not in str(e.value)
    assert f"{path}: {expect}" in str(e.value), str(e.value)


def test_the_settings_are_complete_job_parameters_of_their_declared_types(tmp_path):
    """The section's settings are DCDMSpec's fields, checked by DCDMSpec: the job parameters hold every
    one (DCDMSpec's defaults filled, seq_len from the calibration when not given), each of its declared
    type (an integer temperature is a float), in DCDMSpec's order, as they were when the section declared
    them itself; so the dcdm job keys stay."""
    from orchestrator import configs as P
    from orchestrator.stage import SweepContext
    from orchestrator.stages.dcdm import dcdm_params

    raw = yaml.safe_load(SWEEP.read_text())
    want = {
        "w0": "uniform",
        "metric": "kl",
        "temperature": 0.01,
        "max_iters": 6,
        "tol": 0.001,
        "n_eval": 4,
        "seq_len": 64,  # calibration.seq_len
        "batch_size": 8,
        "seed": 4321,
    }
    for change, expect in [
        ({}, {}),
        ({"temperature": 2, "tol": 0}, {"temperature": 2.0, "tol": 0.0}),
        ({"seq_len": None, "seed": -3}, {"seed": -3}),
        (
            {"seq_len": 32, "w0": "tokens", "metric": "log_ppl"},
            {"seq_len": 32, "w0": "tokens", "metric": "log_ppl"},
        ),
    ]:
        spec = spec_of({**raw, "dcdm": {**raw["dcdm"], **change}}, tmp_path)
        shape = P.stated_shape(spec)
        ctx = SweepContext(spec, shape, P.build_configs(spec, shape))
        got = dcdm_params(ctx, ctx.config(MOE))["dcdm"]
        assert json.dumps(got) == json.dumps({**want, **expect}), change  # values, types and order
        assert [type(v) for v in got.values()] == [str, str, float, int, float, int, int, int, int]
        assert DCDMSpec(**got) == DCDMSpec(**{**want, **expect})  # what the worker builds from them


def test_the_settings_are_read_from_dcdm_spec_without_torch():
    """The schema checks the settings with the worker's own DCDMSpec (workers.calibration.dcdm_spec, a
    torch-free module the DCDM run imports too), and loading a sweep imports neither torch nor transformers."""
    import subprocess
    import sys

    from orchestrator.stages.dcdm import dcdm_spec

    assert dcdm_spec() is DCDMSpec
    code = (
        "import sys\n"
        "from orchestrator.spec import load_spec\n"
        f"assert load_spec({str(SWEEP)!r})[0].dcdm.settings['max_iters'] == 6\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=HERE.parent, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_dcdm_needs_two_calibration_sources(tmp_path):
    raw = yaml.safe_load(SWEEP.read_text())
    raw["calibration"] = {"data": {"source": "tiny", "split": "train"}, "n_samples": 16}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    with pytest.raises(
        SpecError,
        match=r"bad.yaml: dcdm: needs calibration.sources with at least 2 named "
        r"sources \(DCDM mixes domains\)$",
    ):
        load_spec(str(path))


def test_apply_to_that_matches_nothing_is_an_error_of_the_plan(tmp_path):
    from orchestrator import dryrun

    raw = yaml.safe_load(SWEEP.read_text())
    raw["dcdm"]["apply_to"] = {"output": "merged"}
    spec = spec_of(raw, tmp_path)
    with pytest.raises(SpecError, match=r"^dcdm.apply_to: \{'output': 'merged'\} matches no configuration"):
        dryrun.plan_counts(spec)
