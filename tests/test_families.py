"""Family adapters on tiny random configs of every supported MoE family (transformers 5.x).

References are computed independently of the adapter: through the teacher's own experts module
(forced routing) with weights merged here from the raw fused parameters, and the router math
written out per family.
"""

from __future__ import annotations

import copy

import pytest
import torch
from families_cases import (
    CASES,
    COMMON,
    DENSE_FAMILIES,
    FAMILIES,
    NO_DENSE_FAMILIES,
    block_of,
    cfg_get,
    correction_bias,
    experts_forward,
    hand_plans,
    ids,
    layers_of,
    make_teacher,
    routed_scale,
    router_of,
    set_block,
    shared_of,
    shared_weights,
    sparsemixer_ref,
    student_ffn_name,
    student_ffn_of,
)
from torch import nn

from workers.core.types import LayerPlan
from workers.families import get_adapter, supported
from workers.methods.merge import ffn_forward
from workers.models.convert import build_student_from_plans


@pytest.fixture(scope="module", params=FAMILIES)
def fam(request):
    teacher = make_teacher(request.param)
    return request.param, teacher, get_adapter(teacher)


@pytest.fixture(scope="module", params=DENSE_FAMILIES)
def dense_fam(request):
    """The families that write a dense student (Case.dense_student); the others are refused below."""
    teacher = make_teacher(request.param)
    return request.param, teacher, get_adapter(teacher)


# ---- independent per-family reference math -----------------------------------------------------
def ref_logits(family: str, block: nn.Module, h: torch.Tensor) -> torch.Tensor:
    r = router_of(family, block)
    z = h.float() @ r.weight.float().T
    cap = CASES[family].softcap_attr
    if cap is not None and float(getattr(r, cap)) > 0:
        c = float(getattr(r, cap))
        z = c * torch.tanh(z / c)
    return z + r.bias.float() if CASES[family].router == "logits" else z


def ref_probs(family: str, logits: torch.Tensor) -> torch.Tensor:
    """p over all E: softmax; sigmoid routers (DeepSeek-V3 style, Llama-4): sigmoid normalized over E."""
    if CASES[family].router in ("sigmoid", "topk_sigmoid"):
        s = torch.sigmoid(logits)
        return s / s.sum(-1, keepdim=True)
    return torch.softmax(logits, -1)


def renormalizes(family: str, teacher: nn.Module) -> bool:
    return CASES[family].renorm


def shared_term(family: str, block: nn.Module, h: torch.Tensor, gated: bool) -> torch.Tensor:
    """The shared experts inside the block (a shared MLP on the decoder layer is not in the block's output)."""
    case = CASES[family]
    if case.shared is None or case.shared_on_layer:
        return torch.zeros_like(h)
    out = getattr(block, case.shared)(h)
    if gated and case.shared_gate is not None:
        return torch.sigmoid(getattr(block, case.shared_gate)(h)) * out
    return out


def forced(
    experts: nn.Module, h: torch.Tensor, ids: list[int], weights: list[float], family: str = "qwen3_moe"
) -> torch.Tensor:
    """The experts module's own forward with every token routed to `ids` with `weights` (Llama-4: on the
    experts' inputs)."""
    t = h.shape[0]
    idx = torch.tensor(ids, device=h.device).expand(t, len(ids)).contiguous()
    w = torch.tensor(weights, dtype=h.dtype, device=h.device).expand(t, len(ids)).contiguous()
    return experts_forward(family, experts, h, idx, w)


def weighted(family: str, w: torch.Tensor, f, h: torch.Tensor) -> torch.Tensor:
    """w·f(h), or f(w·h) where the family's routing weight scales the expert's input (w [T, 1])."""
    return f(w * h) if CASES[family].input_scaled else w * f(h)


