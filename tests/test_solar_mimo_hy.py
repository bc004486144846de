"""What the solar_open, mimo_v2_flash and hy_v3 adapters refuse in one line, and the Solar Open student's
Llama attention (o_proj without bias in the teacher, a zero bias in the student)."""

from __future__ import annotations

import pytest
import torch
from families_cases import hand_plans, ids, make_teacher, tiny_config

from workers.families import get_adapter, teacher_shape
from workers.models.convert import build_student_from_plans


def test_solar_open_refuses_partial_rope():
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    teacher = make_teacher("solar_open", rope_parameters=rope)
    with pytest.raises(
        ValueError, match=r"^solar_open config: rope_parameters.partial_rotary_factor=0.5; only 1.0"
    ):
        get_adapter(teacher).student_config(teacher, 32)


def test_solar_open_student_is_llama_with_a_zero_o_proj_bias():
    teacher = make_teacher("solar_open")
    a = get_adapter(teacher)
    student = build_student_from_plans(teacher, a, hand_plans(a, teacher, False), share_weights=False)
    assert type(student).__name__ == "LlamaForCausalLM"
    for layer in student.model.layers:
        # exact: the bias the teacher lacks is filled with zeros
        assert torch.equal(layer.self_attn.o_proj.bias, torch.zeros_like(layer.self_attn.o_proj.bias))
    t_attn = teacher.model.layers[0].self_attn
    assert t_attn.o_proj.bias is None and t_attn.q_proj.bias is not None
    # exact: the teacher's q_proj bias, copied
    torch.testing.assert_close(
        student.model.layers[0].self_attn.q_proj.bias, t_attn.q_proj.bias, rtol=0, atol=0
    )
    with torch.no_grad():
        assert torch.isfinite(student(ids()).logits).all()


@pytest.mark.parametrize("family", ["mimo_v2_flash", "hy_v3"])
def test_mlp_layer_types_other_than_sparse_dense_refused(family):
    cfg = tiny_config(family)
    cfg.mlp_layer_types = ["dense", "sparse", "moe"]
    with pytest.raises(ValueError, match=r"mlp_layer_types=\['dense', 'sparse', 'moe'\], expected 3 entries"):
        teacher_shape(cfg)


def test_hy_v3_scale_is_the_routers_router_scaling_factor():
    teacher = make_teacher("hy_v3", router_scaling_factor=2.25)
    a = get_adapter(teacher)
    assert a.routed_scaling(teacher) == 2.25 and not hasattr(teacher.config, "routed_scaling_factor")
    assert a.num_shared_experts(teacher) == 1 and a.moe_layers(teacher) == [1, 2]


def test_mimo_v2_flash_has_no_shared_experts():
    teacher = make_teacher("mimo_v2_flash")
    a = get_adapter(teacher)
    assert a.num_shared_experts(teacher) == 0 and teacher_shape(teacher.config).shared_experts == 0
    assert all(a.shared_ffn(teacher, layer) is None for layer in range(3))
    assert not hasattr(teacher.model.layers[1].mlp, "shared_experts")
