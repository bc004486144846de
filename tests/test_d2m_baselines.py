"""The dense → MoE baselines DOT-MoE compares against, built without training (CMoE, LLaMA-MoE-v2):
their partitions are partitions, all experts at gate 1 are the dense FFN, CMoE's router is its
representatives' activations, LLaMA-MoE-v2's split and residual expert are its code's greedy rules, and
the `dot_moe` stage plans and runs them beside DOT-MoE."""

from __future__ import annotations

import copy
import itertools
import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from test_dot_moe import _dense, _ids
from torch.nn import functional as F
from transformers import AutoModelForCausalLM

from workers.baselines.dense_to_moe_baselines import (
    D2mQwen3MoeConfig,
    D2mQwen3MoeForCausalLM,
    D2mSparseMoeBlock,
    atopk_markers,
    balanced_assignment,
    balanced_kmeans,
    bounded_assignment,
    cmoe_partition,
    cmoe_router,
    importance,
    importance_split,
    llama_moe_v2_partition,
    residual_neurons,
    split_ffn,
)
from workers.baselines.dot_moe import align, extract, install
from workers.baselines.dot_moe_spec import D2mBaselineSpec, DotMoeSpec, baseline_job_settings
from workers.models.dot_moe_hf import set_top_k

ROOT = Path(__file__).resolve().parent.parent
SMALL = {"calib_sequences": 4, "seq_len": 16, "batch_size": 2, "k_act": 6, "kmeans_restarts": 2}


def _logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def _converted(method: str, experts: int, top_k: int, shared: int, d_ffn: int = 64, **settings):
    """(dense model, its converted copy's wrappers, the copy, the job's spec) of one baseline."""
    dense = _dense(d_ffn)
    spec = DotMoeSpec(**baseline_job_settings(method, experts, top_k, shared, {**SMALL, **settings}))
    work = copy.deepcopy(dense)
    ffns = install(work, experts, top_k, method, spec)
    rec = align(work, ffns, (_ids(50 + i, spec.batch_size) for i in range(spec.steps)), spec)
    assert rec == {"curve": [], "steps": spec.steps, "trainable_params": 0}
    return dense, ffns, work, spec


def _block(hidden: int, routed: int, width: int, shared: int, top_k: int, **kw) -> D2mSparseMoeBlock:
    cfg = D2mQwen3MoeConfig(
        hidden_size=hidden,
        num_experts=routed,
        num_experts_per_tok=top_k,
        moe_intermediate_size=width,
        shared_intermediate_size=shared * width,
        hidden_act="silu",
        **kw,
    )
    cfg._experts_implementation = "eager"
    return D2mSparseMoeBlock(cfg).double()


# ---- a partition with every expert at gate 1 is the dense FFN --------------------------------------------
@pytest.mark.parametrize("shared", [0, 2])
def test_all_experts_at_gate_one_are_the_dense_ffn(shared):
    """Splitting the neurons into groups and applying every group with weight 1 adds up the dense
    FFN's neuron contributions exactly once (DOT-MoE §2.2.2, App. E)."""
    g = torch.Generator().manual_seed(0)
    hidden, width, routed = 12, 4, 3
    n = (shared + routed) * width
    gate, up = torch.randn(n, hidden, generator=g).double(), torch.randn(n, hidden, generator=g).double()
    down = torch.randn(hidden, n, generator=g).double()
    owner = [-1] * (shared * width) + [e for e in range(routed) for _ in range(width)]
    owner = [owner[i] for i in torch.randperm(n, generator=g).tolist()]
    block = _block(hidden, routed, width, shared, routed)
    weights = {
        **split_ffn(gate, up, down, owner, routed),
        "gate.weight": torch.randn(routed, hidden).double(),
    }
    block.load_state_dict(weights)
    x = torch.randn(2, 5, hidden, generator=g).double()
    dense = (F.silu(x @ gate.T) * (x @ up.T)) @ down.T
    with torch.no_grad():
        torch.testing.assert_close(block(x), dense)
    with pytest.raises(ValueError, match="one size"):
        split_ffn(gate, up, down, [0] * n, routed)


