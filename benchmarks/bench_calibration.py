"""Benchmark of the calibration statistics pass (workers/calibration/calibrate.py).

Measured side by side in one run, on the same tokens of a random-weight Qwen3-MoE model:
  - plain teacher forward (no hooks);
  - collect_stats end to end (forward + all-experts statistics);
  - the batched statistics pass alone (the hooks' work, replayed on captured router inputs);
  - the same statistics with a per-expert Python loop (one expert's matmuls at a time);
  - the pass as it was before 2026-11-26 (its outputs read three times; PreviousAccumulator);
  - raw torch matmuls of the same shapes (bmm gate/up, bmm down, Gram mm) on random contiguous tensors.
Timed round-robin (one call of each per round after one untimed warm-up round, so a busy machine slows them
alike; the slow loop in the first half of the rounds only); prints medians.
Achieved GFLOP/s count the expert matmuls (6·T·E·H·I) plus the Gram (2·E²·T·H).
Beside the times, the bytes every non-GEMM op of a pass reads and writes, per token (counted by a dispatch
mode, not timed: what the pass adds to its matmuls' memory traffic, the same on any device).
Targets: batched ≥5× the loop, ≥80% of the raw matmul throughput on a GPU. No asserts: it only prints.

  .venv/bin/python benchmarks/bench_calibration.py                       # tiny, CPU
  python benchmarks/bench_calibration.py --preset real --device cuda     # Qwen3-30B-A3B layer shapes
  .venv/bin/python benchmarks/bench_calibration.py --smoke               # seconds: does it still run?
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import DTYPES as ALL_DTYPES  # noqa: E402  (benchmarks/common.py, beside this script)
from common import finish_presets, preset_moe_config, preset_parser, timed  # noqa: E402
from machine import describe  # noqa: E402  (benchmarks/machine.py, beside this script)

from workers.calibration.calibrate import LayerAccumulator, _gram, collect_stats  # noqa: E402
from workers.core.types import STATS_TENSORS, LayerStats  # noqa: E402
from workers.methods.experts import activation, all_expert_outputs, fused_gate_up  # noqa: E402

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
DTYPES = {k: v for k, v in ALL_DTYPES.items() if k != "float64"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = preset_parser(__doc__, PRESETS, "tiny")
    return finish_presets(ap, ap.parse_args(argv), PRESETS, DTYPES)


def build_model(a: argparse.Namespace):
    from transformers import AutoModelForCausalLM

    cfg = preset_moe_config(a)
    torch.manual_seed(a.seed)
    with torch.device(a.device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=DTYPES[a.dtype])
    return model.eval()


def loop_expert_pass(experts, x, fused=None):
    """The baseline: one expert's matmuls at a time, in a Python loop; (a [E, T, I], f [E, T, H])."""
    x = x.to(experts.gate.dtype)
    E, D, H = experts.gate.shape
    a = torch.empty(E, x.shape[0], D, dtype=x.dtype, device=x.device)
    f = torch.empty(E, x.shape[0], H, dtype=x.dtype, device=x.device)
    pick = lambda t, e: 0 if t is None else t[e]  # noqa: E731
    for e in range(E):
        g = x @ experts.gate[e].T + pick(experts.gate_bias, e)
        u = x @ experts.up[e].T + pick(experts.up_bias, e)
        a[e] = activation(g, u, experts.act, experts.act_alpha, experts.act_limit)
        f[e] = a[e] @ experts.down[e].T + pick(experts.down_bias, e)
    return a, f


class LoopAccumulator(LayerAccumulator):
    """The same statistics and reductions; only the expert computation is a per-expert loop."""

    expert_outputs = staticmethod(loop_expert_pass)


class PreviousAccumulator(LayerAccumulator):
    """The pass as it was before 2026-11-26 (64% of raw matmul on an H100 on 2026-11-25), kept to measure
    side by side: every chunk's [E, t, H] outputs read three times after they are written (the Gram, every
    token's norm, Σ_t f), and the input's second moment as a float64 GEMM."""

    def update(self, x, p, weights, indices, mask) -> None:
        if self.sums is None:
            self._init(x.device)
            self.sums["sum_out"] = torch.zeros(self.experts.num_experts, self.experts.hidden).to(self.sum_act)
        s, m, k = self.sums, mask.to(x.device), indices.shape[1]
        idx = indices.to(x.device).long()
        p64 = torch.where(m[:, None], p.double(), 0.0)
        w64 = torch.where(m[:, None], weights.double(), 0.0)
        self.n_tokens += m.sum()
        s["sum_p"] += p64.sum(0)
        s["count"].index_add_(0, idx.reshape(-1), m[:, None].expand(-1, k).reshape(-1).double())
        s["sum_p_sel"].index_add_(0, idx.reshape(-1), p64.gather(1, idx).reshape(-1))
        s["gram_p"] += p64.T @ p64
        xz = torch.where(m[:, None], x, 0)
        x64 = xz.double()
        s["sum_xx"] += x64.T @ x64
        fused = fused_gate_up(self.experts)
        for lo in range(0, x.shape[0], self.chunk):
            hi = min(x.shape[0], lo + self.chunk)
            f = all_expert_outputs(self.experts, xz[lo:hi], fused)
            wide = torch.float64 if f.dtype == torch.float64 else torch.float32
            norms = torch.linalg.vector_norm(f, dim=-1, dtype=wide).double()
            s["sum_sq"] += norms.square().sum(1)
            sel = idx[lo:hi].T
            nsel = norms.gather(0, sel)
            s["sum_norm_sel"].index_add_(0, sel.reshape(-1), nsel.reshape(-1))
            s["sum_gnorm_sel"].index_add_(0, sel.reshape(-1), (w64[lo:hi].T * nsel).reshape(-1))
            s["sum_pnorm_sel"].index_add_(
                0, sel.reshape(-1), (p64[lo:hi].gather(1, sel.T).T * nsel).reshape(-1)
            )
            s["max_norm_sel"].scatter_reduce_(0, sel.reshape(-1), nsel.reshape(-1), reduce="amax")
            s["gram"] += _gram(f).double()
            s["sum_out"] += f.sum(1, dtype=wide).double()

    def finish(self):
        sums = dict(self.sums)
        return LayerStats(n_tokens=int(self.n_tokens.item()), sum_out=sums.pop("sum_out"), **sums)


