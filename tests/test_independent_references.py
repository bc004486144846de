"""Methods against references written apart from the product code, from the papers' equations and algorithms.

Each reference below is a direct numpy / plain-Python transcription of the paper's definition (or a brute
force, or a hand computation on a tiny case), computed from raw inputs (weights, tokens, router logits) in
float64; no reference calls the function it checks, or any product helper on the way. Papers: core = Kim et
al., "Pruning and Distilling Mixture-of-Experts into Dense Language Models"; REAP = Lasby et al., "REAP the
Experts"; C2F = "Compressing Large MoE Models via Efficient Pruning and Data-Aware Calibration"; DOT-MoE =
"DOT-MoE: Differentiable Optimal Transport for MoEfication"; Minitron = Muralidharan et al. 2024, "Compact
Language Models via Pruning and Knowledge Distillation"; ShortGPT = Men et al. 2024.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from workers.core.types import ExpertWeights, LayerContext, LayerStats
from workers.methods.grouping import get_grouping
from workers.methods.scoring import SCORINGS
from workers.methods.sinkhorn import sinkhorn


# ---- shared numpy pieces ---------------------------------------------------------------------------------
def np_logsumexp(a: np.ndarray, axis: int) -> np.ndarray:
    m = a.max(axis=axis, keepdims=True)
    return (m + np.log(np.exp(a - m).sum(axis=axis, keepdims=True))).squeeze(axis)


def np_silu(a: np.ndarray) -> np.ndarray:
    return a / (1.0 + np.exp(-a))


def np_expert_outputs(x: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
    """f_e(x_t) = down_e (silu(gate_e x_t) * (up_e x_t)) for every expert e and token t: [E, T, H]."""
    out = np.zeros((gate.shape[0], x.shape[0], down.shape[1]))
    for e in range(gate.shape[0]):
        for t in range(x.shape[0]):
            out[e, t] = down[e] @ (np_silu(gate[e] @ x[t]) * (up[e] @ x[t]))
    return out


def random_layer(E: int, T: int, H: int, inter: int, seed: int) -> dict[str, np.ndarray]:
    """Raw weights of one MoE layer (router rows [E, H], SwiGLU experts) and T input tokens, float64."""
    rng = np.random.default_rng(seed)
    return {
        "x": rng.standard_normal((T, H)),
        "router": rng.standard_normal((E, H)),
        "gate": rng.standard_normal((E, inter, H)) / math.sqrt(H),
        "up": rng.standard_normal((E, inter, H)) / math.sqrt(H),
        "down": rng.standard_normal((E, H, inter)) / math.sqrt(inter),
    }


def t64(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a)).to(torch.float64)


# ---- 1. Sinkhorn (DOT-MoE App. B.2.1, Algorithm 1) ----------------------------------------------------------
def np_sinkhorn_algorithm_1(A: np.ndarray, cap: np.ndarray, tau: float, N: int) -> np.ndarray:
    """DOT-MoE Algorithm 1 line by line: K ← A/τ; u ← 0, v ← log(s)·1_E; N times u ← −LSE(K + v, dim=1),
    v ← log(s·1_E) − LSE(K + u, dim=0); M_soft ← exp(K + u + v). `cap` is s·1_E (or the per-bin sizes)."""
    K = A / tau
    u = np.zeros(A.shape[0])
    v = np.log(cap)
    for _ in range(N):
        u = -np_logsumexp(K + v[None, :], axis=1)
        v = np.log(cap) - np_logsumexp(K + u[:, None], axis=0)
    return np.exp(K + u[:, None] + v[None, :])


def np_sinkhorn_knopp(A: np.ndarray, cap: np.ndarray, tau: float, N: int) -> np.ndarray:
    """The same iteration in the multiplicative form (Sinkhorn-Knopp matrix scaling of the Gibbs kernel
    exp(A/τ), Cuturi 2013): a ← 1/(G b), b ← c/(Gᵀ a), plan diag(a) G diag(b), starting from b = c."""
    G = np.exp(A / tau)
    b = cap.copy()
    a = np.ones(A.shape[0])
    for _ in range(N):
        a = 1.0 / (G @ b)
        b = cap / (G.T @ a)
    return a[:, None] * G * b[None, :]


@pytest.mark.parametrize(
    ("n", "cap", "tau", "iters", "seed", "converged"),
    [
        (
            24,
            [6.0, 6.0, 6.0, 6.0],
            0.1,
            50,
            0,
            False,
        ),  # DOT-MoE Table 6: τ = 0.1, N = 50, equal expert size s
        (24, [6.0, 6.0, 6.0, 6.0], 1.0, 50, 1, True),  # τ_start of the annealing (App. B.2.3)
        (
            10,
            [4.0, 3.0, 3.0],
            0.1,
            7,
            2,
            False,
        ),  # unequal bins (the OT grouping's K mod k ≠ 0), few iterations
        (9, [2.0, 5.0, 1.5, 0.5], 0.3, 20, 3, False),  # fractional capacities
        (9, [2.0, 5.0, 1.5, 0.5], 0.3, 200, 3, True),  # the same, run to convergence
    ],
)
def test_sinkhorn_plan_values_equal_dot_moe_algorithm_1(n, cap, tau, iters, seed, converged):
    """Reference: DOT-MoE App. B.2.1, Algorithm 1 (log-domain Sinkhorn-Knopp) transcribed in numpy, and the
    same iteration in Sinkhorn-Knopp's multiplicative form, on the same affinity (assignment logits A), τ,
    column marginals and iteration count. Every entry of the plan after `iters` iterations agrees with both
    within rtol 1e-12, atol 1e-15 (float64). Where `iters` has not converged (the paper's τ = 0.1, N = 50
    among them: rows still 7.5e-4 off mass 1), the plan one iteration earlier differs by > 1e-5, so the
    comparison pins the iteration count; where it has, both marginals hold within 1e-12, so the plan is the
    unique entropic OT plan of Algorithm 1's problem."""
    rng = np.random.default_rng(seed)
    A = rng.standard_normal((n, len(cap)))
    c = np.array(cap)
    ours = sinkhorn(t64(A), t64(c), tau=tau, iters=iters)
    assert ours.dtype == torch.float64
    for ref in (np_sinkhorn_algorithm_1(A, c, tau, iters), np_sinkhorn_knopp(A, c, tau, iters)):
        torch.testing.assert_close(ours, t64(ref), rtol=1e-12, atol=1e-15)
    if converged:
        torch.testing.assert_close(ours.sum(1), torch.ones(n, dtype=torch.float64), rtol=0.0, atol=1e-12)
        torch.testing.assert_close(ours.sum(0), t64(c), rtol=0.0, atol=1e-12)
    else:
        assert float((ours - t64(np_sinkhorn_algorithm_1(A, c, tau, iters - 1))).abs().max()) > 1e-5


