"""The learning-rate schedule every training loop of the project uses (distillation, DOT-MoE's alignment,
the tiny teacher): linear warm-up, then cosine decay."""

from __future__ import annotations

import math


def cosine_lr(step: int, steps: int, lr: float, warmup: int, min_lr: float = 0.0) -> float:
    """The learning rate of 0-based `step` of `steps`: linear warm-up over the first `warmup` steps to `lr`
    (step i gets lr·(i+1)/warmup), then cosine decay from `lr` reaching `min_lr` at the last step."""
    if step < warmup:
        return lr * (step + 1) / warmup
    span = max(1, steps - 1 - warmup)
    ratio = min(1.0, (step - warmup) / span)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)
