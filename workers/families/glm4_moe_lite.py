"""GLM-4.7-Flash (`Glm4MoeLiteMoE`) and EXAONE-MoE (`ExaoneMoeSparseMoEBlock`): the DeepSeek-V3 MoE block
again, with the MoE layers chosen by the config's `mlp_layer_types` ("sparse" / "dense") rather than by
first_k_dense_replace alone.

Router (`block.gate`): sigmoid scores; the choice is the group-limited top-k of scores +
e_score_correction_bias (n_group contiguous groups ranked by the sum of their top-2 biased scores,
topk_group kept); the weights are the unbiased scores of the chosen k, renormalized iff norm_topk_prob,
× routed_scaling_factor. Shared experts (moe_intermediate_size × n_shared_experts / num_shared_experts wide)
are ungated; "dense" layers are plain MLPs of intermediate_size. GLM-4.7-Flash has DeepSeek's MLA attention,
EXAONE-MoE q/k-normed attention with sliding-window layers (rope only there, NoPE on the full layers).

Student: the family's own class with every entry of mlp_layer_types "dense" (every layer a dense MLP of
width `width`, no MoE block): neither family has a dense sibling with its attention and norms (EXAONE-4's
dense layers are post-norm, GLM-4.7-Flash's MLA is DeepSeek's but its config is its own). Pruned and
merged MoE students: the DeepSeek-V3 rule for the group limit (workers.families.deepseek_v2).
"""

from __future__ import annotations

from workers.families.deepseek_v2 import DeepseekStyleAdapter

LITE_ROUTING = (
    "sigmoid scores, group-limited top-k of scores + e_score_correction_bias (groups ranked by their "
    "top-2 sum), unbiased scores renormalized iff norm_topk_prob, × routed_scaling_factor; ungated "
    "shared experts; dense layers by mlp_layer_types"
)


class Glm4MoeLiteAdapter(DeepseekStyleAdapter):
    name = "glm4_moe_lite"
    edited = ("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM", "fused")
    routing = LITE_ROUTING
    student = "same class, every layer dense (mlp_layer_types all 'dense')"
    model_types = ("glm4_moe_lite",)
    block_classes = ("Glm4MoeLiteMoE",)
    config_class = "Glm4MoeLiteConfig"
    dense_layers = "mlp_layer_types"
    student_dense_fields = ("mlp_layer_types",)


class ExaoneMoeAdapter(DeepseekStyleAdapter):
    name = "exaone_moe"
    edited = ("ExaoneMoeConfig", "ExaoneMoeForCausalLM", "fused")
    routing = LITE_ROUTING
    student = "same class, every layer dense (mlp_layer_types all 'dense', first_k_dense_replace = n)"
    model_types = ("exaone_moe",)
    block_classes = ("ExaoneMoeSparseMoEBlock",)
    config_class = "ExaoneMoeConfig"
    experts_key = "num_experts"
    shared_key = "num_shared_experts"
    dense_layers = "mlp_layer_types"
    student_dense_fields = ("mlp_layer_types", "first_k_dense_replace")
