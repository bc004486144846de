"""HunYuan-MoE-V1 (`HunYuanMoEV1Moe`): softmax router, top-k, always renormalized, plus one ungated shared MLP.

Router (`block.gate`, a `HunYuanMoEV1Gate`; its linear map is `gate.wg`, built in float32, and the hidden states
are cast to float32 when it is): logits = wg · h, p = softmax over all E (float32), the top-k of p, always divided
by their sum (no config flag), then cast to the logits' dtype. No bias, no scaling factor, no groups. k is
`moe_topk` (alias `num_experts_per_tok`): an int, or a per-layer list (`moe_topk[layer_idx]`); a list is accepted
only when every entry is equal (one k per model; otherwise a one-line ValueError naming moe_topk). Every decoder
layer is an MoE block (no dense layers). E is `num_experts` (alias `num_local_experts`; the experts module is built
from it, so a per-layer list cannot build).

Shared expert: `block.shared_mlp`, a gate/up/down SiLU MLP of width `intermediate_size` (the routed experts' width
too), ungated, added to every token's routed output.

Student: the dense sibling `HunYuanDenseV1` (its decoder layer is the MoE layer with the block replaced by the
same MLP class: attention with q/k RMSNorm after RoPE, pre-norms, the same RoPE incl. dynamic/alpha scaling).
Pruned / merged MoE: the rows of `gate.wg.weight` and the experts sliced (or combined); k and the rule unchanged.
"""

from __future__ import annotations

import copy
from typing import Any

from torch import nn

from workers.core.shape import TeacherShape
from workers.families.fused import FusedMoeAdapter, config_int, copy_config


def single_top_k(config: Any) -> int | None:
    """moe_topk as one int: the int, or the value of a per-layer list whose entries (one per layer) are all equal.
    None where the config has no int k at all (config_int's error then names the field)."""
    value = getattr(config, "moe_topk", None)
    if not isinstance(value, (list, tuple)):
        return None
    n = config_int(config, "num_hidden_layers")
    entries = list(value)[:n]
    if len(entries) < n or len(set(entries)) != 1:
        raise ValueError(
            f"hunyuan_v1_moe config: moe_topk={list(value)} is a per-layer k that differs across the "
            f"{n} layers (or has fewer entries); only one k per model is supported"
        )
    return entries[0]


class HunYuanMoeV1Adapter(FusedMoeAdapter):
    name = "hunyuan_v1_moe"
    edited = ("HunYuanMoEV1Config", "HunYuanMoEV1ForCausalLM", "fused")
    routing = (
        "softmax over E, top-k, always renormalized (router linear map at gate.wg, float32); k = moe_topk "
        "(a per-layer list only if all equal); one ungated shared MLP (intermediate_size); no dense layers"
    )
    student = "dense sibling HunYuanDenseV1"
    model_types = ("hunyuan_v1_moe",)
    block_classes = ("HunYuanMoEV1Moe",)
    router_attr = "gate"
    shared_attr = "shared_mlp"
    router_linear = "wg"  # Router KD trains this linear map's weight only
    renorm = True  # no config flag: the gate always renormalizes

    # --- structure from the config alone -------------------------------------------------------
    def shape_from_config(self, config: Any) -> TeacherShape:
        k = single_top_k(config) if getattr(config, "model_type", None) in self.model_types else None
        if k is not None:
            config = copy.copy(config)
            config.moe_topk = k
        return super().shape_from_config(config)

    def config_shared_experts(self, config: Any) -> int:
        return 1  # shared_mlp is always built, as wide as one routed expert

    # --- structure -------------------------------------------------------------------------
    def top_k(self, model: nn.Module) -> int:
        """The gates' k, one per model (a per-layer moe_topk list with different entries is refused)."""
        ks = {int(self.router_module(model, layer).top_k) for layer in self.moe_layers(model)}
        if len(ks) > 1:
            raise ValueError(
                f"hunyuan_v1_moe model: moe_topk={model.config.moe_topk} gives the layers different k "
                f"({sorted(ks)}); only one k per model is supported"
            )
        return super().top_k(model)

    def num_shared_experts(self, model: nn.Module) -> int:
        return 1

    # --- student ----------------------------------------------------------------------------
    def student_config(self, teacher: nn.Module, width: int) -> Any:
        from transformers import HunYuanDenseV1Config

        return copy_config(
            teacher.config,
            HunYuanDenseV1Config,
            intermediate_size=int(width),
            head_dim=int(teacher.model.layers[0].self_attn.head_dim),
        )
