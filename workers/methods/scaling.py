"""Down-projection scales α_g and within-group merge weights (paper §3.3–3.4, Eq. 1, Appendix H, §4.6).

A scaling is `(ctx, groups, scores, selected) -> list[float]` (one α per group).
Pure tensor code: no transformers import.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from workers.core.registry import lookup
from workers.core.types import LayerContext
from workers.methods.scoring import cp

Scaling = Callable[[LayerContext, list[list[int]], torch.Tensor, list[int]], list[float]]


def _s(scores: torch.Tensor) -> list[float]:
    return scores.detach().to("cpu", torch.float64).tolist()


def merge_weights(groups: list[list[int]], scores: torch.Tensor) -> list[list[float]]:
    """w_e = s_e / Σ_{G_g} s (Eq. 1, Algorithm 1 line 4); uniform within a group whose scores sum to 0."""
    s = _s(scores)
    out = []
    for g in groups:
        total = sum(s[e] for e in g)
        out.append([s[e] / total for e in g] if total > 0 else [1.0 / len(g)] * len(g))
    return out


def uniform(
    ctx: LayerContext, groups: list[list[int]], scores: torch.Tensor, selected: list[int]
) -> list[float]:
    """α_g = 1/k (Appendix H, Eq. 155)."""
    return [1.0 / len(groups)] * len(groups)


def proportional(
    ctx: LayerContext, groups: list[list[int]], scores: torch.Tensor, selected: list[int]
) -> list[float]:
    """α_g = Σ_{G_g} s / Σ_{selected} s (Appendix H, Eq. 156); |G_g|/K if every kept score is 0."""
    s = _s(scores)
    total = sum(s[e] for e in selected)
    if total <= 0:
        return [len(g) / len(selected) for g in groups]
    return [sum(s[e] for e in g) / total for g in groups]


def avg_cp(
    ctx: LayerContext, groups: list[list[int]], scores: torch.Tensor, selected: list[int]
) -> list[float]:
    """α_g = the unweighted mean CP of the group's experts (§4.6, DeepSeek-V2-Lite).

    Meant for routers that do not renormalize their top-k: the MoE then scales each selected expert
    by p_e, on average CP_e. The paper uses CP whatever the scoring (it is a routing quantity, not the
    base score), so this ignores `scores`. A model-level routed scaling factor is not included.
    """
    c = cp(ctx).tolist()
    return [sum(c[e] for e in g) / len(g) for g in groups]


SCALINGS: dict[str, Scaling] = {
    "uniform": uniform,
    "proportional": proportional,
    "avg_cp": avg_cp,
}


def get_scaling(name: str) -> Scaling:
    return lookup(SCALINGS, name, "dp_scaling")
