"""Llama-4's text decoder (`Llama4ForCausalLM`, model_type llama4_text; block `Llama4TextMoe` at the decoder
layer's `feed_forward`).

Router (`feed_forward.router`, an [E, H] linear map without bias): the top-k of the logits z; it returns
(scores [T, E], z) with scores = sigmoid(z) on the chosen k and exactly 0 elsewhere; never renormalized, no
constant factor. p (router_decision) is sigmoid(z) normalized over all E; the weights are the scores at
their k nonzero entries. The block multiplies each expert's INPUT by its score, f_e(w_e·x) (f_e(0) = 0: no
biases), so the expert views are `input_scaled` and the dense student puts α on the gate and up rows
(workers.methods.merge). An ungated shared expert (`shared_expert`, intermediate_size wide) is added to every token.
Layers outside config.moe_layers (interleave_moe_layer_step) are dense `Llama4TextMLP`s of
intermediate_size_mlp.

Experts: `gate_up_proj` [E, H, 2I] applied as x @ W (gate columns first, then up), `down_proj` [E, I, H];
SiLU. Their intermediate units lie on axis 2 (halves) and axis 1.

Student: the same class with moe_layers = [] (every layer a Llama4TextMLP of intermediate_size_mlp = width);
attention (RoPE / NoPE layers, chunked attention, q/k L2 norm, attention temperature tuning) is configured by
fields the student's config copies. Pruned / merged MoE: router rows and experts sliced (or combined), k
unchanged. The edited output is refused (its factored experts rebuild the [E, 2I, H] layout, not this one).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from workers.core.types import DenseFFN, ExpertWeights
from workers.families.fused import (
    TRANSPOSED_UNIT_LAYOUT,
    FusedMoeAdapter,
    config_int,
    copy_config,
    linear_ffn,
    transposed_expert_weights,
)


class Llama4TextAdapter(FusedMoeAdapter):
    name = "llama4_text"
    routing = (
        "top-k of the logits, weights sigmoid of those logits (never renormalized) multiplying the "
        "expert's input; an ungated shared expert; dense layers outside moe_layers"
    )
    student = "same class, every layer dense (moe_layers = [], intermediate_size_mlp = width)"
    model_types = ("llama4_text",)
    block_classes = ("Llama4TextMoe",)
    block_attr = "feed_forward"
    router_attr = "router"
    shared_attr = "shared_expert"
    experts_key = "num_local_experts"
    student_ffn_attr = "feed_forward"
    scores = "sigmoid"
    renorm = False  # the router's sigmoid scores are never renormalized
    unit_layout = TRANSPOSED_UNIT_LAYOUT
    refused_outputs: Mapping[str, str] = {
        "edited": "cannot write an edited checkpoint: its factored experts rebuild the [E, 2I, H] fused layout, "
        "Llama-4's experts are [E, H, 2I] and scale their input"
    }

    # --- structure from the config alone ----------------------------------------------------------
    def config_moe_layers(self, config: Any) -> list[int]:
        n = config_int(config, "num_hidden_layers")
        layers = getattr(config, "moe_layers", None)
        if not isinstance(layers, list) or not all(isinstance(i, int) for i in layers):
            raise ValueError(f"llama4_text config: moe_layers={layers!r}, expected a list of layer indices")
        return [i for i in range(n) if i in layers]

    def config_shared_experts(self, config: Any) -> int:
        return 1  # Llama4TextMoe always builds one shared expert

    def num_shared_experts(self, model: nn.Module) -> int:
        return 1

    # --- router -----------------------------------------------------------------------------------
    def router_decision(self, output: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(p = sigmoid(logits) normalized over E, the scores at their k nonzero entries, those entries); k is
        the row count of nonzero scores (the router's k, or k′ under routing_top_k / override_routing)."""
        scores, logits = output[0], output[1]
        gate = self.gate_values(logits)
        p = gate / gate.sum(dim=-1, keepdim=True)
        k = max(1, int((scores != 0).sum(dim=-1).max()))
        idx = torch.topk(scores, k, dim=-1).indices
        return p, scores.gather(1, idx), idx

    def override_routing(
        self,
        model: nn.Module,
        layer: int,
        decide: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
        allowed: Any,
    ) -> list[Any]:
        """The router's (scores, logits) replaced: scores′ = decide's weights at its indices, 0 elsewhere;
        logits masked to the dtype's minimum outside `allowed`."""

        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
            scores, logits = output[0], output[1]
            w, idx = decide(*self.router_decision(output))
            new = torch.zeros_like(scores).scatter(1, idx.long(), w.to(scores.dtype))
            dropped = torch.ones(logits.shape[-1], dtype=torch.bool, device=logits.device)
            dropped[torch.as_tensor(list(allowed), dtype=torch.long, device=logits.device)] = False
            return new, logits.masked_fill(dropped, torch.finfo(logits.dtype).min)

        return [self.router_module(model, layer).register_forward_hook(hook, with_kwargs=True)]

    def _expanded_forward(self, router: nn.Module, k: int, renormalize: bool | None) -> Callable:
        """Top-k of the logits, weights their sigmoid, renormalized iff `renormalize` (None: never), as scores."""
        native = router.forward
        renorm = bool(renormalize)
        untouched = k == int(router.top_k) and not renorm

        def forward(hidden_states: torch.Tensor) -> Any:
            scores, logits = native(hidden_states)
            if untouched:
                return scores, logits
            idx = torch.topk(logits, k, dim=-1).indices
            w = torch.sigmoid(logits.float().gather(1, idx))
            if renorm:
                w = w / w.sum(dim=-1, keepdim=True)
            return torch.zeros_like(scores).scatter(1, idx, w.to(scores.dtype)), logits

        return forward

    # --- experts ----------------------------------------------------------------------------------
    def expert_weights(self, model: nn.Module, layer: int) -> ExpertWeights:
        return transposed_expert_weights(self.block(model, layer).experts, input_scaled=True)

    def shared_ffn(self, model: nn.Module, layer: int) -> DenseFFN | None:
        if layer not in self.moe_layers(model):
            return None
        return linear_ffn(self.block(model, layer).shared_expert)

    # --- student ----------------------------------------------------------------------------------
    def student_config(self, teacher: nn.Module, width: int) -> Any:
        from transformers import Llama4TextConfig

        return copy_config(
            teacher.config,
            Llama4TextConfig,
            intermediate_size_mlp=int(width),
            moe_layers=[],
            output_router_logits=False,
        )
