"""Expert editing: keep all E routed experts of a layer but factorise their weights to a parameter budget.

Three methods (Router KD paper, App. E/F). MoBE and Tucker2-experts hit the routed-expert parameter budget
of pruning to K of the E experts, so the three kinds of smaller MoE compare at equal size; TD-MoE does too
by default, or, as published, removes a `ratio` of the parameters of the `layers` it decomposes.

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

TD-MoE (Anonymous 2025c, "TD-MoE: Tensor Decomposition for MoE Models"; Router KD paper, App. E/F:
"whitening, then joint tensor decomposition"): per projection the layer's experts stacked into a 3-way
tensor W [E, out, in] and decomposed across the experts by a 3-D Tucker decomposition
W ≈ G ×₁ U_e ×₂ U_out ×₃ U_in (core G [r_e, r_out, r_in]; factors U_e [E, r_e], U_out [out, r_out],
U_in [in, r_in]; every mode, the experts' included, may be compressed), fitted by HOSVD plus `iters` HOOI
sweeps on the whitened tensor T_e = A W_e B and un-whitened after (multilinear whitening, `whiten`):
- input side (input, both): B = S_in with S_in S_inᵀ = Σ_x + ridge·mean(diag)·I, Σ_x = Σ_t x xᵀ / N the
  block input's second moment (calibration's sum_xx), so that ‖(W_e − Ŵ_e) S_in‖² is the squared output
  error over the calibration tokens;
- output side (output, both): A = S_out⁻¹ with S_out S_outᵀ = Σ_y + ridge·mean(diag)·I,
  Σ_y = (1/E) Σ_e W_e Σ_x W_eᵀ the second moment of the outputs y = W_e x, averaged over the experts. The
  published code whitens the output side by the covariance of the loss gradient at the output (a backward
  pass); calibration collects no output-side statistic, so this one is computed from the input's
  (E[y yᵀ] = W E[x xᵀ] Wᵀ). With `both` it makes Σ_e T_e T_eᵀ = E·I up to the ridge: the whitened output
  mode has a flat spectrum, and its factor comes from the HOOI sweeps alone.
Only gate and up are whitened: the down projection's input (the expert's intermediate activation) has no
statistic and neither has its output's Gram, so down is decomposed unwhitened. Stored (kind `tucker`) as
core, Ue = U_e, U = S_out U_out [out, r_out] and V = U_inᵀ S_in⁻¹ [r_in, in].
Ranks: `ratio` is the fraction of a decomposed projection's parameters removed (the published code's
RATIO): r_e r_out r_in + E r_e + out r_out + in r_in ≤ (1 − ratio)·E·out·in (expert biases stay dense and
count too). As in the published rank search r_in is the largest that fits given (r_e, r_out); of those
(r_e, r_out) the one with the smallest HOSVD error bound (the whitened tensor's mode-n energy beyond r_n,
summed over the modes) is taken, where the published search takes the count nearest the budget.
`expert_rank` fixes r_e (the code the Router KD run used keeps r_e = E). `layers` names the decoder layers
decomposed (all; a list; {every: N, start: s}; {count: n, of: L}: n of L spread evenly); the other layers
keep their experts as they are. Defaults: ratio 1 − K/E (the budget of K experts), every layer, input
whitening, 2 HOOI sweeps.

Tucker2-experts (what this module called TD-MoE before; not the published method): per projection a
Tucker-2 decomposition of the expert stack [E, out, in] sharing U [out, r] and V [r, in] across the experts,
one core G_e [r, r] per expert (the expert mode is never compressed), W_e ≈ U · G_e · Vᵀ S⁻¹, gate/up
input-whitened with S = S_in above (HOSVD, refined by `iters` HOOI sweeps), one rank r for all factored
projections of a layer, every layer at the budget K/E. The down projection's input has no statistic:
`down="plain"` (default) factors it unwhitened, `down="keep"` leaves it dense.

Budget: K of E means ≤ K/E of the layer's routed-expert parameters (gate, up, down and any expert biases;
biases stay dense; the router is unchanged). MoBE and Tucker2-experts take the largest rank within it (a
Tucker mode's rank is capped at that mode's size, MoBE's rank at min(I, H)). Pure tensor code: no
transformers import.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

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


def tucker2_experts_params(
    E: int,
    I: int,  # noqa: E741
    H: int,
    r: int,
    factor_down: bool = True,
    bias: bool = False,
) -> int:
    """Tucker2-experts' routed parameters: Tucker-2 gate and up (and down unless kept dense), any biases."""
    down = tucker_params(E, H, I, r) if factor_down else E * H * I
    return 2 * tucker_params(E, I, H, r) + down + (E * (2 * I + H) if bias else 0)


