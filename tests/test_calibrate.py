"""Calibration statistics (workers/calibration/calibrate.py): the batched all-experts pass against a naive per-token,
per-expert loop over the teacher's own expert modules, on tiny random models of every family."""

from __future__ import annotations

import pytest
import torch
from families_cases import CASES, FAMILIES, V, experts_forward, make_teacher, routed_scale

from workers.calibration.calibrate import (
    STAT_FIELDS,
    collect_stats,
    load_stats,
    save_stats,
    stats_metadata,
)
from workers.families import get_adapter
from workers.methods.experts import all_expert_outputs


def tiny_model(family: str, dtype: torch.dtype = torch.float64, seed: int = 0):
    """The family's shared tiny teacher with the eager experts loop (any dtype, float64 included)."""
    return make_teacher(family, seed=seed, dtype=dtype, experts_implementation="eager")


def padded_batches(seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Two right-padded batches; padding sits mid-stream in the flattened token order."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (2, 2, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[0, 0, 6:] = 0
    mask[1, 1, 4:] = 0
    ids[mask == 0] = 0
    return [(ids[0], mask[0]), (ids[1], mask[1])]


def _block_of(model, router):
    return next(mod for mod in model.modules() if any(c is router for c in mod.children()))


def _capture(model, adapter, batches):
    """Per layer: list of (x [T, H], p, weights, indices, mask) seen by the router module."""
    seen = {layer: [] for layer in adapter.moe_layers(model)}
    state = {}

    def make(layer):
        def hook(x, p, w, idx):
            seen[layer].append((x.clone(), p.clone(), w.clone(), idx.clone(), state["mask"]))

        return hook

    handles = [h for layer in seen for h in adapter.hook_routing(model, layer, make(layer))]
    try:
        with torch.no_grad():
            for ids, mask in batches:
                state["mask"] = mask.reshape(-1).bool()
                model(input_ids=ids, attention_mask=mask, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return seen


def naive_stats(model, adapter, batches) -> dict[int, dict[str, torch.Tensor]]:
    """Reference: per token, per expert, the teacher's own experts module on that single token."""
    out = {}
    for layer, records in _capture(model, adapter, batches).items():
        experts = _block_of(model, adapter.router_module(model, layer)).experts
        E = adapter.num_experts(model)
        H = records[0][0].shape[1]
        shapes = {"gram": (E, E), "gram_p": (E, E), "sum_out": (E, H), "sum_xx": (H, H)}
        acc = {name: torch.zeros(shapes.get(name, (E,)), dtype=torch.float64) for name in STAT_FIELDS}
        n = 0
        with torch.no_grad():
            for x, p, w, idx, mask in records:
                for t in range(x.shape[0]):
                    if not mask[t]:
                        continue
                    n += 1
                    one = torch.ones(1, 1, dtype=x.dtype)
                    fs = [
                        experts_forward(adapter.name, experts, x[t : t + 1], torch.tensor([[e]]), one)
                        .reshape(-1)
                        .double()
                        for e in range(E)
                    ]
                    stacked = torch.stack(fs)  # [E, H], this token only
                    acc["gram"] += stacked @ stacked.T
                    acc["sum_out"] += stacked
                    acc["gram_p"] += torch.outer(p[t].double(), p[t].double())
                    acc["sum_xx"] += torch.outer(x[t].double(), x[t].double())
                    for i in range(E):
                        acc["sum_p"][i] += float(p[t, i])
                        acc["sum_sq"][i] += float(fs[i] @ fs[i])
                    for j in range(idx.shape[1]):
                        e = int(idx[t, j])
                        norm = float(fs[e].norm())
                        acc["count"][e] += 1
                        acc["sum_p_sel"][e] += float(p[t, e])
                        acc["sum_norm_sel"][e] += norm
                        acc["sum_gnorm_sel"][e] += float(w[t, j]) * norm
                        acc["sum_pnorm_sel"][e] += float(p[t, e]) * norm
                        acc["max_norm_sel"][e] = max(float(acc["max_norm_sel"][e]), norm)
        out[layer] = {"n_tokens": n, **acc}
    return out


ROUTER_FIELDS = (
    "sum_p",
    "sum_p_sel",
    "sum_gnorm_sel",
    "sum_pnorm_sel",
    "gram_p",
)  # sums of the router's p or weights


def act_rtol(dtype: torch.dtype) -> float:
    """Relative tolerance against experts that evaluate their activation in `dtype` (a few ulps, summed)."""
    return 64 * torch.finfo(dtype).eps


def assert_stats_close(got, want, rtol: float, router_rtol: float | None = None) -> None:
    """Every statistic within rtol (relative to its largest entry); those summing the router's p or
    weights within router_rtol when given (a router that computes in a lower precision than the model)."""
    assert sorted(got) == sorted(want)
    for layer in want:
        g, w = got[layer], want[layer]
        w = w if isinstance(w, dict) else {"n_tokens": w.n_tokens, **{f: getattr(w, f) for f in STAT_FIELDS}}
        assert g.n_tokens == w["n_tokens"]
        for name in STAT_FIELDS:
            a, b = getattr(g, name).cpu(), w[name]
            assert a.dtype == torch.float64 and a.shape == b.shape, name
            tol = router_rtol if router_rtol is not None and name in ROUTER_FIELDS else rtol
            torch.testing.assert_close(a, b, rtol=tol, atol=tol * float(b.abs().max()), msg=name)


def router_eps(model, adapter, batches) -> float:
    """Machine epsilon of the router decision's dtype (DeepSeek routers compute in float32 whatever
    the model's dtype: their p and weights carry float32 rounding)."""
    records = _capture(model, adapter, batches[:1])
    p, w = records[adapter.moe_layers(model)[0]][0][1:3]
    return max(torch.finfo(p.dtype).eps, torch.finfo(w.dtype).eps)


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_stats_equal_naive_per_expert_loop(family):
    model = tiny_model(family)
    adapter = get_adapter(model)
    batches = padded_batches()
    stats = collect_stats(model, adapter, batches, chunk_tokens=5)
    assert sorted(stats) == sorted(adapter.moe_layers(model))
    act = CASES[
        family
    ].act_dtype  # the naive loop runs the experts module, rounding as its activation dtype does
    assert_stats_close(
        stats, naive_stats(model, adapter, batches), rtol=1e-9 if act is None else act_rtol(act)
    )
    n_real = int(sum(m.sum() for _, m in batches))
    k = adapter.top_k(model)
    for st in stats.values():
        assert st.n_tokens == n_real
        assert float(st.count.sum()) == k * n_real  # every real token picks exactly k experts
        torch.testing.assert_close(float(st.sum_p.sum()), float(n_real), rtol=1e-6, atol=0)  # Σ_e p_e = 1
        assert torch.equal(st.gram.diagonal(), st.sum_sq)  # exact: Σ‖f‖² adds the Gram diagonal's own values
        torch.testing.assert_close(st.gram, st.gram.T, rtol=1e-12, atol=0)
        assert float(torch.linalg.eigvalsh(st.gram).min()) > -1e-9 * float(st.gram.diagonal().max())
        assert (st.sum_p_sel <= st.sum_p + 1e-12).all() and (st.sum_norm_sel > 0).any()
        # per routed token max ≤ sum, mean ≤ max
        routed = st.count > 0
        assert (st.max_norm_sel <= st.sum_norm_sel + 1e-12).all() and bool(
            (st.max_norm_sel[~routed] == 0).all()
        )
        assert (st.sum_norm_sel[routed] / st.count[routed] <= st.max_norm_sel[routed] * (1 + 1e-12)).all()
        # p·‖f‖ and g·‖f‖ agree iff the gate is the plain softmax p (no renormalization, no scale; PhiMoE's
        # SparseMixer weights are softmaxes over masked sets, and Llama-4's the chosen logits' sigmoid, not p)
        g_is_p = (
            CASES[family].router not in ("sparsemixer", "topk_sigmoid")
            and not adapter.renormalized(model)
            and adapter.routed_scaling(model) == 1.0
        )
        assert torch.allclose(st.sum_pnorm_sel, st.sum_gnorm_sel, rtol=1e-6) == g_is_p


@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_model_matches_naive_loop(family):
    """The production dtype: expert matmuls in fp32, sums in float64."""
    model = tiny_model(family, dtype=torch.float32)
    adapter = get_adapter(model)
    batches = padded_batches(seed=3)
    stats = collect_stats(model, adapter, batches, chunk_tokens=7)
    assert_stats_close(stats, naive_stats(model, adapter, batches), rtol=2e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_padding_is_excluded(family):
    model = tiny_model(family, seed=2)
    adapter = get_adapter(model)
    batches = padded_batches(seed=4)
    unpadded = [
        (ids[r : r + 1, : int(mask[r].sum())], torch.ones(1, int(mask[r].sum()), dtype=mask.dtype))
        for ids, mask in batches
        for r in range(ids.shape[0])
    ]
    padded = collect_stats(model, adapter, batches, chunk_tokens=4)
    plain = collect_stats(model, adapter, unpadded, chunk_tokens=4)
    # padded and unpadded forwards differ in the last bits of the hidden states; a float32 router
    # (DeepSeek) may then round p and its weights one float32 ulp apart; attention computed in float32 (Flint)
    # puts those last bits at float32's
    attn = CASES[family].attn_dtype or CASES[family].act_dtype
    rtol = 1e-9 if attn is None else 4 * torch.finfo(attn).eps
    assert_stats_close(
        padded, plain, rtol=rtol, router_rtol=max(rtol, 4 * router_eps(model, adapter, batches))
    )
    # the padding really was there: counting it would change the sums
    all_ones = [(ids, torch.ones_like(m)) for ids, m in batches]
    with_pad = collect_stats(model, adapter, all_ones, chunk_tokens=4)
    layer = adapter.moe_layers(model)[0]
    assert with_pad[layer].n_tokens > padded[layer].n_tokens
    assert not torch.allclose(with_pad[layer].sum_sq, padded[layer].sum_sq)


@pytest.mark.parametrize("family", FAMILIES)
def test_what_the_padding_holds_does_not_reach_the_statistics(family):
    """The exclusion itself, free of the attention's rounding: the same padded shapes with other token ids in
    the padding give the same statistics. (Padded vs unpadded above also compares attention over rows of other
    lengths, whose float32 softmax sums round by the CPU's SIMD width.) Only the expert matmuls may group the
    routed tokens differently, hence float64 rounding, or the model's own lower-precision activations."""
    model = tiny_model(family, seed=2)
    adapter = get_adapter(model)
    batches = padded_batches(seed=4)
    g = torch.Generator().manual_seed(9)
    other = [
        (torch.where(m.bool(), ids, torch.randint(3, V, ids.shape, generator=g)), m) for ids, m in batches
    ]
    assert not all(torch.equal(a[0], b[0]) for a, b in zip(batches, other, strict=True))  # exact: integer ids
    act = CASES[family].act_dtype
    rtol = 1e-12 if act is None else 4 * torch.finfo(act).eps
    assert_stats_close(
        collect_stats(model, adapter, other, chunk_tokens=4),
        collect_stats(model, adapter, batches, chunk_tokens=4),
        rtol=rtol,
        router_rtol=max(rtol, 4 * router_eps(model, adapter, batches)),
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_chunk_size_does_not_change_results(family):
    model = tiny_model(family, seed=5)
    adapter = get_adapter(model)
    batches = padded_batches(seed=6)
    ref = collect_stats(model, adapter, batches, chunk_tokens=10**6)
    for chunk in (1, 3, 7):
        assert_stats_close(collect_stats(model, adapter, batches, chunk_tokens=chunk), ref, rtol=1e-12)


@pytest.mark.parametrize("family", FAMILIES)
def test_hook_reads_the_real_decision(family):
    """Σ_j w_tj f_{i_tj}(x_t) from the hooked input and decision rebuilds the experts' real output."""
    model = tiny_model(family, seed=7)
    adapter = get_adapter(model)
    layer = adapter.moe_layers(model)[-1]
    router = adapter.router_module(model, layer)
    block = _block_of(model, router)
    got: dict[str, object] = {}
    hooks = [
        *adapter.hook_routing(model, layer, lambda x, p, w, idx: got.update(x=x, dec=(p, w, idx))),
        block.experts.register_forward_hook(lambda m, a, o: got.update(experts=o)),
        block.register_forward_hook(lambda m, a, o: got.update(block=o[0] if isinstance(o, tuple) else o)),
    ]
    ids, mask = padded_batches(seed=8)[0]
    try:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    x = got["x"].reshape(-1, got["x"].shape[-1])
    p, w, idx = got["dec"]
    f = all_expert_outputs(adapter.expert_weights(model, layer), x)  # [E, T, H]
    tok = torch.arange(x.shape[0])[:, None]
    rebuilt = (w.to(f.dtype)[..., None] * f[idx, tok]).sum(1)
    experts_out = got["experts"]
    if CASES[adapter.name].block_scaled:  # the block scales the experts' sum; the decision's weights carry it
        experts_out = experts_out * routed_scale(adapter.name, model)
    if CASES[
        adapter.name
    ].input_scaled:  # Llama-4: Σ_j f_j(w_j x); its experts module returns [E·T, H] unsummed
        ew = adapter.expert_weights(model, layer)
        rebuilt = torch.stack(
            [
                sum(
                    all_expert_outputs(ew, w[t, j] * x[t : t + 1])[int(idx[t, j]), 0]
                    for j in range(idx.shape[1])
                )
                for t in range(x.shape[0])
            ]
        )
        experts_out = experts_out.reshape(-1, *rebuilt.shape).sum(0)
    act = CASES[adapter.name].act_dtype  # Beam's experts round act(gate)·up to float32
    rtol, atol = (
        (1e-10, 1e-12) if act is None else (act_rtol(act), act_rtol(act) * float(rebuilt.abs().max()))
    )
    torch.testing.assert_close(rebuilt, experts_out.reshape(rebuilt.shape), rtol=rtol, atol=atol)
    if adapter.shared_ffn(model, layer) is None:
        torch.testing.assert_close(rebuilt, got["block"].reshape(rebuilt.shape), rtol=rtol, atol=atol)
    assert p.shape == (x.shape[0], adapter.num_experts(model))
    # Σ_e p_e = 1 at the precision p is computed in (float32 for DeepSeek's routers)
    torch.testing.assert_close(p.sum(-1), torch.ones(x.shape[0], dtype=p.dtype))


def test_save_load_round_trip_is_exact(tmp_path):
    model = tiny_model("qwen3_moe", seed=9)
    adapter = get_adapter(model)
    stats = collect_stats(model, adapter, padded_batches(seed=10), chunk_tokens=8)
    path = tmp_path / "sub" / "stats.safetensors"
    save_stats(stats, path, metadata={"teacher": "tiny"})
    back = load_stats(path)
    assert sorted(back) == sorted(stats)
    for layer, st in stats.items():
        assert back[layer].n_tokens == st.n_tokens
        for name in STAT_FIELDS:
            a, b = getattr(back[layer], name), getattr(st, name)
            assert a.dtype == b.dtype and torch.equal(a, b), name  # exact: safetensors stores the bytes
    meta = stats_metadata(path)
    assert meta["teacher"] == "tiny" and meta["layers"] == ",".join(map(str, sorted(stats)))


def test_loading_stats_without_the_pruning_sums_says_recompute(tmp_path):
    """A file written before sum_pnorm_sel / max_norm_sel existed: a one-line error, not a KeyError."""
    from safetensors.torch import load_file, save_file

    model = tiny_model("olmoe", seed=9)
    path = tmp_path / "stats.safetensors"
    save_stats(collect_stats(model, get_adapter(model), padded_batches(seed=10), chunk_tokens=8), path)
    old = {k: v for k, v in load_file(str(path)).items() if not k.endswith(("sum_pnorm_sel", "max_norm_sel"))}
    save_file(old, str(tmp_path / "old.safetensors"), metadata={"format": "moesweep.layerstats/1"})
    with pytest.raises(ValueError, match="recompute the calibration statistics") as e:
        load_stats(tmp_path / "old.safetensors")
    assert "\n" not in str(e.value) and "sum_pnorm_sel, max_norm_sel" in str(e.value)


def test_hooks_removed_and_mode_restored_on_error():
    model = tiny_model("qwen3_moe", seed=11).train()
    adapter = get_adapter(model)
    seen = []

    def progress(done, total):
        seen.append((done, total))
        raise RuntimeError("stop")

    with pytest.raises(RuntimeError, match="stop"):
        collect_stats(model, adapter, padded_batches(), chunk_tokens=4, progress=progress)
    assert seen == [(1, 2)]
    assert model.training
    assert all(not adapter.router_module(model, layer)._forward_hooks for layer in adapter.moe_layers(model))


def test_bad_input():
    model = tiny_model("qwen3_moe")
    adapter = get_adapter(model)
    with pytest.raises(ValueError, match="chunk_tokens"):
        collect_stats(model, adapter, padded_batches(), chunk_tokens=0)
    with pytest.raises(ValueError, match="batches"):
        collect_stats(model, adapter, [], chunk_tokens=4)
    ids, mask = padded_batches()[0]
    with pytest.raises(ValueError, match="mask"):
        collect_stats(model, adapter, [(ids, mask[:, :3])], chunk_tokens=4)
    with pytest.raises(ValueError, match="empty"):
        save_stats({}, "/tmp/never-written.safetensors")