# ---- 2. DO-REAP (core Algorithm 2 on the REAP importance) -------------------------------------------------
def np_router(logits: np.ndarray, k: int, renormalized: bool) -> tuple[np.ndarray, np.ndarray]:
    """Token by token: p = softmax over all E logits, T(x) = the k largest p, the applied gate g = p on T(x),
    divided by its sum over T(x) where the router renormalises. Returns (routed [T, E] bool, g [T, E])."""
    T, E = logits.shape
    routed = np.zeros((T, E), dtype=bool)
    g = np.zeros((T, E))
    for t in range(T):
        p = np.exp(logits[t] - logits[t].max())
        p /= p.sum()
        top = sorted(range(E), key=lambda e: (-p[e], e))[:k]
        routed[t, top] = True
        total = sum(p[e] for e in top) if renormalized else 1.0
        for e in top:
            g[t, e] = p[e] / total
    return routed, g


def np_do_reap_brute_force(f: np.ndarray, routed: np.ndarray, g: np.ndarray, K: int) -> dict:
    """REAP Eq. 9: S_j = mean over the tokens routing to j of g_j(x)·‖f_j(x)‖₂ (0 if none). Core §3.2 / App. B:
    G_ij = E_t⟨f_i(t), f_j(t)⟩ over all calibration tokens, 𝒦_ij = sqrt(I_i I_j) G_ij with I = S,
    λ = (1/(K·E)) Σ_e 𝒦_ee, and the greedy "iteratively add the expert that maximally increases
    log det(𝒦_S + λI)", here with log det recomputed from scratch (numpy slogdet) for every candidate."""
    E, T, _ = f.shape
    reap = np.zeros(E)
    for j in range(E):
        toks = [t for t in range(T) if routed[t, j]]
        if toks:
            reap[j] = sum(g[t, j] * np.linalg.norm(f[j, t]) for t in toks) / len(toks)
    G = np.array([[sum(f[i, t] @ f[j, t] for t in range(T)) / T for j in range(E)] for i in range(E)])
    kernel = np.sqrt(np.outer(reap, reap)) * G
    lam = np.trace(kernel) / (K * E)
    S: list[int] = []
    margins = []
    for _ in range(K):
        cands = [e for e in range(E) if e not in S]
        F = []
        for e in cands:
            idx = [*S, e]
            sign, logdet = np.linalg.slogdet(kernel[np.ix_(idx, idx)] + lam * np.eye(len(idx)))
            assert sign > 0
            F.append(logdet)
        order = np.argsort(F)[::-1]
        S.append(cands[order[0]])
        if len(cands) > 1:
            margins.append(F[order[0]] - F[order[1]])
    sign, logdet = np.linalg.slogdet(kernel[np.ix_(S, S)] + lam * np.eye(K))
    return {"selected": S, "lambda": lam, "reap": reap, "F": logdet, "margins": margins}


