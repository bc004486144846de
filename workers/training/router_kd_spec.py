"""Router knowledge-distillation settings, validated without importing torch.

Defaults are "the Router KD paper"'s (App. F, Table 1: 1 epoch, batch 2 × accumulation 4, lr 5e-5,
512 tokens, τ = 1, 3,000 samples, seed 42). Where the paper is silent the defaults are those of the
HF ``Trainer`` its vocabulary points at: AdamW β = (0.9, 0.999), ε = 1e-8, weight decay 0, linear decay
with no warm-up, gradient clipping at global norm 1.0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from workers.training.distill_spec import DEFAULT_CHUNK

KD_LOSS_NORMS = ("per_sequence", "per_token")


@dataclass
class RouterKDSpec:
    """Router KD settings; a stage's ``router_kd`` settings are these fields."""

    epochs: int = 1
    batch_size: int = 2  # sequences per micro-batch
    grad_accum: int = 4  # micro-batches per optimizer step
    lr: float = 5e-5  # peak learning rate, decayed linearly to 0 over the run
    max_len: int = 512  # tokens per sequence: each document truncated to it (the paper: no packing)
    packing: bool = False  # True: windows of max_len cut from the concatenated documents instead
    tau: float = 1.0  # KD temperature τ
    max_samples: int = 3000  # calibration sequences in one epoch
    seed: int = 42
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0  # on router matrices only (never on biases)
    eps: float = 1e-8  # AdamW ε
    norm_eps: float = 1e-8  # ε in N_x = Σ_t m_{t+1} + ε (Eq. 3)
    kd_loss_norm: str = "per_sequence"  # Eq. 3 (mean over sequences) or per_token (mean over target tokens)
    grad_clip: float | None = 1.0  # max global grad norm of the router parameters; None or 0 = off
    logit_chunk: int = DEFAULT_CHUNK  # tokens per LM-head chunk in the loss

    def __post_init__(self) -> None:
        def bad(field: str, value: Any, allowed: str) -> ValueError:
            return ValueError(f"RouterKDSpec.{field}: {value!r} is not allowed; allowed: {allowed}")

        for name in ("epochs", "batch_size", "grad_accum", "max_samples", "logit_chunk"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise bad(name, v, "an integer >= 1")
        if not isinstance(self.max_len, int) or isinstance(self.max_len, bool) or self.max_len < 2:
            raise bad("max_len", self.max_len, "an integer >= 2")
        if not isinstance(self.packing, bool):
            raise bad("packing", self.packing, "true or false")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise bad("seed", self.seed, "an integer")
        for name, low in (("lr", 0.0), ("tau", 0.0), ("eps", 0.0), ("norm_eps", 0.0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > low:
                raise bad(name, v, f"a number > {low:g}")
        if (
            isinstance(self.weight_decay, bool)
            or not isinstance(self.weight_decay, (int, float))
            or not self.weight_decay >= 0
        ):
            raise bad("weight_decay", self.weight_decay, "a number >= 0")
        try:
            betas = tuple(float(b) for b in self.betas)
        except (TypeError, ValueError):
            raise bad("betas", self.betas, "two numbers in [0, 1)") from None
        if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
            raise bad("betas", self.betas, "two numbers in [0, 1)")
        self.betas = (betas[0], betas[1])
        if self.kd_loss_norm not in KD_LOSS_NORMS:
            raise bad("kd_loss_norm", self.kd_loss_norm, ", ".join(KD_LOSS_NORMS))
        if self.grad_clip is not None and (
            isinstance(self.grad_clip, bool)
            or not isinstance(self.grad_clip, (int, float))
            or not self.grad_clip >= 0
        ):
            raise bad("grad_clip", self.grad_clip, "null or a number >= 0")

    @property
    def sequences_per_step(self) -> int:
        return self.batch_size * self.grad_accum

    def micro_batches(self, sequences: int) -> int:
        """Micro-batches in one epoch over `sequences` calibration sequences (at most max_samples)."""
        n = min(sequences, self.max_samples)
        return -(-n // self.batch_size)

    def steps(self, sequences: int) -> int:
        """Optimizer steps of the whole run over `sequences` calibration sequences: 375 for the paper's
        3,000 (a last short accumulation group is a step of its own)."""
        return self.epochs * -(-self.micro_batches(sequences) // self.grad_accum)
