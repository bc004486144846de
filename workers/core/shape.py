"""The routed-MoE shape of a teacher, torch-free: the family adapters build it from a model config, and the
orchestrator plans a sweep's configurations with it (from the config, or from what the sweep file states)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TeacherShape:
    """The routed-MoE shape of a teacher as its family's architecture builds it from the config alone
    (no weights): what a sweep's E and k must agree with."""

    family: str  # adapter name, e.g. "qwen3_moe"
    model_type: str  # config.model_type
    num_experts: int  # E: routed experts per MoE layer
    top_k: int  # k: experts the router picks per token
    renormalize: bool  # whether the router divides its top-k weights by their sum
    shared_experts: int  # always-on shared experts per MoE layer (K counts routed experts only)
    moe_layers: int  # decoder layers whose FFN is a routed MoE block
