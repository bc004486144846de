"""Benchmark of the pre-distill sweep: N conversions of one teacher, evaluated two ways.

Measured side by side in one run, on the same plans, text and machine (each configuration does both
paths back to back, after one untimed warm-up round):
  in-memory  the pipeline's way (workers/run/ppl_pre.py): the teacher and its tokenizer stay
             resident; each student is gathered from the teacher with
             build_student_from_plans(..., share_weights=True) (only the FFN tensors are new, nothing is
             written) and workers.evaluation.ppl.perplexity runs on the held-out text, whose token ids are computed
             once (workers.evaluation.ppl.text_ids, as stages.ppl_record caches them per worker);
  naive      what a user would script: build a standalone student (share_weights=False),
             save_pretrained + tokenizer.save_pretrained into a temporary directory,
             AutoModelForCausalLM.from_pretrained + AutoTokenizer.from_pretrained, evaluate the same text.
The perplexities of both paths must agree to float tolerance (the script exits 1 otherwise). Planning
(score → select → group → α, workers.methods.planning.plan_layer) is the same work in both paths: it is timed
and printed, but not part of the ratio. Target (issue): naive / in-memory ≥ 10× at the tiny scale.

Evaluation alone, side by side on the same in-memory students: the chunked head (perplexity's default:
decoder body, then the head per chunk of tokens), compiled layers (`--compile`, as the sweep's ppl.compile;
auto = on CUDA) and the full-logits path (model(ids).logits, the path before the chunked head, run at the
largest batch up to --logits-batch-size that fits). Each is printed in seconds per student and as a
multiple of its FLOP time (the student's forward FLOPs over the evaluated tokens — 2 × linear weights per
token plus causal attention — at the device's nominal dense peak, or a measured matmul rate on a CPU),
with the grid it projects: students × (build + eval) + calibration. With --preset real the held-out text
is repeated until it fills --max-windows windows (random weights: its content does not matter).
No assert on timings: it only prints.

  .venv/bin/python benchmarks/bench_predistill.py                        # small tiny teacher, CPU
  .venv/bin/python benchmarks/bench_predistill.py --spec default         # the `tiny` sweep's teacher
  python benchmarks/bench_predistill.py --preset real --device cuda      # Qwen3-30B-A3B shapes, 2 layers
  python benchmarks/bench_predistill.py --preset real --device cuda --layers 48 --skip-naive \
      --seq-len 2048 --max-windows 140 --batch-size 16 --logits-batch-size 4 --n 4   # full depth
  .venv/bin/python benchmarks/bench_predistill.py --smoke                # seconds: does it still run?
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import qwen3_moe_config, sync  # noqa: E402  (benchmarks/common.py, beside this script)
from machine import describe  # noqa: E402  (benchmarks/machine.py, beside this script)

# a small tiny teacher: trains in well under a minute on 2 CPU cores, cached under --home
SMALL_SPEC = dict(
    experts=16,
    top_k=2,
    hidden=64,
    layers=2,
    heads=4,
    kv_heads=2,
    moe_intermediate=64,
    vocab=512,
    steps=60,
    batch_size=8,
    seq_len=64,
    corpus_chars=300_000,
    eval_windows=16,
)
# --smoke: a tiny teacher trained for a few steps on a short corpus (seconds; timings mean nothing)
SMOKE_SPEC = dict(
    experts=8,
    top_k=2,
    hidden=32,
    layers=2,
    heads=2,
    kv_heads=1,
    moe_intermediate=32,
    vocab=512,
    steps=4,
    batch_size=4,
    seq_len=32,
    warmup=1,
    corpus_chars=100_000,
    eval_windows=4,
)
SMOKE_SIZES = dict(n=2, seq_len=32, max_windows=4, batch_size=4, calib_samples=8)
# Qwen3-30B-A3B's config cut to 2 layers, random weights (no download ever)
REAL = dict(
    hidden=2048,
    moe_intermediate=768,
    experts=128,
    top_k=8,
    layers=2,
    heads=32,
    kv_heads=4,
    head_dim=128,
    vocab=151936,
)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
SCORINGS = ("SF", "DO-ACP", "CP", "ACP", "PP", "DO-CP", "PS")
GROUPINGS = ("RR", "OC", "WC", "AB", "RC")
SCALINGS = ("uniform", "proportional")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--preset",
        choices=["tiny", "real"],
        default="tiny",
        help="tiny: a trained tiny teacher; real: Qwen3-30B-A3B shapes (2 layers, random weights)",
    )
    ap.add_argument(
        "--spec",
        choices=["small", "default"],
        default="small",
        help="tiny teacher: small (bench size) or default (TinyTeacherSpec(), the `tiny` sweep's)",
    )
    ap.add_argument(
        "--home", default=".moesweep/bench", help="cache directory (tiny teacher, corpus, tokenizer)"
    )
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="tiny: float32; real: bfloat16")
    ap.add_argument("--n", type=int, default=12, help="number of configurations")
    ap.add_argument("--seq-len", type=int, default=128, help="perplexity window (the tiny sweep: 128)")
    ap.add_argument("--max-windows", type=int, default=48, help="perplexity windows (the tiny sweep: 48)")
    ap.add_argument("--batch-size", type=int, default=16, help="perplexity batch size")
    ap.add_argument("--calib-samples", type=int, default=64, help="calibration windows")
    ap.add_argument("--tol", type=float, default=1e-4, help="max relative |Δppl| between the two paths")
    ap.add_argument(
        "--layers", type=int, default=None, help="real preset: decoder layers (default 2; 48 = full)"
    )
    ap.add_argument(
        "--skip-naive",
        action="store_true",
        help="do not run the naive save/load path (at full depth each student would be written to disk)",
    )
    ap.add_argument(
        "--compile",
        choices=["auto", "true", "false"],
        default="auto",
        help="compile the students' decoder layers (the sweep's ppl.compile; auto = on CUDA)",
    )
    ap.add_argument(
        "--logits-batch-size",
        type=int,
        default=None,
        help="full-logits path: largest batch to try (default --batch-size; halved while out of memory)",
    )
    ap.add_argument(
        "--grid-students",
        type=int,
        default=None,
        help="students of the projected grid (default: every scoring × grouping × scaling × K here)",
    )
    ap.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="the device's dense peak for FLOP time (default: by name)",
    )
    ap.add_argument(
        "--smoke",
        action="store_true",
        help=f"a seconds-long run through the same code paths (checks the script runs; its timings "
        f"mean nothing): tiny preset, a {SMOKE_SPEC['steps']}-step teacher, "
        + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in SMOKE_SIZES.items()),
    )
    a = ap.parse_args(argv)
    if a.smoke:
        if a.preset != "tiny":
            ap.error("--smoke runs the tiny preset")
        a.spec = "smoke"
        for k, v in SMOKE_SIZES.items():
            setattr(a, k, v)
    a.dtype = a.dtype or ("bfloat16" if a.preset == "real" else "float32")
    if a.layers is not None and a.preset != "real":
        ap.error("--layers sets the depth of the real preset")
    a.layers = REAL["layers"] if a.layers is None else a.layers
    if a.layers < 1:
        ap.error(f"--layers {a.layers}: must be >= 1")
    a.logits_batch_size = a.logits_batch_size or a.batch_size
    if a.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device")
    if a.n < 1:
        ap.error(f"--n {a.n}: must be >= 1")
    return a


def clock(device: str) -> float:
    sync(device)
    return time.perf_counter()


# ---- teacher, text, calibration ------------------------------------------------------------------
def tiny_teacher(a: argparse.Namespace):
    """(model, tokenizer, corpus directory, description): trained once, then read from the cache."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from workers.tiny.teacher import TinyTeacherSpec, train_tiny_teacher

    spec = TinyTeacherSpec(**{"small": SMALL_SPEC, "smoke": SMOKE_SPEC}.get(a.spec, {}))
    home = Path(a.home)
    out = home / "predistill" / f"teacher-{a.spec}"
    t0 = time.perf_counter()
    rec = train_tiny_teacher(spec, out, cache_dir=home / "cache" / "tiny")
    took = time.perf_counter() - t0
    model = AutoModelForCausalLM.from_pretrained(out, dtype=DTYPES[a.dtype]).to(a.device).eval()
    tok = AutoTokenizer.from_pretrained(out)
    desc = (
        f"tiny teacher (--spec {a.spec}): E={spec.experts} k={spec.top_k} H={spec.hidden} "
        f"I={spec.moe_intermediate} layers={spec.layers} vocab={spec.vocab} steps={spec.steps} "
        f"({'cached' if rec.get('cached') else 'trained'} in {took:.1f}s)"
    )
    return model, tok, out / "corpus", desc


