"""Expert merging to a smaller MoE: M merged experts per layer, each the frequency-weighted average of a
cluster of the teacher's experts (HC-SMoE, M-SMoE; REAP paper App. B.4). Pure tensor code: no
transformers import. workers.models.outputs.merged_student writes the checkpoint from `merged_layers` (with
the router rule `summed`: workers.models.merged_model; `weighted`, `dominant`: the family adapter's
`merged_moe_student`).

A merged layer's plan (LayerPlan):
- `groups`: the M clusters, ordered by their smallest member id (ascending); inside a cluster the members
  by descending routed-token count ν, ties lower id, so `groups[j][0]` is the cluster's most frequent
  member (its "dominant" expert). Ordering clusters by smallest id keeps DeepSeek's contiguous expert
  groups contiguous whenever every cluster lies inside one group, and makes all-singleton clusters list
  the experts in the order a pruned MoE keeps them (ascending ids).
- `selected`: all clustered experts in that order (cluster 0's members, then cluster 1's, …).
- `scores`: ν_e (len E); `merge_weights`: ν_i / Σ_{cluster} ν (Eq. 15), uniform for a cluster none of
  whose members was ever routed; `alpha`: 1 per cluster (a merged MoE keeps its router's scale).
- `extras["student"]`: {"merge", "router_rows", "permute"}, what shapes the model besides the clusters.

Router rows (`router_rows`). The seed methods are one-shot merges that "sum the gates" of a cluster's
members (the REAP paper's Eq. 3; the REAP repository writes the merged tensor into every member, the official
HC-SMoE code rebinds the member modules, and the Router KD paper §3.5 keeps the router's dimensionality):
- `summed` (the default of both methods): the router keeps all E rows and every member of a cluster computes
  the cluster's merged expert, so a token's selected members of cluster C contribute
  Σ_{i∈C∩S(t)} g_i(t) · f_C(x) = (Σ g_i) f_C(x): the summed gate, exactly, through the family's own routing
  (top-k, renormalisation, group limits and biases unchanged). Written by workers.models.merged_model: a
  registered class storing each cluster once and an E → cluster map;
- `weighted`: a router collapsed to K rows, the members' rows (and per-expert router / score-correction
  biases) averaged with the same frequency weights as the experts (not the seeds' rule: the softmax of an
  averaged row is not the sum of the members' gates);
- `dominant`: a router collapsed to K rows, each the row of the cluster's most frequent member.

M-SMoE's similarity (`similarity`): `logits` (default; MC-SMoE's `router-logits` and the REAP repository's
M-SMoE) is the cosine over the calibration tokens of two experts' raw router logits z_e(t) = w_e · x(t),
from Σ_t z zᵀ = W (Σ_t x xᵀ) Wᵀ (the router's linear map W and the router input's second moment; a router
logit bias, GPT-OSS's, is left out: calibration keeps no Σ_t x); `probabilities` the cosine of the softmax
probabilities p_e(t) (Σ_t p pᵀ). Dominant experts are picked per layer (the original picks them across
layers; an HF config holds one expert count).

Permutation alignment (`permute`): before averaging, each non-dominant member's intermediate units are
permuted to match the cluster's dominant expert (weight matching, Git Re-Basin): the permutation π
maximises Σ_u ⟨w_dom[u], w_member[π(u)]⟩ over the per-unit vectors [gate row; up row; down column;
biases], solved exactly by the Hungarian algorithm. Permuting an expert's units never changes its
function, only which units get averaged together.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from scipy.optimize import linear_sum_assignment

from workers.core.registry import lookup
from workers.core.types import ExpertWeights, LayerContext, LayerPlan, MergedLayer
from workers.methods.clustering import LINKAGES, agglomerate

ROUTER_ROWS = ("summed", "weighted", "dominant")
SIMILARITIES = ("logits", "probabilities")
DISTANCES = ("cosine", "euclidean")


@dataclass(frozen=True)
class Merging:
    """A merging method: `cluster(ctx, K, settings)` → (clusters, pairwise distance [E, E] used, extras);
    `defaults` its settings, `choices` each setting's allowed values. The choices live in the registry entry,
    so a new value changes the code version of the merged conversions only, not of every conversion."""

    name: str
    cluster: Callable[[LayerContext, int, dict], tuple[list[list[int]], torch.Tensor, dict]]
    defaults: dict = field(default_factory=dict)
    doc: str = ""
    choices: dict = field(default_factory=dict)


# ---- distances ---------------------------------------------------------------------------------
def cosine_distance(x: torch.Tensor) -> torch.Tensor:
    """[E, E] 1 − cos(x_i, x_j) of the rows of x (float64). Degenerate rows: two all-zero rows are at
    distance 0 (identical), an all-zero row and a non-zero one at distance 1 (as orthogonal rows)."""
    x = x.detach().to("cpu", torch.float64)
    norm = x.norm(dim=1)
    zero = norm == 0
    unit = x / torch.where(zero, torch.ones_like(norm), norm)[:, None]
    d = (1.0 - unit @ unit.T).clamp(0.0, 2.0)
    d = (d + d.T) / 2  # a matmul is not bitwise symmetric; ties and the clustering need d_ij == d_ji
    d[zero[:, None] & zero[None, :]] = 0.0
    d[zero[:, None] ^ zero[None, :]] = 1.0
    d.fill_diagonal_(0.0)
    return d


def euclidean_distance(x: torch.Tensor) -> torch.Tensor:
    """[E, E] ‖x_i − x_j‖ of the rows of x (float64, exact zeros on the diagonal)."""
    x = x.detach().to("cpu", torch.float64)
    d = (x[:, None, :] - x[None, :, :]).norm(dim=-1)
    d.fill_diagonal_(0.0)
    return d


def router_gate_distance(gram_p: torch.Tensor) -> torch.Tensor:
    """D = 1 − S, S_ij = gram_p[i,j] / sqrt(gram_p[i,i]·gram_p[j,j]): cosine between two experts' router
    values over the calibration tokens, from their Gram matrix (Σ_t p pᵀ of the gates, or Σ_t z zᵀ of the
    raw logits: router_logit_gram). An expert whose values are all 0 (no tokens) has S = 0 to every other
    expert (D = 1) and D = 0 to itself."""
    g = gram_p.detach().to("cpu", torch.float64)
    diag = g.diagonal().clamp(min=0.0).sqrt()
    denom = diag[:, None] * diag[None, :]
    s = torch.where(denom > 0, g / torch.where(denom > 0, denom, torch.ones_like(denom)), torch.zeros_like(g))
    d = (1.0 - s).clamp(0.0, 2.0)
    d = (d + d.T) / 2  # exactly symmetric (see cosine_distance)
    d.fill_diagonal_(0.0)
    return d


def router_logit_gram(router_weight: torch.Tensor, sum_xx: torch.Tensor) -> torch.Tensor:
    """[E, E] Σ_t z(t) z(t)ᵀ of the raw router logits z(t) = W x(t), as W (Σ_t x xᵀ) Wᵀ (float64)."""
    w = router_weight.detach().to("cpu", torch.float64)
    return w @ sum_xx.detach().to("cpu", torch.float64) @ w.T


# ---- HC-SMoE: agglomerative clustering (workers/methods/clustering.py) -----------------------------------
def hc_smoe_cluster(ctx: LayerContext, K: int, settings: dict) -> tuple[list[list[int]], torch.Tensor, dict]:
    """HC-SMoE (Chen et al. 2025; REAP paper App. B.4): representatives A_i = (1/N) Σ_t f_i(t) over every
    calibration token, distance 1 − cos (or Euclidean), agglomerative clustering to K clusters."""
    ctx.stats.require("sum_out")
    n = max(int(ctx.stats.n_tokens), 1)  # no tokens: sum_out is 0, every representative is 0
    reps = ctx.stats.sum_out.detach().to("cpu", torch.float64) / n
    d = cosine_distance(reps) if settings["distance"] == "cosine" else euclidean_distance(reps)
    return (
        agglomerate(d, K, settings["linkage"]),
        d,
        {"distance": settings["distance"], "linkage": settings["linkage"]},
    )


# ---- M-SMoE: dominant experts and their followers -------------------------------------------------
def by_frequency(ids: list[int], nu: torch.Tensor) -> list[int]:
    """`ids` by descending ν, ties lower id first."""
    return sorted(ids, key=lambda e: (-float(nu[e]), e))


def m_smoe_cluster(ctx: LayerContext, K: int, settings: dict) -> tuple[list[list[int]], torch.Tensor, dict]:
    """M-SMoE (merge stage of MC-SMoE, Li et al. 2024; REAP paper App. B.4): the K most frequently routed
    experts are dominant (ties lower id); every other expert joins the dominant expert it is most similar
    to over the calibration tokens (D = 1 − S, ties lower dominant id): by raw router logits (setting
    `similarity: logits`, the default, as MC-SMoE and the REAP repository) or softmax probabilities
    (`probabilities`). Deviation: the original picks the dominant experts globally across layers
    (different counts per layer); an HF config has one expert count, so they are picked per layer."""
    if settings["similarity"] == "logits":
        ctx.stats.require("sum_xx")
        gram = router_logit_gram(ctx.router_weight, ctx.stats.sum_xx)
    else:
        ctx.stats.require("gram_p")
        gram = ctx.stats.gram_p
    nu = ctx.stats.count.detach().to("cpu", torch.float64)
    E = nu.shape[0]
    dominant = sorted(by_frequency(list(range(E)), nu)[:K])
    d = router_gate_distance(gram)
    members: dict[int, list[int]] = {e: [e] for e in dominant}
    dom_idx = torch.tensor(dominant, dtype=torch.long)
    for e in range(E):
        if e not in members:
            row = d[e, dom_idx]
            first = int(torch.nonzero(row == row.min())[0])  # ties: lower dominant id (dominant is sorted)
            members[dominant[first]].append(e)
    return (
        [sorted(members[e]) for e in dominant],
        d,
        {"similarity": f"router_{settings['similarity']}_over_tokens", "dominant": dominant},
    )


MERGINGS: dict[str, Merging] = {
    "HC-SMoE": Merging(
        "HC-SMoE",
        hc_smoe_cluster,
        {"distance": "cosine", "linkage": "average", "permute": False, "router_rows": "summed"},
        "hierarchical clustering of expert outputs over all tokens, frequency-weighted average",
        {"distance": DISTANCES, "linkage": LINKAGES, "permute": (False, True), "router_rows": ROUTER_ROWS},
    ),
    "M-SMoE": Merging(
        "M-SMoE",
        m_smoe_cluster,
        {"permute": True, "router_rows": "summed", "similarity": "logits"},
        "dominant experts by routing frequency, router-logit similarity, aligned weighted average",
        {"permute": (False, True), "router_rows": ROUTER_ROWS, "similarity": SIMILARITIES},
    ),
}


def merge_settings(method: str, settings: dict | None) -> dict:
    """The method's defaults overridden by `settings` (one-line ValueError for unknown names or values)."""
    m = lookup(MERGINGS, method, "merging")
    settings = dict(settings or {})
    unknown = sorted(set(settings) - set(m.defaults))
    if unknown:
        raise ValueError(f"unknown {method} settings {', '.join(unknown)}; allowed: {', '.join(m.defaults)}")
    out = {**m.defaults, **settings}
    for name, value in out.items():
        if not any(value == c and type(value) is type(c) for c in m.choices[name]):
            allowed = ", ".join(map(str, m.choices[name]))
            raise ValueError(f"{method} setting {name}={value!r}; allowed: {allowed}")
    return out