def merged_experts(
    family: str, experts: nn.Module, groups: list[list[int]], merge_w: list[list[float]]
) -> nn.Module:
    """A copy of the experts module whose slot g holds Σ_e w_e W_e of group g (raw fused tensors; DBRX's
    [E·I, H] w1/v1/w2 through their [E, I, H] views)."""
    ref = copy.deepcopy(experts)

    def slots(t: torch.Tensor) -> torch.Tensor:
        return t.view(experts.num_experts, -1, t.shape[-1]) if family == "dbrx" else t

    with torch.no_grad():
        for name, q in ref.named_parameters():
            p, src = slots(q), slots(experts.get_parameter(name))
            for g, (members, ws) in enumerate(zip(groups, merge_w, strict=True)):
                p[g] = sum(w * src[e] for e, w in zip(members, ws, strict=True))
    return ref


def block_out(family: str, y):
    return y[0] if CASES[family].tuple_out else y  # GptOssMLP / Llama4TextMoe return (out, router output)


class RefMLP(nn.Module):
    """Σ_g α_g f_g(h) (+ ungated shared experts) via the teacher's experts module (Appendix A)."""

    def __init__(self, family: str, block: nn.Module, plan: LayerPlan, scale: float):
        super().__init__()
        self.family, self.block = family, block
        self.experts = merged_experts(family, block.experts, plan.groups, plan.merge_weights)
        self.alpha = [a * scale for a in plan.alpha]

    def forward(self, x):
        h = x.reshape(-1, x.shape[-1])
        y = forced(self.experts, h, list(range(len(self.alpha))), self.alpha, self.family)
        y = (y + shared_term(self.family, self.block, h, gated=False)).reshape(x.shape)
        return (y, None) if CASES[self.family].tuple_out else y


def reference_model(family: str, teacher: nn.Module, plans: list[LayerPlan]) -> nn.Module:
    ref = copy.deepcopy(teacher)
    for pl in plans:
        set_block(
            family,
            ref,
            pl.layer,
            RefMLP(family, block_of(family, ref, pl.layer), pl, routed_scale(family, ref)),
        )
    return ref


def student_mlp(family: str, student: nn.Module, layer: int, h: torch.Tensor) -> torch.Tensor:
    y = student_ffn_of(family, student, layer)(h[None])
    return (y[0] if isinstance(y, tuple) else y)[0]  # a one-expert student's block returns a tuple (GPT-OSS)


# ---- structure ------------------------------------------------------------------------------------
def test_structure(fam):
    family, teacher, a = fam
    case = CASES[family]
    layers, e, k = list(case.moe_layers), case.experts, case.top_k
    assert a.name == family
    assert (a.moe_layers(teacher), a.num_experts(teacher), a.top_k(teacher)) == (layers, e, k)
    assert a.renormalized(teacher) == renormalizes(family, teacher)
    assert a.routed_scaling(teacher) == routed_scale(family, teacher)
    assert a.num_shared_experts(teacher) == (1 if case.shared else 0)  # one shared expert per MoE layer
    # exact: router_weight is the router's own tensor, detached
    assert torch.equal(
        a.router_weight(teacher, layers[0]), router_of(family, block_of(family, teacher, layers[0])).weight
    )


def test_unknown_architecture_one_line_error():
    from transformers import LlamaConfig, LlamaForCausalLM

    m = LlamaForCausalLM(LlamaConfig(**COMMON, num_hidden_layers=1, intermediate_size=16))
    with pytest.raises(ValueError) as err:
        get_adapter(m)
    msg = str(err.value)
    assert "\n" not in msg and "llama" in msg
    for fam_name in FAMILIES:
        assert fam_name in msg
    assert len(supported()) == len(FAMILIES)


def test_expert_views_match_experts_module(fam):
    family, teacher, a = fam
    torch.manual_seed(2)
    h = torch.randn(7, 32) * 3  # large: GPT-OSS clamps engage
    for layer in a.moe_layers(teacher):
        ex = block_of(family, teacher, layer).experts
        w = a.expert_weights(teacher, layer)
        assert w.gate.shape == (a.num_experts(teacher), w.intermediate, 32)
        storages = {p.untyped_storage().data_ptr() for p in ex.parameters()}
        assert w.gate.untyped_storage().data_ptr() in storages  # views, not copies
        for e in range(w.num_experts):
            torch.testing.assert_close(
                ffn_forward(w, h, expert=e), forced(ex, h, [e], [1.0], family), rtol=1e-5, atol=1e-5
            )


