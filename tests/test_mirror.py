"""execution.mirror and `moesweep mirror`: finished jobs' curves in TensorBoard, W&B and MLflow
(orchestrator/mirror.py).

The TensorBoard runs of a real (test-size) launch are read back frame by frame (TFRecord: length, masked
CRC-32C, an Event proto of tensorboardX's bundled protos) and compared with the database's stepped
metrics. W&B and MLflow are not installed here: fake modules in sys.modules record what our adapters ask
of them, with the trackers' rules that matter (W&B drops a step below a resumed run's counter; MLflow
searches active runs by tag).
"""

from __future__ import annotations

import io
import math
import os
import re
import struct
import sys
import types
from collections import namedtuple
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console
from typer.testing import CliRunner

from db.store import Store
from orchestrator import mirror as M
from orchestrator.cli import app
from orchestrator.execute import SerialExecutor
from orchestrator.launch import launch
from orchestrator.scope import Scope
from orchestrator.spec import SpecError, load_spec
from tests.test_orchestrator import HERE, fake, fake_sweep  # noqa: F401  (the fake stage functions fixture)

SWEEP = """extends: {micro}
name: mirrored
dense_teacher: null
grid: {{scoring: [SF], grouping: [RR], dp_scaling: [uniform], K: [2]}}
baselines: []
distill:
  settings: {{steps: 4, batch_size: 4, seq_len: 64, lr: 1.0e-3, min_lr: 1.0e-4, warmup: 1, eval_every: 2,
             val_windows: 4}}
execution: {{retries: 0, mirror: {{tensorboard: {tb}}}}}
"""
TOL = {"rtol": 1e-6, "atol": 1e-6}  # TensorBoard keeps a scalar as float32; the database a float64


# ---- reading event files back ---------------------------------------------------------------------------
def _masked(crc: int) -> int:
    """TFRecord's masked CRC-32C of a frame part."""
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def read_events(run_dir: Path) -> tuple[dict[str, list[tuple[int, float]]], dict[str, Any], list[str]]:
    """({tag: [(step, value)]}, {hyperparameter: value}, the metric tags of the hparams experiment) of the one
    event file in `run_dir`, every frame's length and payload checked against their CRCs."""
    from tensorboardX.crc32c import crc32c
    from tensorboardX.proto.event_pb2 import Event
    from tensorboardX.proto.plugin_hparams_pb2 import HParamsPluginData

    files = sorted(run_dir.iterdir())
    assert [f.name[: len(M.EVENTS)] for f in files] == [M.EVENTS], files
    data = files[0].read_bytes()
    scalars: dict[str, list[tuple[int, float]]] = {}
    hparams: dict[str, Any] = {}
    metric_tags: list[str] = []
    pos = 0
    while pos < len(data):
        header = data[pos : pos + 8]
        (length,) = struct.unpack("<Q", header)
        assert struct.unpack("<I", data[pos + 8 : pos + 12])[0] == _masked(crc32c(header))
        body = data[pos + 12 : pos + 12 + length]
        assert struct.unpack("<I", data[pos + 12 + length : pos + 16 + length])[0] == _masked(crc32c(body))
        pos += 16 + length
        event = Event.FromString(body)
        if not event.HasField("summary"):
            continue
        for v in event.summary.value:
            if v.metadata.plugin_data.plugin_name == "hparams":
                content = HParamsPluginData.FromString(v.metadata.plugin_data.content)
                if content.HasField("session_start_info"):
                    for k, hv in content.session_start_info.hparams.items():
                        hparams[k] = getattr(hv, hv.WhichOneof("kind"))
                if content.HasField("experiment"):
                    metric_tags += [m.name.tag for m in content.experiment.metric_infos]
            else:
                scalars.setdefault(v.tag, []).append((event.step, v.simple_value))
    assert pos == len(data)
    return scalars, hparams, metric_tags