# ---- the plan ------------------------------------------------------------------------------------
def frequency_weights(groups: list[list[int]], nu: torch.Tensor) -> list[list[float]]:
    """w_i = ν_i / Σ_{C} ν (REAP paper App. B.4, Eq. 15); uniform in a cluster never routed."""
    out = []
    for g in groups:
        total = sum(float(nu[e]) for e in g)
        out.append([float(nu[e]) / total for e in g] if total > 0 else [1.0 / len(g)] * len(g))
    return out


def cluster_diagnostics(groups: list[list[int]], d: torch.Tensor) -> dict:
    """singleton_clusters, largest_cluster, mean_intra_distance (mean over all member pairs inside
    clusters of the method's distance; 0 when every cluster is a singleton)."""
    pairs = [float(d[a, b]) for g in groups for i, a in enumerate(g) for b in g[i + 1 :]]
    return {
        "singleton_clusters": sum(len(g) == 1 for g in groups),
        "largest_cluster": max(len(g) for g in groups),
        "mean_intra_distance": sum(pairs) / len(pairs) if pairs else 0.0,
    }


def merge_layer(
    layer: int, ctx: LayerContext, method: str, K: int, settings: dict | None = None
) -> LayerPlan:
    """One layer merged to K experts by `method` (module docstring: plan layout, router rows)."""
    m = lookup(MERGINGS, method, "merging")
    E, k = ctx.stats.num_experts, ctx.top_k
    if not k <= K <= E:
        raise ValueError(f"K={K} out of range; a merged layer keeps k <= K <= E: {k}..{E}")
    s = merge_settings(method, settings)
    nu = ctx.stats.count.detach().to("cpu", torch.float64)
    clusters, d, extras = m.cluster(ctx, K, s)
    groups = sorted((by_frequency(c, nu) for c in clusters), key=min)
    student = {"merge": method, "router_rows": s["router_rows"], "permute": s["permute"]}
    return LayerPlan(
        layer=layer,
        selected=[e for g in groups for e in g],
        scores=nu.tolist(),
        groups=groups,
        merge_weights=frequency_weights(groups, nu),
        alpha=[1.0] * len(groups),
        extras={**extras, **cluster_diagnostics(groups, d), "student": student},
    )


