"""Mellum (`MellumSparseMoeBlock`): Qwen3-MoE's block and router unchanged (softmax over E, top-k, renormalized
iff norm_topk_prob; no shared experts), so it reuses the Qwen3-MoE adapter; only the MoE layers differ: they
are the "sparse" entries of the config's `mlp_layer_types` ("dense" ones are plain MLPs of intermediate_size).
The routed expert count is `num_local_experts` (the config maps `num_experts` onto it). Multi-token-prediction
weights (`mtp.*`) are not part of MellumForCausalLM and are ignored on load.

Student: the same class with every entry of mlp_layer_types "dense" (every layer a dense MLP of width `width`,
no MoE block). Not the dense sibling Qwen3: Mellum's RoPE has one theta per attention layer type (sliding and
full layers differ), which Qwen3's single rope theta cannot express.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from workers.families.fused import config_int, copy_config
from workers.families.qwen3_moe import Qwen3MoeAdapter


class MellumAdapter(Qwen3MoeAdapter):
    name = "mellum"
    edited = ("MellumConfig", "MellumForCausalLM", "fused")
    routing = (
        "softmax over E, top-k, renormalized iff norm_topk_prob (Qwen3-MoE's router); no shared experts; "
        "dense layers by mlp_layer_types"
    )
    student = "same class, every layer dense (mlp_layer_types all 'dense')"
    model_types = ("mellum",)
    block_classes = ("MellumSparseMoeBlock",)
    experts_key = "num_local_experts"

    def config_moe_layers(self, config: Any) -> list[int]:
        n = config_int(config, "num_hidden_layers")
        types = list(getattr(config, "mlp_layer_types", None) or [])
        if len(types) != n or not set(types) <= {"sparse", "dense"}:
            raise ValueError(
                f"mellum config: mlp_layer_types={types!r}, expected {n} entries of 'sparse' / 'dense'"
            )
        return [i for i, t in enumerate(types) if t == "sparse"]

    def student_config(self, teacher: nn.Module, width: int) -> Any:
        from transformers import MellumConfig

        n = teacher.config.num_hidden_layers
        return copy_config(
            teacher.config,
            MellumConfig,
            intermediate_size=int(width),
            mlp_layer_types=["dense"] * n,
            output_router_logits=False,
        )
