"""The decoder inside a causal LM: the module whose forward gives `last_hidden_state` and holds the layers."""

from __future__ import annotations

from torch import nn


def decoder_of(model: nn.Module) -> nn.Module:
    """`model.base_model`, except where the CausalLM's base_model_prefix names none of its attributes and
    base_model is the CausalLM itself (Llama4ForCausalLM: prefix `language_model`, decoder at `.model`)."""
    base = model.base_model
    if base is not model:
        return base
    inner = getattr(model, "model", None)
    if not isinstance(inner, nn.Module):
        raise ValueError(
            f"{type(model).__name__}: base_model is the model itself and it has no `.model` decoder"
        )
    return inner
