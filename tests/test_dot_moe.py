"""DOT-MoE ("DOT-MoE: Differentiable Optimal Transport for MoEfication"): balanced assignment, STE forward,
exact extraction at top-k = E, checkpoint reload, runtime top-k, training, and the dot_moe stage."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

from workers.baselines.dot_moe import DotMoeFFN, align, dense_mode, extract, install, objective
from workers.baselines.dot_moe_spec import DotMoeSpec
from workers.models.dot_moe_hf import DotQwen3MoeForCausalLM, set_top_k

ROOT = Path(__file__).resolve().parent.parent
SPEC = DotMoeSpec(steps=30, batch_size=4, seq_len=16, lr=5e-2, sinkhorn_iters=20, warmup_ratio=0.2)


def _dense(d_ffn: int = 64, seed: int = 0):
    """A small random Qwen3 whose FFNs matter (large init), in eval mode."""
    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=d_ffn,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        initializer_range=0.2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return AutoModelForCausalLM.from_config(cfg).eval()


def _ids(seed: int = 1, n: int = 4) -> torch.Tensor:
    return torch.randint(0, 128, (n, 16), generator=torch.Generator().manual_seed(seed))


def _logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def _aligned(method: str = "dot", experts: int = 8, top_k: int = 2, steps: int = 10, d_ffn: int = 64):
    dense = _dense(d_ffn)
    ffns = install(dense, experts, top_k, method, SPEC)
    align(dense, ffns, (_ids(10 + i) for i in range(steps)), SPEC)
    return dense, ffns


# ---- assignment -------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["dot", "random", "cluster"])
@pytest.mark.parametrize("d_ffn", [64, 60])
def test_greedy_rounding_gives_equal_size_experts(method, d_ffn):
    dense = _dense(d_ffn)
    ffns = install(dense, 8, 2, method, SPEC)
    for f in ffns:
        owner = f.owner()
        assert len(owner) == 8 * f.s == f.n and f.s == 8
        assert Counter(owner) == {e: 8 for e in range(8)}
        _, owner_train = f.assignment()
        assert Counter(owner_train) == {e: 8 for e in range(8)}


def test_cluster_split_groups_similar_neurons():
    """Neurons built as noisy copies of 4 prototypes: the balanced k-means split recovers the prototypes."""
    dense = _dense(32)
    mlp = dense.model.layers[0].mlp
    g = torch.Generator().manual_seed(0)
    protos = torch.randn(4, 64, generator=g)
    labels = torch.arange(32) % 4
    w = protos[labels] + 0.01 * torch.randn(32, 64, generator=g)
    with torch.no_grad():
        mlp.gate_proj.weight.copy_(w[:, :32])
        mlp.up_proj.weight.copy_(w[:, 32:])
    owner = install(dense, 4, 1, "cluster", SPEC)[0].owner()
    groups = {frozenset(i for i in range(32) if owner[i] == e) for e in range(4)}
    assert groups == {frozenset(i for i in range(32) if labels[i] == c) for c in range(4)}


# ---- the training forward -----------------------------------------------------------------------------
def test_ste_forward_equals_the_hard_masked_forward_and_reaches_a_and_the_router():
    dense = _dense()
    mlp = copy.deepcopy(dense.model.layers[0].mlp)
    ffn = DotMoeFFN(mlp, 8, 2, "dot", SPEC, torch.Generator().manual_seed(3))
    x = torch.randn(3, 5, 32)
    y = ffn(x)
    owner = torch.tensor(ffn.assignment()[1])  # the hard assignment at the current τ
    chosen = torch.nn.functional.linear(x, ffn.router).topk(2, dim=-1).indices  # [3, 5, 2]
    mask = (owner[None, None, None, :] == chosen[..., None]).any(dim=2).float()  # [3, 5, 64]
    assert (mask.sum(-1) == 2 * 8).all()  # k·s neurons per token
    h = mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x)
    torch.testing.assert_close(y, mlp.down_proj(h * mask), rtol=0, atol=1e-6)
    y.pow(2).sum().backward()
    assert ffn.affinity.grad is not None and ffn.affinity.grad.abs().sum() > 0
    assert ffn.router.grad is not None and ffn.router.grad.abs().sum() > 0
    assert all(p.grad is None for p in mlp.parameters())


def test_the_hard_assignment_is_rounded_once_per_optimizer_step(monkeypatch):
    """App. B.3.2 rounds every training step: the micro-batches of one step (A unchanged) reuse its rounding,
    an optimizer step (A updated in place) or a new τ rounds again, and the reused one is the same assignment."""
    import workers.baselines.dot_moe as dm

    calls = []
    real = dm.greedy_round
    monkeypatch.setattr(dm, "greedy_round", lambda soft, cap: calls.append(1) or real(soft, cap))
    ffn = DotMoeFFN(
        copy.deepcopy(_dense().model.layers[0].mlp), 8, 2, "dot", SPEC, torch.Generator().manual_seed(3)
    )
    opt = torch.optim.SGD([ffn.affinity], lr=10.0)
    x = torch.randn(2, 5, 32)
    for _ in range(3):  # three micro-batches of one step
        ffn(x).pow(2).sum().backward()
    assert len(calls) == 1
    first = ffn.assignment()[1]
    assert first == real(
        dm.sinkhorn(ffn.affinity, ffn.capacity(), tau=ffn.tau, iters=SPEC.sinkhorn_iters), [ffn.s] * 8
    )
    opt.step()
    ffn(x)
    assert len(calls) == 2  # the assignment() above reused it; the step's new A rounds again
    ffn.tau = ffn.tau / 2
    ffn(x)
    assert len(calls) == 3


def test_dense_mode_is_the_dense_model():
    dense = _dense()
    ids = _ids()
    ref = _logits(dense, ids)
    wrapped = copy.deepcopy(dense)
    ffns = install(wrapped, 8, 2, "dot", SPEC)
    with dense_mode(ffns):
        torch.testing.assert_close(_logits(wrapped, ids), ref)
    assert not torch.allclose(_logits(wrapped, ids), ref, atol=1e-3)


# ---- extraction -------------------------------------------------------------------------------------
@pytest.mark.parametrize("d_ffn", [64, 60])
@pytest.mark.parametrize("method", ["dot", "cluster"])
def test_top_k_equal_to_e_with_unit_combine_is_the_dense_model(d_ffn, method):
    """Block concatenation: all E experts, each weighted 1, are the dense FFN (§3, App. E)."""
    dense = _dense(d_ffn)
    ids = _ids()
    ref = _logits(dense, ids)
    wrapped = copy.deepcopy(dense)
    moe = extract(wrapped, install(wrapped, 8, 8, method, SPEC), "unit")
    assert isinstance(moe, DotQwen3MoeForCausalLM) and moe.config.num_experts == 8
    assert moe.config.moe_intermediate_size * 8 >= d_ffn
    torch.testing.assert_close(_logits(moe, ids), ref, rtol=1e-5, atol=1e-5)


def test_extracted_moe_is_the_trained_sparse_forward():
    dense, ffns = _aligned(steps=5)
    ids = _ids(99)
    trained = _logits(dense, ids)
    moe = extract(dense, ffns, "unit")
    torch.testing.assert_close(_logits(moe, ids), trained, rtol=1e-5, atol=1e-5)
    assert moe.config.num_experts_per_tok == 2 and moe.config.moe_combine == "unit"


def test_runtime_top_k_override_changes_outputs_and_k_equal_e_recovers_dense():
    dense, ffns = _aligned(steps=3)
    ids = _ids(7)
    with dense_mode(ffns):
        ref = _logits(dense, ids)
    moe = extract(dense, ffns, "unit")
    at2 = _logits(moe, ids)
    assert set_top_k(moe, 1) == 2
    at1 = _logits(moe, ids)
    set_top_k(moe, 8)
    at8 = _logits(moe, ids)
    assert not torch.allclose(at1, at2, atol=1e-3) and not torch.allclose(at2, at8, atol=1e-3)
    torch.testing.assert_close(at8, ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="top_k=9"):
        set_top_k(moe, 9)


def test_prob_combine_weights_by_router_probabilities():
    dense, ffns = _aligned(steps=3)
    ids = _ids(7)
    unit, prob = extract(dense, ffns, "unit"), extract(dense, ffns, "prob")
    assert prob.config.moe_combine == "prob" and not prob.config.norm_topk_prob
    assert not torch.allclose(_logits(unit, ids), _logits(prob, ids), atol=1e-3)
    renorm = extract(dense, ffns, "renorm_prob")
    set_top_k(renorm, 1)  # one expert renormalised to weight 1 = unit
    set_top_k(unit, 1)
    torch.testing.assert_close(_logits(renorm, ids), _logits(unit, ids), rtol=1e-5, atol=1e-5)


def test_checkpoint_reloads_in_a_fresh_interpreter(tmp_path):
    dense, ffns = _aligned(steps=3)
    moe = extract(dense, ffns, "unit")
    ids = _ids(5)
    moe.save_pretrained(tmp_path / "moe")
    torch.save(ids, tmp_path / "ids.pt")
    torch.save(_logits(moe, ids), tmp_path / "want.pt")
    code = (
        "import sys, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        "import workers.models.dot_moe_hf  # noqa\n"
        "d = sys.argv[1]\n"
        "m = AutoModelForCausalLM.from_pretrained(d + '/moe').eval()\n"
        "assert type(m).__name__ == 'DotQwen3MoeForCausalLM', type(m)\n"
        "assert m.config.moe_combine == 'unit' and m.config.num_experts_per_tok == 2\n"
        "with torch.no_grad():\n"
        "    got = m(input_ids=torch.load(d + '/ids.pt')).logits\n"
        "torch.testing.assert_close(got, torch.load(d + '/want.pt'), rtol=1e-5, atol=1e-5)\n"
        "print('same logits')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    r = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )
    assert r.returncode == 0 and "same logits" in r.stdout, r.stderr[-2000:]
    cfg = json.loads((tmp_path / "moe" / "config.json").read_text())
    assert (
        cfg["model_type"] == "dot_qwen3_moe" and cfg["moe_combine"] == "unit" and cfg["dot_method"] == "dot"
    )


def test_unsupported_dense_class_is_a_one_line_error():
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    with pytest.raises(ValueError, match=r"model_type 'llama' .* not supported; supported: qwen3"):
        install(AutoModelForCausalLM.from_config(cfg), 4, 1, "dot", SPEC)


# ---- training -----------------------------------------------------------------------------------------
def _held_out_loss(model, ffns, spec) -> float:
    for f in ffns:
        f.tau = spec.tau_end
    with torch.no_grad():
        return float(objective(model, ffns, _ids(1234, 8), spec)["loss"])


@pytest.mark.parametrize("method", ["dot", "random"])
def test_training_lowers_the_loss_on_held_out_tokens(method):
    dense = _dense()
    ffns = install(dense, 8, 2, method, SPEC)
    before = _held_out_loss(dense, ffns, SPEC)
    rec = align(dense, ffns, (_ids(100 + i, 8) for i in range(SPEC.steps)), SPEC)
    after = _held_out_loss(dense, ffns, SPEC)
    assert rec["steps"] == SPEC.steps and rec["curve"][0]["tau"] == SPEC.tau_start
    assert rec["curve"][-1]["tau"] == pytest.approx(SPEC.tau_end)
    assert after < before - 0.05, (before, after)


def test_only_the_affinities_and_routers_train():
    dense = _dense()
    ffns = install(dense, 8, 2, "dot", SPEC)
    before = {k: v.clone() for k, v in dense.state_dict().items()}
    owners = [f.owner() for f in ffns]
    align(dense, ffns, (_ids(200 + i) for i in range(10)), SPEC)
    # exact: a tensor training did not touch keeps its bytes (compared against its clone)
    changed = {k for k, v in dense.state_dict().items() if not torch.equal(v, before[k])}
    assert changed == {f"model.layers.{i}.mlp.{n}" for i in range(2) for n in ("affinity", "router")}
    assert [f.owner() for f in ffns] != owners  # the learned assignment moved
    assert sum(p.numel() for f in ffns for p in f.trainable()) == 2 * (64 * 8 + 8 * 32)


def test_spec_defaults_are_the_papers_and_tau_anneals_over_the_warm_up():
    s = DotMoeSpec()
    assert (s.steps, s.batch_size, s.seq_len, s.lr, s.weight_decay, s.sinkhorn_iters) == (
        3500,
        64,
        2048,
        5e-4,
        1e-4,
        50,
    )
    assert (s.w_kl, s.w_ce, s.w_z, s.w_lb, s.tau_start, s.tau_end, s.warmup) == (
        2.0,
        1.0,
        1e-3,
        1e-2,
        1.0,
        0.1,
        700,
    )
    assert (
        s.tau_at(0) == 1.0 and s.tau_at(350) == pytest.approx(0.55) and s.tau_at(700) == s.tau_at(3499) == 0.1
    )
    with pytest.raises(ValueError, match="combine"):
        DotMoeSpec(combine="softmax")


# ---- the stage -----------------------------------------------------------------------------------------
def test_stage_methods_are_the_workers():
    from orchestrator.stages import dot_moe
    from workers.baselines.dot_moe_spec import METHODS

    assert dot_moe.METHODS == METHODS


@pytest.mark.parametrize(
    "section, expect",
    [
        ({"experts": [4], "top_k": [8]}, "top_k 8 exceeds experts 4"),
        ({"methods": ["kmeans"]}, "unknown method 'kmeans'; allowed: dot, random, cluster"),
        ({"dense_models": ["teacher"]}, "unknown dense model 'teacher'"),
        ({"settings": {"stpes": 3}}, "stpes: unknown key"),
    ],
)
def test_section_errors_are_one_line(tmp_path, section, expect):
    import yaml

    from orchestrator.spec import SpecError, load_spec

    raw = yaml.safe_load((ROOT / "tests" / "sweeps" / "dot.yaml").read_text())
    raw["dot_moe"] = section
    f = tmp_path / "dot.yaml"
    f.write_text(yaml.safe_dump(raw, sort_keys=False))
    with pytest.raises(SpecError) as e:
        load_spec(str(f))
    assert expect in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_dry_run_counts_dot_moe_jobs():
    from orchestrator import dryrun
    from orchestrator.spec import load_spec

    spec, _, _ = load_spec(str(ROOT / "tests" / "sweeps" / "dot.yaml"))
    rows = {r["stage"]: r for r in dryrun.plan_counts(spec)[0]}
    assert rows["dot_moe"]["named"] == 3 + 3 * rows["distill"]["named"]
    spec, _, _ = load_spec(str(ROOT / "sweeps" / "seed004-dot-moe-qwen3-8b.yaml"))
    rows = {r["stage"]: r for r in dryrun.plan_counts(spec)[0]}
    assert rows["dot_moe"]["named"] >= 2


@pytest.mark.slow
def test_the_stage_runs_in_a_tiny_sweep_and_evaluates_several_top_k(tmp_path, monkeypatch):
    from sweep_runs import launch_serial

    from db.store import Store
    from orchestrator.spec import load_spec

    monkeypatch.setenv("MOESWEEP_HOME", str(tmp_path / "home"))
    spec, path, text = load_spec(str(ROOT / "tests" / "sweeps" / "dot.yaml"))
    store = Store(f"sqlite:///{tmp_path}/r.db")
    assert launch_serial(spec, text, store, path) == 0
    cfgs = store.query(
        "SELECT id, config_key, K, top_k, settings FROM configurations WHERE kind = 'dense2moe'"
    )[1]
    assert {c[1] for c in cfgs} == {
        f"dense2moe|{m}|{s}|E=4|k=2"
        for m in ("dot", "random", "cluster")
        for s in ("dense_teacher", "distilled:SF|RR|uniform|K=2")
    }
    assert all(c[2] == 4 and c[3] == 2 for c in cfgs)
    meta = {c[1]: json.loads(c[4]) for c in cfgs}
    assert meta["dense2moe|dot|distilled:SF|RR|uniform|K=2|E=4|k=2"]["source_config"] == "SF|RR|uniform|K=2"
    assert meta["dense2moe|cluster|dense_teacher|E=4|k=2"]["source"] == "dense_teacher"
    rows = store.query(
        "SELECT cj.config_id, m.who, m.step, m.value FROM config_jobs cj JOIN metrics m "
        "ON m.job_id = cj.job_id WHERE cj.stage = 'dot_moe' AND m.name = 'ppl'"
    )[1]
    by: dict[int, dict] = {}
    for cid, who, step, v in rows:
        by.setdefault(cid, {})[(who, step)] = v
    assert len(by) == 6
    for got in by.values():
        assert set(got) == {("dense", -1), ("student", 1), ("student", 2), ("student", 4)}
        assert got[("student", 4)] == pytest.approx(got[("dense", -1)], rel=1e-5)  # k = E: the dense model
        assert got[("student", 1)] != pytest.approx(got[("dense", -1)], rel=1e-7)
    paths = [
        p
        for (p,) in store.query(
            "SELECT a.path FROM artifacts a JOIN jobs j ON j.id = a.job_id "
            "WHERE j.stage = 'dot_moe' AND a.kind = 'moe'"
        )[1]
    ]
    assert len(paths) == 6
    from workers.run.runtime import load_model

    moe, _ = load_model(paths[0])
    assert isinstance(moe, DotQwen3MoeForCausalLM) and moe.config.num_experts == 4
    assert moe.config.moe_combine == "unit" and moe.config.num_experts_per_tok == 2


def test_micro_batches_accumulate_the_whole_batch_gradient():
    """Loss terms that are token means (KL, CE, z) give the same gradient in micro-batches of equal size
    (the balance loss is a product of batch means, so it is left out here)."""
    from dataclasses import replace

    from workers.baselines.dot_moe import _accumulate

    grads = []
    for micro in (None, 2):
        spec = replace(SPEC, w_lb=0.0, micro_batch=micro)
        dense = _dense()
        ffns = install(dense, 8, 2, "dot", spec)
        terms = _accumulate(dense, ffns, _ids(3, 4), spec)
        grads.append((terms["loss"], [p.grad.clone() for f in ffns for p in f.trainable()]))
    torch.testing.assert_close(grads[0][0], grads[1][0])
    for a, b in zip(grads[0][1], grads[1][1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)
    with pytest.raises(ValueError, match="micro_batch"):
        DotMoeSpec(batch_size=4, micro_batch=8)


def test_report_has_a_dense_to_moe_table_beside_the_papers(tmp_path):
    """A sweep's dense → MoE models get their own table (perplexity per evaluated top-k, the dense model's
    beside it), and with the papers imported the DOT-MoE paper's rows come as a context table."""
    from analysis.load import load_frames
    from analysis.reference import reference_sweeps
    from analysis.report import write_report
    from db.store import Store

    store = Store(f"sqlite:///{tmp_path}/d.db")
    store.import_reference(reference_sweeps())
    sid = store.upsert_sweep("own-dot", spec_yaml="name: own-dot")
    key = "dense2moe|dot|dense_teacher|E=4|k=2"
    settings = {"method": "dot", "source": "dense_teacher", "experts": 4, "top_k": 2}
    ids = store.upsert_configs(
        sid,
        [
            {
                "config_key": key,
                "model": "tiny",
                "kind": "dense2moe",
                "K": 4,
                "top_k": 2,
                "settings": json.dumps(settings),
            }
        ],
    )
    store.register_jobs(sid, [{"key": "dot-job", "stage": "dot_moe", "params": {"k": 1}}])
    assert store.claim("dot-job", "t")
    ppl = [{"name": "ppl", "stage": "dot_moe", "who": "dense", "value": 100.0}] + [
        {"name": "ppl", "stage": "dot_moe", "who": "student", "step": k, "value": v}
        for k, v in ((1, 180.0), (2, 130.0), (4, 100.0))
    ]
    store.finish("dot-job", "t", {"metrics": ppl}, 0.1)
    store.link([(ids[key], "dot_moe", store.jobs(["dot-job"])["dot-job"]["id"])])
    frames = load_frames(store.engine, ["own-dot"])
    write_report(
        frames, "own-dot", tmp_path / "r", load_frames(store.engine, [s["name"] for s in reference_sweeps()])
    )
    tex = (tmp_path / "r" / "tables" / "dense2moe.tex").read_text()
    assert r"dot & dense\_teacher & 4 & 2 & 100.0 & 180.0 & 130.0 & 100.0 \\" in tex
    paper = (tmp_path / "r" / "tables" / "dense2moe_paper-dot-moe.tex").read_text()
    assert "DOT-MoE (active=3.49B)" in paper and "61.50" in paper
