"""D-optimal selection against the paper's statements (§3.2, Algorithm 2, Appendix E)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from workers.core.types import ExpertWeights, LayerContext
from workers.methods.diagnostics import effective_rank, jaccard, stats_from_tokens
from workers.methods.planning import plan_layer
from workers.methods.scoring import SCORINGS, acp
from workers.methods.selection import (
    TIE_RTOL,
    d_optimal_greedy,
    default_lambda,
    importance_kernel,
    log_det_objective,
    top_k,
)


def random_psd(E: int, seed: int, rank: int | None = None) -> torch.Tensor:
    """Random PSD kernel with uneven scales and some near-duplicate columns."""
    gen = torch.Generator().manual_seed(seed)
    f = torch.randn(E, rank or E, generator=gen, dtype=torch.float64)
    f[E // 2] = f[0] + 0.01 * torch.randn(f.shape[1], generator=gen, dtype=torch.float64)  # near-duplicate
    f = f * torch.rand(E, 1, generator=gen, dtype=torch.float64).mul(3).add(0.1)
    return f @ f.T


def schur_complements(kernel: torch.Tensor, S: list[int], lam: float) -> dict[int, float]:
    """σ_e = 𝒦_ee + λ − 𝒦_eS (𝒦_S + λI)^{-1} 𝒦_Se for every e ∉ S, written out literally (Algorithm 2 line 8)."""
    out = {}
    for e in range(kernel.shape[0]):
        if e in S:
            continue
        if not S:
            out[e] = float(kernel[e, e]) + lam  # line 4
            continue
        A = kernel[S][:, S] + lam * torch.eye(len(S), dtype=torch.float64)
        kes = kernel[e, S]
        out[e] = float(kernel[e, e] + lam - kes @ torch.linalg.solve(A, kes))
    return out


def slow_greedy(kernel: torch.Tensor, K: int, lam: float) -> tuple[list[int], list[float]]:
    """Algorithm 2 as printed: every step re-solves with A_S, picks the largest σ (ties → lower id)."""
    S: list[int] = []
    gains: list[float] = []
    for _ in range(K):
        sigma = schur_complements(kernel, S, lam)
        best = max(sigma.values())
        pick = min(e for e, v in sigma.items() if v >= best - TIE_RTOL * abs(best))
        S.append(pick)
        gains.append(math.log(sigma[pick]))
    return S, gains


@pytest.mark.parametrize("seed", range(6))
def test_greedy_equals_slow_reference(seed):
    """Well-conditioned kernels: the fast greedy returns exactly the reference's ordered subset and gains."""
    for E in (5, 13, 32):
        kernel = random_psd(E, seed * 100 + E)
        for K in sorted({1, 2, E // 3 + 1, E // 2, E}):
            for lam in (None, 0.05, 0.5, 20.0):
                res = d_optimal_greedy(kernel, K, lam)
                lam_used = default_lambda(kernel, K) if lam is None else lam
                ref_sel, ref_gains = slow_greedy(kernel, K, lam_used)
                assert res.selected == ref_sel, (E, K, lam)
                assert res.extras["lambda"] == lam_used
                torch.testing.assert_close(
                    torch.tensor(res.extras["log_gains"], dtype=torch.float64),
                    torch.tensor(ref_gains, dtype=torch.float64),
                    rtol=1e-9,
                    atol=1e-9,
                )
                # The recorded objective is F̃(S) = log det(I + 𝒦_S/λ) (Eq. 11).
                assert math.isclose(
                    res.extras["log_det"],
                    log_det_objective(kernel, ref_sel, lam_used),
                    rel_tol=1e-8,
                    abs_tol=1e-8,
                )


@pytest.mark.parametrize("seed", range(4))
def test_greedy_follows_the_reference_rule_on_rank_deficient_kernels(seed):
    """Rank-deficient kernel, tiny λ: once the rank is used up all σ_e ≈ λ are numerical ties, so check
    each step's pick against the reference's Schur complements instead of the exact order."""
    for E in (9, 24):
        kernel = random_psd(E, seed * 10 + E, rank=3)
        for K in (3, 6, E):
            for lam in (1e-3, None):
                res = d_optimal_greedy(kernel, K, lam)
                lam_used = res.extras["lambda"]
                for step, pick in enumerate(res.selected):
                    sigma = schur_complements(kernel, res.selected[:step], lam_used)
                    best = max(sigma.values())
                    assert sigma[pick] >= best * (1 - 1e-6), (E, K, lam, step)
                    assert math.isclose(res.extras["log_gains"][step], math.log(sigma[pick]), rel_tol=1e-6)
                assert len(set(res.selected)) == K
                if K == 3:  # within the rank the choice is unambiguous
                    assert res.selected == slow_greedy(kernel, K, lam_used)[0]


def test_default_lambda_is_trace_over_K_times_E():
    kernel = random_psd(9, 3)
    assert math.isclose(default_lambda(kernel, 4), float(kernel.trace()) / (4 * 9), rel_tol=1e-14)
    assert d_optimal_greedy(kernel, 4).extras["lambda"] == default_lambda(kernel, 4)


@pytest.mark.parametrize("seed", range(8))
def test_greedy_is_within_1_minus_1_over_e_of_brute_force(seed):
    """Proposition 3.2: F̃(S_greedy) ≥ (1 − 1/e) max_{|S|=K} F̃(S), for any PSD 𝒦 and λ > 0."""
    E = 8 + seed % 3
    kernel = random_psd(E, seed, rank=3 + seed % 4)
    for K in (2, 4, 6):
        for lam in (None, 0.01, 1.0):
            res = d_optimal_greedy(kernel, K, lam)
            lam_used = res.extras["lambda"]
            best = max(
                log_det_objective(kernel, list(S), lam_used) for S in itertools.combinations(range(E), K)
            )
            got = log_det_objective(kernel, res.selected, lam_used)
            assert got >= (1 - 1 / math.e) * best - 1e-12
            assert got <= best + 1e-9


@pytest.mark.parametrize("seed", range(4))
def test_normalized_objective_is_monotone_submodular(seed):
    """Appendix E.2: σ_e(S) ≥ λ (monotone) and σ_e(S) ≥ σ_e(T) for S ⊆ T (diminishing returns)."""
    kernel = random_psd(10, seed, rank=4)
    lam = 0.3
    gen = torch.Generator().manual_seed(seed)
    for _ in range(20):
        perm = torch.randperm(10, generator=gen).tolist()
        T, e = perm[:6], [perm[6]]
        S = T[:3]
        gain_s = log_det_objective(kernel, S + e, lam) - log_det_objective(kernel, S, lam)
        gain_t = log_det_objective(kernel, T + e, lam) - log_det_objective(kernel, T, lam)
        assert gain_s >= -1e-12 and gain_t >= -1e-12
        assert gain_s >= gain_t - 1e-12


def test_incoherence_bound_for_the_diagonal_proxy():
    """Theorem 3.3: F(S_diag) ≥ max F − K log((1+(K−1)μ)/(1−(K−1)μ)) when (K−1)μ < 1."""
    gen = torch.Generator().manual_seed(0)
    E, K, lam = 9, 3, 0.05
    q, _ = torch.linalg.qr(torch.randn(E, E, generator=gen, dtype=torch.float64))
    f = q + 0.08 * torch.randn(E, E, generator=gen, dtype=torch.float64)  # nearly orthogonal outputs
    kernel = (f * torch.rand(E, 1, generator=gen, dtype=torch.float64).add(0.5)) @ (
        f * torch.rand(E, 1, generator=gen, dtype=torch.float64).add(0.5)
    ).T
    kernel = 0.5 * (kernel + kernel.T) + 0.5 * torch.eye(E, dtype=torch.float64)
    d = torch.diagonal(kernel)
    rho = kernel / (d[:, None] * d[None, :]).sqrt()
    mu = float((rho - torch.eye(E, dtype=torch.float64)).abs().max())
    assert (K - 1) * mu < 1
    F = lambda S: log_det_objective(kernel, list(S), lam, normalized=False)  # noqa: E731
    s_diag = top_k(d, K)
    best = max(F(S) for S in itertools.combinations(range(E), K))
    assert F(s_diag) >= best - K * math.log((1 + (K - 1) * mu) / (1 - (K - 1) * mu)) - 1e-12


# ---- Appendix E.1: independent scoring fails under redundancy --------------------------------------
def redundancy_context(K: int) -> LayerContext:
    """E = 2K−1 scalar experts on the uniform space {a_1..a_K, b_2..b_K}; a deterministic top-1 router.

    f_e(x) = 1[x ∈ {a_j}] for e = 1..K (identical); f_{K+j−1}(x) = 1[x = b_j] (orthogonal specialists);
    r(a_j) = j, r(b_j) = K+j−1 and p^(e)(x) = 1[e = r(x)] (Eq. 12–16). Indices here are 0-based.
    """
    E = 2 * K - 1
    n = E  # one calibration token per point of 𝒳
    f = torch.zeros(n, E, 1, dtype=torch.float64)
    f[:K, :K, 0] = 1.0  # tokens a_1..a_K switch on every redundant expert
    for j in range(K - 1):
        f[K + j, K + j, 0] = 1.0  # token b_{j+2} switches on specialist K+j
    route = torch.arange(n)  # r(a_j) = j, r(b_j) = K+j−1
    p = torch.nn.functional.one_hot(route, E).to(torch.float64)
    stats = stats_from_tokens(p, p.bool(), p, f)
    experts = ExpertWeights(gate=torch.randn(E, 2, 3), up=torch.randn(E, 2, 3), down=torch.randn(E, 3, 2))
    return LayerContext(
        stats=stats, experts=experts, router_weight=torch.randn(E, 3), top_k=1, renormalized=True
    )


def reconstruction_error(ctx: LayerContext, S: list[int], K: int) -> float:
    """ℒ(S) = min_a E_x (Σ_{e∈S} a_e f_e(x) − F_MoE(x))², F_MoE ≡ 1 (Eq. 17, 20)."""
    E = 2 * K - 1
    f = torch.zeros(E, E, dtype=torch.float64)
    f[:K, :K] = 1.0
    f[K:, K:] = torch.eye(K - 1, dtype=torch.float64)
    X = f[:, S]
    a = torch.linalg.lstsq(X, torch.ones(E, 1, dtype=torch.float64)).solution
    return float(((X @ a - 1) ** 2).mean())


@pytest.mark.parametrize("K", [2, 3, 4, 5])
def test_redundancy_counterexample_acp_vs_log_det(K):
    ctx = redundancy_context(K)
    E = 2 * K - 1
    redundant, specialists = list(range(K)), list(range(K, E))
    # Eq. 18: I_A = sqrt(K/(2K−1)), I_B = sqrt(1/(2K−1)); ACP top-K is the redundant block (Eq. 19, 22).
    imp = acp(ctx)
    torch.testing.assert_close(imp[:K], torch.full((K,), math.sqrt(K / E), dtype=torch.float64))
    torch.testing.assert_close(imp[K:], torch.full((K - 1,), math.sqrt(1 / E), dtype=torch.float64))
    s_ind = SCORINGS["ACP"].select(ctx, imp, K).selected
    assert sorted(s_ind) == redundant
    assert math.isclose(reconstruction_error(ctx, s_ind, K), (K - 1) / E, rel_tol=1e-9)
    # Eq. 25: α = 𝒦_11 = (K/(2K−1))^{3/2}, β = 𝒦_{K+1,K+1} = (1/(2K−1))^{3/2}.
    kernel = importance_kernel(ctx.stats.gram, ctx.stats.n_tokens, imp)
    alpha, beta = (K / E) ** 1.5, (1 / E) ** 1.5
    assert math.isclose(float(kernel[0, 0]), alpha, rel_tol=1e-12)
    assert math.isclose(float(kernel[K, K]), beta, rel_tol=1e-12)
    # With λ = β every log-det maximizer has exactly one redundant expert (Eq. 28–31) ...
    values = {S: log_det_objective(kernel, list(S), beta) for S in itertools.combinations(range(E), K)}
    best = max(values.values())
    maximizers = [S for S, v in values.items() if v >= best - 1e-9]
    assert all(len(set(S) & set(redundant)) == 1 for S in maximizers)
    assert len(maximizers) == K  # {i} ∪ specialists for each i
    # ... and so does the greedy, which reaches zero reconstruction error (Eq. 24).
    greedy = d_optimal_greedy(kernel, K, lam=beta).selected
    assert sorted(greedy) == [0] + specialists
    assert reconstruction_error(ctx, greedy, K) < 1e-12
    # Fig. 3's diagnostic: the ACP pick is a rank-one kernel, the log-det pick is not.
    idx = torch.as_tensor
    assert math.isclose(effective_rank(kernel[idx(s_ind)][:, idx(s_ind)]), 1.0, rel_tol=1e-9)
    assert effective_rank(kernel[idx(greedy)][:, idx(greedy)]) > 1.5


@pytest.mark.parametrize("K", [2, 3, 4, 5, 6, 7])
def test_redundancy_counterexample_with_the_default_lambda(K):
    """With λ = trace(𝒦)/(K·E) the greedy keeps a second redundant expert as soon as K ≥ 4.

    After one redundant pick, another identical expert has σ = λ(2α+λ)/(α+λ) and a specialist β + λ;
    the former wins iff λ > αβ/(α−β), which holds for K ≥ 4 with the default λ (the paper's own λ).
    """
    ctx = redundancy_context(K)
    E = 2 * K - 1
    sel = SCORINGS["DO-ACP"].select(ctx, acp(ctx), K)
    lam = sel.extras["lambda"]
    alpha, beta = (K / E) ** 1.5, (1 / E) ** 1.5
    assert math.isclose(lam, (K * alpha + (K - 1) * beta) / (K * E), rel_tol=1e-12)
    n_redundant = len(set(sel.selected) & set(range(K)))
    assert (n_redundant >= 2) == (K >= 4) == (lam > alpha * beta / (alpha - beta))
    if K >= 4:
        assert sel.selected[:2] == [0, 1]  # the first two picks are both redundant
        assert reconstruction_error(ctx, sel.selected, K) > 0
    else:
        assert sorted(sel.selected) == [0] + list(range(K, E))
    # The plan built from DO-ACP (default λ) keeps what the selector chose and records λ.
    plan = plan_layer(0, ctx, "DO-ACP", "RR", "uniform", K)
    assert plan.selected == sel.selected and plan.extras["lambda"] == lam
    # Still strictly more diverse than ACP's pick.
    acp_plan = plan_layer(0, ctx, "ACP", "RR", "uniform", K)
    assert plan.extras["effective_rank"] > acp_plan.extras["effective_rank"]
    assert jaccard(plan.selected, acp_plan.selected) < 1.0


def test_effective_rank_and_jaccard_known_values():
    assert math.isclose(effective_rank(torch.eye(5) * 3), 5.0, rel_tol=1e-12)
    v = torch.tensor([1.0, 2.0, -1.0], dtype=torch.float64)
    assert math.isclose(effective_rank(torch.outer(v, v)), 1.0, rel_tol=1e-9)
    # diag(2,1,1): p = (1/2, 1/4, 1/4), H = 1.5 ln 2, erank = 2^{1.5}.
    assert math.isclose(effective_rank(torch.diag(torch.tensor([2.0, 1.0, 1.0]))), 2**1.5, rel_tol=1e-9)
    assert effective_rank(torch.zeros(3, 3)) == 0.0  # exact: the all-zero matrix returns 0.0 by definition
    assert jaccard([1, 2, 3], [2, 3, 4]) == 0.5 and jaccard([], []) == 1.0 and jaccard([1], [2]) == 0.0


def test_selector_input_errors():
    kernel = random_psd(5, 0)
    for bad, msg in [
        (dict(K=0), "K=0 out of range"),
        (dict(K=6), "K=6 out of range"),
        (dict(K=2, lam=0.0), "lambda=0.0"),
        (dict(K=2, lam=-1.0), "lambda=-1.0"),
    ]:
        with pytest.raises(ValueError, match=msg):
            d_optimal_greedy(kernel, **bad)
    with pytest.raises(ValueError, match="importance must be finite and >= 0"):
        importance_kernel(kernel, 10, torch.tensor([1.0, -1.0, 1.0, 1.0, 1.0]))
    # An all-zero kernel (no signal) still gives K distinct experts, lowest ids first.
    assert d_optimal_greedy(torch.zeros(4, 4), 3).selected == [0, 1, 2]
