"""Tiny, seeded teachers of every supported MoE family (transformers 5.x), shared by the family,
calibration, conversion and teacher-shape tests.

Each family's config exercises what makes it special: Qwen3-MoE a dense first layer narrower than
k·I (`mlp_only_layers`), Qwen2-MoE its sigmoid-gated shared expert, DeepSeek-V2/V3 a dense first
layer (`first_k_dense_replace`), one shared expert, group-limited routing and a routed scaling factor
(V3: sigmoid router with a correction bias), GPT-OSS its biased router and biased clamped-SwiGLU experts,
GLM-4-MoE / dots1 the V3 router (group-limited, scaled; GLM-4 with a dense first layer, dots1 without
renormalization), MiniMax-M2 a sigmoid router whose correction bias lives on the block, FlexOlmo OLMoE's
router in OLMo-2's post-norm layer, the Granite MoE families their block at `block_sparse_moe`, multipliers
and (granitemoeshared, granitemoe_swa) a shared MLP on the decoder layer (tests reach a teacher's blocks and
shared experts through block_of / shared_of, not `layer.mlp`).

`CASES` states each family's semantics for the tests' independent reference math (written per router
kind, not per family): adding a family is one tiny config and one Case.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from workers.core.types import LayerPlan


@dataclass(frozen=True)
class Case:
    """What the tiny teacher of a family is, written out independently of the adapters."""

    moe_layers: tuple[int, ...]
    experts: int
    top_k: int
    experts_key: (
        str  # config field with the routed expert count (DBRX: ffn_config.moe_num_experts, see cfg_get)
    )
    router: str  # "softmax": top-k of softmax p; "softmax_v2": DeepSeek-V2 (groups by max p, scaled);
    #              "sigmoid": top-k of sigmoid + correction bias, weights the raw sigmoid (DeepSeek-V3 style);
    #              "logits": top-k of biased logits, softmax over the k (GPT-OSS);
    #              "softmax_bias": top-k of softmax p + correction bias, weights p of the k (ERNIE-4.5)
    #              "sparsemixer": PhiMoE's two picks (argmax, then argmax of the rest), each weighted by a softmax
    #              over the logits within a relative threshold of its max (sparsemixer_ref below)
    #              "topk_sigmoid": top-k of the logits, weights the sigmoid of those logits (Llama-4)
    renorm: bool  # weights renormalized over the chosen k
    student: str  # transformers config class of the dense student
    groups: bool = False  # group-limited routing (n_group / topk_group, contiguous groups)
    scaled: bool = False  # routed_scaling_factor multiplies the weights
    block_scaled: bool = False  # (with scaled) the block multiplies the experts module's summed output by the
    #              factor, the router's weights lack it (Laguna); the effective per-expert weight is still w × factor
    shared: str | None = None  # block attribute of the shared experts
    shared_gate: str | None = None  # block attribute of a per-token sigmoid gate of the shared expert
    shared_width: int = 0
    bias_on_block: bool = False  # the correction bias is a buffer of the block, not of the router
    one_expert_student: bool = False  # the student is the same class with one expert and top-1
    all_dense_student: bool = False  # the student is the same class with first_k_dense_replace = n
    block: str = "mlp"  # decoder-layer attribute of the MoE block (Granite: block_sparse_moe)
    router_attr: str = "gate"  # block attribute of the router (GPT-OSS, Granite: router)
    shared_on_layer: bool = False  # `shared` is a decoder-layer attribute, added to the block's output there
    scale_key: str = "routed_scaling_factor"  # config field of the constant factor (where scaled)
    bias_attr: str = "e_score_correction_bias"  # name of a sigmoid router's correction bias
    corrected: bool = (
        True  # a sigmoid router adds a correction bias to its choice (False: Flint, top-k of the
    )
    #              scores alone; correction_bias is then zeros)
    router_dtype: torch.dtype | None = None  # the dtype the modeling code pins the router's linear map to
    #              (HunYuan: float32 in any model dtype; from_pretrained keeps it there, so make_teacher does too)
    softcap_attr: str | None = (
        None  # router attribute with c of a tanh cap on its logits, c·tanh(z / c) where
    )
    #              c > 0 (Laguna: router_logit_softcapping, from the config's moe_router_logit_softcapping)
    attn_dtype: torch.dtype | None = None  # the dtype the modeling code's attention scores are computed in
    act_dtype: torch.dtype | None = (
        None  # the dtype the experts evaluate act(gate)·up in, whatever the model's
    )
    #              (Beam: float32), so a float64 teacher's expert outputs carry that dtype's rounding
    #              whatever the model's dtype (Flint: float32; Laguna: its softplus output gate and its router):
    #              forwards of other shapes differ in its last bits
    input_scaled: bool = False  # the routing weight multiplies the expert's input, f_e(w·x) (Llama-4)
    tuple_out: bool = False  # the MoE block returns (hidden states, router output) (GPT-OSS, Llama-4)
    student_block: str = "mlp"  # decoder-layer attribute of the dense student's FFN
    experts_call: str = "routed"  # the experts module's forward: "routed" (h, indices, weights);
    #              "stacked": Llama-4's, every expert on its own [T, H] slice of an [E·T, H] input
    dense_student: bool = True  # the family writes a dense student (False: refused_outputs holds "dense")
    topk_key: str = "num_experts_per_tok"  # config field of k (a dotted key names a field of a sub-config)
    logits_router: bool = (
        False  # the router module returns the logits alone; the block picks and weights (DBRX)
    )
    width_key: str = (
        "intermediate_size"  # config field of the dense student's FFN width (dotted: a sub-config's)
    )


CASES: dict[str, Case] = {
    "qwen3_moe": Case((1, 2), 6, 2, "num_experts", "softmax", True, "Qwen3Config"),
    "qwen2_moe": Case(
        (0, 1),
        6,
        2,
        "num_experts",
        "softmax",
        False,
        "Qwen2Config",
        shared="shared_expert",
        shared_gate="shared_expert_gate",
        shared_width=24,
    ),
    "mixtral": Case((0, 1), 6, 2, "num_local_experts", "softmax", True, "MistralConfig"),
    "olmoe": Case((0, 1), 6, 2, "num_experts", "softmax", False, "OlmoeConfig", one_expert_student=True),
    "deepseek_v2": Case(
        (1, 2),
        8,
        2,
        "n_routed_experts",
        "softmax_v2",
        False,
        "DeepseekV2Config",
        groups=True,
        scaled=True,
        shared="shared_experts",
        shared_width=16,
        all_dense_student=True,
    ),
    "deepseek_v3": Case(
        (1, 2),
        8,
        2,
        "n_routed_experts",
        "sigmoid",
        True,
        "DeepseekV3Config",
        groups=True,
        scaled=True,
        shared="shared_experts",
        shared_width=16,
        all_dense_student=True,
    ),
    "gpt_oss": Case(
        (0, 1),
        6,
        2,
        "num_local_experts",
        "logits",
        True,
        "GptOssConfig",
        one_expert_student=True,
        tuple_out=True,
    ),
    "glm4_moe": Case(
        (1, 2),
        8,
        2,
        "n_routed_experts",
        "sigmoid",
        True,
        "Glm4MoeConfig",
        groups=True,
        scaled=True,
        shared="shared_experts",
        shared_width=16,
        all_dense_student=True,
    ),
    "dots1": Case(
        (0, 1),
        8,
        2,
        "n_routed_experts",
        "sigmoid",
        True,
        "Dots1Config",
        groups=True,
        scaled=True,
        shared="shared_experts",
        shared_width=16,
        all_dense_student=True,
    ),
    "minimax_m2": Case(
        (0, 1),
        6,
        2,
        "num_local_experts",
        "sigmoid",
        True,
        "MiniMaxM2Config",
        bias_on_block=True,
        one_expert_student=True,
    ),
    "flex_olmo": Case((0, 1), 6, 2, "num_experts", "softmax", True, "Olmo2Config"),
}
# Cohere2-MoE and the Granite MoE families
CASES.update(
    {
        "cohere2_moe": Case(
            (1, 2),
            6,
            2,
            "num_experts",
            "softmax",
            True,
            "Cohere2MoeConfig",
            shared="shared_experts",
            shared_width=16,
        ),
    }
)
# Granite MoE: the block is `block_sparse_moe`, the shared MLP (granitemoeshared, granitemoe_swa) sits on the
# decoder layer; the router's softmax over the top-k logits is p renormalized over the k. GraniteMoeSWA has no SDPA
# path: its eager attention takes the softmax (and the sink's sigmoid) in float32 whatever the model's dtype, and a
# padded row (masked keys at -inf) and the same row unpadded sum their exp values in an order that depends on the
# CPU's SIMD width (the same under AVX-512, float32 ulps apart under AVX2): attn_dtype float32
CASES.update(
    {
        "granitemoe": Case(
            (0, 1),
            6,
            2,
            "num_local_experts",
            "softmax",
            True,
            "GraniteConfig",
            block="block_sparse_moe",
            router_attr="router",
        ),
        "granitemoeshared": Case(
            (0, 1),
            6,
            2,
            "num_local_experts",
            "softmax",
            True,
            "GraniteConfig",
            shared="shared_mlp",
            shared_width=16,
            block="block_sparse_moe",
            router_attr="router",
            shared_on_layer=True,
        ),
        "granitemoe_swa": Case(
            (0, 1),
            6,
            2,
            "num_local_experts",
            "softmax",
            True,
            "GraniteSWAConfig",
            shared="shared_mlp",
            shared_width=16,
            block="block_sparse_moe",
            router_attr="router",
            shared_on_layer=True,
            attn_dtype=torch.float32,
        ),
    }
)
# the V3 router with MoE layers by mlp_layer_types; AFMoE: MiniMax-M2's router × route_scale
CASES.update(
    {
        "glm4_moe_lite": Case(
            (1, 2),
            8,
            2,
            "n_routed_experts",
            "sigmoid",
            True,
            "Glm4MoeLiteConfig",
            groups=True,
            scaled=True,
            shared="shared_experts",
            shared_width=16,
        ),
        "exaone_moe": Case(
            (1, 2),
            8,
            2,
            "num_experts",
            "sigmoid",
            True,
            "ExaoneMoeConfig",
            groups=True,
            scaled=True,
            shared="shared_experts",
            shared_width=16,
            all_dense_student=True,
        ),
        "afmoe": Case(
            (1, 2),
            6,
            2,
            "num_experts",
            "sigmoid",
            True,
            "AfmoeConfig",
            scaled=True,
            shared="shared_experts",
            shared_width=16,
            bias_on_block=True,
            scale_key="route_scale",
            bias_attr="expert_bias",
            router_attr="router.gate",
        ),
    }
)
# GLM-5, the glm4_moe_lite block under DSA-indexer attention
CASES.update(
    {
        "glm_moe_dsa": Case(
            (1, 2),
            8,
            2,
            "n_routed_experts",
            "sigmoid",
            True,
            "GlmMoeDsaConfig",
            groups=True,
            scaled=True,
            shared="shared_experts",
            shared_width=16,
            all_dense_student=True,
        ),
    }
)
# HunYuan-MoE-V1, the softmax router's linear map at gate.wg, an ungated shared MLP, no dense layer
CASES.update(
    {
        "hunyuan_v1_moe": Case(
            (0, 1),
            6,
            2,
            "num_experts",
            "softmax",
            True,
            "HunYuanDenseV1Config",
            shared="shared_mlp",
            shared_width=16,
            router_attr="gate.wg",
            router_dtype=torch.float32,
        ),
    }
)
# ERNIE-4.5-MoE, softmax p whose top-k is corrected by a [1, E] bias on the router (gate.moe_statics)
CASES.update(
    {
        "ernie4_5_moe": Case(
            (1, 2),
            6,
            2,
            "moe_num_experts",
            "softmax_bias",
            True,
            "Ernie4_5Config",
            shared="shared_experts",
            shared_width=16,
            bias_attr="moe_statics.e_score_correction_bias",
        ),
    }
)
# PhiMoE: SparseMixer routing (always two experts, weights not renormalized); no dense student (refused)
CASES.update(
    {
        "phimoe": Case(
            (0, 1),
            6,
            2,
            "num_local_experts",
            "sparsemixer",
            False,
            "",
            router_attr="router",
            dense_student=False,
        ),
    }
)
# DBRX: blocks at transformer.blocks, MoE block `ffn`, a router returning logits alone (the block normalizes the
# top-k by their L1 norm), MoE fields in the nested ffn_config
CASES.update(
    {
        "dbrx": Case(
            (0, 1),
            6,
            2,
            "ffn_config.moe_num_experts",
            "softmax",
            True,
            "DbrxConfig",
            one_expert_student=True,
            block="ffn",
            router_attr="router.layer",
            logits_router=True,
            topk_key="ffn_config.moe_top_k",
            width_key="ffn_config.ffn_hidden_size",
        ),
    }
)
# Solar Open: GLM-4.5's block in Llama layers (every layer MoE, dense sibling Llama); MiMo-V2-Flash: the V3 router
# without shared experts, dense layers by mlp_layer_types; Hy-V3: MiniMax-M2's block-held bias × router_scaling_factor,
# a shared MLP and dense layers by mlp_layer_types
CASES.update(
    {
        "solar_open": Case(
            (0, 1),
            8,
            2,
            "n_routed_experts",
            "sigmoid",
            True,
            "LlamaConfig",
            groups=True,
            scaled=True,
            shared="shared_experts",
            shared_width=16,
        ),
        "mimo_v2_flash": Case(
            (1, 2), 8, 2, "n_routed_experts", "sigmoid", True, "MiMoV2FlashConfig", groups=True, scaled=True
        ),
        "hy_v3": Case(
            (1, 2),
            6,
            2,
            "num_experts",
            "sigmoid",
            True,
            "HYV3Config",
            scaled=True,
            shared="shared_experts",
            shared_width=16,
            bias_on_block=True,
            scale_key="router_scaling_factor",
        ),
    }
)
# Llama-4's text decoder: layer 0 dense (moe_layers), layer 2 NoPE; sigmoid scores scale the experts' input
CASES.update(
    {
        "llama4_text": Case(
            (1, 2),
            6,
            2,
            "num_local_experts",
            "topk_sigmoid",
            False,
            "Llama4TextConfig",
            shared="shared_expert",
            shared_width=16,
            all_dense_student=True,
            block="feed_forward",
            router_attr="router",
            input_scaled=True,
            tuple_out=True,
            student_block="feed_forward",
            width_key="intermediate_size_mlp",
            experts_call="stacked",
        ),
    }
)
# Mellum: Qwen3-MoE's block, MoE layers by mlp_layer_types, RoPE theta per attention layer type
CASES.update(
    {
        "mellum": Case((1, 2), 6, 2, "num_local_experts", "softmax", True, "MellumConfig"),
    }
)
# dots.3 note's text decoder: the V3 router with MoE layers by mlp_layer_types under MLA attention (DSA indexer
# or sliding window per layer)
CASES.update(
    {
        "dots3_note_text": Case(
            (1, 2),
            8,
            2,
            "n_routed_experts",
            "sigmoid",
            True,
            "Dots3NoteTextConfig",
            groups=True,
            scaled=True,
            shared="shared_experts",
            shared_width=16,
        ),
    }
)
# Flint: Qwen3-MoE's layer layout, a sigmoid router without correction bias (its weight in float32), an ungated
# shared expert
CASES.update(
    {
        "flint": Case(
            (1, 2),
            6,
            2,
            "num_experts",
            "sigmoid",
            True,
            "FlintConfig",
            shared="shared_expert",
            shared_width=16,
            router_dtype=torch.float32,
            corrected=False,
            attn_dtype=torch.float32,
        ),
    }
)
# Aria's text decoder: top-k of the logits, softmax over the k; experts stored transposed; a shared MLP at the
# block's shared_experts; the dense sibling Llama
CASES.update(
    {
        "aria_text": Case(
            (0, 1),
            6,
            2,
            "moe_num_experts",
            "softmax",
            True,
            "LlamaConfig",
            shared="shared_experts",
            shared_width=16,
            router_attr="router",
            topk_key="moe_topk",
        ),
    }
)
# DeepSeek-V3.2-Exp: the V3 block with mlp_layer_types under MLA with a DSA indexer in every layer
CASES.update(
    {
        "deepseek_v32": Case(
            (1, 2),
            8,
            2,
            "n_routed_experts",
            "sigmoid",
            True,
            "DeepseekV32Config",
            groups=True,
            scaled=True,
            shared="shared_experts",
            shared_width=16,
            all_dense_student=True,
        ),
    }
)
# Laguna: sigmoid router whose correction bias is a frozen parameter, softcapped logits, the block's routed output ×
# moe_routed_scaling_factor, an ungated shared MLP, layer 0 dense
CASES.update(
    {
        "laguna": Case(
            (1, 2),
            6,
            2,
            "num_experts",
            "sigmoid",
            True,
            "LagunaConfig",
            scaled=True,
            shared="shared_experts",
            shared_width=16,
            scale_key="moe_routed_scaling_factor",
            block_scaled=True,
            softcap_attr="router_logit_softcapping",
            attn_dtype=torch.float32,
        ),
    }
)
# Beam: the V3 router (no shared experts) with dense layers by mlp_layer_types; the block multiplies the routed sum
# by routed_scaling_factor
CASES.update(
    {
        "beam": Case(
            (1, 2),
            8,
            2,
            "num_experts",
            "sigmoid",
            True,
            "BeamConfig",
            groups=True,
            scaled=True,
            block_scaled=True,
            act_dtype=torch.float32,
        ),
    }
)
FAMILIES = list(CASES)
DENSE_FAMILIES = [f for f in FAMILIES if CASES[f].dense_student]  # families whose tests build a dense student
NO_DENSE_FAMILIES = [f for f in FAMILIES if not CASES[f].dense_student]
V = 256  # vocabulary of every tiny teacher
H = 32  # hidden size of every tiny teacher
COMMON = dict(
    vocab_size=V,
    hidden_size=H,
    num_attention_heads=4,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def tiny_config(family: str, **overrides: Any):
    """The family's tiny config; `overrides` replace any of its fields."""
    import transformers as tf

    if family == "qwen3_moe":  # layer 0 dense (narrower than k·I: zero-padded)
        kw = dict(
            num_key_value_heads=2,
            intermediate_size=24,
            moe_intermediate_size=16,
            num_hidden_layers=3,
            num_experts=6,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            mlp_only_layers=[0],
        )
        return tf.Qwen3MoeConfig(**{**COMMON, **kw, **overrides})
    if family == "qwen2_moe":
        kw = dict(
            num_key_value_heads=2,
            intermediate_size=24,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
            num_hidden_layers=2,
            num_experts=6,
            num_experts_per_tok=2,
            norm_topk_prob=False,
        )
        return tf.Qwen2MoeConfig(**{**COMMON, **kw, **overrides})
    if family == "mixtral":
        kw = dict(
            num_key_value_heads=2,
            intermediate_size=16,
            num_hidden_layers=2,
            num_local_experts=6,
            num_experts_per_tok=2,
        )
        return tf.MixtralConfig(**{**COMMON, **kw, **overrides})
    if family == "olmoe":
        kw = dict(
            num_key_value_heads=2,
            intermediate_size=16,
            num_hidden_layers=2,
            num_experts=6,
            num_experts_per_tok=2,
            norm_topk_prob=False,
        )
        return tf.OlmoeConfig(**{**COMMON, **kw, **overrides})
    mla = dict(
        num_key_value_heads=4,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        intermediate_size=40,
        moe_intermediate_size=16,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
    )
    if family == "deepseek_v2":
        kw = dict(mla, topk_method="group_limited_greedy", routed_scaling_factor=1.5)
        return tf.DeepseekV2Config(**{**COMMON, **kw, **overrides})
    if family == "deepseek_v3":
        kw = dict(mla, norm_topk_prob=True, routed_scaling_factor=2.5)
        return tf.DeepseekV3Config(**{**COMMON, **kw, **overrides})
    if family == "gpt_oss":
        kw = dict(
            num_key_value_heads=2,
            head_dim=8,
            intermediate_size=16,
            num_hidden_layers=2,
            num_local_experts=6,
            num_experts_per_tok=2,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention"],
        )
        return tf.GptOssConfig(**{**COMMON, **kw, **overrides})
    v3 = dict(
        num_key_value_heads=2,
        num_hidden_layers=2,
        intermediate_size=40,
        moe_intermediate_size=16,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
    )
    if (
        family == "glm4_moe"
    ):  # layer 0 dense (3 layers: two MoE layers, as the per-layer tests need), q/k norm
        kw = dict(
            v3,
            num_hidden_layers=3,
            first_k_dense_replace=1,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            use_qk_norm=True,
        )
        return tf.Glm4MoeConfig(**{**COMMON, **kw, **overrides})
    if family == "dots1":  # no dense layer, sliding attention in layer 1
        kw = dict(
            v3,
            first_k_dense_replace=0,
            norm_topk_prob=True,
            routed_scaling_factor=1.5,
            sliding_window=4,
            max_window_layers=1,
        )
        return tf.Dots1Config(**{**COMMON, **kw, **overrides})
    if family == "minimax_m2":
        kw = dict(
            num_key_value_heads=2,
            head_dim=8,
            intermediate_size=16,
            num_hidden_layers=2,
            num_local_experts=6,
            num_experts_per_tok=2,
        )
        return tf.MiniMaxM2Config(**{**COMMON, **kw, **overrides})
    if family == "flex_olmo":
        kw = dict(
            num_key_value_heads=2,
            intermediate_size=16,
            num_hidden_layers=2,
            num_experts=6,
            num_experts_per_tok=2,
            norm_topk_prob=True,
        )
        return tf.FlexOlmoConfig(**{**COMMON, **kw, **overrides})
    if (
        family == "cohere2_moe"
    ):  # layer 0 dense (full attention, forced RoPE), 1-2 sliding; shared summed; logits × 2
        kw = dict(
            num_key_value_heads=2,
            head_dim=8,
            intermediate_size=16,
            prefix_dense_intermediate_size=24,
            num_hidden_layers=3,
            first_k_dense_replace=1,
            num_experts=6,
            num_experts_per_tok=2,
            num_shared_experts=1,
            shared_expert_combination_strategy="sum",
            sliding_window=4,
            logit_scale=2.0,
        )
        return tf.Cohere2MoeConfig(**{**COMMON, **kw, **overrides})
    # Granite MoE: every multiplier away from 1 (logits / 0.5: KL large enough for the Router KD tests)
    granite = dict(
        num_key_value_heads=2,
        intermediate_size=16,
        num_hidden_layers=2,
        num_local_experts=6,
        num_experts_per_tok=2,
        embedding_multiplier=2.0,
        residual_multiplier=0.5,
        attention_multiplier=0.2,
        logits_scaling=0.5,
    )
    if family == "granitemoe":
        return tf.GraniteMoeConfig(**{**COMMON, **granite, **overrides})
    if family == "granitemoeshared":
        return tf.GraniteMoeSharedConfig(**{**COMMON, **granite, "shared_intermediate_size": 16, **overrides})
    # layer 0 sliding (RoPE), layer 1 full attention without RoPE (theta 0); sinks. Window 10: a float64 eager
    # forward gives NaN where a right-padded row's window holds only padding (its softmax is forced to float32,
    # float64's mask minimum becomes -inf), and the NaN values reach real tokens in the next layer; the tests'
    # padded rows keep at least 3 real tokens of 12
    if family == "granitemoe_swa":
        kw = dict(
            granite,
            shared_intermediate_size=16,
            sliding_window=10,
            layer_types=["sliding_attention", "full_attention"],
            layer_rope_theta=[10000.0, 0.0],
        )
        return tf.GraniteMoeSWAConfig(**{**COMMON, **kw, **overrides})
    if family == "glm4_moe_lite":  # MLA attention, layer 0 dense (GLM-4.7-Flash's layout)
        kw = dict(
            mla, mlp_layer_types=["dense", "sparse", "sparse"], norm_topk_prob=True, routed_scaling_factor=1.8
        )
        kw.pop("first_k_dense_replace")
        return tf.Glm4MoeLiteConfig(**{**COMMON, **kw, **overrides})
    if family == "exaone_moe":  # layer 0 dense; layers 0, 1 sliding (rope), layer 2 full attention (NoPE)
        kw = dict(
            v3,
            num_hidden_layers=3,
            num_experts=8,
            num_shared_experts=1,
            first_k_dense_replace=1,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            sliding_window=4,
            sliding_window_pattern=3,
        )
        for key in ("n_routed_experts", "n_shared_experts"):
            kw.pop(key)
        return tf.ExaoneMoeConfig(**{**COMMON, **kw, **overrides})
    if (
        family == "afmoe"
    ):  # layer 0 dense, layers 0 and 2 sliding (rope), layer 1 global (NoPE), gated attention
        kw = dict(
            num_key_value_heads=2,
            head_dim=8,
            intermediate_size=40,
            moe_intermediate_size=16,
            num_hidden_layers=3,
            num_dense_layers=1,
            num_experts=6,
            num_experts_per_tok=2,
            num_shared_experts=1,
            route_scale=1.5,
            global_attn_every_n_layers=2,
            sliding_window=4,
        )
        return tf.AfmoeConfig(**{**COMMON, **kw, **overrides})
    # GLM-5: MLA with q_lora_rank, layer 0 dense; the indexer keeps 6 of the keys (fewer than the tests' 12
    # tokens, so the sparse mask matters), layer 1 runs its own indexer, layer 2 reuses layer 1's top-k
    if family == "glm_moe_dsa":
        kw = dict(
            mla,
            q_lora_rank=16,
            mlp_layer_types=["dense", "sparse", "sparse"],
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            index_topk=6,
            index_head_dim=16,
            index_n_heads=2,
            indexer_types=["full", "full", "shared"],
        )
        kw.pop("first_k_dense_replace")
        return tf.GlmMoeDsaConfig(**{**COMMON, **kw, **overrides})
    if family == "hunyuan_v1_moe":  # q/k norm after RoPE; shared MLP and experts both intermediate_size wide
        kw = dict(
            num_key_value_heads=2,
            head_dim=8,
            intermediate_size=16,
            num_hidden_layers=2,
            num_experts=6,
            moe_topk=2,
        )
        return tf.HunYuanMoEV1Config(**{**COMMON, **kw, **overrides})
    if family == "ernie4_5_moe":  # layer 0 dense (moe_layer_start_index), one shared expert
        kw = dict(
            num_key_value_heads=2,
            intermediate_size=40,
            moe_intermediate_size=16,
            num_hidden_layers=3,
            moe_num_experts=6,
            moe_k=2,
            moe_num_shared_experts=1,
            moe_layer_start_index=1,
        )
        return tf.Ernie4_5_MoeConfig(**{**COMMON, **kw, **overrides})
    if family == "phimoe":  # LayerNorm with bias, attention and lm_head biases; a wide SparseMixer threshold
        # (2·0.2 relative, not Phi-3.5's 2·0.01) so that the masked softmaxes hold several experts
        kw = dict(
            num_key_value_heads=2,
            intermediate_size=16,
            num_hidden_layers=2,
            num_local_experts=6,
            num_experts_per_tok=2,
            router_jitter_noise=0.2,
            attention_bias=True,
            lm_head_bias=True,
        )
        return tf.PhimoeConfig(**{**COMMON, **kw, **overrides})
    if family == "dbrx":  # clipped fused qkv; the attention reads attn_config.rope_theta (no default there)
        ffn = dict(ffn_hidden_size=16, moe_num_experts=6, moe_top_k=2, moe_normalize_expert_weights=1.0)
        ffn.update(overrides.pop("ffn_config", {}))
        kw = dict(
            d_model=H,
            n_heads=4,
            n_layers=2,
            max_seq_len=64,
            vocab_size=V,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            attn_config=dict(kv_n_heads=2, clip_qkv=2.0, rope_theta=10000.0),
            ffn_config=ffn,
        )
        return tf.DbrxConfig(**{**kw, **overrides})
    if family == "solar_open":  # no dense layer; q/k/v biases (the Llama student's o_proj bias is zeros)
        kw = dict(v3, head_dim=8, norm_topk_prob=True, routed_scaling_factor=2.5, attention_bias=True)
        kw.pop("intermediate_size")
        return tf.SolarOpenConfig(**{**COMMON, **kw, **overrides})
    # MiMo-V2-Flash: layer 0 dense (narrower than k·I); layers 0 and 2 full attention, layer 1 sliding (double KV
    # heads, sinks); partial RoPE with per-type theta, a smaller value head, values × attention_value_scale
    if family == "mimo_v2_flash":
        kw = dict(
            v3,
            num_hidden_layers=3,
            head_dim=8,
            v_head_dim=4,
            intermediate_size=24,
            norm_topk_prob=True,
            routed_scaling_factor=2.0,
            mlp_layer_types=["dense", "sparse", "sparse"],
            sliding_window=6,
            attention_value_scale=0.8,
            layer_types=["full_attention", "sliding_attention", "full_attention"],
            rope_parameters={
                "full_attention": {
                    "rope_type": "default",
                    "rope_theta": 10000.0,
                    "partial_rotary_factor": 0.5,
                },
                "sliding_attention": {
                    "rope_type": "default",
                    "rope_theta": 1000.0,
                    "partial_rotary_factor": 0.5,
                },
            },
        )
        kw.pop("n_shared_experts")
        return tf.MiMoV2FlashConfig(**{**COMMON, **kw, **overrides})
    if family == "hy_v3":  # layer 0 dense; per-head q/k norm; biased MLPs (the shared MLP's too)
        kw = dict(
            num_key_value_heads=2,
            head_dim=8,
            intermediate_size=40,
            moe_intermediate_size=16,
            num_hidden_layers=3,
            num_experts=6,
            num_experts_per_tok=2,
            num_shared_experts=1,
            router_scaling_factor=1.5,
            mlp_layer_types=["dense", "sparse", "sparse"],
            mlp_bias=True,
        )
        return tf.HYV3Config(**{**COMMON, **kw, **overrides})
    if (
        family == "llama4_text"
    ):  # layer 0 dense (wider than k·I + shared: padded), layers 0-1 chunked RoPE, 2 NoPE
        kw = dict(
            num_key_value_heads=2,
            head_dim=8,
            intermediate_size=16,
            intermediate_size_mlp=40,
            num_hidden_layers=3,
            num_local_experts=6,
            num_experts_per_tok=2,
            moe_layers=[1, 2],
            no_rope_layers=[1, 1, 0],
            attention_chunk_size=4,
        )
        return tf.Llama4TextConfig(**{**COMMON, **kw, **overrides})
    if family == "mellum":  # layer 0 dense (narrower than k·I); layers 0, 2 sliding (theta 1e4), 1 full (5e5)
        kw = dict(
            num_key_value_heads=2,
            head_dim=8,
            intermediate_size=24,
            moe_intermediate_size=16,
            num_hidden_layers=3,
            num_experts=6,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            sliding_window=4,
            mlp_layer_types=["dense", "sparse", "sparse"],
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        )
        return tf.MellumConfig(**{**COMMON, **kw, **overrides})
    # dots.3 note: MLA with q_lora_rank, layer 0 dense; layers 0 and 2 run the DSA indexer (6 keys kept of the tests'
    # 12 tokens), layer 1 a sliding window of 4 with its own (swa_*) head shapes
    if family == "dots3_note_text":
        kw = dict(
            mla,
            q_lora_rank=16,
            head_dim=16,
            shared_experts_intermediate_size=16,
            mlp_layer_types=["dense", "sparse", "sparse"],
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            index_topk=6,
            index_head_dim=16,
            index_n_heads=2,
            sliding_window=4,
            layer_types=["indexed_attention", "sliding_attention", "indexed_attention"],
            swa_num_attention_heads=4,
            swa_num_key_value_heads=4,
            swa_q_lora_rank=16,
            swa_kv_lora_rank=16,
            swa_head_dim=16,
            swa_qk_nope_head_dim=8,
            swa_v_head_dim=8,
        )
        kw.pop("first_k_dense_replace")
        return tf.Dots3NoteTextConfig(**{**COMMON, **kw, **overrides})
    # Flint: layer 0 dense (narrower than k·I + shared); layers 0 and 2 sliding (RoPE), layer 1 full (NoPE); sinks
    if family == "flint":
        kw = dict(
            num_key_value_heads=2,
            head_dim=8,
            intermediate_size=24,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=16,
            num_hidden_layers=3,
            num_experts=6,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            mlp_only_layers=[0],
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        )
        return tf.FlintConfig(**{**COMMON, **kw, **overrides})
    if family == "aria_text":  # every layer MoE; attention and MLP biases (the routed experts have none)
        kw = dict(
            num_key_value_heads=2,
            head_dim=8,
            intermediate_size=16,
            num_hidden_layers=2,
            moe_num_experts=6,
            moe_topk=2,
            moe_num_shared_experts=1,
            attention_bias=True,
            mlp_bias=True,
        )
        return tf.AriaTextConfig(**{**COMMON, **kw, **overrides})
    # DeepSeek-V3.2: MLA with q_lora_rank (the indexer reads the query latent), layer 0 dense by
    # first_k_dense_replace (mlp_layer_types derived from it); the indexer keeps 8 of the tests' 12 tokens
    if family == "deepseek_v32":
        kw = dict(
            mla,
            q_lora_rank=16,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            index_topk=8,
            index_head_dim=16,
            index_n_heads=2,
        )
        return tf.DeepseekV32Config(**{**COMMON, **kw, **overrides})
    # Laguna: layer 0 dense (narrower than k·I + shared); layer 1 sliding; a router softcap of 1.5 (the tiny logits
    # reach several units, so the cap bends them); per-layer head counts and the softplus output gate
    if family == "laguna":
        kw = dict(
            num_key_value_heads=2,
            head_dim=8,
            intermediate_size=24,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=16,
            num_hidden_layers=3,
            num_experts=6,
            num_experts_per_tok=2,
            mlp_layer_types=["dense", "sparse", "sparse"],
            sliding_window=4,
            layer_types=["full_attention", "sliding_attention", "full_attention"],
            num_attention_heads_per_layer=[4, 2, 4],
            moe_routed_scaling_factor=2.5,
            moe_router_logit_softcapping=1.5,
        )
        return tf.LagunaConfig(**{**COMMON, **kw, **overrides})
    # Beam: layer 0 dense (narrower than k·I); layers 0 and 2 sliding, layer 1 full; four norms per layer
    if family == "beam":
        kw = dict(
            num_key_value_heads=2,
            head_dim=8,
            intermediate_size=24,
            moe_intermediate_size=16,
            num_hidden_layers=3,
            num_experts=8,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            mlp_layer_types=["dense", "sparse", "sparse"],
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            final_logit_softcapping=None,
        )  # 30 in the real config: KD refuses it (test_beam.py)
        return tf.BeamConfig(**{**COMMON, **kw, **overrides})
    raise ValueError(f"no tiny config for family {family!r}")


