"""workers/models/convert.py: layer contexts from statistics, students from plans (paper Algorithm 1)."""

from __future__ import annotations

import pytest
import torch
from families_cases import (
    CASES,
    DENSE_FAMILIES,
    FAMILIES,
    H,
    block_of,
    experts_forward,
    hand_plans,
    ids,
    layers_of,
    make_teacher,
    routed_scale,
    router_of,
    student_ffn_name,
)

from workers.core.types import LayerPlan, LayerStats
from workers.families import get_adapter
from workers.methods.merge import ffn_forward
from workers.models.convert import build_student_from_plans, layer_contexts, plan_ffns


def fake_stats(e: int, seed: int) -> LayerStats:
    g = torch.Generator().manual_seed(seed)
    f = torch.randn(50, e, 4, generator=g, dtype=torch.float64)
    return LayerStats(
        n_tokens=50,
        count=torch.rand(e, generator=g, dtype=torch.float64) * 50,
        sum_p=torch.rand(e, generator=g, dtype=torch.float64),
        sum_p_sel=torch.rand(e, dtype=torch.float64),
        sum_sq=torch.rand(e, dtype=torch.float64),
        sum_gnorm_sel=torch.rand(e, dtype=torch.float64),
        sum_norm_sel=torch.rand(e, dtype=torch.float64),
        gram=torch.einsum("tid,tjd->ij", f, f),
    )


@pytest.fixture(scope="module", params=FAMILIES)
def fam(request):
    teacher = make_teacher(request.param)
    return request.param, teacher, get_adapter(teacher)


@pytest.fixture(scope="module", params=DENSE_FAMILIES)
def dense_fam(request):
    """The families that write a dense student (Case.dense_student; test_families asserts the others refuse)."""
    teacher = make_teacher(request.param)
    return request.param, teacher, get_adapter(teacher)


def test_layer_contexts(fam):
    family, teacher, a = fam
    moe = a.moe_layers(teacher)
    e = a.num_experts(teacher)
    stats = {layer: fake_stats(e, layer) for layer in moe[1:]}  # a subset: only those layers get contexts
    ctx = layer_contexts(teacher, a, stats)
    assert sorted(ctx) == moe[1:]
    c = ctx[moe[1]]
    assert (
        c.stats is stats[moe[1]] and c.top_k == a.top_k(teacher) and c.renormalized == a.renormalized(teacher)
    )
    block = block_of(family, teacher, moe[1])
    assert torch.equal(
        c.router_weight, router_of(family, block).weight
    )  # exact: the router's own tensor, detached
    store = {p.untyped_storage().data_ptr() for p in block.experts.parameters()}
    assert c.experts.gate.untyped_storage().data_ptr() in store  # views, not copies
    h = torch.randn(5, H)
    torch.testing.assert_close(
        ffn_forward(c.experts, h, expert=3),
        experts_forward(family, block.experts, h, torch.full((5, 1), 3), torch.ones(5, 1)),
        rtol=1e-5,
        atol=1e-5,
    )
    dense = [i for i in range(len(layers_of(family, teacher))) if i not in moe]
    if dense:
        with pytest.raises(ValueError, match="not MoE layers"):
            layer_contexts(teacher, a, {dense[0]: fake_stats(e, 0)})
    with pytest.raises(ValueError, match="experts"):
        layer_contexts(teacher, a, {moe[0]: fake_stats(e + 1, 0)})


def test_plans_validated_and_progress_reported(fam):
    family, teacher, a = fam
    moe = a.moe_layers(teacher)
    plans = hand_plans(a, teacher, merged=True)
    calls = []
    ffns = plan_ffns(teacher, a, plans, progress=lambda i, n: calls.append((i, n)))
    assert calls == [(i, len(moe)) for i in range(1, len(moe) + 1)] and sorted(ffns) == moe
    with pytest.raises(ValueError, match="appears twice"):
        plan_ffns(teacher, a, [plans[0], plans[0]])
    # a dense layer where the family has one (Qwen3-MoE, DeepSeek), else one past the last layer
    not_moe = next(i for i in range(len(layers_of(family, teacher)) + 1) if i not in moe)
    e = a.num_experts(teacher)
    bad = LayerPlan(
        layer=not_moe,
        selected=[0, 1],
        scores=[1.0] * e,
        groups=[[0], [1]],
        merge_weights=[[1.0], [1.0]],
        alpha=[0.5, 0.5],
    )
    with pytest.raises(ValueError, match="not an MoE layer"):
        plan_ffns(teacher, a, [bad, *plans])


def test_routed_scaling_folded_into_alpha(fam):
    """DeepSeek: the router multiplies routed_scaling_factor into its weights, so the student's
    routed part is scale·Σ_g α_g f_g(h) (shared experts stay at scale 1.0); other families: scale 1."""
    family, teacher, a = fam
    scale = routed_scale(family, teacher)
    assert (scale != 1.0) == CASES[family].scaled  # the fixture really exercises the factor
    plans = hand_plans(a, teacher, merged=False)
    ffns = plan_ffns(teacher, a, plans)
    for pl in plans:
        ew = a.expert_weights(teacher, pl.layer)
        h = torch.randn(6, H)
        if CASES[family].input_scaled:  # Llama-4: the weight scales the expert's input
            expect = sum(
                ffn_forward(ew, al * scale * h, expert=g[0])
                for al, g in zip(pl.alpha, pl.groups, strict=True)
            )
        else:
            expect = sum(
                al * scale * ffn_forward(ew, h, expert=g[0])
                for al, g in zip(pl.alpha, pl.groups, strict=True)
            )
        torch.testing.assert_close(ffn_forward(ffns[pl.layer], h), expect, rtol=1e-5, atol=1e-6)


def test_many_shared_students_leave_teacher_intact(dense_fam):
    """The 350-grid fast path: students built in memory share the teacher's non-FFN tensors, copy
    nothing else, and never modify the teacher."""
    family, teacher, a = dense_fam
    before = {k: v.clone() for k, v in teacher.state_dict().items()}
    x = ids()
    with torch.no_grad():
        base = teacher(x).logits
    t_store = {p.untyped_storage().data_ptr() for p in teacher.parameters()}
    for merged in (False, True, False):
        student = build_student_from_plans(teacher, a, hand_plans(a, teacher, merged), share_weights=True)
        t_names = dict(teacher.named_parameters())
        # new: the FFN tensors, and zeros for a bias the teacher lacks (Solar Open's o_proj in its Llama student)
        new = [
            p
            for n, p in student.named_parameters()
            if p.untyped_storage().data_ptr() not in t_store
            and not (n not in t_names and n.endswith(".bias") and not p.any())
        ]
        ffn = student_ffn_name(family)
        assert sum(p.numel() for p in new) == sum(
            p.numel() for n, p in student.named_parameters() if ffn in n
        )
        with torch.no_grad():
            student(x)
    for k, v in teacher.state_dict().items():
        assert torch.equal(v, before[k]), k  # exact: untouched bytes against their clone
    with torch.no_grad():
        # exact: the same model on the same input, the same ops in the same order: a change is a modification
        assert torch.equal(teacher(x).logits, base)
