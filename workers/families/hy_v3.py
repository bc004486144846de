"""Hy-V3 (`hy_v3`, `HYV3MoE`): MiniMax-M2's MoE block (the sigmoid router takes its correction bias from the
block's `e_score_correction_bias` buffer) with a constant factor, an ungated shared MLP and dense layers chosen
by `mlp_layer_types`; reuses the MiniMax-M2 adapter's router semantics.

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

from typing import Any

from torch import nn

from workers.core.types import DenseFFN
from workers.families.fused import FusedMoeAdapter, config_int, copy_config
from workers.families.minimax_m2 import MiniMaxM2Adapter


class HYV3Adapter(MiniMaxM2Adapter):
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

    def config_moe_layers(self, config: Any) -> list[int]:
        n = config_int(config, "num_hidden_layers")
        types = list(getattr(config, "mlp_layer_types", None) or [])
        if len(types) != n or not set(types) <= {"sparse", "dense"}:
            raise ValueError(
                f"hy_v3 config: mlp_layer_types={types!r}, expected {n} entries of 'sparse' / 'dense'"
            )
        return [i for i, t in enumerate(types) if t == "sparse"]

    def config_shared_experts(self, config: Any) -> int:
        return config_int(config, "num_shared_experts")

    def scale(self, router: nn.Module) -> float:
        return float(router.router_scaling_factor)

    def num_shared_experts(self, model: nn.Module) -> int:
        return self.shared_units(model)

    def student_config(self, teacher: nn.Module, width: int) -> Any:
        from transformers import HYV3Config

        n = config_int(teacher.config, "num_hidden_layers")
        return copy_config(
            teacher.config,
            HYV3Config,
            intermediate_size=int(width),
            mlp_layer_types=["dense"] * n,
            output_router_logits=False,
        )

    def student_ffn_params(self, layer: int, ffn: DenseFFN) -> dict[str, Any]:
        """A plain gate/up/down HYV3MLP (not MiniMax-M2's one-expert block)."""
        return FusedMoeAdapter.student_ffn_params(self, layer, ffn)