def make_teacher(
    family: str,
    seed: int = 0,
    dtype: torch.dtype | None = None,
    experts_implementation: str | None = None,
    **overrides: Any,
) -> nn.Module:
    """A tiny random teacher in eval mode, with weights large enough that routing, clamps and biases
    all matter (norms and attention sinks in [0.5, 1.5], DeepSeek-V3's correction bias non-zero)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    kw = {} if experts_implementation is None else {"experts_implementation": experts_implementation}
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides), **kw).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            # the owning module's name, not any prefix: DBRX's attention lives under `norm_attn_norm`
            if "norm" in name.rpartition(".")[0].rpartition(".")[2] or "sinks" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.25)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    if dtype is None:
        return model
    model = model.to(dtype)
    if (
        CASES.get(family) is not None and CASES[family].router_dtype is not None
    ):  # as from_pretrained builds it
        for layer in range(len(layers_of(family, model))):
            block = block_of(family, model, layer)
            if hasattr(block, "experts"):
                router_of(family, block).to(CASES[family].router_dtype)
    return model


def cfg_get(config: Any, key: str) -> Any:
    """A config field; a dotted key reads a sub-config's field (DBRX: ffn_config.moe_num_experts)."""
    for part in key.split("."):
        config = getattr(config, part)
    return config