@pytest.mark.parametrize("d_ffn", [64, 60])
def test_cmoe_with_every_routed_expert_active_is_the_dense_model(d_ffn):
    """CMoE's training-free gates are 1 (1 + p·u with u = 0): at k = E − S the shared and routed experts
    together are the dense FFN of every layer, padding included."""
    dense, ffns, work, _ = _converted("cmoe", 8, 2, 1, d_ffn)
    moe = extract(work, ffns)
    assert isinstance(moe, D2mQwen3MoeForCausalLM) and moe.config.num_experts == 7
    ids = _ids(7, 2)
    assert set_top_k(moe, 7) == 2
    torch.testing.assert_close(_logits(moe, ids), _logits(dense, ids), rtol=1e-5, atol=1e-5)
    set_top_k(moe, 2)
    assert not torch.allclose(_logits(moe, ids), _logits(dense, ids), atol=1e-3)


# ---- partitions ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["cmoe", "llama_moe_v2"])
@pytest.mark.parametrize("shared", [0, 1, 2])
def test_every_neuron_is_in_exactly_one_expert(method, shared):
    _, ffns, work, _ = _converted(method, 4, 1, shared, 64)
    for f in ffns:
        owner = f.owner()
        assert len(owner) == f.n == 64 and f.s == 16
        want = {e: 16 for e in range(4 - shared)} | ({-1: 16 * shared} if shared else {})
        assert Counter(owner) == want
    moe = extract(work, ffns)
    shapes = moe.model.layers[0].mlp.experts.gate_up_proj.shape
    assert tuple(shapes) == (4 - shared, 32, 32)
    shared_mlp = moe.model.layers[0].mlp.shared_expert
    assert (shared_mlp is None) == (shared == 0)
    if shared:
        assert shared_mlp.gate_proj.weight.shape == (16 * shared, 32)


def test_atopk_marks_each_tokens_k_largest_magnitudes():
    h = torch.randn(20, 12, generator=torch.Generator().manual_seed(3))
    a = atopk_markers(h, 4)
    for t in range(20):
        order = sorted(range(12), key=lambda i: -abs(float(h[t, i])))
        assert {i for i in range(12) if a[t, i] == 1} == set(order[:4])
    assert set(a.unique().tolist()) == {0.0, 1.0}
    with pytest.raises(ValueError, match="K_a"):
        atopk_markers(h, 13)


def test_balanced_assignment_is_the_cheapest_balanced_partition():
    """The exact balanced linear assignment (CMoE's code: Jonker-Volgenant), against every balanced
    assignment."""
    cost = torch.rand(6, 3, generator=torch.Generator().manual_seed(4)).double()
    got = balanced_assignment(cost, 2)
    assert Counter(got.tolist()) == {0: 2, 1: 2, 2: 2}
    best = min(
        sum(float(cost[i, c]) for i, c in enumerate(p))
        for p in set(itertools.permutations([0, 0, 1, 1, 2, 2]))
    )
    assert sum(float(cost[i, c]) for i, c in enumerate(got.tolist())) == pytest.approx(best)


def test_cmoe_shares_the_most_often_active_neurons_and_groups_co_activated_ones():
    """Neurons 0-3 fire on every token (shared); the others fire in three groups of four on disjoint
    thirds of the tokens. CMoE's balanced k-means recovers the groups; each representative is the member
    nearest (L1) its cluster's mean marker vector."""
    t, groups = 30, [[4, 7, 10, 13], [5, 8, 11, 14], [6, 9, 12, 15]]
    a = torch.zeros(t, 16)
    a[:, :4] = 1
    for j, grp in enumerate(groups):
        a[j * 10 : (j + 1) * 10, grp] = 1
    a[3, 9] = 1  # noise
    a[25, 4] = 0
    owner, reps = cmoe_partition(a, shared=1, routed=3, width=4)
    assert [i for i, o in enumerate(owner) if o == -1] == [0, 1, 2, 3]
    assert sorted(sorted(i for i, o in enumerate(owner) if o == e) for e in range(3)) == sorted(groups)
    for e, r in enumerate(reps):
        members = [i for i, o in enumerate(owner) if o == e]
        centre = a[:, members].mean(1)
        dist = [float((a[:, i] - centre).abs().sum()) for i in members]
        assert owner[r] == e and r == members[dist.index(min(dist))]


