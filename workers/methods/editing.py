"""Expert editing: keep all E routed experts of a layer but factorise their weights to a parameter budget.

Two methods (Router KD paper, App. E/F; they hit the same routed-expert parameter budget as pruning to K
of the E experts, so the three kinds of smaller MoE compare at equal size):

MoBE (Mixture of Basis Experts, Chen et al. 2025, arXiv 2508.05257, Eq. 2–4): per projection p in
{gate, up}, W_e [I, H] ≈ A_e [I, r] · act(Σ_j c_ej B_j), with m basis matrices B_j [r, H] shared by the
layer's experts, per-expert mixing coefficients c_e = softmax(α_e) over the m bases (the public MoBE code
normalises them with a softmax; `coef="linear"` uses α directly) and act ∈ {silu (the paper's flag), tanh,
none}. Down projections are left as they are (MoBE factors only gate and up). Fitted as the public code
does: targets divided by their global std, experts split into m contiguous groups, B_g initialised from
the SVD of the group's stacked experts, α_e one-hot on the expert's group, full-batch Adam (lr 0.07 in the
paper's flags) on the MSE, the best iterate kept (`steps` defaults to 300 here; the Router KD paper ran
10,000 epochs, its seed001 sweep sets `steps: 10000`). Added here (setting `refit`, default on): the bases are
initialised by least squares so the initial mixtures equal the group SVD bases, and A is refitted by
least squares given the bases before and after Adam (A enters linearly, so this can only lower the error).

TD-MoE (Router KD paper, App. E/F: "whitening, then joint tensor decomposition"): per projection the
layer's experts stacked into a tensor [E, out, in]; the input mode of gate/up is whitened with S, the
Cholesky factor of Σ_t x xᵀ / N + ridge·mean(diag)·I (the block input's second moment, so that
Σ_e ‖(W_e − Ŵ_e) S‖² is the squared output error over the calibration tokens), then a truncated Tucker-2
decomposition shared across experts (HOSVD, refined by `iters` HOOI sweeps): W_e ≈ U · G_e · Vᵀ S⁻¹ with
U [out, r_out] and V [in, r_in] shared and a core G_e [r_out, r_in] per expert; Vᵀ S⁻¹ is stored as one
[r_in, in] factor (same size as V). The down projection's input (the expert's intermediate activation) has
no statistic: `down="plain"` (default) factors it unwhitened, `down="keep"` leaves it dense.

Budget: K of E means ≤ K/E of the layer's routed-expert parameters (gate, up, down and any expert biases;
biases stay dense; the router is unchanged). The largest rank within it is taken (one rank r for all
factored projections of a layer; a Tucker mode's rank is capped at that mode's size, MoBE's rank at
min(I, H)). Pure tensor code: no transformers import.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from workers.core.registry import lookup
from workers.core.types import ExpertWeights, LayerContext, LayerPlan

PROJECTIONS = ("gate", "up", "down")
ACTIVATIONS = ("silu", "tanh", "none")


# ---- parameter counting and the budget -----------------------------------------------------------------
def routed_params(E: int, I: int, H: int, bias: bool = False) -> int:  # noqa: E741
    """Routed-expert parameters of one layer: gate, up [E, I, H], down [E, H, I] (+ biases [E, 2I + H])."""
    return E * 3 * I * H + (E * (2 * I + H) if bias else 0)


def budget(E: int, I: int, H: int, K: int, bias: bool = False) -> int:  # noqa: E741
    """The routed-expert parameters of a pruned MoE keeping K of the E experts (= K/E of the layer's)."""
    return K * routed_params(1, I, H, bias)


def mobe_params(E: int, I: int, H: int, r: int, m: int, bias: bool = False) -> int:  # noqa: E741
    """MoBE's routed parameters: per factored gate/up A [E, I, r], bases [m, r, H], coefficients [E, m];
    the dense down [E, H, I] and any biases."""
    return 2 * (E * I * r + m * r * H + E * m) + E * H * I + (E * (2 * I + H) if bias else 0)


def tucker_params(E: int, out: int, inp: int, r: int) -> int:
    """One Tucker-2 factored projection: U [out, r_out], cores [E, r_out, r_in], V [r_in, in],
    r_out = min(r, out), r_in = min(r, in)."""
    ro, ri = min(r, out), min(r, inp)
    return out * ro + E * ro * ri + ri * inp


def td_moe_params(E: int, I: int, H: int, r: int, factor_down: bool = True, bias: bool = False) -> int:  # noqa: E741
    """TD-MoE's routed parameters: Tucker-2 gate and up (and down unless it is kept dense), any biases."""
    down = tucker_params(E, H, I, r) if factor_down else E * H * I
    return 2 * tucker_params(E, I, H, r) + down + (E * (2 * I + H) if bias else 0)


def solve_rank(cost: Callable[[int], int], limit: int, r_max: int, what: str) -> int:
    """The largest r in 1..r_max with cost(r) <= limit (cost non-decreasing); one-line ValueError if none."""
    if cost(1) > limit:
        raise ValueError(
            f"{what}: no rank >= 1 fits the budget of {limit} routed parameters "
            f"(rank 1 needs {cost(1)}); keep more experts (larger K)"
        )
    lo, hi = 1, r_max
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if cost(mid) <= limit else (lo, mid - 1)
    return lo


# ---- factor formats (also used by the edited model's forward) -------------------------------------------
def _act(x: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "silu":
        return torch.nn.functional.silu(x)
    if activation == "tanh":
        return torch.tanh(x)
    if activation == "none":
        return x
    raise ValueError(f"activation={activation!r}; allowed: {', '.join(ACTIVATIONS)}")


def mobe_coefficients(coef: torch.Tensor, mode: str) -> torch.Tensor:
    """[E, m] mixing weights from the stored coefficients: softmax over the bases, or as stored."""
    if mode == "softmax":
        return torch.softmax(coef, dim=-1)
    if mode == "linear":
        return coef
    raise ValueError(f"coef={mode!r}; allowed: softmax, linear")


def reconstruct(spec: dict, t: dict[str, torch.Tensor]) -> torch.Tensor:
    """One projection's expert weights [E, out, in] from its factors `t` (names as `spec["kind"]` stores)."""
    kind = spec["kind"]
    if kind == "dense":
        return t["weight"]
    if kind == "mobe":
        mix = torch.einsum("em,mrh->erh", mobe_coefficients(t["coef"], spec["coef"]), t["bases"])
        return t["A"] @ _act(mix, spec["activation"])
    if kind == "tucker":
        return t["U"] @ t["core"] @ t["V"]
    raise ValueError(f"projection kind={kind!r}; allowed: dense, mobe, tucker")


def factor_count(tensors: dict[str, torch.Tensor]) -> int:
    return sum(int(t.numel()) for t in tensors.values())


# ---- MoBE (Chen et al. 2025, §3 / Eq. 2–4; Router KD paper §5.1, App. F) ---------------------------------
def _lstsq_A(W: torch.Tensor, Z: torch.Tensor, eps: float = 1e-10) -> torch.Tensor:
    """argmin_A Σ_e ‖W_e − A_e Z_e‖² per expert (ridge eps·tr/r for a rank-deficient Z_e)."""
    gram = Z @ Z.transpose(1, 2)
    r = gram.shape[-1]
    ridge = eps * gram.diagonal(dim1=1, dim2=2).mean(-1).clamp_min(1e-30)[:, None, None]
    rhs = W @ Z.transpose(1, 2)  # [E, I, r]
    sol = torch.linalg.solve(gram + ridge * torch.eye(r, dtype=W.dtype, device=W.device), rhs.transpose(1, 2))
    return sol.transpose(1, 2)


def _mobe_init(
    W: torch.Tensor, r: int, m: int, coef_mode: str, gen: torch.Generator
) -> dict[str, torch.Tensor]:
    """The public code's init: m contiguous expert groups, B_g = top-r right singular vectors of the group's
    stacked experts, A_e = the expert's rows of U_r Σ_r, α_e one-hot on its group; the bases then solved
    (least squares over the experts) so that the initial mixtures equal the B_g."""
    E, I, H = W.shape  # noqa: E741
    target = torch.zeros(E, r, H, dtype=W.dtype, device=W.device)
    A = torch.zeros(E, I, r, dtype=W.dtype, device=W.device)
    coef = torch.zeros(E, m, dtype=W.dtype, device=W.device)
    for g, ids in enumerate(torch.tensor_split(torch.arange(E), m)):
        u, s, vh = torch.linalg.svd(W[ids].reshape(-1, H), full_matrices=False)
        k = min(r, vh.shape[0])
        target[ids, :k] = vh[:k]
        if k < r:  # more rows than the group's rank: small seeded rows (Adam can use them)
            target[ids, k:] = 1e-3 * torch.randn(r - k, H, generator=gen, dtype=W.dtype).to(W.device)
        A[ids, :, :k] = (u[:, :k] * s[:k]).reshape(len(ids), I, k)
        coef[ids, g] = 1.0
    mix = mobe_coefficients(coef, coef_mode)  # [E, m]
    bases = torch.linalg.lstsq(mix, target.reshape(E, -1)).solution.reshape(m, r, H)
    return {"A": A, "coef": coef, "bases": bases}


def fit_mobe(
    W: torch.Tensor,
    r: int,
    m: int,
    activation: str = "silu",
    coef: str = "softmax",
    steps: int = 300,
    lr: float = 0.07,
    seed: int = 0,
    refit: bool = True,
) -> dict[str, torch.Tensor]:
    """MoBE factors {A [E, I, r], bases [m, r, H], coef [E, m]} of W [E, I, H] (module docstring).
    Reproducible given the seed, up to rounding (a CPU BLAS may round differently from one call to the next,
    e.g. MKL by the buffers' alignment; an accelerator needs its deterministic algorithms)."""
    E, I, H = W.shape  # noqa: E741
    if not 1 <= m <= E or r < 1:
        raise ValueError(f"MoBE: bases={m} must be in 1..{E} and rank={r} >= 1")
    if activation not in ACTIVATIONS:
        raise ValueError(f"MoBE: activation={activation!r}; allowed: {', '.join(ACTIVATIONS)}")
    dtype = torch.promote_types(W.dtype, torch.float32)
    std = W.detach().to(dtype).std().clamp_min(1e-30)
    target = W.detach().to(dtype) / std  # the public code fits W / global std
    gen = torch.Generator().manual_seed(int(seed))
    p = _mobe_init(target, r, m, coef, gen)
    spec = {"kind": "mobe", "activation": activation, "coef": coef}

    def z(q: dict[str, torch.Tensor]) -> torch.Tensor:
        return _act(torch.einsum("em,mrh->erh", mobe_coefficients(q["coef"], coef), q["bases"]), activation)

    if refit:
        p["A"] = _lstsq_A(target, z(p))
    params = {k: v.clone().requires_grad_(True) for k, v in p.items()}
    best = {k: v.detach().clone() for k, v in params.items()}
    best_loss = float("inf")
    opt = torch.optim.Adam(list(params.values()), lr=lr)
    for _ in range(int(steps)):
        opt.zero_grad()
        loss = torch.mean((reconstruct(spec, params) - target) ** 2)
        if loss.item() < best_loss:
            best_loss, best = loss.item(), {k: v.detach().clone() for k, v in params.items()}
        loss.backward()
        opt.step()
    with torch.no_grad():
        last = torch.mean((reconstruct(spec, params) - target) ** 2).item()
        out = {k: v.detach().clone() for k, v in params.items()} if last < best_loss else best
        if refit:
            out["A"] = _lstsq_A(target, z(out))
        out["A"] = out["A"] * std  # undo the target scaling
    return {k: v.to(W.dtype) for k, v in out.items()}


# ---- TD-MoE (Router KD paper, App. E/F: whitening + Tucker-2 shared across experts) -----------------------
def whitening(sum_xx: torch.Tensor, n_tokens: int, ridge: float = 1e-3) -> torch.Tensor:
    """S [H, H] lower triangular with S Sᵀ = Σ_t x xᵀ / N + ridge·mean(diag)·I, so ‖W S‖² = mean_t ‖W x‖²
    (+ the ridge)."""
    if n_tokens <= 0:
        raise ValueError(f"n_tokens={n_tokens}: TD-MoE's whitening needs calibration tokens")
    c = sum_xx.detach().to(torch.float64) / n_tokens
    c = c + ridge * c.diagonal().mean().clamp_min(1e-30) * torch.eye(
        c.shape[0], dtype=c.dtype, device=c.device
    )
    return torch.linalg.cholesky(c)


def _top_eigvecs(gram: torch.Tensor, r: int) -> torch.Tensor:
    """The r leading eigenvectors of a symmetric PSD matrix, columns in decreasing eigenvalue order."""
    _, vecs = torch.linalg.eigh(gram)
    return vecs.flip(-1)[:, :r]


def tucker2(
    W: torch.Tensor, r_out: int, r_in: int, S: torch.Tensor | None = None, iters: int = 2
) -> dict[str, torch.Tensor]:
    """Tucker-2 factors {U [out, r_out], core [E, r_out, r_in], V [r_in, in]} with W_e ≈ U core_e V, minimising
    Σ_e ‖(W_e − U core_e V) S‖² (S = I when None) by HOSVD + `iters` HOOI sweeps; V = V_wᵀ S⁻¹."""
    dtype = W.dtype
    T = W.detach().to(torch.float64)
    if S is not None:
        T = T @ S.to(T)
    U = _top_eigvecs(torch.einsum("eoi,epi->op", T, T), r_out)
    V = _top_eigvecs(torch.einsum("eoi,eoj->ij", T, T), r_in)
    for _ in range(int(iters)):
        TV = T @ V
        U = _top_eigvecs(torch.einsum("eor,epr->op", TV, TV), r_out)
        UT = U.T @ T
        V = _top_eigvecs(torch.einsum("eri,erj->ij", UT, UT), r_in)
    core = U.T @ T @ V
    Vt = V.T
    if S is not None:  # V_wᵀ S⁻¹: X S = V_wᵀ
        Vt = torch.linalg.solve_triangular(S.to(T), Vt, upper=False, left=False)
    return {"U": U.to(dtype), "core": core.to(dtype), "V": Vt.to(dtype)}


# ---- one layer -----------------------------------------------------------------------------------------
def _weights(ew: ExpertWeights) -> dict[str, torch.Tensor]:
    return {"gate": ew.gate.detach(), "up": ew.up.detach(), "down": ew.down.detach()}


def _biases(ew: ExpertWeights) -> dict[str, torch.Tensor]:
    found = {"gate": ew.gate_bias, "up": ew.up_bias, "down": ew.down_bias}
    if any(b is None for b in found.values()) and any(b is not None for b in found.values()):
        raise ValueError("experts with some but not all of gate/up/down biases are not supported")
    return {p: b.detach() for p, b in found.items() if b is not None}


def mobe_rank(E: int, I: int, H: int, K: int, m: int, bias: bool = False, rank: int | None = None) -> int:  # noqa: E741
    """MoBE's rank within the budget K/E, counted as the MoBE paper's settings are (Router KD paper's MoBE at
    62.5%: r = 768, m = 8 on Qwen3-30B-A3B gives exactly 0.6250 of the routed parameters): the factors A and
    the bases, not the E·m mixing coefficients per factored projection (negligible: 2,048 of 75M per layer
    there). The largest such rank, or `rank` checked against it."""
    limit = budget(E, I, H, K, bias)
    cost = lambda r: mobe_params(E, I, H, r, m, bias) - 2 * E * m  # noqa: E731
    if rank is None:
        return solve_rank(cost, limit, min(I, H), f"MoBE (bases={m})")
    if cost(int(rank)) > limit:
        raise ValueError(
            f"MoBE: rank={rank} needs {cost(int(rank))} routed parameters, over the budget of {limit}"
        )
    return int(rank)


MOBE_DEFAULTS = {
    "bases": 2,
    "activation": "silu",
    "coef": "softmax",
    "steps": 300,
    "lr": 0.07,
    "seed": 0,
    "refit": True,
    "rank": None,
}


def edit_mobe(
    ctx: LayerContext, K: int, settings: dict
) -> tuple[dict, dict[str, dict[str, torch.Tensor]], dict]:
    """MoBE on gate and up at the largest rank within the budget; down kept dense."""
    s = {**MOBE_DEFAULTS, **settings}
    ew = ctx.experts
    E, I, H, bias = ew.num_experts, ew.intermediate, ew.hidden, ew.gate_bias is not None  # noqa: E741
    m = int(s["bases"])
    limit = budget(E, I, H, K, bias)
    if 2 * E * m + E * H * I + (E * (2 * I + H) if bias else 0) >= limit:
        raise ValueError(
            f"MoBE: K={K} of E={E} leaves no room for gate/up factors (MoBE keeps the down "
            f"projections dense, 1/3 of the routed parameters): use K > {E // 3}"
        )
    r = mobe_rank(E, I, H, K, m, bias, s["rank"])
    w = _weights(ew)
    fit = {k: s[k] for k in ("activation", "coef", "steps", "lr", "seed", "refit")}
    factors = {p: fit_mobe(w[p], r, m, **fit) for p in ("gate", "up")}
    factors["down"] = {"weight": w["down"].clone()}
    specs = {p: {"kind": "mobe", "activation": s["activation"], "coef": s["coef"]} for p in ("gate", "up")}
    specs["down"] = {"kind": "dense"}
    student = {"method": "MoBE", "rank": r, "bases": m, "factored": ["gate", "up"], **fit}
    return student | {"projections": specs}, factors, {"rank": r, "bases": m}


TD_MOE_DEFAULTS = {"ridge": 1e-3, "iters": 2, "down": "plain", "whiten": True, "rank": None}


def edit_td_moe(
    ctx: LayerContext, K: int, settings: dict
) -> tuple[dict, dict[str, dict[str, torch.Tensor]], dict]:
    """TD-MoE: whitened Tucker-2 of gate and up (input = the block input), down per `down` (plain / keep)."""
    s = {**TD_MOE_DEFAULTS, **settings}
    if s["down"] not in ("plain", "keep"):
        raise ValueError(f"TD-MoE: down={s['down']!r}; allowed: plain (factor unwhitened), keep (dense)")
    ew = ctx.experts
    E, I, H, bias = ew.num_experts, ew.intermediate, ew.hidden, ew.gate_bias is not None  # noqa: E741
    factor_down = s["down"] == "plain"
    limit = budget(E, I, H, K, bias)
    cost = lambda r: td_moe_params(E, I, H, r, factor_down, bias)  # noqa: E731
    r = solve_rank(cost, limit, max(I, H), "TD-MoE") if s["rank"] is None else int(s["rank"])
    if cost(r) > limit:
        raise ValueError(f"TD-MoE: rank={r} needs {cost(r)} routed parameters, over the budget of {limit}")
    S = None
    if s["whiten"]:
        ctx.stats.require("sum_xx")
        S = whitening(ctx.stats.sum_xx, ctx.stats.n_tokens, float(s["ridge"])).to(ew.gate.device)
    w = _weights(ew)
    factored = ["gate", "up"] + (["down"] if factor_down else [])
    factors = {
        p: tucker2(
            w[p], min(r, w[p].shape[1]), min(r, w[p].shape[2]), S if p != "down" else None, int(s["iters"])
        )
        for p in factored
    }
    specs = {p: {"kind": "tucker"} for p in factored}
    if not factor_down:
        factors["down"], specs["down"] = {"weight": w["down"].clone()}, {"kind": "dense"}
    ranks = {p: [min(r, w[p].shape[1]), min(r, w[p].shape[2])] for p in factored}
    student = {
        "method": "TD-MoE",
        "rank": r,
        "ranks": ranks,
        "factored": factored,
        **{k: s[k] for k in ("ridge", "iters", "down", "whiten")},
    }
    return student | {"projections": specs}, factors, {"rank": r, "bases": 0}


@dataclass(frozen=True)
class Editing:
    """`edit(ctx, K, settings) -> (student settings incl. per-projection specs, factors per projection,
    numeric extras)`."""

    edit: Callable[[LayerContext, int, dict], tuple[dict, dict[str, dict[str, torch.Tensor]], dict]]


EDITINGS: dict[str, Editing] = {"MoBE": Editing(edit_mobe), "TD-MoE": Editing(edit_td_moe)}


def get_editing(name: str) -> Editing:
    return lookup(EDITINGS, name, "editing")


def relative_errors(
    orig: dict[str, torch.Tensor], approx: dict[str, torch.Tensor]
) -> tuple[list[float], float]:
    """Per expert and over the layer: sqrt(Σ_p ‖W_p − Ŵ_p‖² / Σ_p ‖W_p‖²) over gate, up and down."""
    num = sum(((orig[p].double() - approx[p].double()) ** 2).sum(dim=(1, 2)) for p in PROJECTIONS)
    den = sum((orig[p].double() ** 2).sum(dim=(1, 2)) for p in PROJECTIONS)
    per = (num / den.clamp_min(1e-300)).sqrt()
    return per.tolist(), float((num.sum() / den.sum().clamp_min(1e-300)).sqrt())


def edit_layer(
    layer: int, ctx: LayerContext, method: str, K: int, settings: dict | None = None
) -> tuple[LayerPlan, dict[str, torch.Tensor]]:
    """The edited layer: a plan keeping all E experts (each its own group, weight 1, α 1), with per-expert
    relative reconstruction errors as scores, and the factors as `layer.{layer}.{proj}.{name}` tensors
    (dense projections as `.weight`, expert biases as `.bias`). extras: rank, bases, rel_error,
    params_routed (after editing), params_routed_original and `student` (what shapes the edited model)."""
    ed = get_editing(method)
    E = ctx.experts.num_experts
    if not ctx.top_k <= K <= E:
        raise ValueError(f"K={K} out of range; allowed k <= K <= E: {ctx.top_k}..{E}")
    student, factors, numeric = ed.edit(ctx, int(K), dict(settings or {}))
    orig = _weights(ctx.experts)
    approx = {p: reconstruct(student["projections"][p], factors[p]) for p in PROJECTIONS}
    per_expert, rel = relative_errors(orig, approx)
    for p, b in _biases(ctx.experts).items():
        factors[p]["bias"] = b.clone()
    student["bias"] = bool(_biases(ctx.experts))
    tensors = {
        f"layer.{layer}.{p}.{name}": t.contiguous() for p in PROJECTIONS for name, t in factors[p].items()
    }
    ew = ctx.experts
    extras = {
        **numeric,
        "rel_error": rel,
        "params_routed": factor_count(tensors),
        "params_routed_original": routed_params(E, ew.intermediate, ew.hidden, student["bias"]),
        "student": student,
    }
    plan = LayerPlan(
        layer=layer,
        selected=list(range(E)),
        scores=per_expert,
        groups=[[e] for e in range(E)],
        merge_weights=[[1.0] for _ in range(E)],
        alpha=[1.0] * E,
        extras=extras,
    )
    return plan, tensors
