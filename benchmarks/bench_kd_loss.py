"""Benchmark of the chunked KD loss from final hidden states (workers/training/losses.py `head_divergence`).

Measured side by side in one run, on the same random hidden states and LM heads:
  - impl="fused"    : one pass; each chunk's teacher and student logits are computed once, with the loss and
                      the gradients w.r.t. the student hidden states and head; backward only scales them;
  - impl="compiled" : the same pass with each chunk's divergence and gradient w.r.t. the logits in
                      torch.compile'd kernels (what distillation runs with `distill.compile` on; the first,
                      compiling call is the warm-up, not timed);
  - impl="autograd" : the reference; autograd through checkpointed chunks (the logits are recomputed in
                      backward);
  - the fused pass's four matmuls alone (teacher and student logits, hidden-state and head gradients) on
    random tensors of the same shapes: its FLOP time, as fast as this device multiplies.
Forward + backward each. Matmul work: 2·N·H·V per head matmul; the fused pass does 4 of them, the reference 6
(its 2 forward logit matmuls again in backward). Prints the ratios, the agreement of the two (loss and
gradients) and, on CUDA, each one's peak memory beyond the inputs. No asserts: it only prints.

  .venv/bin/python benchmarks/bench_kd_loss.py                              # small, CPU, fp32
  python benchmarks/bench_kd_loss.py --preset real --device cuda            # 4096 tokens, H 2048, V 151936, bf16
  python benchmarks/bench_kd_loss.py --preset real --device cuda --autocast # fp32 weights under bf16 autocast
  .venv/bin/python benchmarks/bench_kd_loss.py --smoke                      # seconds: does it still run?
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import DTYPES, finish_presets, preset_parser, sync, timed  # noqa: E402
from machine import describe  # noqa: E402  (benchmarks/machine.py, beside this script)

from workers.training.losses import LOSSES, head_divergence  # noqa: E402

PRESETS = {
    "small": dict(tokens=512, hidden=256, vocab=16384, chunk=128, dtype="float32"),
    # --smoke: seconds, the same code paths (a check that the script still runs, not a measurement)
    "smoke": dict(tokens=40, hidden=16, vocab=96, chunk=16, dtype="float32"),
    # Qwen3-30B-A3B's final hidden size and vocabulary, 4096 tokens in chunks of 1024 (DistillSpec's default)
    "real": dict(tokens=4096, hidden=2048, vocab=151936, chunk=1024, dtype="bfloat16"),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = preset_parser(__doc__, PRESETS, "small", device=None, device_help="default: cuda for --preset real")
    ap.add_argument("--loss", choices=["forward_kl", "reverse_kl"], default="forward_kl")
    ap.add_argument("--tau", type=float, default=1.0)
    ap.add_argument("--bias", action="store_true", help="LM heads with a bias (the student's trained)")
    ap.add_argument(
        "--autocast",
        action="store_true",
        help="fp32 hidden states and heads under autocast to --dtype (as distillation runs on GPU)",
    )
    ap.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="the device's peak matmul rate in --dtype (e.g. 989 for an H100 SXM in bf16): also prints the "
        "FLOP time at that peak",
    )
    args = finish_presets(ap, ap.parse_args(argv), PRESETS)
    if args.autocast and args.dtype not in ("bfloat16", "float16"):
        ap.error(f"--autocast with --dtype {args.dtype}: allowed bfloat16, float16")
    for name in ("tokens", "hidden", "vocab", "chunk", "repeats"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} {getattr(args, name)}: must be >= 1")
    return args


def peak_bytes(fn: Callable[[], object], device: str) -> int | None:
    """Peak memory allocated while `fn` runs, beyond what was allocated before (CUDA only)."""
    if device != "cuda":
        return None
    sync(device)
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    sync(device)
    return torch.cuda.max_memory_allocated() - before


def make_inputs(a: argparse.Namespace) -> dict[str, torch.Tensor | None]:
    """Hidden states ~ N(0, 1) and heads ~ N(0, 1/H), so the logits are ~ N(0, 1) (+ bias)."""
    g = torch.Generator(device="cpu").manual_seed(a.seed)
    store = torch.float32 if a.autocast else DTYPES[a.dtype]
    N, H, V = a.tokens, a.hidden, a.vocab

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(device=a.device, dtype=store)

    return dict(
        teacher_hidden=rand(N, H),
        teacher_head=rand(V, H, scale=H**-0.5),
        teacher_bias=rand(V, scale=0.1) if a.bias else None,
        student_hidden=rand(N, H).requires_grad_(True),
        student_head=rand(V, H, scale=H**-0.5).requires_grad_(True),
        student_bias=rand(V, scale=0.1).requires_grad_(True) if a.bias else None,
    )


def loss_step(a: argparse.Namespace, x: dict, impl: str) -> Callable[[], torch.Tensor]:
    """Forward + backward of head_divergence with `impl`; the gradients land in the inputs' .grad."""
    token_loss = LOSSES[a.loss].token_loss

    def step() -> torch.Tensor:
        for k in ("student_hidden", "student_head", "student_bias"):
            if x[k] is not None:
                x[k].grad = None
        amp = torch.autocast(a.device, dtype=DTYPES[a.dtype]) if a.autocast else contextlib.nullcontext()
        with amp:
            loss = head_divergence(token_loss, tau=a.tau, chunk=a.chunk, impl=impl, **x)
        loss.backward()
        return loss.detach()

    return step


