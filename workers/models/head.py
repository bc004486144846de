"""A causal LM's output head as its forward applies it: the linear projection of the final hidden states and what
the model does to the logits after it (Cohere's logit_scale, Granite's logits_scaling, a final tanh softcap).
Perplexity evaluates it chunk by chunk (workers/evaluation/ppl.py); the KD losses take it with the constant factor
folded in (workers/training/distill.py `lm_head`)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn


class Head(NamedTuple):
    """The output projection and what the model's forward does to its logits after it."""

    weight: torch.Tensor  # [V, H]
    bias: torch.Tensor | None
    mul: float | None  # logits * logit_scale (Cohere), in the model dtype
    div: float | None  # logits / logits_scaling (Granite), in the model dtype
    cap: float | None  # cap · tanh(logits / cap) (final_logit_softcapping), in float32


def output_head(model: nn.Module) -> Head | None:
    """The model's head as `Head`, or None when the model has no linear output embedding."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if not isinstance(head, nn.Linear):
        return None
    cfg = getattr(model, "config", None)
    scale, scaling, cap = (
        getattr(cfg, k, None) for k in ("logit_scale", "logits_scaling", "final_logit_softcapping")
    )
    return Head(
        head.weight,
        head.bias,
        None if scale is None else float(scale),
        None if scaling is None else float(scaling),
        None if cap is None else float(cap),
    )


def logit_factor(head: Head) -> float:
    """The constant the model multiplies into its head's logits: logit_scale / logits_scaling (1.0 for neither)."""
    factor = 1.0
    if head.mul is not None:
        factor *= head.mul
    if head.div is not None:
        factor /= head.div
    return factor
