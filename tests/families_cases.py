"""Tiny, seeded teachers of every supported MoE family (transformers 5.x), shared by the family,
calibration, conversion and teacher-shape tests.

`CASES` holds one record per family, and it is the only per-family data here: a `Case` names the family's
transformers config class and the keyword values of its tiny config (plain numbers, strings, lists and dicts over
`COMMON`), and states what the teacher is for the tests' independent reference math (written per router kind,
not per family). `FAMILIES` is `list(CASES)`: every per-family test (tests/test_families*.py and the others
importing this module) iterates it, so a new record is picked up everywhere.

Adding an ordinary family is its adapter plus one record:
- `config_class`: the name of its config class in `transformers`;
- `config`: the tiny config's keyword values, merged over `COMMON` (vocabulary V, hidden size H, 4 heads, 64
  positions, pad/bos/eos 0/1/2); a family whose config names those fields differently sets `with_common=False` and
  writes them out (DBRX). Spread `TWO_MOE_LAYERS`, `DENSE_FIRST`, `MLA`, `DSA`, `GROUPED_ROUTER` or `GRANITE` where
  the family shares that layout (and `V3_ROUTER`, `DEEPSEEK_MOE`, `GRANITE_MOE`, `GRANITE_SHARED` into its `Case`
  for those fields). Keep it tiny (2-3 layers, 6-8 experts, k = 2, widths 16-40) and make what the family does
  differently engage;
- `student`: the config class of its dense student ("" where the family refuses a dense student);
- every other `Case` field whose default (an ordinary softmax-routed MoE: MoE layers 1 and 2 of 6 experts at
  `num_experts`, top-2, renormalized, no shared expert, block `mlp` with router `gate` in `model.layers`) does not
  fit it. tests/test_families_records.py checks the record against the config it builds.

`tiny_config` builds any family's config from its record with no per-family code: `overrides` replace fields,
except that a dict given for a dict-valued field (a sub-config such as DBRX's ffn_config) updates it. No record
needs a computed value today; one that did would name a small function here, listed in this docstring.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from workers.core.types import LayerPlan


@dataclass(frozen=True, kw_only=True)
class Case:
    """One family's tiny teacher: its config, and what it is, written out independently of the adapters."""

    config_class: str  # the family's config class in transformers
    config: Mapping[str, Any]  # its tiny config's keyword values (plain data; merged over COMMON)
    with_common: bool = True  # False: COMMON is not merged in (DBRX names those fields d_model, n_heads, ...)
    student: str = ""  # transformers config class of the dense student ("": the family writes none)
    moe_layers: tuple[int, ...] = (1, 2)
    experts: int = 6
    top_k: int = 2
    experts_key: str = "num_experts"  # config field of the routed expert count (dotted: a sub-config's)
    router: str = "softmax"
    # "softmax": top-k of softmax p; "softmax_v2": DeepSeek-V2 (groups by max p, scaled);
    # "sigmoid": top-k of sigmoid + correction bias, weights the raw sigmoid (DeepSeek-V3 style);
    # "logits": top-k of biased logits, softmax over the k (GPT-OSS);
    # "softmax_bias": top-k of softmax p + correction bias, weights p of the k (ERNIE-4.5);
    # "sparsemixer": PhiMoE's two picks (argmax, then argmax of the rest), each weighted by a softmax over the
    # logits within a relative threshold of its max (sparsemixer_ref below);
    # "topk_sigmoid": top-k of the logits, weights the sigmoid of those logits (Llama-4)
    renorm: bool = True  # weights renormalized over the chosen k
    groups: bool = False  # group-limited routing (n_group / topk_group, contiguous groups)
    scaled: bool = False  # routed_scaling_factor multiplies the weights
    # (with scaled) the block multiplies the experts module's summed output by the factor, the router's weights
    # lack it (Laguna); the effective per-expert weight is still w × factor
    block_scaled: bool = False
    shared: str | None = None  # block attribute of the shared experts
    shared_gate: str | None = None  # block attribute of a per-token sigmoid gate of the shared expert
    shared_width: int = 0
    bias_on_block: bool = False  # the correction bias is a buffer of the block, not of the router
    one_expert_student: bool = False  # the student is the same class with one expert and top-1
    all_dense_student: bool = False  # the student is the same class with first_k_dense_replace = n
    layers: str = "model.layers"  # model attribute (dotted) of the decoder layers (DBRX: transformer.blocks)
    block: str = "mlp"  # decoder-layer attribute of the MoE block (Granite: block_sparse_moe)
    # block attribute of the router (dotted: the linear map inside the router module)
    router_attr: str = "gate"
    shared_on_layer: bool = False  # `shared` is a decoder-layer attribute, added to the block's output there
    scale_key: str = "routed_scaling_factor"  # config field of the constant factor (where scaled)
    bias_attr: str = "e_score_correction_bias"  # name of a sigmoid router's correction bias
    # False: a sigmoid router chooses by the scores alone (Flint); correction_bias is then zeros
    corrected: bool = True
    # the dtype the modeling code pins the router's linear map to (HunYuan: float32 in any model dtype;
    # from_pretrained keeps it there, so make_teacher does too)
    router_dtype: torch.dtype | None = None
    # router attribute with c of a tanh cap on its logits, c·tanh(z / c) where c > 0 (Laguna:
    # router_logit_softcapping, from the config's moe_router_logit_softcapping)
    softcap_attr: str | None = None
    # the dtype the modeling code's attention scores are computed in, whatever the model's (Flint: float32;
    # Laguna: its softplus output gate and its router): forwards of other shapes differ in its last bits
    attn_dtype: torch.dtype | None = None
    # the dtype the experts evaluate act(gate)·up in (Beam: float32), so a float64 teacher's expert outputs carry
    # that dtype's rounding
    act_dtype: torch.dtype | None = None
    input_scaled: bool = False  # the routing weight multiplies the expert's input, f_e(w·x) (Llama-4)
    tuple_out: bool = False  # the MoE block returns (hidden states, router output) (GPT-OSS, Llama-4)
    student_block: str = "mlp"  # decoder-layer attribute of the dense student's FFN
    # the experts module's forward: "routed" (h, indices, weights); "stacked": Llama-4's, every expert on its
    # own [T, H] slice of an [E·T, H] input
    experts_call: str = "routed"
    fused_experts: bool = False  # expert weights stored [E·I, H] (DBRX's w1/v1/w2), read as [E, I, H] views
    topk_key: str = "num_experts_per_tok"  # config field of k (a dotted key names a field of a sub-config)
    # the router module returns the logits alone; the block picks and weights (DBRX)
    logits_router: bool = False
    # config field of the dense student's FFN width (dotted: a sub-config's)
    width_key: str = "intermediate_size"

    @property
    def dense_student(self) -> bool:
        """The family writes a dense student (else refused_outputs holds "dense")."""
        return bool(self.student)


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
# the plain tiny decoders most records spread (2 KV heads, top-2 routing; a record overrides what differs): two
# MoE layers of 16-wide experts, or three whose first is dense (the record says how, and how wide)
TWO_MOE_LAYERS = dict(num_key_value_heads=2, intermediate_size=16, num_hidden_layers=2, num_experts_per_tok=2)
DENSE_FIRST = dict(
    num_key_value_heads=2, moe_intermediate_size=16, num_hidden_layers=3, num_experts_per_tok=2
)
# DeepSeek-V2's multi-head latent attention (no query latent) and its routed layout, 3 layers
MLA = dict(
    num_key_value_heads=4,
    kv_lora_rank=16,
    q_lora_rank=None,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=8,
    num_hidden_layers=3,
    intermediate_size=40,
    moe_intermediate_size=16,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
)
# the V3 router's group-limited top-2 (2 groups, 1 kept), renormalized, in a 2-layer decoder
GROUPED_ROUTER = dict(
    num_key_value_heads=2,
    num_hidden_layers=2,
    moe_intermediate_size=16,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    norm_topk_prob=True,
)
# MLA with a query latent under DeepSeek's sparse-attention (DSA) indexer of 2 heads of 16; the record says how many
# keys it keeps (index_topk)
DSA = dict(MLA, q_lora_rank=16, index_head_dim=16, index_n_heads=2)
# Granite MoE: every multiplier away from 1 (logits / 0.5: KL large enough for the Router KD tests)
GRANITE = dict(
    TWO_MOE_LAYERS,
    num_local_experts=6,
    embedding_multiplier=2.0,
    residual_multiplier=0.5,
    attention_multiplier=0.2,
    logits_scaling=0.5,
)
# Case fields of Granite MoE's layout: two MoE layers of num_local_experts, the block at `block_sparse_moe`, its
# router at `router`; granitemoeshared and granitemoe_swa add a 16-wide shared MLP on the decoder layer
GRANITE_MOE = dict(
    moe_layers=(0, 1), experts_key="num_local_experts", block="block_sparse_moe", router_attr="router"
)
GRANITE_SHARED = dict(shared="shared_mlp", shared_width=16, shared_on_layer=True)
DENSE_SPARSE_SPARSE = ["dense", "sparse", "sparse"]  # mlp_layer_types of a teacher whose layer 0 is dense
# Case fields of the V3 router (a record spreads them): group-limited top-2 of 8 experts' sigmoid scores plus a
# correction bias, the raw scores weighted and scaled
V3_ROUTER = dict(experts=8, router="sigmoid", groups=True, scaled=True)
# Case fields of DeepSeek's MoE layout: the routed count at n_routed_experts, one shared expert (16 wide) at
# shared_experts
DEEPSEEK_MOE = dict(experts_key="n_routed_experts", shared="shared_experts", shared_width=16)

