"""REAP's super-expert rule beside ours (`super_experts: reap` vs a factor): the pure rule
(workers/methods/pruning.py) against a reference restated from the REAP repository's code
(CerebrasResearch/reap: src/reap/model_util.py get_super_expert_indices, over the observer's
`max_activations` of src/reap/pruning_metrics.py update_pruning_state), the max-activation pass
(workers/calibration/expert_maxima.py) against a per-token loop over every family's own expert modules,
its file, the expert_maxima stage's planning, and a micro sweep whose conversions record what it protects."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from families_cases import FAMILIES, experts_forward
from test_calibrate import _block_of, _capture, padded_batches, tiny_model
from test_pruning import COUNT, ctx, stats

from workers.calibration.expert_maxima import (
    MaximaAccumulator,
    collect_maxima,
    grouped_expert_outputs,
    load_maxima,
    routed_max_elements,
    save_maxima,
)
from workers.core.types import ExpertWeights
from workers.families import get_adapter
from workers.methods.experts import all_expert_outputs
from workers.methods.planning import select_layer
from workers.methods.pruning import (
    reap_super_experts,
    reap_threshold,
    select_pruned,
    super_expert_rule,
    super_experts,
)

HERE = Path(__file__).resolve().parent
F64 = dict(dtype=torch.float64)


# ---- the reference, from the REAP repository's code ---------------------------------------------------
def reap_reference(observer_data: dict[int, dict[str, torch.Tensor]]) -> set[tuple[int, int]]:
    """REAP's get_super_expert_indices (perserve_super_experts, include_last_layers=False), restated with
    numpy: every layer's float32 `max_activations` concatenated in the observer's layer order; threshold =
    max(99.5th percentile (linear), max / 10); a super expert is strictly above it; the layers from
    int(0.75·L) on are cleared. Returns {(layer position, expert)} as REAP's argwhere lists them."""
    a = np.stack([d["max_activations"].numpy().astype(np.float32) for d in observer_data.values()])
    flat = a.reshape(-1)
    threshold = max(float(np.percentile(flat, 99.5)), float(flat.max()) / 10)
    mask = a > threshold
    mask[int(a.shape[0] * 0.75) :, :] = False
    return {(int(i), int(e)) for i, e in np.argwhere(mask)}


def observer_max_activations(outputs: list[tuple[torch.Tensor, torch.Tensor]], E: int) -> torch.Tensor:
    """REAP's observer state for one layer: starts at 0 (float32); per batch, for each expert routed at
    least once, the max of its unweighted outputs on its routed tokens replaces the state if larger.
    `outputs`: per batch (activations [E, T, H] of every expert on every token, selected [T, k])."""
    state = torch.zeros(E, dtype=torch.float32)
    for activations, selected in outputs:
        for i in range(E):
            active = (selected == i).any(dim=-1)
            if not active.any():
                continue
            m = activations[i, active, :].max()
            if m > state[i]:
                state[i] = m
    return state


def _as_sets(per_layer: list[list[int]]) -> set[tuple[int, int]]:
    return {(i, e) for i, ids in enumerate(per_layer) for e in ids}


# ---- the rule --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "L, E, seed", [(2, 8, 0), (4, 16, 1), (5, 8, 2), (8, 64, 3), (48, 128, 4), (3, 201, 5)]
)
def test_reap_rule_equals_the_reference_from_the_reap_repository(L, E, seed):
    g = torch.Generator().manual_seed(seed)
    a = torch.rand(L, E, generator=g) * 2  # a background of maxima, a few outliers planted anywhere
    for _ in range(4):
        a[int(torch.randint(L, (1,), generator=g)), int(torch.randint(E, (1,), generator=g))] = float(
            torch.empty(1).uniform_(5, 60, generator=g)
        )
    a[0, 0] = 0.0  # an expert never routed (REAP's state stays 0)
    got = reap_super_experts(a)
    want = reap_reference({layer: {"max_activations": a[layer]} for layer in range(L)})
    assert _as_sets(got) == want
    assert len(got) == L
    for layer, ids in enumerate(got):  # largest first
        assert [float(a[layer, e]) for e in ids] == sorted((float(a[layer, e]) for e in ids), reverse=True)