# ---- TD-MoE's count (the published rank search's: core and the three factors) ----------------------------
def tucker3_params(E: int, out: int, inp: int, ranks: tuple[int, int, int]) -> int:
    """One 3-D Tucker factored projection: core [r_e, r_out, r_in], Ue [E, r_e], U [out, r_out], V [r_in, in]."""
    re_, ro, ri = ranks
    return re_ * ro * ri + E * re_ + out * ro + inp * ri


def td_moe_budget(E: int, out: int, inp: int, keep: Fraction, bias: bool = False) -> int:
    """The most factor parameters of one decomposed projection: floor(keep · its parameters), keep = 1 −
    ratio, less its dense bias [E, out] when it has one (the bias counts against the budget too)."""
    dense = E * out * inp + (E * out if bias else 0)
    return math.floor(keep * dense) - (E * out if bias else 0)


def td_moe_keep(ratio: float | None, K: int, E: int) -> Fraction:
    """The fraction of a decomposed projection's parameters kept: 1 − ratio, or K/E when no ratio is set."""
    return Fraction(K, E) if ratio is None else 1 - Fraction(str(ratio))


def td_moe_model_params(
    total: int,
    E: int,
    I: int,  # noqa: E741
    H: int,
    n_layers: int,
    ratio: float,
    bias: bool = False,
) -> int:
    """A model's parameters after TD-MoE at `ratio` on `n_layers` of its MoE layers, at the budget (every
    decomposed projection at td_moe_budget; a fit is at most that, and below it by less than
    r_e·r_out + in per projection, since r_in is the largest that fits): `total` (the model's) less those
    layers' routed-expert parameters plus their budgets and dense biases."""
    keep = 1 - Fraction(str(ratio))
    layer = sum(td_moe_budget(E, o, i, keep, bias) for o, i in ((I, H), (I, H), (H, I)))
    layer += E * (2 * I + H) if bias else 0
    return total - n_layers * (routed_params(E, I, H, bias) - layer)


def td_moe_ranks(
    E: int,
    out: int,
    inp: int,
    limit: int,
    tails: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    expert_rank: int | None = None,
) -> tuple[int, int, int]:
    """(r_e, r_out, r_in) within `limit` parameters (tucker3_params): for each r_e (or `expert_rank`) and
    r_out, r_in the largest that fits (capped at in); of these the one with the smallest Σ_n tails[n][r_n],
    tails[n][r] = the energy of mode n beyond its r leading directions (the HOSVD error bound; None: flat
    spectra, i.e. the most parameters). One-line ValueError when not even ranks (1, 1, 1) fit."""
    if tails is None:
        tails = tuple(1.0 - torch.arange(n + 1, dtype=torch.float64) / n for n in (E, out, inp))
    if expert_rank is not None and not 1 <= expert_rank <= E:
        raise ValueError(f"TD-MoE: expert_rank={expert_rank} must be in 1..{E}")
    best: tuple[float, tuple[int, int, int]] | None = None
    r_out = torch.arange(1, out + 1, dtype=torch.int64)
    for re_ in [expert_rank] if expert_rank is not None else range(1, E + 1):
        r_in = torch.div(limit - E * re_ - out * r_out, re_ * r_out + inp, rounding_mode="floor").clamp(
            max=inp
        )
        ok = r_in >= 1
        if not bool(ok.any()):
            continue
        bound = tails[0][re_] + tails[1][r_out[ok]] + tails[2][r_in[ok]]
        j = int(torch.argmin(bound))
        if best is None or float(bound[j]) < best[0]:
            best = (float(bound[j]), (re_, int(r_out[ok][j]), int(r_in[ok][j])))
    if best is None:
        need = tucker3_params(E, out, inp, (expert_rank or 1, 1, 1))
        raise ValueError(
            f"TD-MoE: no ranks fit the budget of {limit} parameters for a [{E}, {out}, {inp}] projection "
            f"(ranks 1 need {need}); use a smaller ratio (or a larger K)"
        )
    return best[1]


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
    if kind == "tucker":  # per expert U · core_e · V; a 3-D Tucker's core_e = Σ_a Ue[e, a] core[a]
        core = t["core"] if "Ue" not in t else torch.einsum("ea,arq->erq", t["Ue"], t["core"])
        return t["U"] @ core @ t["V"]
    raise ValueError(f"projection kind={kind!r}; allowed: dense, mobe, tucker")


