"""Qwen3-MoE (`Qwen3MoeSparseMoeBlock`): softmax router, top-k, renormalized iff `norm_topk_prob`.

Student: a plain `Qwen3Config` model (same attention incl. q_norm/k_norm);
dense teacher layers (`mlp_only_layers`, `decoder_sparse_step`) are zero-padded to the student width.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from workers.families.fused import FusedMoeAdapter, copy_config


class Qwen3MoeAdapter(FusedMoeAdapter):
    name = "qwen3_moe"
    edited = ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", "fused")
    routing = (
        "softmax over E, top-k, renormalized iff norm_topk_prob; no shared experts; dense layers by "
        "mlp_only_layers / decoder_sparse_step"
    )
    student = "dense sibling Qwen3"
    model_types = ("qwen3_moe",)
    block_classes = ("Qwen3MoeSparseMoeBlock",)
    dense_layers = "mlp_only_layers"

    def student_config(self, teacher: nn.Module, width: int) -> Any:
        from transformers import Qwen3Config

        tc = teacher.config
        n = tc.num_hidden_layers
        sliding = getattr(tc, "sliding_window", None)
        return copy_config(
            tc,
            Qwen3Config,
            intermediate_size=int(width),
            head_dim=int(teacher.model.layers[0].self_attn.head_dim),
            use_sliding_window=sliding is not None,
            sliding_window=sliding,
            layer_types=["sliding_attention" if sliding is not None else "full_attention"] * n,
        )
