"""Granite MoE specifics the shared family fixture does not reach: the dense student carries the multipliers
(and GraniteSWA's window, sinks and per-layer RoPE theta) exactly, the router's softmax over the top-k logits
is p renormalized over the k, logits_scaling is folded into the KD head, and a shared MLP of width 0 is none."""

from __future__ import annotations

import pytest
import torch
from families_cases import hand_plans, ids, make_teacher, tiny_config

from workers.families import get_adapter, teacher_shape
from workers.models.convert import build_student_from_plans
from workers.training.distill import lm_head

CARRIED = (
    "embedding_multiplier",
    "residual_multiplier",
    "attention_multiplier",
    "logits_scaling",
    "rope_parameters",
    "tie_word_embeddings",
    "rms_norm_eps",
    "num_key_value_heads",
)


@pytest.mark.parametrize("family", ["granitemoe", "granitemoeshared", "granitemoe_swa"])
def test_student_carries_the_multipliers_and_the_attention_layout(family):
    teacher = make_teacher(family)
    student = build_student_from_plans(
        teacher, get_adapter(teacher), hand_plans(get_adapter(teacher), teacher, True), share_weights=True
    )
    tc, sc = teacher.config, student.config
    for name in CARRIED + (
        ("layer_types", "layer_rope_theta", "sliding_window") if family == "granitemoe_swa" else ()
    ):
        assert getattr(sc, name) == getattr(tc, name), name
    assert all(getattr(tc, m) != 1.0 for m in CARRIED[:4])  # the tiny teacher moves every multiplier
    assert not sc.mlp_bias and not any(hasattr(layer, "shared_mlp") for layer in student.model.layers)
    if family == "granitemoe_swa":  # the sinks are the teacher's
        # exact: the student's attention (sinks included) is the teacher's tensor
        assert torch.equal(student.model.layers[1].self_attn.sinks, teacher.model.layers[1].self_attn.sinks)


def test_softmax_over_the_top_k_logits_is_p_renormalized():
    """The router's weights, softmax over the k chosen logits, are p = softmax over all E restricted to the
    k and renormalized (the common factor Σ_E exp z cancels)."""
    teacher = make_teacher("granitemoe")
    a = get_adapter(teacher)
    out = a.router_module(teacher, 1)(torch.randn(11, 32))
    p, w, idx = a.router_decision(out)
    torch.testing.assert_close(w.float(), torch.softmax(out[0].float().gather(1, idx), -1))
    ps = p.gather(1, idx)
    torch.testing.assert_close(w.float(), ps / ps.sum(-1, keepdim=True), rtol=1e-6, atol=1e-7)


def test_logits_scaling_is_folded_into_the_kd_head():
    teacher = make_teacher("granitemoeshared")
    student = build_student_from_plans(
        teacher, get_adapter(teacher), hand_plans(get_adapter(teacher), teacher, False), share_weights=True
    )
    x = ids(seed=2)
    with torch.no_grad():
        for model in (teacher, student):
            h = model.base_model(input_ids=x).last_hidden_state
            torch.testing.assert_close(h @ lm_head(model).weight.T, model(x).logits, rtol=1e-5, atol=1e-5)


def test_a_shared_mlp_of_width_zero_is_none():
    cfg = tiny_config("granitemoeshared", shared_intermediate_size=0)
    assert (
        teacher_shape(cfg).shared_experts == 0
        and teacher_shape(tiny_config("granitemoeshared")).shared_experts == 1
    )
    teacher = make_teacher("granitemoeshared", shared_intermediate_size=0)
    a = get_adapter(teacher)
    assert a.num_shared_experts(teacher) == 0 and a.shared_ffn(teacher, 0) is None
    student = build_student_from_plans(teacher, a, hand_plans(a, teacher, False), share_weights=True)
    assert student.config.intermediate_size == 2 * 16  # k·I, no shared width


def test_a_checkpoint_in_the_released_layout_loads_fused(tmp_path):
    """Released Granite MoE checkpoints hold `block_sparse_moe.input_linear` [E, 2I, H] (gate rows first),
    `output_linear` [E, H, I] and `router.layer`: transformers renames them at load time to the fused
    experts and the router this adapter reads, so the model computes the same logits."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    teacher = make_teacher("granitemoeshared")
    teacher.save_pretrained(tmp_path)
    (f,) = tmp_path.glob("*.safetensors")
    legacy = {
        k.replace("experts.gate_up_proj", "input_linear.weight")
        .replace("experts.down_proj", "output_linear.weight")
        .replace("router.weight", "router.layer.weight"): v
        for k, v in load_file(f).items()
    }
    assert any("input_linear" in k for k in legacy) and not any("gate_up_proj" in k for k in legacy)
    save_file(legacy, f, metadata={"format": "pt"})
    back = AutoModelForCausalLM.from_pretrained(tmp_path)
    loaded, saved = back.state_dict(), teacher.state_dict()
    assert sorted(loaded) == sorted(saved)
    for name, t in saved.items():
        assert torch.equal(loaded[name], t), name  # exact: the renamed tensors' bytes, loaded unchanged
    a = get_adapter(back)
    assert torch.equal(
        a.expert_weights(back, 1).gate, a.expert_weights(teacher, 1).gate
    )  # exact: copied bytes
    x = ids(seed=3)
    with torch.no_grad():
        # float32 forwards of the in-memory and the reloaded model: equal tensors, but the kernels may take other
        # paths (memory layout), so float32 rounding, not bitwise
        torch.testing.assert_close(back(x).logits, teacher(x).logits, rtol=1e-5, atol=1e-5)
