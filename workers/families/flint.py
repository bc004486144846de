"""Flint (`flint`, `FlintSparseMoeBlock`): Qwen3-MoE's layer layout with a sigmoid router without a correction
bias and one ungated shared expert; reuses the Qwen3-MoE adapter (MoE layers by mlp_only_layers /
decoder_sparse_step, fused [E, 2I, H] experts) with the sigmoid router semantics of DeepSeek-V3 minus the bias.

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

import torch
from torch import nn

from workers.families.fused import config_int, copy_config
from workers.families.qwen3_moe import Qwen3MoeAdapter


class FlintAdapter(Qwen3MoeAdapter):
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

    def config_shared_experts(self, config: Any) -> int:
        return 1 if config_int(config, "shared_expert_intermediate_size") > 0 else 0

    def num_shared_experts(self, model: nn.Module) -> int:
        """The one ungated shared expert (0 if it has no units)."""
        return 1 if self.shared_ffn(model, self.moe_layers(model)[0]).width > 0 else 0

    def gate_values(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(logits.float())

    def student_config(self, teacher: nn.Module, width: int) -> Any:
        from transformers import FlintConfig

        n = config_int(teacher.config, "num_hidden_layers")
        return copy_config(
            teacher.config,
            FlintConfig,
            intermediate_size=int(width),
            mlp_only_layers=list(range(n)),
            output_router_logits=False,
        )