def db_curves(store: Store, sweep: str, key: str) -> dict[str, list[tuple[int, float]]]:
    """{name/who: [(step, value)]} of a job's stepped training metrics, straight from the database."""
    _, rows = store.query(
        "SELECT m.name, m.who, m.step, m.value FROM metrics m JOIN jobs j ON j.id = m.job_id "
        "WHERE j.key = :k AND m.step >= 0 ORDER BY m.step",
        {"k": key},
    )
    out: dict[str, list[tuple[int, float]]] = {}
    for name, who, step, value in rows:
        out.setdefault(f"{name}/{who}", []).append((step, value))
    return out


def assert_same_curves(got: dict[str, list[tuple[int, float]]], want: dict[str, list[tuple[int, float]]]):
    assert sorted(got) == sorted(want)
    for tag in want:
        assert [s for s, _ in got[tag]] == [s for s, _ in want[tag]], tag
        torch.testing.assert_close(
            torch.tensor([v for _, v in got[tag]], dtype=torch.float64),
            torch.tensor([v for _, v in want[tag]], dtype=torch.float64),
            equal_nan=True,
            **TOL,
        )


# ---- a real launch, mirrored as it runs -----------------------------------------------------------------
@pytest.fixture(scope="module")
def micro(tmp_path_factory):
    """The micro sweep cut to one configuration, launched up to distillation with execution.mirror set."""
    root = tmp_path_factory.mktemp("mirror")
    old = os.environ.get("MOESWEEP_HOME")
    os.environ["MOESWEEP_HOME"] = str(root / "home")
    try:
        sweep = root / "mirrored.yaml"
        sweep.write_text(SWEEP.format(micro=HERE / "sweeps" / "micro.yaml", tb=root / "tb"))
        spec, path, text = load_spec(str(sweep))
        store = Store(f"sqlite:///{root}/m.db")
        buf = io.StringIO()
        kw = dict(show_progress=False, path=str(path), scope=Scope(until="distill"))
        code = launch(spec, text, store, SerialExecutor(), console=Console(file=buf, width=300), **kw)
        keys = dict(store.query("SELECT stage, key FROM jobs WHERE status = 'succeeded'")[1])
        yield {"store": store, "root": root, "code": code, "console": buf.getvalue(), "keys": keys}
    finally:
        if old is None:
            os.environ.pop("MOESWEEP_HOME", None)
        else:
            os.environ["MOESWEEP_HOME"] = old


def test_a_launch_mirrors_each_finished_job_to_tensorboard(micro):
    assert micro["code"] == 0 and "warning" not in micro["console"]
    store, keys = micro["store"], micro["keys"]
    tb = micro["root"] / "tb" / "mirrored"
    distill = tb / "distill" / f"SF_RR_uniform_K=2-{keys['distill'][:12]}"
    teacher = tb / "teacher" / f"teacher-{keys['teacher'][:12]}"
    # the jobs with curves, each its own run; the others (calibration, conversion, ppl) none
    assert sorted(p.relative_to(tb) for p in tb.glob("*/*")) == sorted(
        p.relative_to(tb) for p in (distill, teacher)
    )
    scalars, hparams, metric_tags = read_events(distill)
    want = db_curves(store, "mirrored", keys["distill"])
    assert sorted(want) == ["train_loss/student", "val_ce/student", "val_ce/teacher"]
    assert [s for s, _ in want["val_ce/student"]] == [0, 2, 4] and len(want["train_loss/student"]) == 4
    assert_same_curves(scalars, want)
    assert metric_tags == []  # no experiment summary: TensorBoard gathers one from all runs
    # the configuration's fields and the distillation's settings, as the sweep states them
    assert hparams["configuration"] == "SF|RR|uniform|K=2" and hparams["stage"] == "distill"
    assert hparams["job"] == keys["distill"] and hparams["sweep"] == "mirrored"
    assert hparams["config.scoring"] == "SF" and hparams["config.grouping"] == "RR"
    assert hparams["config.K"] == 2 and hparams["config.kind"] == "moe2dense"
    assert hparams["settings.steps"] == 4 and hparams["settings.eval_every"] == 2
    assert hparams["settings.lr"] == pytest.approx(1e-3, rel=1e-12)
    assert hparams["data.split"] == "train" and hparams["val_data.split"] == "valid"
    # a shared job (the teacher serves every configuration) is labelled by its stage, no configuration's
    scalars, hparams, _ = read_events(teacher)
    assert_same_curves(scalars, db_curves(store, "mirrored", keys["teacher"]))
    assert len(scalars["train_loss/teacher"]) == 40
    assert hparams["configuration"] == "teacher" and not [k for k in hparams if k.startswith("config.")]


