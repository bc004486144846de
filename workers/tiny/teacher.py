"""The embedded default's teachers: a small Qwen3-MoE (and its parameter-matched dense twin) that
moesweep trains itself on CPU on the stdlib corpus. At this size (32 experts, top-2, 4 layers)
the scoring choice measurably changes pre-distill quality, but the ranking of scorings is not stable:
the tiny sweep demonstrates the machinery, not the paper's findings.

Everything is cached under ``$MOESWEEP_HOME/cache/tiny`` (default ``./.moesweep/cache/tiny``) by
content key: ``corpus/<key>`` (key: builder version, Python version, corpus_chars, corpus_seed),
``tokenizer/<key>`` (corpus hash, vocab, library versions) and ``model/<key>`` (kind, every spec
field, corpus and tokenizer hashes, torch/transformers versions). A cached model is copied into
``out`` instead of being retrained, once it matches its manifest ``model/<key>.manifest.json`` (the
sha256 of every file, recorded when the entry was built): one that does not (a changed, missing or
added file; no manifest) is rebuilt, with one line on stderr. A rebuild whose files (all but
tiny_meta.json, which holds wall-clock times) differ from the recorded ones says so in one line:
training on the CPU is meant to be deterministic. Cache entries are built in a temporary directory and
renamed into place (under a file lock where the OS has fcntl), so parallel workers never see half an entry.

Choices: untied input/output embeddings (as in Qwen3-30B-A3B and the measured recipe), norm_topk_prob
on, every layer sparse; a per-layer load-balancing loss instead of HF's aux loss, which pools the
routing counts of all layers before the product and so lets single layers keep dead experts
(feasibility.md §2); AdamW (betas 0.9/0.95, weight decay on matrices only), linear warmup then
cosine decay to ``lr * min_lr_ratio``, gradient clipping.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from workers.core.schedule import cosine_lr
from workers.core.steplog import StepLog
from workers.tiny.spec import TinyTeacherSpec  # noqa: F401  (re-exported)

TRAIN_VERSION = 1  # bump when training or evaluation changes: it is part of the model cache key
EVAL_BATCH = 16


# ---- pure numerics -----------------------------------------------------------------------------
def per_layer_balance_loss(
    router_logits: tuple[torch.Tensor, ...] | list[torch.Tensor], top_k: int
) -> torch.Tensor:
    """Mean over layers of the Switch-Transformer balancing loss E * sum_e f_e * P_e of each layer.

    f_e: share of the layer's tokens that route to e (sums to top_k over e), P_e: mean router
    probability of e. Each layer is balanced on its own (HF's loss pools all layers first).
    A perfectly balanced layer gives top_k, as HF's loss does.
    """
    losses = []
    for logits in router_logits:
        probs = logits.float().softmax(dim=-1)  # [T, E]
        n_tokens, n_experts = probs.shape
        idx = probs.topk(top_k, dim=-1).indices.flatten()
        f = torch.zeros(n_experts, device=probs.device).index_add_(
            0, idx, torch.ones_like(idx, dtype=probs.dtype)
        )
        losses.append(n_experts * (f / n_tokens * probs.mean(dim=0)).sum())
    return torch.stack(losses).mean()


def expert_load(router_logits: list[torch.Tensor], top_k: int) -> list[dict[str, Any]]:
    """Per layer: the largest and smallest share of top-k routing slots and the number of rare experts
    (share < 10 % of uniform)."""
    out = []
    for layer, logits in enumerate(router_logits):
        idx = logits.float().topk(top_k, dim=-1).indices.flatten()
        n_experts = logits.shape[-1]
        share = torch.bincount(idx, minlength=n_experts).double() / idx.numel()
        out.append(
            {
                "layer": layer,
                "max_share": float(share.max()),
                "min_share": float(share.min()),
                "rare": int((share < 0.1 / n_experts).sum()),
            }
        )
    return out


# ---- cache -------------------------------------------------------------------------------------
def cache_root(cache_dir: Path | str | None = None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    return Path(os.environ.get("MOESWEEP_HOME") or ".moesweep") / "cache" / "tiny"


def _key(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:20]


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # no fcntl (Windows): the atomic rename alone keeps entries whole
        yield
        return
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def cached_dir(
    path: Path, build: Callable[[Path], None], verify: Callable[[Path], str | None] | None = None
) -> bool:
    """Make ``path`` by ``build(tmp)`` once; a complete entry always exists under its final name.
    ``verify(path)``: why an existing entry is not to be used (one line), or None; one that does not
    verify is removed and built again, with one line on stderr.

    Returns True when the entry was already there.
    """
    if path.is_dir() and (verify is None or verify(path) is None):
        return True
    path.parent.mkdir(parents=True, exist_ok=True)
    with _lock(path.parent / f"{path.name}.lock"):
        if path.is_dir():
            problem = None if verify is None else verify(path)
            if problem is None:
                return True
            print(f"tiny cache {path} did not verify ({problem}): rebuilt", file=sys.stderr)
            aside = path.parent / f"{path.name}.bad-{os.getpid()}"
            shutil.rmtree(aside, ignore_errors=True)
            os.replace(path, aside)
            shutil.rmtree(aside, ignore_errors=True)
        tmp = path.parent / f"{path.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            build(tmp)
            os.replace(tmp, path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return False


def manifest(path: Path) -> dict[str, str]:
    """{POSIX path relative to ``path``: content hash (sha256)} of every file under it."""
    from workers.core.artifacts import content_hash

    return {f.relative_to(path).as_posix(): content_hash(f) for f in sorted(path.rglob("*")) if f.is_file()}


def _manifest_path(entry: Path) -> Path:
    return entry.parent / f"{entry.name}.manifest.json"


def _recorded(entry: Path, key: str) -> dict[str, str] | None:
    """The manifest recorded for the entry of ``key``; None when there is none (or it is not one)."""
    try:
        rec = json.loads(_manifest_path(entry).read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(rec, dict) and rec.get("key") == key and isinstance(rec.get("files"), dict)
    return rec["files"] if ok else None


def _differences(recorded: dict[str, str], now: dict[str, str], skip: tuple[str, ...] = ()) -> str | None:
    """The files that differ between two manifests (one line), or None."""
    out = []
    for name in sorted((set(recorded) | set(now)) - set(skip)):
        if name not in now:
            out.append(f"{name} missing")
        elif name not in recorded:
            out.append(f"{name} not recorded")
        elif recorded[name] != now[name]:
            out.append(f"{name} changed")
    return ", ".join(out) or None


def _verify(entry: Path, key: str) -> str | None:
    recorded = _recorded(entry, key)
    if recorded is None:
        return "no manifest recorded for it"
    try:
        return _differences(recorded, manifest(entry))
    except OSError as e:  # a file went away while it was hashed
        return f"unreadable: {e}"


def _record_manifest(entry: Path, built: Path, key: str) -> None:
    """Record the manifest of ``built`` (about to become ``entry``); say so when it differs from the one
    recorded before for the same key (all but tiny_meta.json, which holds wall-clock times)."""
    now = manifest(built)
    before = _recorded(entry, key)
    changed = None if before is None else _differences(before, now, skip=("tiny_meta.json",))
    if changed:
        print(
            f"tiny teacher {key}: the rebuilt model did not reproduce the recorded one ({changed}); "
            "training was not deterministic here",
            file=sys.stderr,
        )
    path = _manifest_path(entry)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps({"key": key, "files": now}, indent=1, sort_keys=True))
    os.replace(tmp, path)


def prepare_data(spec: TinyTeacherSpec, cache_dir: Path | str | None = None) -> dict[str, Any]:
    """The cached corpus and tokenizer for ``spec``: their directories and content hashes."""
    import tokenizers
    import transformers

    from workers.core.tiny_corpus import CORPUS_VERSION, build_corpus, corpus_hash, read_split, stdlib_dir
    from workers.tiny.tokenizer import tokenizer_hash, train_tokenizer

    root = cache_root(cache_dir)
    ckey = _key(
        {
            "v": CORPUS_VERSION,
            "python": sys.version,
            "stdlib": str(stdlib_dir()),
            "chars": spec.corpus_chars,
            "seed": spec.corpus_seed,
        }
    )
    cdir = root / "corpus" / ckey
    cached_dir(cdir, lambda tmp: build_corpus(tmp, spec.corpus_chars, spec.corpus_seed))
    chash = corpus_hash(cdir)
    tkey = _key(
        {
            "corpus": chash,
            "vocab": spec.vocab,
            "tokenizers": tokenizers.__version__,
            "transformers": transformers.__version__,
        }
    )
    tdir = root / "tokenizer" / tkey
    cached_dir(
        tdir, lambda tmp: train_tokenizer([r["text"] for r in read_split(cdir, "train")], spec.vocab, tmp)
    )
    return {
        "corpus_dir": cdir,
        "corpus_hash": chash,
        "tokenizer_dir": tdir,
        "tokenizer_hash": tokenizer_hash(tdir),
    }


# ---- models ------------------------------------------------------------------------------------
def _common(spec: TinyTeacherSpec, tok) -> dict[str, Any]:
    return dict(
        vocab_size=spec.vocab,
        hidden_size=spec.hidden,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        max_position_embeddings=max(2048, spec.seq_len),
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-6,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )


def moe_config(spec: TinyTeacherSpec, tok):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        **_common(spec, tok),
        num_experts=spec.experts,
        num_experts_per_tok=spec.top_k,
        moe_intermediate_size=spec.moe_intermediate,
        intermediate_size=spec.moe_intermediate,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        router_aux_loss_coef=spec.balance_coef,
        output_router_logits=False,
    )


def dense_config(spec: TinyTeacherSpec, tok, intermediate: int):
    from transformers import Qwen3Config

    return Qwen3Config(
        **_common(spec, tok), intermediate_size=intermediate, head_dim=spec.hidden // spec.heads
    )


def _n_params(config) -> int:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def matched_dense_intermediate(spec: TinyTeacherSpec, tok) -> int:
    """The dense FFN width whose model has (to one FFN unit) the MoE teacher's total parameter count."""
    target = _n_params(moe_config(spec, tok))
    base = _n_params(dense_config(spec, tok, 1))
    per_unit = 3 * spec.hidden * spec.layers  # gate, up and down rows/columns per FFN unit
    return max(1, 1 + round((target - base) / per_unit))


def train_tiny_teacher(
    spec: TinyTeacherSpec,
    out: Path,
    progress: Callable[[int, int], None] | None = None,
    cache_dir: Path | str | None = None,
) -> dict[str, Any]:
    """Train (or copy from the cache) the tiny Qwen3-MoE teacher into ``out``; return its record."""
    return _train_cached("moe", spec, Path(out), progress, cache_dir)


def train_tiny_dense(
    spec: TinyTeacherSpec,
    out: Path,
    progress: Callable[[int, int], None] | None = None,
    cache_dir: Path | str | None = None,
) -> dict[str, Any]:
    """The dense teacher of the dense-to-dense baseline: a Qwen3 model with the MoE teacher's total
    parameter count (or FFN width ``spec.dense_intermediate``), same corpus, tokenizer and training,
    no balancing loss."""
    return _train_cached("dense", spec, Path(out), progress, cache_dir)


def _train_cached(kind: str, spec: TinyTeacherSpec, out: Path, progress, cache_dir) -> dict[str, Any]:
    import transformers

    data = prepare_data(spec, cache_dir)
    key = _key(
        {
            "kind": kind,
            "spec": asdict(spec),
            "corpus": data["corpus_hash"],
            "tokenizer": data["tokenizer_hash"],
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "v": TRAIN_VERSION,
        }
    )
    mdir = cache_root(cache_dir) / "model" / key

    def build(tmp: Path) -> None:
        _train(kind, spec, tmp, data, key, progress)
        _record_manifest(mdir, tmp, key)

    hit = cached_dir(mdir, build, verify=lambda entry: _verify(entry, key))
    shutil.copytree(mdir, out, dirs_exist_ok=True)
    record = json.loads((out / "tiny_meta.json").read_text())["record"]
    if hit and progress is not None:
        progress(spec.steps, spec.steps)
    return {**record, "cached": hit, "cache_dir": str(mdir)}


def _eval_windows(tok, rows: list[dict], spec: TinyTeacherSpec) -> dict[str, torch.Tensor]:
    """Held-out windows per domain (eval_windows / 2 each, seeded by corpus_seed: the same for every teacher)."""
    from workers.core.data import token_windows

    out = {}
    for domain in ("prose", "code"):
        wins = token_windows(tok, [r["text"] for r in rows if r["domain"] == domain], spec.seq_len, None, 0)
        perm = torch.randperm(len(wins), generator=torch.Generator().manual_seed(spec.corpus_seed))
        out[domain] = wins[perm[: max(1, spec.eval_windows // 2)]]
    return out


@torch.no_grad()
def _nll(model, wins: torch.Tensor) -> tuple[float, int]:
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(wins), EVAL_BATCH):
        ids = wins[i : i + EVAL_BATCH]
        logits = model(input_ids=ids).logits[:, :-1].float()
        total += float(
            torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum"
            )
        )
        count += ids[:, 1:].numel()
    return total, count


def _ppl(model, evals: dict[str, torch.Tensor]) -> dict[str, float]:
    parts = {d: _nll(model, w) for d, w in evals.items()}
    res = {d: math.exp(s / n) for d, (s, n) in parts.items()}
    res["all"] = math.exp(sum(s for s, _ in parts.values()) / sum(n for _, n in parts.values()))
    return res


def _train(kind: str, spec: TinyTeacherSpec, out: Path, data: dict[str, Any], key: str, progress) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from workers.core.data import token_windows
    from workers.core.tiny_corpus import SPLITS, read_split

    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(data["tokenizer_dir"])
    moe = kind == "moe"
    intermediate = None
    if moe:
        config = moe_config(spec, tok)
    else:
        intermediate = spec.dense_intermediate or matched_dense_intermediate(spec, tok)
        config = dense_config(spec, tok, intermediate)
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config)
    n_params = sum(p.numel() for p in model.parameters())
    train_rows = read_split(data["corpus_dir"], "train")
    train = token_windows(
        tok, [r["text"] for r in train_rows], spec.seq_len, spec.steps * spec.batch_size, spec.seed
    )
    evals = _eval_windows(tok, read_split(data["corpus_dir"], "valid"), spec)
    random_ppl = _ppl(model, evals)  # the same weights the training starts from

    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": spec.weight_decay}, {"params": rest, "weight_decay": 0.0}],
        lr=spec.lr,
        betas=(0.9, 0.95),
    )
    curve, balance = [], []
    model.train()
    t_train = time.perf_counter()
    steplog = StepLog("dense teacher" if not moe else "teacher", spec.steps)
    for step in range(spec.steps):
        for group in opt.param_groups:
            group["lr"] = cosine_lr(step, spec.steps, spec.lr, spec.warmup, spec.lr * spec.min_lr_ratio)
        ids = train[step * spec.batch_size : (step + 1) * spec.batch_size]
        res = model(input_ids=ids, output_router_logits=True) if moe else model(input_ids=ids)
        logits = res.logits[:, :-1]
        ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        loss = ce
        if moe:
            bal = per_layer_balance_loss(res.router_logits, spec.top_k)
            balance.append(float(bal.detach()))
            loss = ce + spec.balance_coef * bal
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.grad_clip)
        opt.step()
        curve.append(float(ce.detach()))
        steplog(step + 1, curve[-1], (step + 1) * ids.numel())
        if progress is not None:
            progress(step + 1, spec.steps)
    train_seconds = time.perf_counter() - t_train
    teacher_ppl = _ppl(model, evals)
    load = None
    if moe:
        with torch.no_grad():
            logits = [
                torch.cat(x)
                for x in zip(
                    *(model(input_ids=w, output_router_logits=True).router_logits for w in evals.values()),
                    strict=True,
                )
            ]
        load = expert_load(logits, spec.top_k)
    active = n_params
    if moe:
        active -= (spec.experts - spec.top_k) * 3 * spec.hidden * spec.moe_intermediate * spec.layers

    model.config.use_cache = True
    model.save_pretrained(out)
    tok.save_pretrained(out)
    (out / "corpus").mkdir()
    for split in SPLITS:
        shutil.copyfile(Path(data["corpus_dir"]) / f"{split}.jsonl", out / "corpus" / f"{split}.jsonl")
    record = {
        "kind": "moe_teacher" if moe else "dense_teacher",
        "valid_ppl_teacher": teacher_ppl["all"],
        "valid_ppl_random_init": random_ppl["all"],
        "valid_ppl_teacher_by_domain": {d: v for d, v in teacher_ppl.items() if d != "all"},
        "valid_ppl_random_init_by_domain": {d: v for d, v in random_ppl.items() if d != "all"},
        "valid_tokens": sum(int(w[:, 1:].numel()) for w in evals.values()),
        "params": n_params,
        "active_params": active,
        "dense_intermediate": intermediate,
        "train_loss_curve": curve,
        "final_balance_loss": balance[-1] if balance else None,
        "expert_load": load,
        "steps": spec.steps,
        "train_tokens": spec.steps * spec.batch_size * spec.seq_len,
        "train_seconds": round(train_seconds, 2),
        "total_seconds": round(time.perf_counter() - t0, 2),
        "threads": torch.get_num_threads(),
        "corpus_hash": data["corpus_hash"],
        "tokenizer_hash": data["tokenizer_hash"],
        "cache_key": key,
    }
    meta = {
        "spec": asdict(spec),
        "corpus_hash": data["corpus_hash"],
        "tokenizer_hash": data["tokenizer_hash"],
        "record": record,
    }
    (out / "tiny_meta.json").write_text(json.dumps(meta, indent=1))
