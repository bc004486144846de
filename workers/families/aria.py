"""Aria's text decoder (`AriaTextForCausalLM`, model_type aria_text; block `AriaTextMoELayer` at `mlp`, every
layer MoE): a softmax router renormalized over the top-k, experts stored transposed, an ungated shared MLP.
Reuses the fused machinery with Llama-4's transposed expert views (without its input scaling).

Router (`block.router`, `AriaTextTopKRouter`, an [E, H] weight without bias): the top-k of the logits z, the
weights the softmax over those k logits, which is p = softmax over all E renormalized over the k; no constant
factor, no bias. E is `moe_num_experts`, k is `moe_topk`.

Experts (`AriaExperts`, always SiLU): `gate_up_proj` [E, H, 2I] applied as x @ W (gate columns first, then up),
`down_proj` [E, I, H]; their intermediate units lie on axis 2 (halves) and axis 1. Shared experts:
`block.shared_experts`, one gate/up/down MLP of intermediate_size × moe_num_shared_experts (biases iff
mlp_bias, activation hidden_act), added to every token.

Student: the dense sibling Llama, exact: Aria's decoder layer, attention (q/k/v/o biases iff attention_bias),
RMSNorm and RoPE are Llama's; the student's MLP has biases iff mlp_bias (the routed part's are zeros). A
hidden_act other than SiLU is refused in one line (the routed experts are SiLU, the student has one
activation). Pruned / merged MoE: router rows and experts sliced (or combined), k unchanged. The edited output
is refused (its factored experts rebuild the [E, 2I, H] fused layout, Aria's are [E, H, 2I]). The multimodal
`aria` (AriaForConditionalGeneration) is refused naming aria_text.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from workers.core.shape import TeacherShape
from workers.core.types import ExpertWeights
from workers.families.fused import (
    TRANSPOSED_UNIT_LAYOUT,
    FusedMoeAdapter,
    config_int,
    copy_config,
    transposed_expert_weights,
)


class AriaTextAdapter(FusedMoeAdapter):
    name = "aria_text"
    routing = (
        "top-k of the logits, softmax over the k (= p renormalized over the k); one ungated shared MLP "
        "(moe_num_shared_experts × intermediate_size); no dense layers"
    )
    student = "dense sibling Llama"
    model_types = ("aria_text",)
    block_classes = ("AriaTextMoELayer",)
    router_attr = "router"
    shared_attr = "shared_experts"
    experts_key = "moe_num_experts"
    shared_key = "moe_num_shared_experts"
    renorm = True  # the softmax over the chosen k logits
    unit_layout = TRANSPOSED_UNIT_LAYOUT
    refused_outputs: Mapping[str, str] = {
        "edited": "cannot write an edited checkpoint: its factored experts rebuild the [E, 2I, H] fused layout, "
        "Aria's experts are stored transposed, [E, H, 2I]"
    }

    # --- structure from the config alone -------------------------------------------------------
    def shape_from_config(self, config: Any) -> TeacherShape:
        model_type = getattr(config, "model_type", None)
        if model_type not in self.model_types:
            raise ValueError(f"config model_type={model_type!r}: the {self.name} adapter handles aria_text")
        e, k = config_int(config, "moe_num_experts"), config_int(config, "moe_topk")
        if e < 1:
            raise ValueError(f"aria_text config: moe_num_experts={e} builds no routed MoE layer")
        if not 1 <= k <= e:
            raise ValueError(f"aria_text config: moe_topk={k} must be in 1..{e} (moe_num_experts)")
        return TeacherShape(
            family=self.name,
            model_type=model_type,
            num_experts=e,
            top_k=k,
            renormalize=True,
            shared_experts=config_int(config, "moe_num_shared_experts"),
            moe_layers=len(self.config_moe_layers(config)),
        )

    # --- structure -------------------------------------------------------------------------
    def layer_experts(self, block: nn.Module) -> int:
        return int(block.experts.gate_up_proj.shape[0])

    def expert_weights(self, model: nn.Module, layer: int) -> ExpertWeights:
        return transposed_expert_weights(self.block(model, layer).experts)

    # --- student ----------------------------------------------------------------------------
    def student_config(self, teacher: nn.Module, width: int) -> Any:
        from transformers import LlamaConfig

        tc = teacher.config
        if tc.hidden_act not in ("silu", "swish"):
            raise ValueError(
                f"aria_text config: hidden_act={tc.hidden_act!r}; the Llama student needs silu "
                "(Aria's routed experts are always SiLU)"
            )
        return copy_config(tc, LlamaConfig, intermediate_size=int(width), head_dim=int(tc.head_dim))
