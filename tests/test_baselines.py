"""Baselines (§4.2, Appendix M): random FFN, random init, and Minitron-style dense-to-dense pruning."""

import json

import pytest
import torch

from workers.baselines.baselines import (
    d2d_candidate_names,
    d2d_candidates,
    prune_dense,
    random_ffn_student,
    random_init_student,
)
from workers.families import get_adapter

V = 128
COMMON = dict(
    vocab_size=V,
    hidden_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    tie_word_embeddings=False,
    max_position_embeddings=64,
)


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.fixture(scope="module")
def moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(
        **COMMON,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        intermediate_size=16,
        norm_topk_prob=True,
    )
    return Qwen3MoeForCausalLM(cfg).eval()


def dense_model(ffn: int = 48, seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    return Qwen3ForCausalLM(Qwen3Config(**COMMON, intermediate_size=ffn)).eval()


def calib(n: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, V, (4, 16), generator=g) for _ in range(n)]


# ---- random students ----------------------------------------------------------------------------------
def test_random_ffn_keeps_teacher_attention_and_draws_the_ffn(moe):
    adapter = get_adapter(moe)
    student = random_ffn_student(moe, adapter, seed=0)
    assert student.config.intermediate_size == 2 * 16  # k · I
    teacher = dict(moe.named_parameters())
    ffn = {n: p for n, p in student.named_parameters() if ".mlp." in n}
    assert ffn and len(ffn) == 3 * COMMON["num_hidden_layers"]
    for name, p in student.named_parameters():
        if ".mlp." not in name:
            assert torch.equal(p, teacher[name]), name  # exact: copied bytes (attention, embeddings, norms)
            assert p.data_ptr() != teacher[name].data_ptr()  # copied, not shared
    std = torch.cat([p.flatten() for p in ffn.values()]).std().item()
    assert std == pytest.approx(moe.config.initializer_range, rel=0.1)  # the model's own init scale
    again = random_ffn_student(moe, adapter, seed=0)
    other = random_ffn_student(moe, adapter, seed=1)
    for name, p in ffn.items():  # exact: the same seed draws the same numbers, scaled by the same op
        assert torch.equal(p, dict(again.named_parameters())[name])
        assert not torch.equal(p, dict(other.named_parameters())[name])
    out = student(input_ids=calib(1)[0]).logits
    assert out.shape == (4, 16, V) and torch.isfinite(out).all()


def test_random_ffn_of_llama4_text_draws_its_feed_forward():
    """Llama-4's dense student keeps its FFN at `feed_forward` (adapter.student_ffn_attr), not `mlp`."""
    from families_cases import make_teacher

    teacher = make_teacher("llama4_text")
    adapter = get_adapter(teacher)
    student = random_ffn_student(teacher, adapter, seed=0)
    assert adapter.student_ffn_attr == "feed_forward" and student.config.moe_layers == []
    ffn = {n: p for n, p in student.named_parameters() if ".feed_forward." in n}
    assert len(ffn) == 3 * teacher.config.num_hidden_layers
    width = student.config.intermediate_size_mlp
    assert width == 2 * 16 + 16  # k·I plus the shared expert (the dense layer's 40 padded)
    assert all(width in p.shape for p in ffn.values())
    std = torch.cat([p.flatten() for p in ffn.values()]).std().item()
    assert std == pytest.approx(teacher.config.initializer_range, rel=0.15)
    source = dict(teacher.named_parameters())
    for name, p in student.named_parameters():
        if name not in ffn:
            assert torch.equal(p, source[name]), name  # exact: copied bytes


def test_random_init_has_the_student_architecture_and_nothing_from_the_teacher(moe):
    adapter = get_adapter(moe)
    ref = random_ffn_student(moe, adapter, seed=0)
    state = torch.random.get_rng_state()
    student = random_init_student(moe, adapter, seed=3)
    assert torch.equal(
        state, torch.random.get_rng_state()
    )  # exact: RNG state bytes; the global RNG is left alone
    assert type(student) is type(ref)
    assert [(n, p.shape) for n, p in student.named_parameters()] == [
        (n, p.shape) for n, p in ref.named_parameters()
    ]
    teacher = dict(moe.named_parameters())
    for name, p in student.named_parameters():
        if p.dim() >= 2 and name in teacher:  # every matrix (attention, embeddings, head) is new
            assert not torch.allclose(p, teacher[name]), name
    again = random_init_student(moe, adapter, seed=3)
    # exact: the same seed, the same init ops in the same order
    assert all(torch.equal(p, q) for p, q in zip(student.parameters(), again.parameters(), strict=True))


