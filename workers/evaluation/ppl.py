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

Σ NLL is accumulated in float64 from float32 log-softmax computed in chunks of positions, so a full
[B, T, V] float32 copy is never held; ppl = exp(Σ NLL / n_tokens).

Each window's Σ NLL and scored-token count are returned too (`window_nll`, `window_tokens`, in window
order): windows are the units a standard error and a paired bootstrap resample (`window_stats`).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

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
) -> dict[str, Any]:
    """Perplexity of a causal LM on texts; see the module docstring for exactly what is scored.
    `ids` = text_ids(tok, texts) computed once by a caller that evaluates many models on one text."""
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
    window_nll = [0.0] * len(wins)
    window_tokens = [w[1] for w in wins]
    done = 0
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for group in by_len.values():
                for i in range(0, len(group), batch_size):
                    batch = group[i : i + batch_size]
                    seqs = torch.tensor([s for _, (s, _) in batch], dtype=torch.long, device=device)
                    logits = model(input_ids=seqs[:, :-1], use_cache=False).logits
                    for row, (idx, (_, n_scored)) in enumerate(batch):
                        window_nll[idx] = float(_row_nll(logits[row, -n_scored:], seqs[row, -n_scored:]))
                    done += len(batch)
                    if progress:
                        progress(done, len(wins))
    finally:
        model.train(was_training)

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


def _row_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Σ -log p(target) over positions, float32 log-softmax in chunks, summed in float64."""
    step = max(1, _CHUNK_ELEMENTS // logits.shape[-1])
    total = torch.zeros((), dtype=torch.float64, device=logits.device)
    for s in range(0, logits.shape[0], step):
        nll = F.cross_entropy(logits[s : s + step].float(), targets[s : s + step], reduction="none")
        total += nll.double().sum()
    return total.cpu()


def _safe_exp(x: float) -> float:
    if math.isnan(x):
        return math.nan
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf
