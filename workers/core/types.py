"""Plain data passed between the pieces of the pipeline.

These dataclasses are the contract between the family adapters (which know transformers), the
numerics (scoring, grouping, merging: pure tensors) and the orchestrator (which stores them).
Everything here is family-free: an adapter translates its model into these shapes.

Shapes use E = routed experts, I = expert intermediate width, H = hidden size, k = router top-k,
K = experts kept.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch


@dataclass
class ExpertWeights:
    """The routed experts of one MoE layer in one canonical layout (views, not copies, when possible).

    Routed with weight w: w·f_e(h), or f_e(w·h) where `input_scaled` (no biases then: f_e(0) = 0).
    f_e(h) = down[e] @ act(gate[e] @ h + gate_bias[e], up[e] @ h + up_bias[e]) + down_bias[e]
    act="silu":   act(g, u) = silu(g) * u
    act="gptoss": act(g, u) = (clamp(u, -limit, limit) + 1) * clamp(g, max=limit) * sigmoid(alpha * clamp(g, max=limit))
    """

    gate: torch.Tensor  # [E, I, H]
    up: torch.Tensor  # [E, I, H]
    down: torch.Tensor  # [E, H, I]
    gate_bias: torch.Tensor | None = None  # [E, I]
    up_bias: torch.Tensor | None = None  # [E, I]
    down_bias: torch.Tensor | None = None  # [E, H]
    act: str = "silu"
    act_alpha: float = 1.702  # gptoss only
    act_limit: float = 7.0  # gptoss only
    # the router's weight multiplies the expert's input, f_e(w·x), not its output (Llama-4)
    input_scaled: bool = False

    @property
    def num_experts(self) -> int:
        return self.gate.shape[0]

    @property
    def intermediate(self) -> int:
        return self.gate.shape[1]

    @property
    def hidden(self) -> int:
        return self.gate.shape[2]


@dataclass
class DenseFFN:
    """One dense FFN in the same convention as ExpertWeights, without the expert axis.

    y = down @ act(gate @ h + gate_bias, up @ h + up_bias) + down_bias
    """

    gate: torch.Tensor  # [D, H]
    up: torch.Tensor  # [D, H]
    down: torch.Tensor  # [H, D]
    gate_bias: torch.Tensor | None = None  # [D]
    up_bias: torch.Tensor | None = None  # [D]
    down_bias: torch.Tensor | None = None  # [H]
    act: str = "silu"
    act_alpha: float = 1.702
    act_limit: float = 7.0

    @property
    def width(self) -> int:
        return self.gate.shape[0]


# Token samples beside the sums (calibration.sample_tokens > 0): per layer the sampled tokens' block inputs
# x [T, H] and router probabilities p [T, E] (keys `layer.<i>.sample_x`, `layer.<i>.sample_p`), and once per
# file where they came from (keys `sample.<name>`): the windows' token ids and attention masks [W, S] and, per
# sampled token, its window row and position [T]. Every layer samples the same token positions.
SAMPLE_LAYER = ("x", "p")
SAMPLE_SHARED = ("ids", "mask", "window", "pos")

# Every tensor of LayerStats, in file order.
STATS_TENSORS = (
    "count",
    "sum_p",
    "sum_p_sel",
    "sum_sq",
    "sum_gnorm_sel",
    "sum_norm_sel",
    "gram",
    "sum_pnorm_sel",
    "max_norm_sel",
    "sum_out",
    "gram_p",
    "sum_xx",
)
# Statistics only some families have (written and read when present; older files simply lack them).
FAMILY_STATS = ("sum_shared_gate",)


@dataclass
class LayerStats:
    """Sufficient statistics of one MoE layer over N calibration tokens.

    All sums are float64 over real (non-padding) tokens. p is the softmax over all E router
    logits; "selected"/"routed" means e is in the top-k set the router really used; g is the
    routing weight the model really applied to that expert on that token.
    """

    n_tokens: int
    count: torch.Tensor  # [E] number of tokens where e was selected
    sum_p: torch.Tensor  # [E] Σ_t p_e(t) over all tokens
    sum_p_sel: torch.Tensor  # [E] Σ_{t: e∈S(t)} p_e(t)
    sum_sq: torch.Tensor  # [E] Σ_t ‖f_e(t)‖² over all tokens
    sum_gnorm_sel: torch.Tensor  # [E] Σ_{t: e∈S(t)} g_e(t)·‖f_e(t)‖   (REAP numerator)
    sum_norm_sel: torch.Tensor  # [E] Σ_{t: e∈S(t)} ‖f_e(t)‖          (EAN)
    gram: torch.Tensor  # [E, E] Σ_t ⟨f_i(t), f_j(t)⟩ over all tokens (a sum: divide by n_tokens for G)
    # Optional only for statistics built by hand (tests, token-level references); calibration always
    # fills them and load_stats requires them.
    sum_pnorm_sel: torch.Tensor | None = None  # [E] Σ_{t: e∈S(t)} p_e(t)·‖f_e(t)‖  (REAP-p numerator)
    max_norm_sel: torch.Tensor | None = None  # [E] max_{t: e∈S(t)} ‖f_e(t)‖, 0 if never routed
    sum_out: torch.Tensor | None = None  # [E, H] Σ_t f_e(t) over all tokens (HC-SMoE's representative A_e)
    gram_p: torch.Tensor | None = None  # [E, E] Σ_t p(t) p(t)ᵀ over all tokens (M-SMoE's router similarity)
    sum_xx: torch.Tensor | None = None  # [H, H] Σ_t x(t) x(t)ᵀ of the block's input (TD-MoE's whitening)
    # [1] Σ_t σ(w·x(t)) of a per-token shared-expert gate (Qwen2-MoE); None for a family without one
    sum_shared_gate: torch.Tensor | None = None
    # Real tokens, not sums (reconstruction-loss selection): SAMPLE_LAYER and SAMPLE_SHARED names → tensors
    sample: dict[str, torch.Tensor] | None = None

    @property
    def num_experts(self) -> int:
        return self.count.shape[0]

    def require(self, *names: str) -> None:
        """One-line ValueError if any of the optional statistics `names` is missing."""
        missing = [n for n in names if getattr(self, n) is None]
        if missing:
            raise ValueError(
                f"layer statistics lack {', '.join(missing)}: recompute the calibration statistics"
            )

    def to_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """Flatten for safetensors; `prefix` is e.g. 'layer.3.'. Missing optional statistics are left out."""
        out = {f"{prefix}n_tokens": torch.tensor([self.n_tokens], dtype=torch.int64)}
        for name in (*STATS_TENSORS, *FAMILY_STATS):
            if getattr(self, name) is not None:
                out[prefix + name] = getattr(self, name).contiguous()
        for name in SAMPLE_LAYER:  # the shared sample tensors are written once per file (save_stats)
            if self.sample is not None and name in self.sample:
                out[f"{prefix}sample_{name}"] = self.sample[name].contiguous()
        return out

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], prefix: str) -> LayerStats:
        """The inverse of to_tensors; every statistic (optional ones included) must be present, token samples
        may be absent (`sample` None)."""
        missing = [name for name in ("n_tokens", *STATS_TENSORS) if prefix + name not in tensors]
        if missing:
            raise ValueError(
                f"statistics '{prefix}*' lack {', '.join(missing)} (written by an older "
                "moesweep): recompute the calibration statistics"
            )
        kw = {name: tensors[prefix + name] for name in STATS_TENSORS}
        kw.update({name: tensors[prefix + name] for name in FAMILY_STATS if prefix + name in tensors})
        sample = {n: tensors[f"{prefix}sample_{n}"] for n in SAMPLE_LAYER if f"{prefix}sample_{n}" in tensors}
        return cls(n_tokens=int(tensors[prefix + "n_tokens"].item()), sample=sample or None, **kw)


@dataclass
class LayerContext:
    """Everything a scoring/grouping/scaling method may look at for one MoE layer."""

    stats: LayerStats
    experts: ExpertWeights
    router_weight: torch.Tensor  # [E, H]
    top_k: int  # the router's k = number of groups
    renormalized: bool  # does the router renormalize its top-k weights to sum to 1?
    settings: dict | None = None  # the configuration's method settings, for scorings that take them
    # [E] each expert's largest output element over its routed calibration tokens (the expert_maxima pass, REAP's
    # max_activations), where a configuration's method reads it
    maxima: torch.Tensor | None = None


@dataclass
class MergedLayer:
    """One MoE layer of a merged MoE (workers.methods.moe_merging): merged expert j = Σ_i weights[j][i] ·
    perm_i(expert groups[j][i]), where perm_i reorders the intermediate units of member i (unit u of the
    permuted expert = its unit perms[i][u]; identity when absent). The router follows `router_rows`:
    "summed" = all E rows kept, every member of cluster j computing merged expert j (the gates of a
    cluster's selected members sum; workers.models.merged_model), or one row per merged expert:
    "weighted" = the members' rows (and per-expert router biases) averaged with the same weights,
    "dominant" = the row of dominant[j]."""

    groups: list[list[int]]  # M clusters of teacher expert ids, in the merged layer's expert order
    weights: list[list[float]]  # same shape as groups; each inner list sums to 1
    router_rows: str  # "summed" | "weighted" | "dominant"
    dominant: list[int]  # per cluster, its most frequent member (an element of the cluster)
    perms: dict[int, torch.Tensor] = field(default_factory=dict)  # expert id → LongTensor [I]

    @property
    def num_experts(self) -> int:
        return len(self.groups)


@dataclass
class LayerPlan:
    """The conversion of one MoE layer (Algorithm 1): what is kept, how it is grouped and merged."""

    layer: int
    selected: list[int]  # the K kept experts, in the selector's order
    scores: list[float]  # base score s_e of every expert (len E) used for merging and scaling
    groups: list[list[int]]  # k groups, expert ids
    merge_weights: list[list[float]]  # same shape as groups; each inner list sums to 1
    alpha: list[float]  # k down-projection scales
    extras: dict = field(
        default_factory=dict
    )  # e.g. {"effective_rank": 3.2}; "student": settings (JSON) that
    # shape the student beyond groups/weights/α (a merged MoE's router rule, an edited MoE's factors file)

    def signature(self) -> tuple:
        """What determines the student's function: per group its experts, merge weights and α, in a
        canonical group order (the order of the dense FFN's blocks does not change what it computes, so
        at K = k every grouping gives one student). Scores and extras are excluded."""
        r = lambda xs: tuple(round(float(x), 10) for x in xs)  # noqa: E731
        blocks = sorted(
            (tuple(g), r(w), round(float(a), 10))
            for g, w, a in zip(self.groups, self.merge_weights, self.alpha, strict=True)
        )
        student = self.extras.get("student")  # settings that shape the student beyond the blocks (JSON)
        if student is None:
            return (self.layer, tuple(blocks))
        return (self.layer, tuple(blocks), json.dumps(student, sort_keys=True, separators=(",", ":")))