def real_teacher(a: argparse.Namespace):
    """Random-weight Qwen3-30B-A3B-shaped teacher (2 layers); text and tokenizer of the small tiny corpus."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from workers.tiny.teacher import TinyTeacherSpec, prepare_data

    data = prepare_data(TinyTeacherSpec(**SMALL_SPEC), Path(a.home) / "cache" / "tiny")
    tok = AutoTokenizer.from_pretrained(data["tokenizer_dir"])
    r = REAL
    cfg = qwen3_moe_config(
        **(r | {"layers": a.layers}),
        intermediate=6144,
        tokenizer=tok,
        tie_word_embeddings=False,
        max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    with torch.device(a.device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=DTYPES[a.dtype]).eval()
    desc = (
        f"real preset: Qwen3-30B-A3B shapes, random weights: E={r['experts']} k={r['top_k']} H={r['hidden']} "
        f"I={r['moe_intermediate']} layers={a.layers} vocab={r['vocab']} "
        f"({sum(p.numel() for p in model.parameters()) / 1e9:.2f}B params); text/tokenizer: small tiny corpus"
    )
    return model, tok, Path(data["corpus_dir"]), desc


def split_texts(corpus: Path, split: str) -> list[str]:
    """The non-empty texts of one split of the embedded corpus (as workers.core.data.load_texts reads them)."""
    from workers.core.tiny_corpus import read_split

    return [r["text"] for r in read_split(corpus, split) if r["text"].strip()]


def make_plans(model, adapter, tok, corpus: Path, a: argparse.Namespace):
    """Calibrate once, then N distinct (scoring, grouping, scaling, K) plans over every MoE layer."""
    from workers.calibration.calibrate import collect_stats
    from workers.core.data import token_windows
    from workers.methods.planning import plan_layer, plan_signature
    from workers.models.convert import layer_contexts

    train = split_texts(corpus, "train")
    ids = token_windows(tok, train, a.seq_len, a.calib_samples, seed=1234).to(a.device)
    batches = [(ids[i : i + 8], torch.ones_like(ids[i : i + 8])) for i in range(0, len(ids), 8)]
    t0 = clock(a.device)
    stats = collect_stats(model, adapter, batches, chunk_tokens=1024)
    t_calib = clock(a.device) - t0
    contexts = layer_contexts(model, adapter, stats)
    E, k = adapter.num_experts(model), adapter.top_k(model)
    Ks = [K for K in (2 * k, 4 * k, k) if K <= E]
    grid = list(itertools.product(SCORINGS, GROUPINGS, SCALINGS, Ks))
    random.Random(0).shuffle(grid)  # spread the N configurations over the whole grid
    a.grid_size = len(grid)
    configs, seen = [], set()
    for scoring, grouping, scaling, K in grid:
        if len(configs) == a.n:
            break
        t0 = time.perf_counter()
        plans = [
            plan_layer(layer, ctx, scoring, grouping, scaling, K) for layer, ctx in sorted(contexts.items())
        ]
        t_plan = time.perf_counter() - t0
        sig = plan_signature(plans)
        if sig in seen:  # equal plans are one student: the sweep would evaluate it once
            continue
        seen.add(sig)
        configs.append(
            {"name": f"{scoring}/{grouping}/{scaling[:4]}/K={K}", "plans": plans, "plan_s": t_plan}
        )
    del stats, contexts  # the plans are all that is kept
    return configs, t_calib, len(ids) * a.seq_len


# ---- the two paths ---------------------------------------------------------------------------------
def evaluate(student, tok, texts, a, ids=None, **kw) -> tuple[dict, float]:
    """(perplexity's record, seconds) of one evaluation; `kw` = perplexity's compile_layers / full_logits /
    batch_size."""
    from workers.evaluation.ppl import perplexity

    kw = {"batch_size": a.batch_size, "compile_layers": a.compile_on, **kw}
    t0 = clock(a.device)
    r = perplexity(
        student,
        tok,
        texts,
        seq_len=a.seq_len,
        add_bos=False,
        device=a.device,
        max_windows=a.max_windows,
        ids=ids,
        **kw,
    )
    return r, clock(a.device) - t0


def in_memory(model, adapter, tok, texts, plans, a, ids=None, variants: bool = False):
    """The pipeline's path; with `variants`, the same student also through the full-logits path (the largest
    batch up to --logits-batch-size that fits) and, when layers are compiled, the chunked head eagerly."""
    from workers.models.convert import build_student_from_plans

    t0 = clock(a.device)
    student = build_student_from_plans(model, adapter, plans, share_weights=True).to(a.device)
    t1 = clock(a.device)
    r, t_eval = evaluate(student, tok, texts, a, ids)
    out = {
        "build": t1 - t0,
        "eval": t_eval,
        "ppl": r["ppl"],
        "width": student.config.intermediate_size,
        "windows": r["protocol"]["n_windows"],
        "flops": forward_flops(student, r["window_tokens"]),
    }
    if variants:
        if a.compile_on:
            out["eager_ppl"], out["eager"] = _ppl_time(
                evaluate(student, tok, texts, a, ids, compile_layers=False)
            )
        out["logits_ppl"], out["logits"], out["logits_batch"] = full_logits(student, tok, texts, a, ids)
    del student
    return out


def _ppl_time(res: tuple[dict, float]) -> tuple[float, float]:
    return res[0]["ppl"], res[1]


def full_logits(student, tok, texts, a, ids) -> tuple[float, float, int]:
    """(ppl, seconds, batch) of the full-logits path, eager, at the largest batch ≤ --logits-batch-size that
    fits ([B, T, V] logits: at full vocabulary a large batch runs out of GPU memory)."""
    batch = a.logits_batch_size
    while True:
        try:
            r, t = evaluate(
                student, tok, texts, a, ids, compile_layers=False, full_logits=True, batch_size=batch
            )
            return r["ppl"], t, batch
        except torch.OutOfMemoryError:
            if batch == 1:
                raise
        batch //= 2  # out of memory (its traceback released here, so the cache can be emptied)
        torch.cuda.empty_cache()


def forward_flops(student, window_tokens: list[int]) -> float:
    """FLOPs of the (dense) student's forward over the evaluated windows: 2 × its linear weights per position
    (the LM head included) plus causal attention, 2 · layers · heads · head_dim · T(T+1) per window of T
    inputs. Without BOS a window's inputs are as many as its scored tokens."""
    cfg = student.config
    linear = sum(m.weight.numel() for m in student.modules() if isinstance(m, torch.nn.Linear))
    heads = cfg.num_attention_heads
    attn = cfg.num_hidden_layers * heads * (getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    return float(sum(2 * linear * t + 2 * attn * t * (t + 1) for t in window_tokens))


# dense bf16 peaks (TFLOP/s, NVIDIA data sheets; SXM unless named), matched in this order against the name
NOMINAL_BF16_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),
    ("H200", 989.0),
    ("A100", 312.0),
)