def test_reap_threshold_is_the_percentile_or_a_tenth_of_the_max_whichever_is_larger():
    g = torch.Generator().manual_seed(0)
    a = torch.rand(8, 64, generator=g, **F64) * 2
    a[7, 1], a[0, 3], a[2, 5] = 100.0, 40.0, 30.0
    # 512 values: the 99.5th percentile interpolates between the 4th and 3rd largest (2.x and 30)
    flat = a.flatten().sort().values
    pos = 0.995 * 511
    pct = float(flat[int(pos)] + (pos - int(pos)) * (flat[int(pos) + 1] - flat[int(pos)]))
    torch.testing.assert_close(reap_threshold(a), pct, rtol=1e-12, atol=0)
    assert pct > 100.0 / 10
    # expert 1 of the last layer is above the threshold but in the last 25% of layers: not a super expert
    assert reap_super_experts(a) == [[3], [], [5], [], [], [], [], []]
    a[7, 1] = 1000.0  # now a tenth of the max (100) is the larger threshold: nothing else passes it
    assert reap_threshold(a) == 100.0
    assert reap_super_experts(a) == [[]] * 8
    a[5, 0] = 101.0  # layer 5 of 8 is in the first 75% (int(8·0.75) = 6 layers)
    assert reap_super_experts(a) == [[], [], [], [], [], [0], [], []]
    assert _as_sets(reap_super_experts(a)) == reap_reference({i: {"max_activations": a[i]} for i in range(8)})


def test_first_75_percent_of_layers_as_reap_counts_them():
    for L, first in ((1, 0), (2, 1), (3, 2), (4, 3), (5, 3), (48, 36)):
        a = torch.ones(L, 400, **F64)  # one outlier per layer: 0.25% of the values, above the percentile
        a[:, 2] = 1000.0  # and the threshold is max / 10 = 100
        assert reap_threshold(a) == 100.0
        got = reap_super_experts(a)
        assert [i for i, ids in enumerate(got) if ids] == list(range(first)), L


# planted outliers where the rules disagree: per layer the same 8 values for both statistics
BASE = [1.0, 1.1, 0.9, 1.2, 1.0, 0.8, 1.05, 0.95]
PLANTED = {0: (2, 50.0), 1: (4, 20.0), 3: (6, 30.0)}  # layer: (expert, its peak)


def planted_table() -> torch.Tensor:
    a = torch.tensor([BASE] * 4, **F64)
    for layer, (e, v) in PLANTED.items():
        a[layer, e] = v
    return a


def test_planted_outliers_ours_protects_three_reaps_one():
    a = planted_table()
    ours = [super_experts(stats(a[layer].tolist(), [5] * 8, [0.5] * 8), 10.0) for layer in range(4)]
    assert ours == [[2], [4], [], [6]]  # each layer's own median (~1): 50, 20 and 30 are all > 10×
    # REAP: one global threshold, 30 + 0.845·(50 − 30) = 46.9 (the percentile; max/10 = 5), first 3 layers
    torch.testing.assert_close(reap_threshold(a), 30.0 + (0.995 * 31 - 30) * 20.0, rtol=1e-12, atol=0)
    assert reap_super_experts(a) == [[2], [], [], []]
    assert _as_sets(reap_super_experts(a)) == reap_reference({i: {"max_activations": a[i]} for i in range(4)})

    # the protected experts reach the selection: REAP's scores make every outlier the least salient
    reap_mean = [0.5, 0.8, 0.6, 0.7, 0.65, 0.75, 0.55, 0.9]
    low = {layer: e for layer, (e, _) in PLANTED.items()}
    by_rule = {}
    for name, rule in (
        ("ours", super_expert_rule(10.0)),
        ("reap", super_expert_rule("reap", dict(enumerate(a)))),
    ):
        plans = []
        for layer in range(4):
            r = list(reap_mean)
            if layer in low:
                r[low[layer]] = 0.01
            c = ctx(stats(a[layer].tolist(), [5] * 8, r), k=2)
            plans.append(select_layer(layer, c, "REAP", 4, rule(layer, c.stats)))
        by_rule[name] = plans
    assert sum(pl.extras["protected"] for pl in by_rule["ours"]) == 3
    assert sum(pl.extras["protected"] for pl in by_rule["reap"]) == 1
    assert [pl.extras["protected_ids"] for pl in by_rule["reap"]] == [[2], [], [], []]
    assert all(low[i] in pl.selected for i, pl in enumerate(by_rule["ours"]) if i in low)
    assert 2 in by_rule["reap"][0].selected and 4 not in by_rule["reap"][1].selected
    assert 6 not in by_rule["reap"][3].selected