# ---- permutation alignment (weight matching) -------------------------------------------------------
def unit_vectors(ex: ExpertWeights, e: int) -> torch.Tensor:
    """[I, *] per intermediate unit of expert e: its gate row, up row, down column and unit biases."""
    parts = [ex.gate[e], ex.up[e], ex.down[e].T]
    parts += [b[e][:, None] for b in (ex.gate_bias, ex.up_bias) if b is not None]
    return torch.cat([p.detach().to("cpu", torch.float64) for p in parts], dim=1)


def match_units(ex: ExpertWeights, dominant: int, member: int) -> torch.Tensor:
    """π [I] maximising Σ_u ⟨w_dominant[u], w_member[π(u)]⟩ (Git Re-Basin weight matching, exact by
    linear_sum_assignment): the member permuted so that its unit u is its original unit π(u)."""
    sim = unit_vectors(ex, dominant) @ unit_vectors(ex, member).T
    rows, cols = linear_sum_assignment(sim.numpy(), maximize=True)
    return torch.as_tensor(cols[rows.argsort()], dtype=torch.long)


def dominant_member(group: list[int], nu: list[float]) -> int:
    """The member with the largest ν (ties lower id)."""
    return min(group, key=lambda e: (-float(nu[e]), e))


def merged_layers(plans: list[LayerPlan], experts: dict[int, ExpertWeights]) -> dict[int, MergedLayer]:
    """The merged student's input (FamilyAdapter.merged_moe_student for the router rules `weighted` and
    `dominant`, workers.models.merged_model.summed_moe_student for `summed`) from merged plans: clusters,
    frequency weights, router-row rule, dominant members (largest score ν, ties lower id) and, when the plan's
    student asks to permute, each non-dominant member's permutation aligning it to its dominant."""
    out: dict[int, MergedLayer] = {}
    for p in plans:
        student = p.extras.get("student") or {}
        if "router_rows" not in student:
            raise ValueError(
                f"layer {p.layer}: the plan is not a merged-MoE plan (extras['student'] has no router_rows)"
            )
        dominant = [dominant_member(g, p.scores) for g in p.groups]
        perms: dict[int, torch.Tensor] = {}
        if student.get("permute"):
            for g, dom in zip(p.groups, dominant, strict=True):
                perms.update({e: match_units(experts[p.layer], dom, e) for e in g if e != dom})
        out[p.layer] = MergedLayer(
            groups=[list(g) for g in p.groups],
            weights=[list(w) for w in p.merge_weights],
            router_rows=student["router_rows"],
            dominant=dominant,
            perms=perms,
        )
    return out
