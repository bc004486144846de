"""GLM-5 (`glm_moe_dsa`, `GlmMoeDsaMoE`): GLM-4.7-Flash's DeepSeek-V3 MoE block (sigmoid router with a
correction bias, group-limited top-k, unbiased scores renormalized iff norm_topk_prob, × routed_scaling_factor;
ungated shared experts; MoE layers by `mlp_layer_types`), under MLA attention with DeepSeek's sparse-attention
indexer (per layer `indexer_types`: "full" runs the indexer, "shared" reuses the previous full layer's top-k
tokens). The indexer is plain torch (eager / SDPA turn its top-k into an additive mask; no CUDA kernel): the
model runs on CPU in any float dtype. A decoder layer returns (hidden states, top-k tokens) and the next
layer takes the top-k as prev_topk_indices (layer_output: the streamed calibration carries it).

Student: the same class with every entry of mlp_layer_types "dense" and first_k_dense_replace = n (every layer
a dense MLP of width `width`; attention, indexer and norms copied from the teacher).
"""

from __future__ import annotations

from typing import Any

import torch

from workers.families.deepseek_v2 import DeepseekStyleAdapter


class GlmMoeDsaAdapter(DeepseekStyleAdapter):
    name = "glm_moe_dsa"
    edited = ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM", "fused")
    routing = (
        "as glm4_moe_lite (V3 sigmoid router, group-limited, renormalized iff norm_topk_prob, "
        "× routed_scaling_factor; dense layers by mlp_layer_types); DSA-indexer attention"
    )
    student = "same class, every layer dense (mlp_layer_types all 'dense', first_k_dense_replace = n)"
    model_types = ("glm_moe_dsa",)
    block_classes = ("GlmMoeDsaMoE",)
    config_class = "GlmMoeDsaConfig"
    dense_layers = "mlp_layer_types"
    student_dense_fields = ("mlp_layer_types", "first_k_dense_replace")

    def layer_output(self, output: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        """(hidden states, {prev_topk_indices: this layer's DSA top-k}), as GlmMoeDsaModel.forward passes it on."""
        hidden, topk = output
        return hidden, {"prev_topk_indices": topk}

    def recorded_layer_output(self, hidden: torch.Tensor) -> Any:
        return hidden, None