# ---- the factors applied to routed rows (the edited model's forward, without forming W_e) ------------------
GROUPED_KERNELS = ("auto", "grouped_mm", "loop")


@dataclass(frozen=True)
class Step:
    """One linear step of a projection's factor chain W_e = S_n ⋯ S_1 (S_1 applied first): a matrix every
    expert shares (`shared` [o, i]), a per-expert stack stored as it is (`stack` [E, o, i], indexed, never
    copied) or one built from the factors for the experts named (`build(ids) -> [len(ids), o, i]`)."""

    shared: torch.Tensor | None = None
    stack: torch.Tensor | None = None
    build: Callable[[torch.Tensor], torch.Tensor] | None = None


def factor_steps(spec: dict, t: dict[str, torch.Tensor]) -> list[Step]:
    """reconstruct's product as a chain of steps (applied first to last), so that routed rows go through the
    factors without any W_e being formed."""
    kind = spec["kind"]
    if kind == "dense":
        return [Step(stack=t["weight"])]
    if kind == "mobe":
        # MoBE (Chen et al. 2025, Eq. 2–4): W_e = A_e · act(Σ_j c_ej B_j); the activation acts on the mixed
        # basis matrix, so the mixture is built per routed expert before the rows meet it
        mix, bases, activation = mobe_coefficients(t["coef"], spec["coef"]), t["bases"], spec["activation"]

        def mixed(ids: torch.Tensor) -> torch.Tensor:
            return _act(torch.einsum("em,mrh->erh", mix[ids], bases), activation)

        return [Step(build=mixed), Step(stack=t["A"])]
    if kind == "tucker":
        # Tucker-2 / TD-MoE's 3-D Tucker (Router KD paper, App. E/F): W_e = U · core_e · V,
        # core_e = Σ_a Ue[e, a] core[a]; U and V are shared, so they meet each token once
        if "Ue" in t:
            Ue, core = t["Ue"], t["core"]
            middle = Step(build=lambda ids: torch.einsum("ea,arq->erq", Ue[ids], core))
        else:
            middle = Step(stack=t["core"])
        return [Step(shared=t["V"]), middle, Step(shared=t["U"])]
    raise ValueError(f"projection kind={kind!r}; allowed: dense, mobe, tucker")


def split_shared_tail(steps: list[Step]) -> tuple[list[Step], list[Step]]:
    """(the steps up to the last per-expert one, the shared steps after it). A map every expert shares
    commutes with the routing weights' sum over a token's experts, so the tail can run once per token."""
    last = max(i for i, s in enumerate(steps) if s.shared is None)
    return steps[: last + 1], steps[last + 1 :]


