"""The teacher's routed-MoE shape from its config alone (workers.families.teacher_shape) against what
the family adapter reports on the model built from the same config, for every family and for config
variants that move each field (renormalization flag, dense layers, shared experts, E, k)."""

from __future__ import annotations

from types import SimpleNamespace
from unittest import mock

import pytest
import torch
import transformers
from families_cases import FAMILIES, ids, make_teacher, routed_scale, tiny_config

from workers.core.shape import TeacherShape
from workers.families import ADAPTERS, adapter_for_config, get_adapter, teacher_shape

# (family, config overrides): every family as the shared fixture builds it, then variants
CASES = [(f, {}) for f in FAMILIES] + [
    (
        "qwen3_moe",
        {"norm_topk_prob": False, "mlp_only_layers": [], "decoder_sparse_step": 2, "num_hidden_layers": 4},
    ),
    ("qwen2_moe", {"norm_topk_prob": True, "mlp_only_layers": [1], "num_hidden_layers": 3}),
    ("olmoe", {"norm_topk_prob": True, "num_experts": 5, "num_experts_per_tok": 3}),
    ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 1}),
    (
        "deepseek_v2",
        {"norm_topk_prob": True, "n_shared_experts": 2, "first_k_dense_replace": 2, "topk_method": "greedy"},
    ),
    ("deepseek_v3", {"norm_topk_prob": False, "n_shared_experts": 2, "first_k_dense_replace": 0}),
    ("gpt_oss", {"num_local_experts": 5, "num_experts_per_tok": 3}),
    (
        "dbrx",
        {
            "ffn_config": {"moe_num_experts": 5, "moe_top_k": 3, "moe_normalize_expert_weights": None},
            "n_layers": 3,
        },
    ),
    ("solar_open", {"norm_topk_prob": False, "n_shared_experts": 2, "num_experts_per_tok": 3}),
    ("mimo_v2_flash", {"norm_topk_prob": False, "mlp_layer_types": ["sparse", "sparse", "dense"]}),
    (
        "hy_v3",
        {"num_shared_experts": 2, "mlp_layer_types": ["sparse", "dense", "sparse"], "num_experts_per_tok": 3},
    ),
    ("flint", {"norm_topk_prob": False, "mlp_only_layers": [2], "shared_expert_intermediate_size": 0}),
    ("aria_text", {"moe_num_shared_experts": 2, "moe_num_experts": 5, "moe_topk": 3}),
]


def case_id(case) -> str:
    family, over = case
    return family + ("-" + "-".join(f"{k}={v}" for k, v in over.items()) if over else "")


def built_shape(family: str, model, adapter) -> TeacherShape:
    """The shape as the adapter sees it on the built model; renormalization as calibration meets it:
    the router's applied weights (hook_routing, as collect_stats reads them) divided by the
    routed scaling sum to 1 on every token iff the router renormalizes."""
    layers = adapter.moe_layers(model)
    decisions = []
    handles = adapter.hook_routing(model, layers[0], lambda x, p, w, idx: decisions.append((p, w, idx)))
    try:
        with torch.no_grad():
            model(ids())
    finally:
        for handle in handles:
            handle.remove()
    p, w, idx = decisions[0]
    k = adapter.top_k(model)
    assert idx.shape[1] == w.shape[1] == k  # the top_k the router really used
    sums = w.double().sum(-1) / routed_scale(family, model)
    renorm = bool(torch.allclose(sums, torch.ones_like(sums), rtol=0, atol=1e-5))
    assert renorm == adapter.renormalized(model)
    if not renorm:
        assert bool(((sums - 1).abs() > 1e-3).all())  # no token's weights happen to sum to 1
    return TeacherShape(
        family=adapter.name,
        model_type=model.config.model_type,
        num_experts=adapter.expert_weights(model, layers[0]).num_experts,
        top_k=k,
        renormalize=renorm,
        shared_experts=adapter.num_shared_experts(model),
        moe_layers=len(layers),
    )


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_shape_from_config_equals_the_built_model(case):
    family, over = case
    config = tiny_config(family, **over)
    with mock.patch.object(
        transformers.AutoModelForCausalLM,
        "from_config",
        side_effect=AssertionError("teacher_shape built a model"),
    ):
        shape = teacher_shape(config)
    model = make_teacher(family, **over)
    assert shape == built_shape(family, model, get_adapter(model))
    assert adapter_for_config(config) is get_adapter(model)


