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

from workers.families.fused import FusedMoeAdapter


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
    router_linear = "gate"  # Router KD trains this linear map's weight only
    shared_key = "num_shared_experts"
    scores = "sigmoid"
    correction_bias = "expert_bias"  # the block's frozen parameter, passed to the router's forward
    renorm = True  # no config flag: the router always renormalizes
    scale_attr = "route_scale"
    dense_layers = "num_dense_layers"
    config_class = "AfmoeConfig"
    student_dense_fields = ("num_dense_layers",)
