"""ERNIE-4.5-MoE (`Ernie4_5_MoeSparseMoeBlock`): softmax router whose top-k is corrected by a bias, ungated
shared experts, dense layers outside the MoE layer range.

Router (`block.gate`, float32 whatever the model's dtype): p = softmax(W h) over all E; the choice is the
top-k of p + `gate.moe_statics.e_score_correction_bias` (a frozen [1, E] parameter, requires_grad=False);
the weights are p of the chosen k, always renormalized over them (the sum clamped below by `moe_norm_min`,
1e-12); no constant factor. p (router_decision) is the router's softmax itself. Router KD trains
`gate.weight` only: the bias enters only the (non-differentiable) choice and is frozen in the model.
Shared experts (moe_intermediate_size × moe_num_shared_experts wide) are added to every token. Layer i is
an MoE layer iff (i + 1) % moe_layer_interval == 0 and moe_layer_start_index <= i <= moe_layer_end_index
(-1: the last layer); the others are dense MLPs (intermediate_size). Config names: moe_num_experts (E),
moe_k (k; `num_experts_per_tok` through the config's attribute_map).

Pruned / merged MoE: the router rows, the bias (sliced / combined on its expert axis, axis 1 of [1, E]) and
the experts; k and the renormalization unchanged. A pruned router's softmax runs over the E′ kept logits,
i.e. p restricted to the kept experts and divided by their sum, and its choice adds the kept biases to
that: exactly the teacher's router with the dropped experts' logits at -inf (and their biases at -inf, so
a dropped expert cannot be chosen on its bias alone); the weights (p renormalized over the chosen k) do not
see the rescaling.

Student: the dense sibling Ernie4_5 (Ernie4_5ForCausalLM): the same attention (interleaved RoPE, q/k/v/o
with `use_bias`), RMSNorms, pre-norm residual layer and tied embeddings; `head_dim` is set to the teacher's
(the MoE config has none, Ernie4_5Config's default is 128).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from workers.core.types import DenseFFN
from workers.families.fused import FusedMoeAdapter, config_int, copy_config, linear_ffn

_BIAS = "gate.moe_statics.e_score_correction_bias"


class Ernie45MoeAdapter(FusedMoeAdapter):
    name = "ernie4_5_moe"
    edited = ("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM", "fused")
    routing = (
        "softmax p over E, top-k of p + the router's [1, E] e_score_correction_bias (frozen), p of the k "
        "always renormalized; ungated shared experts; dense layers outside moe_layer_start/end_index, "
        "moe_layer_interval"
    )
    student = "Ernie4_5 (dense sibling)"
    model_types = ("ernie4_5_moe",)
    block_classes = ("Ernie4_5_MoeSparseMoeBlock",)
    experts_key = "moe_num_experts"
    shared_attr = "shared_experts"
    correction_bias = _BIAS  # a frozen [1, E] parameter of the router, added to p for the choice
    expert_axis = {_BIAS: 1}
    renorm = True  # no config flag: the router always renormalizes

    def config_moe_layers(self, config: Any) -> list[int]:
        n = config_int(config, "num_hidden_layers")
        start, interval = (
            config_int(config, "moe_layer_start_index"),
            config_int(config, "moe_layer_interval"),
        )
        end = config_int(config, "moe_layer_end_index")
        end = n - 1 if end == -1 else end
        if interval < 1:
            raise ValueError(f"ernie4_5_moe config: moe_layer_interval={interval}, expected >= 1")
        return [i for i in range(n) if (i + 1) % interval == 0 and start <= i <= end]

    def config_shared_experts(self, config: Any) -> int:
        return max(config_int(config, "moe_num_shared_experts"), 0)

    def num_shared_experts(self, model: nn.Module) -> int:
        """The shared MLP's width in units of one routed expert's width (moe_intermediate_size)."""
        layer = self.moe_layers(model)[0]
        shared = self.shared_ffn(model, layer)
        if shared is None:
            return 0
        width, unit = shared.width, self.expert_weights(model, layer).intermediate
        if width % unit:
            raise ValueError(f"shared experts of width {width} are not a multiple of the expert width {unit}")
        return width // unit

    def shared_ffn(self, model: nn.Module, layer: int) -> DenseFFN | None:
        if layer not in self.moe_layers(model):
            return None
        shared = self.block(model, layer).shared_experts
        return None if shared is None else linear_ffn(shared)  # None: moe_num_shared_experts = 0

    # --- student ----------------------------------------------------------------------------
    def student_config(self, teacher: nn.Module, width: int) -> Any:
        from transformers import Ernie4_5Config

        head_dim = int(self.layers(teacher)[0].self_attn.head_dim)
        return copy_config(teacher.config, Ernie4_5Config, intermediate_size=int(width), head_dim=head_dim)