def layer_stats_by_hand(f: np.ndarray, routed: np.ndarray, g: np.ndarray, logits: np.ndarray) -> LayerStats:
    """The sums LayerStats documents (workers/core/types.py), each written out from the token records."""
    E, T, _ = f.shape
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    m = routed.astype(np.float64)
    norm = np.linalg.norm(f, axis=2).T  # [T, E]
    return LayerStats(
        n_tokens=T,
        count=t64(m.sum(0)),
        sum_p=t64(p.sum(0)),
        sum_p_sel=t64((m * p).sum(0)),
        sum_sq=t64((norm**2).sum(0)),
        sum_gnorm_sel=t64((m * g * norm).sum(0)),
        sum_norm_sel=t64((m * norm).sum(0)),
        gram=t64(np.einsum("itd,jtd->ij", f, f)),
    )


@pytest.mark.parametrize(("seed", "K", "renormalized"), [(0, 3, True), (1, 4, True), (2, 5, False)])
def test_do_reap_equals_the_brute_force_log_det_greedy_from_tokens(seed, K, renormalized):
    """Reference: REAP Eq. 9 for the importance, core §3.2 Eq. 4 and App. B (Algorithm 2's objective) for the
    kernel 𝒦 = sqrt(I_i I_j)·E_t⟨f_i, f_j⟩ and λ = tr(𝒦)/(K·E), and the greedy on log det(𝒦_S + λI)
    recomputed from scratch with numpy at every step: all from the raw expert weights, router and tokens of a
    10-expert top-2 layer whose experts 7..9 copy experts 0..2's weights (redundant outputs; distinct router
    rows). The DO-REAP scoring's picks equal the reference's, in order (exact ids; each reference step wins by
    a log-det margin > 1e-6, far above rounding), λ within rel 1e-12, the recorded F̃(S) = log det(I + 𝒦_S/λ)
    within rel 1e-10, and the picks differ from REAP's top-K (the log det matters here)."""
    E, T, H, inter, k = 10, 48, 6, 5, 2
    w = random_layer(E, T, H, inter, seed)
    for j in range(3):  # experts 7, 8, 9 compute the same function as experts 0, 1, 2
        for name in ("gate", "up", "down"):
            w[name][7 + j] = w[name][j]
    logits = w["x"] @ w["router"].T
    f = np_expert_outputs(w["x"], w["gate"], w["up"], w["down"])
    routed, g = np_router(logits, k, renormalized)
    ref = np_do_reap_brute_force(f, routed, g, K)
    assert min(ref["margins"]) > 1e-6

    stats = layer_stats_by_hand(f, routed, g, logits)
    ctx = LayerContext(
        stats=stats,
        experts=ExpertWeights(gate=t64(w["gate"]), up=t64(w["up"]), down=t64(w["down"])),
        router_weight=t64(w["router"]),
        top_k=k,
        renormalized=renormalized,
    )
    scoring = SCORINGS["DO-REAP"]
    scores = scoring.score(ctx)
    torch.testing.assert_close(scores, t64(ref["reap"]), rtol=1e-12, atol=0.0)
    sel = scoring.select(ctx, scores, K)
    assert sel.selected == ref["selected"]
    assert math.isclose(sel.extras["lambda"], ref["lambda"], rel_tol=1e-12)
    assert math.isclose(sel.extras["log_det"], ref["F"] - K * math.log(ref["lambda"]), rel_tol=1e-10)
    top_k = sorted(range(E), key=lambda e: (-ref["reap"][e], e))[:K]
    assert sorted(ref["selected"]) != sorted(top_k)


# ---- 3. RL-greedy and CFES (C2F §4.1, Algorithm 1) -----------------------------------------------------------
class NpPrunedLayer:
    """The C2F layer loss from raw weights: d(S) = ‖Layer(X; all E) − Layer(X; S)‖₂ over the token sample
    (ℓ2 of the [T, H] output difference, §4.1). Layer(X; S) is the MoE layer with only S's experts: each token's
    router softmax over the logits of S's experts, its top-k among them (k clamped to |S|), the chosen weights
    renormalised iff the router renormalises, Σ_j w_j f_j(x)."""

    def __init__(self, w: dict[str, np.ndarray], k: int, renormalized: bool):
        self.logits = w["x"] @ w["router"].T
        self.f = np_expert_outputs(w["x"], w["gate"], w["up"], w["down"])
        self.k, self.renormalized = k, renormalized
        self.E, self.T = self.f.shape[0], self.f.shape[1]
        self.full = self.output(list(range(self.E)))

    def output(self, kept: list[int]) -> np.ndarray:
        out = np.zeros((self.T, self.f.shape[2]))
        for t in range(self.T):
            z = np.array([self.logits[t, e] for e in kept])
            q = np.exp(z - z.max())
            q /= q.sum()
            top = sorted(range(len(kept)), key=lambda i: -q[i])[: min(self.k, len(kept))]
            total = sum(q[i] for i in top) if self.renormalized else 1.0
            for i in top:
                out[t] += q[i] / total * self.f[kept[i], t]
        return out

    def d(self, kept: list[int]) -> float:
        return float(np.sqrt(((self.full - self.output(kept)) ** 2).sum()))