def test_cmoe_router_is_training_free_and_picks_the_highest_scoring_representatives():
    """CMoE's router (its code's Router.forward): expert e scores |(x·ŵ_up,e)·SiLU(x·ŵ_gate,e)| with
    ŵ its representative neuron's L2-normalised rows; a token goes to its k highest, each weighted 1."""
    g = torch.Generator().manual_seed(5)
    hidden, n, reps = 10, 24, [3, 17, 8, 20]
    w_gate, w_up = torch.randn(n, hidden, generator=g).double(), torch.randn(n, hidden, generator=g).double()
    up_rows, gate_rows = cmoe_router(w_gate, w_up, reps)
    block = _block(hidden, 4, 6, 0, 2, router_kind="cmoe")
    block.gate.load_state_dict({"weight": up_rows, "gate_weight": gate_rows})
    x = torch.randn(7, hidden, generator=g).double()
    logits, weights, idx = block.gate(x)
    for t in range(7):
        score = []
        for r in reps:
            u = float(x[t] @ w_up[r]) / float(w_up[r].norm())
            v = float(x[t] @ w_gate[r]) / float(w_gate[r].norm())
            score.append(abs(u * v / (1 + torch.exp(torch.tensor(-v)).item())))
        torch.testing.assert_close(logits[t], torch.tensor(score, dtype=logits.dtype))
        assert set(idx[t].tolist()) == set(sorted(range(4), key=lambda e: -score[e])[:2])
    assert torch.all(weights == 1)  # exact: the training-free gate is the constant 1
    assert {n for n, _ in block.gate.named_parameters()} == {"weight", "gate_weight"}


def test_converted_cmoe_router_holds_its_representatives_rows():
    _, ffns, _, _ = _converted("cmoe", 4, 1, 1, 64)
    for f in ffns:
        owner = f.owner()
        w_up = f.mlp.up_proj.weight
        rows = f.block.gate.weight
        reps = [int(torch.cdist(rows[e : e + 1], F.normalize(w_up, dim=1)).argmin()) for e in range(3)]
        assert [owner[r] for r in reps] == [0, 1, 2]
        torch.testing.assert_close(rows, F.normalize(w_up[reps], dim=1))


# ---- LLaMA-MoE-v2 ----------------------------------------------------------------------------------------
def _official_residual(scores: torch.Tensor, count: int, width: int) -> list[int]:
    """LLaMA-MoE-v2's split_with_neuron_sharing (expert_split_residual.py), transcribed with lists."""
    lists = [sorted(range(scores.shape[1]), key=lambda i: (-float(row[i]), i)) for row in scores]
    out: list[int] = []
    while len(out) < count:
        times = Counter(i for lst in lists for i in lst[:width])
        for rep in range(len(lists), 0, -1):
            hit = sorted(i for i, c in times.items() if c == rep)
            if hit:
                out += hit[: count - len(out)]
                break
        lists = [[i for i in lst if i not in out] for lst in lists]
    return out


def _official_split(scores: torch.Tensor, width: int, exclude: list[int]) -> list[int]:
    """LLaMA-MoE-v2's split_without_neuron_sharing, transcribed: each step the best free neuron of each
    expert that is not full, the largest of those wins."""
    experts, n = scores.shape
    lists = [sorted(range(n), key=lambda i: -float(row[i])) for row in scores]
    owner, used, size = [-1] * n, set(exclude), [0] * experts
    while len(used) < n:
        best = None
        for e in range(experts):
            if size[e] == width:
                continue
            i = next(i for i in lists[e] if i not in used)
            if best is None or float(scores[e, i]) >= float(scores[best[0], best[1]]):
                best = (e, i)
        owner[best[1]], size[best[0]] = best[0], size[best[0]] + 1
        used.add(best[1])
    return owner


def test_residual_neurons_are_those_most_clusters_rank_high():
    scores = torch.tensor(
        [
            [9.0, 8.0, 1.0, 0.0, 2.0, 0.0],
            [9.0, 0.0, 8.0, 1.0, 0.0, 2.0],
            [9.0, 7.0, 0.0, 8.0, 0.0, 0.0],
        ]
    )
    assert residual_neurons(scores, 1, 2) == [0]  # every cluster's top two hold neuron 0
    assert residual_neurons(scores, 2, 2) == [0, 1]  # then neuron 1 is in two of the three
    g = torch.Generator().manual_seed(6)
    for _ in range(5):
        s = torch.rand(3, 24, generator=g)
        assert residual_neurons(s, 6, 6) == _official_residual(s, 6, 6)


def test_importance_split_is_the_greedy_of_llama_moe_v2s_code():
    g = torch.Generator().manual_seed(7)
    for shared in (0, 1):
        s = torch.rand(3, (3 + shared) * 5, generator=g)
        res = residual_neurons(s, 5 * shared, 5) if shared else []
        got = importance_split(s, 5, res)
        assert got == _official_split(s, 5, res)
        assert got == llama_moe_v2_partition(s, shared, 5)
        assert Counter(got) == {e: 5 for e in range(3)} | ({-1: 5} if shared else {})


