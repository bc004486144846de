"""DOT-MoE alignment settings (a sweep's `dot_moe.settings`), validated without importing torch.

Defaults are those of "DOT-MoE: Differentiable Optimal Transport for MoEfication" (App. B.2.3, App. D,
Table 6, "MoEfication"): 3,500 steps of 64 × 2048 tokens, AdamW lr 5e-4, weight decay 1e-4, cosine
schedule with 20 % linear warm-up, gradient clipping 1.0, Sinkhorn N = 50 with τ annealed linearly
1.0 → 0.1 over the warm-up, loss weights KL 2.0, CE 1.0, z 1e-3, balance 1e-2. Where the paper is
silent: forward KL(dense ‖ MoE) at temperature 1, z- and balance losses averaged over layers, AdamW
betas (0.9, 0.999), cosine decay to 0, affinities and router drawn from N(0, init_std²).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

METHODS = ("dot", "random", "cluster")  # learned OT assignment; fixed random split; balanced k-means split
COMBINES = ("unit", "prob", "renorm_prob")  # how the extracted MoE weights its chosen experts


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


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
