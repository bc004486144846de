"""DeepSeek-V3.2-Exp (`deepseek_v32`, `DeepseekV32MoE`): DeepSeek-V3's MoE block unchanged (sigmoid router
with e_score_correction_bias, group-limited top-k with groups ranked by their top-2 biased scores, unbiased
scores renormalized iff norm_topk_prob, × routed_scaling_factor; ungated shared experts
moe_intermediate_size × n_shared_experts wide), with the MoE layers chosen by `mlp_layer_types` (its config
derives it from first_k_dense_replace when unset), under MLA attention with DeepSeek's sparse-attention
indexer in every layer (plain torch: the top-k tokens become an additive mask under eager / SDPA; no CUDA
kernel, runs on CPU). Unlike GLM-5 (glm_moe_dsa) no layer reuses another's top-k: a decoder layer returns its
hidden states alone. The DeepSeek-V3-style base (the V3 router rules) with the MoE layers by mlp_layer_types.

Student: the same class with every entry of mlp_layer_types "dense" and first_k_dense_replace = n (every layer
a dense MLP of width `width`; attention, indexer and norms copied from the teacher).
"""

from __future__ import annotations

from workers.families.deepseek_v2 import DeepseekStyleAdapter


class DeepseekV32Adapter(DeepseekStyleAdapter):
    name = "deepseek_v32"
    edited = ("DeepseekV32Config", "DeepseekV32ForCausalLM", "fused")
    routing = (
        "as deepseek_v3 (sigmoid router + e_score_correction_bias, group-limited, renormalized iff "
        "norm_topk_prob, × routed_scaling_factor; ungated shared experts); dense layers by mlp_layer_types; "
        "DSA-indexer attention"
    )
    student = "same class, every layer dense (mlp_layer_types all 'dense', first_k_dense_replace = n)"
    model_types = ("deepseek_v32",)
    block_classes = ("DeepseekV32MoE",)
    config_class = "DeepseekV32Config"
    dense_layers = "mlp_layer_types"
    student_dense_fields = ("mlp_layer_types", "first_k_dense_replace")
