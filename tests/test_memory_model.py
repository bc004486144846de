"""The memory model of sharded distillation (workers/training/memory_model.py) against HF's models and torch."""

import pytest
import torch

from workers.training.memory_model import (
    GB,
    QWEN3_30B_A3B,
    STUDENT_3B,
    Shapes,
    fits,
    layer_activation_bytes,
    per_rank_bytes,
    table,
)


def test_parameter_counts_equal_the_hf_models():
    """Qwen3-30B-A3B and the 3.3B student built on the meta device: the same counts as the formula."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    t, s = QWEN3_30B_A3B, STUDENT_3B
    common = dict(
        hidden_size=t.hidden,
        num_hidden_layers=t.layers,
        num_attention_heads=t.heads,
        num_key_value_heads=t.kv_heads,
        head_dim=t.head_dim,
        vocab_size=t.vocab,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        teacher = Qwen3MoeForCausalLM(
            Qwen3MoeConfig(
                **common,
                num_experts=t.experts,
                num_experts_per_tok=t.top_k,
                moe_intermediate_size=t.ffn,
                decoder_sparse_step=1,
                mlp_only_layers=[],
            )
        )
        student = Qwen3ForCausalLM(Qwen3Config(**common, intermediate_size=s.ffn))
    assert t.params() == sum(p.numel() for p in teacher.parameters()) == 30_532_122_624
    assert s.params() == sum(p.numel() for p in student.parameters()) == 3_340_449_792


@pytest.mark.parametrize("fp32_weights", [False, True])
def test_layer_activations_equal_what_torch_saves(fp32_weights):
    """Every tensor a Qwen3 decoder layer saves for backward, counted by storage, per token."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    s = Shapes(layers=1, hidden=48, vocab=32, heads=4, kv_heads=2, head_dim=16, ffn=80)
    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=s.vocab,
        hidden_size=s.hidden,
        num_hidden_layers=1,
        num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads,
        head_dim=s.head_dim,
        intermediate_size=s.ffn,
        attn_implementation="sdpa",
    )
    model = Qwen3ForCausalLM(cfg)
    if not fp32_weights:
        model.to(torch.bfloat16)  # FSDP's gathered bf16 parameters
    tokens = 7
    ids = torch.randint(0, s.vocab, (1, tokens))
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    shapes = {tuple(p.shape) for p in model.parameters()} | {tuple(p.shape)[::-1] for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in weights and tuple(t.shape) not in shapes and t.dtype != torch.int64:
            saved[st.data_ptr()] = st.nbytes()  # weights and autocast's casts of them are not activations
        return t

    with (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        torch.autocast("cpu", dtype=torch.bfloat16, enabled=fp32_weights),
    ):
        h = model.model.embed_tokens(ids)
        pos = torch.arange(tokens)[None]
        model.model.layers[0](
            h, position_embeddings=model.model.rotary_emb(h, pos), attention_mask=None, position_ids=pos
        )
    assert sum(saved.values()) == layer_activation_bytes(s, fp32_weights) * tokens


def test_bytes_per_rank_by_hand():
    """FSDP on 8 ranks, teacher sharded, checkpointing on, 4096 tokens, chunk 1024: each part by hand."""
    b = per_rank_bytes(QWEN3_30B_A3B, STUDENT_3B, 8, "fsdp", teacher_offload=False, checkpointing=True)
    pt, ps = 30_532_122_624, 3_340_449_792
    emb = 151936 * 2048  # embedding = LM head = 311,164,928
    t_layer, s_layer = 623_120_640, 56_627_456  # 18.87M attention + 603.98M experts + 262k router + norms
    assert b["teacher_weights"] == 2 * (pt - emb) / 8 + 2 * emb  # shards + the whole LM head
    assert b["teacher_gathered"] == 2 * (emb + 2048) + 2 * 2 * t_layer  # embeddings + 2 layers, bf16
    assert b["student_weights"] == b["student_grads"] == 4 * ps / 8 and b["optimizer"] == 8 * ps / 8
    s_root = 2 * emb + 2048
    assert b["student_gathered"] == 2 * s_root + 2 * 2 * s_layer + 6 * s_root
    assert b["activations"] == 2 * 2048 * 4096 * 48 + 128_792 * 4096  # layer inputs + one layer recomputed
    assert b["logits"] == 4 * 5 * 1024 * 151936  # five fp32 [chunk, V] buffers of the fused loss
    assert b["teacher_forward"] == (2 * 2048 + 2 * (2 * 4096 + 2 * 512) + 6 * 8 * 768 + 4 * 128) * 4096
    assert b["total"] == sum(v for k, v in b.items() if k != "total") == pytest.approx(27.868e9, rel=1e-3)
    assert fits(b["total"])
    ddp = per_rank_bytes(QWEN3_30B_A3B, STUDENT_3B, 8, "ddp", checkpointing=True)
    assert ddp["teacher_weights"] == 2 * pt and ddp["optimizer"] == 8 * ps
    assert ddp["student_gathered"] == 6 * ps  # DDP's bucket copy of the gradients + autocast's bf16 weights
    assert not fits(ddp["total"]) and not fits(ddp["total"], 141)  # not on H200s either
    assert per_rank_bytes(QWEN3_30B_A3B, STUDENT_3B, 8, "fsdp", True, True)["teacher_weights"] == 2 * emb


def test_the_readme_table_and_bad_settings():
    text = table()
    assert text.count("\n") == 13 and "| 4 | ddp | replicated | on |" in text
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "scale.md").read_text()
    assert "  " + text.replace("\n", "\n  ") in page  # docs/scale.md shows what the function computes
    with pytest.raises(ValueError, match="sharding: 'zero' is not allowed; allowed: ddp, fsdp"):
        per_rank_bytes(QWEN3_30B_A3B, STUDENT_3B, 4, "zero")
    with pytest.raises(ValueError, match="teacher_offload: needs sharding fsdp"):
        per_rank_bytes(QWEN3_30B_A3B, STUDENT_3B, 4, "ddp", teacher_offload=True)
    assert GB == 1e9