def test_importance_is_the_mean_of_h_times_its_gradient_per_cluster():
    """|h · ∂L/∂h| averaged over each cluster's tokens (a token's cluster: its largest x·c), L the
    dense model's LM loss, against autograd on the dense model's own FFN hidden states."""
    dense = _dense()
    spec = DotMoeSpec(**baseline_job_settings("llama_moe_v2", 4, 2, 0, SMALL))
    work = copy.deepcopy(dense)
    ffns = install(work, 4, 2, "llama_moe_v2", spec)
    g = torch.Generator().manual_seed(8)
    centroids = [torch.randn(4, 32, generator=g) for _ in ffns]
    windows = [_ids(60, 2), _ids(61, 2)]
    got = importance(work, ffns, centroids, windows)
    want = [torch.zeros(4, 64) for _ in ffns]
    count = [torch.zeros(4) for _ in ffns]
    seen: list[torch.Tensor] = []  # each layer's FFN hidden state h (the input of down_proj)
    xs: list[torch.Tensor] = []  # each layer's FFN input x
    hooks = [
        layer.mlp.down_proj.register_forward_pre_hook(lambda m, a: seen.append(a[0]) or a[0].retain_grad())
        for layer in dense.model.layers
    ]
    hooks += [
        layer.mlp.register_forward_pre_hook(lambda m, a: xs.append(a[0])) for layer in dense.model.layers
    ]
    hooks.append(
        dense.get_input_embeddings().register_forward_hook(lambda m, a, out: out.requires_grad_(True))
    )
    for ids in windows:
        seen.clear()
        xs.clear()
        dense(input_ids=ids, labels=ids).loss.backward()
        for i, (h, x) in enumerate(zip(seen, xs, strict=True)):
            c = (x.reshape(-1, 32) @ centroids[i].T).argmax(-1)
            contrib = (h * h.grad).abs().reshape(-1, 64)
            for t in range(len(c)):
                want[i][c[t]] += contrib[t]
                count[i][c[t]] += 1
    for h in hooks:
        h.remove()
    for i in range(len(ffns)):
        torch.testing.assert_close(got[i], want[i] / count[i].clamp(min=1)[:, None], rtol=1e-4, atol=1e-7)
    assert all(float(m.sum()) > 0 for m in got)


def test_bounded_kmeans_keeps_sizes_within_the_jitter_and_finds_separated_blobs():
    g = torch.Generator().manual_seed(9)
    centres = torch.tensor([[0.0, 0.0], [10.0, 0.0], [0.0, 10.0]])
    x = torch.cat([centres[j] + 0.3 * torch.randn(n, 2, generator=g) for j, n in enumerate((60, 30, 30))])
    c = balanced_kmeans(x, 3, 0.6, 30, 3, torch.Generator().manual_seed(0))
    near = torch.cdist(centres, c).min(1).values
    assert bool((near < 1.0).all()), c
    d = torch.rand(40, 4, generator=g)
    d[:, 0] = -1  # every row prefers cluster 0
    a = bounded_assignment(d, 8, 12)
    sizes = torch.bincount(a, minlength=4)
    assert int(sizes.min()) >= 8 and int(sizes.max()) <= 12


def test_llama_moe_v2_routes_by_its_centroids_and_renormalised_top_k_times_the_scale():
    _, ffns, work, spec = _converted("llama_moe_v2", 4, 2, 0, 64)
    moe = extract(work, ffns)
    cfg = moe.config
    assert (cfg.router_kind, cfg.moe_combine, cfg.routed_scale, cfg.norm_topk_prob) == (
        "linear",
        "renorm_prob",
        2.0,  # E / k: its code's 4.0 for 8 experts top-2
        True,
    )
    router = moe.model.layers[0].mlp.gate
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(10))
    _, w, idx = router(x)
    p = (x @ router.weight.T).softmax(-1)
    top = p.topk(2, dim=-1)
    assert torch.equal(idx, top.indices)  # exact: the same softmax and top-k on the same tensors
    torch.testing.assert_close(w, 2.0 * top.values / top.values.sum(-1, keepdim=True))
    _, _, _, spec1 = _converted("llama_moe_v2", 4, 1, 1, 64)
    assert spec1.baseline["scale_factor"] == 1.0  # its residual 1+7top1: 1.0