class ExpertGroups:
    """Routed rows sorted by expert id (`sorted_ids` [S]): `ends` [E] where each expert's rows end,
    `active` the experts that receive rows and `active_ends` where theirs end. The host-side bounds a loop
    needs are read once (one device sync), when first asked for."""

    def __init__(self, sorted_ids: torch.Tensor, num_experts: int):
        counts = torch.bincount(sorted_ids, minlength=num_experts)
        if counts.numel() != num_experts:
            raise ValueError(f"expert ids must be in 0..{num_experts - 1}; got up to {counts.numel() - 1}")
        self.ends = torch.cumsum(counts, 0)
        self.active = torch.nonzero(counts).squeeze(1)
        self.active_ends = self.ends[self.active]
        self._bounds: dict[str, list[int]] = {}

    def bounds(self, which: str) -> list[int]:
        """[0, *ends] (`which` = all) or [0, *active_ends] (active) as Python ints."""
        if which not in self._bounds:
            ends = self.ends if which == "all" else self.active_ends
            self._bounds[which] = [0, *ends.tolist()]
        return self._bounds[which]


def _grouped_mm_usable(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Where torch's grouped GEMM beats one matmul per group: bfloat16 on CUDA devices of compute capability
    8.0 and later (sizes off its 16-byte alignment are zero-padded), and float32, bfloat16 and float16 on CPU
    when the sizes are aligned already (padding copies cost more there than the loop). float64: no kernel."""
    if not hasattr(torch.nn.functional, "grouped_mm") or x.dtype != w.dtype or x.device != w.device:
        return False
    if x.is_cuda:
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (8, 0)
    align = 16 // x.element_size()
    return (
        x.device.type == "cpu"
        and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and w.shape[1] % align == 0
        and w.shape[2] % align == 0
    )


class _ContiguousGrad(torch.autograd.Function):
    """The identity, whose backward hands on a contiguous gradient (the grouped GEMM's backward refuses the
    stride-0 gradient of, say, a sum)."""

    @staticmethod
    def forward(ctx: object, y: torch.Tensor) -> torch.Tensor:
        return y.view_as(y)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _grouped_mm(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """grouped_linear through torch's grouped GEMM: every row stride a multiple of 16 bytes (the in and out
    sizes zero-padded, which adds exact zeros) and 16-byte aligned operands."""
    align = max(1, 16 // x.element_size())
    pad_in, pad_out = (-w.shape[2]) % align, (-w.shape[1]) % align
    if pad_in:
        x, w = torch.nn.functional.pad(x, (0, pad_in)), torch.nn.functional.pad(w, (0, pad_in))
    if pad_out:
        w = torch.nn.functional.pad(w, (0, 0, 0, pad_out))
    x, w = x.contiguous(), w.contiguous()
    if x.data_ptr() % 16:
        x = x.clone()
    if w.data_ptr() % 16:
        w = w.clone()
    y = torch.nn.functional.grouped_mm(x, w.transpose(1, 2), offs=ends.to(torch.int32))
    if y.requires_grad:
        y = _ContiguousGrad.apply(y)
    return y[:, : w.shape[1] - pad_out] if pad_out else y


def _resolve_kernel(x: torch.Tensor, w: torch.Tensor, kernel: str) -> str:
    if kernel not in GROUPED_KERNELS:
        raise ValueError(f"kernel={kernel!r}; allowed: {', '.join(GROUPED_KERNELS)}")
    if kernel == "auto":
        return "grouped_mm" if _grouped_mm_usable(x, w) else "loop"
    return kernel


def grouped_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    ends: torch.Tensor,
    kernel: str = "auto",
    bounds: list[int] | None = None,
) -> torch.Tensor:
    """x [S, in] with its rows in len(ends) consecutive groups (group g: rows ends[g-1]..ends[g]), each times its
    w[g]ᵀ ([G, out, in]): [S, out]. `kernel`: grouped_mm (torch's grouped GEMM), loop (one matmul per non-empty
    group; `bounds` = [0, *ends] as ints saves reading ends from the device) or auto (grouped_mm where it beats
    the loop: bfloat16 on CUDA, aligned float32/bfloat16/float16 on CPU; else loop)."""
    kernel = _resolve_kernel(x, w, kernel)
    if x.shape[0] == 0:
        return x.new_zeros(0, w.shape[1])
    if kernel == "grouped_mm":
        return _grouped_mm(x, w, ends)
    b = [0, *ends.tolist()] if bounds is None else bounds
    return torch.cat([x[lo:hi] @ w[g].T for g, (lo, hi) in enumerate(zip(b, b[1:], strict=False)) if hi > lo])


def routed_apply(
    steps: list[Step],
    x: torch.Tensor,
    groups: ExpertGroups,
    rows: torch.Tensor | None = None,
    kernel: str = "auto",
) -> torch.Tensor:
    """Routed rows through a chain of steps, each per-expert step for the experts that receive rows only.
    x [S, in] sorted by expert; or, given `rows` (the token of each sorted row), x [T, in] the tokens: the
    leading shared steps then run once per token, before the gather, not once per routed pair."""
    i = 0
    if rows is not None:
        while i < len(steps) and steps[i].shared is not None:
            x = x @ steps[i].shared.T
            i += 1
        x = x[rows]
    for step in steps[i:]:
        if step.shared is not None:
            x = x @ step.shared.T
            continue
        which, w = ("all", step.stack) if step.stack is not None else ("active", step.build(groups.active))
        ends = groups.ends if which == "all" else groups.active_ends
        k = _resolve_kernel(x, w, kernel)
        x = grouped_linear(x, w, ends, k, groups.bounds(which) if k == "loop" and x.shape[0] else None)
    return x


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


# ---- whitening (TD-MoE and Tucker2-experts) and Tucker-2 (Tucker2-experts) --------------------------------
def whitening(sum_xx: torch.Tensor, n_tokens: int, ridge: float = 1e-3) -> torch.Tensor:
    """S [H, H] lower triangular with S Sᵀ = Σ_t x xᵀ / N + ridge·mean(diag)·I, so ‖W S‖² = mean_t ‖W x‖²
    (+ the ridge)."""
    if n_tokens <= 0:
        raise ValueError(f"n_tokens={n_tokens}: TD-MoE's whitening needs calibration tokens")
    c = sum_xx.detach().to(torch.float64) / n_tokens
    return _ridged_cholesky(c, ridge)


def _ridged_cholesky(c: torch.Tensor, ridge: float) -> torch.Tensor:
    eye = torch.eye(c.shape[0], dtype=c.dtype, device=c.device)
    return torch.linalg.cholesky(c + ridge * c.diagonal().mean().clamp_min(1e-30) * eye)


def output_whitening(
    W: torch.Tensor, sum_xx: torch.Tensor, n_tokens: int, ridge: float = 1e-3
) -> torch.Tensor:
    """S_out [out, out] lower triangular with S_out S_outᵀ = (1/E) Σ_e W_e Σ_x W_eᵀ + ridge·mean(diag)·I,
    Σ_x = sum_xx / N: the second moment of the outputs y = W_e x over the calibration inputs, averaged over
    the E experts of W [E, out, in]."""
    if n_tokens <= 0:
        raise ValueError(f"n_tokens={n_tokens}: TD-MoE's whitening needs calibration tokens")
    w = W.detach().to(torch.float64)
    cx = sum_xx.detach().to(w) / n_tokens
    cy = torch.einsum("eoi,epi->op", w @ cx, w) / w.shape[0]
    return _ridged_cholesky((cy + cy.T) / 2, ridge)


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


# ---- TD-MoE: 3-D Tucker across the experts (TD-MoE paper; Router KD paper, App. F) -------------------------
def _spectrum(gram: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(eigenvalues, eigenvectors) of a symmetric PSD Gram matrix, in decreasing order, eigenvalues ≥ 0."""
    vals, vecs = torch.linalg.eigh(gram)
    return vals.flip(-1).clamp_min(0), vecs.flip(-1)