def raw_matmuls(a: argparse.Namespace) -> Callable[[], None]:
    """The fused pass's 4 matmuls per chunk on random contiguous tensors in the compute dtype: logits of the
    teacher and the student, the hidden-state gradient and the head's gradient (accumulated over chunks)."""
    dt, dev = DTYPES[a.dtype], a.device
    N, H, V, c = a.tokens, a.hidden, a.vocab, a.chunk
    wt, ws = torch.randn(V, H, device=dev, dtype=dt), torch.randn(V, H, device=dev, dtype=dt)
    h = torch.randn(min(c, N), H, device=dev, dtype=dt)
    g = torch.randn(min(c, N), V, device=dev, dtype=dt)
    sizes = [min(c, N - i) for i in range(0, N, c)]

    def run() -> None:
        acc = None
        for n in sizes:
            hc, gc = h[:n], g[:n]
            F.linear(hc, wt)
            F.linear(hc, ws)
            torch.mm(gc, ws)
            acc = torch.mm(gc.T, hc) if acc is None else acc.addmm_(gc.T, hc)

    return run


def rel_diff(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30))


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    torch.manual_seed(a.seed)
    x = make_inputs(a)
    N, H, V = a.tokens, a.hidden, a.vocab
    head_mm = 2 * N * H * V
    fused_flops, autograd_flops = 4 * head_mm, 6 * head_mm

    steps = {impl: loss_step(a, x, impl) for impl in ("fused", "compiled", "autograd")}
    t = timed({**steps, "raw": raw_matmuls(a)}, a.device, a.repeats)
    t_raw = t["raw"]
    mem = {impl: peak_bytes(steps[impl], a.device) for impl in steps}

    # the two must agree: loss and every student gradient
    grads = {}
    for impl in steps:
        loss = steps[impl]()
        grads[impl] = [loss] + [
            x[k].grad.clone() for k in ("student_hidden", "student_head", "student_bias") if x[k] is not None
        ]
    diff = {
        impl: max(rel_diff(f, r) for f, r in zip(grads[impl], grads["autograd"], strict=True))
        for impl in ("fused", "compiled")
    }

    print(f"machine : {describe(a.device)}")
    print(
        f"sizes   : preset={a.preset} tokens={N} H={H} V={V} chunk={a.chunk} dtype={a.dtype}"
        f"{' (autocast, fp32 tensors)' if a.autocast else ''} loss={a.loss} tau={a.tau} bias={a.bias}; "
        f"one head matmul 2·N·H·V = {head_mm / 1e9:.2f} GFLOP"
    )
    rows = [
        ("fused (fwd+bwd)", t["fused"], fused_flops, mem["fused"]),
        ("compiled (fwd+bwd)", t["compiled"], fused_flops, mem["compiled"]),
        ("autograd reference (fwd+bwd)", t["autograd"], autograd_flops, mem["autograd"]),
        ("the 4 matmuls alone (FLOP time)", t_raw, fused_flops, None),
    ]
    print(f"{'pass':34s} {'time (s)':>10s} {'GFLOP':>8s} {'GFLOP/s':>10s} {'peak mem (GiB)':>15s}")
    for name, sec, flops, peak in rows:
        pk = "" if peak is None else f"{peak / 2**30:15.2f}"
        print(f"{name:34s} {sec:10.4f} {flops / 1e9:8.1f} {flops / sec / 1e9:10.1f} {pk:>15s}")
    print(f"autograd / fused        : {t['autograd'] / t['fused']:6.2f}x")
    print(f"fused / FLOP time       : {t['fused'] / t_raw:6.2f}x   (target <= 2x on GPU)")
    print(f"compiled / FLOP time    : {t['compiled'] / t_raw:6.2f}x")
    print(f"fused / compiled        : {t['fused'] / t['compiled']:6.2f}x")
    print(f"autograd / FLOP time    : {t['autograd'] / t_raw:6.2f}x")
    if a.peak_tflops:
        ideal = fused_flops / (a.peak_tflops * 1e12)
        print(f"FLOP time at peak       : {ideal * 1e3:.2f} ms ({a.peak_tflops:g} TFLOP/s)")
        print(f"fused / FLOP time @peak : {t['fused'] / ideal:6.2f}x")
        print(f"compiled / FLOP @peak   : {t['compiled'] / ideal:6.2f}x")
        print(f"autograd / FLOP @peak   : {t['autograd'] / ideal:6.2f}x")
    print(f"fused vs autograd       : max rel diff {diff['fused']:.2e} (loss and student gradients)")
    print(f"compiled vs autograd    : max rel diff {diff['compiled']:.2e}")


if __name__ == "__main__":
    main()
