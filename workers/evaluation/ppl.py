"""Token-level perplexity with a recorded protocol (before and after distillation).

Protocol (the record's ``protocol`` dict repeats it):

* The texts are joined with "\\n\\n" into one document and tokenized once, without special tokens.
* ``windows="disjoint"`` (default, the usual WikiText-2 protocol): the token stream is cut into
  non-overlapping windows of ``seq_len`` tokens. Without BOS a window holds seq_len text tokens and
  every token after its first is scored (seq_len-1 per window; the first token of each window is
  context only). With ``add_bos`` a window is BOS + seq_len-1 text tokens; BOS is never scored and
  every text token is (the first from BOS alone). The last, shorter window is kept (without BOS it
  needs at least 2 tokens to score one).
* ``windows="rolling"`` reproduces lm-eval's ``loglikelihood_rolling`` with ``max_length=seq_len``
  exactly: every text token is scored once; the first window is prefix + the first seq_len-1 tokens
  and scores seq_len tokens; each later block of seq_len tokens is predicted from an input that
  starts with the previous block's last token; the last partial block is scored with a full
  seq_len-token left context. The prefix is BOS (EOS if the tokenizer has no BOS, as lm-eval's
  ``prefix_token_id``), so ``add_bos`` must be True.

Σ NLL is accumulated in float64 from float32 log-softmax; ppl = exp(Σ NLL / n_tokens). The decoder body
runs without the LM head and the scored positions' final hidden states go through the head in chunks of
tokens (logits = head(h) in the model dtype, the model's constant logit factor and final tanh softcap as
its forward applies them, float32 log-softmax, the target's entry), so no [B, T, V] tensor is built and
larger batches fit. A model without a linear output embedding (or with `full_logits`) is scored from its
own `model(...).logits` instead, cut into the same chunks.

`compile_layers` (the sweep's ``ppl.compile``; `compile_setting` resolves ``auto`` to "on CUDA") runs each
decoder layer through one `torch.compile`d function per layer class, kept for the life of the process:
parameters are graph inputs (dynamo inlines built-in nn.Modules), so every layer of a model and every
later student of the same architecture reuses the compiled code instead of compiling again.

Each window's Σ NLL and scored-token count are returned too (`window_nll`, `window_tokens`, in window
order): windows are the units a standard error and a paired bootstrap resample (`window_stats`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import types
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from workers.models.decoder import decoder_of
from workers.models.head import Head, output_head

WINDOWS = ("disjoint", "rolling")
_CHUNK_ELEMENTS = 1 << 26  # float32 logits per CE chunk (256 MB)


def tokenizer_sha(tok) -> str:
    """sha256 of the tokenizer's serialized form (tokenizer.json when fast, else the sorted vocab)."""
    backend = getattr(tok, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(tok.get_vocab(), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def prefix_token_id(tok) -> int:
    """BOS, or EOS when the tokenizer has no BOS (lm-eval's rule for its rolling prefix)."""
    tid = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    if tid is None:
        raise ValueError("add_bos needs a tokenizer with a bos_token or eos_token; this one has neither")
    return int(tid)


def make_windows(
    ids: list[int], seq_len: int, prefix: int | None, windows: str
) -> list[tuple[list[int], int]]:
    """(sequence, n_scored): the model reads sequence[:-1]; the last n_scored of sequence[1:] are scored."""
    n = len(ids)
    out: list[tuple[list[int], int]] = []
    if windows == "disjoint":
        step = seq_len - 1 if prefix is not None else seq_len
        for s in range(0, n, step):
            chunk = ids[s : s + step]
            if prefix is not None:
                out.append(([prefix, *chunk], len(chunk)))
            elif len(chunk) >= 2:
                out.append((chunk, len(chunk) - 1))
        return out
    # rolling: lm_eval.utils.get_rolling_token_windows(context_len=1) + make_disjoint_window
    first = min(seq_len, n)
    out.append(([prefix, *ids[:first]], first))
    done = first
    while done < n:
        w = min(n - done, seq_len)
        end = done + w
        out.append((ids[end - seq_len - 1 : end], w))
        done = end
    return out


def text_ids(tok, texts: list[str]) -> list[int]:
    """The token stream that is scored: the texts joined with "\n\n", no special tokens."""
    return list(tok("\n\n".join(texts), add_special_tokens=False, verbose=False)["input_ids"])


def perplexity(
    model,
    tok,
    texts: list[str],
    seq_len: int,
    batch_size: int,
    add_bos: bool,
    device,
    max_windows: int | None = None,
    windows: str = "disjoint",
    progress: Callable[[int, int], None] | None = None,
    ids: list[int] | None = None,
    compile_layers: bool = False,
    full_logits: bool = False,
) -> dict[str, Any]:
    """Perplexity of a causal LM on texts; see the module docstring for exactly what is scored.
    `ids` = text_ids(tok, texts) computed once by a caller that evaluates many models on one text;
    `compile_layers`: decoder layers through their class's shared compiled forward (compiled_layers);
    `full_logits`: score the model's own [B, T, V] logits (the path before the chunked head; benchmarks)."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if windows not in WINDOWS:
        raise ValueError(f"windows must be one of {', '.join(WINDOWS)}, got {windows!r}")
    if windows == "rolling" and not add_bos:
        raise ValueError(
            "windows='rolling' predicts the first token from a BOS/EOS prefix (lm-eval); set add_bos=True"
        )
    if max_windows is not None and max_windows < 1:
        raise ValueError(f"max_windows must be a positive integer or None, got {max_windows}")
    ids = text_ids(tok, texts) if ids is None else ids
    prefix = prefix_token_id(tok) if add_bos else None
    wins = make_windows(ids, seq_len, prefix, windows)
    n_total = len(wins)
    wins = wins[:max_windows] if max_windows else wins
    if not wins:
        raise ValueError(f"texts give {len(ids)} tokens: too few for one scored window of seq_len {seq_len}")
    device = torch.device(device) if device is not None else next(model.parameters()).device

    by_len: dict[int, list[tuple[int, tuple[list[int], int]]]] = defaultdict(list)
    for i, w in enumerate(wins):
        by_len[len(w[0])].append((i, w))
    window_tokens = [w[1] for w in wins]
    head = None if full_logits or not _has_decoder(model) else output_head(model)
    nll = torch.zeros(len(wins), dtype=torch.float64, device=device)  # read back once, at the end
    done = 0
    was_training = model.training
    model.eval()
    layers = compiled_layers(model) if compile_layers else contextlib.nullcontext(0)
    try:
        with torch.no_grad(), layers as n_compiled:
            for group in by_len.values():
                for i in range(0, len(group), batch_size):
                    batch = group[i : i + batch_size]
                    seqs = torch.tensor([s for _, (s, _) in batch], dtype=torch.long, device=device)
                    n_scored = [n for _, (_, n) in batch]
                    if head is None:
                        logits = model(input_ids=seqs[:, :-1], use_cache=False).logits
                        for row, (idx, (_, n)) in enumerate(batch):
                            nll[idx] = _row_nll(logits[row, -n:], seqs[row, -n:])
                    else:
                        h = decoder_of(model)(input_ids=seqs[:, :-1], use_cache=False).last_hidden_state
                        rows = torch.tensor([idx for idx, _ in batch], device=device)
                        row_nll = batch_nll(head, h, seqs[:, 1:], n_scored, compiled=compile_layers)
                        nll[rows] = row_nll.to(device)
                    done += len(batch)
                    if progress:
                        progress(done, len(wins))
    finally:
        model.train(was_training)

    window_nll = nll.cpu().tolist()
    total = math.fsum(window_nll)
    n_tokens = sum(window_tokens)
    ppl = _safe_exp(total / n_tokens)
    kind = "nan" if math.isnan(ppl) else "inf" if math.isinf(ppl) else "finite"
    rule = (
        "disjoint windows of seq_len tokens; "
        + (
            "BOS + seq_len-1 text tokens, every text token scored, BOS not scored"
            if add_bos
            else "every token after the first of each window scored"
        )
        + "; last partial window kept"
        if windows == "disjoint"
        else "lm-eval loglikelihood_rolling (context_len=1, max_length=seq_len): every token scored once, "
        "first from the BOS/EOS prefix, last partial block with full left context"
    )
    protocol = {
        "seq_len": seq_len,
        "add_bos": add_bos,
        "prefix_token_id": prefix,
        "windows": windows,
        "window_rule": rule,
        "join": "\\n\\n",
        "special_tokens": False,
        "n_texts": len(texts),
        "text_tokens": len(ids),
        "n_windows": len(wins),
        "n_windows_total": n_total,
        "max_windows": max_windows,
        "tokenizer": getattr(tok, "name_or_path", ""),
        "tokenizer_sha": tokenizer_sha(tok),
        "model_dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "nll_accumulation": "float64 sum of float32 log-softmax",
        "head": "model logits" if head is None else "chunked from final hidden states",
        "compiled_layers": n_compiled,
    }
    return {
        "ppl": ppl,
        "sum_nll": total,
        "n_tokens": n_tokens,
        "value_kind": kind,
        "protocol": protocol,
        "window_nll": window_nll,
        "window_tokens": window_tokens,
    }


def window_stats(window_nll: list[float], window_tokens: list[int]) -> tuple[float | None, int]:
    """(standard error of the perplexity, number of windows): the ratio estimator of the mean NLL per
    token over windows (the sampled units), carried to ppl by the delta method (se_ppl = ppl · se_log)."""
    n = len(window_nll)
    total_tokens = sum(window_tokens)
    if n < 2 or total_tokens == 0:
        return None, n
    mean = math.fsum(window_nll) / total_tokens
    resid = [x - mean * t for x, t in zip(window_nll, window_tokens, strict=True)]
    var = n / (n - 1) * math.fsum(r * r for r in resid) / total_tokens**2
    se_log = math.sqrt(var)
    ppl = _safe_exp(mean)
    return (ppl * se_log if math.isfinite(ppl) and math.isfinite(se_log) else None), n


def compile_setting(setting: Any, device: torch.device | str) -> bool:
    """Whether `ppl.compile` (auto | true | false) compiles on this device: auto = on CUDA only."""
    if setting == "auto" and not isinstance(setting, bool):
        return torch.device(device).type == "cuda"
    if isinstance(setting, bool):
        return setting
    raise ValueError(f"ppl.compile must be 'auto', true or false, got {setting!r}")


# ---- the LM head, chunked ---------------------------------------------------------------------------
def _has_decoder(model: nn.Module) -> bool:
    """Whether the model runs a decoder body whose final hidden states the head can be applied to."""
    try:
        decoder_of(model)
    except (AttributeError, ValueError):
        return False
    return True


def chunk_nll(
    h: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    mul: float | None,
    div: float | None,
    cap: float | None,
) -> torch.Tensor:
    """-log p(target) [n] (float32) of n final hidden states [n, H]: the head's logits in the model dtype,
    scaled and softcapped as the model's forward does, float32 log-softmax."""
    logits = F.linear(h, weight, bias)
    if mul is not None:
        logits = logits * mul
    if div is not None:
        logits = logits / div
    logits = logits.float()
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return F.cross_entropy(logits, targets, reduction="none")


def batch_nll(
    head: Head, h: torch.Tensor, targets: torch.Tensor, n_scored: list[int], compiled: bool = False
) -> torch.Tensor:
    """Σ -log p(target) per row [B] (float64) of final hidden states h [B, T, H] predicting targets [B, T],
    where row r scores its last n_scored[r] positions; the head runs on chunks of scored positions."""
    B, T, H = h.shape
    flat_h, flat_t = h.reshape(B * T, H), targets.reshape(B * T)
    index = None
    if any(n != T for n in n_scored):
        index = torch.cat([torch.arange(r * T + T - n, (r + 1) * T) for r, n in enumerate(n_scored)])
        index = index.to(h.device)
        flat_h, flat_t = flat_h.index_select(0, index), flat_t.index_select(0, index)
    fn = _compiled_chunk_nll() if compiled else chunk_nll
    step = max(1, _CHUNK_ELEMENTS // head.weight.shape[0])
    step -= step % 128 if step >= 128 else 0  # whole 128-row tiles of the head's matmul
    per_token = torch.empty(flat_t.shape[0], dtype=torch.float32, device=h.device)
    for s in range(0, flat_t.shape[0], step):
        per_token[s : s + step] = fn(
            flat_h[s : s + step], head.weight, head.bias, flat_t[s : s + step], head.mul, head.div, head.cap
        )
    grid = per_token.double()
    if index is not None:  # unscored positions add 0; index_copy_ of unique indices is deterministic
        grid = torch.zeros(B * T, dtype=torch.float64, device=h.device).index_copy_(0, index, grid)
    return grid.view(B, T).sum(1)


def _row_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Σ -log p(target) over positions, float32 log-softmax in chunks, summed in float64."""
    step = max(1, _CHUNK_ELEMENTS // logits.shape[-1])
    total = torch.zeros((), dtype=torch.float64, device=logits.device)
    for s in range(0, logits.shape[0], step):
        nll = F.cross_entropy(logits[s : s + step].float(), targets[s : s + step], reduction="none")
        total += nll.double().sum()
    return total


# ---- regional compilation, shared across models of one architecture ----------------------------------
_COMPILED: dict[Any, Callable[..., Any]] = {}  # layer class (or "head") -> its compiled function


def _compiled_chunk_nll() -> Callable[..., torch.Tensor]:
    if "head" not in _COMPILED:
        _COMPILED["head"] = torch.compile(chunk_nll)
    return _COMPILED["head"]


def shared_forward(cls: type) -> Callable[..., Any]:
    """`cls.forward` compiled once per process (static shapes: a sweep's windows take one or a few).

    Dynamo keeps compiled code, and its recompile limit, per code object of the frame it starts from;
    transformers wraps every layer class's forward in one shared wrapper function
    (GradientCheckpointingLayer), so the compiled entry is a small function with a code object of its
    own per class. The layer (`self`) is an argument and, with dynamo inlining built-in nn.Modules, its
    parameters are graph inputs guarded on shape, dtype and device, not identity: every layer of a model
    and every later model of this class reuse the code."""
    fn = _COMPILED.get(cls)
    if fn is None:
        forward = cls.forward

        def entry(self, *args, **kwargs):
            return forward(self, *args, **kwargs)

        name = f"{cls.__name__}_forward"
        code = entry.__code__.replace(co_name=name, co_qualname=name)
        fn = torch.compile(
            types.FunctionType(code, entry.__globals__, name, None, entry.__closure__), dynamic=False
        )
        _COMPILED[cls] = fn
    return fn


def decoder_layers(model: nn.Module) -> nn.ModuleList | None:
    """The decoder's longest module list (its layers: `layers`, DBRX's `blocks`); None without one."""
    try:
        decoder = decoder_of(model)
    except (AttributeError, ValueError):
        return None
    lists = [m for m in decoder.children() if isinstance(m, nn.ModuleList) and len(m)]
    return max(lists, key=len) if lists else None


@contextlib.contextmanager
def compiled_layers(model: nn.Module) -> Iterator[int]:
    """While open, each decoder layer runs its class's compiled forward (shared_forward); yields how many
    layers do. A layer whose forward is already an instance attribute (a hook framework's) stays as it is.
    Compiling is only a speed-up: a frame the compiler fails on runs eagerly (dynamo's suppress_errors)."""
    swapped = []
    for layer in decoder_layers(model) or []:
        if "forward" not in vars(layer):
            layer.forward = types.MethodType(shared_forward(type(layer)), layer)
            swapped.append(layer)
    try:
        with torch._dynamo.config.patch(suppress_errors=True):
            yield len(swapped)
    finally:
        for layer in swapped:
            del layer.forward


def _safe_exp(x: float) -> float:
    if math.isnan(x):
        return math.nan
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf
