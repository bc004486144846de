"""The pruned-MoE student (REAP paper, Sec. 4: drop experts, slice the router): a real, smaller HF
checkpoint of the teacher's class that routes like the teacher with the dropped experts excluded.

The reference is built here, independently of the adapters: the teacher (float64) with its routers
patched so that the dropped experts' logits are -inf (softmax routers), their score-correction bias is
-inf (DeepSeek-V3-style sigmoid routers: out of the group scores, the top-k and the normalization over the
chosen k) or their router bias is -inf (GPT-OSS: out of the top-k of the logits); a softmax router with a
correction bias (ERNIE-4.5) gets both its dropped logits and biases at -inf; a sigmoid router without one (Flint)
its dropped logits at -inf.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from families_cases import (
    CASES,
    FAMILIES,
    block_of,
    cfg_get,
    correction_bias,
    expert_params,
    ids,
    layers_of,
    make_teacher,
    router_module_of,
    router_of,
    shared_of,
    sparsemixer_ref,
)

from workers.families import get_adapter


def teacher(family: str, seed: int = 0) -> torch.nn.Module:
    return make_teacher(family, seed=seed, dtype=torch.float64, experts_implementation="eager")


def moe_blocks(family: str, model) -> dict[int, torch.nn.Module]:
    """Decoder layer index → its MoE block (the FFNs with routed experts)."""
    blocks = {i: block_of(family, model, i) for i in range(len(layers_of(family, model)))}
    return {i: b for i, b in blocks.items() if hasattr(b, "experts")}


def _softmax_router_forward(router, dropped: torch.Tensor, always_renorm: bool, module=None):
    """Qwen2/Qwen3/OLMoE/Mixtral/Granite/HunYuan router with the dropped experts' logits at -inf. `router` holds
    the linear map, `module` (default: router) is the router module (top_k, norm_topk_prob; a router module
    without norm_topk_prob, HunYuan's gate, always renormalizes but casts like the flagged ones)."""
    module = router if module is None else module

    def forward(hidden_states):
        h = hidden_states.reshape(-1, router.weight.shape[1]).to(router.weight.dtype)
        logits = F.linear(h, router.weight).masked_fill(dropped, float("-inf"))
        probs = torch.softmax(logits, dtype=torch.float, dim=-1)
        w, idx = torch.topk(probs, module.top_k, dim=-1)
        if always_renorm or getattr(module, "norm_topk_prob", True):
            w = w / w.sum(dim=-1, keepdim=True)
        return logits, (w if always_renorm else w.to(logits.dtype)), idx

    return forward


def _deepseek_v2_router_forward(router, dropped: torch.Tensor):
    """DeepseekV2 router (greedy or group-limited over the teacher's groups) with dropped logits at -inf."""

    def forward(hidden_states):
        h = hidden_states.view(-1, router.hidden_dim)
        logits = F.linear(h.float(), router.weight.float()).masked_fill(dropped, float("-inf"))
        scores = logits.softmax(dim=-1, dtype=torch.float32)
        E = scores.shape[-1]
        if router.topk_method == "group_limited_greedy":
            n = router.num_group
            group = scores.view(-1, n, E // n).max(dim=-1).values
            chosen = torch.zeros_like(group).scatter_(1, torch.topk(group, router.topk_group, dim=-1)[1], 1)
            scores = scores.masked_fill(~chosen.repeat_interleave(E // n, dim=1).bool(), 0.0)
        w, idx = torch.topk(scores, router.top_k, dim=-1)
        return logits, w * router.routed_scaling_factor, idx

    return forward


def _softmax_bias_router_forward(router, dropped: torch.Tensor):
    """ERNIE-4.5 router (top-k of softmax p + correction bias, p of the k renormalized) with the dropped
    experts' logits and biases at -inf: the softmax runs over the kept experts only."""

    def forward(hidden_states):
        logits = F.linear(hidden_states.float(), router.weight.float()).masked_fill(dropped, float("-inf"))
        p = torch.softmax(logits, dim=-1)
        bias = (
            router.moe_statics.e_score_correction_bias.float().reshape(-1).masked_fill(dropped, float("-inf"))
        )
        idx = torch.topk(p + bias, router.top_k, dim=-1).indices
        w = p.gather(1, idx)
        w = w / w.sum(dim=-1, keepdim=True).clamp(min=router.norm_min)
        return logits, w.to(hidden_states.dtype), idx

    return forward


def _sigmoid_router_forward(router, dropped: torch.Tensor, renorm: bool):
    """A sigmoid router without correction bias (Flint) with the dropped experts' logits at -inf (score 0, never
    chosen while k experts are kept): top-k of the scores, renormalized over the k iff `renorm`."""

    def forward(hidden_states):
        logits = F.linear(hidden_states.float(), router.weight.float()).masked_fill(dropped, float("-inf"))
        w, idx = torch.topk(torch.sigmoid(logits), router.top_k, dim=-1)
        return logits, (w / w.sum(dim=-1, keepdim=True) if renorm else w), idx

    return forward


def _topk_sigmoid_router_forward(router, dropped: torch.Tensor):
    """Llama-4's router with the dropped experts' logits at -inf: top-k of the logits, their sigmoid as scores."""

    def forward(hidden_states):
        logits = F.linear(hidden_states, router.weight).masked_fill(dropped, float("-inf"))
        top, idx = torch.topk(logits, router.top_k, dim=1)
        scores = torch.zeros_like(logits).scatter(1, idx, torch.sigmoid(top.float()).to(logits.dtype))
        return scores, logits

    return forward


def _sparsemixer_router_forward(router, dropped: torch.Tensor):
    """PhiMoE router (SparseMixer, eval mode) with the dropped experts' logits at -inf, its two picks and
    weights from the independent sparsemixer_ref."""

    def forward(hidden_states):
        logits = F.linear(hidden_states, router.weight).masked_fill(dropped, float("-inf"))
        w, idx = sparsemixer_ref(logits, router.router_jitter_noise)
        return logits, w.to(logits.dtype), idx

    return forward


def _logits_router_forward(router, dropped: torch.Tensor):
    """DBRX's router (the logits alone; the block takes their softmax top-k) with the dropped logits at -inf."""

    def forward(hidden_states):
        return F.linear(hidden_states.reshape(-1, router.weight.shape[1]), router.weight).masked_fill(
            dropped, float("-inf")
        )

    return forward


def masked_teacher(family: str, model, kept: dict[int, list[int]], groups: bool = True):
    """A deep copy of `model` routing as if the experts not in kept[layer] did not exist. groups=False:
    DeepSeek's group limit switched off (n_group = topk_group = 1)."""
    ref = copy.deepcopy(model)
    for layer, block in moe_blocks(family, ref).items():
        router = router_of(family, block)
        E = router.weight.shape[0]
        dropped = torch.ones(E, dtype=torch.bool)
        dropped[kept[layer]] = False
        case = CASES[family]
        if case.groups and not groups:
            router.num_group, router.topk_group = 1, 1
        with torch.no_grad():
            if case.router == "logits":
                router.bias[dropped] = float("-inf")
            elif case.router == "sigmoid" and not case.corrected:
                router.forward = _sigmoid_router_forward(router, dropped, case.renorm)
            elif case.router == "sigmoid":
                correction_bias(family, block)[dropped] = float("-inf")
            elif case.router == "softmax_bias":
                router.forward = _softmax_bias_router_forward(router, dropped)
            elif case.logits_router:
                router_module_of(family, block).forward = _logits_router_forward(router, dropped)
            elif case.router == "softmax_v2":
                router.forward = _deepseek_v2_router_forward(router, dropped)
            elif case.router == "topk_sigmoid":
                router.forward = _topk_sigmoid_router_forward(router, dropped)
            elif case.router == "sparsemixer":
                router.forward = _sparsemixer_router_forward(router, dropped)
            else:
                module = router_module_of(family, block)  # the router module, not its inner linear map
                module.forward = _softmax_router_forward(
                    router,
                    dropped,
                    module=module,
                    always_renorm=family == "mixtral" or family.startswith("granite"),
                )
    return ref


def logits(model, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=x, use_cache=False).logits


def some_kept(family: str, model, e_new: int, seed: int = 0) -> dict[int, list[int]]:
    """A different random subset of e_new experts per MoE layer, listed in a shuffled order."""
    adapter = get_adapter(model)
    E = adapter.num_experts(model)
    g = torch.Generator().manual_seed(seed)
    return {layer: torch.randperm(E, generator=g)[:e_new].tolist() for layer in adapter.moe_layers(model)}


def balanced_kept(model, per_group: int, seed: int = 0) -> dict[int, list[int]]:
    """DeepSeek: per_group experts from every one of the n_group contiguous groups, per layer."""
    adapter = get_adapter(model)
    E, n = adapter.num_experts(model), model.config.n_group
    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in adapter.moe_layers(model):
        out[layer] = [
            grp * (E // n) + int(i)
            for grp in range(n)
            for i in torch.randperm(E // n, generator=g)[:per_group]
        ]
    return out


def check_pruned_checkpoint(family, model, kept, pruned, tmp_path):
    """Saved and reloaded offline: E' in the config, sliced tensors of E' rows, everything else copied."""
    from transformers import AutoModelForCausalLM

    e_new = len(next(iter(kept.values())))
    pruned.save_pretrained(tmp_path)
    back = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64, experts_implementation="eager")
    assert type(back) is type(model)
    assert cfg_get(back.config, CASES[family].experts_key) == e_new
    assert cfg_get(back.config, CASES[family].topk_key) == cfg_get(model.config, CASES[family].topk_key)
    t_blocks, b_blocks = moe_blocks(family, model), moe_blocks(family, back)
    assert sorted(t_blocks) == sorted(b_blocks) == sorted(kept)
    H = model.config.hidden_size
    for layer, blk in b_blocks.items():
        idx = torch.tensor(sorted(kept[layer]))
        src = t_blocks[layer]
        router, t_router = router_of(family, blk), router_of(family, src)
        # exact: below, slices and copies of the float64 teacher's bytes, through safetensors
        assert router.weight.shape == (e_new, H) and torch.equal(router.weight, t_router.weight[idx])
        for name, t in expert_params(family, src.experts).items():
            got = expert_params(family, blk.experts)[name]  # exact: the kept experts' rows, sliced
            assert got.shape == (e_new, *t.shape[1:]) and torch.equal(got, t[idx]), name
        case = CASES[family]
        if case.router == "logits":  # exact: the sliced router bias and correction bias
            assert router.bias.shape == (e_new,) and torch.equal(router.bias, t_router.bias[idx])
        if case.router in ("sigmoid", "softmax_bias"):
            assert torch.equal(correction_bias(family, blk), correction_bias(family, src)[idx])
        if case.shared_gate:  # exact: copied
            assert torch.equal(getattr(blk, case.shared_gate).weight, getattr(src, case.shared_gate).weight)
        if case.shared:
            for (n1, a), (n2, b) in zip(
                shared_of(family, model, layer).named_parameters(),
                shared_of(family, back, layer).named_parameters(),
                strict=True,
            ):
                assert n1 == n2 and torch.equal(a, b)  # exact: the shared experts, copied
    for i in range(len(layers_of(family, back))):  # dense teacher layers unchanged
        if i not in b_blocks:
            for (n1, a), (n2, b) in zip(
                block_of(family, model, i).named_parameters(),
                block_of(family, back, i).named_parameters(),
                strict=True,
            ):
                assert n1 == n2 and torch.equal(a, b)  # exact: copied
    # nothing shared with the teacher
    t_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert not any(p.untyped_storage().data_ptr() in t_ptrs for p in pruned.parameters())
    return back


# DeepSeek and the float32 routers of Qwen/OLMoE/Mixtral compute the weights in float32: the reference's
# softmax over E (with -inf) and the pruned softmax over E' round differently in the last float32 bit.
TOL = {"gpt_oss": 1e-10}
# A checkpoint reloaded in float64 computes its logits up to float64 rounding, not bit for bit: the DBRX teacher
# itself, saved and reloaded, differs from the in-memory one by ~3e-14 (its state dict and config are equal).
ROUNDTRIP_TOL = 1e-12


@pytest.mark.parametrize("family", FAMILIES)
def test_pruned_checkpoint_routes_as_the_teacher_without_the_dropped_experts(family, tmp_path):
    model = teacher(family)
    adapter = get_adapter(model)
    E, k = adapter.num_experts(model), adapter.top_k(model)
    kept = balanced_kept(model, per_group=2) if CASES[family].groups else some_kept(family, model, E - 2)
    pruned = adapter.pruned_moe_student(model, kept)
    back = check_pruned_checkpoint(family, model, kept, pruned, tmp_path)
    if CASES[family].groups:  # balanced across the groups: the group limit is kept
        assert (back.config.n_group, back.config.topk_group) == (
            model.config.n_group,
            model.config.topk_group,
        )
    x = ids(3, 12, seed=4)
    want = logits(masked_teacher(family, model, kept), x)
    tol = TOL.get(family, 1e-5)
    for m in (pruned, back):
        torch.testing.assert_close(logits(m, x), want, rtol=tol, atol=tol * float(want.abs().max()))
    assert not torch.allclose(want, logits(model, x), rtol=1e-3, atol=1e-3)  # pruning did change the model
    assert all(k <= len(v) < E for v in kept.values())


def test_sparsemixer_over_the_kept_logits_is_the_teacher_with_the_dropped_logits_at_minus_inf():
    """PhiMoE: a -inf logit gives a NaN relative threshold ((max − (−inf)) / inf), which never masks, but its
    softmax weight is 0 and it is never the max: SparseMixer over the kept logits picks the same experts with
    the same weights as over all E with the dropped logits at -inf, and both equal sparsemixer_ref."""
    from transformers.models.phimoe.modeling_phimoe import sparsemixer

    g = torch.Generator().manual_seed(0)
    z = torch.randn(200, 6, generator=g, dtype=torch.float64) * 2
    kept = [0, 2, 3, 5]
    dropped = torch.ones(6, dtype=torch.bool)
    dropped[kept] = False
    for eps in (0.01, 0.2, 0.5):
        w_all, i_all = sparsemixer(z.masked_fill(dropped, float("-inf")), jitter_eps=eps, training=False)
        w_kept, i_kept = sparsemixer(z[:, kept], jitter_eps=eps, training=False)
        assert torch.equal(
            i_all, torch.tensor(kept)[i_kept]
        )  # exact: integer indices (picked from z, not softmax)
        # not bitwise: a softmax over 6 entries (2 at -inf) and one over the 4 kept add the same exp values in a
        # different order, which depends on the CPU's SIMD width (equal under AVX-512, not under AVX2)
        torch.testing.assert_close(w_all, w_kept, rtol=1e-12, atol=0)
        w_ref, i_ref = sparsemixer_ref(z.masked_fill(dropped, float("-inf")), eps)
        assert torch.equal(i_all, i_ref)  # exact: integer indices
        torch.testing.assert_close(w_all, w_ref, rtol=1e-12, atol=1e-12)
        if eps == 0.2:  # the masked softmaxes hold several experts in some tokens
            assert (w_ref < 1 - 1e-9).any()


@pytest.mark.parametrize("family", FAMILIES)
def test_pruning_to_all_experts_reproduces_the_teacher_exactly(family, tmp_path):
    model = teacher(family, seed=3)
    adapter = get_adapter(model)
    E = adapter.num_experts(model)
    kept = {layer: list(range(E)) for layer in adapter.moe_layers(model)}
    pruned = adapter.pruned_moe_student(model, kept)
    x = ids(2, 10, seed=5)
    # exact: every expert kept in order: the same float64 values (copied), the same ops on the same shapes, in memory
    assert torch.equal(logits(pruned, x), logits(model, x))
    back = check_pruned_checkpoint(family, model, kept, pruned, tmp_path)
    want = logits(model, x)
    torch.testing.assert_close(
        logits(back, x), want, rtol=ROUNDTRIP_TOL, atol=ROUNDTRIP_TOL * float(want.abs().max())
    )


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
@pytest.mark.parametrize("case", ["uneven", "indivisible", "one_per_group"])
def test_deepseek_drops_the_group_limit_when_the_groups_cannot_survive(family, case, tmp_path):
    """n_group = 2 groups of 4, topk_group = 1, k = 2: keeping 3 of one group and 1 of the other, 5
    experts (not divisible by 2), or 1 per group (the one chosen group could not supply k = 2 experts)
    leaves no contiguous-block grouping that routes as the teacher's: the pruned config has
    n_group = topk_group = 1 and routes as the teacher without the dropped experts and without the limit."""
    model = teacher(family, seed=1)
    adapter = get_adapter(model)
    layers = adapter.moe_layers(model)
    first, last = {
        "uneven": ([0, 2, 3, 6], [5, 6, 7, 1]),
        "indivisible": ([1, 2, 4, 5, 7], [0, 3, 4, 5, 6]),
        "one_per_group": ([1, 6], [3, 4]),
    }[case]
    kept = {layer: first for layer in layers}
    kept[layers[-1]] = last
    pruned = adapter.pruned_moe_student(model, kept)
    back = check_pruned_checkpoint(family, model, kept, pruned, tmp_path)
    assert (back.config.n_group, back.config.topk_group) == (1, 1)
    x = ids(3, 12, seed=6)
    want = logits(masked_teacher(family, model, kept, groups=False), x)
    torch.testing.assert_close(logits(back, x), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    # ... which is not what the teacher's group limit would do
    assert not torch.allclose(logits(masked_teacher(family, model, kept, groups=True), x), want, rtol=1e-4)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss", "phimoe"])
def test_bad_kept_gives_one_line_errors(family):
    model = teacher(family)
    adapter = get_adapter(model)
    layers, E, k = adapter.moe_layers(model), adapter.num_experts(model), adapter.top_k(model)
    full = {layer: list(range(E)) for layer in layers}
    cases = [
        ({layer: list(range(k - 1)) for layer in layers}, "need E' >= k"),
        ({**full, layers[0]: list(range(E - 1))}, "differ in length across layers"),
        ({**full, layers[0]: [0, 0] + list(range(2, E))}, "distinct"),
        ({**full, layers[0]: list(range(1, E + 1))}, "distinct and in 0"),
        ({layer: full[layer] for layer in layers[1:]}, "MoE layers are"),
    ]
    for kept, msg in cases:
        with pytest.raises(ValueError, match=msg) as e:
            adapter.pruned_moe_student(model, kept)
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("family", FAMILIES)
def test_calibrate_select_prune_end_to_end(family):
    """Calibration statistics → select_pruned (REAP, super experts protected) → pruned checkpoint whose
    router rows are the selected experts' rows, with finite logits."""
    from workers.calibration.calibrate import collect_stats
    from workers.methods.pruning import select_pruned
    from workers.models.convert import layer_contexts

    model = teacher(family, seed=2)
    adapter = get_adapter(model)
    x = ids(4, 10, seed=7)
    stats = collect_stats(model, adapter, [(x, torch.ones_like(x))], chunk_tokens=16)
    E, k = adapter.num_experts(model), adapter.top_k(model)
    kept, protected = {}, 0
    for layer, c in layer_contexts(model, adapter, stats).items():
        sel = select_pruned(c, "REAP", max(k, E // 2), super_factor=1.0)  # above the median
        assert set(sel.extras["protected"]) <= set(sel.selected)
        kept[layer], protected = sel.selected, protected + len(sel.extras["protected"])
    assert protected > 0
    pruned = adapter.pruned_moe_student(model, kept)
    for layer, block in moe_blocks(family, pruned).items():
        t_router = router_of(family, moe_blocks(family, model)[layer])
        # exact: the kept experts' router rows, sliced
        assert torch.equal(router_of(family, block).weight, t_router.weight[sorted(kept[layer])])
    assert torch.isfinite(logits(pruned, ids(2, 8, seed=8))).all()