def expert_params(family: str, experts: nn.Module) -> dict[str, torch.Tensor]:
    """The experts module's parameters by name, each with a leading expert axis (DBRX's [E·I, H] w1/v1/w2 as
    their [E, I, H] views)."""
    params = dict(experts.named_parameters())
    if family != "dbrx":
        return params
    return {n: t.view(experts.num_experts, -1, t.shape[-1]) for n, t in params.items()}


def layers_of(family: str, model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a model of the family's class (DBRX: transformer.blocks)."""
    return model.transformer.blocks if family == "dbrx" else model.model.layers


def student_ffn_of(family: str, student: nn.Module, layer: int) -> nn.Module:
    """Layer `layer`'s FFN in the dense student: the block of a one-expert student, else the decoder layer's
    `student_block` (`mlp`; Llama-4: `feed_forward`)."""
    if CASES[family].one_expert_student:
        return block_of(family, student, layer)
    return getattr(student.model.layers[layer], CASES[family].student_block)


def student_ffn_name(family: str) -> str:
    """What the dense student's FFN parameter names contain (".mlp.", DBRX's one-expert ".ffn.", ...)."""
    case = CASES[family]
    return f".{case.block}." if case.one_expert_student else f".{case.student_block}."


def router_of(family: str, block: nn.Module) -> nn.Module:
    """The router module of a family's MoE block (written out, not asked of the adapter; a dotted
    `router_attr` such as AFMoE's `router.gate` names the router's linear map inside the router)."""
    return block.router if family == "gpt_oss" else block.get_submodule(CASES[family].router_attr)


def router_module_of(family: str, block: nn.Module) -> nn.Module:
    """The router module itself (whose forward returns logits, weights, indices): router_of, or where
    `router_attr` is dotted (AFMoE's `router.gate`, HunYuan's `gate.wg`) the module holding that linear map."""
    attr = CASES[family].router_attr
    return block.get_submodule(attr.partition(".")[0]) if "." in attr else router_of(family, block)


def block_of(family: str, model: nn.Module, layer: int) -> nn.Module:
    """Decoder layer `layer`'s FFN module (the MoE block in MoE layers) in a model of the family's class
    (the teacher, its pruned, merged and edited twins; dense students keep theirs at `mlp`)."""
    return getattr(layers_of(family, model)[layer], CASES[family].block)


def set_block(family: str, model: nn.Module, layer: int, module: nn.Module) -> None:
    """Replace decoder layer `layer`'s FFN module (see block_of)."""
    setattr(layers_of(family, model)[layer], CASES[family].block, module)


def shared_of(family: str, model: nn.Module, layer: int) -> nn.Module | None:
    """The shared-expert module of an MoE layer, in the block or (Granite) on the decoder layer; None if none."""
    case = CASES[family]
    if case.shared is None:
        return None
    owner = layers_of(family, model)[layer] if case.shared_on_layer else block_of(family, model, layer)
    return getattr(owner, case.shared, None)


def shared_weights(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(gate [S, H], up [S, H], down [H, S]) of a shared-expert MLP: gate/up/down_proj, or Granite's
    input_linear (halves: gate rows, then up rows) and output_linear."""
    if hasattr(module, "input_linear"):
        gate, up = module.input_linear.weight.chunk(2, dim=0)
        return gate, up, module.output_linear.weight
    return module.gate_proj.weight, module.up_proj.weight, module.down_proj.weight


def routed_scale(family: str, teacher: nn.Module) -> float:
    """The constant DeepSeek-style routers multiply into their weights (1 elsewhere)."""
    return float(getattr(teacher.config, CASES[family].scale_key)) if CASES[family].scaled else 1.0


def correction_bias(family: str, block: nn.Module) -> torch.Tensor:
    """The [E] score-correction bias of a sigmoid router (on the router, or on the block for MiniMax-M2); a dotted
    `bias_attr` names a parameter in a submodule (ERNIE-4.5's [1, E] moe_statics bias: its [E] view); zeros for a
    sigmoid router without one (Flint)."""
    if not CASES[family].corrected:
        w = router_of(family, block).weight
        return torch.zeros(w.shape[0], dtype=w.dtype, device=w.device)
    owner = block if CASES[family].bias_on_block else router_of(family, block)
    if "." in CASES[family].bias_attr:
        return owner.get_parameter(CASES[family].bias_attr).view(-1)
    return getattr(owner, CASES[family].bias_attr)


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
        out.append(
            LayerPlan(
                layer=layer,
                selected=sel,
                scores=[1.0] * e,
                groups=groups,
                merge_weights=mw,
                alpha=[0.7, 0.45],
            )
        )
    return out


def sparsemixer_ref(logits: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PhiMoE's eval-mode routing written out per token (not transformers' sparsemixer): (weights [T, 2],
    indices [T, 2]). Pick j's expert m_j is the largest logit among those not picked yet; its weight is
    exp(z_m) / Σ exp(z_e) over the not-yet-picked e with (z_m − z_e) / max(|z_e|, z_m) <= 2·eps (a -inf
    logit, a dropped expert, is never picked and adds nothing)."""
    z = logits.detach().double()
    weights = torch.zeros(z.shape[0], 2, dtype=torch.float64)
    picks = torch.zeros(z.shape[0], 2, dtype=torch.long)
    for t in range(z.shape[0]):
        left = [e for e in range(z.shape[1]) if z[t, e] != float("-inf")]
        for j in range(2):
            m = max(left, key=lambda e: float(z[t, e]))
            top = float(z[t, m])
            near = [e for e in left if (top - float(z[t, e])) / max(abs(float(z[t, e])), top) <= 2 * eps]
            weights[t, j] = 1.0 / sum(math.exp(float(z[t, e]) - top) for e in near)
            picks[t, j] = m
            left.remove(m)
    return weights, picks


def ids(n: int = 2, t: int = 12, seed: int = 1) -> torch.Tensor:
    """[n, t] random token ids (no special tokens)."""
    return torch.randint(3, V, (n, t), generator=torch.Generator().manual_seed(seed))


def experts_forward(
    family: str, experts: nn.Module, h: torch.Tensor, idx: torch.Tensor, w: torch.Tensor
) -> torch.Tensor:
    """The experts module's own forward on h [T, H] routed to idx [T, j] with weights w [T, j] (Llama-4's
    stacked experts see w·h on the chosen slices and 0 elsewhere; f(0) = 0)."""
    if CASES[family].experts_call != "stacked":
        return experts(h, idx, w).reshape(h.shape)  # DBRX's experts return [T, 1, H]
    e = experts.gate_up_proj.shape[0]
    scores = torch.zeros(h.shape[0], e, dtype=h.dtype, device=h.device).scatter_add(1, idx, w.to(h.dtype))
    routed_in = h.repeat(e, 1) * scores.transpose(0, 1).reshape(-1, 1)
    return experts(routed_in).reshape(e, h.shape[0], -1).sum(0)
