"""The tiny teacher's settings (a sweep's `teacher.tiny`), validated without importing torch."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class TinyTeacherSpec:
    """The tiny teacher's architecture, corpus and training (defaults: the measured e32 recipe)."""

    experts: int = 32
    top_k: int = 2
    hidden: int = 128
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    moe_intermediate: int = 128
    dense_intermediate: int | None = None  # dense teacher's FFN width; None = match the MoE's total params
    vocab: int = 4096
    steps: int = 1000
    batch_size: int = 8
    seq_len: int = 128
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 30
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    balance_coef: float = 0.01
    seed: int = 0
    corpus_chars: int | None = 6_000_000  # None: the whole standard library (~9M chars)
    corpus_seed: int = 0  # the corpus and tokenizer do not change with the training seed
    eval_windows: int = 128  # held-out windows of seq_len, half prose, half code (fewer if valid is short)

    def __post_init__(self) -> None:
        positive = (
            "experts",
            "top_k",
            "hidden",
            "layers",
            "heads",
            "kv_heads",
            "moe_intermediate",
            "vocab",
            "steps",
            "batch_size",
            "seq_len",
            "eval_windows",
        )
        for name in positive + ("warmup", "seed", "corpus_seed"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name}={value!r}: must be an integer")
            if name in positive and value < 1:
                raise ValueError(f"{name}={value}: must be >= 1")
        for name in ("lr", "min_lr_ratio", "weight_decay", "grad_clip", "balance_coef"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
                raise ValueError(f"{name}={value!r}: must be a finite number")
        if self.top_k > self.experts:
            raise ValueError(f"top_k={self.top_k}: must be <= experts ({self.experts})")
        if self.hidden % self.heads or (self.hidden // self.heads) % 2:
            raise ValueError(f"heads={self.heads}: hidden ({self.hidden}) / heads must be an even integer")
        if self.heads % self.kv_heads:
            raise ValueError(f"kv_heads={self.kv_heads}: must divide heads ({self.heads})")
        if self.vocab < 300:
            raise ValueError(f"vocab={self.vocab}: must be >= 300 (256 bytes + special tokens + merges)")
        if self.seq_len < 8:
            raise ValueError(f"seq_len={self.seq_len}: must be >= 8")
        if self.warmup < 0 or self.warmup > self.steps:
            raise ValueError(f"warmup={self.warmup}: must be in [0, steps={self.steps}]")
        if self.lr <= 0:
            raise ValueError(f"lr={self.lr}: must be > 0")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio={self.min_lr_ratio}: must be in [0, 1]")
        if self.grad_clip <= 0:
            raise ValueError(f"grad_clip={self.grad_clip}: must be > 0")
        for name in ("weight_decay", "balance_coef"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 0")
        if self.corpus_chars is not None and (
            not isinstance(self.corpus_chars, int) or self.corpus_chars < 100_000
        ):
            raise ValueError(
                f"corpus_chars={self.corpus_chars!r}: must be an integer >= 100000 or null (all)"
            )
        if self.dense_intermediate is not None and (
            not isinstance(self.dense_intermediate, int) or self.dense_intermediate < 1
        ):
            raise ValueError(
                f"dense_intermediate={self.dense_intermediate!r}: must be an integer >= 1 or null"
            )
