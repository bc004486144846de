"""The tiny distillation setup that tests/test_distill.py, tests/test_fsdp.py and tests/test_distill_compile.py
share: a wide-init Qwen3-MoE teacher, text sampled from it, the settings of the 2-rank gloo runs and their saved
job, a 1-rank process group in this process, and benchmarks/bench_fsdp.py's smoke run."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

V, T = 64, 16

# the 2-rank runs against one process: 3 steps of 2 micro-batches of 4, 5 validation windows, expanded k′ = 3
GLOO_SETTINGS = dict(
    steps=3,
    batch_size=4,
    grad_accum=2,
    seq_len=T,
    lr=3e-3,
    min_lr=3e-4,
    warmup=1,
    eval_every=2,
    val_windows=5,
    teacher_top_k=3,
)


def tiny_teacher() -> nn.Module:
    """A random Qwen3-MoE (seed 0) with a wide init: peaked, far-from-uniform next-token distributions."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(
        vocab_size=V,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        intermediate_size=16,
        norm_topk_prob=True,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        initializer_range=0.3,
    )
    return Qwen3MoeForCausalLM(cfg).eval()


def teacher_sampled(teacher: nn.Module, n: int) -> torch.Tensor:
    """n windows of T tokens sampled from the teacher itself (generator seed 1): its CE on them is low and a
    student matching it improves."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (n, 1), generator=g)
    with torch.no_grad():
        for _ in range(T - 1):
            p = teacher(input_ids=ids).logits[:, -1].softmax(-1)
            ids = torch.cat([ids, torch.multinomial(p, 1, generator=g)], dim=1)
    return ids


def saved_job(
    d: Path, teacher: nn.Module, student: nn.Module, train: torch.Tensor, val: torch.Tensor
) -> dict[str, object]:
    """Saves the models and windows under d for workers.training.ddp.launch; the job's entries naming them."""
    teacher.save_pretrained(d / "teacher")
    student.save_pretrained(d / "student")
    torch.save(train, d / "train.pt")
    torch.save(val, d / "val.pt")
    return {
        "student": str(d / "student"),
        "teacher": str(d / "teacher"),
        "moe_teacher": True,
        "train": str(d / "train.pt"),
        "val": str(d / "val.pt"),
    }


@contextmanager
def one_rank_group(tmp_path: Path) -> Iterator[None]:
    """A 1-rank gloo process group in this process (torch.distributed is destroyed afterwards)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def bench_fsdp_smoke(tmp_path: Path, *args: str) -> tuple[str, dict]:
    """benchmarks/bench_fsdp.py --smoke with args, run in tmp_path: its stdout and its JSON line."""
    from tests.test_benchmarks import smoke_env

    root = Path(__file__).resolve().parents[1]
    r = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "bench_fsdp.py"), "--smoke", *args],
        cwd=tmp_path,
        env=smoke_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout, json.loads(next(ln for ln in r.stdout.splitlines() if ln.startswith("{")))
