"""AFMoE (Arcee Trinity, `AfmoeSparseMoeBlock`): MiniMax-M2's router plus a constant factor, ungated shared
experts, dense first layers.

Router (`block.router`, its linear map `router.gate`): scores = sigmoid(W h); the choice is the top-k of
scores + the block's `expert_bias` (a frozen parameter of the block, passed to the router's forward; no
groups); the weights are the unbiased scores of the chosen k, always renormalized over them, × route_scale.
p (router_decision) is the sigmoid scores normalized over all E, so p restricted to the chosen k and
renormalized is the applied weights / route_scale. Router KD trains `router.gate.weight` only: expert_bias
enters only the (non-differentiable) choice and is frozen in the model, like DeepSeek-V3's correction bias.
Shared experts (moe_intermediate_size × num_shared_experts wide) are added to every token; the first
num_dense_layers layers are dense MLPs (intermediate_size).

Student: the same class with num_dense_layers = num_hidden_layers (every layer a dense MLP of width
`width`): no dense class has AFMoE's layer (gated attention with q/k norm, rope only in sliding layers,
pre- and post-norm around attention and FFN). Pruned / merged MoE: router rows, expert_bias and the experts
sliced (or combined) per expert; k, renormalization and route_scale unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from workers.families.fused import FusedMoeAdapter, config_int, copy_config


class AfmoeAdapter(FusedMoeAdapter):
    name = "afmoe"
    edited = ("AfmoeConfig", "AfmoeForCausalLM", "fused")
    routing = (
        "sigmoid scores, top-k of scores + the block's expert_bias, unbiased scores renormalized over the k, "
        "× route_scale; ungated shared experts; num_dense_layers dense layers"
    )
    student = "same class, every layer dense (num_dense_layers = num_hidden_layers)"
    model_types = ("afmoe",)
    block_classes = ("AfmoeSparseMoeBlock",)
    router_attr = "router"
    shared_attr = "shared_experts"
    expert_tensors = ("router.gate.weight", "expert_bias", "experts.gate_up_proj", "experts.down_proj")
    router_linear = "gate"  # Router KD trains this linear map's weight only

    def config_moe_layers(self, config: Any) -> list[int]:
        n = config_int(config, "num_hidden_layers")
        return list(range(min(config_int(config, "num_dense_layers"), n), n))

    def config_renorm(self, config: Any) -> bool:
        return True  # no config flag: the router always renormalizes

    def config_shared_experts(self, config: Any) -> int:
        return config_int(config, "num_shared_experts")

    def num_shared_experts(self, model: nn.Module) -> int:
        return self.shared_units(model)

    # --- router ---------------------------------------------------------------------------------
    def native_renorm(self, router: nn.Module) -> bool:
        return True

    def gate_values(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(logits.float())

    def choice_scores(
        self, router: nn.Module, logits: torch.Tensor, gate: torch.Tensor, *router_args: Any
    ) -> torch.Tensor:
        (bias,) = router_args  # AfmoeTokenChoiceRouter.forward(hidden_states, expert_bias)
        return gate + bias.float()

    def scale(self, router: nn.Module) -> float:
        return float(router.route_scale)

    def is_router_tensor(self, rel: str) -> bool:
        return rel.startswith("router.") or rel == "expert_bias"

    # --- student ----------------------------------------------------------------------------
    def student_config(self, teacher: nn.Module, width: int) -> Any:
        from transformers import AfmoeConfig

        n = teacher.config.num_hidden_layers
        return copy_config(
            teacher.config,
            AfmoeConfig,
            intermediate_size=int(width),
            num_dense_layers=n,
            output_router_logits=False,
        )
