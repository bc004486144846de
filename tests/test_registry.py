"""The stage and axis registries: a stage added in one module runs in a sweep, shows in the dry run,
status and the schema; axes are typed columns; planning and validation import no torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from sqlalchemy import inspect
from sweep_runs import launch_serial
from typer.testing import CliRunner

from db.store import Store
from orchestrator import dryrun
from orchestrator.axes import AXES
from orchestrator.cli import app
from orchestrator.schema import PosInt, SpecError, Strict
from orchestrator.spec import load_spec
from orchestrator.stage import JobSpec, Stage, SweepContext, get_stage, register, stages, unregister
from tests.test_orchestrator import fake, fake_sweep  # noqa: F401  (the fake stage functions fixture)

ROOT = Path(__file__).resolve().parents[1]


# ---- a toy stage, declared in this one module -------------------------------------------------------
class ToyParams(Strict):
    factor: PosInt = 3


def toy_run(payload: dict, cache: dict, progress) -> dict:
    """A stage's run function: plain payload in (its params, its upstream outputs), plain record out."""
    plan_key = payload["inputs"]["convert"]["plan_key"]
    value = float(len(plan_key) * payload["params"]["factor"])
    return {"outputs": {"toy": value}, "metrics": [{"name": "toy_metric", "stage": "toy", "value": value}]}


def toy_jobs(ctx: SweepContext) -> dict[str, JobSpec]:
    out = {}
    for ck, conv in ctx.jobs.get("convert", {}).items():
        if ctx.succeeded("convert", ck) is not None:
            out[ck] = ctx.job(
                "toy",
                {"factor": ctx.spec.toy.factor, "scoring": ctx.config(ck)["scoring"]},
                {"convert": conv.key},
            )
    return out


TOY = Stage(
    name="toy",
    run=toy_run,
    jobs=toy_jobs,
    section="toy",
    params=ToyParams,
    section_default="default",
    upstream=("convert",),
    records=frozenset({"outputs", "metrics"}),
    summary="a toy stage",
)


@pytest.fixture
def toy():
    register(TOY)
    yield TOY
    unregister("toy")


def test_a_stage_declared_in_one_module_runs_in_a_sweep(fake, toy, tmp_path):  # noqa: F811
    calls, state = fake
    text = (ROOT / "tests" / "sweeps" / "fake.yaml").read_text() + "toy: {factor: 2}\n"
    text = text.replace("execution: {retries: 1}", "execution: {retries: 1, resources: {toy: {cpus: 1}}}")
    sweep = fake_sweep(tmp_path, text)
    spec, path, text = load_spec(str(sweep))
    assert spec.toy.factor == 2  # its section is part of the sweep schema
    store = Store(state["db"])
    state["fail"] = False
    assert launch_serial(spec, text, store, path) == 0
    # one toy job per distinct conversion, each linked to its configurations, its metric in the DB
    n_convert = store.query("SELECT COUNT(*) FROM jobs WHERE stage = 'convert'")[1][0][0]
    rows = store.query("SELECT j.status, j.code_json FROM jobs j WHERE j.stage = 'toy'")[1]
    assert len(rows) == n_convert == 8 and all(s == "succeeded" for s, _ in rows)
    assert all(
        set(json.loads(c)) == {"stage:toy", f"scoring:{sc}"}
        for (_, c), sc in zip(rows, ["SF"] * 4 + ["CP"] * 4, strict=True)
    )
    linked = store.query("SELECT COUNT(*) FROM config_jobs WHERE stage = 'toy'")[1][0][0]
    assert linked == 8
    assert store.query("SELECT COUNT(*) FROM metrics WHERE name = 'toy_metric'")[1][0][0] == 8
    # the dry run, status and `moesweep stages` read the same registry
    assert "toy" in {r["stage"] for r in dryrun.plan_counts(spec)[0]}
    res = CliRunner().invoke(app, ["status", "fake", "--db", state["db"]])
    assert res.exit_code == 0 and "toy" in res.output
    assert "a toy stage" in CliRunner().invoke(app, ["stages"]).output


def test_a_section_key_of_an_unknown_stage_is_an_error(tmp_path):
    text = (ROOT / "tests" / "sweeps" / "fake.yaml").read_text() + "toy: {factor: 2}\n"
    with pytest.raises(SpecError, match="toy: unknown key"):
        load_spec(str(fake_sweep(tmp_path, text)))


def test_a_record_the_stage_does_not_declare_fails_the_job(fake, tmp_path):  # noqa: F811
    calls, state = fake
    register(
        Stage(
            name="toy2",
            run=_bad_record,
            jobs=lambda ctx: {
                ck: ctx.job("toy2", {"n": 1}, {"convert": j.key}) for ck, j in ctx.jobs["convert"].items()
            },
            upstream=("convert",),
            records=frozenset({"outputs"}),
        )
    )
    try:
        spec, path, text = load_spec(str(state["sweep"]))
        state["fail"] = False
        store = Store(state["db"])
        assert launch_serial(spec, text, store, path) == 1
        errors = store.query("SELECT error FROM jobs WHERE stage = 'toy2'")[1]
        assert errors and all("returned ['plan_rows']" in e for (e,) in errors)
    finally:
        unregister("toy2")