def test_variants_move_every_field():
    """The variants really change each field against the family's base config (else the equality
    above would not show the config is read)."""
    base = {f: teacher_shape(tiny_config(f)) for f in FAMILIES}
    moved = {name: False for name in ("num_experts", "top_k", "renormalize", "shared_experts", "moe_layers")}
    for family, over in CASES[len(FAMILIES) :]:
        shape = teacher_shape(tiny_config(family, **over))
        for name in moved:
            moved[name] |= getattr(shape, name) != getattr(base[family], name)
    assert all(moved.values()), moved
    assert {s.renormalize for s in base.values()} == {True, False}
    assert {s.shared_experts for s in base.values()} == {0, 1}


def test_plain_attribute_object_no_torch_model():
    """Only attributes are read: a plain namespace with a supported model_type is enough."""
    cfg = SimpleNamespace(
        model_type="deepseek_v3",
        num_hidden_layers=61,
        first_k_dense_replace=3,
        n_routed_experts=256,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        n_shared_experts=1,
    )
    assert teacher_shape(cfg) == TeacherShape(
        family="deepseek_v3",
        model_type="deepseek_v3",
        num_experts=256,
        top_k=8,
        renormalize=True,
        shared_experts=1,
        moe_layers=58,
    )


def test_shape_from_a_saved_config(tmp_path):
    """AutoConfig.from_pretrained of a saved config.json (what a sweep points at) gives the same shape."""
    for family in FAMILIES:
        tiny_config(family).save_pretrained(tmp_path / family)
        loaded = transformers.AutoConfig.from_pretrained(tmp_path / family)
        assert teacher_shape(loaded) == teacher_shape(tiny_config(family)), family


def test_unknown_model_type_and_bad_configs():
    with pytest.raises(ValueError) as err:
        teacher_shape(transformers.LlamaConfig())
    msg = str(err.value)
    assert "\n" not in msg and "'llama'" in msg
    assert all(mt in msg for a in ADAPTERS for mt in a.model_types)
    with pytest.raises(ValueError, match="num_experts_per_tok=None"):
        teacher_shape(transformers.DeepseekV2Config())  # its default k is None: no router can be built
    with pytest.raises(ValueError, match="num_experts_per_tok=7"):
        teacher_shape(tiny_config("mixtral", num_experts_per_tok=7))  # k > E
    with pytest.raises(ValueError, match="no routed MoE layer"):
        teacher_shape(tiny_config("qwen3_moe", mlp_only_layers=[0, 1, 2]))
    with pytest.raises(ValueError, match="handles"):
        get_adapter(make_teacher("mixtral")).shape_from_config(tiny_config("olmoe"))


@pytest.mark.parametrize("k", [1, 3])
def test_phimoe_refuses_a_k_sparsemixer_does_not_route(k):
    """PhiMoE's SparseMixer routes two experts whatever num_experts_per_tok says: the built model really does,
    and the config (and the adapter on the built model) is a one-line error naming the field."""
    model = make_teacher("phimoe", num_experts_per_tok=k)
    seen = []
    handle = model.model.layers[0].mlp.router.register_forward_hook(lambda m, i, o: seen.append(o[2]))
    with torch.no_grad():
        model(ids())
    handle.remove()
    assert seen[0].shape[1] == 2
    for call in (
        lambda: teacher_shape(tiny_config("phimoe", num_experts_per_tok=k)),
        lambda: get_adapter(model).top_k(model),
    ):
        with pytest.raises(ValueError, match=f"num_experts_per_tok={k}; SparseMixer always routes 2") as err:
            call()
        assert "\n" not in str(err.value)


def test_a_multimodal_aria_config_is_one_line_naming_its_text_model():
    """model_type aria (AriaForConditionalGeneration) is left out on purpose: its text model, aria_text, is the
    supported teacher."""
    config = transformers.AriaConfig(text_config=tiny_config("aria_text").to_dict())
    with pytest.raises(ValueError) as err:
        teacher_shape(config)
    assert str(err.value) == (
        "model_type='aria' is the multimodal AriaForConditionalGeneration: convert its text "
        "model (model_type aria_text, AriaTextForCausalLM built from config.text_config) "
        "instead"
    )
    assert teacher_shape(config.text_config).family == "aria_text"
