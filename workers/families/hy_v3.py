"""Hy-V3 (`hy_v3`, `HYV3MoE`): MiniMax-M2's MoE block (the sigmoid router takes its correction bias from the
block's `e_score_correction_bias` buffer) with a constant factor, an ungated shared MLP and dense layers chosen
by `mlp_layer_types`; MiniMax-M2's router semantics, in fields.

Router (`block.gate`, `HYV3TopKRouter`): scores = sigmoid(W h) in float32; the choice is the top-k of scores +
the block's e_score_correction_bias (no groups); the weights are the unbiased scores of the chosen k, always
renormalized over them, × router_scaling_factor (a field of the router, not DeepSeek's routed_scaling_factor).
Shared experts: one `HYV3MLP` (`shared_experts`, moe_intermediate_size × num_shared_experts wide, biases iff
mlp_bias) added to every token (in float32 where enable_moe_fp32_combine). "dense" layers are `HYV3MLP`s of
intermediate_size. Attention: Apertus' (per-head q/k RMSNorm before RoPE).

Student: the same class with every entry of mlp_layer_types "dense" (every layer an `HYV3MLP` of width
`width`, no MoE block): no dense sibling has its attention with a SiLU MLP (Apertus' MLP is xIELU).
"""

from __future__ import annotations

from workers.families.fused import FusedMoeAdapter


class HYV3Adapter(FusedMoeAdapter):
    name = "hy_v3"
    edited = ("HYV3Config", "HYV3ForCausalLM", "fused")
    routing = (
        "sigmoid scores, top-k of scores + the block's e_score_correction_bias, unbiased scores "
        "renormalized over the k, × router_scaling_factor; ungated shared MLP; dense layers by "
        "mlp_layer_types"
    )
    student = "same class, every layer dense (mlp_layer_types all 'dense')"
    model_types = ("hy_v3",)
    block_classes = ("HYV3MoE",)
    experts_key = "num_experts"
    shared_attr = "shared_experts"
    shared_key = "num_shared_experts"
    scores = "sigmoid"
    correction_bias = "e_score_correction_bias"  # the block's buffer, passed to the router's forward
    renorm = True  # no config flag: the router always renormalizes
    scale_attr = "router_scaling_factor"  # a field of the router, not DeepSeek's routed_scaling_factor
    dense_layers = "mlp_layer_types"
    config_class = "HYV3Config"
    student_dense_fields = ("mlp_layer_types",)
