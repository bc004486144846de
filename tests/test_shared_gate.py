"""The per-token shared-expert gate (Qwen2-MoE: σ(w·h) · shared_expert(h)): calibration records its sum,
the dense student takes its mean as the shared expert's static scale (`shared_gate_scales`)."""

from __future__ import annotations

import pytest
import torch
from families_cases import V, hand_plans, make_teacher

from workers.calibration.calibrate import collect_stats, load_stats, mix_stats, save_stats
from workers.families import get_adapter
from workers.families.base import SHARED_GATE_DEFAULT, shared_gate_scales
from workers.methods.merge import ffn_forward
from workers.models.convert import plan_ffns


def batches(seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (2, 2, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[0, 0, 5:] = 0
    ids[mask == 0] = 0
    return [(ids[0], mask[0]), (ids[1], mask[1])]


def naive_gate_sums(model, data) -> dict[int, float]:
    """Σ over real tokens of σ(shared_expert_gate · h), h the block's input, written out here."""
    sums: dict[int, float] = {}
    cur: dict[str, torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):

        def pre(m, args, i=i):
            h = args[0].reshape(-1, args[0].shape[-1])[cur["mask"]]
            sums[i] = sums.get(i, 0.0) + float(
                torch.sigmoid(h @ m.shared_expert_gate.weight.T).double().sum()
            )

        hooks.append(layer.mlp.register_forward_pre_hook(pre))
    with torch.no_grad():
        for ids, mask in data:
            cur["mask"] = mask.reshape(-1).bool()
            model(input_ids=ids, attention_mask=mask, use_cache=False)
    for h in hooks:
        h.remove()
    return sums


def test_calibration_records_the_gate_sum():
    model = make_teacher("qwen2_moe", dtype=torch.float64, experts_implementation="eager")
    adapter = get_adapter(model)
    data = batches()
    stats = collect_stats(model, adapter, data, chunk_tokens=5)
    want = naive_gate_sums(model, data)
    for layer, st in stats.items():
        assert st.sum_shared_gate.shape == (1,)
        torch.testing.assert_close(float(st.sum_shared_gate), want[layer], rtol=1e-12, atol=0)
        assert 0 < float(st.sum_shared_gate) < st.n_tokens  # a real gate: strictly inside (0, 1) per token


def test_ungated_families_record_none_and_scale_one():
    model = make_teacher("deepseek_v3")
    stats = collect_stats(model, get_adapter(model), batches(), chunk_tokens=8)
    assert all(st.sum_shared_gate is None for st in stats.values())
    assert shared_gate_scales(stats, "mean") == {layer: 1.0 for layer in stats}


def test_save_load_and_mix_keep_the_statistic(tmp_path):
    model = make_teacher("qwen2_moe", dtype=torch.float64, experts_implementation="eager")
    adapter = get_adapter(model)
    a = collect_stats(model, adapter, batches(1), chunk_tokens=8)
    b = collect_stats(model, adapter, batches(2), chunk_tokens=8)
    save_stats(a, tmp_path / "a.safetensors")
    back = load_stats(tmp_path / "a.safetensors")
    # exact: a safetensors round trip copies bytes
    assert all(torch.equal(back[layer].sum_shared_gate, st.sum_shared_gate) for layer, st in a.items())
    mixed = mix_stats({"a": a, "b": b}, {"a": 1.0, "b": 1.0})
    for layer in a:  # equal weights: the mean gate of the mixture is the mean of the sources' means
        mean = float(mixed[layer].sum_shared_gate) / mixed[layer].n_tokens
        parts = [float(s[layer].sum_shared_gate) / s[layer].n_tokens for s in (a, b)]
        assert mean == pytest.approx(sum(parts) / 2, rel=1e-12)


def test_student_uses_the_gate_mean_as_the_static_scale():
    model = make_teacher("qwen2_moe")
    adapter = get_adapter(model)
    stats = collect_stats(model, adapter, batches(), chunk_tokens=8)
    assert SHARED_GATE_DEFAULT == "one" and set(shared_gate_scales(stats).values()) == {1.0}
    scales = shared_gate_scales(stats, "mean")
    assert all(0 < s < 1 for s in scales.values())
    plans = hand_plans(adapter, model, merged=True)
    ffns = plan_ffns(model, adapter, plans)
    student = adapter.build_student(model, ffns, share_weights=True, shared_scale=scales)
    h = torch.randn(7, model.config.hidden_size)
    with torch.no_grad():
        for pl in plans:
            block = model.model.layers[pl.layer].mlp
            want = ffn_forward(ffns[pl.layer], h) + scales[pl.layer] * block.shared_expert(h)
            got = student.model.layers[pl.layer].mlp(h[None])[0]
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_bad_rule_is_a_one_line_error():
    with pytest.raises(ValueError, match="allowed: one, mean") as e:
        shared_gate_scales({}, "median")
    assert "\n" not in str(e.value)


def test_the_shared_gate_setting_reaches_the_dense_student():
    """`settings: {dense: {shared_gate: mean}}`: convert puts each layer's gate mean in its plan, the dense
    student scales its shared expert by it; the default (`one`) leaves plans and students as before."""
    from workers.models.convert import layer_contexts
    from workers.models.outputs import convert_plans, dense_student

    model = make_teacher("qwen2_moe", dtype=torch.float64, experts_implementation="eager")
    adapter = get_adapter(model)
    stats = collect_stats(model, adapter, batches(), chunk_tokens=5)
    contexts = layer_contexts(model, adapter, stats)
    base = {"scoring": "SF", "grouping": "RR", "dp_scaling": "uniform", "K": adapter.top_k(model)}
    plain, _ = convert_plans(contexts, base)
    one, _ = convert_plans(contexts, {**base, "settings": {"shared_gate": "one"}})
    mean, _ = convert_plans(contexts, {**base, "settings": {"shared_gate": "mean"}})
    assert [p.signature() for p in one] == [p.signature() for p in plain]
    scales = shared_gate_scales(stats, "mean")
    assert {p.layer: p.extras["student"]["shared_scale"] for p in mean} == scales
    ids = batches()[0][0]
    with torch.no_grad():
        a = dense_student(model, adapter, plain, share_weights=False)(input_ids=ids).logits
        b = dense_student(model, adapter, mean, share_weights=False)(input_ids=ids).logits
    assert not torch.allclose(a, b)
    with pytest.raises(ValueError, match="shared_gate='max'; allowed: one, mean"):
        convert_plans(contexts, {**base, "settings": {"shared_gate": "max"}})