def test_the_setting_is_a_factor_or_reap_and_nothing_else():
    st = stats([1.0, 1.2, 0.9, 30.0, 1.1, 15.0, 0.0], COUNT, [0.5] * 7)
    assert super_expert_rule(None) is None
    assert super_expert_rule(10.0)(0, st) == super_experts(st, 10.0) == [3, 5]
    assert super_expert_rule(20)(0, st) == [3]
    maxima = {0: torch.tensor([0.0, 1.0, 1.0, 50.0, 1.0, 1.0, 1.0]), 5: torch.ones(7)}
    assert super_expert_rule("reap", maxima)(0, st) == [3]
    assert super_expert_rule("reap", maxima)(5, st) == []
    for bad in ("REAP", "10", True, 0.5, float("nan"), float("inf"), [10.0], {"reap": 1}):
        with pytest.raises(ValueError) as e:
            super_expert_rule(bad)
        msg = str(e.value)
        assert msg.startswith(f"super_experts={bad!r}; allowed: a number >= 1") and "'reap'" in msg, msg
        assert "\n" not in msg
    with pytest.raises(ValueError, match="super_experts=reap needs the per-expert max activations"):
        super_expert_rule("reap")
    with pytest.raises(
        ValueError, match=r"layer 2 has no max activations; the maxima file has layers \[0, 5\]"
    ):
        super_expert_rule("reap", maxima)(2, st)
    with pytest.raises(ValueError, match="layer 0: 3 max activations for 7 experts"):
        super_expert_rule("reap", {0: torch.ones(3)})(0, st)
    for bad in (torch.ones(3), torch.ones(0, 4), torch.tensor([[1.0, float("nan")]])):
        with pytest.raises(ValueError, match="maxima"):
            reap_super_experts(bad)


def test_select_pruned_takes_the_super_experts_as_ids():
    c = ctx(stats([1.0, 1.2, 0.9, 30.0, 1.1, 15.0, 0.0], COUNT, [0.5, 0.8, 0.6, 0.1, 0.7, 0.2, 0.0]))
    by_factor = select_pruned(c, "REAP", 4, super_factor=10.0)
    by_ids = select_pruned(c, "REAP", 4, super_ids=[3, 5])
    assert by_ids.selected == by_factor.selected == [3, 5, 1, 4]
    assert by_ids.extras == by_factor.extras
    sel = select_pruned(c, "REAP", 2, super_ids=[5, 3, 6])  # more than K: the first K, in the given order
    assert (
        sel.selected == [5, 3]
        and sel.extras["protected"] == [5, 3]
        and sel.extras["super_experts"] == [5, 3, 6]
    )
    assert select_pruned(c, "REAP", 4, super_ids=[]).selected == [1, 4, 2, 0]
    with pytest.raises(ValueError, match="give one"):
        select_pruned(c, "REAP", 4, super_factor=10.0, super_ids=[3])
    for bad in ([3, 3], [7], [-1]):
        with pytest.raises(ValueError, match=r"super_ids=.*distinct expert ids in 0\.\.6"):
            select_pruned(c, "REAP", 4, super_ids=bad)


# ---- the max-activation pass ------------------------------------------------------------------------
def _experts(act: str, bias: bool, E: int = 5, H: int = 6, inter: int = 4, seed: int = 0) -> ExpertWeights:
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, **F64)

    return ExpertWeights(
        gate=r(E, inter, H),
        up=r(E, inter, H),
        down=r(E, H, inter),
        gate_bias=r(E, inter) if bias else None,
        up_bias=r(E, inter) if bias else None,
        down_bias=r(E, H) if bias else None,
        act=act,
    )


