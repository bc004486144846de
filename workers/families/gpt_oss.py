"""GPT-OSS (`GptOssMLP`, router at `mlp.router`): logits = W h + b, top-k on the logits, softmax over
the k (always sums to 1). p (router_decision) is the softmax over all E logits (bias included);
the applied weights equal p restricted to the chosen k and renormalized.

Experts (transformers 5.x) are transposed and interleaved with biases: gate_up_proj [E, H, 2I]
(gate = columns 0::2, up = 1::2), gate_up_proj_bias [E, 2I], down_proj [E, I, H], down_proj_bias
[E, H]; activation (clamp(up, ±limit) + 1) · g · σ(α g) with g = clamp(gate, max=limit).

No dense twin (attention sinks, sliding layers): the student is the same class with one expert and
top-1 (softmax over one logit = 1), the FFN's biases and clamped SwiGLU kept.

Pruned MoE: the router's weight rows and bias entries and every expert tensor (biases included) sliced
to the kept experts; top-k over the surviving logits, softmax over the chosen k, as in the teacher.

Merged MoE: the same tensors averaged per cluster; an expert's intermediate units are permuted along
gate_up_proj's last axis (gate/up columns 2u, 2u+1 together), gate_up_proj_bias likewise and
down_proj's middle axis; down_proj_bias has no unit axis.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from workers.core.types import DenseFFN, ExpertWeights
from workers.families.fused import FusedMoeAdapter, copy_config


class GptOssAdapter(FusedMoeAdapter):
    name = "gpt_oss"
    edited = ("GptOssConfig", "GptOssForCausalLM", "gptoss")
    routing = (
        "top-k of the biased logits, softmax over the k; no shared experts; biased clamped-SwiGLU experts"
    )
    student = "same class, one expert, top-1"
    model_types = ("gpt_oss",)
    block_classes = ("GptOssMLP",)
    router_attr = "router"
    expert_tensors = (
        "router.weight",
        "router.bias",
        "experts.gate_up_proj",
        "experts.gate_up_proj_bias",
        "experts.down_proj",
        "experts.down_proj_bias",
    )
    unit_layout = {
        "experts.gate_up_proj": (2, "interleaved"),
        "experts.gate_up_proj_bias": (1, "interleaved"),
        "experts.down_proj": (1, "plain"),
        "experts.down_proj_bias": None,
    }
    student_act = "gptoss"
    experts_key = "num_local_experts"
    renorm = True  # no config flag: softmax over the chosen k logits = p renormalized over the k

    def choice_scores(self, router: nn.Module, logits: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return logits  # GptOssTopKRouter takes its top-k of the raw (biased) logits

    def expert_weights(self, model: nn.Module, layer: int) -> ExpertWeights:
        ex = self.block(model, layer).experts
        gu = ex.gate_up_proj.detach()  # [E, H, 2I], interleaved columns
        gb = ex.gate_up_proj_bias.detach()  # [E, 2I]
        return ExpertWeights(
            gate=gu[..., 0::2].transpose(1, 2),
            up=gu[..., 1::2].transpose(1, 2),
            down=ex.down_proj.detach().transpose(1, 2),
            gate_bias=gb[:, 0::2],
            up_bias=gb[:, 1::2],
            down_bias=ex.down_proj_bias.detach(),
            act="gptoss",
            act_alpha=float(ex.alpha),
            act_limit=float(ex.limit),
        )

    def student_config(self, teacher: nn.Module, width: int) -> Any:
        from transformers import GptOssConfig

        cfg = copy_config(
            teacher.config,
            GptOssConfig,
            intermediate_size=int(width),
            num_local_experts=1,
            num_experts_per_tok=1,
            output_router_logits=False,
        )
        cfg._experts_implementation = teacher.config._experts_implementation
        return cfg

    def student_ffn_params(self, layer: int, ffn: DenseFFN) -> dict[str, torch.Tensor]:
        pre = f"model.layers.{layer}.mlp."
        d, h = ffn.gate.shape
        zeros_d = ffn.gate.new_zeros(d)
        gb = zeros_d if ffn.gate_bias is None else ffn.gate_bias
        ub = zeros_d if ffn.up_bias is None else ffn.up_bias
        db = ffn.gate.new_zeros(h) if ffn.down_bias is None else ffn.down_bias
        return {
            pre + "router.weight": ffn.gate.new_zeros(1, h),
            pre + "router.bias": ffn.gate.new_zeros(1),
            pre + "experts.gate_up_proj": torch.stack([ffn.gate.T, ffn.up.T], dim=-1).reshape(h, 2 * d)[None],
            pre + "experts.gate_up_proj_bias": torch.stack([gb, ub], dim=-1).reshape(2 * d)[None],
            pre + "experts.down_proj": ffn.down.T[None],
            pre + "experts.down_proj_bias": db[None],
        }

    def build_student(
        self,
        teacher: nn.Module,
        ffns: dict[int, DenseFFN],
        share_weights: bool = False,
        shared_scale: Mapping[int, float] | None = None,
    ) -> nn.Module:
        ex = self.block(teacher, self.moe_layers(teacher)[0]).experts
        for layer, f in ffns.items():
            if (f.act_alpha, f.act_limit) != (float(ex.alpha), float(ex.limit)):
                raise ValueError(
                    f"layer {layer}: ffn act_alpha/act_limit={f.act_alpha}/{f.act_limit}, "
                    f"the student has {ex.alpha}/{ex.limit}"
                )
        return super().build_student(teacher, ffns, share_weights, shared_scale)
