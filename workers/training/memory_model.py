"""Bytes per rank of a distillation run: which sharding settings fit a GPU (docs/scale.md, "Multi-GPU distillation").

A model, not a measurement: it counts the tensors the loop in `workers.training.distill` keeps, per rank, for
the three placements `distill.sharding` offers (ddp, fsdp with the teacher sharded, fsdp with the
teacher's shards in host memory), with or without activation checkpointing. What it assumes:

- teacher weights in bf16; student with fp32 master weights, fp32 gradients and AdamW's two fp32
  moments (16 bytes per parameter, sharded 1/N under FSDP); DDP also keeps a second fp32 copy of the
  gradients in its buckets (``gradient_as_bucket_view`` off, torch's default) and autocast's bf16 copy
  of every weight, saved for backward.
- FSDP gathers units in bf16: the student's root (embeddings, LM head, norm) for the whole step and two
  decoder layers at a time (the one running and the one prefetched), plus one unit's bf16 gradient and
  its fp32 reduce-scatter input; the teacher's base-model root (embeddings) during its forward and two
  layers at a time. The teacher's LM head is whole on every rank.
- activations of a Qwen3-style layer saved for backward, per token (`layer_activation_bytes`; equal to
  what torch saves on CPU, tests/test_memory_model.py): attention by a fused kernel (no [T, T] scores),
  GQA without repeating k/v. With checkpointing only each layer's input is kept, plus one layer's
  activations while it is recomputed.
- the chunked KD loss holds about five fp32 [chunk, vocab] buffers at its peak (`LOGIT_BUFFERS`; the fused
  one-pass `head_divergence` peaks at 4.3 in its forward and 0.5 in its backward, measured on CPU; the
  autograd reference held 7.3).

- the teacher's forward (no grad) keeps its final hidden states for the loss and, for one layer at a
  time, q/k/v/output, each token's top-k expert activations and the router's logits
  (`teacher_forward_bytes`, a rough count, not measured).

Not counted: the CUDA context, NCCL buffers and allocator fragmentation (`fits` leaves 10% of the card
for them), the optimizer step's temporaries (after backward, when activations are gone).
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9
LOGIT_BUFFERS = 5  # fp32 [chunk, vocab] tensors alive at the peak of one KD-loss chunk (fused pass)
HEADROOM = 0.9  # the share of a card's memory the counted tensors may use


@dataclass(frozen=True)
class Shapes:
    """A decoder-only transformer; `ffn` is the dense FFN width, or each routed expert's when experts > 0."""

    layers: int
    hidden: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    experts: int = 0
    top_k: int = 0
    tied: bool = False

    def layer_params(self) -> int:
        """Attention (q, k, v, o, q/k norms), FFN or experts + router, two RMSNorms."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attn = self.hidden * (q + 2 * kv) + q * self.hidden + 2 * self.head_dim
        ffn = 3 * self.hidden * self.ffn
        if self.experts:
            ffn = self.experts * ffn + self.experts * self.hidden
        return attn + ffn + 2 * self.hidden

    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    def head_params(self) -> int:
        return 0 if self.tied else self.vocab * self.hidden

    def params(self) -> int:
        return self.layers * self.layer_params() + self.embedding_params() + self.head_params() + self.hidden


# Qwen3-30B-A3B (its config.json) and the paper's 3.3B dense student: the same attention and embeddings,
# one dense FFN of k·I = 8·768 = 6144 per layer.
QWEN3_30B_A3B = Shapes(
    layers=48, hidden=2048, vocab=151936, heads=32, kv_heads=4, head_dim=128, ffn=768, experts=128, top_k=8
)
STUDENT_3B = Shapes(layers=48, hidden=2048, vocab=151936, heads=32, kv_heads=4, head_dim=128, ffn=6144)


def layer_activation_bytes(s: Shapes, fp32_weights: bool = False) -> int:
    """Bytes one token keeps for backward in one dense Qwen3 layer, bf16 compute.

    bf16 parameters (FSDP's gathered units): each RMSNorm keeps its input in fp32, the normalised bf16
    and its output (8H + rsqrt); q and k keep the fp32 copy, the normalised and the rotated (8 per
    element, + rsqrt per head); v, the attention output (2 each) and its log-sum-exp (4 per head);
    cos and sin (2 × 2 per head_dim); the SwiGLU keeps gate, up, silu(gate) and their product (8I).
    `fp32_weights` (autocast over fp32 master weights: one process, DDP): the residual stream is fp32,
    each norm keeps its fp32 output and each projection its own bf16 cast of it (+10H), cos/sin fp32."""
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    norms = 2 * (8 * s.hidden + 4)
    qk = 8 * (q + kv) + 4 * (s.heads + s.kv_heads)
    attention = 2 * kv + 2 * q + 4 * s.heads
    rope = 2 * 2 * s.head_dim
    mlp = 8 * s.ffn
    extra = 10 * s.hidden + 2 * 2 * s.head_dim if fp32_weights else 0
    return norms + qk + attention + rope + mlp + extra


def teacher_forward_bytes(t: Shapes) -> int:
    """Bytes per token of the teacher's no-grad forward at its peak: final hidden states (bf16, kept for
    the KD loss) and one layer's q, k, v, attention output, top-k experts' gate/up/product and router logits."""
    q, kv = t.heads * t.head_dim, t.kv_heads * t.head_dim
    ffn = 3 * 2 * max(t.top_k, 1) * t.ffn
    return 2 * t.hidden + 2 * (2 * q + 2 * kv) + ffn + 4 * t.experts


def per_rank_bytes(
    teacher: Shapes,
    student: Shapes,
    ranks: int,
    sharding: str,
    teacher_offload: bool = False,
    checkpointing: bool = False,
    tokens: int = 4096,
    logit_chunk: int = 1024,
) -> dict[str, float]:
    """Bytes each of `ranks` GPUs holds at the peak of a step, by part, and their "total". `tokens` is
    one micro-batch on one rank (batch_size / ranks × seq_len); sharding is "ddp" or "fsdp"."""
    if sharding not in ("ddp", "fsdp"):
        raise ValueError(f"sharding: {sharding!r} is not allowed; allowed: ddp, fsdp")
    if teacher_offload and sharding != "fsdp":
        raise ValueError("teacher_offload: needs sharding fsdp")
    n = ranks if sharding == "fsdp" else 1
    pt, ps = teacher.params(), student.params()
    t_head = teacher.head_params() or teacher.embedding_params()  # a tied head is kept whole too
    s_root = student.embedding_params() + student.head_params() + student.hidden
    out = {
        "teacher_weights": 2.0 * pt,
        "teacher_gathered": 0.0,
        "student_weights": 4.0 * ps / n,
        "student_grads": 4.0 * ps / n,
        "optimizer": 8.0 * ps / n,
    }
    if sharding == "fsdp":
        shards = 0.0 if teacher_offload else 2.0 * (pt - teacher.head_params()) / n
        out["teacher_weights"] = shards + 2.0 * t_head
        out["teacher_gathered"] = (
            2.0 * (teacher.embedding_params() + teacher.hidden) + 2 * 2.0 * teacher.layer_params()
        )
        out["student_gathered"] = (
            2.0 * s_root
            + 2 * 2.0 * student.layer_params()
            + (2.0 + 4.0) * max(student.layer_params(), s_root)
        )
    else:
        out["student_gathered"] = 4.0 * ps + 2.0 * ps  # DDP's gradient buckets + autocast's bf16 weights
    fp32_weights = sharding == "ddp"
    per_layer = layer_activation_bytes(student, fp32_weights) * tokens
    if checkpointing:  # each layer's input (the residual stream) + one layer recomputed
        out["activations"] = (
            4.0 if fp32_weights else 2.0
        ) * student.hidden * tokens * student.layers + per_layer
    else:
        out["activations"] = float(per_layer * student.layers)
    out["teacher_forward"] = float(teacher_forward_bytes(teacher) * tokens)
    out["logits"] = 4.0 * LOGIT_BUFFERS * min(logit_chunk, tokens) * student.vocab
    out["total"] = sum(out.values())
    return out


def fits(total_bytes: float, card_gb: float = 80.0) -> bool:
    """Whether the counted tensors leave 10% of the card for what is not counted."""
    return total_bytes <= HEADROOM * card_gb * GB


def max_sequences(
    teacher: Shapes,
    student: Shapes,
    ranks: int,
    sharding: str,
    teacher_offload: bool,
    checkpointing: bool,
    seq_len: int = 4096,
    card_gb: float = 80.0,
    limit: int = 64,
) -> int:
    """The most sequences of `seq_len` one rank's micro-batch can hold and still fit (0: not even one)."""
    best = 0
    for n in range(1, limit + 1):
        b = per_rank_bytes(teacher, student, ranks, sharding, teacher_offload, checkpointing, n * seq_len)
        if not fits(b["total"], card_gb):
            break
        best = n
    return best