def _tails(vals: torch.Tensor) -> torch.Tensor:
    """tails[r] = Σ_{i ≥ r} vals[i], r = 0..n: a mode's energy beyond its r leading directions."""
    tail = vals.flip(0).cumsum(0).flip(0)
    return torch.cat([tail, tail.new_zeros(1)])


def tucker3(
    W: torch.Tensor,
    ranks: tuple[int, int, int] | None = None,
    *,
    limit: int | None = None,
    expert_rank: int | None = None,
    S_out: torch.Tensor | None = None,
    S_in: torch.Tensor | None = None,
    iters: int = 2,
) -> tuple[dict[str, torch.Tensor], tuple[int, int, int]]:
    """3-D Tucker factors {core [r_e, r_out, r_in], Ue [E, r_e], U [out, r_out], V [r_in, in]} of W
    [E, out, in] with W_e ≈ U (Σ_a Ue[e, a] core[a]) V, and the ranks: HOSVD + `iters` HOOI sweeps of the
    whitened T_e = S_out⁻¹ W_e S_in (either side I when None), un-whitened after (U = S_out U_w,
    V = V_wᵀ S_in⁻¹). `ranks`, or those td_moe_ranks picks within `limit` parameters from T's spectra."""
    dtype, (E, out, inp) = W.dtype, W.shape
    T = W.detach().to(torch.float64)
    if S_out is not None:
        T = torch.linalg.solve_triangular(S_out.to(T), T, upper=False)
    if S_in is not None:
        T = T @ S_in.to(T)
    flat = T.reshape(E * out, inp)
    spectra = [
        _spectrum(T.reshape(E, -1) @ T.reshape(E, -1).T),
        _spectrum(torch.einsum("eoi,epi->op", T, T)),
        _spectrum(flat.T @ flat),
    ]
    if ranks is None:
        if limit is None:
            raise ValueError("tucker3: give the ranks or a parameter limit")
        ranks = td_moe_ranks(E, out, inp, limit, tuple(_tails(v) for v, _ in spectra), expert_rank)
    re_, ro, ri = ranks
    if not (1 <= re_ <= E and 1 <= ro <= out and 1 <= ri <= inp):
        raise ValueError(f"tucker3: ranks {tuple(ranks)} out of range for a [{E}, {out}, {inp}] tensor")
    Ue, U, V = (vecs[:, :r] for (_, vecs), r in zip(spectra, ranks, strict=True))
    for _ in range(int(iters)):  # HOOI: each factor from T projected on the other two
        TV = T @ V
        Y = torch.einsum("eoq,or->erq", TV, U).reshape(E, -1)
        Ue = _top_eigvecs(Y @ Y.T, re_)
        Y = torch.einsum("ea,eoq->aoq", Ue, TV)
        U = _top_eigvecs(torch.einsum("aoq,apq->op", Y, Y), ro)
        Y = torch.einsum("ea,eri->ari", Ue, U.T @ T).reshape(-1, inp)
        V = _top_eigvecs(Y.T @ Y, ri)
    core = torch.einsum("ea,erq->arq", Ue, U.T @ T @ V)
    if S_out is not None:
        U = S_out.to(T) @ U
    Vt = V.T
    if S_in is not None:  # X S_in = V_wᵀ
        Vt = torch.linalg.solve_triangular(S_in.to(T), Vt, upper=False, left=False)
    factors = {"core": core, "Ue": Ue, "U": U, "V": Vt}
    return {k: v.to(dtype) for k, v in factors.items()}, (re_, ro, ri)


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
    layer: int, ctx: LayerContext, K: int, settings: dict
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