def np_layerwise_greedy(layer: NpPrunedLayer, K: int) -> tuple[list[int], list[float], list[float]]:
    """C2F §4.1 "Layer-wise greedy search": from the empty set, K times add the candidate expert whose addition
    gives the smallest d. Returns (picks, d after each pick, each step's margin to the runner-up)."""
    sel: list[int] = []
    losses, margins = [], []
    for _ in range(K):
        cands = [e for e in range(layer.E) if e not in sel]
        d = sorted((layer.d([*sel, e]), e) for e in cands)
        sel.append(d[0][1])
        losses.append(d[0][0])
        if len(d) > 1:
            margins.append(d[1][0] - d[0][0])
    return sel, losses, margins


def np_coarse_to_fine(layer: NpPrunedLayer, K: int, S: int) -> tuple[list[int], list[float], list[float]]:
    """C2F Algorithm 1 for one layer: each of the K steps partitions the candidates (by id) into groups, the
    first S experts each and the last the rest (§4.1 text; the group count ⌈|candidates|/S⌉ of line 7 taken
    per step, so no group is empty), picks the group G* minimising d(Sel ∪ G) (coarse, lines 10–13), then the
    e ∈ G* minimising d(Sel ∪ {e}) (fine, line 15)."""
    sel: list[int] = []
    cand = list(range(layer.E))
    losses, margins = [], []
    for _ in range(K):
        n_groups = math.ceil(len(cand) / S)
        groups = [cand[i * S : (i + 1) * S] for i in range(n_groups - 1)] + [cand[(n_groups - 1) * S :]]
        coarse = sorted((layer.d([*sel, *grp]), i) for i, grp in enumerate(groups))
        best_group = groups[coarse[0][1]]
        fine = sorted((layer.d([*sel, e]), e) for e in best_group)
        sel.append(fine[0][1])
        cand.remove(fine[0][1])
        losses.append(fine[0][0])
        margins += [c[1][0] - c[0][0] for c in (coarse, fine) if len(c) > 1]
    return sel, losses, margins


def rl_ctx(
    w: dict[str, np.ndarray], k: int, renormalized: bool, settings: dict | None = None
) -> LayerContext:
    """The product's input: the raw weights, and the token sample (x, full-softmax p) calibration stores."""
    E = w["router"].shape[0]
    p = torch.softmax(t64(w["x"] @ w["router"].T), dim=1)
    z = torch.zeros(E, dtype=torch.float64)  # the sums are not read by reconstruction-loss selection
    stats = LayerStats(
        n_tokens=w["x"].shape[0],
        count=z,
        sum_p=z,
        sum_p_sel=z,
        sum_sq=z,
        sum_gnorm_sel=z,
        sum_norm_sel=z,
        gram=torch.zeros(E, E, dtype=torch.float64),
        sample={"x": t64(w["x"]), "p": p},
    )
    return LayerContext(
        stats=stats,
        experts=ExpertWeights(gate=t64(w["gate"]), up=t64(w["up"]), down=t64(w["down"])),
        router_weight=t64(w["router"]),
        top_k=k,
        renormalized=renormalized,
        settings=settings,
    )


RL_CASES = [
    (0, 8, 3, 2, True),
    (1, 8, 4, 2, False),
    (2, 7, 3, 1, True),
    (3, 8, 5, 2, True),
    (4, 6, 2, 2, False),
]


@pytest.mark.parametrize(("seed", "E", "K", "k", "renormalized"), RL_CASES)
def test_rl_greedy_equals_the_layerwise_greedy_on_the_pruned_layer_from_raw_weights(
    seed, E, K, k, renormalized
):
    """Reference: C2F §4.1 "Layer-wise greedy search" with the §4.1 layer loss d = ℓ2 of Layer(X; all) −
    Layer(X; S) (routed_subset target, original inputs: the default settings), the pruned layer written token
    by token in numpy from the raw expert weights, router rows and token sample. Picks equal in order (exact
    ids; every reference step wins by > 1e-9·‖Y‖, so no rounding-level tie decides), and the recorded
    per-step losses within rtol 1e-10."""
    w = random_layer(E, 24, 6, 4, 100 + seed)
    layer = NpPrunedLayer(w, k, renormalized)
    want, losses, margins = np_layerwise_greedy(layer, K)
    assert min(margins) > 1e-9 * float(np.linalg.norm(layer.full))
    sel = SCORINGS["RL-greedy"].select(rl_ctx(w, k, renormalized), torch.ones(E, dtype=torch.float64), K)
    assert sel.selected == want
    torch.testing.assert_close(
        t64(np.array(sel.extras["recon_step_losses"])), t64(np.array(losses)), rtol=1e-10, atol=0.0
    )


