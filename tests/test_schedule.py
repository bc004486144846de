"""The one learning-rate schedule (workers/core/schedule.py) that distillation, DOT-MoE's alignment and the tiny
teacher train with."""

from __future__ import annotations

import math

import pytest

from workers.core.schedule import cosine_lr


def test_warmup_then_cosine_to_min_lr():
    lrs = [cosine_lr(i, 20, 1.0, 4, 0.1) for i in range(20)]
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0], rel=1e-12)
    assert lrs[4] == pytest.approx(1.0, rel=1e-12) and lrs[-1] == pytest.approx(0.1, rel=1e-12)
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:], strict=False))
    # step 11 is 7/15 of the way through the decay: min_lr + (lr − min_lr)·(1 + cos(π·7/15))/2
    assert lrs[11] == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 7 / 15)), rel=1e-12)


def test_decays_to_zero_by_default_and_without_warmup():
    lrs = [cosine_lr(i, 100, 1e-3, 0) for i in range(100)]
    assert lrs[0] == pytest.approx(1e-3, rel=1e-12) and lrs[-1] == pytest.approx(0.0, abs=1e-18)
    assert lrs[49] > lrs[50] > lrs[51]


def test_the_tiny_teachers_min_lr_ratio():
    # the tiny teacher decays to lr · min_lr_ratio: 1e-3 · 0.1
    lrs = [cosine_lr(s, 100, 1e-3, 10, 1e-3 * 0.1) for s in range(100)]
    assert lrs[0] == pytest.approx(1e-4, rel=1e-12) and lrs[9] == pytest.approx(1e-3, rel=1e-12)
    assert max(lrs) == pytest.approx(1e-3, rel=1e-12) and lrs[-1] == pytest.approx(1e-4, rel=1e-12)


def test_a_single_step_after_warmup_is_lr():
    assert cosine_lr(2, 3, 0.5, 2, 0.0) == pytest.approx(0.5, rel=1e-12)  # span clamps to 1: ratio 0