def test_gpt_oss_layout_clamp_and_bias():
    teacher = make_teacher("gpt_oss")
    a = get_adapter(teacher)
    ex = teacher.model.layers[0].mlp.experts
    w = a.expert_weights(teacher, 0)
    assert w.act == "gptoss" and (w.act_alpha, w.act_limit) == (ex.alpha, ex.limit)
    # exact: the expert views are strided views of the fused tensors (the same bytes)
    assert torch.equal(w.gate[3, 5], ex.gate_up_proj[3, :, 10]) and torch.equal(
        w.up[3, 5], ex.gate_up_proj[3, :, 11]
    )
    # exact: strided views of the fused bias and a transposed view of down (the same bytes)
    assert torch.equal(w.up_bias[2], ex.gate_up_proj_bias[2, 1::2]) and torch.equal(
        w.down[1], ex.down_proj[1].T
    )
    h = torch.randn(64, 32) * 3
    g = h @ w.gate[0].T + w.gate_bias[0]
    u = h @ w.up[0].T + w.up_bias[0]
    assert (g > ex.limit).any() and (u.abs() > ex.limit).any()  # the clamps are exercised below
    # an unclamped SwiGLU would give a different answer: the clamp really matters in this test
    plain = (u + 1) * g * torch.sigmoid(ex.alpha * g) @ w.down[0].T + w.down_bias[0]
    assert not torch.allclose(plain, forced(ex, h, [0], [1.0]), atol=1e-3)
    plans = hand_plans(a, teacher, merged=True)
    student = build_student_from_plans(teacher, a, plans, share_weights=False)
    sx = student.model.layers[0].mlp.experts
    d = student.config.intermediate_size
    assert sx.gate_up_proj.shape == (1, 32, 2 * d) and sx.down_proj_bias.shape == (1, 32)
    pl = plans[0]
    gate0 = sum(mw * w.gate[e] for e, mw in zip(pl.groups[0], pl.merge_weights[0], strict=True))
    torch.testing.assert_close(sx.gate_up_proj[0, :, 0:16:2].T, gate0[:8])  # interleaved even columns = gate
    bias = sum(
        al * sum(mw * w.down_bias[e] for e, mw in zip(g_, ws, strict=True))
        for al, g_, ws in zip(pl.alpha, pl.groups, pl.merge_weights, strict=True)
    )
    torch.testing.assert_close(sx.down_proj_bias[0], bias)
    ref = RefMLP("gpt_oss", teacher.model.layers[0].mlp, pl, 1.0)
    torch.testing.assert_close(
        student_mlp("gpt_oss", student, 0, h), ref(h[None])[0][0], rtol=1e-4, atol=1e-4
    )


# ---- router decision --------------------------------------------------------------------------------
def test_router_decision_is_what_the_block_used(fam):
    family, teacher, a = fam
    seen: dict[int, dict] = {}
    handles = []
    for layer in a.moe_layers(teacher):
        rec = seen.setdefault(layer, {})
        handles += a.hook_routing(teacher, layer, lambda x, p, w, idx, rec=rec: rec.update(dec=(p, w, idx)))
        handles.append(
            block_of(family, teacher, layer).register_forward_hook(
                lambda m, i, o, rec=rec: rec.update(
                    h=i[0].reshape(-1, i[0].shape[-1]), y=block_out(family, o)
                )
            )
        )
    with torch.no_grad():
        teacher(ids())
    for hd in handles:
        hd.remove()
    k, scale = a.top_k(teacher), routed_scale(family, teacher)
    for layer, rec in seen.items():
        block = block_of(family, teacher, layer)
        p, w, idx = rec["dec"]
        h = rec["h"]
        t = h.shape[0]
        assert p.shape == (t, a.num_experts(teacher)) and w.shape == idx.shape == (t, k)
        torch.testing.assert_close(p, ref_probs(family, ref_logits(family, block, h)), rtol=1e-5, atol=1e-6)
        ps = p.gather(1, idx)
        if CASES[family].router == "topk_sigmoid":  # the chosen logits' sigmoid, not p
            ps = torch.sigmoid(ref_logits(family, block, h)).gather(1, idx)
            # exact: expert indices (integers); random logits have no near-ties for rounding to flip
            assert torch.equal(
                idx.sort(-1).values, torch.topk(ref_logits(family, block, h), k, -1).indices.sort(-1).values
            )
        expect_w = ps / ps.sum(-1, keepdim=True) if renormalizes(family, teacher) else ps
        if CASES[family].router == "sparsemixer":
            expect_w, expect_idx = sparsemixer_ref(
                ref_logits(family, block, h), teacher.config.router_jitter_noise
            )
            assert torch.equal(idx, expect_idx)  # exact: expert indices (integers)
            expect_w = expect_w.float()
            assert (expect_w < 1 - 1e-6).any() and (
                expect_w.sum(-1) != 1
            ).any()  # the masks hold several experts
        torch.testing.assert_close(w.float(), expect_w * scale, rtol=1e-5, atol=1e-6)
        # rebuild the block's output from (indices, weights) and the expert views
        ew = a.expert_weights(teacher, layer)
        y = shared_term(family, block, h, gated=True)
        for j in range(k):
            y = y + torch.stack(
                [
                    weighted(
                        family,
                        w[i, j],
                        lambda x, m=ew, e=int(idx[i, j]): ffn_forward(m, x, expert=e),
                        h[i : i + 1],
                    )[0]
                    for i in range(t)
                ]
            )
        torch.testing.assert_close(y.reshape(rec["y"].shape), rec["y"], rtol=1e-4, atol=1e-5)


