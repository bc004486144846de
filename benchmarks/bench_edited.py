"""Edited MoE students (workers/models/edited_model.py: MoBE, TD-MoE, Tucker2-experts) against the pruned MoE of
the same K, forward time side by side in one run.

One random-weight Qwen3-MoE teacher of E experts is calibrated on random tokens and edited to the parameter
budget of K experts by each method (workers/methods/editing.py, fits shortened: MoBE 2 Adam steps, no HOOI
sweeps; the ranks, hence the shapes timed, are the budget's). The pruned MoE of the same K is the same
architecture with K experts (random weights: the compute of any pruned student). Timed on the same tokens:
  - infer: a no_grad forward of the pruned MoE and of each edited student in each forward mode: `direct` (the
    default: the factors applied to the routed tokens), `cache` (rebuilt weights kept while the factors do not
    change: the family's forward at the pruned model's per-token cost, the full experts' memory) and `rebuild`
    (every expert's weights rebuilt from the factors on every forward: the old path);
  - train: forward + backward with every parameter trainable (factors included), `direct` and `rebuild`.
Timed round-robin (one call of each per round, so a busy machine slows them alike); prints medians and
their ratios, on CUDA also the peak memory of each infer mode. No asserts: it only prints.

  .venv/bin/python benchmarks/bench_edited.py                              # small, CPU
  python benchmarks/bench_edited.py --preset real --device cuda            # Qwen3-30B-A3B layer shapes, bf16
  .venv/bin/python benchmarks/bench_edited.py --smoke                      # seconds: does it still run?
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import DTYPES, finish_presets, preset_moe_config, preset_parser, timed  # noqa: E402
from machine import describe  # noqa: E402  (benchmarks/machine.py, beside this script)

import workers.models.edited_model as edited_model  # noqa: E402
from workers.calibration.calibrate import collect_stats  # noqa: E402
from workers.families import get_adapter  # noqa: E402
from workers.methods.editing import edit_layer  # noqa: E402
from workers.models.convert import layer_contexts  # noqa: E402

PRESETS = {
    "small": dict(
        hidden=256,
        inter=128,
        experts=32,
        top_k=4,
        K=16,
        layers=2,
        heads=4,
        kv_heads=2,
        head_dim=32,
        vocab=1024,
        seq_len=256,
        batch_size=2,
        dtype="float32",
    ),
    # --smoke: seconds, the same code paths (a check that the script still runs, not a measurement)
    "smoke": dict(
        hidden=32,
        inter=16,
        experts=8,
        top_k=2,
        K=6,
        layers=1,
        heads=2,
        kv_heads=1,
        head_dim=16,
        vocab=128,
        seq_len=16,
        batch_size=2,
        dtype="float32",
    ),
    # Qwen3-30B-A3B layer shapes (hidden 2048, moe_intermediate 768, 128 experts, top-8), the Router KD
    # paper's K = 80, two layers
    "real": dict(
        hidden=2048,
        inter=768,
        experts=128,
        top_k=8,
        K=80,
        layers=2,
        heads=32,
        kv_heads=4,
        head_dim=128,
        vocab=8192,
        seq_len=2048,
        batch_size=2,
        dtype="bfloat16",
    ),
}
MODES = ("direct", "cache", "rebuild")
METHODS = {"MoBE": {"steps": 2, "bases": 2}, "TD-MoE": {"iters": 0}, "Tucker2-experts": {"iters": 0}}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = preset_parser(__doc__, PRESETS, "small", repeats=5)
    ap.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of {', '.join(METHODS)}")
    ap.add_argument("--experts-implementation", default=None, help="eager, batched_mm, grouped_mm (default)")
    ap.add_argument("--no-train", action="store_true", help="time the no_grad forwards only")
    args = finish_presets(ap, ap.parse_args(argv), PRESETS)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(args.methods) - set(METHODS))
    if unknown:
        ap.error(f"--methods {', '.join(unknown)}: allowed {', '.join(METHODS)}")
    if not args.top_k <= args.K <= args.experts:
        ap.error(f"--K {args.K}: allowed top_k <= K <= experts ({args.top_k}..{args.experts})")
    return args


def build_moe(a: argparse.Namespace, experts: int, seed: int) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    cfg = preset_moe_config(a, experts)
    torch.manual_seed(seed)
    kw = {} if a.experts_implementation is None else {"experts_implementation": a.experts_implementation}
    model = AutoModelForCausalLM.from_config(cfg, **kw)
    with torch.no_grad():  # weights large enough that the routing is not uniform
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.05)
    return model.to(a.device, DTYPES[a.dtype]).eval()


def infer(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def train_step(model: torch.nn.Module, ids: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, use_cache=False).logits.float().square().mean().backward()


def peak_memory(fn: Callable[[], object], device: str) -> float | None:
    if device != "cuda":
        return None
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    fn()
    return torch.cuda.max_memory_allocated() / 2**30


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    teacher = build_moe(a, a.experts, a.seed)
    pruned = build_moe(a, a.K, a.seed + 1)
    adapter = get_adapter(teacher)
    g = torch.Generator().manual_seed(a.seed)
    ids = torch.randint(0, a.vocab, (a.batch_size, a.seq_len), generator=g).to(a.device)
    stats = collect_stats(
        teacher, adapter, [(ids, torch.ones_like(ids))], chunk_tokens=a.batch_size * a.seq_len
    )
    contexts = layer_contexts(teacher, adapter, stats)
    print(f"machine: {describe(a.device)}")
    print(
        f"shape: H {a.hidden}, I {a.inter}, E {a.experts} -> K {a.K}, top-{a.top_k}, {a.layers} layers, "
        f"{a.batch_size} x {a.seq_len} tokens, {a.dtype}, median of {a.repeats}"
    )
    pruned_train = copy.deepcopy(pruned).train()
    for method in a.methods:
        plans, factors = [], {}
        for layer, ctx in contexts.items():
            plan, t = edit_layer(layer, ctx, method, a.K, METHODS[method])
            plans.append(plan)
            factors.update(t)
        student = edited_model.edited_moe_student(teacher, adapter, plans, factors)
        routed = sum(p.extras["params_routed"] for p in plans) / sum(
            p.extras["params_routed_original"] for p in plans
        )
        print(f"{method}: routed parameters {routed:.3f} of the teacher's")
        students = {}
        for mode in MODES:
            students[mode] = copy.deepcopy(student)
            edited_model.set_forward_mode(students[mode], mode)
        del student
        fns = {"pruned": lambda: infer(pruned, ids)}
        fns |= {mode: (lambda s=s: infer(s, ids)) for mode, s in students.items()}
        times = timed(fns, a.device, a.repeats)
        for name, fn in fns.items():
            mem = peak_memory(fn, a.device)
            print(
                f"  infer {name:8s}: {1e3 * times[name]:.2f} ms"
                + ("" if mem is None else f", peak {mem:.2f} GiB")
            )
        for mode in MODES:
            print(f"{method} infer {mode} / pruned : {times[mode] / times['pruned']:.2f}x")
        print(f"{method} infer rebuild / direct: {times['rebuild'] / times['direct']:.2f}x")
        outs = {mode: infer(s, ids).float() for mode, s in students.items()}
        scale = float(outs["rebuild"].abs().max())
        for mode in ("direct", "cache"):
            diff = float((outs[mode] - outs["rebuild"]).abs().max()) / scale
            print(f"{method} {mode} vs rebuild logits: max rel diff {diff:.1e}")
        if not a.no_train:
            train = {"pruned": pruned_train}
            for mode in ("direct", "rebuild"):
                train[mode] = students[mode].train().requires_grad_(True)
            del students
            tt = timed(
                {name: (lambda m=m: train_step(m, ids)) for name, m in train.items()}, a.device, a.repeats
            )
            for name in train:
                print(f"  train {name:8s}: {1e3 * tt[name]:.2f} ms")
            print(f"{method} train direct / pruned : {tt['direct'] / tt['pruned']:.2f}x")
            print(f"{method} train rebuild / direct: {tt['rebuild'] / tt['direct']:.2f}x")
            del train
        else:
            del students


if __name__ == "__main__":
    main()
