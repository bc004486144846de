"""DeepSeek-V2 (`DeepseekV2Moe`) and DeepSeek-V3 (`DeepseekV3MoE`): same fused experts, ungated
shared experts, dense first layers (`first_k_dense_replace`).

V2 router: softmax over E (fp32) → greedy or group-limited top-k → × routed_scaling_factor; never
renormalized (its config's norm_topk_prob is ignored by the router). V3 router: sigmoid scores; the
choice uses scores + e_score_correction_bias with group-limited top-k; the weights are the unbiased
sigmoid scores of the chosen k, renormalized iff norm_topk_prob, × routed_scaling_factor. For V3,
p (router_decision) is the sigmoid scores normalized over all E, so p restricted to the chosen k and
renormalized equals the applied weights / routed_scaling_factor.

routing_top_k with k′ ≠ k (or a non-native renormalization) picks the plain top-k′ (V3: of the
biased scores) without the group limit (paper §4.3 Eq. 6 uses the k′ highest-probability experts).

Student: the same class with first_k_dense_replace = num_hidden_layers (every layer a dense MLP of
width `width`); shared experts concatenated with scale 1.0 (K counts routed experts only); the
teacher's dense layers zero-padded to the same width. The routed part is
multiplied by routed_scaling_factor (see FamilyAdapter.routed_scaling).

Pruned MoE (pruned_moe_student): router rows, V3's e_score_correction_bias and the experts sliced to
the kept ids (ascending); routed_scaling_factor, k and norm_topk_prob unchanged. Group-limited routing
(V2 topk_method="group_limited_greedy", V3 always) splits the E experts into n_group contiguous blocks.
The groups are kept (n_group, topk_group unchanged) when every layer keeps E'/n_group experts of every
original group, topk_group × E'/n_group >= k (the chosen groups can supply k experts) and, for V3
(whose group score sums the group's top-2 scores), E'/n_group >= 2: the pruned router's contiguous
blocks are then exactly the original groups minus the dropped experts, and the pruned model routes as
the teacher with the dropped experts excluded. Otherwise (E' not divisible by n_group, an uneven pick
across the groups, too few per group) the pruned config sets n_group = topk_group = 1: plain top-k over
the survivors (V3: of the bias-corrected scores). Re-cutting the survivors into n_group new contiguous
blocks would group experts that were never grouped, an arbitrary constraint; dropping the group limit
keeps the rest of the teacher's rule (DeepSeek motivates the limit by the devices a token's experts
sit on, not by what the experts compute). V2 "greedy" routing ignores the groups: n_group/topk_group
are left as they are.

Merged MoE (merged_moe_student): the same rule with clusters in place of kept experts. The group limit
is kept when every cluster lies inside one original group, the clusters are listed group by group and
one representative per cluster passes the pruned MoE's condition above (so the merged router's
contiguous blocks are the original groups, each with its merged experts); otherwise
n_group = topk_group = 1. V3's e_score_correction_bias is combined like the router rows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

from workers.core.types import MergedLayer
from workers.families.fused import FusedMoeAdapter, config_int


class DeepseekStyleAdapter(FusedMoeAdapter):
    """The shared base of the DeepSeek-V3-style families (DeepSeek-V2/V3/V3.2, GLM-4.5/4.7/5, dots, Solar Open,
    EXAONE-MoE, MiMo-V2-Flash, Beam): the V3 router (sigmoid scores, group-limited top-k of scores +
    gate.e_score_correction_bias, × routed_scaling_factor), shared experts fused into one MLP, and the group
    limit kept or dropped in pruned and merged MoE students (module docstring). A family states its layout
    (dense_layers, shared_key, experts_key), its classes and its student in fields; V2 changes the router."""

    scores = "sigmoid"
    correction_bias = "gate.e_score_correction_bias"
    shared_attr = "shared_experts"
    shared_key = "n_shared_experts"
    experts_key = "n_routed_experts"
    dense_layers = "first_k_dense_replace"
    min_group: int = 2  # experts a group must keep for the router's group score (V3: top-2 sum; V2: 1)

    def group_limited(self, config: Any) -> bool:
        """Does the router restrict each token to topk_group of n_group expert groups?"""
        return True

    def groups_survive(self, config: Any, kept: Mapping[int, Sequence[int]]) -> bool:
        """Can the pruned router keep n_group/topk_group and route exactly as the teacher without the
        dropped experts (module docstring)?"""
        E, e_new = config_int(config, self.experts_key), len(next(iter(kept.values())))
        n_group, topk_group = config_int(config, "n_group"), config_int(config, "topk_group")
        k = config_int(config, "num_experts_per_tok")
        if e_new % n_group or e_new // n_group < self.min_group or topk_group * (e_new // n_group) < k:
            return False
        size = E // n_group
        return all(
            sorted(e // size for e in ids) == sorted(list(range(n_group)) * (e_new // n_group))
            for ids in kept.values()
        )

    def pruned_config(self, model: nn.Module, kept: dict[int, list[int]]) -> Any:
        cfg = super().pruned_config(model, kept)
        if self.group_limited(model.config) and not self.groups_survive(model.config, kept):
            cfg.n_group, cfg.topk_group = 1, 1
        return self.check_group_size(cfg, len(next(iter(kept.values()))))

    def check_group_size(self, cfg: Any, e_new: int) -> Any:
        if self.group_limited(cfg) and e_new // cfg.n_group < self.min_group:
            raise ValueError(
                f"{self.name}: its group score needs >= {self.min_group} experts per group; "
                f"kept {e_new} experts"
            )
        return cfg

    def merged_groups_survive(self, config: Any, merged: Mapping[int, MergedLayer]) -> bool:
        """Can the merged router keep n_group/topk_group (module docstring)? Every cluster inside one
        original group, the clusters listed group by group, and the group condition of a pruned MoE
        for one representative per cluster."""
        size = config_int(config, self.experts_key) // config_int(config, "n_group")
        reps: dict[int, list[int]] = {}
        for layer, m in merged.items():
            owner = [{e // size for e in g} for g in m.groups]
            seq = [min(o) for o in owner]
            if any(len(o) != 1 for o in owner) or seq != sorted(seq):
                return False
            reps[layer] = [min(g) for g in m.groups]
        return self.groups_survive(config, reps)

    def merged_config(self, model: nn.Module, merged: dict[int, MergedLayer]) -> Any:
        cfg = super().merged_config(model, merged)
        if self.group_limited(model.config) and not self.merged_groups_survive(model.config, merged):
            cfg.n_group, cfg.topk_group = 1, 1
        return self.check_group_size(cfg, next(iter(merged.values())).num_experts)


class DeepseekV2Adapter(DeepseekStyleAdapter):
    name = "deepseek_v2"
    edited = ("DeepseekV2Config", "DeepseekV2ForCausalLM", "fused")
    routing = (
        "softmax over E, greedy or group-limited top-k (groups ranked by their max), × "
        "routed_scaling_factor, never renormalized; ungated shared experts; first_k_dense_replace "
        "dense layers"
    )
    student = "same class, every layer dense (first_k_dense_replace = num_hidden_layers)"
    model_types = ("deepseek_v2",)
    block_classes = ("DeepseekV2Moe",)
    scores = "softmax"
    correction_bias = None
    renorm = (
        False  # DeepseekV2TopkRouter never divides by the top-k sum (the config's norm_topk_prob is ignored)
    )
    min_group = 1
    config_class = "DeepseekV2Config"
    student_dense_fields = ("first_k_dense_replace",)

    def group_limited(self, config: Any) -> bool:
        return getattr(config, "topk_method", None) == "group_limited_greedy"


class DeepseekV3Adapter(DeepseekStyleAdapter):
    name = "deepseek_v3"
    edited = ("DeepseekV3Config", "DeepseekV3ForCausalLM", "fused")
    routing = (
        "sigmoid scores, group-limited top-k of scores + e_score_correction_bias (groups ranked by their "
        "top-2 sum), unbiased scores renormalized iff norm_topk_prob, × routed_scaling_factor; ungated "
        "shared experts; first_k_dense_replace dense layers"
    )
    student = "same class, every layer dense (first_k_dense_replace = num_hidden_layers)"
    model_types = ("deepseek_v3",)
    block_classes = ("DeepseekV3MoE",)
    config_class = "DeepseekV3Config"
    student_dense_fields = ("first_k_dense_replace",)
