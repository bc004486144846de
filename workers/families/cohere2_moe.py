"""Cohere2-MoE (`Cohere2MoeSparseMoeBlock`, Command A MoE): a top-k of the router logits, then softmax over
the chosen k only; parallel attention + FFN layers; dense layers by `mlp_layer_types`.

Router (`block.gate`, expert_selection_fn "softmax", the config default): the choice is the top-k of the
logits z (= the top-k of p = softmax(z), a monotone map); the weights are softmax over the k chosen logits,
exp(z_i) / Σ_{j∈top-k} exp(z_j) = p_i / Σ_{j∈top-k} p_j (the common factor Σ_E exp z cancels): p
renormalized over the k, always (norm_topk_prob is not read); no constant factor. expert_selection_fn
"sigmoid" (sigmoid of the k logits, renormalized iff norm_topk_prob) is refused with a one-line error:
router_decision sees only the router's output, which does not say which function made the weights.

Shared experts (`block.shared_experts`, num_shared_experts × intermediate_size wide, ungated):
`shared_expert_combination_strategy` "sum" adds them; "average" (the config default) returns
(routed + shared) / 2. The router's weights are left as they are (routed_scaling stays 1: reconstruction
and Router KD replace the router's output, which never held the ½); the dense student's FFN of a layer is
multiplied by ½ as a whole instead (layer_ffns).

Student: the same class with every layer dense (mlp_layer_types all "dense", prefix_dense_intermediate_size
= width). The dense sibling `Cohere2` differs (LayerNorm only, where Cohere2-MoE takes RMSNorm when
rms_norm_eps is set; no RoPE on full-attention layers, where Cohere2-MoE forces it on dense layers when
prefix_dense_sliding_window_pattern = 1). A dense layer of this class applies RoPE on a full-attention layer
iff prefix_dense_sliding_window_pattern = 1, for all layers alike; the student sets it so that the
full-attention layers keep the teacher's RoPE. Where the teacher's full-attention layers differ (a dense
prefix with forced RoPE and full-attention MoE layers without), no all-dense config keeps both: the student
keeps the teacher's mlp_layer_types and each MoE layer becomes one expert, top-1, softmax (weight exactly 1),
no shared experts (they are in the FFN), so each layer is exactly its dense FFN either way.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from workers.core.types import DenseFFN
from workers.families.fused import FusedMoeAdapter, assemble, config_int, copy_config, scale_ffn


def check_softmax(fn: str) -> None:
    """The sigmoid router is refused (module docstring: p could not be told from the router's output)."""
    if fn != "softmax":
        raise ValueError(f"cohere2_moe: expert_selection_fn={fn!r} is not supported (only 'softmax')")


class Cohere2MoeAdapter(FusedMoeAdapter):
    name = "cohere2_moe"
    edited = ("Cohere2MoeConfig", "Cohere2MoeForCausalLM", "fused")
    routing = (
        "top-k of the logits, softmax over the k (= p renormalized over the k; the sigmoid router is "
        "refused); ungated shared experts summed or averaged with the routed output; dense layers by "
        "mlp_layer_types"
    )
    student = (
        "same class, every layer dense (or, where RoPE differs across full-attention layers, MoE layers "
        "with one expert and top-1)"
    )
    model_types = ("cohere2_moe",)
    block_classes = ("Cohere2MoeSparseMoeBlock",)
    shared_attr = "shared_experts"
    shared_key = "num_shared_experts"
    renorm = True  # softmax over the chosen k logits = p renormalized over the k (module docstring)

    # --- structure from the config alone ----------------------------------------------------------
    def config_moe_layers(self, config: Any) -> list[int]:
        n = config_int(config, "num_hidden_layers")
        types = list(config.mlp_layer_types or ["sparse"] * n)
        return [i for i in range(n) if types[i] == "sparse"]

    def config_renorm(self, config: Any) -> bool:
        check_softmax(config.expert_selection_fn)
        return super().config_renorm(config)

    # --- router semantics -------------------------------------------------------------------------
    def moe_layers(self, model: nn.Module) -> list[int]:
        layers = super().moe_layers(model)
        for layer in layers:
            check_softmax(self.router_module(model, layer).expert_selection_fn)
        return layers

    # --- shared experts ---------------------------------------------------------------------------
    def num_shared_experts(self, model: nn.Module) -> int:
        return int(self._first(model).num_shared_experts)

    def averaged(self, model: nn.Module) -> bool:
        """Does every MoE block return (routed + shared) / 2?"""
        block = self._first(model)
        return block.num_shared_experts > 0 and block.shared_expert_combination_strategy == "average"

    def shared_ffn(self, model: nn.Module, layer: int) -> DenseFFN | None:
        if self.block(model, layer).num_shared_experts == 0:
            return None
        return super().shared_ffn(model, layer)

    # --- student ----------------------------------------------------------------------------------
    def full_attention_rope(self, config: Any) -> set[bool]:
        """Whether each full-attention layer of the teacher applies RoPE (dense layers with
        prefix_dense_sliding_window_pattern = 1 force it), as a set over those layers."""
        forced = config.prefix_dense_sliding_window_pattern == 1
        return {
            forced and m == "dense"
            for t, m in zip(config.layer_types, config.mlp_layer_types, strict=True)
            if t == "full_attention"
        }

    def student_config(self, teacher: nn.Module, width: int) -> Any:
        from transformers import Cohere2MoeConfig

        tc = teacher.config
        rope = self.full_attention_rope(tc)
        common = dict(
            intermediate_size=int(width),
            prefix_dense_intermediate_size=int(width),
            num_shared_experts=0,
            layer_types=list(tc.layer_types),
            output_router_logits=False,
        )
        if (
            len(rope) == 2
        ):  # no all-dense config keeps both: MoE layers with one expert, top-1 (module docstring)
            cfg = copy_config(
                tc,
                Cohere2MoeConfig,
                num_experts=1,
                num_experts_per_tok=1,
                expert_selection_fn="softmax",
                mlp_layer_types=list(tc.mlp_layer_types),
                **common,
            )
            cfg._experts_implementation = tc._experts_implementation
            return cfg
        return copy_config(
            tc,
            Cohere2MoeConfig,
            mlp_layer_types=["dense"] * tc.num_hidden_layers,
            prefix_dense_sliding_window_pattern=1 if rope == {True} else 2,
            **common,
        )

    def layer_ffns(
        self, teacher: nn.Module, ffns: dict[int, DenseFFN], shared_scale: Mapping[int, float] | None = None
    ) -> list[DenseFFN]:
        """As FusedMoeAdapter's, each MoE layer's FFN × ½ where the block averages routed and shared output."""
        out = super().layer_ffns(teacher, ffns, shared_scale)
        if not self.averaged(teacher):
            return out
        moe = set(self.moe_layers(teacher))
        return [scale_ffn(f, 0.5) if layer in moe else f for layer, f in enumerate(out)]

    def build_student(
        self,
        teacher: nn.Module,
        ffns: dict[int, DenseFFN],
        share_weights: bool = False,
        shared_scale: Mapping[int, float] | None = None,
    ) -> nn.Module:
        per_layer = self.layer_ffns(teacher, ffns, shared_scale)
        cfg = self.student_config(teacher, per_layer[0].width)
        tensors: dict[str, torch.Tensor] = {}
        for layer, f in enumerate(per_layer):
            if cfg.mlp_layer_types[layer] == "dense":
                tensors.update(self.student_ffn_params(layer, f))
                continue
            if f.gate_bias is not None or f.up_bias is not None or f.down_bias is not None:
                raise ValueError(f"layer {layer}: Cohere2-MoE experts have no biases, the FFN has some")
            pre = f"model.layers.{layer}.mlp."
            tensors.update(
                {
                    pre + "gate.weight": f.gate.new_zeros(1, f.gate.shape[1]),
                    pre + "experts.gate_up_proj": torch.cat([f.gate, f.up], dim=0)[None],
                    pre + "experts.down_proj": f.down[None],
                }
            )
        ffn_prefixes = tuple(f"model.layers.{i}.mlp." for i in range(len(per_layer)))
        return assemble(cfg, teacher, tensors, ffn_prefixes, share_weights)
