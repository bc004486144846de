"""Flint (`flint`, `FlintSparseMoeBlock`): Qwen3-MoE's layer layout with a sigmoid router without a correction
bias and one ungated shared expert: Qwen3-MoE's layout (MoE layers by mlp_only_layers / decoder_sparse_step,
fused [E, 2I, H] experts) with the sigmoid router semantics of DeepSeek-V3 minus the bias, in fields.

Router (`block.gate`, `FlintTopKRouter`; its [E, H] weight is kept in float32): logits = W h in float32,
scores = sigmoid(logits); the choice is the top-k of the scores (no bias, no groups); the weights are the
scores of the chosen k, renormalized over them iff norm_topk_prob; no constant factor. p (router_decision) is
the sigmoid scores normalized over all E, so p restricted to the chosen k and renormalized equals the
renormalized weights. Shared expert: `block.shared_expert`, a SiLU MLP of shared_expert_intermediate_size,
added in full to every token (no gate). Dense layers are `FlintMLP`s of intermediate_size.

Student: the same class with mlp_only_layers = every layer (each a dense FlintMLP of width `width`). No dense
sibling has Flint's attention (per-head learned sinks, q/k RMSNorm, RoPE on sliding layers only, NoPE on full
ones). Pruned / merged MoE: router rows and experts sliced (or combined); k and norm_topk_prob unchanged.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from workers.families.fused import FusedMoeAdapter, config_int


class FlintAdapter(FusedMoeAdapter):
    name = "flint"
    edited = ("FlintConfig", "FlintForCausalLM", "fused")
    routing = (
        "sigmoid scores (no correction bias), top-k, renormalized iff norm_topk_prob; one ungated shared "
        "expert; dense layers by mlp_only_layers / decoder_sparse_step"
    )
    student = "same class, every layer dense (mlp_only_layers = all layers)"
    model_types = ("flint",)
    block_classes = ("FlintSparseMoeBlock",)
    shared_attr = "shared_expert"
    scores = "sigmoid"  # no correction bias, no groups
    dense_layers = "mlp_only_layers"
    config_class = "FlintConfig"
    student_dense_fields = ("mlp_only_layers",)

    def config_shared_experts(self, config: Any) -> int:
        return 1 if config_int(config, "shared_expert_intermediate_size") > 0 else 0

    def num_shared_experts(self, model: nn.Module) -> int:
        """The one ungated shared expert (0 if it has no units)."""
        return 1 if self.shared_ffn(model, self.moe_layers(model)[0]).width > 0 else 0
