"""What the benchmark scripts share: flags from a table of presets, the median timing of several ways side
by side, and the random-weight Qwen3-MoE config they build teachers from. Imported by name from beside the
scripts (each puts benchmarks/ on sys.path), like machine.py."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}
SMOKE_HELP = (
    "a seconds-long run through the same code paths: --preset smoke, 1 repeat "
    "(checks the script runs; its timings mean nothing)"
)


def preset_parser(
    doc: str | None,
    presets: Mapping[str, Mapping[str, Any]],
    default: str,
    *,
    device: str | None = "cpu",
    device_help: str | None = None,
    repeats: int = 3,
) -> argparse.ArgumentParser:
    """--preset, --smoke, --device, one override flag per key of the presets (None: the preset's value,
    filled in by `finish_presets`), --repeats and --seed; the script adds its own flags."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(presets), default=default)
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    ap.add_argument("--device", choices=["cpu", "cuda"], default=device, help=device_help)
    for name, value in presets[default].items():
        ap.add_argument(
            "--" + name.replace("_", "-"),
            type=type(value),
            default=None,
            help=f"override the preset ({default}: {value}, real: {presets['real'][name]})",
        )
    ap.add_argument("--repeats", type=int, default=repeats, help="timed repeats per measurement (median)")
    ap.add_argument("--seed", type=int, default=0)
    return ap


def finish_presets(
    ap: argparse.ArgumentParser,
    args: argparse.Namespace,
    presets: Mapping[str, Mapping[str, Any]],
    dtypes: Mapping[str, torch.dtype] = DTYPES,
) -> argparse.Namespace:
    """--smoke (the smoke preset, 1 repeat), the preset's value for every flag not given, a --device left
    None (cuda for the real preset, else cpu); refuses a --dtype outside `dtypes` and cuda without CUDA."""
    if args.smoke:
        args.preset, args.repeats = "smoke", 1
    for name, value in presets[args.preset].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.device is None:
        args.device = "cuda" if args.preset == "real" else "cpu"
    if args.dtype not in dtypes:
        ap.error(f"--dtype {args.dtype!r}: allowed {sorted(dtypes)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device")
    return args


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(
    fns: Mapping[str, Callable[[], object]],
    device: str,
    repeats: int,
    fewer: Mapping[str, int] | None = None,
) -> dict[str, float]:
    """Median wall time of each function over `repeats` rounds after one untimed warm-up round; the
    functions take turns within a round, so a busy machine slows them alike. `fewer`: a slow function
    timed in the first n rounds only."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(repeats):
        for name, fn in fns.items():
            if fewer is not None and i >= fewer.get(name, repeats):
                continue
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def qwen3_moe_config(
    *,
    vocab: int,
    hidden: int,
    intermediate: int,
    moe_intermediate: int,
    layers: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    experts: int,
    top_k: int,
    tokenizer: Any = None,
    **extra: Any,
):
    """A Qwen3-MoE config of these shapes, every layer sparse with normalized top-k weights (as
    Qwen3-30B-A3B); with `tokenizer`, its bos, eos and pad ids; `extra`: any other field of the config."""
    from transformers import Qwen3MoeConfig

    if tokenizer is not None:
        extra |= dict(
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    return Qwen3MoeConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        moe_intermediate_size=moe_intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        **extra,
    )


def preset_moe_config(a: argparse.Namespace, experts: int | None = None):
    """The config of a preset's random-weight teacher from its flags (--hidden, --inter, --experts, --top-k,
    --layers, --heads, --kv-heads, --head-dim, --vocab, --seq-len): `experts` (default --experts) experts,
    a dense width of 4·inter, positions for at least 4096 tokens."""
    return qwen3_moe_config(
        vocab=a.vocab,
        hidden=a.hidden,
        intermediate=4 * a.inter,
        moe_intermediate=a.inter,
        layers=a.layers,
        heads=a.heads,
        kv_heads=a.kv_heads,
        head_dim=a.head_dim,
        experts=a.experts if experts is None else experts,
        top_k=a.top_k,
        max_position_embeddings=max(4096, a.seq_len),
    )
