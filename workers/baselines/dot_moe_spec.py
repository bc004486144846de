"""DOT-MoE alignment settings (a sweep's `dot_moe.settings`), validated without importing torch.

Defaults are those of "DOT-MoE: Differentiable Optimal Transport for MoEfication" (App. B.2.3, App. D,
Table 6, "MoEfication"): 3,500 steps of 64 × 2048 tokens, AdamW lr 5e-4, weight decay 1e-4, cosine
schedule with 20 % linear warm-up, gradient clipping 1.0, Sinkhorn N = 50 with τ annealed linearly
1.0 → 0.1 over the warm-up, loss weights KL 2.0, CE 1.0, z 1e-3, balance 1e-2. Where the paper is
silent: forward KL(dense ‖ MoE) at temperature 1, z- and balance losses averaged over layers, AdamW
betas (0.9, 0.999), cosine decay to 0, affinities and router drawn from N(0, init_std²).

`D2mBaselineSpec`: how the paper's dense → MoE baselines built without training (CMoE, LLaMA-MoE-v2;
workers.baselines.dense_to_moe_baselines) are calibrated, a sweep's `dot_moe.baseline_settings`; a job
carries it, resolved per method, as `DotMoeSpec.baseline` (`baseline_job_settings`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

METHODS = ("dot", "random", "cluster")  # learned OT assignment; fixed random split; balanced k-means split
BASELINES = ("cmoe", "llama_moe_v2")  # built from calibration statistics, nothing trained (§4.1 "Baselines")
COMBINES = ("unit", "prob", "renorm_prob")  # how the extracted MoE weights its chosen experts
SUPPORTED = ("qwen3",)  # dense model_type → extracted as a Qwen3-MoE of the same attention, norms, embeddings
# the dense config's keys an extracted MoE keeps (everything but the FFN shape)
COPIED_CONFIG_KEYS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "max_position_embeddings",
    "initializer_range",
    "rms_norm_eps",
    "use_cache",
    "tie_word_embeddings",
    "rope_parameters",
    "attention_bias",
    "attention_dropout",
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
)


@dataclass
class DotMoeSpec:
    """How one dense model is aligned into an MoE (the assignment method, E and k are job parameters)."""

    steps: int = 3500
    batch_size: int = 64  # sequences per step
    micro_batch: int | None = None  # sequences per forward (gradients accumulated); None = the whole batch
    seq_len: int = 2048
    lr: float = 5e-4
    weight_decay: float = 1e-4
    warmup_ratio: float = 0.2  # of steps: linear lr warm-up and the τ annealing
    grad_clip: float = 1.0
    tau_start: float = 1.0
    tau_end: float = 0.1
    sinkhorn_iters: int = 50
    w_kl: float = 2.0
    w_ce: float = 1.0
    w_z: float = 1e-3
    w_lb: float = 1e-2
    kl_temperature: float = 1.0
    combine: str = "unit"  # unit: the training forward (Eq. 16); prob / renorm_prob: router probabilities
    init_std: float = 0.02  # affinity A and router W_r initialisation (the paper: "random")
    cluster_iters: int = 20  # balanced k-means iterations of the `cluster` baseline
    seed: int = 0
    baseline: dict[str, Any] | None = None  # a baseline job's D2mBaselineSpec fields, else None

    def __post_init__(self) -> None:
        def bad(name: str, allowed: str) -> ValueError:
            return ValueError(
                f"DotMoeSpec.{name}: {getattr(self, name)!r} is not allowed; allowed: {allowed}"
            )

        for name in ("steps", "batch_size", "sinkhorn_iters", "cluster_iters"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise bad(name, "an integer >= 1")
        if self.micro_batch is not None and (
            not isinstance(self.micro_batch, int)
            or isinstance(self.micro_batch, bool)
            or not 1 <= self.micro_batch <= self.batch_size
        ):
            raise bad("micro_batch", f"null or an integer in [1, batch_size={self.batch_size}]")
        if not isinstance(self.seq_len, int) or isinstance(self.seq_len, bool) or self.seq_len < 2:
            raise bad("seq_len", "an integer >= 2")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise bad("seed", "an integer")
        for name in ("lr", "tau_start", "tau_end", "kl_temperature", "grad_clip", "init_std"):
            if not _number(getattr(self, name)) or not getattr(self, name) > 0:
                raise bad(name, "a number > 0")
        for name in ("weight_decay", "w_kl", "w_ce", "w_z", "w_lb"):
            if not _number(getattr(self, name)) or not getattr(self, name) >= 0:
                raise bad(name, "a number >= 0")
        if not _number(self.warmup_ratio) or not 0 <= self.warmup_ratio <= 1:
            raise bad("warmup_ratio", "a number in [0, 1]")
        if self.combine not in COMBINES:
            raise bad("combine", ", ".join(COMBINES))
        if self.w_kl + self.w_ce == 0:
            raise ValueError("DotMoeSpec: w_kl and w_ce are both 0; the alignment needs one of them")
        if self.baseline is not None:
            if not isinstance(self.baseline, dict):
                raise bad("baseline", "null or a mapping of D2mBaselineSpec fields")
            D2mBaselineSpec(**self.baseline)

    @property
    def warmup(self) -> int:
        """Warm-up steps (lr ramp and τ annealing, App. B.2.3)."""
        return round(self.warmup_ratio * self.steps)

    def tau_at(self, step: int) -> float:
        """τ falls linearly from tau_start to tau_end over the warm-up, then stays (App. B.2.3)."""
        if step >= self.warmup:
            return self.tau_end
        return self.tau_start + (self.tau_end - self.tau_start) * step / self.warmup

    @property
    def tokens(self) -> int:
        return self.steps * self.batch_size * self.seq_len


# CMoE's code calibrates on one batch of 8 windows; LLaMA-MoE-v2's gradient script runs 256 steps of 1
BASELINE_DEFAULTS = {
    "cmoe": {"calib_sequences": 8, "batch_size": 8},
    "llama_moe_v2": {"calib_sequences": 256, "batch_size": 1},
}
_COMMON = ("shared", "calib_sequences", "seq_len", "batch_size", "seed")
# the D2mBaselineSpec fields each baseline reads (a job's parameters hold only these)
BASELINE_FIELDS = {
    "cmoe": (*_COMMON, "k_act", "cmoe_iters"),
    "llama_moe_v2": (
        *_COMMON,
        "kmeans_sequences",
        "kmeans_tokens",
        "kmeans_iters",
        "kmeans_restarts",
        "jitter",
        "scale_factor",
    ),
}


@dataclass
class D2mBaselineSpec:
    """How a dense → MoE baseline is calibrated and built; None takes the method's own default
    (BASELINE_DEFAULTS, `resolved`). `shared` is a configuration's (dot_moe.baselines), not a setting."""

    shared: int = 0  # always-on shared experts, counted in the E experts
    calib_sequences: int | None = None  # calibration windows of the section's data
    seq_len: int = 2048
    batch_size: int | None = None  # windows per forward
    seed: int = 0  # which windows; the k-means initialisation
    k_act: int = 10  # CMoE K_a: neurons marked active per token (its code's default)
    cmoe_iters: int = 1  # CMoE balanced k-means rounds (its code: one assignment, one centroid update)
    kmeans_sequences: int = 80  # LLaMA-MoE-v2: the first windows, whose MLP inputs give the router
    kmeans_tokens: int = 16384  # … a seeded subsample of at most this many of their tokens per layer
    kmeans_iters: int = 50
    kmeans_restarts: int = 16
    jitter: float = 0.4  # LLaMA-MoE-v2: cluster sizes within (1 ± jitter) · tokens / clusters
    scale_factor: float | None = None  # LLaMA-MoE-v2 routed-output scale; None: E/k, or 1 with shared experts

    def __post_init__(self) -> None:
        def bad(name: str, allowed: str) -> ValueError:
            return ValueError(
                f"D2mBaselineSpec.{name}: {getattr(self, name)!r} is not allowed; allowed: {allowed}"
            )

        def whole(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        for name in (
            "k_act",
            "cmoe_iters",
            "kmeans_sequences",
            "kmeans_tokens",
            "kmeans_iters",
            "kmeans_restarts",
        ):
            if not whole(getattr(self, name)) or getattr(self, name) < 1:
                raise bad(name, "an integer >= 1")
        for name in ("calib_sequences", "batch_size"):
            v = getattr(self, name)
            if v is not None and (not whole(v) or v < 1):
                raise bad(name, "null or an integer >= 1")
        if not whole(self.shared) or self.shared < 0:
            raise bad("shared", "an integer >= 0")
        if not whole(self.seq_len) or self.seq_len < 2:
            raise bad("seq_len", "an integer >= 2")
        if not whole(self.seed):
            raise bad("seed", "an integer")
        if not _number(self.jitter) or not 0 <= self.jitter < 1:
            raise bad("jitter", "a number in [0, 1)")
        if self.scale_factor is not None and (not _number(self.scale_factor) or not self.scale_factor > 0):
            raise bad("scale_factor", "null or a number > 0")

    def resolved(self, method: str, experts: int, top_k: int) -> D2mBaselineSpec:
        """Every None filled in for `method` at E experts, top-k routed."""
        if method not in BASELINES:
            raise ValueError(f"baseline {method!r}; allowed: {', '.join(BASELINES)}")
        own = {k: v for k, v in BASELINE_DEFAULTS[method].items() if getattr(self, k) is None}
        scale = self.scale_factor
        if scale is None:  # LLaMA-MoE-v2's scripts: 4.0 at 8 experts top-2, 1.0 at 1 residual + 7 top-1
            scale = 1.0 if method == "cmoe" or self.shared else experts / top_k
        return replace(self, **own, scale_factor=float(scale))


def baseline_job_settings(
    method: str, experts: int, top_k: int, shared: int, values: dict[str, Any]
) -> dict[str, Any]:
    """The DotMoeSpec fields of one baseline job: its calibration windows as `steps` × `batch_size` of
    `seq_len`, its combine (CMoE: every chosen expert weighted 1; LLaMA-MoE-v2: softmax renormalised over
    the top-k, times the scale) and the resolved D2mBaselineSpec as `baseline`."""
    b = D2mBaselineSpec(**{**values, "shared": shared}).resolved(method, experts, top_k)
    assert b.calib_sequences is not None and b.batch_size is not None
    return {
        "steps": math.ceil(b.calib_sequences / b.batch_size),
        "batch_size": b.batch_size,
        "seq_len": b.seq_len,
        "seed": b.seed,
        "combine": "unit" if method == "cmoe" else "renorm_prob",
        "baseline": {k: v for k, v in asdict(b).items() if k in BASELINE_FIELDS[method]},
    }


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