CASES: dict[str, Case] = {
    # layer 0 dense (narrower than k·I: zero-padded)
    "qwen3_moe": Case(
        config_class="Qwen3MoeConfig",
        config=dict(
            DENSE_FIRST,
            intermediate_size=24,
            num_experts=6,
            norm_topk_prob=True,
            mlp_only_layers=[0],
        ),
        student="Qwen3Config",
    ),
    # its sigmoid-gated shared expert; weights not renormalized
    "qwen2_moe": Case(
        config_class="Qwen2MoeConfig",
        config=dict(
            num_key_value_heads=2,
            intermediate_size=24,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
            num_hidden_layers=2,
            num_experts=6,
            num_experts_per_tok=2,
            norm_topk_prob=False,
        ),
        student="Qwen2Config",
        moe_layers=(0, 1),
        renorm=False,
        shared="shared_expert",
        shared_gate="shared_expert_gate",
        shared_width=24,
    ),
    "mixtral": Case(
        config_class="MixtralConfig",
        config=dict(
            TWO_MOE_LAYERS,
            num_local_experts=6,
        ),
        student="MistralConfig",
        moe_layers=(0, 1),
        experts_key="num_local_experts",
    ),
    "olmoe": Case(
        config_class="OlmoeConfig",
        config=dict(
            TWO_MOE_LAYERS,
            num_experts=6,
            norm_topk_prob=False,
        ),
        student="OlmoeConfig",
        moe_layers=(0, 1),
        renorm=False,
        one_expert_student=True,
    ),
    # DeepSeek-V2/V3: a dense first layer (first_k_dense_replace), one shared expert, group-limited routing and a
    # routed scaling factor (V3: sigmoid router with a correction bias)
    "deepseek_v2": Case(
        config_class="DeepseekV2Config",
        config=dict(
            MLA, first_k_dense_replace=1, topk_method="group_limited_greedy", routed_scaling_factor=1.5
        ),
        student="DeepseekV2Config",
        **DEEPSEEK_MOE,
        experts=8,
        router="softmax_v2",
        renorm=False,
        groups=True,
        scaled=True,
        all_dense_student=True,
    ),
    "deepseek_v3": Case(
        config_class="DeepseekV3Config",
        config=dict(MLA, first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5),
        student="DeepseekV3Config",
        **V3_ROUTER,
        **DEEPSEEK_MOE,
        all_dense_student=True,
    ),
    # its biased router and biased clamped-SwiGLU experts; layer 0 sliding
    "gpt_oss": Case(
        config_class="GptOssConfig",
        config=dict(
            TWO_MOE_LAYERS,
            head_dim=8,
            num_local_experts=6,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention"],
        ),
        student="GptOssConfig",
        moe_layers=(0, 1),
        experts_key="num_local_experts",
        router="logits",
        one_expert_student=True,
        router_attr="router",
        tuple_out=True,
    ),
    # the V3 router (group-limited, scaled); layer 0 dense (3 layers: two MoE layers, as the per-layer tests
    # need), q/k norm
    "glm4_moe": Case(
        config_class="Glm4MoeConfig",
        config=dict(
            GROUPED_ROUTER,
            intermediate_size=40,
            n_routed_experts=8,
            n_shared_experts=1,
            num_hidden_layers=3,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
            use_qk_norm=True,
        ),
        student="Glm4MoeConfig",
        **V3_ROUTER,
        **DEEPSEEK_MOE,
        all_dense_student=True,
    ),
    # the V3 router; no dense layer, sliding attention in layer 1
    "dots1": Case(
        config_class="Dots1Config",
        config=dict(
            GROUPED_ROUTER,
            intermediate_size=40,
            n_routed_experts=8,
            n_shared_experts=1,
            first_k_dense_replace=0,
            routed_scaling_factor=1.5,
            sliding_window=4,
            max_window_layers=1,
        ),
        student="Dots1Config",
        moe_layers=(0, 1),
        **V3_ROUTER,
        **DEEPSEEK_MOE,
        all_dense_student=True,
    ),
    # a sigmoid router whose correction bias lives on the block
    "minimax_m2": Case(
        config_class="MiniMaxM2Config",
        config=dict(
            TWO_MOE_LAYERS,
            head_dim=8,
            num_local_experts=6,
        ),
        student="MiniMaxM2Config",
        moe_layers=(0, 1),
        experts_key="num_local_experts",
        router="sigmoid",
        bias_on_block=True,
        one_expert_student=True,
    ),
    # OLMoE's router in OLMo-2's post-norm layer
    "flex_olmo": Case(
        config_class="FlexOlmoConfig",
        config=dict(
            TWO_MOE_LAYERS,
            num_experts=6,
            norm_topk_prob=True,
        ),
        student="Olmo2Config",
        moe_layers=(0, 1),
    ),
    # layer 0 dense (full attention, forced RoPE), 1-2 sliding; shared summed; logits × 2
    "cohere2_moe": Case(
        config_class="Cohere2MoeConfig",
        config=dict(
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
        ),
        student="Cohere2MoeConfig",
        shared="shared_experts",
        shared_width=16,
    ),
    # Granite MoE: the block is `block_sparse_moe`, the shared MLP (granitemoeshared, granitemoe_swa) sits on the
    # decoder layer; the router's softmax over the top-k logits is p renormalized over the k
    "granitemoe": Case(
        config_class="GraniteMoeConfig",
        config=GRANITE,
        student="GraniteConfig",
        **GRANITE_MOE,
    ),
    "granitemoeshared": Case(
        config_class="GraniteMoeSharedConfig",
        config=dict(GRANITE, shared_intermediate_size=16),
        student="GraniteConfig",
        **GRANITE_MOE,
        **GRANITE_SHARED,
    ),
    # layer 0 sliding (RoPE), layer 1 full attention without RoPE (theta 0); sinks. Window 10: a float64 eager
    # forward gives NaN where a right-padded row's window holds only padding (its softmax is forced to float32,
    # float64's mask minimum becomes -inf), and the NaN values reach real tokens in the next layer; the tests'
    # padded rows keep at least 3 real tokens of 12. No SDPA path: its eager attention takes the softmax (and the
    # sink's sigmoid) in float32 whatever the model's dtype, and a padded row (masked keys at -inf) and the same
    # row unpadded sum their exp values in an order that depends on the CPU's SIMD width (the same under AVX-512,
    # float32 ulps apart under AVX2): attn_dtype float32
    "granitemoe_swa": Case(
        config_class="GraniteMoeSWAConfig",
        config=dict(
            GRANITE,
            shared_intermediate_size=16,
            sliding_window=10,
            layer_types=["sliding_attention", "full_attention"],
            layer_rope_theta=[10000.0, 0.0],
        ),
        student="GraniteSWAConfig",
        **GRANITE_MOE,
        **GRANITE_SHARED,
        attn_dtype=torch.float32,
    ),
    # the V3 router under MLA attention, MoE layers by mlp_layer_types, layer 0 dense (GLM-4.7-Flash's layout)
    "glm4_moe_lite": Case(
        config_class="Glm4MoeLiteConfig",
        config=dict(MLA, mlp_layer_types=DENSE_SPARSE_SPARSE, norm_topk_prob=True, routed_scaling_factor=1.8),
        student="Glm4MoeLiteConfig",
        **V3_ROUTER,
        **DEEPSEEK_MOE,
    ),
    # the V3 router; layer 0 dense; layers 0, 1 sliding (rope), layer 2 full attention (NoPE)
    "exaone_moe": Case(
        config_class="ExaoneMoeConfig",
        config=dict(
            GROUPED_ROUTER,
            intermediate_size=40,
            num_hidden_layers=3,
            num_experts=8,
            num_shared_experts=1,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
            sliding_window=4,
            sliding_window_pattern=3,
        ),
        student="ExaoneMoeConfig",
        **V3_ROUTER,
        shared="shared_experts",
        shared_width=16,
        all_dense_student=True,
    ),
    # MiniMax-M2's router × route_scale; layer 0 dense, layers 0 and 2 sliding (rope), layer 1 global (NoPE),
    # gated attention
    "afmoe": Case(
        config_class="AfmoeConfig",
        config=dict(
            DENSE_FIRST,
            head_dim=8,
            intermediate_size=40,
            num_dense_layers=1,
            num_experts=6,
            num_shared_experts=1,
            route_scale=1.5,
            global_attn_every_n_layers=2,
            sliding_window=4,
        ),
        student="AfmoeConfig",
        router="sigmoid",
        scaled=True,
        shared="shared_experts",
        shared_width=16,
        bias_on_block=True,
        scale_key="route_scale",
        bias_attr="expert_bias",
        router_attr="router.gate",
    ),
    # GLM-5, the glm4_moe_lite block under DSA-indexer attention: MLA with q_lora_rank, layer 0 dense; the indexer
    # keeps 6 of the keys (fewer than the tests' 12 tokens, so the sparse mask matters), layer 1 runs its own
    # indexer, layer 2 reuses layer 1's top-k
    "glm_moe_dsa": Case(
        config_class="GlmMoeDsaConfig",
        config=dict(
            DSA,
            mlp_layer_types=DENSE_SPARSE_SPARSE,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            index_topk=6,
            indexer_types=["full", "full", "shared"],
        ),
        student="GlmMoeDsaConfig",
        **V3_ROUTER,
        **DEEPSEEK_MOE,
        all_dense_student=True,
    ),
    # HunYuan-MoE-V1: the softmax router's linear map at gate.wg, an ungated shared MLP, no dense layer; q/k norm
    # after RoPE; shared MLP and experts both intermediate_size wide
    "hunyuan_v1_moe": Case(
        config_class="HunYuanMoEV1Config",
        config=dict(
            num_key_value_heads=2,
            head_dim=8,
            intermediate_size=16,
            num_hidden_layers=2,
            num_experts=6,
            moe_topk=2,
        ),
        student="HunYuanDenseV1Config",
        moe_layers=(0, 1),
        shared="shared_mlp",
        shared_width=16,
        router_attr="gate.wg",
        router_dtype=torch.float32,
    ),
    # ERNIE-4.5-MoE: softmax p whose top-k is corrected by a [1, E] bias on the router (gate.moe_statics); layer 0
    # dense (moe_layer_start_index), one shared expert
    "ernie4_5_moe": Case(
        config_class="Ernie4_5_MoeConfig",
        config=dict(
            num_key_value_heads=2,
            intermediate_size=40,
            moe_intermediate_size=16,
            num_hidden_layers=3,
            moe_num_experts=6,
            moe_k=2,
            moe_num_shared_experts=1,
            moe_layer_start_index=1,
        ),
        student="Ernie4_5Config",
        experts_key="moe_num_experts",
        router="softmax_bias",
        shared="shared_experts",
        shared_width=16,
        bias_attr="moe_statics.e_score_correction_bias",
    ),
    # PhiMoE: SparseMixer routing (always two experts, weights not renormalized); no dense student (refused).
    # LayerNorm with bias, attention and lm_head biases; a wide SparseMixer threshold (2·0.2 relative, not
    # Phi-3.5's 2·0.01) so that the masked softmaxes hold several experts
    "phimoe": Case(
        config_class="PhimoeConfig",
        config=dict(
            TWO_MOE_LAYERS,
            num_local_experts=6,
            router_jitter_noise=0.2,
            attention_bias=True,
            lm_head_bias=True,
        ),
        moe_layers=(0, 1),
        experts_key="num_local_experts",
        router="sparsemixer",
        renorm=False,
        router_attr="router",
    ),
    # DBRX: blocks at transformer.blocks, MoE block `ffn`, a router returning logits alone (the block normalizes
    # the top-k by their L1 norm), MoE fields in the nested ffn_config; clipped fused qkv; the attention reads
    # attn_config.rope_theta (no default there)
    "dbrx": Case(
        config_class="DbrxConfig",
        config=dict(
            d_model=H,
            n_heads=4,
            n_layers=2,
            max_seq_len=64,
            vocab_size=V,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            attn_config=dict(kv_n_heads=2, clip_qkv=2.0, rope_theta=10000.0),
            ffn_config=dict(
                ffn_hidden_size=16, moe_num_experts=6, moe_top_k=2, moe_normalize_expert_weights=1.0
            ),
        ),
        with_common=False,
        student="DbrxConfig",
        moe_layers=(0, 1),
        experts_key="ffn_config.moe_num_experts",
        one_expert_student=True,
        layers="transformer.blocks",
        block="ffn",
        router_attr="router.layer",
        fused_experts=True,
        logits_router=True,
        topk_key="ffn_config.moe_top_k",
        width_key="ffn_config.ffn_hidden_size",
    ),
    # Solar Open: GLM-4.5's block in Llama layers (every layer MoE, dense sibling Llama); q/k/v biases (the Llama
    # student's o_proj bias is zeros)
    "solar_open": Case(
        config_class="SolarOpenConfig",
        config=dict(
            GROUPED_ROUTER,
            n_routed_experts=8,
            n_shared_experts=1,
            head_dim=8,
            routed_scaling_factor=2.5,
            attention_bias=True,
        ),
        student="LlamaConfig",
        moe_layers=(0, 1),
        **V3_ROUTER,
        **DEEPSEEK_MOE,
    ),
    # MiMo-V2-Flash: the V3 router without shared experts, dense layers by mlp_layer_types: layer 0 dense
    # (narrower than k·I); layers 0 and 2 full attention, layer 1 sliding (double KV heads, sinks); partial RoPE
    # with per-type theta, a smaller value head, values × attention_value_scale
    "mimo_v2_flash": Case(
        config_class="MiMoV2FlashConfig",
        config=dict(
            GROUPED_ROUTER,
            n_routed_experts=8,
            num_hidden_layers=3,
            head_dim=8,
            v_head_dim=4,
            intermediate_size=24,
            routed_scaling_factor=2.0,
            mlp_layer_types=DENSE_SPARSE_SPARSE,
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
        ),
        student="MiMoV2FlashConfig",
        **V3_ROUTER,
        experts_key="n_routed_experts",
    ),
    # Hy-V3: MiniMax-M2's block-held bias × router_scaling_factor, a shared MLP; layer 0 dense by mlp_layer_types;
    # per-head q/k norm; biased MLPs (the shared MLP's too)
    "hy_v3": Case(
        config_class="HYV3Config",
        config=dict(
            DENSE_FIRST,
            head_dim=8,
            intermediate_size=40,
            num_experts=6,
            num_shared_experts=1,
            router_scaling_factor=1.5,
            mlp_layer_types=DENSE_SPARSE_SPARSE,
            mlp_bias=True,
        ),
        student="HYV3Config",
        router="sigmoid",
        scaled=True,
        shared="shared_experts",
        shared_width=16,
        bias_on_block=True,
        scale_key="router_scaling_factor",
    ),
    # Llama-4's text decoder: sigmoid scores scale the experts' input; layer 0 dense (moe_layers; wider than
    # k·I + shared: padded), layers 0-1 chunked RoPE, 2 NoPE
    "llama4_text": Case(
        config_class="Llama4TextConfig",
        config=dict(
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
        ),
        student="Llama4TextConfig",
        experts_key="num_local_experts",
        router="topk_sigmoid",
        renorm=False,
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
    # Mellum: Qwen3-MoE's block, MoE layers by mlp_layer_types, RoPE theta per attention layer type; layer 0 dense
    # (narrower than k·I); layers 0, 2 sliding (theta 1e4), 1 full (5e5)
    "mellum": Case(
        config_class="MellumConfig",
        config=dict(
            DENSE_FIRST,
            head_dim=8,
            intermediate_size=24,
            num_experts=6,
            norm_topk_prob=True,
            sliding_window=4,
            mlp_layer_types=DENSE_SPARSE_SPARSE,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        ),
        student="MellumConfig",
        experts_key="num_local_experts",
    ),
    # dots.3 note's text decoder: the V3 router with MoE layers by mlp_layer_types under MLA attention with
    # q_lora_rank, layer 0 dense; layers 0 and 2 run the DSA indexer (6 keys kept of the tests' 12 tokens), layer 1
    # a sliding window of 4 with its own (swa_*) head shapes
    "dots3_note_text": Case(
        config_class="Dots3NoteTextConfig",
        config=dict(
            DSA,
            head_dim=16,
            shared_experts_intermediate_size=16,
            mlp_layer_types=DENSE_SPARSE_SPARSE,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            index_topk=6,
            sliding_window=4,
            layer_types=["indexed_attention", "sliding_attention", "indexed_attention"],
            swa_num_attention_heads=4,
            swa_num_key_value_heads=4,
            swa_q_lora_rank=16,
            swa_kv_lora_rank=16,
            swa_head_dim=16,
            swa_qk_nope_head_dim=8,
            swa_v_head_dim=8,
        ),
        student="Dots3NoteTextConfig",
        **V3_ROUTER,
        **DEEPSEEK_MOE,
    ),
    # Flint: Qwen3-MoE's layer layout, a sigmoid router without correction bias (its weight in float32), an
    # ungated shared expert; layer 0 dense (narrower than k·I + shared); layers 0 and 2 sliding (RoPE), layer 1
    # full (NoPE); sinks
    "flint": Case(
        config_class="FlintConfig",
        config=dict(
            DENSE_FIRST,
            head_dim=8,
            intermediate_size=24,
            shared_expert_intermediate_size=16,
            num_experts=6,
            norm_topk_prob=True,
            mlp_only_layers=[0],
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        ),
        student="FlintConfig",
        router="sigmoid",
        shared="shared_expert",
        shared_width=16,
        router_dtype=torch.float32,
        corrected=False,
        attn_dtype=torch.float32,
    ),
    # Aria's text decoder: top-k of the logits, softmax over the k; experts stored transposed; a shared MLP at the
    # block's shared_experts; the dense sibling Llama; every layer MoE; attention and MLP biases (the routed
    # experts have none)
    "aria_text": Case(
        config_class="AriaTextConfig",
        config=dict(
            num_key_value_heads=2,
            head_dim=8,
            intermediate_size=16,
            num_hidden_layers=2,
            moe_num_experts=6,
            moe_topk=2,
            moe_num_shared_experts=1,
            attention_bias=True,
            mlp_bias=True,
        ),
        student="LlamaConfig",
        moe_layers=(0, 1),
        experts_key="moe_num_experts",
        shared="shared_experts",
        shared_width=16,
        router_attr="router",
        topk_key="moe_topk",
    ),
    # DeepSeek-V3.2-Exp: the V3 block under MLA with q_lora_rank (the indexer reads the query latent) and a DSA
    # indexer in every layer; layer 0 dense by first_k_dense_replace (mlp_layer_types derived from it); the
    # indexer keeps 8 of the tests' 12 tokens
    "deepseek_v32": Case(
        config_class="DeepseekV32Config",
        config=dict(
            DSA,
            first_k_dense_replace=1,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            index_topk=8,
        ),
        student="DeepseekV32Config",
        **V3_ROUTER,
        **DEEPSEEK_MOE,
        all_dense_student=True,
    ),
    # Laguna: sigmoid router whose correction bias is a frozen parameter, softcapped logits, the block's routed
    # output × moe_routed_scaling_factor, an ungated shared MLP; layer 0 dense (narrower than k·I + shared); layer
    # 1 sliding; a router softcap of 1.5 (the tiny logits reach several units, so the cap bends them); per-layer
    # head counts and the softplus output gate
    "laguna": Case(
        config_class="LagunaConfig",
        config=dict(
            DENSE_FIRST,
            head_dim=8,
            intermediate_size=24,
            shared_expert_intermediate_size=16,
            num_experts=6,
            mlp_layer_types=DENSE_SPARSE_SPARSE,
            sliding_window=4,
            layer_types=["full_attention", "sliding_attention", "full_attention"],
            num_attention_heads_per_layer=[4, 2, 4],
            moe_routed_scaling_factor=2.5,
            moe_router_logit_softcapping=1.5,
        ),
        student="LagunaConfig",
        router="sigmoid",
        scaled=True,
        shared="shared_experts",
        shared_width=16,
        scale_key="moe_routed_scaling_factor",
        block_scaled=True,
        softcap_attr="router_logit_softcapping",
        attn_dtype=torch.float32,
    ),
    # Beam: the V3 router (no shared experts) with dense layers by mlp_layer_types, the block multiplies the routed
    # sum by routed_scaling_factor; layer 0 dense (narrower than k·I); layers 0 and 2 sliding, layer 1 full; four
    # norms per layer; final_logit_softcapping is 30 in the real config: KD refuses it (test_beam.py)
    "beam": Case(
        config_class="BeamConfig",
        config=dict(
            DENSE_FIRST,
            head_dim=8,
            intermediate_size=24,
            num_experts=8,
            n_group=2,
            topk_group=1,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            mlp_layer_types=DENSE_SPARSE_SPARSE,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            final_logit_softcapping=None,
        ),
        student="BeamConfig",
        **V3_ROUTER,
        block_scaled=True,
        act_dtype=torch.float32,
    ),
}
FAMILIES = list(CASES)
DENSE_FAMILIES = [f for f in FAMILIES if CASES[f].dense_student]  # families whose tests build a dense student
NO_DENSE_FAMILIES = [f for f in FAMILIES if not CASES[f].dense_student]


def tiny_config(family: str, **overrides: Any):
    """The family's tiny config, built from its record; `overrides` replace any of its fields (a dict given for a
    dict-valued field, a sub-config such as DBRX's ffn_config, updates that dict)."""
    import transformers as tf

    if family not in CASES:
        raise ValueError(f"no tiny config for family {family!r}; families: {', '.join(FAMILIES)}")
    case = CASES[family]
    kw = {**(COMMON if case.with_common else {}), **case.config}
    for key, value in overrides.items():
        nested = isinstance(value, Mapping) and isinstance(kw.get(key), Mapping)
        kw[key] = {**kw[key], **value} if nested else value
    return getattr(tf, case.config_class)(**copy.deepcopy(kw))  # the records' lists stay unshared


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
    if CASES[family].router_dtype is not None:  # as from_pretrained builds it
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
    if not CASES[family].fused_experts:
        return params
    return {n: t.view(experts.num_experts, -1, t.shape[-1]) for n, t in params.items()}


def layers_of(family: str, model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a model of the family's class (DBRX: transformer.blocks)."""
    return model.get_submodule(CASES[family].layers)


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
    return block.get_submodule(CASES[family].router_attr)


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
