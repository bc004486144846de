"""Reconstruction-loss expert selection: keep the K experts whose kept set best reproduces the MoE layer's
output on real calibration tokens ("Compressing Large MoE Models via Efficient Pruning and Data-Aware
Calibration", §4.1).

The layer loss of a kept set S is d(S) = ‖Y − Y_S‖_F over the sampled tokens (the paper's ℓ2 distance d: the
Frobenius norm of the [T, H] difference, accumulated in float64), where Y is the reference output of the
routed experts and Y_S the candidate's. Shared experts, the residual and attention are the same in both and
cancel, so this is the decoder layer's output discrepancy (the paper's Layer_l(X_l; S) vs X_{l+1}).
Three searches of the same loss (scorings in workers.methods.scoring.SCORINGS):
- `RL-exhaustive` (O-Prune, Lu et al. 2024, the paper's Table 1 baseline): every K-subset, C(E, K) evaluations;
  refused with a one-line error above `max_subsets`;
- `RL-greedy` (§4.1 "Layer-wise greedy search"): starting from the empty set, add the expert whose addition
  gives the smallest loss, K times: Σ_{t=1..K} (E − t + 1) evaluations, O(n²) at E = 2n, K = n;
- `CFES` (§4.1, Algorithm 1, coarse-to-fine expert selection; CFES is the Router KD paper's name for it): each
  step partitions the candidates into ⌈|candidates|/S⌉ groups (the first of S experts each, the last the
  rest), scores Sel ∪ G for every group (coarse), then Sel ∪ {e} for e in the best group (fine):
  O(K·√(4E + 2 − 2K)) evaluations with S = round(√(E + (1 − K)/2)), O(n^1.5).
Ties go to the lower group index / expert id (RL-exhaustive: the lexicographically first subset). Losses
within TIE_RTOL·max(|d_min|, ‖Y‖_F) of the lowest d_min are ties (64 ulps of ‖Y‖_F where that is coarser:
float32 on a GPU): rounding noise scales with ‖Y‖_F, so subsets that reproduce Y up to rounding (zero loss)
are decided by id, not by which one happens to round lower. With `forced` experts (protected super experts),
the searches start from them and choose the other K − |forced|.

Settings (a sub-grid's `settings: {CFES: {...}}`, LayerContext.settings):
- `target`: `routed_subset` (default; the pruned MoE itself: each token routed among the kept experts, top-k
  of the router's probabilities restricted to S and renormalised over S (a softmax router's output once the
  dropped experts' logits are removed), the k chosen weights renormalised again iff the router renormalises
  (ctx.renormalized); Y is the same rule over all E, so d(all E) = 0) or `dense_proxy` (the MoE→dense
  student with uniform α in output space: Y_S = (1/|S|) Σ_{e∈S} f_e(x), exactly the RR student with
  `uniform` scaling at K = k (each group one expert, α = 1/k); for K > k the dense path averages the grouped
  experts' parameters, this proxy their outputs; Y is the teacher's routed output);
- `input`: `original` (default; the cached teacher inputs of every layer, Algorithm 1 line 4) or `sequential`
  (each layer sees the inputs the already-compressed earlier layers produce, and is compared with the full
  layer on those same inputs: the error terms of Theorem 4.1). Sequential re-runs the sampled windows
  through the teacher with each earlier layer's router decision replaced by its compressed layer's:
  routed_subset = top-k among the kept experts as above (the pruned MoE, exact for softmax routers);
  dense_proxy = every token sent to all kept experts with weight 1/|S| (the output-space dense proxy);
- `max_subsets` (RL-exhaustive; default 100000), `group_size` (CFES's S; default the paper's S*),
  `partition` (CFES: `sequential`, by expert id as a reviewer reads the paper, or `random`, reshuffled each
  step from `seed`).
A router's constant factor (DeepSeek's routed_scaling_factor) scales Y and Y_S alike and is left out of d;
DeepSeek-V3's bias-corrected, group-limited choice is approximated by the top-k of p.
Recorded per layer (LayerPlan.extras, numbers become layer diagnostics): `recon_evals` (layer-loss
evaluations), `recon_seconds` (selection wall time), `recon_loss` (d of the kept set), `recon_tokens`, for
CFES `c2f_group_size`, for sequential input `recon_input_seconds` (the re-run of the windows); `recon_step_losses` (greedy/CFES, per added expert)
stays in plan.json. Pure tensor code: no transformers import (sequential inputs use the model only through
its FamilyAdapter).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from itertools import combinations
from typing import Any

import torch
from torch import nn

from workers.core.types import LayerContext
from workers.methods.experts import all_expert_outputs, sample_copy
from workers.methods.selection import TIE_RTOL, Selection, check_forced

TARGETS = ("routed_subset", "dense_proxy")
INPUTS = ("original", "sequential")
PARTITIONS = ("sequential", "random")


@dataclass(frozen=True)
class ReconSettings:
    """The settings of a reconstruction-loss scoring (module docstring)."""

    target: str = "routed_subset"
    input: str = "original"
    max_subsets: int = 100_000
    group_size: int | None = None
    partition: str = "sequential"
    seed: int = 0

    @classmethod
    def parse(cls, raw: dict[str, Any] | None) -> ReconSettings:
        """Checked settings; a one-line ValueError names what is wrong."""
        raw = dict(raw or {})
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(raw) - set(names))
        if unknown:
            raise ValueError(
                f"settings {', '.join(unknown)}: reconstruction-loss selection takes {', '.join(names)}"
            )
        s = cls(**raw)
        for name, allowed in (("target", TARGETS), ("input", INPUTS), ("partition", PARTITIONS)):
            if getattr(s, name) not in allowed:
                raise ValueError(f"settings.{name}={getattr(s, name)!r}; allowed: {', '.join(allowed)}")
        for name in ("max_subsets", "group_size", "seed"):
            v = getattr(s, name)
            if v is not None and (
                not isinstance(v, int) or isinstance(v, bool) or v < (0 if name == "seed" else 1)
            ):
                raise ValueError(f"settings.{name}={v!r}; must be an integer >= {0 if name == 'seed' else 1}")
        return s


# ---- one layer's loss ---------------------------------------------------------------------------------
def routed_weights(
    p: torch.Tensor, kept: list[int], k: int, renormalized: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The pruned router's decision: (weights [T, min(k, |S|)], expert ids [T, min(k, |S|)]).

    p restricted to S and renormalised over S (softmax over the kept logits), its top-k (k clamped to |S|),
    renormalised over the k iff the router renormalises."""
    idx = torch.as_tensor(sorted(kept), dtype=torch.long, device=p.device)
    q = p[:, idx]
    q = q / q.sum(1, keepdim=True).clamp_min(torch.finfo(q.dtype).tiny)
    w, j = torch.topk(q, min(k, len(kept)), dim=1)
    if renormalized:
        w = w / w.sum(1, keepdim=True).clamp_min(torch.finfo(w.dtype).tiny)
    return w, idx[j]


