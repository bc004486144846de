"""What every dense → MoE construction (DOT-MoE and the baselines built without training) reads from the
dense model: an FFN's weights padded to E·s neurons, and the config fields the extracted MoE copies."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from workers.baselines.dot_moe_spec import COPIED_CONFIG_KEYS


def padded_ffn(mlp: nn.Module, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W_gate, W_up [n, H] and W_down [H, n] of a SwiGLU FFN, padded with zero neurons to n (each adds
    exactly 0 to the output)."""
    gate, up, down = mlp.gate_proj.weight.detach(), mlp.up_proj.weight.detach(), mlp.down_proj.weight.detach()
    pad = n - gate.shape[0]
    if pad:
        gate = torch.cat([gate, gate.new_zeros(pad, gate.shape[1])])
        up = torch.cat([up, up.new_zeros(pad, up.shape[1])])
        down = torch.cat([down, down.new_zeros(down.shape[0], pad)], dim=1)
    return gate, up, down


def copied_config(dense_config: Any) -> dict[str, Any]:
    """The dense model's attention, norm, embedding and token fields the extracted MoE's config keeps."""
    d = dense_config.to_dict()
    kw = {k: d[k] for k in COPIED_CONFIG_KEYS if k in d}
    kw.setdefault("head_dim", dense_config.hidden_size // dense_config.num_attention_heads)
    return kw
