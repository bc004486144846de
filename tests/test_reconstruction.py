"""Reconstruction-loss expert selection (workers/methods/reconstruction.py): RL-exhaustive, RL-greedy and CFES
("Compressing Large MoE Models via Efficient Pruning and Data-Aware Calibration", §4.1, Algorithm 1) on
synthetic layers and tiny teachers, the calibration token sample they read, and a sweep through launch."""

from __future__ import annotations

import math
from dataclasses import replace
from itertools import combinations

import pytest
import torch
from families_cases import V, make_teacher

from workers.calibration.calibrate import collect_stats, load_stats, save_stats
from workers.core.types import ExpertWeights, LayerContext, LayerStats
from workers.families import get_adapter
from workers.methods.merge import build_dense_ffn, ffn_forward
from workers.methods.planning import plan_layer
from workers.methods.reconstruction import LayerLoss, ReconSettings, default_group_size, sequential_sample
from workers.methods.scoring import SCORINGS
from workers.models.convert import layer_contexts
from workers.models.outputs import convert_plans

RL = ("RL-exhaustive", "RL-greedy", "CFES")


def synthetic(
    E: int,
    T: int = 16,
    H: int = 8,
    inter: int = 4,
    k: int = 2,
    seed: int = 0,
    renormalized: bool = True,
    twins: int = 0,
    settings: dict | None = None,
) -> LayerContext:
    """A random layer whose token sample is T random tokens; with `twins`, experts E−twins.. are copies of
    experts 0.. (weights and router probabilities alike)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    gate, up, down, logits = r(E, inter, H), r(E, inter, H), r(E, H, inter), r(T, E)
    for j in range(twins):
        for t in (gate, up, down):
            t[E - twins + j] = t[j]
        logits[:, E - twins + j] = logits[:, j]
    z = torch.zeros(E, dtype=torch.float64)
    stats = LayerStats(
        n_tokens=T,
        count=z + 1,
        sum_p=z + 1,
        sum_p_sel=z + 1,
        sum_sq=z + 1,
        sum_gnorm_sel=z,
        sum_norm_sel=z,
        gram=torch.eye(E, dtype=torch.float64),
        sample={"x": r(T, H), "p": torch.softmax(logits, 1)},
    )
    return LayerContext(
        stats=stats,
        experts=ExpertWeights(gate=gate, up=up, down=down),
        router_weight=r(E, H),
        top_k=k,
        renormalized=renormalized,
        settings=settings,
    )


def select(name: str, ctx: LayerContext, K: int, forced: tuple[int, ...] = ()):
    return SCORINGS[name].select(ctx, torch.ones(ctx.stats.num_experts), K, forced)


def naive_pruned(ctx: LayerContext, kept: list[int]) -> torch.Tensor:
    """The pruned MoE token by token: softmax over the kept logits (= p renormalised over S), top-k,
    renormalised iff the router does, each expert by the reference FFN forward."""
    x, p = ctx.stats.sample["x"], ctx.stats.sample["p"]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        q = {e: float(p[t, e]) / sum(float(p[t, j]) for j in kept) for e in kept}
        top = sorted(kept, key=lambda e: (-q[e], e))[: min(ctx.top_k, len(kept))]
        total = sum(q[e] for e in top) if ctx.renormalized else 1.0
        for e in top:
            out[t] += q[e] / total * ffn_forward(ctx.experts, x[t], expert=e)
    return out


# ---- the layer loss -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("renormalized", [True, False])
def test_routed_subset_loss_is_the_pruned_moe_and_zero_for_the_full_set(renormalized):
    ctx = synthetic(6, renormalized=renormalized)
    loss = LayerLoss(ctx, "routed_subset")
    assert (
        loss(list(range(6))) == 0.0
    )  # exact: the reference is routed(all E): the same ops on the same tensors
    full = naive_pruned(ctx, list(range(6)))
    for kept in ([0, 2, 5], [1], [3, 4]):
        d = float(torch.linalg.vector_norm(full - naive_pruned(ctx, kept)))
        assert loss(kept) == pytest.approx(d, rel=1e-10)
    assert loss.evals == 4


@pytest.mark.parametrize("name", RL)
def test_input_scaled_experts_are_refused_in_one_line(name):
    """Llama-4's experts see w·x (ExpertWeights.input_scaled): the loss's Σ w·f(x) is not that layer."""
    ctx = synthetic(6)
    ctx = replace(ctx, experts=replace(ctx.experts, input_scaled=True))
    with pytest.raises(ValueError, match=r"^experts.input_scaled=True .*not supported$") as e:
        select(name, ctx, 3)
    assert "\n" not in str(e.value)


def test_exhaustive_finds_the_true_optimum():
    ctx = synthetic(7, seed=3)
    full = naive_pruned(ctx, list(range(7)))
    brute = min(
        combinations(range(7), 3),
        key=lambda c: float(torch.linalg.vector_norm(full - naive_pruned(ctx, list(c)))),
    )
    sel = select("RL-exhaustive", ctx, 3)
    assert sorted(sel.selected) == list(brute)
    assert sel.extras["recon_evals"] == math.comb(7, 3)


def test_exhaustive_refuses_too_many_subsets_in_one_line():
    ctx = synthetic(16, settings={"max_subsets": 1000})
    with pytest.raises(ValueError, match=r"C\(16, 8\) = 12870 subsets exceed max_subsets=1000") as e:
        select("RL-exhaustive", ctx, 8)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("name", RL)
def test_twins_are_redundant_every_search_reaches_zero_loss(name):
    """Experts 4..7 copy 0..3 (k = 1, renormalising): keeping one of each pair loses nothing, and with
    K = E − 1 the dropped expert is a twin whose copy is kept."""
    ctx = synthetic(8, k=1, twins=4, seed=5)
    for K in (4, 7):
        sel = select(name, ctx, K)
        assert sel.extras["recon_loss"] == pytest.approx(0.0, abs=1e-9)
        assert {e % 4 for e in sel.selected} == {0, 1, 2, 3}
    rand = torch.Generator().manual_seed(0)
    loss = LayerLoss(ctx, "routed_subset")
    random_losses = [loss(torch.randperm(8, generator=rand)[:4].tolist()) for _ in range(20)]
    assert max(random_losses) > 1.0  # a random half usually keeps both copies of a pair


@pytest.mark.parametrize("name", RL)
def test_zero_loss_ties_go_to_the_lower_id_not_to_rounding(name):
    """Experts 4..7 are never in a token's top-2 (renormalising router): every K = 5 set holding 0..3 reproduces
    the layer, its loss zero up to rounding (~1e-14, different per set). An exact tie: the lower id, 4, is
    the fifth expert, whether the search starts from 0..3 (forced) or, for RL-exhaustive, from nothing."""
    for seed in range(4):
        ctx = synthetic(8, k=2, seed=seed)
        logits = torch.randn(16, 8, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        logits[:, 4:] -= 30.0
        ctx.stats.sample["p"] = torch.softmax(logits, 1)
        runs = [select(name, ctx, 5, forced=(0, 1, 2, 3))]
        if name == "RL-exhaustive":
            runs.append(select(name, ctx, 5))
        for sel in runs:
            assert sel.extras["recon_loss"] == pytest.approx(0.0, abs=1e-9)
            assert sorted(sel.selected) == [0, 1, 2, 3, 4], (seed, sel.selected)
        loss = LayerLoss(ctx, "routed_subset")
        zero = [loss([0, 1, 2, 3, e]) for e in range(4, 8)]
        assert max(zero) < 1e-9 and len(set(zero)) > 1  # tied in exact arithmetic, not in floating point


@pytest.mark.parametrize("name", ["RL-greedy", "CFES"])
def test_searches_beat_random_subsets(name):
    """On random layers, greedy and coarse-to-fine do better than the median random K-subset and never worse
    than the worst; the exhaustive optimum bounds them from below."""
    for seed in range(4):
        ctx = synthetic(10, T=24, seed=seed)
        loss = LayerLoss(ctx, "routed_subset")
        gen = torch.Generator().manual_seed(seed)
        rand = sorted(loss(torch.randperm(10, generator=gen)[:5].tolist()) for _ in range(31))
        d = select(name, ctx, 5).extras["recon_loss"]
        best = select("RL-exhaustive", ctx, 5).extras["recon_loss"]
        assert best <= d + 1e-12 and d <= rand[15]


@pytest.mark.parametrize("name", RL)
def test_forced_experts_are_kept_first(name):
    sel = select(name, synthetic(8, seed=2), 4, forced=(6, 1))
    assert sel.selected[:2] == [6, 1] and len(set(sel.selected)) == 4


def test_greedy_and_coarse_to_fine_evaluation_counts_grow_as_the_paper_states():
    """E = 8…128, K = E/2: greedy makes exactly Σ_t (E − t + 1) = K(E + (1 − K)/2) evaluations (O(n²)),
    coarse-to-fine at most Σ_t ⌈(E − t + 1)/S⌉ + K·S with S = S* (O(n^1.5)); log-log slopes fitted."""
    Es, counts = [8, 16, 32, 64, 128], {"RL-greedy": [], "CFES": []}
    for E in Es:
        ctx, K = synthetic(E, T=4, H=4, inter=2), E // 2
        S = default_group_size(E, K)
        for name in counts:
            sel = select(name, ctx, K)
            counts[name].append(sel.extras["recon_evals"])
        assert counts["RL-greedy"][-1] == K * (E + (1 - K) / 2)
        assert counts["CFES"][-1] <= sum(math.ceil((E - t + 1) / S) for t in range(1, K + 1)) + K * S
        assert sel.extras["c2f_group_size"] == S
    x = torch.log(torch.tensor(Es, dtype=torch.float64))

    def slope(ys: list[int]) -> float:
        y = torch.log(torch.tensor(ys, dtype=torch.float64))
        return float(((x - x.mean()) * (y - y.mean())).sum() / ((x - x.mean()) ** 2).sum())

    assert 1.9 <= slope(counts["RL-greedy"]) <= 2.05
    assert 1.35 <= slope(counts["CFES"]) <= 1.6
    assert default_group_size(128, 64) == 10 and default_group_size(256, 128) == 14  # the paper's examples


def test_settings_are_checked_in_one_line():
    for raw, msg in [
        ({"targte": "x"}, "settings targte: reconstruction-loss selection takes"),
        ({"target": "dense"}, "settings.target='dense'; allowed: routed_subset, dense_proxy"),
        ({"group_size": 0}, "settings.group_size=0; must be an integer >= 1"),
    ]:
        with pytest.raises(ValueError, match=msg):
            ReconSettings.parse(raw)
    with pytest.raises(ValueError, match="no token sample: .*calibration.sample_tokens > 0"):
        select("CFES", replace(synthetic(6), stats=replace(synthetic(6).stats, sample=None)), 3)


def test_random_partition_is_seeded():
    a = select("CFES", synthetic(12, seed=1, settings={"partition": "random", "seed": 3}), 6)
    b = select("CFES", synthetic(12, seed=1, settings={"partition": "random", "seed": 3}), 6)
    assert a.selected == b.selected and a.extras["recon_evals"] == b.extras["recon_evals"]


# ---- on tiny teachers ----------------------------------------------------------------------------------------
def _calibrated(family: str, sample_tokens: int = 40, seed: int = 0, tmp_path=None):
    model = make_teacher(family, seed=seed, dtype=torch.float64, experts_implementation="eager")
    adapter = get_adapter(model)
    ids = torch.randint(3, V, (6, 10), generator=torch.Generator().manual_seed(1))
    batches = [(ids[:4], torch.ones(4, 10, dtype=torch.long)), (ids[4:], torch.ones(2, 10, dtype=torch.long))]
    stats = collect_stats(
        model, adapter, batches, chunk_tokens=16, sample_tokens=sample_tokens, sample_seed=seed
    )
    if tmp_path is not None:
        save_stats(stats, tmp_path / "stats.safetensors")
        stats = load_stats(tmp_path / "stats.safetensors")
    return model, adapter, ids, stats


def test_token_samples_round_trip_and_files_without_them_still_load(tmp_path):
    """The sample holds 40 distinct real tokens; each one's x is the router input at its window and position."""
    model, adapter, ids, stats = _calibrated("qwen3_moe", tmp_path=tmp_path)
    layer = adapter.moe_layers(model)[0]
    s = stats[layer].sample
    assert s["x"].shape == (40, 32) and s["p"].shape == (40, 6) and s["pos"].shape == (40,)
    rows = torch.tensor([int((ids == s["ids"][w]).all(1).nonzero()[0]) for w in s["window"]])
    assert len({(int(r), int(q)) for r, q in zip(rows, s["pos"], strict=True)}) == 40
    seen = []
    hook = adapter.router_module(model, layer).register_forward_hook(lambda m, a, o: seen.append(a[0]))
    with torch.no_grad():
        model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    hook.remove()
    full = seen[0].reshape(6, 10, -1)
    assert torch.allclose(s["x"].double(), full[rows, s["pos"]], atol=1e-6)
    plain = collect_stats(model, adapter, [(ids, torch.ones_like(ids))], chunk_tokens=16)
    save_stats(plain, tmp_path / "plain.safetensors")
    assert all(st.sample is None for st in load_stats(tmp_path / "plain.safetensors").values())


