"""OLMoE (`OlmoeSparseMoeBlock`): softmax router, top-k, renormalized iff `norm_topk_prob`.

No dense HF class matches OLMoE's attention (q/k norm over the full projection; Olmo has none,
Olmo2 is post-norm), so the student is the same class with one expert and top-1: the softmax over
one logit is exactly 1, so each layer is exactly its dense FFN.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from workers.core.types import DenseFFN
from workers.families.fused import FusedMoeAdapter, copy_config


class OlmoeAdapter(FusedMoeAdapter):
    name = "olmoe"
    edited = ("OlmoeConfig", "OlmoeForCausalLM", "fused")
    routing = "softmax over E, top-k, renormalized iff norm_topk_prob; no shared experts"
    student = "same class, one expert, top-1"
    model_types = ("olmoe",)
    block_classes = ("OlmoeSparseMoeBlock",)

    def student_config(self, teacher: nn.Module, width: int) -> Any:
        from transformers import OlmoeConfig

        cfg = copy_config(
            teacher.config,
            OlmoeConfig,
            intermediate_size=int(width),
            num_experts=1,
            num_experts_per_tok=1,
            norm_topk_prob=True,
            output_router_logits=False,
        )
        cfg._experts_implementation = teacher.config._experts_implementation
        return cfg

    def student_ffn_params(self, layer: int, ffn: DenseFFN) -> dict[str, torch.Tensor]:
        if ffn.gate_bias is not None or ffn.up_bias is not None or ffn.down_bias is not None:
            raise ValueError(f"layer {layer}: OLMoE experts have no biases, the FFN has some")
        pre = f"model.layers.{layer}.mlp."
        return {
            pre + "gate.weight": ffn.gate.new_zeros(1, ffn.gate.shape[1]),
            pre + "experts.gate_up_proj": torch.cat([ffn.gate, ffn.up], dim=0)[None],
            pre + "experts.down_proj": ffn.down[None],
        }
