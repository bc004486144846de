"""GLM-4.5 / GLM-4.6 (`Glm4MoeMoE`) and dots.llm1 (`Dots1MoE`): the DeepSeek-V3 MoE block under another
name (transformers builds both from the same modular code), so they take the DeepSeek-V3-style base unchanged.

Router: sigmoid scores; the choice takes the group-limited top-k of scores + e_score_correction_bias
(n_group contiguous groups ranked by the sum of their top-2 biased scores, topk_group of them kept); the
weights are the unbiased sigmoid scores of the chosen k, renormalized iff norm_topk_prob, ×
routed_scaling_factor. Shared experts (n_shared_experts × moe_intermediate_size wide) are ungated and
added to every token; the first first_k_dense_replace layers are dense MLPs (intermediate_size).

Student: the family's own class with first_k_dense_replace = num_hidden_layers, i.e. every layer a dense
MLP of width `width` and no MoE block at all (GLM-4's dense sibling `Glm4` has extra post-norms, dots1
has none: the same class is the exact match of attention, norms and rope). Pruned and merged MoE
students: the DeepSeek-V3 rule for the group limit (workers.families.deepseek_v2).
"""

from __future__ import annotations

from workers.families.deepseek_v2 import DeepseekStyleAdapter


class Glm4MoeAdapter(DeepseekStyleAdapter):
    name = "glm4_moe"
    edited = ("Glm4MoeConfig", "Glm4MoeForCausalLM", "fused")
    routing = (
        "sigmoid scores, group-limited top-k of scores + e_score_correction_bias (groups ranked by their "
        "top-2 sum), unbiased scores renormalized iff norm_topk_prob, × routed_scaling_factor; ungated "
        "shared experts; first_k_dense_replace dense layers"
    )
    student = "same class, every layer dense (first_k_dense_replace = num_hidden_layers)"
    model_types = ("glm4_moe",)
    block_classes = ("Glm4MoeMoE",)
    config_class = "Glm4MoeConfig"
    student_dense_fields = ("first_k_dense_replace",)


class Dots1Adapter(DeepseekStyleAdapter):
    name = "dots1"
    edited = ("Dots1Config", "Dots1ForCausalLM", "fused")
    routing = (
        "sigmoid scores, group-limited top-k of scores + e_score_correction_bias (groups ranked by their "
        "top-2 sum), unbiased scores renormalized iff norm_topk_prob, × routed_scaling_factor; ungated "
        "shared experts; first_k_dense_replace dense layers"
    )
    student = "same class, every layer dense (first_k_dense_replace = num_hidden_layers)"
    model_types = ("dots1",)
    block_classes = ("Dots1MoE",)
    config_class = "Dots1Config"
    student_dense_fields = ("first_k_dense_replace",)