@pytest.mark.parametrize("act, bias", [("silu", False), ("gptoss", True)])
def test_routed_max_elements_equal_every_expert_on_every_token(act, bias):
    ew = _experts(act, bias)
    g = torch.Generator().manual_seed(1)
    T = 11
    x = torch.randn(T, 6, generator=g, **F64)
    idx = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(T)])  # expert 4 is never routed
    mask = torch.ones(T, dtype=torch.bool)
    mask[[2, 7]] = False
    full = all_expert_outputs(ew, x)  # [E, T, H]
    want = torch.full((5,), -math.inf, **F64)
    for t in range(T):
        for e in idx[t].tolist():
            if mask[t]:
                want[e] = max(float(want[e]), float(full[e, t].max()))
    got = routed_max_elements(ew, x, idx, mask)
    assert got.dtype == torch.float32 and got[4] == -math.inf
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    xs = torch.stack([x[:3]] * 5)
    torch.testing.assert_close(grouped_expert_outputs(ew, xs), full[:, :3], rtol=1e-12, atol=1e-12)
    # any token chunking gives the same maxima; the accumulator starts at 0 (REAP's observer state)
    for chunk in (1, 3, 100):
        acc = MaximaAccumulator(ew, chunk)
        acc.update(x, idx, mask)
        torch.testing.assert_close(acc.finish().double(), want.clamp(min=0), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="need \\[T, 6\\]"):
        routed_max_elements(ew, x[:3], idx, mask)
    with pytest.raises(ValueError, match="chunk_tokens=0"):
        MaximaAccumulator(ew, 0)


@pytest.mark.parametrize("family", FAMILIES)
def test_collect_maxima_equals_reaps_observer_over_the_teachers_own_experts(family):
    """The reference: the routing the teacher itself chose, each routed expert run by the family's own
    experts module (unweighted) on every real token, reduced as REAP's observer state."""
    model = tiny_model(family)
    adapter = get_adapter(model)
    batches = padded_batches()
    got = collect_maxima(model, adapter, batches, chunk_tokens=5)
    E = adapter.num_experts(model)
    assert sorted(got) == adapter.moe_layers(model)
    for layer, records in _capture(model, adapter, batches).items():
        experts = _block_of(model, adapter.router_module(model, layer)).experts
        outputs = []
        with torch.no_grad():
            for x, _, _, idx, mask in records:
                real = mask.to(x.device)
                xr, sel = x[real], idx[real]
                one = torch.ones(xr.shape[0], 1, dtype=xr.dtype)
                act = torch.stack(
                    [
                        experts_forward(adapter.name, experts, xr, torch.full((xr.shape[0], 1), e), one)
                        .reshape(xr.shape[0], -1)
                        .float()
                        for e in range(E)
                    ]
                )
                outputs.append((act, sel))
        want = observer_max_activations(outputs, E)
        assert bool((want > 0).any())
        assert got[layer].dtype == torch.float32 and got[layer].shape == (E,)
        torch.testing.assert_close(got[layer], want, rtol=1e-5, atol=1e-6, msg=f"{family} layer {layer}")


