"""Beam (`beam`, `BeamMoE`): DeepSeek-V3's router and fused experts without shared experts, the MoE layers chosen
by `mlp_layer_types` (as MiMo-V2-Flash), with `routed_scaling_factor` applied by the block to the routed experts'
sum rather than by the router (block_scale_attr: the reported weights carry it, FusedMoeAdapter.block_scale).

Router (`block.gate`, `BeamTopKRouter`): sigmoid scores of float32 logits; the choice is the group-limited top-k of
scores + e_score_correction_bias (n_group contiguous groups ranked by the sum of their top-2 biased scores,
topk_group kept); the weights are the unbiased scores of the chosen k, renormalized iff norm_topk_prob. The
experts and the dense MLP evaluate SiLU(gate)·up in float32. Decoder layers: four RMSNorms (post-attention and
post-feed-forward norms) and depth-scaled residual adds, sliding / full attention by layer_types, a final logit
softcap.

Student: the same class with every entry of mlp_layer_types "dense" (each a BeamMLP of width `width`): no dense
class has Beam's layer. Pruned and merged MoE students: the DeepSeek-V3 rule for the group limit.
"""

from __future__ import annotations

from workers.families.deepseek_v2 import DeepseekStyleAdapter


class BeamAdapter(DeepseekStyleAdapter):
    name = "beam"
    edited = ("BeamConfig", "BeamForCausalLM", "fused")
    routing = (
        "sigmoid scores, group-limited top-k of scores + e_score_correction_bias (groups ranked by their "
        "top-2 sum), unbiased scores renormalized iff norm_topk_prob; the block multiplies the routed sum "
        "by routed_scaling_factor; no shared experts; dense layers by mlp_layer_types"
    )
    student = "same class, every layer dense (mlp_layer_types all 'dense')"
    model_types = ("beam",)
    block_classes = ("BeamMoE",)
    config_class = "BeamConfig"
    experts_key = "num_experts"
    shared_attr = None
    shared_key = None
    block_scale_attr = "routed_scaling_factor"  # the block's factor after the experts (block_scale)
    dense_layers = "mlp_layer_types"
    student_dense_fields = ("mlp_layer_types",)