TUCKER2_EXPERTS_DEFAULTS = {"ridge": 1e-3, "iters": 2, "down": "plain", "whiten": True, "rank": None}


def edit_tucker2_experts(
    layer: int, ctx: LayerContext, K: int, settings: dict
) -> tuple[dict, dict[str, dict[str, torch.Tensor]], dict]:
    """Tucker2-experts: whitened Tucker-2 of gate and up (input = the block input), down per `down` (plain /
    keep), one rank at the budget of K experts."""
    s = {**TUCKER2_EXPERTS_DEFAULTS, **settings}
    if s["down"] not in ("plain", "keep"):
        raise ValueError(
            f"Tucker2-experts: down={s['down']!r}; allowed: plain (factor unwhitened), keep (dense)"
        )
    ew = ctx.experts
    E, I, H, bias = ew.num_experts, ew.intermediate, ew.hidden, ew.gate_bias is not None  # noqa: E741
    factor_down = s["down"] == "plain"
    limit = budget(E, I, H, K, bias)
    cost = lambda r: tucker2_experts_params(E, I, H, r, factor_down, bias)  # noqa: E731
    r = solve_rank(cost, limit, max(I, H), "Tucker2-experts") if s["rank"] is None else int(s["rank"])
    if cost(r) > limit:
        raise ValueError(
            f"Tucker2-experts: rank={r} needs {cost(r)} routed parameters, over the budget of {limit}"
        )
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
        "method": "Tucker2-experts",
        "rank": r,
        "ranks": ranks,
        "factored": factored,
        **{k: s[k] for k in ("ridge", "iters", "down", "whiten")},
    }
    return student | {"projections": specs}, factors, {"rank": r, "bases": 0}