def test_a_relaunch_mirrors_nothing_it_did_not_run(micro):
    store, root = micro["store"], micro["root"]
    before = sorted(p.relative_to(root / "tb") for p in (root / "tb").rglob("*"))
    spec, path, text = load_spec(str(root / "mirrored.yaml"))
    kw = dict(show_progress=False, path=str(path), scope=Scope(until="distill"))
    assert launch(spec, text, store, SerialExecutor(), console=Console(quiet=True), **kw) == 0
    assert sorted(p.relative_to(root / "tb") for p in (root / "tb").rglob("*")) == before


def test_moesweep_mirror_writes_the_same_runs_again_without_duplicates(micro, tmp_path):
    db = f"sqlite:///{micro['root']}/m.db"
    keys = micro["keys"]
    out = tmp_path / "tb"
    args = ["mirror", "mirrored", "--tensorboard", str(out), "--db", db]
    for _ in range(2):  # the second writes every run's folder again: one event file each, as many points
        res = CliRunner().invoke(app, args)
        assert res.exit_code == 0 and res.stderr == "", res.output
        assert res.stdout == f"sweep mirrored: 2 run(s) mirrored to tensorboard {out}\n"
    runs = sorted(out.glob("mirrored/*/*"))
    assert [p.name for p in runs] == [
        f"SF_RR_uniform_K=2-{keys['distill'][:12]}",
        f"teacher-{keys['teacher'][:12]}",
    ]
    launched = micro["root"] / "tb" / "mirrored"
    for run in runs:  # exact: the same stored numbers, each made a float32 the same way
        assert read_events(run) == read_events(launched / run.parent.name / run.name)
    # without an option: the trackers of the sweep's stored execution.mirror
    res = CliRunner().invoke(app, ["mirror", "mirrored", "--db", db])
    assert res.exit_code == 0 and res.stdout.endswith(f"to tensorboard {micro['root'] / 'tb'}\n")


def test_a_run_folder_holding_other_files_is_left_alone(micro, tmp_path):
    db = f"sqlite:///{micro['root']}/m.db"
    out = tmp_path / "tb"
    assert (
        CliRunner().invoke(app, ["mirror", "mirrored", "--tensorboard", str(out), "--db", db]).exit_code == 0
    )
    (run,) = out.glob("mirrored/distill/*")
    (run / "notes.txt").write_text("mine")
    res = CliRunner().invoke(app, ["mirror", "mirrored", "--tensorboard", str(out), "--db", db])
    assert res.exit_code == 1
    warning, error = res.stderr.splitlines()
    assert warning.startswith(f"warning: mirror to tensorboard of distill {micro['keys']['distill'][:12]} ")
    assert warning.endswith("holds other files than event files (notes.txt): left as it is")
    assert error == "error: mirror: 1 run(s) could not be written (the warnings above say why)"
    assert (run / "notes.txt").read_text() == "mine" and len(list(run.glob(M.EVENTS + "*"))) == 1


