"""Benchmark of the calibration statistics pass (workers/calibration/calibrate.py).

Measured side by side in one run, on the same tokens of a random-weight Qwen3-MoE model:
  - plain teacher forward (no hooks);
  - collect_stats end to end (forward + all-experts statistics);
  - the batched statistics pass alone (the hooks' work, replayed on captured router inputs);
  - the same statistics with a per-expert Python loop (one expert's matmuls at a time);
  - raw torch matmuls of the same shapes (bmm gate/up, bmm down, Gram mm) on random contiguous tensors.
Achieved GFLOP/s count the expert matmuls (6·T·E·H·I) plus the Gram (2·E²·T·H).
Issue targets: batched ≥5× the loop, ≥50% of the raw matmul throughput. No asserts: it only prints.

  .venv/bin/python benchmarks/bench_calibration.py                       # tiny, CPU
  python benchmarks/bench_calibration.py --preset real --device cuda     # Qwen3-30B-A3B layer shapes
  .venv/bin/python benchmarks/bench_calibration.py --smoke               # seconds: does it still run?
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from machine import describe  # noqa: E402  (benchmarks/machine.py, beside this script)

from workers.calibration.calibrate import LayerAccumulator, collect_stats  # noqa: E402
from workers.methods.merge import ffn_forward  # noqa: E402

PRESETS = {
    "tiny": dict(
        hidden=64,
        inter=32,
        experts=16,
        top_k=4,
        layers=2,
        heads=4,
        kv_heads=2,
        head_dim=16,
        vocab=512,
        seq_len=128,
        batch_size=4,
        batches=4,
        chunk_tokens=256,
        dtype="float32",
    ),
    # --smoke: seconds, the same code paths (a check that the script still runs, not a measurement)
    "smoke": dict(
        hidden=32,
        inter=16,
        experts=8,
        top_k=2,
        layers=1,
        heads=2,
        kv_heads=1,
        head_dim=16,
        vocab=128,
        seq_len=32,
        batch_size=2,
        batches=2,
        chunk_tokens=24,
        dtype="float32",
    ),
    # Qwen3-30B-A3B layer shapes (hidden 2048, moe_intermediate 768, 128 experts, top-8), a few layers
    "real": dict(
        hidden=2048,
        inter=768,
        experts=128,
        top_k=8,
        layers=4,
        heads=32,
        kv_heads=4,
        head_dim=128,
        vocab=8192,
        seq_len=2048,
        batch_size=2,
        batches=4,
        chunk_tokens=4096,
        dtype="bfloat16",
    ),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="a seconds-long run through the same code paths: --preset smoke, 1 repeat "
        "(checks the script runs; its timings mean nothing)",
    )
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    for name, default in PRESETS["tiny"].items():
        kind = str if isinstance(default, str) else int
        ap.add_argument(
            "--" + name.replace("_", "-"),
            type=kind,
            default=None,
            help=f"override the preset (tiny: {default}, real: {PRESETS['real'][name]})",
        )
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats per measurement (median)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.smoke:
        args.preset, args.repeats = "smoke", 1
    for name, value in PRESETS[args.preset].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.dtype not in DTYPES:
        ap.error(f"--dtype {args.dtype!r}: allowed {sorted(DTYPES)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device")
    return args


def build_model(a: argparse.Namespace):
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    cfg = Qwen3MoeConfig(
        vocab_size=a.vocab,
        hidden_size=a.hidden,
        intermediate_size=4 * a.inter,
        moe_intermediate_size=a.inter,
        num_hidden_layers=a.layers,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads,
        head_dim=a.head_dim,
        num_experts=a.experts,
        num_experts_per_tok=a.top_k,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=max(4096, a.seq_len),
    )
    torch.manual_seed(a.seed)
    with torch.device(a.device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=DTYPES[a.dtype])
    return model.eval()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: str, repeats: int) -> float:
    """Median wall time of `repeats` calls after one warm-up call."""
    fn()
    sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def loop_expert_outputs(experts, x, fused=None):
    """The baseline: one expert's matmuls at a time, in a Python loop."""
    out = torch.empty(
        experts.num_experts, x.shape[0], experts.hidden, dtype=experts.gate.dtype, device=x.device
    )
    for e in range(experts.num_experts):
        out[e] = ffn_forward(experts, x.to(experts.gate.dtype), expert=e)
    return out


class LoopAccumulator(LayerAccumulator):
    """The same statistics and reductions; only the expert computation is a per-expert loop."""

    expert_outputs = staticmethod(loop_expert_outputs)


def capture(model, adapter, batches):
    """(layer, x, p, weights, indices, mask) for every MoE layer and batch, as the hooks see them."""
    seen, state = [], {}

    def make(layer):
        def hook(mod, args, kwargs, out):
            h = args[0] if args else kwargs["hidden_states"]
            seen.append((layer, h.reshape(-1, h.shape[-1]), *adapter.router_decision(out), state["mask"]))

        return hook

    handles = [
        adapter.router_module(model, layer).register_forward_hook(make(layer), with_kwargs=True)
        for layer in adapter.moe_layers(model)
    ]
    try:
        with torch.no_grad():
            for ids, mask in batches:
                state["mask"] = mask.reshape(-1).bool()
                model(input_ids=ids, attention_mask=mask, use_cache=False, logits_to_keep=1)
    finally:
        for h in handles:
            h.remove()
    return seen