# ---- expanded teacher routing (paper §4.3, Eq. 6) ---------------------------------------------------
def _capture_blocks(family, teacher, a, fn):
    seen: dict[int, tuple] = {}
    hs = [
        block_of(family, teacher, layer).register_forward_hook(
            lambda m, i, o, layer=layer: seen.__setitem__(
                layer, (i[0].reshape(-1, i[0].shape[-1]), block_out(family, o))
            )
        )
        for layer in a.moe_layers(teacher)
    ]
    with torch.no_grad():
        out = fn()
    for hd in hs:
        hd.remove()
    return out, seen


def _choice(family: str, block: nn.Module, logits: torch.Tensor) -> torch.Tensor:
    if CASES[family].router in ("logits", "topk_sigmoid"):
        return logits
    if CASES[family].router == "sigmoid":
        return torch.sigmoid(logits) + correction_bias(family, block)
    if CASES[family].router == "softmax_bias":
        return torch.softmax(logits, -1) + correction_bias(family, block)
    return torch.softmax(logits, -1)


@pytest.mark.parametrize("kprime,renorm", [("E", True), ("k+1", False)])
def test_routing_top_k_expanded(fam, kprime, renorm):
    family, teacher, a = fam
    e, k = a.num_experts(teacher), a.top_k(teacher)
    kk = e if kprime == "E" else k + 1
    x = ids()
    with a.routing_top_k(teacher, kk, renormalize=renorm):
        _, seen = _capture_blocks(family, teacher, a, lambda: teacher(x))
    scale = routed_scale(family, teacher)
    for layer, (h, y) in seen.items():
        block = block_of(family, teacher, layer)
        logits = ref_logits(family, block, h)
        p = ref_probs(family, logits)
        sel = torch.topk(_choice(family, block, logits), kk, -1).indices
        if CASES[family].router in ("sigmoid", "topk_sigmoid"):  # the raw sigmoid scores are multiplied in
            raw = torch.sigmoid(logits).gather(1, sel)
            w = raw / raw.sum(-1, keepdim=True) if renorm else raw
        else:
            ps = p.gather(1, sel)
            w = ps / ps.sum(-1, keepdim=True) if renorm else ps
        ew = a.expert_weights(teacher, layer)
        if CASES[family].input_scaled:  # Σ_j f_{e_j}(w_j h), token by token
            ref = torch.stack(
                [
                    sum(ffn_forward(ew, w[t, j] * h[t : t + 1], expert=int(sel[t, j]))[0] for j in range(kk))
                    for t in range(h.shape[0])
                ]
            )
        else:
            every = torch.stack([ffn_forward(ew, h, expert=i) for i in range(e)], 1)  # [T, E, H]
            ref = (w[..., None] * scale * every.gather(1, sel[..., None].expand(-1, -1, h.shape[1]))).sum(1)
            if kprime == "E" and renorm:  # the full mixture Σ_e p_e f_e over all experts
                torch.testing.assert_close(ref, scale * (p[..., None] * every).sum(1), rtol=1e-4, atol=1e-5)
        ref = ref + shared_term(family, block, h, gated=True)
        torch.testing.assert_close(y.reshape(ref.shape), ref, rtol=1e-4, atol=1e-5)