def peak_flops(a: argparse.Namespace) -> tuple[float, str]:
    """(FLOP/s, where the number comes from): --peak-tflops, the GPU's nominal bf16 peak, or else a measured
    rate of square matmuls in the evaluation dtype on this device."""
    if a.peak_tflops:
        return a.peak_tflops * 1e12, "--peak-tflops"
    if a.device == "cuda" and a.dtype == "bfloat16":
        name = torch.cuda.get_device_name()
        for key, tflops in NOMINAL_BF16_TFLOPS:
            if key in name:
                return tflops * 1e12, f"nominal dense bf16 peak of {key}"
    n = 4096 if a.device == "cuda" else 1024
    x = torch.randn(n, n, device=a.device, dtype=DTYPES[a.dtype])
    x @ x  # noqa: B018  (warm-up)
    reps, t0 = 10, clock(a.device)
    for _ in range(reps):
        x @ x  # noqa: B018
    return 2 * n**3 * reps / (clock(a.device) - t0), f"measured {n}² {a.dtype} matmul rate"


def say(label: str, value: str) -> None:
    """One result line, the values aligned in one column."""
    print(f"{label:52s}: {value}")


def minutes(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 5400 else f"{seconds / 60:.1f} min"


def naive(model, adapter, tok, texts, plans, a):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from workers.models.convert import build_student_from_plans

    tmp = Path(tempfile.mkdtemp(prefix="bench_predistill_"))
    try:
        t0 = clock(a.device)
        student = build_student_from_plans(model, adapter, plans, share_weights=False)
        t1 = clock(a.device)
        student.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        del student
        t2 = clock(a.device)
        loaded = AutoModelForCausalLM.from_pretrained(tmp, dtype=DTYPES[a.dtype]).to(a.device).eval()
        tok2 = AutoTokenizer.from_pretrained(tmp)
        t3 = clock(a.device)
        r, t_eval = evaluate(loaded, tok2, texts, a)
        size = sum(f.stat().st_size for f in tmp.rglob("*") if f.is_file())
        del loaded
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {
        "build": t1 - t0,
        "save": t2 - t1,
        "load": t3 - t2,
        "eval": t_eval,
        "ppl": r["ppl"],
        "bytes": size,
    }


def tokenize_time(tok, texts: list[str], repeats: int = 3) -> tuple[float, int]:
    """What perplexity() spends tokenizing the joined text (it does so on every call)."""
    times, n = [], 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        n = len(tok("\n\n".join(texts), add_special_tokens=False, verbose=False)["input_ids"])
        times.append(time.perf_counter() - t0)
    return statistics.median(times), n


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    from transformers.utils import logging as hf_logging

    from workers.evaluation.ppl import compile_setting, text_ids
    from workers.families import get_adapter

    hf_logging.disable_progress_bar()  # save/load bars would interleave with the table
    hf_logging.set_verbosity_error()
    a.compile_on = compile_setting({"true": True, "false": False}.get(a.compile, "auto"), a.device)

    model, tok, corpus, desc = (real_teacher if a.preset == "real" else tiny_teacher)(a)
    adapter = get_adapter(model)
    texts = split_texts(corpus, "test")
    configs, t_calib, calib_tokens = make_plans(model, adapter, tok, corpus, a)

    # the pipeline's worker (stages.ppl_record) tokenizes the held-out text once per resident tokenizer
    ids = text_ids(tok, texts)
    if a.preset == "real":  # random weights: the text is repeated until it fills the windows
        texts = texts * -(-(a.max_windows * a.seq_len) // len(ids))
        ids = text_ids(tok, texts)
    # warm-up: first calls pay one-off costs (imports, kernels, allocator, compiling) that no path owns
    first = in_memory(model, adapter, tok, texts, configs[0]["plans"], a, ids, variants=True)
    if not a.skip_naive:
        naive(model, adapter, tok, texts, configs[0]["plans"], a)

    rows = []
    for c in configs:
        m = in_memory(model, adapter, tok, texts, c["plans"], a, ids, variants=True)
        n = None if a.skip_naive else naive(model, adapter, tok, texts, c["plans"], a)
        rows.append((c, m, n))
    t_tok, n_text_tokens = tokenize_time(tok, texts)

    mem = [m["build"] + m["eval"] for _, m, _ in rows]
    mtot = {k: sum(m[k] for _, m, _ in rows) for k in ("build", "eval")}
    plan_total = sum(c["plan_s"] for c in configs)

    print(f"machine : {describe(a.device)}")
    print(f"teacher : {desc}")
    print(
        f"sizes   : N={len(rows)} configurations; dtype={a.dtype}; calibration {calib_tokens} tokens "
        f"({t_calib:.2f}s, once); perplexity seq_len={a.seq_len} windows={rows[0][1]['windows']} "
        f"batch={a.batch_size}; held-out text {n_text_tokens} tokens; student width "
        f"{sorted({m['width'] for _, m, _ in rows})}"
        + ("" if a.skip_naive else f"; saved student {rows[0][2]['bytes'] / 2**20:.1f} MiB")
    )
    summary: dict[str, float] = {"n": len(rows), "in_memory_s": sum(mem)}
    if not a.skip_naive:
        summary |= paths_table(rows, mem, mtot, plan_total, t_tok, a)
    summary |= evaluation_table(rows, first, t_calib, a)
    if a.device == "cuda":
        print(
            f"peak GPU memory                                     : "
            f"{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB"
        )
    print("json    :", json.dumps(summary))
    worst = max(summary.get(k, 0.0) for k in ("max_rel_dppl", "max_rel_dppl_logits", "max_rel_dppl_eager"))
    if worst > a.tol:
        print(f"MISMATCH: perplexities of two paths differ by {worst:.2e} > {a.tol:g}")
        return 1
    return 0


def paths_table(rows, mem, mtot, plan_total, t_tok, a) -> dict[str, float]:
    """The in-memory vs naive table and its ratios."""
    nav = [n["build"] + n["save"] + n["load"] + n["eval"] for _, _, n in rows]
    drel = [abs(m["ppl"] - n["ppl"]) / abs(n["ppl"]) for _, m, n in rows]
    tot = {k: sum(n[k] for _, _, n in rows) for k in ("build", "save", "load", "eval")}
    print()
    hdr = (
        f"{'configuration':28s} {'plan':>6s} | {'build':>6s} {'eval':>6s} {'total':>6s} | {'build':>6s} "
        f"{'save':>6s} {'load':>6s} {'eval':>6s} {'total':>6s} | {'ratio':>6s} {'ppl':>9s} {'|Δ|rel':>8s}"
    )
    print(f"{'':28s} {'':6s} | {'in-memory (s)':^20s} | {'naive (s)':^34s} |")
    print(hdr)
    print("-" * len(hdr))
    for (c, m, n), tm, tn, d in zip(rows, mem, nav, drel, strict=True):
        print(
            f"{c['name']:28s} {c['plan_s']:6.3f} | {m['build']:6.3f} {m['eval']:6.3f} {tm:6.3f} | "
            f"{n['build']:6.3f} {n['save']:6.3f} {n['load']:6.3f} {n['eval']:6.3f} {tn:6.3f} | "
            f"{tn / tm:5.1f}x {m['ppl']:9.3f} {d:8.1e}"
        )
    print("-" * len(hdr))
    print(
        f"{'sum':28s} {plan_total:6.3f} | {mtot['build']:6.3f} {mtot['eval']:6.3f} {sum(mem):6.3f} | "
        f"{tot['build']:6.3f} {tot['save']:6.3f} {tot['load']:6.3f} {tot['eval']:6.3f} {sum(nav):6.3f} | "
        f"{sum(nav) / sum(mem):5.1f}x"
    )
    print()
    build_mem, build_nav = mtot["build"], tot["build"] + tot["save"] + tot["load"]
    print(
        f"naive / in-memory, per configuration (build+eval)   : {sum(nav) / sum(mem):6.2f}x   (target >= 10x)"
    )
    print(
        f"  median over configurations                        : "
        f"{statistics.median(tn / tm for tn, tm in zip(nav, mem, strict=True)):6.2f}x"
    )
    print(
        f"  with planning counted in both paths               : "
        f"{(sum(nav) + plan_total) / (sum(mem) + plan_total):6.2f}x"
    )
    print(f"student making alone: (build+save+load) / build     : {build_nav / build_mem:6.2f}x")
    print(
        f"evaluation share of the in-memory path              : {100 * mtot['eval'] / sum(mem):5.1f}%  "
        f"(tokenizing the text, once here, on every call in the naive path: {t_tok:.3f}s)"
    )
    print(f"max relative |Δppl| between the paths               : {max(drel):.2e}   (tolerance {a.tol:g})")
    return {
        "ratio": sum(nav) / sum(mem),
        "build_ratio": build_nav / build_mem,
        "max_rel_dppl": max(drel),
        "naive_s": sum(nav),
    }


def evaluation_table(rows, first: dict, t_calib: float, a) -> dict[str, float]:
    """Evaluation alone per student: full logits vs chunked head (eager, compiled), in seconds and FLOP
    time, and the grid each projects."""
    med = statistics.median
    ms = [m for _, m, _ in rows]
    peak, source = peak_flops(a)
    flops = med(m["flops"] for m in ms)
    t_flop = flops / peak
    e_new, e_old, build = (
        med(m["eval"] for m in ms),
        med(m["logits"] for m in ms),
        med(m["build"] for m in ms),
    )
    students = a.grid_students or a.grid_size
    lines = [(f"full logits (the earlier path), eager, batch {ms[0]['logits_batch']}", e_old)]
    if a.compile_on:
        lines.append((f"chunked head, eager, batch {a.batch_size}", med(m["eager"] for m in ms)))
    lines.append((f"chunked head{', compiled layers' if a.compile_on else ''}, batch {a.batch_size}", e_new))
    print()
    print(
        f"evaluation per student (median of {len(ms)}): {flops / 1e12:.3g} TFLOP = FLOP time {t_flop:.3g}s "
        f"at {peak / 1e12:.3g} TFLOP/s ({source})"
    )
    for name, t in lines:
        say(f"  {name}", f"{t:8.3f}s = {t / t_flop:6.2f}x FLOP time")
    say(f"full logits / chunked head{' (compiled)' if a.compile_on else ''}", f"{e_old / e_new:6.2f}x")
    if a.compile_on:
        e_eager = med(m["eager"] for m in ms)
        say("chunked head: eager / compiled layers", f"{e_eager / e_new:6.2f}x")
        say("first compiled evaluation (compiles; once a worker)", f"{first['eval']:6.2f}s")
    grid_new, grid_old = (students * (build + e) + t_calib for e in (e_new, e_old))
    say(
        f"projected grid of {students} students",
        f"{minutes(grid_new)} chunked{' + compiled' if a.compile_on else ''} vs {minutes(grid_old)} full "
        f"logits (students × (build {build:.3f}s + eval) + calibration {t_calib:.1f}s)",
    )
    d_old = max(abs(m["ppl"] - m["logits_ppl"]) / abs(m["logits_ppl"]) for m in ms)
    say("max relative |Δppl| chunked head vs full logits", f"{d_old:.2e}   (tolerance {a.tol:g})")
    out = {
        "eval_s": e_new,
        "eval_full_logits_s": e_old,
        "flop_s": t_flop,
        "eval_over_flop": e_new / t_flop,
        "full_logits_over_chunked": e_old / e_new,
        "grid_s": grid_new,
        "grid_full_logits_s": grid_old,
        "max_rel_dppl_logits": d_old,
    }
    if a.compile_on:
        d_eager = max(abs(m["ppl"] - m["eager_ppl"]) / abs(m["eager_ppl"]) for m in ms)
        say("max relative |Δppl| compiled vs eager layers", f"{d_eager:.2e}   (tolerance {a.tol:g})")
        out |= {"eval_eager_s": med(m["eager"] for m in ms), "first_compiled_eval_s": first["eval"]}
        out["max_rel_dppl_eager"] = d_eager
    return out


if __name__ == "__main__":
    sys.exit(main())
