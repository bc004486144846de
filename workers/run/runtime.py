"""What stage functions share inside a worker process: device, resident models, cached data."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch


def runtime_versions() -> dict[str, Any]:
    import transformers

    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "threads": torch.get_num_threads(),
    }


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ---- models held in memory ----------------------------------------------------------------------
def teacher_path(payload: dict[str, Any], role: str = "teacher") -> str:
    ref = payload["params"]["teacher"] if role == "teacher" else payload["params"].get(role, {})
    if ref.get("source") == "hf":
        return ref["model"]
    return payload["inputs"][role]["path"]


def load_model(path: str, dtype: str = "float32", revision: str | None = None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import workers.models.dot_moe_hf  # noqa: F401  (registers the MoE class DOT-MoE extracts, so it reloads)
    import workers.models.edited_model  # noqa: F401  (registers the edited-MoE checkpoints' classes)

    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype], revision=revision)
    model.to(device()).eval()
    tok = AutoTokenizer.from_pretrained(path, revision=revision)
    return model, tok


def resident_teacher(payload: dict[str, Any], cache: dict, role: str = "teacher"):
    """The teacher stays loaded across the jobs of one worker, so the pre-distillation evaluation of many
    students is built from it in memory (no save/load round trip per configuration)."""
    ref = payload["params"]["teacher"]
    path = teacher_path(payload, role)
    key = f"{role}:{path}:{ref.get('dtype')}:{ref.get('revision')}"
    if cache.get("teacher_key") != key:
        cache.clear()  # one teacher at a time: free the previous one first
        cache["teacher"] = load_model(path, ref.get("dtype", "float32"), ref.get("revision"))
        cache["teacher_key"] = key
    return cache["teacher"]


def tiny_dir(payload: dict[str, Any]) -> str | None:
    for role in ("teacher", "dense_teacher"):
        if role in payload["inputs"] and "path" in payload["inputs"][role]:
            return payload["inputs"][role]["path"]
    return None


def windows(
    payload: dict[str, Any],
    cache: dict,
    tok,
    data: dict[str, Any],
    seq_len: int,
    n: int | None,
    seed: int,
    add_bos: bool = False,
) -> torch.Tensor:
    from workers.core.data import DataSpec, load_texts, token_windows

    key = json.dumps(["win", data, seq_len, n, seed, add_bos, tok.name_or_path], sort_keys=True)
    if key not in cache:
        # a remote corpus is read only as far as the windows need (~8 chars per token, with room)
        budget = None if n is None or data.get("source") == "tiny" else n * seq_len * 8
        texts = load_texts(DataSpec(**data), tiny_dir=tiny_dir(payload), max_chars=budget, tok=tok)
        cache[key] = token_windows(tok, texts, seq_len, n, seed, add_bos=add_bos)
    return cache[key]


def sequences(
    payload: dict[str, Any], cache: dict, tok, data: dict[str, Any], max_len: int, n: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask) of `n` documents truncated to `max_len` (workers.core.data.truncated_sequences); a remote
    corpus is read for its first `n` documents only."""
    from workers.core.data import DataSpec, load_texts, truncated_sequences

    key = json.dumps(["seq", data, max_len, n, seed, tok.name_or_path], sort_keys=True)
    if key not in cache:
        limit = None if data.get("source") == "tiny" else n
        texts = load_texts(DataSpec(**data), tiny_dir=tiny_dir(payload), max_texts=limit, tok=tok)
        cache[key] = truncated_sequences(tok, texts, max_len, n, seed)
    return cache[key]


def eval_texts(payload: dict[str, Any], cache: dict, data: dict[str, Any]) -> list[str]:
    from workers.core.data import DataSpec, load_texts

    key = json.dumps(["texts", data], sort_keys=True)
    if key not in cache:
        cache[key] = list(load_texts(DataSpec(**data), tiny_dir=tiny_dir(payload)))
    return cache[key]


def artifact(kind: str, path: Path) -> dict[str, Any]:
    """The record of an artifact a job wrote: kind, path, content hash, size and mtime (see workers.core.artifacts)."""
    from workers.core.artifacts import record

    return record(kind, path)
