"""The per-family test records themselves (tests/families_cases.py): each is plain data that builds its config
with no per-family code, and its stated facts are the ones that config holds, so a new family's record is checked
before the adapter tests read it."""

from __future__ import annotations

import pytest
import transformers
from families_cases import CASES, COMMON, FAMILIES, cfg_get, tiny_config

PLAIN = (int, float, str, bool, type(None))


def plain(value: object) -> bool:
    """Numbers, strings, booleans, None, and lists / string-keyed dicts of them."""
    if isinstance(value, list):
        return all(plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and plain(v) for k, v in value.items())
    return isinstance(value, PLAIN)


@pytest.mark.parametrize("family", FAMILIES)
def test_record_is_plain_data_and_states_what_its_config_holds(family):
    case = CASES[family]
    assert all(plain(v) for v in case.config.values()), case.config
    config = tiny_config(family)
    assert type(config) is getattr(transformers, case.config_class)
    if case.with_common:
        assert {k: getattr(config, k) for k in COMMON} == COMMON
    assert cfg_get(config, case.experts_key) == case.experts
    assert cfg_get(config, case.topk_key) == case.top_k
    assert max(case.moe_layers) < config.num_hidden_layers and len(case.moe_layers) >= 2
    if case.scaled:
        assert float(cfg_get(config, case.scale_key)) not in (0.0, 1.0)  # the factor really engages
    if case.student:
        assert isinstance(getattr(transformers, case.student), type)


def test_unknown_family_is_a_one_line_error():
    with pytest.raises(ValueError) as err:
        tiny_config("no_such_moe")
    msg = str(err.value)
    assert "\n" not in msg and "'no_such_moe'" in msg and "qwen3_moe" in msg


def test_overrides_replace_fields_and_update_sub_configs():
    config = tiny_config("mixtral", num_experts_per_tok=1, vocab_size=300)
    assert (config.num_experts_per_tok, config.vocab_size, config.num_local_experts) == (1, 300, 6)
    dbrx = tiny_config("dbrx", ffn_config={"moe_top_k": 1})  # the rest of ffn_config stays the record's
    assert (dbrx.ffn_config.moe_top_k, dbrx.ffn_config.moe_num_experts, dbrx.ffn_config.ffn_hidden_size) == (
        1,
        6,
        16,
    )
    assert CASES["dbrx"].config["ffn_config"]["moe_top_k"] == 2


def test_built_configs_share_no_state_with_the_records():
    first = tiny_config("laguna")
    first.layer_types.append("full_attention")
    first.num_attention_heads_per_layer[0] = 99
    first.mlp_layer_types[0] = "sparse"  # a list several records spread
    again = tiny_config("laguna")
    assert again.layer_types == ["full_attention", "sliding_attention", "full_attention"]
    assert again.num_attention_heads_per_layer == [4, 2, 4]
    assert CASES["laguna"].config["num_attention_heads_per_layer"] == [4, 2, 4]
    assert tiny_config("beam").mlp_layer_types == ["dense", "sparse", "sparse"]