class LayerLoss:
    """d(S) of one layer on its token sample (module docstring); `evals` counts the calls."""

    def __init__(self, ctx: LayerContext, target: str):
        sample = ctx.stats.sample
        if not sample or "x" not in sample or "p" not in sample:
            raise ValueError(
                "layer statistics have no token sample: reconstruction-loss selection needs "
                "calibration.sample_tokens > 0 (recompute the calibration)"
            )
        if ctx.experts.input_scaled:
            raise ValueError(
                "experts.input_scaled=True (the router weight scales the expert's input, f(w·x)): "
                "reconstruction-loss selection models the layer as Σ w·f(x); not supported"
            )
        dev = ctx.experts.gate.device
        f = all_expert_outputs(ctx.experts, sample["x"].to(dev))  # [E, T, H] in the weights' dtype
        dtype = torch.float64 if dev.type == "cpu" else torch.float32
        self.f = f.to(dtype).transpose(0, 1).contiguous()  # [T, E, H]
        self.p = sample["p"].to(dev, dtype)
        if self.p.shape != self.f.shape[:2]:
            raise ValueError(
                f"token sample: p {tuple(self.p.shape)} does not match [T, E] = {tuple(self.f.shape[:2])}"
            )
        self.T, self.E = self.f.shape[0], self.f.shape[1]
        self.k, self.renormalized, self.target = ctx.top_k, ctx.renormalized, target
        self.rows = torch.arange(self.T, device=dev)[:, None]
        self.reference = self.routed(list(range(self.E)))  # Y: the full layer (Algorithm 1 line 4)
        # Losses closer than this to the lowest are ties: rounding noise scales with ‖Y‖, not with d.
        self.tie_atol = max(TIE_RTOL, 64 * torch.finfo(dtype).eps) * float(
            torch.linalg.vector_norm(self.reference.double())
        )
        self.evals = 0

    def routed(self, kept: list[int]) -> torch.Tensor:
        """Σ_j w_j f_{e_j}(x) under the pruned router's decision, [T, H]."""
        w, e = routed_weights(self.p, kept, self.k, self.renormalized)
        return (w.unsqueeze(-1) * self.f[self.rows, e]).sum(1)

    def output(self, kept: list[int]) -> torch.Tensor:
        if self.target == "dense_proxy":
            return self.f[:, sorted(kept)].mean(1)
        return self.routed(kept)

    def __call__(self, kept: list[int]) -> float:
        self.evals += 1
        return float(torch.linalg.vector_norm((self.reference - self.output(kept)).double()))


