"""PhiMoE / Phi-3.5-MoE (`PhimoeSparseMoeBlock`): SparseMixer routing, always two experts.

Router (`mlp.router`, an nn.Linear [E, H] without bias) returns (logits, multipliers [T, 2], selected [T, 2])
from transformers' `sparsemixer`. In eval mode: expert 1 = the argmax of the logits z, its weight the softmax
over the experts whose logit lies within a relative threshold 2·`router_jitter_noise` of the max
((z_max − z_e) / max(|z_e|, z_max) ≤ 2ε; the others masked to -inf); expert 2 = the argmax with expert 1
masked, its weight the softmax over the survivors of the same threshold relative to that max. The two weights
are each a softmax over a masked set: they do not sum to 1 (renormalized = False). Exactly two experts
whatever `num_experts_per_tok` says (the modeling code never reads it), so a config with another value is
refused. In training mode the router samples both picks (Gumbel) and scales the multipliers (Heun's
third-order gradient estimate): hooks, `routing_top_k` and Router KD see whatever mode the caller set, and
training-mode routing is PhiMoE's own sampling.

p (what scorings read) is the softmax of the logits over all E; the weights and indices are the router's own.
Expanded routing (`routing_top_k`) picks the top-k of p with weights p of the k, renormalized iff asked
(None: not); k = 2 with the native rule leaves SparseMixer's output untouched.

No dense student: SparseMixer always routes two experts (with one expert the second pick is a softmax over an
all -inf row, NaN) and a two-expert student with a zero router ties (weights 0.5 / 1.0, the order decided by
the argmax in eval and by sampling in training), so no PhiMoE-class model computes one dense FFN, and
transformers has no dense sibling (LayerNorm with bias, attention and lm_head biases). Pruned, merged and
edited MoE students (the same class, E′ ≥ 2 experts) are written. A pruned router's SparseMixer over the kept
logits routes as the teacher's with the dropped experts' logits at -inf (a -inf logit is never the max and
its softmax weight is 0).

renormalized = False drives no default scaling here (dp_scaling applies to the dense student only); it is the
rule reconstruction-loss selection (workers.methods.reconstruction, target routed_subset) applies to a pruned layer,
the top-2 of p restricted to the kept experts, not renormalized: an approximation of SparseMixer's masked
softmaxes, as the top-k of p is of DeepSeek-V3's corrected choice.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from workers.core.shape import TeacherShape
from workers.core.types import DenseFFN
from workers.families.fused import FusedMoeAdapter, config_int

SPARSEMIXER_K = 2  # SparseMixer's picks per token, fixed by the modeling code
DENSE_REFUSED = (
    "cannot write a dense student: SparseMixer always routes two experts (one expert gives NaN, "
    "two tie under a zero router) and transformers has no dense sibling"
)


class PhimoeAdapter(FusedMoeAdapter):
    name = "phimoe"
    edited = ("PhimoeConfig", "PhimoeForCausalLM", "fused")
    routing = (
        "SparseMixer: argmax, then the argmax of the rest, each weighted by a softmax over the logits "
        "within 2·router_jitter_noise (relative) of its max; always two experts, not renormalized; "
        "no shared experts, no dense layers"
    )
    student = (
        "none dense (refused: SparseMixer always routes two experts); pruned/merged/edited MoE with E' >= 2"
    )
    model_types = ("phimoe",)
    block_classes = ("PhimoeSparseMoeBlock",)
    router_attr = "router"
    experts_key = "num_local_experts"
    renorm = False  # two softmaxes over masked sets: the weights do not sum to 1
    refused_outputs: Mapping[str, str] = {"dense": DENSE_REFUSED}

    # --- structure from the config alone ----------------------------------------------------------
    def shape_from_config(self, config: Any) -> TeacherShape:
        k = (
            config_int(config, "num_experts_per_tok")
            if getattr(config, "model_type", None) == "phimoe"
            else None
        )
        if k is not None and k != SPARSEMIXER_K:
            raise ValueError(
                f"phimoe config: num_experts_per_tok={k}; SparseMixer always routes "
                f"{SPARSEMIXER_K} experts, only {SPARSEMIXER_K} is allowed"
            )
        return super().shape_from_config(config)

    # --- structure --------------------------------------------------------------------------------
    def top_k(self, model: nn.Module) -> int:
        """2, SparseMixer's fixed number of picks (a model whose config says otherwise is refused)."""
        k = getattr(model.config, "num_experts_per_tok", None)
        if k != SPARSEMIXER_K:
            raise ValueError(
                f"phimoe config: num_experts_per_tok={k!r}; SparseMixer always routes "
                f"{SPARSEMIXER_K} experts, only {SPARSEMIXER_K} is allowed"
            )
        return SPARSEMIXER_K

    # --- dense student: refused -------------------------------------------------------------------
    def student_config(self, teacher: nn.Module, width: int) -> Any:
        """Refused (see the module docstring): a one-line ValueError."""
        raise ValueError(f"output='dense': phimoe {DENSE_REFUSED}")

    def build_student(
        self,
        teacher: nn.Module,
        ffns: dict[int, DenseFFN],
        share_weights: bool = False,
        shared_scale: Mapping[int, float] | None = None,
    ) -> nn.Module:
        """Refused (see the module docstring): a one-line ValueError."""
        raise ValueError(f"output='dense': phimoe {DENSE_REFUSED}")
