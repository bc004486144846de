"""DOT-MoE's greedy rounding (workers/methods/sinkhorn.py `greedy_round`) against the sequential visit it
computes, as App. B.3.2 of the DOT-MoE paper writes it (a Python loop over the n·m pairs by descending mass),
side by side on the same soft plans: their ratio, and whether every assignment is the same.

    .venv/bin/python benchmarks/bench_rounding.py                # Qwen3-8B's FFN into 96 experts: 12288 x 96
    .venv/bin/python benchmarks/bench_rounding.py --smoke        # 600 x 12, one repeat
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workers.methods.sinkhorn import balanced_capacity, greedy_round  # noqa: E402


def sequential(soft: torch.Tensor, capacity: list[int]) -> list[int]:
    n, m = soft.shape
    flat = soft.reshape(-1).tolist()
    owner, cap, left = [-1] * n, list(capacity), n
    for idx in sorted(range(n * m), key=lambda i: (-flat[i], i)):
        i, e = divmod(idx, m)
        if owner[i] == -1 and cap[e] > 0:
            owner[i], cap[e], left = e, cap[e] - 1, left - 1
            if not left:
                break
    return owner


def best_of(fn, repeats: int) -> tuple[float, list[int]]:
    best, out = float("inf"), []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--neurons", type=int, default=12288)
    ap.add_argument("--experts", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    if args.smoke:
        args.neurons, args.experts, args.repeats = 600, 12, 1
    torch.set_num_threads(1)
    n, m = args.neurons, args.experts
    soft = torch.rand(n, m, generator=torch.Generator().manual_seed(0), dtype=torch.float64).softmax(1)
    cap = balanced_capacity(n, m)
    t_seq, a = best_of(lambda: sequential(soft, cap), args.repeats)
    t_vec, b = best_of(lambda: greedy_round(soft, cap), args.repeats)
    print(f"soft plan {n} x {m}, best of {args.repeats}")
    print(f"sequential visit : {t_seq:.3f} s")
    print(f"greedy_round     : {t_vec:.3f} s")
    print(f"sequential / greedy_round: {t_seq / t_vec:.1f}x")
    print(f"same assignment  : {a == b}")


if __name__ == "__main__":
    main()