@pytest.mark.parametrize(("seed", "E", "K", "k", "renormalized"), RL_CASES)
def test_cfes_equals_c2f_algorithm_1_on_the_pruned_layer_from_raw_weights(seed, E, K, k, renormalized):
    """Reference: C2F Algorithm 1 (coarse-to-fine expert selection), S = round(√(E + (1 − K)/2)) (line 3), groups
    of S candidates by id with the rest in the last, coarse argmin over d(Sel ∪ G), fine argmin over
    d(Sel ∪ {e}), on the same numpy layer loss as the greedy test (default settings). Picks equal in order
    (exact ids; every coarse and fine decision of the reference wins by > 1e-9·‖Y‖), per-step losses within
    rtol 1e-10, the group size equal. Over these cases the coarse pass changes at least one pick relative to
    the plain greedy, so this test does not reduce to the greedy one."""
    w = random_layer(E, 24, 6, 4, 100 + seed)
    layer = NpPrunedLayer(w, k, renormalized)
    S = round(math.sqrt(E + (1 - K) / 2))
    want, losses, margins = np_coarse_to_fine(layer, K, S)
    assert min(margins) > 1e-9 * float(np.linalg.norm(layer.full))
    sel = SCORINGS["CFES"].select(rl_ctx(w, k, renormalized), torch.ones(E, dtype=torch.float64), K)
    assert sel.selected == want
    assert sel.extras["c2f_group_size"] == S
    torch.testing.assert_close(
        t64(np.array(sel.extras["recon_step_losses"])), t64(np.array(losses)), rtol=1e-10, atol=0.0
    )


def test_the_cfes_cases_include_one_where_coarse_to_fine_and_greedy_disagree():
    """The CFES reference cases are discriminating: on at least one of them C2F Algorithm 1 keeps another
    set than the layer-wise greedy (both references, numpy)."""
    differ = []
    for seed, E, K, k, renormalized in RL_CASES:
        layer = NpPrunedLayer(random_layer(E, 24, 6, 4, 100 + seed), k, renormalized)
        S = round(math.sqrt(E + (1 - K) / 2))
        differ.append(np_coarse_to_fine(layer, K, S)[0] != np_layerwise_greedy(layer, K)[0])
    assert any(differ)


# ---- 4. d2d baseline importance (Minitron §2.2 activation importance; ShortGPT block importance) -------------
D2D = dict(
    vocab_size=40,
    hidden_size=12,
    intermediate_size=10,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=4,
    max_position_embeddings=32,
    tie_word_embeddings=False,
    rms_norm_eps=1e-6,
)


