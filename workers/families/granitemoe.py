"""Granite MoE (`GraniteMoeMoE`, `GraniteMoeSharedMoE`, `GraniteMoeSWAMoE`): every decoder layer's FFN is the
MoE block `layer.block_sparse_moe` (router `router`, fused `experts`), not `layer.mlp`.

Experts: the checkpoints' `input_linear` / `output_linear` are converted at load time to
`experts.gate_up_proj` [E, 2I, H] (gate rows first) / `experts.down_proj` [E, H, I], SiLU.

Router: the top-k of the logits z (= the top-k of p = softmax(z), a monotone map), weights softmax over the
k chosen logits = p_i / Σ_{j∈top-k} p_j (as Cohere2-MoE): p renormalized over the k, always; no constant
factor.

Shared MLP (granitemoeshared, granitemoe_swa with shared_intermediate_size > 0): `layer.shared_mlp`, on the
decoder layer outside the block, ungated, added to the block's output before the residual multiplier;
`input_linear` [2S, H] holds gate rows then up rows, `output_linear` [H, S]. Hooks on the block see only the
routed part; the dense student's FFN stacks the shared MLP with scale 1.

Multipliers: embedding_multiplier, residual_multiplier, attention_multiplier (the attention's scale) and
logits_scaling (logits / it; the KD losses fold it into the head) are fields of the dense siblings too, read
the same way, and are copied. granitemoe_swa's per-layer sliding window (layer_types), attention sinks and
per-layer RoPE theta (layer_rope_theta, 0 = no RoPE) are GraniteSWA's as well.

Student: the dense sibling, Granite (granitemoe, granitemoeshared) or GraniteSWA (granitemoe_swa), of FFN
width `width` in every layer (no MLP biases).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from workers.core.types import DenseFFN
from workers.families.fused import FusedMoeAdapter, _check_silu, copy_config

GRANITE_STUDENT = (
    "Granite (dense sibling, the same embedding, residual and attention multipliers and logits_scaling)"
)


class GraniteMoeStyleAdapter(FusedMoeAdapter):
    """What the three Granite MoE families share: the block at block_sparse_moe, the softmax over the chosen k,
    the shared MLP on the decoder layer and a dense-sibling student (student_config_class)."""

    block_attr = "block_sparse_moe"
    router_attr = "router"
    experts_key = "num_local_experts"
    renorm = True  # softmax over the chosen k logits (module docstring)
    student_config_class = "GraniteConfig"  # the dense sibling's config class

    # --- structure from the config alone ----------------------------------------------------------
    def config_shared_experts(self, config: Any) -> int:
        return 1 if getattr(config, "shared_intermediate_size", 0) else 0

    # --- shared MLP (on the decoder layer, outside the block) ------------------------------------
    def shared_mlp(self, model: nn.Module, layer: int) -> nn.Module | None:
        return getattr(self.layers(model)[layer], "shared_mlp", None)

    def num_shared_experts(self, model: nn.Module) -> int:
        return 0 if self.shared_mlp(model, self.moe_layers(model)[0]) is None else 1

    def shared_ffn(self, model: nn.Module, layer: int) -> DenseFFN | None:
        mlp = self.shared_mlp(model, layer)
        if mlp is None or layer not in self.moe_layers(model):
            return None
        _check_silu(mlp.activation)
        gate, up = mlp.input_linear.weight.detach().chunk(2, dim=0)  # gate rows, then up rows
        return DenseFFN(gate=gate, up=up, down=mlp.output_linear.weight.detach())

    # --- student ----------------------------------------------------------------------------------
    def student_config(self, teacher: nn.Module, width: int) -> Any:
        import transformers

        cls = getattr(transformers, self.student_config_class)
        return copy_config(teacher.config, cls, intermediate_size=int(width), mlp_bias=False)


class GraniteMoeAdapter(GraniteMoeStyleAdapter):
    name = "granitemoe"
    edited = ("GraniteMoeConfig", "GraniteMoeForCausalLM", "fused")
    routing = (
        "top-k of the logits, softmax over the k (= p renormalized over the k); block at "
        "block_sparse_moe; no shared experts, no dense layers"
    )
    student = GRANITE_STUDENT
    model_types = ("granitemoe",)
    block_classes = ("GraniteMoeMoE",)


class GraniteMoeSharedAdapter(GraniteMoeStyleAdapter):
    name = "granitemoeshared"
    edited = ("GraniteMoeSharedConfig", "GraniteMoeSharedForCausalLM", "fused")
    routing = (
        "as granitemoe; an ungated shared MLP on the decoder layer (shared_mlp, outside the block) "
        "added to the block's output"
    )
    student = GRANITE_STUDENT
    model_types = ("granitemoeshared",)
    block_classes = ("GraniteMoeSharedMoE",)


class GraniteMoeSWAAdapter(GraniteMoeStyleAdapter):
    name = "granitemoe_swa"
    edited = ("GraniteMoeSWAConfig", "GraniteMoeSWAForCausalLM", "fused")
    routing = "as granitemoeshared (sliding-window layers, attention sinks, per-layer RoPE theta)"
    student = "GraniteSWA (dense sibling: the same sliding window, sinks and per-layer RoPE theta)"
    model_types = ("granitemoe_swa",)
    block_classes = ("GraniteMoeSWAMoE",)
    student_config_class = "GraniteSWAConfig"
