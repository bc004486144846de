"""Cohere2-MoE specifics the shared family fixture does not reach: the "average" shared-expert strategy (its
config default), the one-expert student where RoPE differs across full-attention layers, the refused sigmoid
router and the logit_scale folded into the KD head."""

from __future__ import annotations

import copy

import pytest
import torch
from families_cases import hand_plans, ids, make_teacher, tiny_config

from workers.families import get_adapter, teacher_shape
from workers.models.convert import build_student_from_plans
from workers.training.distill import lm_head


def reference_logits(teacher, plans) -> torch.Tensor:
    """The teacher with each MoE block replaced by its Appendix A combination, written out here:
    ½ (Σ_g α_g f_g(h) + shared(h)) under "average", with f_g the merged experts."""
    ref = copy.deepcopy(teacher)
    for pl in plans:
        block = ref.model.layers[pl.layer].mlp
        gu, down = block.experts.gate_up_proj.detach(), block.experts.down_proj.detach()
        i = gu.shape[1] // 2

        def forward(x, block=block, pl=pl, gu=gu, down=down, i=i):
            h = x.reshape(-1, x.shape[-1])
            y = torch.zeros_like(h)
            for a, g, ws in zip(pl.alpha, pl.groups, pl.merge_weights, strict=True):
                w_gu = sum(w * gu[e] for e, w in zip(g, ws, strict=True))
                w_d = sum(w * down[e] for e, w in zip(g, ws, strict=True))
                y = y + a * (torch.nn.functional.silu(h @ w_gu[:i].T) * (h @ w_gu[i:].T)) @ w_d.T
            return ((y + block.shared_experts(h)) / 2).reshape(x.shape)

        block.forward = forward
    return ref


@pytest.mark.parametrize("layers", ["dense_roped", "mixed_rope"])
def test_average_strategy_and_student_kinds(layers):
    """'average' halves the whole layer FFN in the student; a dense prefix with forced RoPE next to a
    full-attention MoE layer without it gives the one-expert student, else the all-dense one."""
    over = dict(shared_expert_combination_strategy="average")
    if layers == "mixed_rope":  # layer 2 full attention (NoPE) next to the forced-RoPE dense layer 0
        over["sliding_window_pattern"] = 2
    teacher = make_teacher("cohere2_moe", dtype=torch.float64, experts_implementation="eager", **over)
    a = get_adapter(teacher)
    assert a.routed_scaling(teacher) == 1.0 and a.averaged(teacher)
    plans = hand_plans(a, teacher, merged=True)
    student = build_student_from_plans(teacher, a, plans, share_weights=False)
    kinds = student.config.mlp_layer_types
    if layers == "mixed_rope":
        assert kinds == ["dense", "sparse", "sparse"] and student.config.num_experts == 1
    else:
        assert kinds == ["dense"] * 3 and student.config.prefix_dense_sliding_window_pattern == 1
    x = ids(seed=5)
    with torch.no_grad():
        torch.testing.assert_close(
            student(x).logits, reference_logits(teacher, plans)(x).logits, rtol=1e-9, atol=1e-9
        )


def test_softmax_over_the_top_k_logits_is_p_renormalized():
    """The router's weights, softmax over the k chosen logits, are p = softmax over all E restricted to the
    k and renormalized (the common factor Σ_E exp z cancels)."""
    teacher = make_teacher("cohere2_moe")
    a = get_adapter(teacher)
    router = a.router_module(teacher, 1)
    h = torch.randn(11, 32)
    out = router(h)
    p, w, idx = a.router_decision(out)
    torch.testing.assert_close(w.float(), torch.softmax(out[0].float().gather(1, idx), -1))
    ps = p.gather(1, idx)
    torch.testing.assert_close(w.float(), ps / ps.sum(-1, keepdim=True), rtol=1e-6, atol=1e-7)


def test_sigmoid_router_is_refused_in_one_line():
    cfg = tiny_config("cohere2_moe", expert_selection_fn="sigmoid")
    with pytest.raises(ValueError, match="expert_selection_fn='sigmoid'") as err:
        teacher_shape(cfg)
    assert "\n" not in str(err.value)
    teacher = make_teacher("cohere2_moe", expert_selection_fn="sigmoid")
    with pytest.raises(ValueError, match="only 'softmax'"):
        get_adapter(teacher).moe_layers(teacher)


def test_logit_scale_is_folded_into_the_kd_head():
    teacher = make_teacher("cohere2_moe")
    head = lm_head(teacher)
    x = ids(seed=2)
    with torch.no_grad():
        h = teacher.base_model(input_ids=x).last_hidden_state
        torch.testing.assert_close(h @ head.weight.T, teacher(x).logits, rtol=1e-5, atol=1e-5)
    assert teacher.config.logit_scale != 1.0