def test_routing_top_k_native_and_restore(fam):
    family, teacher, a = fam
    x = ids()
    with torch.no_grad():
        base = teacher(x).logits
        with a.routing_top_k(teacher, a.top_k(teacher)):
            same = teacher(x).logits
        after = teacher(x).logits
    # exact: the native k with the native rule returns the router's own output: the same ops in the same order
    assert torch.equal(base, same) and torch.equal(base, after)
    # the other rule changes the MoE blocks' outputs (compared there: FlexOlmo's post-FFN RMSNorm all but
    # cancels a per-token rescaling of the block output, so its logits barely move)
    first = a.moe_layers(teacher)[0]
    _, native = _capture_blocks(family, teacher, a, lambda: teacher(x))
    with a.routing_top_k(teacher, a.top_k(teacher), renormalize=not a.renormalized(teacher)):
        _, changed = _capture_blocks(family, teacher, a, lambda: teacher(x))
    assert not torch.allclose(native[first][1], changed[first][1], atol=1e-4)
    assert all("forward" not in a.router_module(teacher, layer).__dict__ for layer in a.moe_layers(teacher))
    with pytest.raises(ValueError):
        with a.routing_top_k(teacher, a.num_experts(teacher) + 1):
            pass


# ---- students (Appendix A exactness) -----------------------------------------------------------------
@pytest.mark.parametrize("merged", [False, True])
def test_student_ffn_exact(dense_fam, merged):
    family, teacher, a = dense_fam
    plans = hand_plans(a, teacher, merged)
    student = build_student_from_plans(teacher, a, plans, share_weights=True)
    torch.manual_seed(3)
    h = torch.randn(9, 32) * 2
    with torch.no_grad():
        for pl in plans:
            ref = RefMLP(family, block_of(family, teacher, pl.layer), pl, routed_scale(family, teacher))
            want = block_out(family, ref(h[None]))[0]
            if CASES[family].shared_on_layer:  # the decoder layer adds its shared MLP to the block's output
                want = want + shared_of(family, teacher, pl.layer)(h)
            torch.testing.assert_close(student_mlp(family, student, pl.layer, h), want, rtol=1e-4, atol=1e-5)
        for layer in set(range(len(layers_of(family, teacher)))) - set(
            a.moe_layers(teacher)
        ):  # padded dense layers
            torch.testing.assert_close(
                student_mlp(family, student, layer, h),
                block_of(family, teacher, layer)(h),
                rtol=1e-5,
                atol=1e-6,
            )


@pytest.mark.parametrize("share", [False, True])
def test_student_logits_equal_reference(dense_fam, share):
    family, teacher, a = dense_fam
    plans = hand_plans(a, teacher, merged=True)
    student = build_student_from_plans(teacher, a, plans, share_weights=share)
    ref = reference_model(family, teacher, plans)
    x = ids(seed=5)
    with torch.no_grad():
        torch.testing.assert_close(student(x).logits, ref(x).logits, rtol=1e-4, atol=1e-4)
    t_params = dict(teacher.named_parameters())
    t_store = {p.untyped_storage().data_ptr() for p in teacher.parameters()}
    ffn = student_ffn_name(family)
    for name, p in student.named_parameters():
        if ffn in name:
            assert p.untyped_storage().data_ptr() not in t_store, name  # FFN tensors are always new
        elif share and name not in t_params:  # a bias the teacher lacks (Solar Open's o_proj in Llama): zeros
            assert name.endswith(".bias") and not p.any(), name
        elif share:
            assert p is t_params[name], name
        else:
            assert p.untyped_storage().data_ptr() not in t_store, name


