"""MiMo-V2-Flash (`mimo_v2_flash`, `MiMoV2FlashMoE`): DeepSeek-V3's router and fused experts without shared
experts, the MoE layers chosen by the config's `mlp_layer_types` ("sparse" / "dense"), as GLM-4.7-Flash's
(the DeepSeek-V3-style base with no shared experts).

Router (`block.gate`): sigmoid scores; the choice is the group-limited top-k of scores + e_score_correction_bias
(n_group contiguous groups ranked by the sum of their top-2 biased scores, topk_group kept); the weights are the
unbiased scores of the chosen k, renormalized iff norm_topk_prob, × routed_scaling_factor. No shared experts;
"dense" layers are plain MLPs of intermediate_size. Attention: hybrid full / sliding-window softmax attention
(sliding layers with twice the KV heads and per-head attention sinks), partial RoPE with per-layer-type theta,
a value head dim of its own and values × attention_value_scale; eager (or flash) only, no SDPA.

Student: the same class with every entry of mlp_layer_types "dense" (every layer a dense MLP of width
`width`, no MoE block): no dense class has its attention. Pruned and merged MoE students: the DeepSeek-V3 rule
for the group limit (workers.families.deepseek_v2).
"""

from __future__ import annotations

from workers.families.deepseek_v2 import DeepseekStyleAdapter


class MiMoV2FlashAdapter(DeepseekStyleAdapter):
    name = "mimo_v2_flash"
    edited = ("MiMoV2FlashConfig", "MiMoV2FlashForCausalLM", "fused")
    routing = (
        "sigmoid scores, group-limited top-k of scores + e_score_correction_bias (groups ranked by their "
        "top-2 sum), unbiased scores renormalized iff norm_topk_prob, × routed_scaling_factor; no shared "
        "experts; dense layers by mlp_layer_types"
    )
    student = "same class, every layer dense (mlp_layer_types all 'dense')"
    model_types = ("mimo_v2_flash",)
    block_classes = ("MiMoV2FlashMoE",)
    config_class = "MiMoV2FlashConfig"
    shared_attr = None  # MiMoV2FlashMoE deletes DeepSeek-V3's shared experts
    shared_key = None
    dense_layers = "mlp_layer_types"
    student_dense_fields = ("mlp_layer_types",)
