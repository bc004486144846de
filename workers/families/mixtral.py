"""Mixtral (`MixtralSparseMoeBlock`): softmax router, top-k, always renormalized over the k.

Student: a plain `MistralConfig` model, exact only with Mixtral's rope parameters, rms_norm_eps,
head_dim and sliding_window copied (Mistral's defaults differ: θ=1e4, eps 1e-6, head_dim 128, window 4096).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from workers.families.fused import FusedMoeAdapter, copy_config


class MixtralAdapter(FusedMoeAdapter):
    name = "mixtral"
    edited = ("MixtralConfig", "MixtralForCausalLM", "fused")
    routing = "softmax over E, top-k, always renormalized; no shared experts"
    student = "dense sibling Mistral"
    model_types = ("mixtral",)
    block_classes = ("MixtralSparseMoeBlock",)
    experts_key = "num_local_experts"
    renorm = True  # no config flag: MixtralTopKRouter always divides by the top-k sum

    def student_config(self, teacher: nn.Module, width: int) -> Any:
        from transformers import MistralConfig

        tc = teacher.config
        return copy_config(
            tc,
            MistralConfig,
            intermediate_size=int(width),
            head_dim=int(teacher.model.layers[0].self_attn.head_dim),
            rope_parameters=dict(tc.rope_parameters),
            rms_norm_eps=tc.rms_norm_eps,
            sliding_window=tc.sliding_window,
        )
