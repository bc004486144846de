"""Benchmark of sharded distillation (workers/training/fsdp.py): peak memory per rank, tokens/s and MFU, next to
what workers/training/memory_model.py predicts for the same shapes, ranks and settings, and the micro-step by
parts (teacher forward, student forward, loss, backward, optimizer, comm; ms per micro-step, the medians the
training loop's PhaseTimer measures: CUDA events on CUDA, perf_counter on the CPU).

Random weights and random tokens (no download): a Qwen3-30B-A3B-shaped teacher and the 3.3B dense
student (k·I = 6144), optionally cut to fewer layers (--layers) so it fits the GPUs at hand. The models
are built on the CPU and handed to fsdp_worker, which shards them onto the GPUs layer by layer, as a
real job does (workers.training.ddp.run_job). Each rank's peak is torch.cuda.max_memory_allocated over the
whole run; tokens/s is the global batch (sequences × ranks × --accum micro-batches) over the median step
time (steps 3..n−1: the first compiles and allocates, the last includes the final validation). MFU counts
model FLOPs only (no recomputation): student 6·N + attention 6·L·T·d_q per token, teacher forward
2·N_active + attention 2·L·T·d_q, over --peak-tflops per GPU (989: H100/H200 SXM dense bf16). The memory
model knows no selective checkpointing: with it, its figure is the one without checkpointing (an upper
bound). --compare runs eager with full checkpointing, eager selective and compiled selective side by side
(models rebuilt for each) and prints each one's tokens/s over the first's. No asserts: one JSON line per run.

  torchrun --standalone --nproc_per_node=8 benchmarks/bench_fsdp.py --preset real --checkpointing --accum 8
  python benchmarks/bench_fsdp.py --preset real --layers 8 --accum 8 --compare   # one lent GPU
  .venv/bin/python benchmarks/bench_fsdp.py --smoke     # one CPU process, tiny shapes: does it still run?

Not run on a GPU yet (none was lent for this work): no figures in the README come from it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from machine import describe  # noqa: E402  (benchmarks/machine.py, beside this script)

from workers.training.memory_model import QWEN3_30B_A3B, STUDENT_3B, Shapes, per_rank_bytes  # noqa: E402

SMOKE_TEACHER = Shapes(
    layers=2, hidden=32, vocab=128, heads=4, kv_heads=2, head_dim=8, ffn=16, experts=8, top_k=2
)
SMOKE_STUDENT = dataclasses.replace(SMOKE_TEACHER, ffn=32, experts=0, top_k=0)


def build(s: Shapes, dtype: torch.dtype, seed: int) -> torch.nn.Module:
    """A random-weight Qwen3 (MoE when s.experts) of these shapes, on the CPU."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = dict(
        hidden_size=s.hidden,
        num_hidden_layers=s.layers,
        num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads,
        head_dim=s.head_dim,
        vocab_size=s.vocab,
        tie_word_embeddings=s.tied,
        max_position_embeddings=40960,
    )
    torch.manual_seed(seed)
    if s.experts:
        cfg = Qwen3MoeConfig(
            **common,
            num_experts=s.experts,
            num_experts_per_tok=s.top_k,
            moe_intermediate_size=s.ffn,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
        return Qwen3MoeForCausalLM(cfg).to(dtype)
    return Qwen3ForCausalLM(Qwen3Config(**common, intermediate_size=s.ffn)).to(dtype)


def flops_per_token(teacher: Shapes, student: Shapes, seq_len: int) -> float:
    """Model FLOPs per trained token: student forward + backward, teacher forward (active experts only)."""

    def attention(s: Shapes) -> float:  # QK^T and AV over a causal context of seq_len/2 on average
        return 2 * 2 * s.layers * (seq_len / 2) * s.heads * s.head_dim

    def matmul(s: Shapes) -> int:  # parameters a token multiplies with: all but the embedding lookup, and
        unused = s.layers * (s.experts - s.top_k) * 3 * s.hidden * s.ffn  # the experts it is not routed to
        return s.params() - (0 if s.tied else s.embedding_params()) - unused

    return 6 * matmul(student) + 3 * attention(student) + 2 * matmul(teacher) + attention(teacher)


SETTINGS = {"full": True, "selective": "selective", None: False}  # --checkpointing -> grad_checkpoint
COMPILE = {"auto": "auto", "true": True, "false": False}
COMPARE = [("false", "full"), ("false", "selective"), ("true", "selective")]  # (--compile, --checkpointing)


def run(args: argparse.Namespace, compile_: str, checkpointing: str | None) -> dict | None:
    """One distillation run through fsdp_worker on fresh models; its JSON record on rank 0 (None elsewhere)."""
    from workers.families import get_adapter
    from workers.training.distill import DistillSpec
    from workers.training.fsdp import fsdp_worker

    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = args.cuda
    teacher = build(args.teacher_s, torch.bfloat16 if cuda else torch.float32, 0).eval()
    student = build(args.student_s, torch.float32, 1)
    batch = args.sequences * world
    spec = DistillSpec(
        steps=args.steps,
        batch_size=batch,
        grad_accum=args.accum,
        seq_len=args.seq_len,
        warmup=1,
        eval_every=args.steps,
        val_windows=world,
        grad_checkpoint=SETTINGS[checkpointing],
        compile=COMPILE[compile_],
        logit_chunk=args.logit_chunk,
        dtype="auto",
    )
    g = torch.Generator().manual_seed(2)
    micro = args.steps * args.accum
    train = torch.randint(0, args.student_s.vocab, (micro * batch, args.seq_len), generator=g)
    val = torch.randint(0, args.student_s.vocab, (world, args.seq_len), generator=g)
    stamps: list[float] = []
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    res = fsdp_worker(
        student,
        teacher,
        get_adapter(teacher),
        (train[i : i + batch] for i in range(0, len(train), batch)),
        val,
        spec,
        teacher_offload=args.teacher_offload,
        progress=lambda i, n: stamps.append(time.perf_counter()),
    )
    peak = torch.cuda.max_memory_allocated() if cuda else 0
    peaks = [None] * world
    dist.all_gather_object(peaks, peak)
    del teacher, student
    if rank != 0:
        return None
    steps = [b - a for a, b in zip(stamps[1:-2], stamps[2:-1], strict=True)] or [stamps[-1] - stamps[0]]
    step_s = statistics.median(steps)
    tok_s = batch * args.accum * args.seq_len / step_s
    flops = flops_per_token(args.teacher_s, args.student_s, args.seq_len)
    model = per_rank_bytes(
        args.teacher_s,
        args.student_s,
        world,
        "fsdp",
        args.teacher_offload,
        checkpointing == "full",
        args.sequences * args.seq_len,
        args.logit_chunk,
    )
    parts = {k.removeprefix("time_"): v for k, v in res["timings"][-1].items() if k != "step"}
    return {
        "device": describe("cuda" if cuda else "cpu"),
        "ranks": world,
        "layers": args.student_s.layers,
        "seq_len": args.seq_len,
        "sequences_per_rank": args.sequences,
        "accum": args.accum,
        "checkpointing": checkpointing or "none",
        "compile": compile_,
        "teacher_offload": args.teacher_offload,
        "step_s": round(step_s, 4),
        "micro_step_ms": round(1e3 * step_s / args.accum, 2),
        "parts": parts,  # ms per micro-step, medians over the run's micro-steps
        "tokens_per_s": round(tok_s, 1),
        "mfu": round(flops * tok_s / (args.peak_tflops * 1e12 * world), 4) if cuda else None,
        "peak_gb_per_rank": [round(p / 1e9, 2) for p in peaks] if cuda else None,
        "model_gb_per_rank": round(model["total"] / 1e9, 2),
        "loss_curve": res["loss_curve"],
    }


def report(line: dict, out: Path | None) -> None:
    print(json.dumps(line))
    parts = "  ".join(f"{k.removesuffix('_ms')} {v:.1f}" for k, v in line["parts"].items())
    print(
        f"compile {line['compile']}, checkpointing {line['checkpointing']}: tokens/s {line['tokens_per_s']:.1f}, "
        f"median step {line['step_s']:.3f} s = {line['accum']} micro-steps of {line['micro_step_ms']:.1f} ms "
        f"(ms: {parts}), model {line['model_gb_per_rank']:.2f} GB per rank"
    )
    if out:
        with out.open("a") as f:
            f.write(json.dumps(line) + "\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", choices=["real", "smoke"], default="real")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, one CPU process, 4 steps")
    ap.add_argument("--layers", type=int, default=None, help="cut teacher and student to this many layers")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--sequences", type=int, default=1, help="sequences per rank per micro-batch")
    ap.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step (the paper's: 8)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument(
        "--checkpointing",
        nargs="?",
        const="full",
        choices=["full", "selective"],
        default=None,
        help="activation checkpointing of the student's layers (bare flag: full)",
    )
    ap.add_argument("--compile", choices=sorted(COMPILE), default="auto", help="auto: on CUDA")
    ap.add_argument("--compare", action="store_true", help="eager full, eager selective, compiled selective")
    ap.add_argument("--teacher-offload", action="store_true")
    ap.add_argument("--logit-chunk", type=int, default=1024)
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of one GPU")
    ap.add_argument("--out", type=Path, default=None, help="also append the JSON lines to this file")
    args = ap.parse_args(argv)
    if args.accum < 1:
        raise SystemExit(f"--accum: {args.accum} is not allowed; allowed: an integer >= 1")
    if args.smoke:
        args.preset, args.seq_len, args.steps, args.logit_chunk = "smoke", 16, 4, 8
    args.teacher_s, args.student_s = (
        (QWEN3_30B_A3B, STUDENT_3B) if args.preset == "real" else (SMOKE_TEACHER, SMOKE_STUDENT)
    )
    if args.layers:
        args.teacher_s = dataclasses.replace(args.teacher_s, layers=args.layers)
        args.student_s = dataclasses.replace(args.student_s, layers=args.layers)

    args.cuda = torch.cuda.is_available() and not args.smoke
    if "LOCAL_RANK" in os.environ:
        if args.cuda:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if args.cuda else "gloo")
    else:  # one process without torchrun
        store = Path(tempfile.mkdtemp()) / "pg"
        dist.init_process_group(
            "nccl" if args.cuda else "gloo", init_method=f"file://{store}", rank=0, world_size=1
        )
    variants = COMPARE if args.compare else [(args.compile, args.checkpointing)]
    lines = [run(args, c, k) for c, k in variants]
    if dist.get_rank() == 0:
        for line in lines:
            report(line, args.out)
        for line in lines[1:]:
            print(
                f"compile {line['compile']}, checkpointing {line['checkpointing']} / "
                f"compile {lines[0]['compile']}, checkpointing {lines[0]['checkpointing']}, tokens/s: "
                f"{line['tokens_per_s'] / lines[0]['tokens_per_s']:.2f}x"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