# ---- dense-to-dense ----------------------------------------------------------------------------------------
def test_dbrx_is_refused_in_one_line():
    """DBRX keeps its decoder layers at transformer.blocks; the random students refuse it before building one."""
    from families_cases import make_teacher

    teacher = make_teacher("dbrx")
    msg = (
        "model_type='dbrx': decoder layers at base_model.blocks, not base_model.layers; the baselines need "
        "base_model.layers"
    )
    for build in (random_ffn_student, random_init_student):
        with pytest.raises(ValueError) as e:
            build(teacher, get_adapter(teacher), seed=0)
        assert str(e.value) == msg


def test_d2d_candidates_match_the_moe_student_size(moe, tmp_path):
    adapter = get_adapter(moe)
    target = n_params(random_ffn_student(moe, adapter, seed=0))  # the MoE→dense student at K = k
    dense = dense_model(ffn=8 * 16)
    cands = d2d_candidates(dense, target_params=target)
    assert [c["name"] for c in cands] == d2d_candidate_names()
    assert len(set(d2d_candidate_names())) == 5
    by = {c["name"]: c for c in cands}
    assert by["width"]["params"] == target and by["width"]["ffn"] == 2 * 16  # FFN-only pruning is exact here
    assert by["width+depth12"]["layers"] == 3 and by["width+depth25"]["layers"] == 2
    assert by["width+hidden"]["hidden"] < 32 and by["width+hidden+heads"]["kv_heads"] == 1
    for c in cands:
        pruned = prune_dense(dense, c, calib())
        assert n_params(pruned) == c["params"], c["name"]  # the promised count is the real one
        per_unit = 3 * c["hidden"] * c["layers"]  # one FFN unit: as close as the shape allows
        assert abs(c["params"] - target) <= per_unit, c
        assert c["target_params"] == target
    # the tiny dense twin carries its MoE sibling's spec: the target then comes from its directory
    dense.save_pretrained(tmp_path / "dense")
    (tmp_path / "dense" / "tiny_meta.json").write_text(
        json.dumps({"spec": {"top_k": 2, "moe_intermediate": 16}})
    )
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "dense")
    assert d2d_candidates(reloaded) == cands
    with pytest.raises(ValueError, match="target_params is required"):
        d2d_candidates(dense_model())


def rigged_dense():
    """A dense model where we know what matters: per layer l, FFN neurons dead[l] are dead (gate row 0),
    KV group (l % 2) has zero values, and layer 2 is an identity (o_proj = down_proj = 0)."""
    model = dense_model(ffn=48, seed=1)
    dead = {li: sorted((3 * li + 7 * i) % 48 for i in range(6)) for li in range(4)}
    with torch.no_grad():
        for li, layer in enumerate(model.model.layers):
            layer.mlp.gate_proj.weight[dead[li]] = 0.0
            g = li % 2
            layer.self_attn.v_proj.weight[g * 8 : (g + 1) * 8] = 0.0
        model.model.layers[2].self_attn.o_proj.weight.zero_()
        model.model.layers[2].mlp.down_proj.weight.zero_()
    return model, dead


