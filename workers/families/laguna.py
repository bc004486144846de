"""Laguna (`laguna`, `LagunaSparseMoeBlock`): a DeepSeek-V3-style sigmoid router (no groups) whose correction
bias is a frozen parameter of the router, optional tanh softcapping of the logits, a constant factor on the
block's routed output, an ungated shared MLP and dense layers by `mlp_layer_types`. Reuses the fused machinery
(experts [E, 2I, H]) with the sigmoid semantics of the DeepSeek-V3 adapter.

Router (`block.gate`, `LagunaTopKRouter`): z = W h in float32, capped to c·tanh(z / c) where
moe_router_logit_softcapping c > 0; it returns the capped logits. scores = sigmoid(z); the choice is the top-k of
scores + e_score_correction_bias (an [E] nn.Parameter with requires_grad=False); the weights are the unbiased
scores of the chosen k, always renormalized over them. p (router_decision) is the sigmoid scores normalized over
all E. The block multiplies the routed experts' sum by moe_routed_scaling_factor s AFTER the experts (the router's
weights do not hold it). Choice: since s·Σ_j w_j f_j = Σ_j (s·w_j) f_j, the weights really applied per expert are
s·w, and that is what the decision this adapter reports (hook_routing) and takes (override_routing) carries, like
DeepSeek's: s is multiplied in on reading and divided out before the weights go back to the router, and
routed_scaling returns s (block_scale_attr, FusedMoeAdapter.block_scale). router_decision alone sees only the
router's output, which lacks s, so it is read through those two hooks; expanded routing (routing_top_k) leaves s
to the block. Router KD trains `gate.weight` only: the correction bias is frozen in
the model and enters only the (non-differentiable) choice, like DeepSeek-V3's buffer.

Student: the same class with every entry of mlp_layer_types "dense" (each a LagunaMLP of width `width`): no dense
sibling has Laguna's attention (softplus output gate, per-layer head counts, q/k norm, per-type RoPE). The
routed part carries moe_routed_scaling_factor (routed_scaling). Pruned / merged MoE: router rows, the correction
bias and the experts sliced (or combined); k, softcapping and the factor unchanged.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from workers.families.fused import FusedMoeAdapter, config_int


class LagunaAdapter(FusedMoeAdapter):
    name = "laguna"
    edited = ("LagunaConfig", "LagunaForCausalLM", "fused")
    routing = (
        "sigmoid scores of the (optionally tanh-softcapped) logits, top-k of scores + the router's frozen "
        "e_score_correction_bias, unbiased scores renormalized over the k; the block's routed output × "
        "moe_routed_scaling_factor; one ungated shared MLP; dense layers by mlp_layer_types"
    )
    student = "same class, every layer dense (mlp_layer_types all 'dense')"
    model_types = ("laguna",)
    block_classes = ("LagunaSparseMoeBlock",)
    block_scale_attr = "routed_scaling_factor"  # moe_routed_scaling_factor, after the experts (block_scale)
    shared_attr = "shared_experts"
    scores = "sigmoid"  # of the logits the router returns, already capped
    correction_bias = "gate.e_score_correction_bias"
    renorm = True  # no config flag: the router always renormalizes
    dense_layers = "mlp_layer_types"
    config_class = "LagunaConfig"
    student_dense_fields = ("mlp_layer_types",)

    # --- structure from the config alone -------------------------------------------------------
    def config_shared_experts(self, config: Any) -> int:
        return 1 if config_int(config, "shared_expert_intermediate_size") > 0 else 0

    def num_shared_experts(self, model: nn.Module) -> int:
        """The one ungated shared MLP (0 if it has no units)."""
        return 1 if self.shared_ffn(model, self.moe_layers(model)[0]).width > 0 else 0

    # --- router ---------------------------------------------------------------------------------
    def router_parameters(self, model: nn.Module) -> list[nn.Parameter]:
        """Each MoE block's router weight [E, H]; the frozen correction bias (a parameter of the router that only
        the top-k choice reads) is left out."""
        frozen = {
            id(self.router_module(model, layer).e_score_correction_bias) for layer in self.moe_layers(model)
        }
        return [p for p in super().router_parameters(model) if id(p) not in frozen]