def _argmin(items: list, loss_of: Callable[[Any], float], atol: float) -> tuple[Any, float]:
    """The first item (lowest id / group index) among those tied with the lowest loss, and its loss."""
    losses = [loss_of(it) for it in items]
    low = min(losses)
    # Exact and rounding-level ties (within TIE_RTOL·|low| or atol of the lowest) resolve by position = id.
    i = next(i for i, d in enumerate(losses) if d <= low + max(TIE_RTOL * abs(low), atol))
    return items[i], losses[i]


def default_group_size(E: int, K: int) -> int:
    """S* = round(√(E + (1 − K)/2)), halves rounded up (Algorithm 1, "Group size"; Eq. 5's minimiser)."""
    return max(1, math.floor(math.sqrt(E + (1 - K) / 2) + 0.5))


# ---- the three searches -------------------------------------------------------------------------------
def exhaustive(loss: LayerLoss, K: int, forced: list[int], s: ReconSettings) -> tuple[list[int], dict]:
    """The best of all K-subsets that contain `forced` (O-Prune; the paper's Table 1, O(C(E, K)))."""
    rest = [e for e in range(loss.E) if e not in forced]
    n = math.comb(len(rest), K - len(forced))
    if n > s.max_subsets:
        raise ValueError(
            f"RL-exhaustive: C({len(rest)}, {K - len(forced)}) = {n} subsets exceed max_subsets="
            f"{s.max_subsets}; use RL-greedy or CFES, or raise max_subsets"
        )
    best, best_d = _argmin(
        list(combinations(rest, K - len(forced))), lambda c: loss([*forced, *c]), loss.tie_atol
    )
    return [*forced, *best], {"recon_loss": best_d}


def greedy(loss: LayerLoss, K: int, forced: list[int], s: ReconSettings) -> tuple[list[int], dict]:
    """Add the expert whose addition gives the smallest loss, K − |forced| times (§4.1, layer-wise greedy)."""
    sel, cand, steps = list(forced), [e for e in range(loss.E) if e not in forced], []
    for _ in range(K - len(forced)):
        best, best_d = _argmin(cand, lambda e: loss([*sel, e]), loss.tie_atol)
        sel.append(best)
        cand.remove(best)
        steps.append(best_d)
    return sel, {"recon_loss": steps[-1] if steps else loss(sel), "recon_step_losses": steps}


def coarse_to_fine(loss: LayerLoss, K: int, forced: list[int], s: ReconSettings) -> tuple[list[int], dict]:
    """Algorithm 1: per step a coarse pass over groups of S candidates, then a fine pass inside the best group
    (§4.1, coarse-to-fine expert selection). The group count ⌈|candidates|/S⌉ is recomputed every step, as
    the paper's complexity analysis counts it (its pseudocode computes it once, which would leave empty
    groups)."""
    S = s.group_size or default_group_size(loss.E, K)
    gen = torch.Generator().manual_seed(s.seed)
    sel, cand, steps = list(forced), [e for e in range(loss.E) if e not in forced], []
    for _ in range(K - len(forced)):
        order = (
            cand
            if s.partition == "sequential"
            else [cand[i] for i in torch.randperm(len(cand), generator=gen)]
        )
        groups = [order[i : i + S] for i in range(0, len(order), S)]
        best_g, _ = _argmin(groups, lambda g: loss([*sel, *g]), loss.tie_atol)  # coarse: Sel ∪ G_k
        # fine: Sel ∪ {e}, e ∈ G*
        best, best_d = _argmin(sorted(best_g), lambda e: loss([*sel, e]), loss.tie_atol)
        sel.append(best)
        cand.remove(best)
        steps.append(best_d)
    return sel, {
        "recon_loss": steps[-1] if steps else loss(sel),
        "recon_step_losses": steps,
        "c2f_group_size": S,
    }


SEARCHES: dict[str, Callable[[LayerLoss, int, list[int], ReconSettings], tuple[list[int], dict]]] = {
    "exhaustive": exhaustive,
    "greedy": greedy,
    "c2f": coarse_to_fine,
}