def test_prune_dense_keeps_the_important_units_and_preserves_the_function():
    model, dead = rigged_dense()
    n_dead = max(len(v) for v in dead.values())
    cand = {"name": "rigged", "layers": 3, "hidden": 32, "ffn": 48 - n_dead, "heads": 2, "kv_heads": 1}
    assert all(len(v) == n_dead for v in dead.values())
    pruned = prune_dense(model, cand, calib())
    assert pruned.config.num_hidden_layers == 3 and pruned.config.intermediate_size == 48 - n_dead
    ids = calib(1)[0]
    with torch.no_grad():
        # only dead neurons, zero-value heads and the identity layer were removed: same function
        assert torch.allclose(pruned(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-5)
    kept_layers = [0, 1, 3]  # layer 2 (block importance 0) is dropped
    for new, old in enumerate(kept_layers):
        live = [j for j in range(48) if j not in dead[old]]
        src, dst = model.model.layers[old], pruned.model.layers[new]
        # exact: the pruned weights are slices (copied bytes) of the dense model's
        assert torch.equal(dst.mlp.gate_proj.weight, src.mlp.gate_proj.weight[live])
        assert torch.equal(dst.mlp.down_proj.weight, src.mlp.down_proj.weight[:, live])
        g = (
            1 - old % 2
        )  # the live KV group and its two query heads; exact: slices of their rows (copied bytes)
        assert torch.equal(dst.self_attn.k_proj.weight, src.self_attn.k_proj.weight[g * 8 : (g + 1) * 8])
        assert torch.equal(dst.self_attn.q_proj.weight, src.self_attn.q_proj.weight[g * 16 : (g + 1) * 16])
        assert torch.equal(dst.self_attn.o_proj.weight, src.self_attn.o_proj.weight[:, g * 16 : (g + 1) * 16])
    assert model.config.num_hidden_layers == 4  # the dense teacher is untouched


def test_prune_dense_drops_the_least_active_embedding_channels(tmp_path):
    model = dense_model(seed=2)
    quiet = [3, 17, 30]
    with torch.no_grad():
        for layer in model.model.layers:  # these channels never leave any norm: importance 0
            layer.input_layernorm.weight[quiet] = 0.0
            layer.post_attention_layernorm.weight[quiet] = 0.0
        model.model.norm.weight[quiet] = 0.0
    cand = {"name": "hidden", "layers": 4, "hidden": 29, "ffn": 48, "heads": 4, "kv_heads": 2}
    pruned = prune_dense(model, cand, calib())
    live = [c for c in range(32) if c not in quiet]
    # exact: the pruned weights are slices (copied bytes) of the dense model's
    assert torch.equal(pruned.model.embed_tokens.weight, model.model.embed_tokens.weight[:, live])
    assert torch.equal(pruned.lm_head.weight, model.lm_head.weight[:, live])
    assert torch.equal(
        pruned.model.layers[1].self_attn.q_proj.weight, model.model.layers[1].self_attn.q_proj.weight[:, live]
    )
    assert torch.equal(
        pruned.model.layers[1].self_attn.q_norm.weight,  # exact: q_norm is copied whole
        model.model.layers[1].self_attn.q_norm.weight,
    )
    # the pruned model is a plain checkpoint of the same class: it runs and reloads
    pruned.save_pretrained(tmp_path / "pruned")
    from transformers import AutoModelForCausalLM

    back = AutoModelForCausalLM.from_pretrained(tmp_path / "pruned").eval()
    assert type(back) is type(model) and back.config.hidden_size == 29
    saved, reloaded = pruned.state_dict(), back.state_dict()
    assert sorted(saved) == sorted(reloaded)
    for name, t in saved.items():
        assert torch.equal(reloaded[name], t), name  # exact: copied bytes through safetensors
    ids = calib(1)[0]
    with torch.no_grad():
        # float32 forward of a reloaded model: the kernels may take other paths (memory layout), so not bitwise
        torch.testing.assert_close(
            back(input_ids=ids).logits, pruned(input_ids=ids).logits, rtol=1e-5, atol=1e-5
        )


def test_prune_dense_rejects_bad_input(moe):
    dense = dense_model()
    with pytest.raises(ValueError, match="heads=3"):
        prune_dense(
            dense, {"name": "x", "layers": 4, "hidden": 32, "ffn": 8, "heads": 3, "kv_heads": 1}, calib()
        )
    with pytest.raises(ValueError, match="ffn=99"):
        prune_dense(
            dense, {"name": "x", "layers": 4, "hidden": 32, "ffn": 99, "heads": 4, "kv_heads": 2}, calib()
        )
    with pytest.raises(ValueError, match="model_type 'qwen3_moe'"):
        d2d_candidates(moe, target_params=1000)
    with pytest.raises(ValueError, match="batches are empty"):
        prune_dense(dense, {"name": "x", "layers": 4, "hidden": 32, "ffn": 8, "heads": 4, "kv_heads": 2}, [])