def d2d_dense_model(seed: int = 0):
    """A tiny Qwen3 dense model, float64, with every query projection zero: each head's attention scores are 0,
    so its output at position t is the plain mean of the value vectors at positions ≤ t (causal), a forward a
    few lines of numpy reproduce exactly. Everything else is random and non-trivial (norm weights in
    [0.5, 1.5], projections at scale 0.4)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(**D2D)).to(torch.float64).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.4)
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.zero_()
    return model


def d2d_batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [
        torch.randint(0, D2D["vocab_size"], (3, 7), generator=g),
        torch.randint(0, 40, (2, 5), generator=g),
    ]


def np_minitron_importance(model, batches: list[torch.Tensor]) -> dict:
    """Minitron §2.2 (Muralidharan et al. 2024) with its best aggregation (mean over the sequence, L2 over the
    batch), the forward written in numpy from the state dict (RMSNorm, causal mean of values, SwiGLU):
    - FFN neuron j: F = ‖(mean_t |X W_1^j|)_b‖₂ over every sequence b, X W_1^j = silu(gate_j·n)·(up_j·n), n the
      post-attention norm output (the input of down_proj);
    - head h: F = ‖(mean_t ‖Attn_h(X)_t‖₂)_b‖₂, the per-token L2 norm of head h's output;
    - embedding channel c: LN(X)_c of every RMSNorm output (each layer's two and the final one), the
      (norm, sequence) pairs aggregated together: sqrt(Σ_norm Σ_b (mean_t |LN(X)_{b,t,c}|)²). The paper's
      F_emb does not say how the norms of different layers combine; this is the product's documented reading
      ("summed over every RMSNorm output", squares under one root). NVIDIA Model-Optimizer's Minitron instead
      sums the per-norm scores Σ_norm sqrt(Σ_b (mean_t |LN(X)|)²) over the attention and MLP input norms only
      (no final norm): a different ranking, not checked here;
    - layer l: ShortGPT's block importance 1 − mean over all tokens of cos(x_l(t), x_{l+1}(t))."""
    sd = {k: v.numpy() for k, v in model.state_dict().items()}
    L, nh, nkv, hd = (
        D2D["num_hidden_layers"],
        D2D["num_attention_heads"],
        D2D["num_key_value_heads"],
        D2D["head_dim"],
    )
    eps = D2D["rms_norm_eps"]

    def rms(x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return w * x / np.sqrt((x**2).mean(-1, keepdims=True) + eps)

    def agg(a: np.ndarray) -> np.ndarray:  # [B, T, ...] → Σ_b (mean_t |a|)²
        return (np.abs(a).mean(1) ** 2).sum(0)

    ffn = [np.zeros(D2D["intermediate_size"]) for _ in range(L)]
    heads = [np.zeros(nh) for _ in range(L)]
    channels = np.zeros(D2D["hidden_size"])
    cos_sum, tokens = np.zeros(L), 0
    for ids in batches:
        x = sd["model.embed_tokens.weight"][ids.numpy()]  # [B, T, H]
        B, T, _ = x.shape
        tokens += B * T
        for i in range(L):
            p = f"model.layers.{i}."
            n1 = rms(x, sd[p + "input_layernorm.weight"])
            channels += agg(n1)
            v = (n1 @ sd[p + "self_attn.v_proj.weight"].T).reshape(B, T, nkv, hd)
            causal_mean = np.cumsum(v, axis=1) / np.arange(1, T + 1)[None, :, None, None]
            attn = np.stack(
                [causal_mean[:, :, h // (nh // nkv)] for h in range(nh)], axis=2
            )  # [B, T, nh, hd]
            heads[i] += agg(np.linalg.norm(attn, axis=-1))
            x1 = x + attn.reshape(B, T, nh * hd) @ sd[p + "self_attn.o_proj.weight"].T
            n2 = rms(x1, sd[p + "post_attention_layernorm.weight"])
            channels += agg(n2)
            a = np_silu(n2 @ sd[p + "mlp.gate_proj.weight"].T) * (n2 @ sd[p + "mlp.up_proj.weight"].T)
            ffn[i] += agg(a)
            x2 = x1 + a @ sd[p + "mlp.down_proj.weight"].T
            cos = (x * x2).sum(-1) / (np.linalg.norm(x, axis=-1) * np.linalg.norm(x2, axis=-1))
            cos_sum[i] += cos.sum()
            x = x2
        channels += agg(rms(x, sd["model.norm.weight"]))
    return {
        "ffn": [np.sqrt(s) for s in ffn],
        "heads": [np.sqrt(s) for s in heads],
        "channels": np.sqrt(channels),
        "blocks": 1.0 - cos_sum / tokens,
    }


def test_d2d_importance_values_equal_minitron_by_hand():
    """Reference: Minitron §2.2 activation importance (FFN neurons, attention heads, embedding channels; mean
    over the sequence, L2 over the batch) and ShortGPT's block importance, computed in numpy from the weights
    of a tiny Qwen3 whose attention reduces to a causal mean of values (d2d_dense_model). Values within
    rtol 2e-6, atol 0: transformers' Qwen3RMSNorm computes in float32 even in a float64 model, so the model's
    activations carry float32 rounding (measured: ≤ 3.3e-7 relative over seeds 0–2); the importances of
    different units differ by far more (checked: the reference's own spread within each layer exceeds 1e-2
    relative)."""
    from workers.baselines.baselines import _Importance

    model = d2d_dense_model()
    ref = np_minitron_importance(model, d2d_batches())
    got = _Importance(model).run(d2d_batches())
    for i in range(D2D["num_hidden_layers"]):
        torch.testing.assert_close(got["ffn"][i], t64(ref["ffn"][i]), rtol=2e-6, atol=0.0)
        torch.testing.assert_close(got["heads"][i], t64(ref["heads"][i]), rtol=2e-6, atol=0.0)
        for values in (ref["ffn"][i], ref["heads"][i]):
            assert np.ptp(values) > 1e-2 * values.max()
    torch.testing.assert_close(got["channels"], t64(ref["channels"]), rtol=2e-6, atol=0.0)
    torch.testing.assert_close(got["blocks"], t64(ref["blocks"]), rtol=2e-6, atol=0.0)
    assert np.ptp(ref["channels"]) > 1e-2 * ref["channels"].max()


def test_d2d_prune_keeps_the_units_the_hand_computed_importance_ranks_first():
    """Reference: the same hand-computed Minitron / ShortGPT importances; prune_dense keeps the top-scored
    layers, embedding channels, FFN neurons and KV groups (a group's importance = the sum of its query heads'),
    as the weights it copies show (exact ids: every kept/dropped boundary of the reference is separated by
    > 1e-4 relative, far above the float32 norm rounding)."""
    from workers.baselines.baselines import prune_dense

    model = d2d_dense_model()
    ref = np_minitron_importance(model, d2d_batches())
    cand = {"name": "t", "layers": 2, "hidden": 8, "ffn": 6, "heads": 2, "kv_heads": 1}

    def top(values: np.ndarray, n: int) -> list[int]:
        order = np.argsort(-values, kind="stable")
        assert values[order[n - 1]] - values[order[n]] > 1e-4 * abs(values[order[n - 1]])
        return sorted(order[:n].tolist())

    layers = top(ref["blocks"], 2)
    channels = top(ref["channels"], 8)
    pruned = prune_dense(model, cand, d2d_batches())
    assert pruned.config.num_hidden_layers == 2 and pruned.config.hidden_size == 8
    emb = model.model.embed_tokens.weight
    # exact: the pruned embedding is a column slice (copied bytes) of the teacher's
    assert torch.equal(pruned.model.embed_tokens.weight, emb[:, channels])
    for new, old in enumerate(layers):
        src, dst = model.model.layers[old], pruned.model.layers[new]
        neurons = top(ref["ffn"][old], 6)
        group = top(ref["heads"][old].reshape(2, 2).sum(1), 1)[0]
        # exact: copied rows / columns of the teacher's weights
        assert torch.equal(dst.mlp.down_proj.weight, src.mlp.down_proj.weight[channels][:, neurons])
        assert torch.equal(
            dst.self_attn.v_proj.weight, src.self_attn.v_proj.weight[group * 4 : group * 4 + 4][:, channels]
        )


# ---- 5. OT grouping (DOT-MoE App. B.2–B.3 applied to expert grouping: ours) ----------------------------------
def np_greedy_rounding(soft: np.ndarray, room: list[int]) -> list[int]:
    """DOT-MoE App. B.3 "Hard Assignment via Greedy Rounding": sort all entries of M_soft in descending order
    (equal entries: row-major order), then assign row i to bin e if i is unassigned and e has capacity left."""
    n, m = soft.shape
    entries = sorted((-soft[i, e], i * m + e) for i in range(n) for e in range(m))
    owner = [-1] * n
    left = list(room)
    for _, flat in entries:
        i, e = divmod(flat, m)
        if owner[i] < 0 and left[e] > 0:
            owner[i] = e
            left[e] -= 1
    return owner


def output_cosines(f: np.ndarray) -> np.ndarray:
    """ρ_ij = Ḡ_ij / sqrt(Ḡ_ii Ḡ_jj), Ḡ = E_t⟨f_i(t), f_j(t)⟩ (core App. G, Eq. 153–154)."""
    G = np.einsum("itd,jtd->ij", f, f) / f.shape[1]
    d = np.sqrt(np.diag(G))
    return G / np.outer(d, d)


def np_ot_grouping(f: np.ndarray, selected: list[int], scores: np.ndarray, k: int) -> set[frozenset[int]]:
    """The OT grouping as its documentation states it, from the expert outputs: rank by (score desc, id asc);
    the k best head the k groups; the others are transported to the groups' remaining places (balanced sizes,
    the best-ranked groups one larger) by DOT-MoE Algorithm 1 on the output cosines to the anchors (τ = 0.1,
    N = 50, mass 1 per expert), then greedy rounding (App. B.3)."""
    order = sorted(selected, key=lambda e: (-scores[e], e))
    rho = output_cosines(f[order])
    q, r = divmod(len(order), k)
    room = [q + (1 if g < r else 0) - 1 for g in range(k)]
    bins = [g for g in range(k) if room[g] > 0]
    groups = [[a] for a in order[:k]]
    rest = order[k:]
    if rest:
        A = rho[k:][:, bins]
        cap = np.array([room[g] for g in bins], dtype=np.float64)
        soft = np_sinkhorn_algorithm_1(A, cap, 0.1, 50)
        for e, b in zip(rest, np_greedy_rounding(soft, [room[g] for g in bins]), strict=True):
            groups[bins[b]].append(e)
    return {frozenset(g) for g in groups}


def ot_ctx(f: np.ndarray) -> LayerContext:
    E, T, _ = f.shape
    z = torch.zeros(E, dtype=torch.float64)  # only the Gram is read by the OT grouping
    stats = LayerStats(
        n_tokens=T,
        count=z,
        sum_p=z,
        sum_p_sel=z,
        sum_sq=z,
        sum_gnorm_sel=z,
        sum_norm_sel=z,
        gram=t64(np.einsum("itd,jtd->ij", f, f)),
    )
    w = torch.zeros(E, 1, 1, dtype=torch.float64)
    return LayerContext(
        stats=stats,
        experts=ExpertWeights(gate=w, up=w, down=w),
        router_weight=torch.zeros(E, 1),
        top_k=1,
        renormalized=True,
    )


@pytest.mark.parametrize("seed", range(8))
def test_ot_grouping_equals_its_transcription_from_dot_moe(seed):
    """Reference: the OT grouping's documented rule transcribed in numpy (np_ot_grouping: anchors, balanced
    room, DOT-MoE Algorithm 1 with τ = 0.1 and N = 50 on the output cosines, App. B.3 greedy rounding), from
    random expert outputs on 5–8 experts into 2–3 groups. Partitions equal (exact). Not an exact OT: the
    entropic plan at τ = 0.1, rounded greedily, is not always the maximum-affinity balanced assignment (a
    brute force over all balanced placements disagrees on some random cases, with 50 iterations or 2,000), so
    the reference is the rule as stated, not an assignment optimum."""
    rng = np.random.default_rng(1000 + seed)
    E = int(rng.integers(5, 9))
    k = 2 if seed % 2 else 3
    f = rng.standard_normal((E, 16, 5))
    scores = rng.random(E)
    selected = sorted(rng.choice(E, size=E - (seed % 3 == 0), replace=False).tolist())
    got = get_grouping("OT")(ot_ctx(f), selected, t64(scores), k)
    assert {frozenset(g) for g in got} == np_ot_grouping(f, selected, scores, k)


# ---- 6. Tucker2-experts truncated fit (ours: Tucker-2 by HOSVD + HOOI, De Lathauwer et al. 2000) --------------
def np_leading_left_singular_vectors(M: np.ndarray, r: int) -> np.ndarray:
    return np.linalg.svd(M, full_matrices=False)[0][:, :r]


def np_tucker2_hooi(W: np.ndarray, r_out: int, r_in: int, S: np.ndarray | None, sweeps: int) -> np.ndarray:
    """Tucker-2 of the expert stack W [E, out, in] (expert mode kept), minimising Σ_e ‖(W_e − U C_e Vᵀ S⁻¹) S‖²:
    T = W S; HOSVD (U, V = leading left singular vectors of the mode-out / mode-in unfoldings of T), then
    `sweeps` HOOI sweeps (U from the mode-out unfolding of T ×_in Vᵀ, then V from the mode-in unfolding of
    T ×_out Uᵀ), C_e = Uᵀ T_e V. Returns the reconstruction U C_e Vᵀ S⁻¹ [E, out, in]."""
    T = W @ S if S is not None else W
    E, n_out, n_in = T.shape

    def unfold_out(X: np.ndarray) -> np.ndarray:  # [out, E·(in)]
        return X.transpose(1, 0, 2).reshape(X.shape[1], -1)

    def unfold_in(X: np.ndarray) -> np.ndarray:  # [in, E·(out)]
        return X.transpose(2, 0, 1).reshape(X.shape[2], -1)

    U = np_leading_left_singular_vectors(unfold_out(T), r_out)
    V = np_leading_left_singular_vectors(unfold_in(T), r_in)
    for _ in range(sweeps):
        U = np_leading_left_singular_vectors(unfold_out(T @ V), r_out)
        V = np_leading_left_singular_vectors(unfold_in(np.einsum("or,eoi->eri", U, T)), r_in)
    rec = np.einsum("or,eri,ji->eoj", U, np.einsum("or,eoi,ij->erj", U, T, V), V)
    return rec @ np.linalg.inv(S) if S is not None else rec


@pytest.mark.parametrize(("seed", "rank", "down"), [(0, 3, "plain"), (1, 4, "plain"), (2, 2, "keep")])
def test_tucker2_experts_truncated_fit_equals_hosvd_hooi_by_svd(seed, rank, down):
    """Reference: Tucker-2 by HOSVD + 2 HOOI sweeps (De Lathauwer et al. 2000) written with numpy SVDs of the
    unfoldings, on the input-whitened gate/up stacks (S = chol(Σxxᵀ/N + 1e-3·mean diag·I), the module's stated
    whitening) and the unwhitened down stack, at a truncated rank (rank < min(out, in)). The reconstructed
    experts U·core_e·V that edit_tucker2_experts returns (basis-free, so sign and rotation choices cancel)
    equal the reference's within rtol 1e-9, atol 1e-12 (float64); the HOSVD alone (0 sweeps) is outside that
    tolerance, so the sweep count is pinned."""
    from workers.methods.editing import edit_tucker2_experts

    E, I, H, N = 4, 8, 6, 40  # noqa: E741
    rng = np.random.default_rng(50 + seed)
    W = {
        "gate": rng.standard_normal((E, I, H)),
        "up": rng.standard_normal((E, I, H)),
        "down": rng.standard_normal((E, H, I)),
    }
    X = rng.standard_normal((N, H)) * np.array([3.0, 1.0, 0.5, 2.0, 0.2, 1.5])  # anisotropic block inputs
    sum_xx = X.T @ X
    C = sum_xx / N
    S = np.linalg.cholesky(C + 1e-3 * np.mean(np.diag(C)) * np.eye(H))
    z = torch.zeros(E, dtype=torch.float64)
    ctx = LayerContext(
        stats=LayerStats(
            n_tokens=N,
            count=z,
            sum_p=z,
            sum_p_sel=z,
            sum_sq=z,
            sum_gnorm_sel=z,
            sum_norm_sel=z,
            gram=torch.zeros(E, E, dtype=torch.float64),
            sum_xx=t64(sum_xx),
        ),
        experts=ExpertWeights(gate=t64(W["gate"]), up=t64(W["up"]), down=t64(W["down"])),
        router_weight=torch.zeros(E, H, dtype=torch.float64),
        top_k=1,
        renormalized=True,
    )
    _, factors, _ = edit_tucker2_experts(0, ctx, 3, {"rank": rank, "down": down})
    for p in ("gate", "up", "down"):
        if p == "down" and down == "keep":
            # exact: kept dense, a copy of the teacher's stack
            assert torch.equal(factors["down"]["weight"], t64(W["down"]))
            continue
        f = factors[p]
        got = f["U"] @ f["core"] @ f["V"]
        white = S if p != "down" else None
        ref = np_tucker2_hooi(W[p], rank, rank, white, 2)
        torch.testing.assert_close(got, t64(ref), rtol=1e-9, atol=1e-12)
        assert float((got - t64(np_tucker2_hooi(W[p], rank, rank, white, 0))).abs().max()) > 1e-6
