"""FlexOlmo (`FlexOlmoSparseMoeBlock`): OLMoE's router (softmax over E, top-k, renormalized iff
norm_topk_prob) and fused experts in OLMo-2's post-norm decoder (q/k RMSNorm over the whole projection,
RMSNorm after attention and after the FFN); every layer MoE, no shared experts.

Student: the dense sibling `Olmo2Config` (the same attention, norms and decoder layer, an `Olmo2MLP` of
width `width`), with FlexOlmo's rope parameters and rms_norm_eps copied (Olmo2's defaults differ).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from workers.families.fused import FusedMoeAdapter, copy_config


class FlexOlmoAdapter(FusedMoeAdapter):
    name = "flex_olmo"
    edited = ("FlexOlmoConfig", "FlexOlmoForCausalLM", "fused")
    routing = "softmax over E, top-k, renormalized iff norm_topk_prob; no shared experts"
    student = "dense sibling Olmo2"
    model_types = ("flex_olmo",)
    block_classes = ("FlexOlmoSparseMoeBlock",)

    def student_config(self, teacher: nn.Module, width: int) -> Any:
        from transformers import Olmo2Config

        tc = teacher.config
        return copy_config(
            tc,
            Olmo2Config,
            intermediate_size=int(width),
            rope_parameters=dict(tc.rope_parameters),
            rms_norm_eps=tc.rms_norm_eps,
        )
