"""Expert scorings: a base score s_e per expert, and the selector that picks the K kept experts.

Paper §3.2 and Appendix C (SF, PP, PS, CP, ACP, DO-CP, DO-ACP); REAP, REAP-p and EAN from the REAP paper
(Lasby et al., "REAP the Experts", Eq. 9 and Appendix D); DO-REAP = the D-optimal selection with REAP
as its importance; Weights = PS / SF (CD-MoE's ratio, the C2F paper's baseline); max_activations (the REAP
repository's criterion: an expert's largest output element, from the expert_maxima pass); RL-exhaustive,
RL-greedy and CFES select by the layer's reconstruction loss on real tokens ("Compressing Large MoE
Models via Efficient Pruning and Data-Aware Calibration", §4.1; see workers/methods/reconstruction.py).
Adding a scoring = one function `(ctx) -> Tensor[E]` plus one registry line. Pure tensor code: no
transformers import.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from workers.core.registry import lookup
from workers.core.types import LayerContext, LayerStats
from workers.methods.reconstruction import ReconstructionSelector
from workers.methods.selection import Selection, d_optimal_greedy, importance_kernel, top_k

# (ctx, scores, K, forced=()) -> Selection; `forced` experts are kept first (e.g. protected super experts)
Selector = Callable[..., Selection]


def _f64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", torch.float64)


def _n(stats: LayerStats) -> int:
    if stats.n_tokens <= 0:
        raise ValueError(f"stats.n_tokens={stats.n_tokens}; must be > 0")
    return stats.n_tokens


def _per_routed(total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """total / count, 0 where the expert was never selected."""
    c = _f64(count)
    return torch.where(c > 0, _f64(total) / c.clamp_min(1), torch.zeros_like(c))


def sf(ctx: LayerContext) -> torch.Tensor:
    """Selection frequency (1/N) Σ_t 1[e∈S(t)] (Appendix C)."""
    return _f64(ctx.stats.count) / _n(ctx.stats)


def pp(ctx: LayerContext) -> torch.Tensor:
    """Pre-selection probability (1/N) Σ_t p_e(t) (Appendix C)."""
    return _f64(ctx.stats.sum_p) / _n(ctx.stats)


def ps(ctx: LayerContext) -> torch.Tensor:
    """Post-selection probability (1/N) Σ_{t: e∈S(t)} p_e(t) = SF × CP (Appendix C)."""
    return _f64(ctx.stats.sum_p_sel) / _n(ctx.stats)


def cp(ctx: LayerContext) -> torch.Tensor:
    """Conditional probability Σ_{t: e∈S(t)} p_e(t) / |{t: e∈S(t)}|, 0 if never selected (§3.2, Eq. 3)."""
    return _per_routed(ctx.stats.sum_p_sel, ctx.stats.count)


def weights(ctx: LayerContext) -> torch.Tensor:
    """CD-MoE's "Weights" as the C2F paper's baseline defines it: the average routing weight (over all
    tokens, 0 where the expert is not selected: PS) over the activation frequency (SF), 0 if never
    selected. PS / SF = Σ_{t: e∈S(t)} p_e(t) / |{t: e∈S(t)}|, i.e. exactly CP; computed as the ratio."""
    # C2F/DCDM paper, Sec. 5.1 (baseline "Weights", after Cao et al. 2024, CD-MoE)
    f = sf(ctx)
    return torch.where(f > 0, ps(ctx) / f.where(f > 0, torch.ones_like(f)), torch.zeros_like(f))


def max_activations(ctx: LayerContext) -> torch.Tensor:
    """The REAP repository's `max_activations` pruning score: each expert's largest output element over its
    routed calibration tokens (the expert_maxima pass), the K largest kept."""
    # REAP repository, observer `max_activations` (a pruning criterion beside REAP, EAN and frequency)
    if ctx.maxima is None:
        raise ValueError(
            "scoring max_activations needs the per-expert max activations of the expert_maxima pass; "
            "none reached this conversion"
        )
    if ctx.maxima.numel() != ctx.stats.num_experts:
        raise ValueError(f"{ctx.maxima.numel()} max activations for {ctx.stats.num_experts} experts")
    return _f64(ctx.maxima).reshape(-1)


def acp(ctx: LayerContext) -> torch.Tensor:
    """Activation-weighted CP: CP · sqrt(E_t ‖f_e(t)‖²) over all tokens (§3.2)."""
    return cp(ctx) * (_f64(ctx.stats.sum_sq) / _n(ctx.stats)).clamp_min(0).sqrt()


def reap(ctx: LayerContext) -> torch.Tensor:
    """REAP saliency: mean over routed tokens of g_e(t)·‖f_e(t)‖, 0 if never routed (REAP paper, Sec. 4, Eq. 9).

    g is the gate the model really applied (renormalized over the top-k where the router does, times
    DeepSeek's routed scaling factor): the paper's definition. `REAP-p` (reap_p) is the variant with the
    full-softmax probability p in place of g, what the REAP repository's earlier code used as the gate.
    How REAP differs from ACP (paper §3.2), which also weighs an expert's output by its router mass:
      - gate: REAP uses the applied gate g (REAP-p: p), ACP the raw softmax p over all E;
      - tokens: REAP averages over the tokens routed to e only, ACP's norm is the RMS over all tokens;
      - combination: REAP is one joint conditional mean E[g·‖f‖ | e routed], ACP a product of two
        separate means, CP_e × sqrt(E_t ‖f_e‖²).
    Selection keeps the K largest; on equal scores the lower expert id wins (workers.methods.selection.top_k).
    """
    return _per_routed(ctx.stats.sum_gnorm_sel, ctx.stats.count)


def reap_p(ctx: LayerContext) -> torch.Tensor:
    """REAP-p: mean over routed tokens of p_e(t)·‖f_e(t)‖ with p the softmax over all E router logits
    (REAP paper Eq. 9 with the REAP repository's earlier gate), 0 if never routed."""
    ctx.stats.require("sum_pnorm_sel")
    return _per_routed(ctx.stats.sum_pnorm_sel, ctx.stats.count)


def ean(ctx: LayerContext) -> torch.Tensor:
    """EAN: Σ over routed tokens of ‖f_e(t)‖ (REAP paper, Appendix D, Eq. 13)."""
    return _f64(ctx.stats.sum_norm_sel)


def select_top_k(ctx: LayerContext, scores: torch.Tensor, K: int, forced: tuple[int, ...] = ()) -> Selection:
    """Independent scoring: keep the K best, ties → lower expert id (after the `forced` experts)."""
    return Selection(top_k(scores, K, forced))


def select_d_optimal(
    ctx: LayerContext, scores: torch.Tensor, K: int, forced: tuple[int, ...] = ()
) -> Selection:
    """Greedy D-optimal on 𝒦 = sqrt(I_i I_j)·G_ij with I = the base score and λ = trace(𝒦)/(K·E) (Algorithm 2).

    With this (the paper's) λ the greedy may keep two identical experts (Appendix E.1 with K ≥ 4):
    see d_optimal_greedy.
    """
    kernel = importance_kernel(ctx.stats.gram, ctx.stats.n_tokens, scores)
    return d_optimal_greedy(kernel, K, forced=forced)


@dataclass(frozen=True)
class Scoring:
    """A base score (used for merging, scaling and RR order) and the rule that picks the K kept experts."""

    score: Callable[[LayerContext], torch.Tensor]
    select: Selector = select_top_k


SCORINGS: dict[str, Scoring] = {
    "SF": Scoring(sf),
    "PP": Scoring(pp),
    "PS": Scoring(ps),
    "CP": Scoring(cp),
    "ACP": Scoring(acp),
    "DO-CP": Scoring(cp, select_d_optimal),
    "DO-ACP": Scoring(acp, select_d_optimal),
    "REAP": Scoring(reap),
    "REAP-p": Scoring(reap_p),
    "DO-REAP": Scoring(reap, select_d_optimal),
    "EAN": Scoring(ean),
    "frequency": Scoring(sf),
    "Weights": Scoring(weights),  # PS / SF (= CP), the C2F paper's CD-MoE baseline
    "max_activations": Scoring(max_activations),  # the REAP repository's criterion (the expert_maxima pass)
    # reconstruction-loss selection on the calibration token sample (workers/methods/reconstruction.py); base score PS
    "RL-exhaustive": Scoring(ps, ReconstructionSelector("exhaustive")),
    "RL-greedy": Scoring(ps, ReconstructionSelector("greedy")),
    "CFES": Scoring(ps, ReconstructionSelector("c2f")),
}


def get_scoring(name: str) -> Scoring:
    return lookup(SCORINGS, name, "scoring")