def test_the_maxima_file_keeps_sources_apart_and_takes_the_max_of_those_weighted(tmp_path):
    a = {0: torch.tensor([1.0, 5.0, 0.0]), 2: torch.tensor([2.0, 0.0, 3.0])}
    b = {0: torch.tensor([4.0, 1.0, 0.5]), 2: torch.tensor([0.0, 0.0, 9.0])}
    path = tmp_path / "m.safetensors"
    save_maxima({"code": a, "chat": b}, {"code": 0.7, "chat": 0.3}, path, metadata={"seed": "1234"})
    both = load_maxima(path)
    # exact: a max of stored float32 values, no arithmetic
    assert sorted(both) == [0, 2] and torch.equal(both[0], torch.tensor([4.0, 5.0, 0.5]))
    assert torch.equal(load_maxima(path, weights={"code": 1.0, "chat": 0.0})[2], a[2])  # exact: stored values
    with pytest.raises(ValueError, match="every weight is 0"):
        load_maxima(path, weights={"code": 0.0, "chat": 0.0})
    with pytest.raises(ValueError, match="weights name \\['code'\\]; the sources are \\['chat', 'code'\\]"):
        load_maxima(path, weights={"code": 1.0})
    with pytest.raises(ValueError, match="weight of source 'chat': -1"):
        load_maxima(path, weights={"code": 1.0, "chat": -1})
    with pytest.raises(ValueError, match="source 'b' has layers \\[0\\]"):
        save_maxima({"a": a, "b": {0: a[0]}}, {"a": 1.0, "b": 1.0}, path)
    with pytest.raises(ValueError, match="source name 'a.b'"):
        save_maxima({"a.b": a}, {"a.b": 1.0}, path)
    from safetensors.torch import save_file

    other = tmp_path / "stats.safetensors"
    save_file({"layer.0.count": torch.ones(3)}, str(other), metadata={"format": "moesweep.layerstats/4"})
    with pytest.raises(ValueError, match="an expert_maxima file"):
        load_maxima(other)


# ---- planning: the stage runs only when asked, once, and only reap conversions read it ---------------
def _raw(grid_extra: list | None = None) -> dict:
    """tests/sweeps/moe.yaml's teacher and calibration; smaller MoEs unprotected (REAP, K = 2) and by our
    factor (EAN), a dense student, and `grid_extra`; nothing after the pre-distillation perplexity."""
    raw = yaml.safe_load((HERE / "sweeps" / "moe.yaml").read_text())
    raw["grid"] = [
        {"scoring": ["SF"], "grouping": ["RR"], "K": [2]},
        {"output": ["moe"], "scoring": ["REAP"], "K": [2], "recovery": ["none"]},
        {"output": ["moe"], "scoring": ["EAN"], "K": [4], "settings": {"moe": {"super_experts": 2.0}}},
        *(grid_extra or []),
    ]
    for section in ("distill", "router_kd", "evaluate"):
        raw.pop(section, None)
    raw["select"] = None
    return raw


REAP_GRID = [
    {"output": ["moe"], "scoring": ["REAP", "SF"], "K": [4], "settings": {"moe": {"super_experts": "reap"}}}
]
REAP_CONFIGS = ["moe|REAP|K=4|recovery=none", "moe|SF|K=4|recovery=none"]
MAX_ACT_GRID = {"output": ["moe"], "scoring": ["max_activations"], "K": [4]}
MAX_ACT_CONFIG = "moe|max_activations|K=4|recovery=none"


def _spec(raw: dict, tmp_path: Path, name: str):
    from orchestrator.spec import load_spec

    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return load_spec(str(path))


def _plan(spec) -> dict:
    from orchestrator import dryrun
    from orchestrator.stage import SweepContext, stages

    shape = dryrun.P.stated_shape(spec)
    ctx = SweepContext(spec, shape, dryrun.P.build_configs(spec, shape))
    for st in stages():
        if st.name in ("teacher", "calibrate", "expert_maxima", "dcdm", "convert"):
            ctx.jobs[st.name] = st.jobs(ctx)
    return ctx.jobs


def test_the_stage_is_planned_once_only_for_reap_and_other_conversions_keep_their_keys(tmp_path):
    plain = _plan(_spec(_raw(), tmp_path, "plain")[0])
    assert plain["expert_maxima"] == {}
    assert all("expert_maxima" not in j.deps for j in plain["convert"].values())
    jobs = _plan(_spec(_raw(REAP_GRID), tmp_path, "reap")[0])
    assert sorted(jobs["expert_maxima"]) == REAP_CONFIGS
    maxima = {j.key for j in jobs["expert_maxima"].values()}
    assert len(maxima) == 1  # one pass per teacher × calibration data, shared
    job = next(iter(jobs["expert_maxima"].values()))
    assert job.deps == {"teacher": next(iter(jobs["teacher"].values())).key}
    calib = next(iter(jobs["calibrate"].values())).params
    assert {k: job.params[k] for k in ("teacher", "data", "n_samples", "seq_len", "seed", "batch_size")} == {
        k: calib[k] for k in ("teacher", "data", "n_samples", "seq_len", "seed", "batch_size")
    }
    for ck, j in jobs["convert"].items():
        if ck in REAP_CONFIGS:
            assert j.params["settings"] == {"super_experts": "reap"} and j.deps["expert_maxima"] in maxima
        else:  # the conversions that do not ask keep their deps and keys
            assert "expert_maxima" not in j.deps and j.key == plain["convert"][ck].key, ck
    # the calibration keeps its key: the statistic is not part of it
    assert {j.key for j in jobs["calibrate"].values()} == {j.key for j in plain["calibrate"].values()}