TD_MOE_DEFAULTS = {
    "ratio": None,
    "layers": "all",
    "whiten": "input",
    "expert_rank": None,
    "iters": 2,
    "ridge": 1e-3,
}
WHITENINGS = ("input", "output", "both", "none")


def td_moe_settings(settings: dict) -> dict:
    """TD-MoE's settings, checked (one-line ValueError naming the setting), defaults filled in: `ratio`
    (0 < ratio < 1, the fraction of a decomposed projection's parameters removed; None: 1 − K/E),
    `layers` ("all", a list of layer indices, {every: N, start: s} or {count: n, of: L}), `whiten`
    (input, output, both, none), `expert_rank` (None: searched; an int fixes r_e), `iters` (HOOI sweeps
    after the HOSVD, ≥ 0) and `ridge` (≥ 0)."""
    unknown = sorted(set(settings) - set(TD_MOE_DEFAULTS))
    if unknown:
        raise ValueError(
            f"TD-MoE: unknown setting {', '.join(unknown)}; allowed: {', '.join(TD_MOE_DEFAULTS)}"
        )
    s = {**TD_MOE_DEFAULTS, **settings}
    if s["ratio"] is not None and not (
        isinstance(s["ratio"], int | float) and not isinstance(s["ratio"], bool) and 0 < s["ratio"] < 1
    ):
        raise ValueError(f"TD-MoE: ratio={s['ratio']!r}; allowed: a number in (0, 1), the fraction removed")
    if s["whiten"] not in WHITENINGS:
        raise ValueError(f"TD-MoE: whiten={s['whiten']!r}; allowed: {', '.join(WHITENINGS)}")
    for name, low in (("expert_rank", 1), ("iters", 0)):
        v = s[name]
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < low):
            raise ValueError(f"TD-MoE: {name}={v!r}; allowed: an integer >= {low}")
    if s["iters"] is None:
        raise ValueError("TD-MoE: iters=None; allowed: an integer >= 0")
    if isinstance(s["ridge"], bool) or not isinstance(s["ridge"], int | float) or s["ridge"] < 0:
        raise ValueError(f"TD-MoE: ridge={s['ridge']!r}; allowed: a number >= 0")
    td_moe_layers(s["layers"])
    return s