# ---- settings and planning -------------------------------------------------------------------------------
def test_stage_baselines_are_the_workers():
    from orchestrator.stages import dot_moe
    from workers.baselines.dot_moe_spec import BASELINES

    assert dot_moe.BASELINES == BASELINES and set(dot_moe.LABELS) == set(dot_moe.METHODS) | set(BASELINES)


def test_each_baseline_resolves_its_own_calibration_and_keeps_only_its_settings():
    cmoe = baseline_job_settings("cmoe", 8, 1, 1, {})
    assert (cmoe["steps"], cmoe["batch_size"], cmoe["seq_len"], cmoe["combine"]) == (1, 8, 2048, "unit")
    assert cmoe["baseline"] == {
        "shared": 1,
        "calib_sequences": 8,
        "seq_len": 2048,
        "batch_size": 8,
        "seed": 0,
        "k_act": 10,
        "cmoe_iters": 1,
    }
    lm = baseline_job_settings("llama_moe_v2", 8, 2, 0, {"jitter": 0.2})
    assert (lm["steps"], lm["batch_size"], lm["combine"]) == (256, 1, "renorm_prob")
    assert (
        lm["baseline"]["scale_factor"] == 4.0
        and lm["baseline"]["jitter"] == 0.2
        and "k_act" not in lm["baseline"]
    )
    with pytest.raises(ValueError, match="jitter"):
        D2mBaselineSpec(jitter=1.5)
    with pytest.raises(ValueError, match="top_k=4: need 1 <= top_k <= 3 routed experts"):
        install(_dense(), 4, 4, "cmoe", DotMoeSpec(**baseline_job_settings("cmoe", 4, 3, 1, {})))


@pytest.mark.parametrize(
    "section, expect",
    [
        ({"methods": ["cmoe"]}, "method 'cmoe' is built without training: list it under dot_moe.baselines"),
        ({"baselines": [{"method": "moefication", "experts": 8, "top_k": 2}]}, "unknown baseline method"),
        ({"baselines": [{"method": "cmoe", "experts": 8, "shared": 2, "top_k": 7}]}, "top_k 7 with 2 shared"),
        ({"baselines": [{"method": "cmoe", "experts": 4, "top_k": 1}] * 2}, "is listed twice"),
        ({"baseline_settings": {"shared": 1}}, "shared: set per configuration"),
        ({"baseline_settings": {"k_atc": 3}}, "k_atc: unknown key"),
        ({"settings": {"baseline": {}}}, "baseline: set per job"),
    ],
)
def test_section_errors_are_one_line(tmp_path, section, expect):
    import yaml

    from orchestrator.spec import SpecError, load_spec

    raw = yaml.safe_load((ROOT / "tests" / "sweeps" / "dot.yaml").read_text())
    raw["dot_moe"].update(section)
    f = tmp_path / "dot.yaml"
    f.write_text(yaml.safe_dump(raw, sort_keys=False))
    with pytest.raises(SpecError) as e:
        load_spec(str(f))
    assert expect in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_seed004_plans_the_papers_baselines_beside_dot_moe():
    from orchestrator import dryrun
    from orchestrator.spec import load_spec

    spec, _, _ = load_spec(str(ROOT / "sweeps" / "seed004-dot-moe-qwen3-8b.yaml"))
    got = {(b.method, b.experts, b.shared, b.top_k) for b in spec.dot_moe.baselines}
    assert got == {
        ("cmoe", 8, 1, 1),  # E8A1S1 (Tables 2-3)
        ("cmoe", 8, 2, 2),  # E8A2S2 (Table 3, Qwen2.5-7B)
        ("cmoe", 96, 0, 24),  # at DOT-MoE's granularity (App. J's check at E = 148)
        ("llama_moe_v2", 8, 0, 2),  # E8A2 (Table 2)
        ("llama_moe_v2", 8, 1, 1),  # E8A1S1 (Table 2)
    }
    rows = {r["stage"]: r for r in dryrun.plan_counts(spec)[0]}
    assert rows["dot_moe"]["named"] == 3 * 1 * 2 + 5