def _bad_record(payload: dict, cache: dict, progress) -> dict:
    return {"outputs": {}, "plan_rows": []}


def test_stage_order_follows_upstream_and_rejects_unknown_inputs():
    names = [s.name for s in stages()]
    assert names == [
        "teacher",
        "dense_teacher",
        "calibrate",
        "expert_maxima",
        "dcdm",
        "convert",
        "ppl_pre",
        "seed_convert",
        "seed_ppl",
        "distill",
        "router_kd",
        "evaluate",
        "dot_moe",
    ]
    for s in stages():
        assert all(names.index(u) < names.index(s.name) for u in s.upstream)
    register(Stage(name="orphan", run=_bad_record, jobs=lambda ctx: {}, upstream=("nowhere",)))
    try:
        with pytest.raises(ValueError, match="upstream \\['nowhere'\\] not registered"):
            stages()
    finally:
        unregister("orphan")
    with pytest.raises(ValueError, match="unknown stage 'nope'; allowed: teacher"):
        get_stage("nope")


def test_every_axis_is_a_typed_column_of_configurations_and_results(tmp_path):
    store = Store(f"sqlite:///{tmp_path}/a.db")
    cols = {c["name"]: c["type"] for c in inspect(store.engine).get_columns("configurations")}
    view = {c["name"] for c in inspect(store.engine).get_columns("results")}
    for name, axis in AXES.items():
        assert name in cols and name in view, name
        assert cols[name].python_type is axis.kind, name
    # a registry axis allows exactly the registry's names, read from source without importing it
    import workers.methods.grouping
    import workers.methods.scaling
    import workers.methods.scoring

    runtime = {
        "scoring": workers.methods.scoring.SCORINGS,
        "grouping": workers.methods.grouping.GROUPINGS,
        "dp_scaling": workers.methods.scaling.SCALINGS,
    }
    for name, registry in runtime.items():
        assert AXES[name].allowed() == list(registry), name


@pytest.mark.parametrize(
    "patch, expect",
    [
        ("K: ['4']", "grid.K.0: Input should be a valid integer"),
        ("K: [4.0]", "grid.K.0: Input should be a valid integer"),
        ("K: [true, 4]", "grid.K.0: Input should be a valid integer"),
        ("K: [2, 2, 4]", "grid.K: K 2 is listed twice"),
        ("K: [0]", "grid.K: K must be positive integers"),
    ],
)
def test_grid_values_are_strict(tmp_path, patch, expect):
    text = (ROOT / "tests" / "sweeps" / "fake.yaml").read_text().replace("K: [2, 4]", patch)
    with pytest.raises(SpecError) as e:
        load_spec(str(fake_sweep(tmp_path, text)))
    assert expect in str(e.value) and "\n" not in str(e.value)


def test_the_teacher_shape_comes_from_its_config(fake, tmp_path):  # noqa: F811
    calls, state = fake
    for stated, expect in (
        ({"num_experts": 16}, "teacher.num_experts: 16, but the model's config says 8"),
        ({"top_k": 4}, "teacher.top_k: 4, but the model's config says 2"),
        ({"renormalize": False}, "teacher.renormalize: False, but the model's config says True"),
    ):
        raw = yaml.safe_load((ROOT / "tests" / "sweeps" / "fake.yaml").read_text())
        raw["teacher"].update(stated)
        sweep = fake_sweep(tmp_path, yaml.safe_dump(raw))
        db = tmp_path / "never.db"
        res = CliRunner().invoke(
            app, ["launch", str(sweep), "--db", f"sqlite:///{db}", "--executor", "serial"]
        )
        assert res.exit_code == 2 and expect in res.output, res.output
        assert not db.exists()  # nothing is created for a sweep that cannot run


def test_dry_run_and_sweeps_import_no_torch():
    code = (
        "import sys, time\n"
        "from typer.testing import CliRunner\n"
        "from orchestrator.cli import app\n"
        "t = time.perf_counter()\n"
        "r = CliRunner().invoke(app, ['launch', 'paper-qwen3-30b-a3b', '--dry-run'])\n"
        "assert r.exit_code == 0, r.output\n"
        "assert '350' in r.output and '35' in r.output, r.output\n"
        "r = CliRunner().invoke(app, ['sweeps'])\n"
        "assert r.exit_code == 0 and 'tiny' in r.output, r.output\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'ray')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env={**os.environ, "MOESWEEP_HOME": "/nonexistent-moesweep-home"},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(
    "name",
    [
        "tiny",
        "tiny-moe",
        "paper-qwen3-30b-a3b",
        "paper-deepseek-v2-lite",
        "paper-gpt-oss-20b",
        "seed002-reap-qwen3-30b-a3b",
        "seed001-router-kd-qwen3-30b-a3b",
    ],
)
def test_every_named_sweep_is_planned_by_the_dry_run(name):
    from orchestrator.spec import list_sweeps

    assert name in list_sweeps()
    spec, _, _ = load_spec(name)
    rows = {r["stage"]: r for r in dryrun.plan_counts(spec)[0]}
    passes = 5 if name.startswith("seed001") else 1  # seed001 calibrates each method as its authors did
    assert rows["calibrate"]["distinct"] == passes and rows["convert"]["named"] >= 1 and "evaluate" in rows
