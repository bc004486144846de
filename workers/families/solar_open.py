"""Solar Open (`solar_open`, `SolarOpenMoE`): GLM-4.5's MoE block (transformers builds it from the same modular
code, so it takes the DeepSeek-V3-style base unchanged) in Llama decoder layers, every layer MoE.

Router (`block.gate`): sigmoid scores; the choice is the group-limited top-k of scores + e_score_correction_bias
(n_group contiguous groups ranked by the sum of their top-2 biased scores, topk_group kept; the released model
has n_group = 1); the weights are the unbiased scores of the chosen k, renormalized iff norm_topk_prob, ×
routed_scaling_factor. Shared experts (n_shared_experts × moe_intermediate_size wide) are ungated; no dense layer
(the config has neither first_k_dense_replace nor intermediate_size).

Student: the dense sibling `LlamaConfig`: the decoder layer, attention (q/k/v biases iff attention_bias, o_proj
without bias: the Llama student's o_proj bias, where attention_bias builds one, is zeros), RMSNorm and RoPE are
Llama's. Solar's RoPE honours a partial_rotary_factor, Llama's does not; a factor other than 1 is refused in one
line (Solar's own attention rotates the whole head, so such a config does not run either).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from workers.families.deepseek_v2 import DeepseekStyleAdapter
from workers.families.fused import copy_config


class SolarOpenAdapter(DeepseekStyleAdapter):
    name = "solar_open"
    edited = ("SolarOpenConfig", "SolarOpenForCausalLM", "fused")
    routing = (
        "sigmoid scores, group-limited top-k of scores + e_score_correction_bias (groups ranked by their "
        "top-2 sum), unbiased scores renormalized iff norm_topk_prob, × routed_scaling_factor; ungated "
        "shared experts; every layer MoE"
    )
    student = "dense sibling Llama"
    model_types = ("solar_open",)
    block_classes = ("SolarOpenMoE",)
    config_class = "SolarOpenConfig"
    dense_layers = ""  # every layer MoE (the config has no first_k_dense_replace)

    def student_config(self, teacher: nn.Module, width: int) -> Any:
        from transformers import LlamaConfig

        tc = teacher.config
        rope = dict(tc.rope_parameters)
        if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError(
                f"solar_open config: rope_parameters.partial_rotary_factor="
                f"{rope['partial_rotary_factor']!r}; only 1.0 (the whole head rotated) is supported"
            )
        return copy_config(
            tc,
            LlamaConfig,
            intermediate_size=int(width),
            rope_parameters=rope,
            rms_norm_eps=tc.rms_norm_eps,
            head_dim=tc.head_dim,
            mlp_bias=False,
        )