# ---- the stage, end to end -------------------------------------------------------------------------------
@pytest.mark.slow
def test_the_baselines_run_in_the_tiny_dot_sweep_beside_dot_moe(tmp_path, monkeypatch):
    import yaml
    from rich.console import Console

    from db.store import Store
    from orchestrator.execute import SerialExecutor
    from orchestrator.launch import launch
    from orchestrator.spec import load_spec

    monkeypatch.setenv("MOESWEEP_HOME", str(tmp_path / "home"))
    raw = yaml.safe_load((ROOT / "tests" / "sweeps" / "dot.yaml").read_text())
    raw["name"] = "dot-baselines"
    raw.pop("distill")
    raw.pop("select")
    raw["dot_moe"].update(
        {
            "methods": ["dot"],
            "dense_models": ["dense_teacher"],
            "baselines": [
                {"method": "cmoe", "experts": 4, "shared": 1, "top_k": 1, "eval_top_k": [1, 3]},
                {"method": "llama_moe_v2", "experts": 4, "top_k": 2},
            ],
            "baseline_settings": {"calib_sequences": 4, "seq_len": 32, "kmeans_restarts": 2, "k_act": 8},
        }
    )
    f = tmp_path / "dot-baselines.yaml"
    f.write_text(yaml.safe_dump(raw, sort_keys=False))
    spec, path, text = load_spec(str(f))
    store = Store(f"sqlite:///{tmp_path}/r.db")
    console = Console(quiet=True)
    assert (
        launch(spec, text, store, SerialExecutor(), console=console, show_progress=False, path=str(path)) == 0
    )
    cfgs = store.query(
        "SELECT config_key, baseline, K, top_k, settings FROM configurations WHERE kind = 'dense2moe'"
    )[1]
    by_key = {c[0]: c for c in cfgs}
    assert {k: (b, K, k_) for k, b, K, k_, _ in cfgs} == {
        "dense2moe|dot|dense_teacher|E=4|k=2": ("DOT-MoE", 4, 2),
        "dense2moe|cmoe|dense_teacher|E=4|S=1|k=1": ("CMoE", 4, 1),
        "dense2moe|llama_moe_v2|dense_teacher|E=4|k=2": ("LLaMA-MoE-v2", 4, 2),
    }
    meta = json.loads(by_key["dense2moe|cmoe|dense_teacher|E=4|S=1|k=1"][4])
    assert meta["shared"] == 1 and meta["combine"] == "unit" and meta["settings"]["baseline"]["k_act"] == 8
    rows = store.query(
        "SELECT c.config_key, m.who, m.step, m.value FROM configurations c JOIN config_jobs cj "
        "ON cj.config_id = c.id JOIN metrics m ON m.job_id = cj.job_id "
        "WHERE cj.stage = 'dot_moe' AND m.name = 'ppl'"
    )[1]
    ppl: dict[str, dict] = {}
    for key, who, step, v in rows:
        ppl.setdefault(key, {})[(who, step)] = v
    cmoe = ppl["dense2moe|cmoe|dense_teacher|E=4|S=1|k=1"]
    assert set(cmoe) == {("dense", -1), ("student", 1), ("student", 3)}
    assert cmoe[("student", 3)] == pytest.approx(
        cmoe[("dense", -1)], rel=1e-5
    )  # all experts: the dense model
    assert set(ppl["dense2moe|llama_moe_v2|dense_teacher|E=4|k=2"]) == {
        ("dense", -1),
        ("student", 1),
        ("student", 2),
        ("student", 4),
    }
    arts = store.query(
        "SELECT c.config_key, a.kind, a.path FROM configurations c JOIN config_jobs cj "
        "ON cj.config_id = c.id JOIN artifacts a ON a.job_id = cj.job_id WHERE cj.stage = 'dot_moe'"
    )[1]
    path_of = {(k, kind): p for k, kind, p in arts}
    moe = AutoModelForCausalLM.from_pretrained(path_of[("dense2moe|cmoe|dense_teacher|E=4|S=1|k=1", "moe")])
    assert isinstance(moe, D2mQwen3MoeForCausalLM) and moe.config.d2m_shared_experts == 1
    from safetensors.torch import load_file

    owner = load_file(path_of[("dense2moe|cmoe|dense_teacher|E=4|S=1|k=1", "dot_assignment")] + "")[
        "layer.0.owner"
    ]
    assert Counter(owner.tolist()) == {-1: 16, 0: 16, 1: 16, 2: 16}
    from analysis.load import load_frames
    from analysis.report import write_report

    write_report(load_frames(store.engine, ["dot-baselines"]), "dot-baselines", tmp_path / "r")
    tex = (tmp_path / "r" / "tables" / "dense2moe.tex").read_text()
    assert (
        r"cmoe (S=1) & dense\_teacher & 4 & 1 &" in tex
        and r"llama\_moe\_v2 & dense\_teacher & 4 & 2 &" in tex
    )