def replay(model, adapter, records, chunk, cls):
    accs = {layer: cls(adapter.expert_weights(model, layer), chunk) for layer in adapter.moe_layers(model)}
    with torch.no_grad():
        for layer, x, p, w, idx, mask in records:
            accs[layer].update(x, p, w, idx, mask)
    return accs


def raw_matmuls(a: argparse.Namespace, n_tokens: int, n_layers: int):
    """Plain bmm/mm on random contiguous tensors of the batched pass's shapes, as many times as it runs."""
    E, H, D, dt = a.experts, a.hidden, a.inter, DTYPES[a.dtype]
    chunks = []
    per_batch = a.batch_size * a.seq_len
    for lo in range(0, per_batch, a.chunk_tokens):
        chunks.append(min(per_batch, lo + a.chunk_tokens) - lo)
    reps = (n_tokens // per_batch) * n_layers
    w1 = torch.randn(E, H, 2 * D, device=a.device, dtype=dt)
    w2 = torch.randn(E, D, H, device=a.device, dtype=dt)
    bufs = [
        (torch.randn(E, t, H, device=a.device, dtype=dt), torch.randn(E, t, D, device=a.device, dtype=dt))
        for t in sorted(set(chunks))
    ]
    by_t = {x.shape[1]: (x, y) for x, y in bufs}
    out_dtype = torch.float32 if dt in (torch.bfloat16, torch.float16) and a.device == "cuda" else None

    def gram(f):
        F = f.reshape(E, -1)
        return torch.mm(F, F.T, out_dtype=out_dtype) if out_dtype else F @ F.T

    def run():
        for _ in range(reps):
            for t in chunks:
                x, h = by_t[t]
                torch.bmm(x, w1)
                f = torch.bmm(h, w2)
                gram(f)

    return run


def machine(device: str) -> str:
    return describe(device)


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    from workers.families import get_adapter

    model = build_model(a)
    adapter = get_adapter(model)
    g = torch.Generator().manual_seed(a.seed)
    batches = [
        (
            torch.randint(0, a.vocab, (a.batch_size, a.seq_len), generator=g).to(a.device),
            torch.ones(a.batch_size, a.seq_len, dtype=torch.long, device=a.device),
        )
        for _ in range(a.batches)
    ]
    n_tokens = a.batches * a.batch_size * a.seq_len
    n_layers = len(adapter.moe_layers(model))
    E, H, D = a.experts, a.hidden, a.inter
    flops = n_layers * n_tokens * (6 * E * H * D + 2 * E * E * H)

    def forward():
        with torch.no_grad():
            for ids, mask in batches:
                model(input_ids=ids, attention_mask=mask, use_cache=False, logits_to_keep=1)

    t_fwd = timed(forward, a.device, a.repeats)
    t_collect = timed(lambda: collect_stats(model, adapter, batches, a.chunk_tokens), a.device, a.repeats)
    records = capture(model, adapter, batches)
    t_batched = timed(
        lambda: replay(model, adapter, records, a.chunk_tokens, LayerAccumulator), a.device, a.repeats
    )
    t_loop = timed(
        lambda: replay(model, adapter, records, a.chunk_tokens, LoopAccumulator),
        a.device,
        max(1, a.repeats // 2),
    )
    t_raw = timed(raw_matmuls(a, n_tokens, n_layers), a.device, a.repeats)

    # the two passes must agree (same statistics, different expert loops)
    b = replay(model, adapter, records, a.chunk_tokens, LayerAccumulator)
    lp = replay(model, adapter, records, a.chunk_tokens, LoopAccumulator)
    diff = max(
        float((b[i].sums[k] - lp[i].sums[k]).abs().max() / lp[i].sums[k].abs().max().clamp_min(1e-30))
        for i in b
        for k in b[i].sums
    )

    gf = lambda t: flops / t / 1e9  # noqa: E731
    rows = [
        ("plain teacher forward", t_fwd, None),
        ("collect_stats (forward + stats)", t_collect, None),
        ("batched stats pass (hooks' work)", t_batched, gf(t_batched)),
        ("per-expert loop stats pass", t_loop, gf(t_loop)),
        ("raw torch matmuls, same shapes", t_raw, gf(t_raw)),
    ]
    print(f"machine : {machine(a.device)}")
    print(
        f"sizes   : preset={a.preset} H={H} I={D} E={E} k={a.top_k} moe_layers={n_layers} "
        f"tokens={n_tokens} (batches {a.batches}x{a.batch_size}x{a.seq_len}) chunk={a.chunk_tokens} "
        f"dtype={a.dtype}; matmul work {flops / 1e9:.1f} GFLOP"
    )
    print(f"{'pass':36s} {'time (s)':>10s} {'GFLOP/s':>10s}")
    for name, t, rate in rows:
        print(f"{name:36s} {t:10.4f} {'' if rate is None else f'{rate:10.1f}':>10s}")
    print(f"loop / batched          : {t_loop / t_batched:6.2f}x   (target >= 5x)")
    print(f"batched / raw throughput: {100 * t_raw / t_batched:6.1f}%   (target >= 50%)")
    print(f"collect_stats / forward : {t_collect / t_fwd:6.2f}x")
    print(f"batched vs loop stats   : max rel diff {diff:.2e}")
    if a.device == "cuda":
        print(f"peak GPU memory         : {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")


if __name__ == "__main__":
    main()
