"""Two outputs, one pipeline: dense students and smaller MoEs (with or without Router KD) in one sweep."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from db.store import Store
from orchestrator import dryrun
from orchestrator.axes import config_key
from orchestrator.spec import SpecError, load_spec
from tests.test_orchestrator import HERE, _launch, fake, fake_sweep  # noqa: F401

GRID = [
    {"scoring": ["SF", "CP"], "grouping": ["RR", "WC"], "K": [2, 4]},
    {"output": ["moe"], "scoring": ["SF", "REAP"], "K": [2, 4], "recovery": ["none", "router_kd"]},
]


def _sweep(tmp_path, grid=GRID):
    raw = yaml.safe_load((HERE / "sweeps" / "fake.yaml").read_text())
    raw["grid"] = grid
    return fake_sweep(tmp_path, yaml.safe_dump(raw, sort_keys=False))


def test_configuration_keys_stay_those_of_dense_students():
    assert (
        config_key(
            {
                "output": "dense",
                "scoring": "SF",
                "grouping": "RR",
                "dp_scaling": "uniform",
                "K": 8,
                "recovery": None,
            }
        )
        == "SF|RR|uniform|K=8"
    )
    assert (
        config_key(
            {
                "output": "moe",
                "scoring": "REAP",
                "grouping": None,
                "dp_scaling": None,
                "K": 16,
                "recovery": "router_kd",
            }
        )
        == "moe|REAP|K=16|recovery=router_kd"
    )


def test_dense_and_moe_outputs_in_one_sweep(fake, tmp_path):  # noqa: F811
    calls, state = fake
    state["fail"] = False
    sweep = _sweep(tmp_path)
    store = Store(state["db"])
    assert _launch(store, sweep) == 0
    rows = store.query(
        "SELECT config_key, output, grouping, dp_scaling, recovery, selected_for_distill, "
        "duplicate_of IS NOT NULL, avg_acc IS NOT NULL FROM results WHERE sweep = 'fake' "
        "AND kind IN ('moe2dense', 'moe2moe') ORDER BY config_id"
    )[1]
    dense = [r for r in rows if r[1] == "dense"]
    moe = [r for r in rows if r[1] == "moe"]
    assert len(dense) == 8 and len(moe) == 8
    assert all(r[2] is None and r[3] is None and r[4] in ("none", "router_kd") for r in moe)
    assert all(r[5] == 0 for r in moe)  # the selection rule picks dense students to distill
    assert all(r[7] == 1 for r in moe)  # every smaller MoE is evaluated, with or without Router KD
    assert not any(r[6] for r in moe)  # router_kd and none are different final students
    assert sum(r[5] for r in dense) == 4
    stages = [s for s, _ in calls]
    assert stages.count("router_kd") == 4
    # the same pre-distillation evaluation serves both recoveries of one smaller MoE
    assert stages.count("ppl_pre") == len({k for s, k in calls if s == "ppl_pre"})
    keys = {r[0] for r in moe}
    assert "moe|REAP|K=4|recovery=router_kd" in keys and "moe|SF|K=2|recovery=none" in keys
    # the dry run counts both outputs
    spec, _, _ = load_spec(str(sweep))
    rows = {r["stage"]: r for r in dryrun.plan_counts(spec)[0]}
    assert rows["convert"]["named"] == 16 and rows["router_kd"]["named"] == 4
    assert "8 smaller MoEs" in rows["evaluate"]["note"]


@pytest.mark.parametrize(
    "grid, expect",
    [
        (
            [{"output": ["moe"], "scoring": ["SF"], "grouping": ["RR"], "K": [2]}],
            "grid.0: grouping does not apply to output moe; it applies to dense",
        ),
        (
            [{"scoring": ["SF"], "K": [2], "recovery": ["router_kd"]}],
            "grid.0: recovery does not apply to output dense; it applies to moe",
        ),
        (
            {"output": ["moe"], "scoring": ["SF"], "K": [2], "recovery": ["full"]},
            "grid.recovery: unknown recovery 'full'; allowed: none, router_kd",
        ),
        (
            {"output": ["sparse"], "scoring": ["SF"], "K": [2]},
            "grid.output: unknown output 'sparse'; allowed: dense, moe",
        ),
    ],
)
def test_axes_that_do_not_apply_to_an_output_are_errors(tmp_path, grid, expect):
    with pytest.raises(SpecError) as e:
        load_spec(str(_sweep(tmp_path, grid)))
    assert expect in str(e.value), str(e.value)


@pytest.mark.slow
def test_a_real_sweep_writes_smaller_moes_that_reload_with_fewer_experts(tmp_path, monkeypatch):
    """The tiny teacher pruned (REAP, SF; EAN keeping super experts), merged (HC-SMoE, M-SMoE) and edited
    (MoBE, TD-MoE) to the size of K experts per layer, as converted, after Router KD and (one) after full
    KD: each evaluated and its checkpoint reloaded from disk — pruned with K experts of the teacher's class,
    merged with the seeds' summed gates (all E experts and router rows, each cluster stored once: the
    `params` of results counts it once), edited with every expert factorised — Router KD changing only
    routers."""
    import json
    import math

    import torch
    from safetensors import safe_open
    from sweep_runs import launch_serial
    from transformers import AutoModelForCausalLM

    import workers.models.edited_model  # noqa: F401  (edited checkpoints load through the Auto classes)

    monkeypatch.setenv("MOESWEEP_HOME", str(tmp_path / "home"))
    spec, path, text = load_spec(str(HERE / "sweeps" / "moe.yaml"))
    store = Store(f"sqlite:///{tmp_path}/r.db")
    assert launch_serial(spec, text, store, path) == 0
    rows = store.query(
        "SELECT config_id, config_key, K, recovery, params, ppl_pre, ppl_post, avg_acc, output "
        "FROM results WHERE output IN ('moe', 'merged', 'edited') ORDER BY config_id"
    )[1]
    assert [r[8] for r in rows].count("moe") == 9 and [r[8] for r in rows].count("merged") == 5
    assert [r[8] for r in rows].count("edited") == 4
    assert all(r[5] is not None and r[6] is not None and r[7] is not None for r in rows)
    teacher_params = store.query("SELECT params FROM results WHERE kind = 'teacher'")[1][0][0]
    assert all(r[4] < teacher_params for r in rows)
    params = {r[1]: r[4] for r in rows}
    assert (
        params["moe|REAP|K=2|recovery=none"] < params["moe|REAP|K=4|recovery=none"]
    )  # measured, not from flags
    for method in ("MoBE", "TD-MoE"):  # an edit stays within the budget of pruning to the same K
        assert params[f"edited|{method}|K=4|recovery=none"] <= params["moe|REAP|K=4|recovery=none"]
    # Router KD ran for the router_kd configurations and recorded its loss curve
    n_kd = store.query(
        "SELECT COUNT(DISTINCT j.id) FROM jobs j WHERE j.stage = 'router_kd' AND j.status = 'succeeded'"
    )[1][0][0]
    assert n_kd == 8
    saved = dict(
        store.query(  # evaluate writes each student built from its plan; distill writes its own
            "SELECT cj.config_id, a.path FROM config_jobs cj JOIN artifacts a ON a.job_id = cj.job_id "
            "WHERE cj.stage IN ('evaluate', 'distill') AND a.kind = 'student'"
        )[1]
    )
    teacher_dir = json.loads(store.query("SELECT outputs_json FROM jobs WHERE stage = 'teacher'")[1][0][0])[
        "path"
    ]
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir)
    E = teacher.config.num_experts
    routed = (
        sum(  # the routed experts' parameters per expert, over all MoE layers
            t.numel() for n, t in teacher.named_parameters() if ".mlp.experts." in n
        )
        // E
    )
    unique = {K: teacher_params - (E - K) * routed for K in (2, 4)}  # each cluster once, the rest as it is
    by_id = {r[0]: r for r in rows}
    students = {}
    for cid, p in saved.items():
        if cid not in by_id:
            continue
        m = AutoModelForCausalLM.from_pretrained(p)
        output, K = by_id[cid][8], by_id[cid][2]
        if output == "edited":  # every expert kept, stored as factors: fewer parameters on disk
            assert type(m).__name__.endswith("EditedForCausalLM") and m.config.num_experts == E
            with safe_open(str(Path(p) / "model.safetensors"), framework="pt") as fh:
                on_disk = sum(math.prod(fh.get_slice(k).get_shape()) for k in fh.keys())
            assert on_disk < sum(t.numel() for t in teacher.state_dict().values())
        elif output == "merged":  # summed gates: E router rows over members tied to K stored clusters
            assert type(m).__name__.endswith("MergedForCausalLM") and m.config.num_experts == E
            assert all(t.shape[0] == E for n, t in m.state_dict().items() if n.endswith("mlp.gate.weight"))
            assert by_id[cid][4] == sum(t.numel() for t in m.parameters()) == unique[K]
        else:
            assert type(m) is type(teacher) and m.config.num_experts == K < E
        assert m.config.num_experts_per_tok == teacher.config.num_experts_per_tok
        students[by_id[cid][1]] = m
    assert len(students) == 18
    # Router KD changed the routers and nothing else, whatever made the smaller MoE
    for plain_key in (
        "moe|REAP|K=4|recovery=none",
        "merged|HC-SMoE|K=4|recovery=none",
        "edited|TD-MoE|K=4|recovery=none",
    ):
        plain, kd = students[plain_key], students[plain_key.replace("none", "router_kd")]
        # exact: both are one recipe's student (the same ops on the same teacher bytes); router KD writes the routers only
        changed = {
            n
            for (n, a), (_, b) in zip(plain.state_dict().items(), kd.state_dict().items(), strict=True)
            if not torch.equal(a, b)
        }
        assert changed and all(n.endswith("mlp.gate.weight") for n in changed), (plain_key, changed)
    # long jobs wrote their step, loss and throughput to their logs
    logs = dict(
        store.query("SELECT stage, log_path FROM jobs WHERE stage IN ('teacher', 'distill', 'router_kd')")[1]
    )
    for stage, what in (("teacher", "teacher"), ("distill", "distill"), ("router_kd", "router_kd")):
        text = Path(logs[stage]).read_text()
        assert f"{what}: step " in text and " loss " in text and "tokens/s" in text, (stage, text[-500:])
    # full KD trains the experts too (its own settings: single linkage)
    full = students["merged|HC-SMoE|K=4|recovery=full_kd"]
    # exact: a distinctness check: training moved some expert tensor
    assert any(
        "experts" in n and not torch.equal(a, b)
        for (n, a), (_, b) in zip(
            full.state_dict().items(),
            students["merged|HC-SMoE|K=4|recovery=none"].state_dict().items(),
            strict=True,
        )
    )


@pytest.mark.parametrize("grid", [GRID, GRID[1:]], ids=["dense and moe", "moe only"])
def test_report_of_a_sweep_with_smaller_moes(fake, tmp_path, grid):  # noqa: F811
    from typer.testing import CliRunner

    from orchestrator.cli import app

    calls, state = fake
    state["fail"] = False
    store = Store(state["db"])
    assert _launch(store, _sweep(tmp_path, grid)) == 0
    out = tmp_path / "report"
    res = CliRunner().invoke(app, ["report", "fake", "--db", state["db"], "--out", str(out)])
    assert res.exit_code == 0, res.output
    moe = (out / "tables" / "moe.tex").read_text()
    assert "REAP" in moe and "router" in moe.lower()
    for f in (out / "tables").glob("*.tex"):  # the dense tables hold dense students only
        if f.name != "moe.tex":
            assert "REAP" not in f.read_text(), f.name
    n = 8 * len(grid) + 2  # the grid, the teacher and the random-FFN baseline
    assert f"{n} configurations" in (out / "index.md").read_text()
