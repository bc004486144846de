"""What several stages' run functions share: a metric record, the training windows, a recipe's hash."""

from __future__ import annotations

import json
from typing import Any

import torch

from workers.run.runtime import (
    tiny_dir,
    windows,
)


def _metric(name: str, value: float | None, **kw: Any) -> dict[str, Any]:
    return {"name": name, "value": value, **kw}


def _train_batches(payload: dict, cache: dict, tok, spec, n_train: int):
    """Micro-batches [batch_size, seq_len]: a seeded sample of windows, or, for a streamed source (e.g.
    FineWeb-Edu), the stream's windows in order, tokenized as training consumes them."""
    from itertools import islice

    from workers.core.data import DataSpec, stream_texts, stream_windows

    data = payload["params"]["data"]
    if data.get("streaming"):
        wins = islice(
            stream_windows(tok, stream_texts(DataSpec(**data), tiny_dir(payload)), spec.seq_len), n_train
        )
        return (torch.stack(b) for b in iter(lambda: list(islice(wins, spec.batch_size)), []))
    train = windows(payload, cache, tok, data, spec.seq_len, n_train, spec.seed + 1)
    return (train[i : i + spec.batch_size] for i in range(0, len(train), spec.batch_size))


def _recipe_hash(recipe: dict[str, Any]) -> str:
    import hashlib

    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:32]