PASSES = {"batched": LayerAccumulator, "loop": LoopAccumulator, "previous": PreviousAccumulator}
GEMMS = {"mm", "bmm", "addmm", "baddbmm"}
PARTIAL_READS = {"index_select", "gather"}  # read only what they return


class Traffic(TorchDispatchMode):
    """Bytes read and written by every op that is not a GEMM (views move nothing; an index_select or
    gather reads what it returns): the memory traffic a pass adds to its matmuls, counted, not timed."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._schema.name.split("::")[-1]
        if name in GEMMS or func.is_view:
            return out
        outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        ins = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        written = sum(t.numel() * t.element_size() for t in outs)
        if name in PARTIAL_READS:
            read = written + sum(t.numel() * t.element_size() for t in ins if not t.is_floating_point())
        else:
            read = sum(t.numel() * t.element_size() for t in ins if t.numel() > 1)
        self.bytes += read + written
        return out


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

    records = capture(model, adapter, batches)
    secs = timed(
        {
            "forward": forward,
            "collect": lambda: collect_stats(model, adapter, batches, a.chunk_tokens),
            **{
                name: (lambda cls=cls: replay(model, adapter, records, a.chunk_tokens, cls))
                for name, cls in PASSES.items()
            },
            "raw": raw_matmuls(a, n_tokens, n_layers),
        },
        a.device,
        a.repeats,
        fewer={"loop": max(1, a.repeats // 2)},  # the per-expert loop is the slow one
    )
    t_fwd, t_collect, t_batched, t_loop, t_previous, t_raw = (
        secs[k] for k in ("forward", "collect", "batched", "loop", "previous", "raw")
    )

    def traffic(cls) -> float:
        """Non-GEMM bytes per token of one pass (counted on the first layer's records)."""
        first = [r for r in records if r[0] == records[0][0]]
        with Traffic() as t:
            replay(model, adapter, first, a.chunk_tokens, cls)
        return t.bytes / sum(len(r[1]) for r in first)

    bytes_now, bytes_previous = traffic(LayerAccumulator), traffic(PreviousAccumulator)

    # the passes must agree (same statistics, different expert loops and reductions)
    stats = {
        cls: {i: acc.finish() for i, acc in replay(model, adapter, records, a.chunk_tokens, cls).items()}
        for cls in PASSES.values()
    }

    def max_rel(other) -> float:
        b, o = stats[LayerAccumulator], stats[other]
        return max(
            float(
                (getattr(b[i], k) - getattr(o[i], k)).abs().max()
                / getattr(o[i], k).abs().max().clamp_min(1e-30)
            )
            for i in b
            for k in STATS_TENSORS
        )

    gf = lambda t: flops / t / 1e9  # noqa: E731
    rows = [
        ("plain teacher forward", t_fwd, None),
        ("collect_stats (forward + stats)", t_collect, None),
        ("batched stats pass (hooks' work)", t_batched, gf(t_batched)),
        ("previous batched pass (f read 3x)", t_previous, gf(t_previous)),
        ("per-expert loop stats pass", t_loop, gf(t_loop)),
        ("raw torch matmuls, same shapes", t_raw, gf(t_raw)),
    ]
    print(f"machine : {describe(a.device)}")
    print(
        f"sizes   : preset={a.preset} H={H} I={D} E={E} k={a.top_k} moe_layers={n_layers} "
        f"tokens={n_tokens} (batches {a.batches}x{a.batch_size}x{a.seq_len}) chunk={a.chunk_tokens} "
        f"dtype={a.dtype}; matmul work {flops / 1e9:.1f} GFLOP"
    )
    print(f"{'pass':36s} {'time (s)':>10s} {'GFLOP/s':>10s}")
    for name, t, rate in rows:
        print(f"{name:36s} {t:10.4f} {'' if rate is None else f'{rate:10.1f}':>10s}")
    print(f"loop / batched          : {t_loop / t_batched:6.2f}x   (target >= 5x)")
    print(f"batched / raw throughput: {100 * t_raw / t_batched:6.1f}%   (target >= 80%)")
    print(f"previous / raw          : {100 * t_raw / t_previous:6.1f}%")
    print(f"previous / batched time : {t_previous / t_batched:6.2f}x")
    print(
        f"non-matmul traffic/token: {bytes_now / 1e3:.1f} kB, previous {bytes_previous / 1e3:.1f} kB "
        f"({bytes_previous / bytes_now:.2f}x less now)"
    )
    print(f"collect_stats / forward : {t_collect / t_fwd:6.2f}x")
    print(f"batched vs loop stats   : max rel diff {max_rel(LoopAccumulator):.2e}")
    print(f"batched vs previous     : max rel diff {max_rel(PreviousAccumulator):.2e}")
    if a.device == "cuda":
        print(f"peak GPU memory         : {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")


if __name__ == "__main__":
    main()
