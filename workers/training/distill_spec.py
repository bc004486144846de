"""Distillation settings (a sweep's `distill.settings`), validated without importing torch.

The names of the KD losses are read from workers/training/losses.py's LOSSES registry source, so a sweep file is
checked (and a dry run planned) before torch is imported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from workers.core.registry import registry_names

DTYPES = ("auto", "bf16", "fp32")
DEFAULT_CHUNK = 1024  # tokens per LM-head chunk in the chunked KD losses


@dataclass
class DistillSpec:
    """Distillation settings; the sweep's ``distill.settings`` are these fields (defaults: Table 9)."""

    steps: int
    batch_size: int  # sequences per micro-batch; one optimizer step sees batch_size × grad_accum
    seq_len: int
    grad_accum: int = 1
    lr: float = 1e-4
    min_lr: float = 1e-5
    warmup: int = 20
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.95)
    tau: float = 1.0
    loss: str = "forward_kl"
    hidden_weight: float = 1.0  # weight of the hidden-state MSE in the "intermediate" loss
    dtype: str = "auto"  # auto = bf16 autocast on cuda, fp32 on cpu
    eval_every: int = 20
    val_windows: int = 64
    seed: int = 0
    teacher_top_k: int | None = None  # k′ (Eq. 6); None = the teacher's own routing
    teacher_renormalize: bool | None = None  # renormalise the k′ weights; None = the architecture's rule
    grad_clip: float | None = 1.0  # max global grad norm; None or 0 = off
    logit_chunk: int = DEFAULT_CHUNK  # tokens per LM-head chunk in the losses
    # recompute the student's decoder layers in backward (activation memory): true = all of each layer,
    # "selective" = keep the matmul and attention outputs, recompute the elementwise ops between them
    grad_checkpoint: bool | str = False
    compile: bool | str = "auto"  # torch.compile each decoder layer of student and teacher, and the KD loss's
    # elementwise arithmetic; auto = on CUDA

    def __post_init__(self) -> None:
        def bad(field: str, value: Any, allowed: str) -> ValueError:
            return ValueError(f"DistillSpec.{field}: {value!r} is not allowed; allowed: {allowed}")

        for name in ("steps", "batch_size", "grad_accum", "eval_every", "val_windows", "logit_chunk"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise bad(name, v, "an integer >= 1")
        if not isinstance(self.seq_len, int) or self.seq_len < 2:
            raise bad("seq_len", self.seq_len, "an integer >= 2")
        if not isinstance(self.warmup, int) or self.warmup < 0:
            raise bad("warmup", self.warmup, "an integer >= 0")
        if not isinstance(self.seed, int):
            raise bad("seed", self.seed, "an integer")
        if not self.lr > 0:
            raise bad("lr", self.lr, "a number > 0")
        if not 0 <= self.min_lr <= self.lr:
            raise bad("min_lr", self.min_lr, f"a number in [0, lr={self.lr}]")
        if not self.weight_decay >= 0:
            raise bad("weight_decay", self.weight_decay, "a number >= 0")
        betas = tuple(self.betas)
        if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
            raise bad("betas", self.betas, "two numbers in [0, 1)")
        self.betas = (float(betas[0]), float(betas[1]))
        if not self.tau > 0:
            raise bad("tau", self.tau, "a number > 0")
        losses = registry_names("workers.training.losses", "LOSSES")
        if self.loss not in losses:
            raise bad("loss", self.loss, ", ".join(sorted(losses)))
        if not self.hidden_weight >= 0:
            raise bad("hidden_weight", self.hidden_weight, "a number >= 0")
        if self.dtype not in DTYPES:
            raise bad("dtype", self.dtype, ", ".join(DTYPES))
        if self.teacher_top_k is not None and (
            not isinstance(self.teacher_top_k, int) or self.teacher_top_k < 1
        ):
            raise bad("teacher_top_k", self.teacher_top_k, "null or an integer >= 1")
        if self.teacher_renormalize not in (None, True, False):
            raise bad("teacher_renormalize", self.teacher_renormalize, "null, true or false")
        if self.grad_clip is not None and not self.grad_clip >= 0:
            raise bad("grad_clip", self.grad_clip, "null or a number >= 0")
        if not (isinstance(self.grad_checkpoint, bool) or self.grad_checkpoint == "selective"):
            raise bad("grad_checkpoint", self.grad_checkpoint, "false, true or selective")
        if not (isinstance(self.compile, bool) or self.compile == "auto"):
            raise bad("compile", self.compile, "auto, true or false")

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.grad_accum * self.seq_len

    @property
    def tokens(self) -> int:
        """The token budget: steps × batch_size × grad_accum × seq_len."""
        return self.steps * self.tokens_per_step
