"""Tiny, seeded teachers of every supported MoE family (transformers 5.x), shared by the family,
calibration, conversion and teacher-shape tests.

Each family's config exercises what makes it special: Qwen3-MoE a dense first layer narrower than
k·I (`mlp_only_layers`), Qwen2-MoE its sigmoid-gated shared expert, DeepSeek-V2/V3 a dense first
layer (`first_k_dense_replace`), one shared expert, group-limited routing and a routed scaling factor
(V3: sigmoid router with a correction bias), GPT-OSS its biased router and biased clamped-SwiGLU experts.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from workers.types import LayerPlan

FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v2", "deepseek_v3", "gpt_oss"]
V = 256  # vocabulary of every tiny teacher
H = 32  # hidden size of every tiny teacher
COMMON = dict(vocab_size=V, hidden_size=H, num_attention_heads=4, max_position_embeddings=64,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)


def tiny_config(family: str, **overrides: Any):
    """The family's tiny config; `overrides` replace any of its fields."""
    import transformers as tf

    if family == "qwen3_moe":  # layer 0 dense (narrower than k·I: zero-padded)
        kw = dict(num_key_value_heads=2, intermediate_size=24, moe_intermediate_size=16, num_hidden_layers=3,
                  num_experts=6, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0])
        return tf.Qwen3MoeConfig(**{**COMMON, **kw, **overrides})
    if family == "qwen2_moe":
        kw = dict(num_key_value_heads=2, intermediate_size=24, moe_intermediate_size=16,
                  shared_expert_intermediate_size=24, num_hidden_layers=2, num_experts=6, num_experts_per_tok=2,
                  norm_topk_prob=False)
        return tf.Qwen2MoeConfig(**{**COMMON, **kw, **overrides})
    if family == "mixtral":
        kw = dict(num_key_value_heads=2, intermediate_size=16, num_hidden_layers=2, num_local_experts=6,
                  num_experts_per_tok=2)
        return tf.MixtralConfig(**{**COMMON, **kw, **overrides})
    if family == "olmoe":
        kw = dict(num_key_value_heads=2, intermediate_size=16, num_hidden_layers=2, num_experts=6,
                  num_experts_per_tok=2, norm_topk_prob=False)
        return tf.OlmoeConfig(**{**COMMON, **kw, **overrides})
    mla = dict(num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
               qk_nope_head_dim=8, v_head_dim=8, num_hidden_layers=3, first_k_dense_replace=1,
               intermediate_size=40, moe_intermediate_size=16, n_routed_experts=8, n_shared_experts=1,
               num_experts_per_tok=2, n_group=2, topk_group=1)
    if family == "deepseek_v2":
        kw = dict(mla, topk_method="group_limited_greedy", routed_scaling_factor=1.5)
        return tf.DeepseekV2Config(**{**COMMON, **kw, **overrides})
    if family == "deepseek_v3":
        kw = dict(mla, norm_topk_prob=True, routed_scaling_factor=2.5)
        return tf.DeepseekV3Config(**{**COMMON, **kw, **overrides})
    if family == "gpt_oss":
        kw = dict(num_key_value_heads=2, head_dim=8, intermediate_size=16, num_hidden_layers=2, num_local_experts=6,
                  num_experts_per_tok=2, sliding_window=4, layer_types=["sliding_attention", "full_attention"])
        return tf.GptOssConfig(**{**COMMON, **kw, **overrides})
    raise ValueError(f"no tiny config for family {family!r}")


def make_teacher(family: str, seed: int = 0, dtype: torch.dtype | None = None,
                 experts_implementation: str | None = None, **overrides: Any) -> nn.Module:
    """A tiny random teacher in eval mode, with weights large enough that routing, clamps and biases
    all matter (norms and attention sinks in [0.5, 1.5], DeepSeek-V3's correction bias non-zero)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    kw = {} if experts_implementation is None else {"experts_implementation": experts_implementation}
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides), **kw).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "sinks" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.25)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    return model if dtype is None else model.to(dtype)


def router_of(family: str, block: nn.Module) -> nn.Module:
    """The router module of a family's MoE block (written out, not asked of the adapter)."""
    return block.router if family == "gpt_oss" else block.gate


def routed_scale(family: str, teacher: nn.Module) -> float:
    """The constant DeepSeek's routers multiply into their weights (1 elsewhere)."""
    return float(teacher.config.routed_scaling_factor) if family.startswith("deepseek") else 1.0


def hand_plans(adapter, teacher: nn.Module, merged: bool) -> list[LayerPlan]:
    """One plan per MoE layer, k = 2 groups: merged (K = 4, two experts per group, unequal merge
    weights) or singletons (K = k)."""
    e = adapter.num_experts(teacher)
    out = []
    for i, layer in enumerate(adapter.moe_layers(teacher)):
        if merged:
            groups = [[(i + 1) % e, e - 1], [(i + 3) % e, 0]]
            mw = [[0.3, 0.7], [0.6, 0.4]]
        else:
            groups, mw = [[e - 1 - i], [i]], [[1.0], [1.0]]
        sel = [x for g in groups for x in g]
        out.append(LayerPlan(layer=layer, selected=sel, scores=[1.0] * e, groups=groups, merge_weights=mw,
                             alpha=[0.7, 0.45]))
    return out


def ids(n: int = 2, t: int = 12, seed: int = 1) -> torch.Tensor:
    """[n, t] random token ids (no special tokens)."""
    return torch.randint(3, V, (n, t), generator=torch.Generator().manual_seed(seed))
