"""MiniMax-M2 (`MiniMaxM2SparseMoeBlock`): sigmoid router with a bias-corrected top-k, no groups, no
shared experts, every layer MoE.

Router (`block.gate`): scores = sigmoid(W h); the choice is the top-k of scores + the block's
e_score_correction_bias (a buffer of the block, passed to the router's forward); the weights are the
unbiased scores of the chosen k, always renormalized over them; no constant factor. p (router_decision)
is the sigmoid scores normalized over all E, so p restricted to the chosen k and renormalized is the
applied weights.

Pruned / merged MoE: the router rows, the correction bias and the experts sliced (or combined) per expert;
top-k and the renormalization unchanged (no groups to keep).

Student: no dense class has MiniMax-M2's attention (q/k RMSNorm over the whole projection, partial
rotary), so the student is the same class with one expert and top-1: sigmoid(0) renormalized over one
expert is exactly 1, so each layer is exactly its dense FFN.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from workers.core.types import DenseFFN
from workers.families.fused import FusedMoeAdapter, copy_config


class MiniMaxM2Adapter(FusedMoeAdapter):
    name = "minimax_m2"
    edited = ("MiniMaxM2Config", "MiniMaxM2ForCausalLM", "fused")
    routing = (
        "sigmoid scores, top-k of scores + the block's e_score_correction_bias, unbiased scores "
        "renormalized over the k; no shared experts"
    )
    student = "same class, one expert, top-1"
    model_types = ("minimax_m2",)
    block_classes = ("MiniMaxM2SparseMoeBlock",)
    experts_key = "num_local_experts"
    scores = "sigmoid"
    # a buffer of the block, passed on: MiniMaxM2TopKRouter.forward(hidden_states, e_score_correction_bias)
    correction_bias = "e_score_correction_bias"
    renorm = True  # no config flag: the router always renormalizes

    def student_config(self, teacher: nn.Module, width: int) -> Any:
        from transformers import MiniMaxM2Config

        cfg = copy_config(
            teacher.config,
            MiniMaxM2Config,
            intermediate_size=int(width),
            num_local_experts=1,
            num_experts_per_tok=1,
            output_router_logits=False,
        )
        cfg._experts_implementation = teacher.config._experts_implementation
        return cfg

    def student_ffn_params(self, layer: int, ffn: DenseFFN) -> dict[str, torch.Tensor]:
        if ffn.gate_bias is not None or ffn.up_bias is not None or ffn.down_bias is not None:
            raise ValueError(f"layer {layer}: MiniMax-M2 experts have no biases, the FFN has some")
        pre = f"model.layers.{layer}.mlp."
        return {
            pre + "gate.weight": ffn.gate.new_zeros(1, ffn.gate.shape[1]),
            pre + "e_score_correction_bias": ffn.gate.new_zeros(1),
            pre + "experts.gate_up_proj": torch.cat([ffn.gate, ffn.up], dim=0)[None],
            pre + "experts.down_proj": ffn.down[None],
        }
