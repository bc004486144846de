"""Choosing the K experts to keep: top-K by score and greedy D-optimal design (paper §3.2, Algorithm 2).

Pure tensor code (float64, CPU): no transformers import.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

# Two candidates whose gains agree to this relative tolerance are a tie, broken by the lower expert id,
# so the choice does not depend on the last bits of floating-point rounding.
TIE_RTOL = 1e-10


@dataclass
class Selection:
    """The kept experts in the selector's order, plus numbers worth recording (e.g. λ)."""

    selected: list[int]
    extras: dict = field(default_factory=dict)


def check_forced(forced: list[int] | tuple[int, ...], K: int, E: int) -> list[int]:
    """Experts a selection must start with: distinct ids in 0..E-1, at most K of them."""
    out = [int(e) for e in forced]
    if len(set(out)) != len(out) or not all(0 <= e < E for e in out) or len(out) > K:
        raise ValueError(f"forced={out}: need at most K={K} distinct expert ids in 0..{E - 1}")
    return out


def top_k(scores: torch.Tensor, K: int, forced: list[int] | tuple[int, ...] = ()) -> list[int]:
    """The K highest scores, ties broken by the lower expert id (Algorithm 1 line 1). With `forced`:
    those experts first, in their order, then the highest scores among the others."""
    s = scores.detach().to("cpu", torch.float64).tolist()
    if not 1 <= K <= len(s):
        raise ValueError(f"K={K} out of range; allowed 1 <= K <= E={len(s)}")
    first = check_forced(forced, K, len(s))
    rest = sorted((e for e in range(len(s)) if e not in first), key=lambda e: (-s[e], e))
    return (first + rest)[:K]


def importance_kernel(gram: torch.Tensor, n_tokens: int, importance: torch.Tensor) -> torch.Tensor:
    """𝒦_ij = sqrt(I_i I_j) · G_ij with G = gram / N (paper §3.2, Eq. 4)."""
    if n_tokens <= 0:
        raise ValueError(f"n_tokens={n_tokens}; must be > 0")
    imp = importance.detach().to("cpu", torch.float64)
    if not bool(torch.isfinite(imp).all()) or bool((imp < 0).any()):
        raise ValueError("importance must be finite and >= 0 (Appendix B: I_e = s_e >= 0)")
    g = gram.detach().to("cpu", torch.float64) / n_tokens
    g = 0.5 * (g + g.T)
    r = imp.sqrt()
    return r[:, None] * g * r[None, :]


def default_lambda(kernel: torch.Tensor, K: int) -> float:
    """λ_reg = trace(𝒦) / (K·E) (paper Eq. 4); 1.0 for an all-zero kernel, where any λ > 0 selects the same."""
    lam = float(torch.diagonal(kernel).sum()) / (K * kernel.shape[0])
    return lam if lam > 0 else 1.0


def log_det_objective(kernel: torch.Tensor, subset: list[int], lam: float, normalized: bool = True) -> float:
    """F̃(S) = log det(I + 𝒦_S/λ) (normalized, Eq. 11) or F(S) = log det(𝒦_S + λI)."""
    idx = torch.as_tensor(subset, dtype=torch.long)
    ks = kernel.to(torch.float64)[idx][:, idx]
    eye = torch.eye(len(subset), dtype=torch.float64)
    m = eye + ks / lam if normalized else ks + lam * eye
    return float(torch.linalg.slogdet(m).logabsdet)


def argmax_low_id(values: torch.Tensor, available: torch.Tensor) -> int:
    """Index of the largest available value; values within TIE_RTOL of it count as ties → lowest id."""
    v = torch.where(available, values, torch.full_like(values, -math.inf))
    best = float(v.max())
    ok = available & (values >= best - TIE_RTOL * abs(best))
    return int(torch.nonzero(ok)[0])


def d_optimal_greedy(
    kernel: torch.Tensor,
    K: int,
    lam: float | None = None,
    progress: Callable[[int, int], None] | None = None,
    forced: list[int] | tuple[int, ...] = (),
) -> Selection:
    """Greedy D-optimal selection (Algorithm 2): maximize log det(𝒦_S + λI) one expert at a time.

    Each step adds the e with the largest Schur complement σ_e = 𝒦_ee + λ − 𝒦_eS (𝒦_S + λI)^{-1} 𝒦_Se
    (the first step is argmax log(𝒦_ee + λ)). The σ_e of all candidates are kept up to date by an
    incremental Cholesky factor of 𝒦_S + λI, so the whole selection costs O(E·K²) instead of O(E·K³).

    λ defaults to trace(𝒦)/(K·E) as in the paper. That default is small: on the Appendix E.1
    redundancy construction (K identical experts + K−1 orthogonal specialists) it keeps a second
    identical expert for K ≥ 4 instead of a specialist; with the proof's λ = β (the specialists'
    kernel diagonal) it keeps one redundant expert and all specialists. This is what Eq. 4 with the
    paper's λ does, not a defect of the greedy; pass `lam` to choose another regularizer.
    `forced`: experts taken as the first picks, in order (e.g. protected super experts); the greedy
    then continues from that set.
    Extras: `lambda`, `log_gains` (log σ of each pick, in order), `log_det` = F̃(S) = log det(I + 𝒦_S/λ).
    """
    km = kernel.detach().to("cpu", torch.float64)
    if km.ndim != 2 or km.shape[0] != km.shape[1]:
        raise ValueError(f"kernel shape {tuple(km.shape)}; must be square [E, E]")
    E = km.shape[0]
    if not 1 <= K <= E:
        raise ValueError(f"K={K} out of range; allowed 1 <= K <= E={E}")
    first = check_forced(forced, K, E)
    lam = default_lambda(km, K) if lam is None else float(lam)
    if not (lam > 0 and math.isfinite(lam)):
        raise ValueError(f"lambda={lam}; must be finite and > 0")
    km = 0.5 * (km + km.T)
    sigma = torch.diagonal(km).clone() + lam  # σ_e(∅) = 𝒦_ee + λ
    rows = torch.zeros(K, E, dtype=torch.float64)  # row i = i-th row of L^{-1} 𝒦_{S,·}, L L^T = 𝒦_S + λI
    available = torch.ones(E, dtype=torch.bool)
    selected: list[int] = []
    gains: list[float] = []
    for step in range(K):
        j = first[step] if step < len(first) else argmax_low_id(sigma, available)
        selected.append(j)
        gains.append(math.log(float(sigma[j])))
        available[j] = False
        if progress is not None:
            progress(step + 1, K)
        if step == K - 1:
            break
        # New Cholesky row: (𝒦_j· − Σ_i L^{-1}-rows_i[j] · rows_i) / sqrt(σ_j); then σ_e -= row_e².
        row = (km[j] - rows[:step].T @ rows[:step, j]) / math.sqrt(float(sigma[j]))
        rows[step] = row
        sigma = torch.clamp_min(sigma - row * row, lam)  # σ_e ≥ λ always (Appendix E.2, Eq. 34)
    log_det = sum(gains) - K * math.log(lam)
    return Selection(selected, {"lambda": lam, "log_gains": gains, "log_det": log_det})