def test_moesweep_mirror_refuses_in_one_line(micro, tmp_path, monkeypatch):
    db = f"sqlite:///{micro['root']}/m.db"
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed (whatever this machine has)
    cases = {
        ("nope", "--tensorboard", str(tmp_path)): f"error: no sweep 'nope' in {micro['root']}/m.db",
        (
            "mirrored",
            "--wandb",
            "me/proj",
        ): "error: mirror: --wandb: needs the wandb package: pip install wandb",
        ("mirrored", "--tensorboard", "s3://b/x"): "error: mirror: --tensorboard: 's3://b/x' is a URL",
        ("mirrored", "--wandb", "a/b/c"): "error: mirror: --wandb: expected a W&B project",
    }
    for args, want in cases.items():
        res = CliRunner().invoke(app, ["mirror", *args, "--db", db])
        assert res.exit_code == 2 and res.stderr.startswith(want) and res.stderr.count("\n") == 1, res.stderr


# ---- W&B and MLflow, through fake modules -----------------------------------------------------------------
class FakeWandb(types.ModuleType):
    """What our adapter asks of wandb: init (a run of an id is resumed with resume='allow', its step counter
    at its last step + 1), config.update, log (a step below the counter is refused, as W&B drops it), finish."""

    def __init__(self) -> None:
        super().__init__("wandb")
        self.stored: dict[str, dict[str, Any]] = {}
        self.inits: list[dict[str, Any]] = []

    def Settings(self, **kw: Any) -> dict[str, Any]:  # noqa: N802  (wandb's name)
        return kw

    def init(self, **kw: Any) -> Any:
        self.inits.append(kw)
        resumed = kw["id"] in self.stored
        assert not resumed or kw["resume"] == "allow"
        rec = self.stored.setdefault(kw["id"], {"history": [], "config": {}, "finished": 0})

        class Config:
            def update(self, values: dict[str, Any], allow_val_change: bool = False) -> None:
                assert allow_val_change or not set(values) & set(rec["config"])
                rec["config"].update(values)

        run = types.SimpleNamespace(config=Config(), resumed=resumed)
        run.step = rec["history"][-1][0] + 1 if resumed else 0

        def log(values: dict[str, float], step: int) -> None:
            assert step >= run.step, f"W&B drops step {step} below {run.step}"
            rec["history"].append((step, dict(values)))
            run.step = step + 1

        def finish() -> None:
            rec["finished"] += 1

        run.log, run.finish = log, finish
        return run


class FakeMlflow:
    """An MLflow tracking server in memory, with the three modules our adapter imports."""

    Metric = namedtuple("Metric", "key value timestamp step")
    Param = namedtuple("Param", "key value")

    def __init__(self) -> None:
        self.experiments: dict[str, str] = {}
        self.runs: dict[str, dict[str, Any]] = {}
        self.uris: list[str] = []
        server = self

        class MlflowClient:
            def __init__(self, tracking_uri: str) -> None:
                server.uris.append(tracking_uri)

            def get_experiment_by_name(self, name: str) -> Any:
                i = server.experiments.get(name)
                return None if i is None else types.SimpleNamespace(experiment_id=i)

            def create_experiment(self, name: str) -> str:
                assert name not in server.experiments
                server.experiments[name] = str(len(server.experiments))
                return server.experiments[name]

            def search_runs(self, experiment_ids: list[str], filter_string: str) -> list[Any]:
                terms = filter_string.split(" and ")
                wanted = [re.fullmatch(r"tags\.(\w+) = '([^']*)'", t) for t in terms]
                assert all(wanted), f"not a filter MLflow reads: {filter_string!r}"
                return [
                    types.SimpleNamespace(info=types.SimpleNamespace(run_id=rid))
                    for rid, r in server.runs.items()
                    if r["experiment"] in experiment_ids
                    and not r["deleted"]
                    and all(r["tags"].get(m.group(1)) == m.group(2) for m in wanted)
                ]

            def delete_run(self, run_id: str) -> None:
                server.runs[run_id]["deleted"] = True

            def create_run(self, experiment_id: str, tags: dict[str, str], run_name: str) -> Any:
                rid = f"run{len(server.runs)}"
                server.runs[rid] = {
                    "experiment": experiment_id,
                    "tags": dict(tags),
                    "name": run_name,
                    "params": {},
                    "metrics": [],
                    "deleted": False,
                    "status": "RUNNING",
                }
                return types.SimpleNamespace(info=types.SimpleNamespace(run_id=rid))

            def log_batch(self, run_id: str, metrics: Any = (), params: Any = ()) -> None:
                assert len(params) <= 100 and len(metrics) <= 1000  # MLflow's limits per batch
                run = server.runs[run_id]
                for p in params:
                    assert p.key not in run["params"] and len(p.value) <= 500
                    run["params"][p.key] = p.value
                run["metrics"] += list(metrics)

            def set_terminated(self, run_id: str) -> None:
                server.runs[run_id]["status"] = "FINISHED"

        self.modules = {
            "mlflow": types.ModuleType("mlflow"),
            "mlflow.tracking": types.ModuleType("mlflow.tracking"),
            "mlflow.entities": types.ModuleType("mlflow.entities"),
        }
        self.modules["mlflow.tracking"].MlflowClient = MlflowClient
        self.modules["mlflow.entities"].Metric = self.Metric
        self.modules["mlflow.entities"].Param = self.Param


