"""Qwen2-MoE (`Qwen2MoeSparseMoeBlock`): softmax router, top-k, renormalized iff `norm_topk_prob`,
plus a shared expert gated per token by sigmoid(shared_expert_gate · h).

Student: a plain `Qwen2Config` model. APPROXIMATION (documented): a dense MLP cannot represent
the per-token sigmoid gate, so the shared expert gets a static scale s: the student's FFN is
Σ_g α_g f_g(h) + s·f_shared(h) while the teacher's is Σ_e g_e f_e(h) + σ(w·h) f_shared(h). Calibration
records Σ_t σ(w·h_t) (LayerStats.sum_shared_gate, via shared_gate); s is build_student's shared_scale,
from workers.families.base.shared_gate_scales: "one" (default, the gate dropped: its upper bound 1) or
"mean" (the calibration mean of the gate, §3.4's static scale ≈ the average routing). Distillation
absorbs the rest. Qwen2 always has q/k/v biases;
they are zero when the teacher has `qkv_bias=False`.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from workers.families.fused import FusedMoeAdapter, copy_config


class Qwen2MoeAdapter(FusedMoeAdapter):
    name = "qwen2_moe"
    edited = ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", "fused")
    routing = (
        "softmax over E, top-k, renormalized iff norm_topk_prob; one shared expert gated per token "
        "by sigmoid(w·h) (student: static scale, shared_gate_scales); dense layers by "
        "mlp_only_layers / decoder_sparse_step"
    )
    student = "dense sibling Qwen2"
    model_types = ("qwen2_moe",)
    block_classes = ("Qwen2MoeSparseMoeBlock",)
    shared_attr = "shared_expert"
    dense_layers = "mlp_only_layers"

    def config_shared_experts(self, config: Any) -> int:
        return 1 if int(config.shared_expert_intermediate_size) > 0 else 0

    def shared_gate(self, model: nn.Module, layer: int) -> nn.Module | None:
        return self.block(model, layer).shared_expert_gate if layer in self.moe_layers(model) else None

    def num_shared_experts(self, model: nn.Module) -> int:
        """The one gated shared expert (0 if it has no units)."""
        return 1 if self.shared_ffn(model, self.moe_layers(model)[0]).width > 0 else 0

    def student_config(self, teacher: nn.Module, width: int) -> Any:
        from transformers import Qwen2Config

        return copy_config(
            teacher.config,
            Qwen2Config,
            intermediate_size=int(width),
            head_dim=int(teacher.model.layers[0].self_attn.head_dim),
        )