def test_student_config_and_width(dense_fam):
    family, teacher, a = dense_fam
    import transformers

    case = CASES[family]
    student = build_student_from_plans(teacher, a, hand_plans(a, teacher, False), share_weights=True)
    cfg = student.config
    assert type(cfg) is getattr(transformers, case.student)
    i = a.expert_weights(teacher, a.moe_layers(teacher)[0]).intermediate
    assert cfg_get(cfg, case.width_key) == a.top_k(teacher) * i + case.shared_width  # k·I + shared width
    if case.one_expert_student:
        assert (cfg_get(cfg, case.experts_key), cfg_get(cfg, case.topk_key)) == (1, 1)
    if case.all_dense_student:
        if family == "llama4_text":
            assert cfg.moe_layers == [] and cfg.no_rope_layers == teacher.config.no_rope_layers
            assert (
                cfg.layer_types == teacher.config.layer_types
                and cfg.use_qk_norm == teacher.config.use_qk_norm
            )
            assert cfg.attention_chunk_size == teacher.config.attention_chunk_size
        else:
            assert cfg.first_k_dense_replace == cfg.num_hidden_layers
        assert not any(
            hasattr(getattr(layer, case.student_block), "experts") for layer in student.model.layers
        )
    if family == "mixtral":
        assert cfg.rope_parameters == teacher.config.rope_parameters and cfg.sliding_window is None
        assert cfg.head_dim == 8 and cfg.rms_norm_eps == teacher.config.rms_norm_eps


def test_shared_experts_scale_one_and_padding(dense_fam):
    family, teacher, a = dense_fam
    plans = hand_plans(a, teacher, merged=False)
    student = build_student_from_plans(teacher, a, plans, share_weights=False)
    width = cfg_get(student.config, CASES[family].width_key)
    kI = a.top_k(teacher) * a.expert_weights(teacher, a.moe_layers(teacher)[0]).intermediate
    for layer in range(len(layers_of(family, student))):
        block = block_of(family, teacher, layer)
        mlp = student_ffn_of(family, student, layer)
        if CASES[family].shared and layer in a.moe_layers(teacher):
            sh_gate, _, sh_down = shared_weights(shared_of(family, teacher, layer))
            # exact: the shared expert's weights are copied into the student's tail rows / columns
            torch.testing.assert_close(mlp.gate_proj.weight[kI:], sh_gate, rtol=0, atol=0)
            torch.testing.assert_close(mlp.down_proj.weight[:, kI:], sh_down, rtol=0, atol=0)
        if layer not in a.moe_layers(teacher):  # dense teacher layer zero-padded to the student's width
            d = block.gate_proj.weight.shape[0]
            assert d < width
            assert torch.equal(mlp.gate_proj.weight[:d], block.gate_proj.weight)  # exact: copied bytes
            assert not mlp.gate_proj.weight[d:].any() and not mlp.down_proj.weight[:, d:].any()


def test_build_student_rejects_bad_ffns(dense_fam):
    family, teacher, a = dense_fam
    plans = hand_plans(a, teacher, merged=False)
    with pytest.raises(ValueError, match="MoE layer"):
        build_student_from_plans(teacher, a, plans[:-1], share_weights=True)


def test_save_load_roundtrip(dense_fam, tmp_path):
    family, teacher, a = dense_fam
    from transformers import AutoModelForCausalLM

    student = build_student_from_plans(teacher, a, hand_plans(a, teacher, merged=True), share_weights=True)
    student.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is type(student)
    x = ids(seed=7)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, student(x).logits, rtol=0, atol=1e-6)


@pytest.mark.parametrize("family", NO_DENSE_FAMILIES)
def test_dense_student_refused_in_one_line(family):
    """A family whose Case says it writes no dense student refuses it: refused_outputs names "dense", and
    student_config / build_student raise the same one-line error."""
    teacher = make_teacher(family)
    a = get_adapter(teacher)
    assert "dense" in a.refused_outputs and "\n" not in a.refused_outputs["dense"]
    for build in (
        lambda: a.student_config(teacher, 16),
        lambda: build_student_from_plans(teacher, a, hand_plans(a, teacher, False), share_weights=True),
    ):
        with pytest.raises(ValueError) as err:
            build()
        assert str(err.value) == f"output='dense': {family} {a.refused_outputs['dense']}"