def test_wandb_gets_one_run_per_job_its_config_and_its_steps(micro, monkeypatch):
    fake_wandb = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb)
    store, keys = micro["store"], micro["keys"]
    runs = {r.stage: r for r in M.runs(store, "mirrored")}
    assert sorted(runs) == ["distill", "teacher"]
    for _ in range(2):  # mirrored again: the same run resumed, no step logged twice
        assert M.mirror_runs({"wandb": "team/moe"}, list(runs.values()), pytest.fail) == (2, 0)
    d = runs["distill"]
    first, again = [i for i in fake_wandb.inits if i["job_type"] == "distill"]
    assert first == again
    assert first["project"] == "moe" and first["entity"] == "team" and first["resume"] == "allow"
    assert first["id"] == f"mirrored-{keys['distill']}" and first["group"] == "mirrored"
    assert first["name"] == f"SF_RR_uniform_K=2-{keys['distill'][:12]}"
    assert first["settings"] == {"silent": True, "console": "off"}
    rec = fake_wandb.stored[first["id"]]
    assert rec["finished"] == 2 and rec["config"] == d.hparams and rec["config"]["settings.steps"] == 4
    steps = [s for s, _ in rec["history"]]
    assert steps == sorted(set(steps)) == [0, 1, 2, 3, 4]
    got: dict[str, list[tuple[int, float]]] = {}
    for step, values in rec["history"]:
        for tag, value in values.items():
            got.setdefault(tag, []).append((step, value))
    assert_same_curves(got, db_curves(store, "mirrored", keys["distill"]))
    teacher = fake_wandb.stored[f"mirrored-{keys['teacher']}"]
    assert len(teacher["history"]) == 40 and teacher["config"]["configuration"] == "teacher"


def test_mlflow_gets_one_run_per_job_replaced_when_mirrored_again(micro, monkeypatch):
    server = FakeMlflow()
    for name, module in server.modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    store, keys = micro["store"], micro["keys"]
    runs = M.runs(store, "mirrored")
    for _ in range(2):
        assert M.mirror_runs({"mlflow": "http://tracking:5000"}, runs, pytest.fail) == (2, 0)
    assert server.uris == ["http://tracking:5000"] * 4 and list(server.experiments) == ["mirrored"]
    alive = [r for r in server.runs.values() if not r["deleted"]]
    assert len(server.runs) == 4 and len(alive) == 2  # the first two deleted when mirrored again
    live = {r["tags"]["moesweep_stage"]: r for r in alive}
    assert sorted(live) == ["distill", "teacher"]
    d = live["distill"]
    assert d["tags"] == {
        "moesweep_sweep": "mirrored",
        "moesweep_job": keys["distill"],
        "moesweep_stage": "distill",
    }
    assert d["name"] == f"SF_RR_uniform_K=2-{keys['distill'][:12]}" and d["status"] == "FINISHED"
    assert d["params"]["settings.steps"] == "4" and d["params"]["config.scoring"] == "SF"
    got: dict[str, list[tuple[int, float]]] = {}
    for m in d["metrics"]:
        got.setdefault(m.key, []).append((m.step, m.value))
    assert_same_curves(got, db_curves(store, "mirrored", keys["distill"]))