def td_moe_layers(spec: object) -> Callable[[int], bool]:
    """Whether a decoder layer is decomposed, per the `layers` setting: "all"; a list of layer indices;
    {every: N, start: s} (s, s + N, s + 2N, ...; s defaults to 0); {count: n, of: L}: n of layers 0..L−1
    spread evenly (floor((i + 1/2)·L/n), i < n). One-line ValueError for anything else."""
    allowed = "allowed: all, a list of layer indices, {every: N, start: S} or {count: N, of: L}"

    def ints(*vals: object) -> bool:
        return all(isinstance(v, int) and not isinstance(v, bool) for v in vals)

    if spec == "all":
        return lambda layer: True
    if isinstance(spec, list) and spec and ints(*spec) and min(spec) >= 0 and len(set(spec)) == len(spec):
        chosen = frozenset(spec)
        return lambda layer: layer in chosen
    if isinstance(spec, dict) and set(spec) in ({"every"}, {"every", "start"}):
        n, start = spec["every"], spec.get("start", 0)
        if ints(n, start) and n >= 1 and start >= 0:
            return lambda layer: layer >= start and (layer - start) % n == 0
    if isinstance(spec, dict) and set(spec) == {"count", "of"}:
        n, total = spec["count"], spec["of"]
        if ints(n, total) and 1 <= n <= total:
            chosen = frozenset((2 * i + 1) * total // (2 * n) for i in range(n))
            return lambda layer: layer in chosen
    raise ValueError(f"TD-MoE: layers={spec!r}; {allowed}")


def edit_td_moe(
    layer: int, ctx: LayerContext, K: int, settings: dict
) -> tuple[dict, dict[str, dict[str, torch.Tensor]], dict]:
    """TD-MoE (module docstring): a layer `layers` names gets every projection decomposed by a whitened
    3-D Tucker at `ratio` (default 1 − K/E); any other layer keeps its experts dense, as they are."""
    s = td_moe_settings(settings)
    ew = ctx.experts
    E, bias = ew.num_experts, ew.gate_bias is not None
    w = _weights(ew)
    keep = td_moe_keep(s["ratio"], K, E)
    student = {"method": "TD-MoE", **{k: s[k] for k in TD_MOE_DEFAULTS}}
    if not td_moe_layers(s["layers"])(layer):
        dense = {p: {"weight": w[p].clone()} for p in PROJECTIONS}
        specs = {p: {"kind": "dense"} for p in PROJECTIONS}
        return student | {"decomposed": False, "projections": specs}, dense, {"decomposed": False}
    S_in, ridge = None, float(s["ridge"])
    if s["whiten"] != "none":
        ctx.stats.require("sum_xx")
    if s["whiten"] in ("input", "both"):
        S_in = whitening(ctx.stats.sum_xx, ctx.stats.n_tokens, ridge).to(ew.gate.device)
    factors, ranks = {}, {}
    for p in PROJECTIONS:
        _, out, inp = w[p].shape
        S_out = None
        # down's input (the expert's intermediate activation) and output Gram have no statistic: unwhitened
        if p != "down" and s["whiten"] in ("output", "both"):
            S_out = output_whitening(w[p], ctx.stats.sum_xx, ctx.stats.n_tokens, ridge)
        factors[p], ranks[p] = tucker3(
            w[p],
            limit=td_moe_budget(E, out, inp, keep, bias),
            expert_rank=s["expert_rank"],
            S_out=S_out,
            S_in=S_in if p != "down" else None,
            iters=int(s["iters"]),
        )
    specs = {p: {"kind": "tucker"} for p in PROJECTIONS}
    numeric = {"decomposed": True, "keep": float(keep)}
    student |= {"decomposed": True, "ranks": {p: list(r) for p, r in ranks.items()}, "keep": str(keep)}
    return student | {"projections": specs}, factors, numeric


@dataclass(frozen=True)
class Editing:
    """`edit(layer, ctx, K, settings) -> (student settings incl. per-projection specs, factors per
    projection, numeric extras)`."""

    edit: Callable[[int, LayerContext, int, dict], tuple[dict, dict[str, dict[str, torch.Tensor]], dict]]


EDITINGS: dict[str, Editing] = {
    "MoBE": Editing(edit_mobe),
    "TD-MoE": Editing(edit_td_moe),
    "Tucker2-experts": Editing(edit_tucker2_experts),
}


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
    student, factors, numeric = ed.edit(layer, ctx, int(K), dict(settings or {}))
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