def test_the_max_activations_scoring_reads_the_pass_for_a_pruned_moe_and_a_dense_student(tmp_path):
    dense = {"scoring": ["max_activations"], "grouping": ["RR"], "K": [2]}
    jobs = _plan(_spec(_raw([MAX_ACT_GRID, dense]), tmp_path, "maxact")[0])
    asking = [MAX_ACT_CONFIG, "max_activations|RR|uniform|K=2"]
    assert sorted(jobs["expert_maxima"]) == sorted(asking)
    (key,) = {j.key for j in jobs["expert_maxima"].values()}
    for ck, j in jobs["convert"].items():
        assert (j.deps.get("expert_maxima") == key) == (ck in asking), ck


def test_the_max_activations_score_is_the_measured_maxima_and_needs_them():
    from dataclasses import replace

    from workers.methods.scoring import get_scoring

    plain = ctx(stats([1.0, 1.0, 1.0, 1.0], [5, 5, 5, 5], [0.1, 0.1, 0.1, 0.1]))
    with pytest.raises(ValueError, match="max_activations needs the per-expert max activations"):
        get_scoring("max_activations").score(plain)
    measured = replace(plain, maxima=torch.tensor([0.5, 3.0, 0.0, 2.0]))
    scores = get_scoring("max_activations").score(measured)
    assert scores.tolist() == [0.5, 3.0, 0.0, 2.0]  # exact: the float32 maxima widened to float64
    assert sorted(get_scoring("max_activations").select(measured, scores, 2).selected) == [1, 3]


def test_a_streamed_calibration_plans_a_streamed_pass_and_a_resident_one_keeps_its_parameters(tmp_path):
    resident = _plan(_spec(_raw(REAP_GRID), tmp_path, "resident")[0])
    (plain,) = {j.key: j for j in resident["expert_maxima"].values()}.values()
    assert "streamed" not in plain.params and "offload_hidden" not in plain.params
    for extra in ({"streamed": True}, {"streamed": True, "offload_hidden": True}):
        raw = _raw(REAP_GRID)
        raw["calibration"] = {**raw["calibration"], **extra}
        jobs = _plan(_spec(raw, tmp_path, "streamed")[0])
        (job,) = {j.key: j for j in jobs["expert_maxima"].values()}.values()
        assert job.params == {**plain.params, **extra} and job.key != plain.key
        assert sorted(jobs["expert_maxima"]) == REAP_CONFIGS


@pytest.mark.parametrize(("grid", "asking"), [([MAX_ACT_GRID], [MAX_ACT_CONFIG]), (REAP_GRID, REAP_CONFIGS)])
def test_dcdm_refuses_a_configuration_that_reads_the_maxima_and_plans_once_narrowed(tmp_path, grid, asking):
    """DCDM's rounds compress from mixed statistics alone: a configuration it applies to that reads the
    max activations is one line before anything runs; narrowed by apply_to, both plan."""
    from orchestrator.schema import SpecError

    raw = yaml.safe_load((HERE / "sweeps" / "dcdm.yaml").read_text())
    raw["grid"] = [{"output": ["moe"], "scoring": ["EAN"], "K": [3], "recovery": ["none"]}, *grid]
    with pytest.raises(SpecError) as e:
        _plan(_spec(raw, tmp_path, "dcdm")[0])
    assert str(e.value) == (
        f"dcdm.apply_to: {{'output': 'moe'}} matches {asking[0]}, which reads the expert_maxima pass (scoring "
        "max_activations or super_experts: reap) that DCDM's rounds do not run; narrow dcdm.apply_to to leave it out"
    )
    raw["dcdm"]["apply_to"] = {"output": "moe", "scoring": "EAN"}
    jobs = _plan(_spec(raw, tmp_path, "narrowed")[0])
    assert sorted(jobs["dcdm"]) == ["moe|EAN|K=3|recovery=none"]
    assert sorted(jobs["expert_maxima"]) == sorted(asking)