@pytest.mark.parametrize("tracker", ["wandb", "mlflow"])
def test_a_tracker_that_is_not_installed_says_so_in_one_line(tracker, tmp_path, monkeypatch):
    for name in (tracker, f"{tracker}.tracking", f"{tracker}.entities"):
        monkeypatch.setitem(sys.modules, name, None)
    run = M.Run("s", "distill", "k" * 32, "SF|RR|uniform|K=2", {"lr": 0.1}, [(0, "val_ce/student", 1.0)])
    with pytest.raises(M.MirrorError) as e:
        M.TRACKERS[tracker]("where", run)
    assert str(e.value) == f"mirror.{tracker} needs the {tracker} package: pip install {tracker}"
    where = "me/proj" if tracker == "wandb" else "http://h:5000"
    f = tmp_path / "s.yaml"
    f.write_text(
        (HERE / "sweeps" / "fake.yaml")
        .read_text()
        .replace("execution: {retries: 1}", f"execution: {{mirror: {{{tracker}: {where}}}}}")
    )
    with pytest.raises(SpecError) as e:
        load_spec(str(f))
    assert str(e.value) == (
        f"{f}: execution.mirror.{tracker}: needs the {tracker} package: pip install {tracker}"
    )


@pytest.mark.parametrize(
    "mirror, problem",
    [
        ("runs/tb", "execution.mirror: expected a mapping of tensorboard, wandb, mlflow (e.g. "),
        ("{}", "execution.mirror: names no tracker; give at least one of tensorboard: DIR, wandb: PROJECT"),
        ("{tensorbord: x}", "execution.mirror.tensorbord: unknown key; allowed: tensorboard, wandb, mlflow"),
        ("{tensorboard: 's3://b/runs'}", "execution.mirror.tensorboard: 's3://b/runs' is a URL; expected a"),
        ("{tensorboard: 7}", "execution.mirror.tensorboard: expected a local folder"),
        (
            "{wandb: 'my project'}",
            "execution.mirror.wandb: expected a W&B project, PROJECT or ENTITY/PROJECT",
        ),
        ("{mlflow: 'http://h 5000'}", "execution.mirror.mlflow: expected an MLflow tracking URI without"),
    ],
)
def test_a_bad_mirror_setting_is_one_line(mirror, problem, tmp_path):
    f = tmp_path / "s.yaml"
    text = (HERE / "sweeps" / "fake.yaml").read_text()
    f.write_text(text.replace("execution: {retries: 1}", f"execution: {{mirror: {mirror}}}"))
    with pytest.raises(SpecError) as e:
        load_spec(str(f))
    assert str(e.value).startswith(f"{f}: {problem}") and "\n" not in str(e.value)


