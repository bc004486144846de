"""Qwen3-MoE (`Qwen3MoeSparseMoeBlock`): softmax router, top-k, renormalized iff `norm_topk_prob`.

Student: a plain `Qwen3Config` model (same attention incl. q_norm/k_norm);
dense teacher layers (`mlp_only_layers`, `decoder_sparse_step`) are zero-padded to the student width.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from workers.families.fused import FusedMoeAdapter, config_int, copy_config


def sparse_step_moe_layers(config: Any) -> list[int]:
    """Qwen2-MoE / Qwen3-MoE decoder layers built as MoE blocks: not in mlp_only_layers, and every
    decoder_sparse_step-th layer (when the config has experts at all)."""
    n = config_int(config, "num_hidden_layers")
    step = config_int(config, "decoder_sparse_step")
    dense = set(getattr(config, "mlp_only_layers", None) or [])
    if int(config.num_experts) <= 0:
        return []
    return [i for i in range(n) if i not in dense and (i + 1) % step == 0]


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

    def config_moe_layers(self, config: Any) -> list[int]:
        return sparse_step_moe_layers(config)

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