@pytest.mark.parametrize("bad", ["REAP", "10", True, 0.5, [2.0]])
def test_a_setting_neither_a_factor_nor_reap_is_refused_before_anything_runs(tmp_path, bad):
    from orchestrator.schema import SpecError

    grid = [{"output": ["moe"], "scoring": ["SF"], "K": [4], "settings": {"moe": {"super_experts": bad}}}]
    spec, _, _ = _spec(_raw(grid), tmp_path, "bad")
    with pytest.raises(SpecError) as e:
        _plan(spec)
    assert str(e.value) == (
        f"grid: moe|SF|K=4|recovery=none: super_experts={bad!r}; allowed: a number >= 1 (our rule, a factor "
        "of the layer's median peak routed output norm) or 'reap' (REAP's rule on max activations)"
    )


# ---- end to end -----------------------------------------------------------------------------------------
def test_a_micro_sweep_runs_the_pass_and_its_conversions_record_the_protected_experts(tmp_path, monkeypatch):
    """tests/sweeps/moe.yaml's teacher, its smaller MoEs unprotected, by our factor and by REAP's rule, up to
    their conversions: one expert_maxima job; REAP's protected experts in plan.json and layer_diag."""
    from rich.console import Console

    from db.store import Store
    from orchestrator.execute import SerialExecutor
    from orchestrator.launch import launch
    from orchestrator.scope import Scope

    monkeypatch.setenv("MOESWEEP_HOME", str(tmp_path / "home"))
    raw = _raw([*REAP_GRID, MAX_ACT_GRID])
    raw["grid"] = raw["grid"][1:]  # the smaller MoEs only
    spec, path, text = _spec(raw, tmp_path, "micro")
    store = Store(f"sqlite:///{tmp_path}/r.db")
    quiet = Console(quiet=True)
    until = Scope(until="convert")
    assert (
        launch(
            spec,
            text,
            store,
            SerialExecutor(),
            console=quiet,
            show_progress=False,
            path=str(path),
            scope=until,
        )
        == 0
    )
    rows = store.query("SELECT status, outputs_json FROM jobs WHERE stage = 'expert_maxima'")[1]
    assert len(rows) == 1 and rows[0][0] == "succeeded"
    out = json.loads(rows[0][1])
    maxima = load_maxima(out["maxima"])
    assert sorted(maxima) == out["layers"] == [0, 1]
    assert all(m.shape == (8,) and bool((m >= 0).all()) for m in maxima.values())
    want = reap_super_experts(torch.stack([maxima[i] for i in sorted(maxima)]))
    assert want[1] == []  # 2 MoE layers: only the first may hold a super expert (int(2 · 0.75) = 1)
    assert want[0], "the tiny teacher's largest max activation is in its first layer: a super expert"
    plans, settings = {}, {}
    for ck, setting, outputs in store.query(
        "SELECT c.config_key, c.settings, j.outputs_json FROM config_jobs cj "
        "JOIN configurations c ON c.id = cj.config_id JOIN jobs j ON j.id = cj.job_id WHERE cj.stage = 'convert'"
    )[1]:
        plans[ck] = json.loads(Path(json.loads(outputs)["plan_path"]).read_text())
        settings[ck] = json.loads(setting or "{}")
    assert sorted(plans) == sorted(
        [*REAP_CONFIGS, MAX_ACT_CONFIG, "moe|REAP|K=2|recovery=none", "moe|EAN|K=4|recovery=none"]
    )
    # max_activations keeps each layer's 4 experts of the largest max activation (ties: lower id)
    for i, pl in enumerate(plans[MAX_ACT_CONFIG]):
        m = maxima[sorted(maxima)[i]].tolist()
        assert sorted(pl["selected"]) == sorted(sorted(range(8), key=lambda e: (-m[e], e))[:4])
    for ck in REAP_CONFIGS:
        assert settings[ck] == {"super_experts": "reap"}
        for i, pl in enumerate(plans[ck]):
            assert pl["extras"]["super_expert_ids"] == want[i]
            assert pl["extras"]["protected_ids"] == want[i][:4]
            assert pl["selected"][: len(want[i][:4])] == want[i][:4]
    assert all("protected_ids" in pl["extras"] for pl in plans["moe|EAN|K=4|recovery=none"])  # ours
    assert all("protected_ids" not in pl["extras"] for pl in plans["moe|REAP|K=2|recovery=none"])
    diag = store.query(
        "SELECT c.config_key, d.layer, d.name, d.value FROM layer_diag d "
        "JOIN config_jobs cj ON cj.job_id = d.job_id AND cj.stage = 'convert' "
        "JOIN configurations c ON c.id = cj.config_id WHERE d.name IN ('super_experts', 'protected')"
    )[1]
    got = {(ck, layer, name): value for ck, layer, name, value in diag}
    for ck in REAP_CONFIGS:
        for i, layer in enumerate(sorted(maxima)):
            assert got[(ck, layer, "super_experts")] == len(want[i])
            assert got[(ck, layer, "protected")] == len(want[i][:4])