def test_samples_are_real_tokens_and_seeded():
    """Padding is never sampled; the same seed samples the same tokens; no sample leaves calibration as it was."""
    from orchestrator.stages.calibrate import Calibration
    from workers.calibration.calibrate import sample_plan

    ids = torch.randint(3, V, (2, 3, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, 0, 6:] = 0
    mask[1, 2, 2:] = 0
    batches = [(ids[0], mask[0]), (ids[1], mask[1])]
    offsets, shared = sample_plan(batches, 100, seed=4)
    assert len(shared["pos"]) == int(mask.sum())  # all real tokens, capped at what there is
    assert bool((shared["mask"][shared["window"], shared["pos"]] == 1).all())
    a, b = sample_plan(batches, 10, seed=4)[1], sample_plan(batches, 10, seed=4)[1]
    assert torch.equal(a["pos"], b["pos"]) and torch.equal(
        a["ids"], b["ids"]
    )  # exact: integers, the same seed
    assert "sample_tokens" not in Calibration().model_dump()
    assert Calibration(sample_tokens=512).model_dump()["sample_tokens"] == 512


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe"])
def test_routed_subset_is_the_teachers_layer_and_the_pruned_checkpoints_layer(family):
    """The reference is the teacher's MoE block on the sampled tokens; the candidate for S is the block of
    adapter.pruned_moe_student keeping S (renormalising Qwen3, non-renormalising OLMoE)."""
    model, adapter, _, stats = _calibrated(family)
    ctxs = layer_contexts(model, adapter, stats)
    layer = adapter.moe_layers(model)[0]
    ctx = ctxs[layer]
    x = ctx.stats.sample["x"].double()
    loss = LayerLoss(ctx, "routed_subset")
    block = model.model.layers[layer].mlp
    with torch.no_grad():
        assert torch.allclose(loss.reference, block(x[None])[0], atol=1e-5)  # the router softmax is fp32
        kept = [0, 2, 3, 5]
        pruned = adapter.pruned_moe_student(model, {m: kept for m in adapter.moe_layers(model)})
        assert torch.allclose(loss.routed(kept), pruned.model.layers[layer].mlp(x[None])[0], atol=1e-5)


def test_dense_proxy_is_the_uniform_rr_student_built_by_the_merge_code():
    model, adapter, _, stats = _calibrated("qwen3_moe")
    layer = adapter.moe_layers(model)[0]
    ctx = replace(layer_contexts(model, adapter, stats)[layer], settings={"target": "dense_proxy"})
    k = ctx.top_k
    plan = plan_layer(layer, ctx, "CFES", "RR", "uniform", k)
    x = ctx.stats.sample["x"].double()
    loss = LayerLoss(ctx, "dense_proxy")
    dense = ffn_forward(build_dense_ffn(ctx.experts, plan), x)
    assert torch.allclose(loss.output(plan.selected), dense, atol=1e-12)
    assert plan.extras["recon_loss"] == pytest.approx(float(torch.linalg.vector_norm(loss.reference - dense)))
    assert {"recon_evals", "recon_seconds", "recon_tokens", "c2f_group_size"} <= set(plan.extras)


@pytest.mark.parametrize("target", ["routed_subset", "dense_proxy"])
def test_sequential_inputs_equal_original_on_the_first_layer_and_differ_after_it(target):
    """Qwen3 tiny teacher: a dense layer 0, MoE layers 1 and 2."""
    model, adapter, _, stats = _calibrated("qwen3_moe")
    ctxs = layer_contexts(model, adapter, stats)
    first, second = adapter.moe_layers(model)
    cached = ctxs[second].stats.sample
    same = sequential_sample(model, adapter, cached, second, {first: list(range(6))}, "routed_subset")
    assert torch.allclose(same["x"], cached["x"], atol=1e-6) and torch.allclose(
        same["p"], cached["p"], atol=1e-6
    )
    p = {"output": "dense", "K": 3, "scoring": "CFES", "grouping": "RR", "dp_scaling": "uniform"}
    orig, _ = convert_plans(ctxs, {**p, "settings": {"target": target}})
    seq, _ = convert_plans(
        ctxs, {**p, "settings": {"target": target, "input": "sequential"}}, teacher=(model, adapter)
    )
    assert orig[0].selected == seq[0].selected and orig[0].extras["recon_loss"] == seq[0].extras["recon_loss"]
    assert "recon_input_seconds" not in seq[0].extras and seq[1].extras["recon_input_seconds"] > 0
    moved = sequential_sample(model, adapter, cached, second, {first: seq[0].selected}, target)
    assert not torch.allclose(moved["x"], cached["x"], atol=1e-6)
    assert seq[1].extras["recon_loss"] != orig[1].extras["recon_loss"]
    with pytest.raises(ValueError, match="sequential re-runs the teacher"):
        convert_plans(ctxs, {**p, "settings": {"input": "sequential"}})


def test_settings_reach_reconstruction_scorings_of_both_outputs_and_no_other():
    model, adapter, _, stats = _calibrated("qwen3_moe")
    ctxs = layer_contexts(model, adapter, stats)
    base = {"K": 4, "settings": {"group_size": 2}}
    moe, _ = convert_plans(ctxs, {**base, "output": "moe", "scoring": "CFES"})
    dense, _ = convert_plans(ctxs, {**base, "scoring": "CFES", "grouping": "RR", "dp_scaling": "uniform"})
    assert all(pl.extras["c2f_group_size"] == 2 for pl in moe + dense)
    assert all(pl.groups == [[e] for e in sorted(pl.selected)] for pl in moe)
    with pytest.raises(ValueError, match="a pruned MoE takes super_experts"):
        convert_plans(ctxs, {**base, "output": "moe", "scoring": "REAP"})
    protected, _ = convert_plans(
        ctxs, {"K": 4, "output": "moe", "scoring": "RL-greedy", "settings": {"super_experts": 1.0}}
    )
    assert all(
        pl.selected[: len(pl.extras["protected_ids"])] == pl.extras["protected_ids"] for pl in protected
    )


# ---- through launch --------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_sweep_selects_by_reconstruction_for_a_dense_student_and_a_pruned_moe(tmp_path, monkeypatch):
    """tests/sweeps/recon.yaml: CFES (dense_proxy, sequential) for dense students, CFES (sequential) and
    RL-greedy for pruned MoEs; the evaluation counts and times become layer diagnostics."""
    from sweep_runs import launch_serial

    from db.store import Store
    from orchestrator.spec import load_spec
    from tests.test_orchestrator import HERE

    monkeypatch.setenv("MOESWEEP_HOME", str(tmp_path / "home"))
    spec, path, text = load_spec(str(HERE / "sweeps" / "recon.yaml"))
    store = Store(f"sqlite:///{tmp_path}/r.db")
    assert launch_serial(spec, text, store, path) == 0
    rows = store.query(
        "SELECT config_key, output, ppl_pre FROM results WHERE kind IN ('moe2dense', 'moe2moe') ORDER BY config_id"
    )[1]
    assert {r[0] for r in rows} == {
        "CFES|RR|uniform|K=2",
        "CFES|RR|uniform|K=4",
        "moe|CFES|K=4|recovery=none",
        "moe|RL-greedy|K=4|recovery=none",
    }
    assert all(r[2] is not None for r in rows)
    names = {r[0] for r in store.query("SELECT DISTINCT name FROM layer_diag")[1]}  # numeric extras
    assert {"recon_evals", "recon_seconds", "recon_loss", "c2f_group_size", "recon_input_seconds"} <= names