SETTINGS = [
    ("ddp", False, False),
    ("ddp", False, True),
    ("fsdp", False, False),
    ("fsdp", False, True),
    ("fsdp", True, False),
    ("fsdp", True, True),
]


def table(ranks_list: tuple[int, ...] = (4, 8), card_gb: float = 80.0, tokens: int = 4096) -> str:
    """The table in docs/scale.md: Qwen3-30B-A3B → 3.3B, GB per rank by part at `tokens` per rank's micro-batch,
    whether it fits, and the most sequences of `tokens` a micro-batch could hold."""
    head = (
        "| ranks | sharding | teacher | checkpointing | teacher | student weights + grads + AdamW | "
        f"gathered / buffers | activations (student + teacher) | KD logits | total | fits {card_gb:g} GB | most sequences |"
    )
    rows = [head, "|---|---|---|---|" + "---:|" * 8]
    for ranks in ranks_list:
        for sharding, offload, ckpt in SETTINGS:
            b = per_rank_bytes(QWEN3_30B_A3B, STUDENT_3B, ranks, sharding, offload, ckpt, tokens)
            place = "replicated" if sharding == "ddp" else ("offloaded" if offload else "sharded")
            student = b["student_weights"] + b["student_grads"] + b["optimizer"]
            gathered = b["teacher_gathered"] + b["student_gathered"]
            cells = (
                [str(ranks), sharding, place, "on" if ckpt else "off"]
                + [
                    f"{v / GB:.1f}"
                    for v in (
                        b["teacher_weights"],
                        student,
                        gathered,
                        b["activations"] + b["teacher_forward"],
                        b["logits"],
                        b["total"],
                    )
                ]
                + ["yes" if fits(b["total"], card_gb) else "no"]
                + [
                    str(
                        max_sequences(
                            QWEN3_30B_A3B, STUDENT_3B, ranks, sharding, offload, ckpt, tokens, card_gb
                        )
                    )
                ]
            )
            rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(f"teacher {QWEN3_30B_A3B.params() / 1e9:.2f}B, student {STUDENT_3B.params() / 1e9:.2f}B parameters")
    print(table())
