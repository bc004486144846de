"""Mellum (`MellumSparseMoeBlock`): Qwen3-MoE's block and router unchanged (softmax over E, top-k, renormalized
iff norm_topk_prob; no shared experts), the fused machinery's defaults; only the MoE layers differ: they
are the "sparse" entries of the config's `mlp_layer_types` ("dense" ones are plain MLPs of intermediate_size).
The routed expert count is `num_local_experts` (the config maps `num_experts` onto it). Multi-token-prediction
weights (`mtp.*`) are not part of MellumForCausalLM and are ignored on load.

Student: the same class with every entry of mlp_layer_types "dense" (every layer a dense MLP of width `width`,
no MoE block). Not the dense sibling Qwen3: Mellum's RoPE has one theta per attention layer type (sliding and
full layers differ), which Qwen3's single rope theta cannot express.
"""

from __future__ import annotations

from workers.families.fused import FusedMoeAdapter


class MellumAdapter(FusedMoeAdapter):
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
    dense_layers = "mlp_layer_types"
    config_class = "MellumConfig"
    student_dense_fields = ("mlp_layer_types",)