def test_a_tracker_failure_is_one_line_and_the_launch_goes_on(fake, tmp_path, monkeypatch):  # noqa: F811
    """A TensorBoard folder that cannot be made and a W&B that throws: each mirrored job is one warning
    line per tracker, the launch's exit code and records are those of the same launch without a mirror."""
    calls, state = fake
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")

    class Broken(FakeWandb):
        def init(self, **kw: Any) -> Any:
            raise RuntimeError("wandb.ai is unreachable")

    monkeypatch.setitem(sys.modules, "wandb", Broken())
    text = (HERE / "sweeps" / "fake.yaml").read_text()
    outcome = {}
    for label, execution in (
        ("plain", "{retries: 0}"),
        ("mirrored", f"{{retries: 0, mirror: {{tensorboard: {blocked}, wandb: proj}}}}"),
    ):
        # the same teacher folder both times: the same job keys (the fake's numbers hash them)
        sweep = fake_sweep(tmp_path, text.replace("execution: {retries: 1}", f"execution: {execution}"))
        spec, path, spec_text = load_spec(str(sweep))
        state["db"] = f"sqlite:///{tmp_path}/{label}.db"  # the fake distillation reads it while it runs
        store = Store(state["db"])
        buf = io.StringIO()
        code = launch(
            spec,
            spec_text,
            store,
            SerialExecutor(),
            console=Console(file=buf, width=400),
            show_progress=False,
        )
        rows = store.query(
            "SELECT j.stage, m.name, m.who, m.step, m.value FROM metrics m JOIN jobs j ON j.id = m.job_id "
            "ORDER BY 1, 2, 3, 4, 5"
        )[1]
        outcome[label] = (code, rows, [ln for ln in buf.getvalue().splitlines() if "warning" in ln])
    (code, rows, warnings), (code2, rows2, warnings2) = outcome["plain"], outcome["mirrored"]
    assert code == code2 == 1 and warnings == []  # 1: the fake's deliberately failing conversions
    assert rows == rows2  # exact: the fake's numbers, the same jobs
    curved = store.query(
        "SELECT COUNT(DISTINCT m.job_id) FROM metrics m JOIN jobs j ON j.id = m.job_id "
        "WHERE j.status = 'succeeded' AND m.step >= 0 AND m.stage NOT IN ('pre', 'post')"
    )[1][0][0]
    assert curved >= 2 and len(warnings2) == 2 * curved
    tb = [w for w in warnings2 if "mirror to tensorboard of " in w]
    wb = [w for w in warnings2 if "mirror to wandb of " in w]
    assert len(tb) == len(wb) == curved
    assert all("cannot write" in w and str(blocked) in w for w in tb)
    assert all(w.endswith("RuntimeError: wandb.ai is unreachable") for w in wb)


def test_tags_and_non_finite_values():
    """A series per metric name/task/who, led by its metric stage where two stages share one; NaN and ±inf
    (stored as NULL and their kind) come back as numbers; a NULL of no kind is no point."""
    rows = [
        {
            "name": "val_ce",
            "stage": "train",
            "task": "",
            "who": "student",
            "step": 0,
            "value": None,
            "value_kind": "nan",
        },
        {
            "name": "val_ce",
            "stage": "train",
            "task": "",
            "who": "student",
            "step": 1,
            "value": None,
            "value_kind": "inf",
        },
        {
            "name": "loss",
            "stage": "a",
            "task": "web text",
            "who": "",
            "step": 0,
            "value": 2.0,
            "value_kind": "finite",
        },
        {
            "name": "loss",
            "stage": "b",
            "task": "web text",
            "who": "",
            "step": 0,
            "value": 3.0,
            "value_kind": "finite",
        },
        {
            "name": "w",
            "stage": "dcdm",
            "task": "x",
            "who": "",
            "step": 2,
            "value": None,
            "value_kind": "-inf",
        },
        {
            "name": "w",
            "stage": "dcdm",
            "task": "x",
            "who": "",
            "step": 3,
            "value": None,
            "value_kind": "skipped",
        },
    ]
    job = {"key": "f" * 32, "stage": "nostage", "params_json": '{"settings": {"lr": 0.5, "ks": [1, 2]}}'}
    run = M._run("s", job, [], rows)
    assert run.label == "nostage" and run.name == f"nostage-{'f' * 12}"
    assert run.hparams["settings.lr"] == 0.5 and run.hparams["settings.ks"] == "[1, 2]"
    tags = [(s, t) for s, t, _ in run.points]
    assert tags == [
        (0, "a/loss/web_text"),
        (0, "b/loss/web_text"),
        (0, "val_ce/student"),
        (1, "val_ce/student"),
        (2, "w/x"),
    ]
    values = [v for _, _, v in run.points]
    assert values[:2] == [2.0, 3.0]  # exact: the stored numbers, copied unchanged
    assert math.isnan(values[2]) and values[3] == math.inf and values[4] == -math.inf
