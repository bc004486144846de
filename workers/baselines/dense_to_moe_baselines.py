"""The dense → MoE baselines DOT-MoE compares against, built without training: CMoE and LLaMA-MoE-v2
("DOT-MoE: Differentiable Optimal Transport for MoEfication", §2.2.2 and §4.1 "Baselines"). Each splits
the SwiGLU FFN of every layer of a dense model into E experts of s neurons (S of them shared, always on)
from calibration statistics, gives it a top-k router, and is extracted as a real MoE checkpoint
(`model_type: d2m_qwen3_moe`, registered by importing this module).

CMoE (Pei et al. 2025, as its authors' code runs it): layer by layer, each layer seeing the already
converted layers before it, the hidden state of normalised inputs and weights
h = σ(x̂ Ŵ_gateᵀ) ⊙ (x̂ Ŵ_upᵀ) marks per token its K_a largest |h| active; the S·s neurons of highest
activation rate form the shared experts; the others are split into E − S experts of s by balanced
k-means of their activation markers (L1 distance, each round an exact balanced linear assignment;
centroids start at the neurons of highest rate); the neuron nearest its cluster's centroid represents
the expert, and the router scores expert e by |(x ŵ_up,e)·σ(x ŵ_gate,e)| of its representative's
normalised rows, top-k, every chosen expert weighted 1 (training-free: its learnable scale starts at 0).

LLaMA-MoE-v2 (Qu et al. 2024, its code's "Gradient Split Plus"): per layer, k-means of the MLP inputs
into E − S clusters with sizes within 1 ± jitter of equal gives the router (the centroids); a token
belongs to the cluster of largest x·c; a neuron's importance for a cluster is the mean over its tokens
of |h · ∂L/∂h| (L: the dense model's LM loss); the S·s neurons important to most clusters form the
residual (shared) expert, the others go greedily by descending importance to the clusters that value
them, s each; the router weights its top-k by the softmax renormalised over them, times a scale.

Not stated by DOT-MoE, chosen here (workers.baselines.dot_moe_spec.D2mBaselineSpec holds each):
- calibration: the sweep's dot_moe data (DOT-MoE §4.1: the same Dolmino-mix sample for every method).
- CMoE: 8 windows of 2,048 tokens, K_a = 10, one k-means round: its code's run script and defaults.
- CMoE's Jonker-Volgenant solver (lap.lapjv) is scipy's exact linear_sum_assignment: the same optimum.
- LLaMA-MoE-v2: 256 windows for the gradients, the router's k-means on 80 (≤ 16,384 tokens): its scripts.
- LLaMA-MoE-v2's size-bounded k-means (min-cost flow) is a greedy bounded assignment with k-means++ starts.
- LLaMA-MoE-v2 with S shared: E − S clusters, and scale E/k without shared experts, 1 with (its scripts).
- LLaMA-MoE-v2's released 8top2 used a sequential split and random router; DOT-MoE names the act./grad. one.
- no fine-tuning, post-training or hidden-distribution alignment of any method (DOT-MoE Table 2's 1.2B).

The numerics are functions of tensors (`cmoe_*`, `atopk_markers`, `balanced_assignment`,
`balanced_kmeans`, `residual_neurons`, `importance_split`, `split_ffn`); `install_baseline`, `construct`
and `extract_baseline` are what workers.baselines.dot_moe's install / align / extract hand the baseline
methods to.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from scipy.optimize import linear_sum_assignment
from torch import nn
from torch.nn import functional as F
from transformers import AutoConfig, AutoModelForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.activations import ACT2FN
from transformers.models.qwen3_moe.modeling_qwen3_moe import (
    Qwen3MoeExperts,
    Qwen3MoeMLP,
    Qwen3MoeTopKRouter,
)

from workers.baselines.dense_ffn import copied_config, padded_ffn
from workers.baselines.dot_moe_spec import (
    BASELINES,
    COMBINES,
    SUPPORTED,
    D2mBaselineSpec,
    DotMoeSpec,
)
from workers.methods.sinkhorn import greedy_round

MODEL_TYPE = "d2m_qwen3_moe"
ROUTERS = ("linear", "cmoe")  # x Wᵀ (LLaMA-MoE-v2); |(x Ŵ_upᵀ) ⊙ σ(x Ŵ_gateᵀ)| of representatives (CMoE)
ROUTER_OF = {"cmoe": "cmoe", "llama_moe_v2": "linear"}


# ---- the checkpoint class ----------------------------------------------------------------------------
class D2mQwen3MoeConfig(Qwen3MoeConfig):
    """Qwen3-MoE config plus a shared expert of `shared_intermediate_size` neurons (0: none), the router's
    form, its combine rule and routed-output scale, and where the MoE came from. `num_experts` counts the
    routed experts; E = num_experts + d2m_shared_experts."""

    model_type = MODEL_TYPE

    def __init__(
        self,
        d2m_method: str | None = None,
        d2m_source_model_type: str | None = None,
        d2m_shared_experts: int = 0,
        router_kind: str = "linear",
        moe_combine: str = "unit",
        routed_scale: float = 1.0,
        shared_intermediate_size: int = 0,
        **kwargs,
    ) -> None:
        if router_kind not in ROUTERS:
            raise ValueError(f"router_kind={router_kind!r}; allowed: {', '.join(ROUTERS)}")
        if moe_combine not in COMBINES:
            raise ValueError(f"moe_combine={moe_combine!r}; allowed: {', '.join(COMBINES)}")
        self.d2m_method = d2m_method
        self.d2m_source_model_type = d2m_source_model_type
        self.d2m_shared_experts = d2m_shared_experts
        self.router_kind = router_kind
        self.moe_combine = moe_combine
        self.routed_scale = float(routed_scale)
        self.shared_intermediate_size = shared_intermediate_size
        kwargs["norm_topk_prob"] = moe_combine == "renorm_prob"
        super().__init__(**kwargs)


class D2mRouter(Qwen3MoeTopKRouter):
    """Top-k router over the routed experts; `top_k` may be changed at run time (workers.models.dot_moe_hf's
    set_top_k). `weight` holds x Wᵀ's rows, or CMoE's normalised W_up rows of the representatives with
    `gate_weight` their normalised W_gate rows."""

    def __init__(self, config: D2mQwen3MoeConfig) -> None:
        super().__init__(config)
        self.kind = config.router_kind
        self.combine = config.moe_combine
        self.scale = config.routed_scale
        self.act_fn = ACT2FN[config.hidden_act]
        if self.kind == "cmoe":
            self.gate_weight = nn.Parameter(torch.zeros(self.num_experts, self.hidden_dim))

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "cmoe":
            return cmoe_scores(x, self.weight, self.gate_weight, self.act_fn)
        return F.linear(x, self.weight)

    def forward(self, hidden_states: torch.Tensor):
        x = hidden_states.reshape(-1, self.hidden_dim)
        logits = self.scores(x)
        probs = logits.softmax(dim=-1, dtype=torch.float)
        top, idx = torch.topk(probs, self.top_k, dim=-1)
        if self.combine == "unit":
            top = torch.ones_like(top)
        elif self.combine == "renorm_prob":
            top = top / top.sum(dim=-1, keepdim=True)
        return logits, (top * self.scale).to(logits.dtype), idx


class D2mSparseMoeBlock(nn.Module):
    """Routed experts (Qwen3-MoE's fused layout) plus an always-on shared expert."""

    def __init__(self, config: D2mQwen3MoeConfig) -> None:
        super().__init__()
        self.experts = Qwen3MoeExperts(config)
        self.gate = D2mRouter(config)
        width = config.shared_intermediate_size
        self.shared_expert = Qwen3MoeMLP(config, intermediate_size=width) if width else None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        _, weights, idx = self.gate(x)
        out = self.experts(x, idx, weights)
        if self.shared_expert is not None:
            out = out + self.shared_expert(x)
        return out.reshape(shape)


class D2mQwen3MoeForCausalLM(Qwen3MoeForCausalLM):
    config_class = D2mQwen3MoeConfig

    def __init__(self, config: D2mQwen3MoeConfig) -> None:
        super().__init__(config)
        for layer in self.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp = D2mSparseMoeBlock(config)
        self.post_init()


AutoConfig.register(MODEL_TYPE, D2mQwen3MoeConfig, exist_ok=True)
AutoModelForCausalLM.register(D2mQwen3MoeConfig, D2mQwen3MoeForCausalLM, exist_ok=True)


# ---- splitting one FFN ------------------------------------------------------------------------------
def split_ffn(
    gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, owner: list[int], routed: int
) -> dict[str, torch.Tensor]:
    """A D2mSparseMoeBlock's expert tensors from W_gate, W_up [n, H] and W_down [H, n] (nn.Linear
    layouts): routed expert e holds the neurons with owner e, the shared expert those with owner -1."""
    n = gate.shape[0]
    own = torch.tensor(owner, dtype=torch.long, device=gate.device)
    if own.shape != (n,) or bool(((own < -1) | (own >= routed)).any()):
        raise ValueError(f"owner: need {n} entries in -1 (shared) .. {routed - 1}")
    members = [torch.nonzero(own == e).flatten() for e in range(routed)]
    if len({m.numel() for m in members}) != 1 or members[0].numel() == 0:
        raise ValueError(f"owner: the {routed} routed experts must be non-empty and of one size")
    out = {
        "experts.gate_up_proj": torch.stack([torch.cat([gate[c], up[c]]) for c in members]),
        "experts.down_proj": torch.stack([down[:, c] for c in members]),
    }
    shared = torch.nonzero(own == -1).flatten()
    if shared.numel():
        out["shared_expert.gate_proj.weight"] = gate[shared]
        out["shared_expert.up_proj.weight"] = up[shared]
        out["shared_expert.down_proj.weight"] = down[:, shared]
    return out


# ---- CMoE --------------------------------------------------------------------------------------------
def cmoe_hidden(
    x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """h [T, n] = σ(x̂ Ŵ_gateᵀ) ⊙ (x̂ Ŵ_upᵀ): tokens and weight rows L2-normalised (CMoE's code)."""
    xn = F.normalize(x, dim=-1)
    return act(xn @ F.normalize(w_gate, dim=1).T) * (xn @ F.normalize(w_up, dim=1).T)


def atopk_markers(h: torch.Tensor, k: int) -> torch.Tensor:
    """a [T, n]: 1 where the neuron is among the token's k largest |h|, else 0 (CMoE's ATopK)."""
    if not 1 <= k <= h.shape[-1]:
        raise ValueError(f"k_act={k}: need 1 <= K_a <= {h.shape[-1]} neurons")
    return torch.zeros_like(h).scatter_(-1, h.abs().topk(k, dim=-1).indices, 1.0)


def l1_to(points: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """L1 distances [N, C] of 0/1 points [N, T] to centroids [C, T] with entries in [0, 1]
    (|a − c| = a + c − 2ac for a ∈ {0, 1})."""
    return points.sum(1, keepdim=True) + centroids.sum(1)[None, :] - 2 * points @ centroids.T


def balanced_assignment(cost: torch.Tensor, size: int) -> torch.Tensor:
    """The cluster [N] of each of N = C·size items, `size` per cluster, at the least total cost [N, C]:
    the exact linear assignment of the items to `size` copies of every cluster (CMoE's code solves the same
    problem with Jonker-Volgenant)."""
    n, c = cost.shape
    if n != c * size:
        raise ValueError(f"{n} items into {c} clusters of {size}: need items = clusters × size")
    rows, cols = linear_sum_assignment(cost.detach().repeat_interleave(size, dim=1).double().cpu().numpy())
    out = torch.empty(n, dtype=torch.long)
    out[torch.as_tensor(rows)] = torch.as_tensor(cols) // size
    return out.to(cost.device)


def cmoe_partition(
    markers: torch.Tensor, shared: int, routed: int, width: int, iters: int = 1
) -> tuple[list[int], list[int]]:
    """(owner, representatives) from activation markers [T, n] (CMoE's code): the shared·width neurons of
    highest activation rate (ties: lower index) are the shared experts (owner -1); the rest go to `routed`
    experts of `width` by balanced k-means of their marker columns, L1 distance, centroids started at the
    neurons of highest rate, `iters` rounds of exact balanced assignment and mean update (stopping when
    nothing moves); each expert's representative is its member nearest its centroid (ties: lower index)."""
    n = markers.shape[1]
    if n != (shared + routed) * width:
        raise ValueError(f"{n} neurons: need (shared {shared} + routed {routed}) × width {width}")
    rates = markers.double().mean(0)
    is_shared = torch.zeros(n, dtype=torch.bool, device=markers.device)
    is_shared[torch.sort(rates, descending=True, stable=True).indices[: shared * width]] = True
    rest = torch.nonzero(~is_shared).flatten()
    points = markers[:, rest].T.double()
    centroids = points[torch.sort(rates[rest], descending=True, stable=True).indices[:routed]].clone()
    assign: torch.Tensor | None = None
    for _ in range(iters):
        new = balanced_assignment(l1_to(points, centroids), width)
        if assign is not None and torch.equal(new, assign):  # exact: integer cluster ids
            break
        assign = new
        centroids = torch.stack([points[assign == c].mean(0) for c in range(routed)])
    assert assign is not None
    owner = torch.full((n,), -1, dtype=torch.long, device=markers.device)
    reps = []
    for c in range(routed):
        members = torch.nonzero(assign == c).flatten()
        owner[rest[members]] = c
        reps.append(int(rest[members[l1_to(points[members], centroids[c : c + 1]).flatten().argmin()]]))
    return owner.tolist(), reps


def cmoe_router(
    w_gate: torch.Tensor, w_up: torch.Tensor, reps: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """CMoE's training-free router (its code's Router): the representatives' W_up and W_gate rows,
    L2-normalised."""
    return F.normalize(w_up[reps], dim=1), F.normalize(w_gate[reps], dim=1)


def cmoe_scores(
    x: torch.Tensor,
    up_rows: torch.Tensor,
    gate_rows: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Expert scores [T, E − S] = |(x ŵ_upᵀ) ⊙ σ(x ŵ_gateᵀ)|: the representatives' activations (CMoE's
    Router.forward)."""
    return (F.linear(x, up_rows) * act(F.linear(x, gate_rows))).abs()


# ---- LLaMA-MoE-v2 -----------------------------------------------------------------------------------
def kmeans_plusplus(x: torch.Tensor, k: int, gen: torch.Generator) -> torch.Tensor:
    """k starting centres [k, H] by k-means++ seeding (seeded by `gen`, a CPU generator)."""
    n = x.shape[0]
    pick = [int(torch.randint(n, (1,), generator=gen))]
    d2 = (x - x[pick[0]]).pow(2).sum(1)
    for _ in range(1, k):
        total = float(d2.sum())
        p = (d2 / total if total > 0 else torch.ones_like(d2)).double().cpu()
        pick.append(int(torch.multinomial(p, 1, generator=gen)))
        d2 = torch.minimum(d2, (x - x[pick[-1]]).pow(2).sum(1))
    return x[pick].clone()


def bounded_assignment(dist: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Each row's cluster [N] with every cluster size in [lo, hi]: the nearest centre, then a cluster over
    `hi` moves the members that lose least to their nearest centre with room, and one under `lo` takes the
    tokens that lose least from clusters above `lo` (greedy; k-means-constrained solves it as min-cost
    flow)."""
    n, k = dist.shape
    if not 0 <= lo <= n / k <= hi:
        raise ValueError(f"sizes [{lo}, {hi}] for {n} items in {k} clusters: need lo <= items/k <= hi")
    a = dist.argmin(1)
    for _ in range(2 * k + 1):  # each pass fills one cluster to `hi` or to `lo` for good
        sizes = torch.bincount(a, minlength=k)
        over = torch.nonzero(sizes > hi).flatten()
        if over.numel():
            c = int(over[0])
            room = sizes < hi
            room[c] = False
            members = torch.nonzero(a == c).flatten()
            alt_cost, alt = dist[members].masked_fill(~room[None, :], math.inf).min(1)
            move = torch.sort(alt_cost - dist[members, c], stable=True).indices[: int(sizes[c]) - hi]
            a[members[move]] = alt[move]
            continue
        under = torch.nonzero(sizes < lo).flatten()
        if not under.numel():
            return a
        c = int(under[0])
        spare = (sizes - lo).clamp(min=0)
        spare[c] = 0
        cand = torch.nonzero(spare[a] > 0).flatten()
        need = lo - int(sizes[c])
        for t in cand[torch.sort(dist[cand, c] - dist[cand, a[cand]], stable=True).indices].tolist():
            if need == 0:
                break
            if spare[a[t]] > 0:
                spare[a[t]] -= 1
                a[t] = c
                need -= 1
    raise RuntimeError("bounded_assignment did not settle")  # unreachable: see the pass count


def balanced_kmeans(
    x: torch.Tensor, k: int, jitter: float, iters: int, restarts: int, gen: torch.Generator
) -> torch.Tensor:
    """Centres [k, H] of k-means (squared L2) with cluster sizes within (1 ± jitter)·N/k (LLaMA-MoE-v2's
    router initialisation): k-means++ starts, `iters` rounds of bounded assignment and mean update
    (stopping when nothing moves); the best of `restarts` runs by inertia."""
    n = x.shape[0]
    if n < k:
        raise ValueError(f"{n} tokens for {k} clusters: need at least one token per cluster")
    lo, hi = math.floor(n / k * (1 - jitter)), math.ceil(n / k * (1 + jitter))
    best, best_cost = None, math.inf
    for _ in range(restarts):
        c = kmeans_plusplus(x, k, gen)
        a: torch.Tensor | None = None
        for _ in range(iters):
            new = bounded_assignment(torch.cdist(x, c).pow(2), lo, hi)
            if a is not None and torch.equal(new, a):  # exact: integer cluster ids
                break
            a = new
            c = torch.stack([x[a == j].mean(0) if bool((a == j).any()) else c[j] for j in range(k)])
        assert a is not None
        cost = float((x - c[a]).pow(2).sum())
        if cost < best_cost:
            best, best_cost = c, cost
    assert best is not None
    return best


def cluster_of(x: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """Each token's cluster: the centre of largest x·c (as LLaMA-MoE-v2 classifies tokens)."""
    return (x @ centroids.T).argmax(-1)


def add_importance(
    scores: torch.Tensor, counts: torch.Tensor, h: torch.Tensor, grad: torch.Tensor, clusters: torch.Tensor
) -> None:
    """scores[c] += Σ over cluster c's tokens of |h ⊙ ∂L/∂h| [n]; counts[c] += its tokens (in place)."""
    hot = F.one_hot(clusters, scores.shape[0]).to(scores.dtype)
    scores[:, : h.shape[-1]] += hot.T @ (h * grad).abs().to(scores.dtype)
    counts += hot.sum(0)


def residual_neurons(scores: torch.Tensor, count: int, width: int) -> list[int]:
    """The `count` neurons of the residual (shared) expert from importance scores [C, n] (LLaMA-MoE-v2's
    residual split): every cluster proposes its `width` most important neurons not yet taken; the neurons
    proposed by the most clusters (ascending index) join, up to `count`; repeat."""
    n = scores.shape[1]
    lists = [torch.sort(row, descending=True, stable=True).indices for row in scores]
    taken = torch.zeros(n, dtype=torch.bool, device=scores.device)
    out: list[int] = []
    while len(out) < count:
        times = torch.bincount(torch.cat([lst[:width] for lst in lists]), minlength=n)
        hit = torch.nonzero(times == times.max()).flatten()[: count - len(out)]
        out += hit.tolist()
        taken[hit] = True
        lists = [lst[~taken[lst]] for lst in lists]
    return out


def importance_split(scores: torch.Tensor, width: int, exclude: Iterable[int] = ()) -> list[int]:
    """owner [n]: the neurons not excluded (owner -1) go to the C clusters, `width` each, greedily by
    descending importance (LLaMA-MoE-v2's split without neuron sharing: each step the largest remaining
    (cluster, neuron) score whose neuron is free and cluster not full:
    workers.methods.sinkhorn.greedy_round)."""
    c, n = scores.shape
    keep = torch.ones(n, dtype=torch.bool)
    keep[list(exclude)] = False
    idx = torch.nonzero(keep).flatten()
    owner = torch.full((n,), -1, dtype=torch.long)
    owner[idx] = torch.tensor(greedy_round(scores[:, idx.to(scores.device)].T, [width] * c))
    return owner.tolist()


def llama_moe_v2_partition(scores: torch.Tensor, shared: int, width: int) -> list[int]:
    """owner [n] from importance scores [E − S, n]: S·width residual neurons (owner -1), the rest split."""
    return importance_split(scores, width, residual_neurons(scores, shared * width, width) if shared else ())


# ---- converting a dense model ----------------------------------------------------------------------------
class D2mFFN(nn.Module):
    """One dense FFN a baseline converts: the dense FFN (whose hidden state `tap`, when set, sees) until
    `build` gives it its MoE block."""

    def __init__(self, mlp: nn.Module, config: D2mQwen3MoeConfig, method: str, experts: int, top_k: int):
        super().__init__()
        self.mlp = mlp
        for p in mlp.parameters():
            p.requires_grad_(False)
        self.config = config
        self.method, self.experts, self.top_k = method, experts, top_k
        self.shared = config.d2m_shared_experts
        self.routed = experts - self.shared
        self.d = mlp.gate_proj.out_features
        self.s = config.moe_intermediate_size
        self.n = self.s * experts  # neurons including the zero padding
        self.block: D2mSparseMoeBlock | None = None
        self.tap: Callable[[torch.Tensor, torch.Tensor], None] | None = None
        self._owner: list[int] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.block is not None:
            return self.block(x)
        m = self.mlp
        h = m.act_fn(m.gate_proj(x)) * m.up_proj(x)
        if self.tap is not None:
            self.tap(x, h)
        return m.down_proj(h)

    def weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """W_gate, W_up [n, H] and W_down [H, n], padded to n = E·s with zero neurons (each adds exactly 0)."""
        return padded_ffn(self.mlp, self.n)

    def build(self, owner: list[int], router: dict[str, torch.Tensor]) -> None:
        """The MoE block of this partition (owner -1: shared) and router tensors; the forward uses it."""
        gate, up, down = self.weights()
        block = D2mSparseMoeBlock(self.config)
        tensors = {**split_ffn(gate, up, down, owner, self.routed), **router}
        block.load_state_dict({k: v.to(gate.dtype) for k, v in tensors.items()}, strict=True)
        self.block = block.to(device=gate.device, dtype=gate.dtype).eval()
        self._owner = list(owner)

    def owner(self) -> list[int]:
        """Each neuron's routed expert, -1 for the shared experts (padding neurons included)."""
        if self._owner is None:
            raise ValueError(f"{self.method}: the layer is not converted yet (run construct first)")
        return list(self._owner)

    def trainable(self) -> list[nn.Parameter]:
        return []


def baseline_config(
    dense_config: Any,
    method: str,
    experts: int,
    shared: int,
    top_k: int,
    width: int,
    combine: str,
    scale: float,
) -> D2mQwen3MoeConfig:
    """The extracted MoE's config: the dense model's attention, norms and embeddings; E − S routed experts
    of width s, top-k, and S·s shared neurons."""
    kw = copied_config(dense_config)
    return D2mQwen3MoeConfig(
        d2m_method=method,
        d2m_source_model_type=dense_config.model_type,
        d2m_shared_experts=shared,
        router_kind=ROUTER_OF[method],
        moe_combine=combine,
        routed_scale=scale,
        shared_intermediate_size=shared * width,
        num_experts=experts - shared,
        num_experts_per_tok=top_k,
        moe_intermediate_size=width,
        intermediate_size=width * experts,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        use_sliding_window=False,
        output_router_logits=False,
        **kw,
    )


def install_baseline(
    model: nn.Module, experts: int, top_k: int, method: str, spec: DotMoeSpec
) -> list[D2mFFN]:
    """Wrap every dense FFN of `model` (in place, everything frozen) for `method`; the shared experts and
    routed-output scale come from `spec.baseline`, the combine rule from `spec.combine`."""
    if method not in BASELINES:
        raise ValueError(f"baseline {method!r}; allowed: {', '.join(BASELINES)}")
    mt = getattr(model.config, "model_type", None)
    if mt not in SUPPORTED:
        raise ValueError(
            f"{method}: dense model_type {mt!r} ({type(model).__name__}) is not supported; "
            f"supported: {', '.join(SUPPORTED)}"
        )
    if getattr(model.config, "use_sliding_window", False):
        raise ValueError(f"{method}: a dense model with sliding-window layers is not supported")
    b = D2mBaselineSpec(**(spec.baseline or {}))
    routed = experts - b.shared
    if not 1 <= top_k <= routed:
        raise ValueError(
            f"top_k={top_k}: need 1 <= top_k <= {routed} routed experts (E={experts}, S={b.shared})"
        )
    mlps = [layer.mlp for layer in model.model.layers]
    d = mlps[0].gate_proj.out_features
    if not 1 <= experts <= d:
        raise ValueError(f"experts={experts}: need 1 <= E <= d_ffn={d}")
    width = math.ceil(d / experts)
    scale = 1.0 if b.scale_factor is None else b.scale_factor
    config = baseline_config(model.config, method, experts, b.shared, top_k, width, spec.combine, scale)
    config._experts_implementation = "eager"  # the blocks run inside the dense model while it is converted
    for p in model.parameters():
        p.requires_grad_(False)
    ffns = []
    for layer, mlp in zip(model.model.layers, mlps, strict=True):
        ffn = D2mFFN(mlp, config, method, experts, top_k)
        layer.mlp = ffn
        ffns.append(ffn)
    return ffns


class _Stop(Exception):
    """Ends a forward once the layer of interest has seen its input."""


def _mlp_inputs(model: nn.Module, ffn: D2mFFN, windows: list[torch.Tensor]) -> torch.Tensor:
    """The FFN's inputs [T, H] over the calibration windows, through the model as it is now (the layers
    before it already converted); the forward stops at the FFN."""
    xs: list[torch.Tensor] = []

    def grab(module: nn.Module, args: tuple) -> None:
        xs.append(args[0].reshape(-1, args[0].shape[-1]).detach())
        raise _Stop

    hook = ffn.register_forward_pre_hook(grab)
    try:
        with torch.no_grad():
            for ids in windows:
                try:
                    model(input_ids=ids, use_cache=False)
                except _Stop:
                    pass
    finally:
        hook.remove()
    return torch.cat(xs)


def _build_cmoe(
    model: nn.Module, ffns: list[D2mFFN], windows: list[torch.Tensor], b: D2mBaselineSpec, progress
) -> None:
    """CMoE, one layer after the other: each sees the converted layers before it (its code's order)."""
    for i, f in enumerate(ffns):
        x = _mlp_inputs(model, f, windows).float()
        gate, up, _ = f.weights()
        h = cmoe_hidden(x, gate.float(), up.float(), f.mlp.act_fn)
        owner, reps = cmoe_partition(atopk_markers(h, b.k_act), f.shared, f.routed, f.s, b.cmoe_iters)
        del x, h
        up_rows, gate_rows = cmoe_router(gate.float(), up.float(), reps)
        f.build(owner, {"gate.weight": up_rows, "gate.gate_weight": gate_rows})
        if progress is not None:
            progress(i + 1, len(ffns))


def router_centroids(
    model: nn.Module,
    ffns: list[D2mFFN],
    windows: list[torch.Tensor],
    b: D2mBaselineSpec,
    gen: torch.Generator,
) -> list[torch.Tensor]:
    """Per layer the LLaMA-MoE-v2 router [E − S, H]: centres of the bounded k-means of the dense model's MLP
    inputs over the first `kmeans_sequences` windows (a seeded subsample of `kmeans_tokens` tokens)."""
    first: list[torch.Tensor] = []
    left = b.kmeans_sequences
    for ids in windows:
        if left <= 0:
            break
        first.append(ids[:left])
        left -= len(first[-1])
    total = sum(ids.numel() for ids in first)
    chosen = torch.sort(torch.randperm(total, generator=gen)[: b.kmeans_tokens]).values
    feats: list[list[torch.Tensor]] = [[] for _ in ffns]
    state = {"rows": chosen}

    def keep(i: int) -> Callable[[torch.Tensor, torch.Tensor], None]:
        def tap(x: torch.Tensor, h: torch.Tensor) -> None:
            flat = x.reshape(-1, x.shape[-1])
            feats[i].append(flat[state["rows"].to(flat.device)].float().cpu())

        return tap

    for i, f in enumerate(ffns):
        f.tap = keep(i)
    try:
        with torch.no_grad():
            start = 0
            for ids in first:
                state["rows"] = chosen[(chosen >= start) & (chosen < start + ids.numel())] - start
                model(input_ids=ids, use_cache=False)
                start += ids.numel()
    finally:
        for f in ffns:
            f.tap = None
    dev = next(model.parameters()).device
    return [
        balanced_kmeans(torch.cat(fs).to(dev), f.routed, b.jitter, b.kmeans_iters, b.kmeans_restarts, gen)
        for fs, f in zip(feats, ffns, strict=True)
    ]


def importance(
    model: nn.Module, ffns: list[D2mFFN], centroids: list[torch.Tensor], windows: list[torch.Tensor]
) -> list[torch.Tensor]:
    """Per layer the importance [E − S, n] of every neuron for every cluster: the mean over the cluster's
    tokens (largest x·c) of |h · ∂L/∂h|, L the dense model's LM loss on each window (LLaMA-MoE-v2)."""
    dev = next(model.parameters()).device
    scores = [torch.zeros(f.routed, f.n, device=dev) for f in ffns]
    counts = [torch.zeros(f.routed, device=dev) for f in ffns]

    def measure(i: int) -> Callable[[torch.Tensor, torch.Tensor], None]:
        def tap(x: torch.Tensor, h: torch.Tensor) -> None:
            clusters = cluster_of(x.reshape(-1, x.shape[-1]).float().detach(), centroids[i])
            flat = h.detach().reshape(-1, h.shape[-1])
            h.register_hook(
                lambda g: add_importance(scores[i], counts[i], flat, g.reshape(flat.shape), clusters)
            )

        return tap

    embed = model.get_input_embeddings().register_forward_hook(lambda m, a, out: out.requires_grad_(True))
    for i, f in enumerate(ffns):
        f.tap = measure(i)
    try:
        for ids in windows:
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    finally:
        embed.remove()
        for f in ffns:
            f.tap = None
    return [s / c.clamp(min=1)[:, None] for s, c in zip(scores, counts, strict=True)]


def _build_llama_moe_v2(
    model: nn.Module, ffns: list[D2mFFN], windows: list[torch.Tensor], b: D2mBaselineSpec, progress
) -> None:
    """LLaMA-MoE-v2 on the dense model: the routers, the importance, then each layer's split."""
    centroids = router_centroids(model, ffns, windows, b, torch.Generator().manual_seed(b.seed))
    for i, (f, mean) in enumerate(zip(ffns, importance(model, ffns, centroids, windows), strict=True)):
        f.build(llama_moe_v2_partition(mean, f.shared, f.s), {"gate.weight": centroids[i]})
        if progress is not None:
            progress(i + 1, len(ffns))


def construct(
    model: nn.Module,
    ffns: list[D2mFFN],
    batches: Iterable[torch.Tensor],
    spec: DotMoeSpec,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Build every layer's MoE block from the first `calib_sequences` windows of `batches` (nothing is
    trained). Returns what workers.baselines.dot_moe.align returns: an empty curve, the calibration
    batches read as `steps`, no trained parameters."""
    f0 = ffns[0]
    b = D2mBaselineSpec(**(spec.baseline or {})).resolved(f0.method, f0.experts, f0.top_k)
    assert b.calib_sequences is not None
    dev = next(model.parameters()).device
    windows: list[torch.Tensor] = []
    seen = 0
    for ids in batches:
        windows.append(ids[: b.calib_sequences - seen].to(dev))
        seen += len(windows[-1])
        if seen >= b.calib_sequences:
            break
    if not windows:
        raise ValueError(f"{f0.method}: no calibration windows")
    model.eval()
    if f0.method == "cmoe":
        _build_cmoe(model, ffns, windows, b, progress)
    else:
        _build_llama_moe_v2(model, ffns, windows, b, progress)
    return {"curve": [], "steps": len(windows), "trainable_params": 0}


def extract_baseline(model: nn.Module, ffns: list[D2mFFN]) -> nn.Module:
    """The converted model as a D2mQwen3MoeForCausalLM: the dense model's attention, norms and
    embeddings, every layer's built MoE block."""
    f0 = ffns[0]
    dtype = f0.mlp.gate_proj.weight.dtype
    moe = D2mQwen3MoeForCausalLM(copy.deepcopy(f0.config)).to(dtype)
    state = {k: v for k, v in model.state_dict().items() if ".mlp." not in k}
    for i, f in enumerate(ffns):
        if f.block is None:
            raise ValueError(f"{f.method}: layer {i} is not converted (run construct first)")
        for k, v in f.block.state_dict().items():
            state[f"model.layers.{i}.mlp.{k}"] = v
    moe.load_state_dict(state, strict=True)
    return moe.to(f0.mlp.gate_proj.weight.device).eval()