def test_a_streamed_sweep_measures_the_maxima_and_protects_the_experts_the_resident_one_does(
    tmp_path, monkeypatch
):
    """The same sweep with `calibration.streamed: true` (the teacher read one decoder layer at a time, its hidden
    states offloaded) beside the resident one, in one home: its own expert_maxima job, equal maxima, the same
    protected experts in the REAP conversions' plans."""
    from sweep_runs import launch_serial

    from db.store import Store
    from orchestrator.scope import Scope

    monkeypatch.setenv("MOESWEEP_HOME", str(tmp_path / "home"))
    store = Store(f"sqlite:///{tmp_path}/r.db")
    found = {}
    for name, extra in (("resident", {}), ("streamed", {"streamed": True, "offload_hidden": True})):
        raw = _raw(REAP_GRID)
        raw["grid"] = raw["grid"][3:]  # REAP's rule only
        raw["calibration"] = {**raw["calibration"], **extra}
        raw["name"] = name
        spec, path, text = _spec(raw, tmp_path, name)
        assert launch_serial(spec, text, store, path, scope=Scope(until="convert")) == 0, name
        (params, outputs), *more = store.query(
            "SELECT j.params_json, j.outputs_json FROM jobs j JOIN sweep_jobs sj ON sj.job_id = j.id "
            "JOIN sweeps s ON s.id = sj.sweep_id WHERE s.name = :n AND j.stage = 'expert_maxima'",
            {"n": name},
        )[1]
        assert not more and json.loads(params).get("streamed", False) == bool(extra)
        plans = {
            ck: json.loads(Path(json.loads(out)["plan_path"]).read_text())
            for ck, out in store.query(
                "SELECT c.config_key, j.outputs_json FROM config_jobs cj JOIN configurations c ON c.id = cj.config_id "
                "JOIN sweeps s ON s.id = c.sweep_id JOIN jobs j ON j.id = cj.job_id "
                "WHERE cj.stage = 'convert' AND s.name = :n",
                {"n": name},
            )[1]
        }
        found[name] = (load_maxima(json.loads(outputs)["maxima"]), plans)
    (want, want_plans), (got, got_plans) = found["resident"], found["streamed"]
    assert sorted(got) == sorted(want) == [0, 1]
    for layer in want:
        torch.testing.assert_close(got[layer], want[layer], rtol=1e-5, atol=1e-5 * float(want[layer].max()))
    assert sorted(got_plans) == sorted(want_plans) == REAP_CONFIGS
    for ck in REAP_CONFIGS:
        ids = [pl["extras"]["super_expert_ids"] for pl in want_plans[ck]]
        assert [pl["extras"]["super_expert_ids"] for pl in got_plans[ck]] == ids and ids[0], ck
        assert [pl["selected"] for pl in got_plans[ck]] == [pl["selected"] for pl in want_plans[ck]], ck
