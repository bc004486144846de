"""Tiny Qwen3 language models (dense and MoE) with a seeded initialisation, for the evaluation tests."""

from __future__ import annotations

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

# the shape both kinds share: two layers of width 32, four query and two key/value heads of 8
SHAPE = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
}


def dense_qwen3(vocab_size: int, seed: int, max_positions: int) -> Qwen3ForCausalLM:
    """A dense Qwen3 (untied embeddings) initialised under `torch.manual_seed(seed)`, in eval mode."""
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=vocab_size, **SHAPE, max_position_embeddings=max_positions, tie_word_embeddings=False
        )
    ).eval()


def moe_qwen3(vocab_size: int, seed: int, max_positions: int) -> Qwen3MoeForCausalLM:
    """A Qwen3-MoE (4 experts of width 16, top-2, every layer sparse) initialised under
    `torch.manual_seed(seed)`, left in the mode the constructor gives it."""
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(
        Qwen3MoeConfig(
            vocab_size=vocab_size,
            **SHAPE,
            moe_intermediate_size=16,
            num_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=max_positions,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    )
