"""Benchmark of the max-activation pass (workers/calibration/expert_maxima.py, REAP's super-expert statistic).

Measured side by side in one run (round-robin, medians), on the same tokens, routing and random expert
weights of one MoE layer:
  - the pass as written: each expert on its routed tokens only (grouped into [E, C, H], two bmm);
  - the all-experts way (calibration's kernel, workers.methods.experts.all_expert_outputs): every expert on
    every token, then the routed (token, expert) pairs picked out.
Both compute the same maxima (printed: their largest difference). The routing is a random softmax router's
top-k on random inputs, so experts are unevenly loaded as in a real router (printed: C against T·k/E).
No asserts: it only prints.

  .venv/bin/python benchmarks/bench_expert_maxima.py [--threads 1]         # tiny, CPU
  python benchmarks/bench_expert_maxima.py --preset real --device cuda     # Qwen3-30B-A3B layer shapes
  .venv/bin/python benchmarks/bench_expert_maxima.py --smoke               # seconds: does it still run?
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import DTYPES as ALL_DTYPES  # noqa: E402  (benchmarks/common.py, beside this script)
from common import finish_presets, preset_parser, timed  # noqa: E402
from machine import describe  # noqa: E402  (benchmarks/machine.py, beside this script)

from workers.calibration.expert_maxima import MaximaAccumulator  # noqa: E402
from workers.core.types import ExpertWeights  # noqa: E402
from workers.methods.experts import all_expert_outputs, fused_gate_up  # noqa: E402

PRESETS = {
    "tiny": dict(hidden=256, inter=128, experts=32, top_k=4, tokens=4096, chunk_tokens=1024, dtype="float32"),
    "smoke": dict(hidden=32, inter=16, experts=8, top_k=2, tokens=96, chunk_tokens=40, dtype="float32"),
    # Qwen3-30B-A3B: hidden 2048, moe_intermediate 768, 128 experts, top-8; 4 × 2048 tokens (one batch)
    "real": dict(
        hidden=2048, inter=768, experts=128, top_k=8, tokens=8192, chunk_tokens=2048, dtype="bfloat16"
    ),
}
DTYPES = {k: v for k, v in ALL_DTYPES.items() if k != "float64"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = preset_parser(__doc__, PRESETS, "tiny")
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: torch's; 1 on a loaded machine)",
    )
    return finish_presets(ap, ap.parse_args(argv), PRESETS, DTYPES)


def all_experts_maxima(ew: ExpertWeights, x: torch.Tensor, idx: torch.Tensor, chunk: int) -> torch.Tensor:
    """The same statistic the all-experts way: f of every expert on every token, routed pairs picked out."""
    out = torch.zeros(ew.num_experts, dtype=torch.float32, device=x.device)
    fused = fused_gate_up(ew)
    for lo in range(0, x.shape[0], chunk):
        peak = all_expert_outputs(ew, x[lo : lo + chunk], fused).amax(-1).float()  # [E, t]
        sel = idx[lo : lo + chunk].T  # [k, t]
        out.scatter_reduce_(0, sel.reshape(-1), peak.gather(0, sel).reshape(-1), reduce="amax")
    return out


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    if a.threads is not None:
        torch.set_num_threads(a.threads)
    dev, dt = a.device, DTYPES[a.dtype]
    g = torch.Generator(device="cpu").manual_seed(a.seed)

    def r(*shape: int, scale: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(dev, dt)

    E, H, inter = a.experts, a.hidden, a.inter
    ew = ExpertWeights(
        gate=r(E, inter, H, scale=H**-0.5),
        up=r(E, inter, H, scale=H**-0.5),
        down=r(E, H, inter, scale=inter**-0.5),
    )
    x = r(a.tokens, H, scale=1.0)
    logits = x.float() @ r(E, H, scale=H**-0.5).float().T
    idx = logits.softmax(-1).topk(a.top_k, dim=-1).indices
    mask = torch.ones(a.tokens, dtype=torch.bool, device=dev)

    def routed() -> torch.Tensor:
        acc = MaximaAccumulator(ew, a.chunk_tokens)
        acc.update(x, idx, mask)
        return acc.finish()

    with torch.no_grad():
        t = timed(
            {"routed": routed, "all": lambda: all_experts_maxima(ew, x, idx, a.chunk_tokens)}, dev, a.repeats
        )
        t_routed, t_all = t["routed"], t["all"]
        diff = float((routed() - all_experts_maxima(ew, x, idx, a.chunk_tokens).cpu()).abs().max())
    loads = [
        torch.bincount(idx[lo : lo + a.chunk_tokens].reshape(-1), minlength=E).max().item()
        for lo in range(0, a.tokens, a.chunk_tokens)
    ]
    mean_load = a.chunk_tokens * a.top_k / E
    print(f"device: {describe(dev)}")
    print(
        f"shapes: E {E}, top-{a.top_k}, H {H}, I {inter}, {a.tokens} tokens in chunks of {a.chunk_tokens}, "
        f"{a.dtype}; busiest expert per chunk {statistics.mean(loads):.0f} tokens vs T·k/E = {mean_load:.0f}"
    )
    print(f"routed pass     : {t_routed * 1e3:10.2f} ms")
    print(f"all-experts pass: {t_all * 1e3:10.2f} ms")
    print(f"all-experts / routed: {t_all / t_routed:.2f}x")
    print(f"max |Δ| between the passes: {diff:.3e}")


if __name__ == "__main__":
    main()