@dataclass(frozen=True)
class ReconstructionSelector:
    """A Scoring's `select` that minimises the layer loss on the token sample; takes settings
    (LayerContext.settings, checked by parse_settings). The base score is not used to select."""

    search: str  # a SEARCHES name

    def parse_settings(self, raw: dict[str, Any] | None) -> ReconSettings:
        return ReconSettings.parse(raw)

    def layer_inputs(self, raw: dict[str, Any] | None, teacher: tuple[nn.Module, Any] | None):
        """The re-run of the teacher that sequential inputs need (module-level layer_inputs), else None."""
        return layer_inputs(raw, teacher)

    def __call__(
        self, ctx: LayerContext, scores: torch.Tensor, K: int, forced: tuple[int, ...] = ()
    ) -> Selection:
        s = ReconSettings.parse(ctx.settings)
        E = ctx.stats.num_experts
        if not 1 <= K <= E:
            raise ValueError(f"K={K} out of range; allowed 1 <= K <= E={E}")
        first = check_forced(forced, K, E)
        t0 = time.perf_counter()
        with torch.no_grad():
            loss = LayerLoss(ctx, s.target)
            selected, extras = SEARCHES[self.search](loss, K, first, s)
        extras.update(recon_evals=loss.evals, recon_seconds=time.perf_counter() - t0, recon_tokens=loss.T)
        return Selection([int(e) for e in selected], extras)


# ---- sequential inputs ----------------------------------------------------------------------------------
class _Stop(Exception):
    """Raised by the capture hook: the layers after the one being sampled need not run."""


def _compressed_decision(kept: list[int], k: int, renormalized: bool, scale: float, target: str) -> Callable:
    """decide(p, w, idx) for FamilyAdapter.override_routing: the compressed layer's decision (module docstring)."""

    def decide(p: torch.Tensor, w0: torch.Tensor, idx0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if target == "dense_proxy":
            idx = torch.as_tensor(sorted(kept), dtype=torch.long, device=p.device).expand(
                p.shape[0], len(kept)
            )
            w = torch.full(idx.shape, 1.0 / len(kept), dtype=p.dtype, device=p.device)
        else:
            w, idx = routed_weights(p, kept, k, renormalized)
        return w * scale, idx

    return decide


def sequential_sample(
    model: nn.Module,
    adapter,
    sample: dict[str, torch.Tensor],
    layer: int,
    kept: dict[int, list[int]],
    target: str,
    batch_size: int = 16,
) -> dict[str, torch.Tensor]:
    """`sample` with x and p of `layer` recomputed on the sampled windows with the layers in `kept` compressed
    (Theorem 4.1: each layer's error is measured on the input the already-pruned layers produce, against the
    full layer on that input). The rest of the forward is skipped once `layer`'s router has run."""
    missing = [n for n in ("ids", "mask", "window", "pos") if n not in sample]
    if missing:
        raise ValueError(
            f"token sample lacks {', '.join(missing)}: sequential input re-runs the sampled windows"
        )
    k, renorm, scale = adapter.top_k(model), adapter.renormalized(model), adapter.routed_scaling(model)
    dev = next(model.parameters()).device
    ids, mask, window, pos = sample["ids"], sample["mask"], sample["window"], sample["pos"]
    S = ids.shape[1]
    got: list[tuple[torch.Tensor, torch.Tensor]] = []
    rows: dict[str, torch.Tensor] = {}

    def capture(x: torch.Tensor, p: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> None:
        r = rows["flat"].to(x.device)
        got.append((sample_copy(x[r]), sample_copy(p[r])))
        raise _Stop

    handles = [
        h
        for other, ks in kept.items()
        if other != layer
        for h in adapter.override_routing(
            model, other, _compressed_decision(list(ks), k, renorm, scale, target), list(ks)
        )
    ]
    handles += adapter.hook_routing(model, layer, capture)
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad():
            for w0 in range(0, ids.shape[0], batch_size):
                w1 = min(ids.shape[0], w0 + batch_size)
                mine = (window >= w0) & (window < w1)
                if not bool(mine.any()):
                    continue
                rows["flat"] = (window[mine] - w0) * S + pos[mine]
                try:
                    model(input_ids=ids[w0:w1].to(dev), attention_mask=mask[w0:w1].to(dev), use_cache=False)
                except _Stop:
                    pass
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    return {**sample, "x": torch.cat([x for x, _ in got]), "p": torch.cat([p for _, p in got])}


def layer_inputs(
    raw_settings: dict[str, Any] | None, teacher: tuple[nn.Module, Any] | None
) -> Callable[[int, dict[int, list[int]], dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None:
    """For `input: sequential`, `(layer, kept so far, cached sample) -> the layer's sample` on the compressed
    earlier layers; None for `original`. `teacher`: the resident (model, adapter)."""
    s = ReconSettings.parse(raw_settings)
    if s.input == "original":
        return None
    if teacher is None:
        raise ValueError(
            "settings.input=sequential re-runs the teacher: convert_plans needs teacher=(model, adapter)"
        )
    model, adapter = teacher
    return lambda layer, kept, sample: sequential_sample(model, adapter, sample, layer, kept, s.target)
