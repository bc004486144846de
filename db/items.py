"""Per-item scores packed into two compressed arrays per row of `item_scores`.

One row per (job, stage, task, leaf task, step, name) holds that evaluation's item ids (lm-eval's
doc_id, or a perplexity window's index) and values, each zlib-compressed little-endian (int64 ids,
float64 values). Packed rather than one row per item: a suite of ~35k items costs one row and a few
bytes per item instead of ~35k rows with their indexes, and a comparison reads whole tasks anyway.
"""

from __future__ import annotations

import zlib

import numpy as np


def pack_ids(ids) -> bytes:
    return zlib.compress(np.asarray(ids, dtype="<i8").tobytes(), 6)


def pack_values(values) -> bytes:
    return zlib.compress(np.asarray(values, dtype="<f8").tobytes(), 6)


def unpack_ids(blob: bytes) -> np.ndarray:
    return np.frombuffer(zlib.decompress(bytes(blob)), dtype="<i8")


def unpack_values(blob: bytes) -> np.ndarray:
    return np.frombuffer(zlib.decompress(bytes(blob)), dtype="<f8")


def item_row(r: dict) -> dict:
    """A worker's item_scores record → the table's columns (one-line error when ids and values differ)."""
    ids, values = r["doc_ids"], r["values"]
    if len(ids) != len(values):
        raise ValueError(
            f"item_scores {r.get('task') or 'ppl'}/{r['name']}: {len(ids)} ids but {len(values)} values"
        )
    return {
        "stage": r.get("stage") or "",
        "task": r.get("task") or "",
        "subtask": r.get("subtask") or "",
        "step": -1 if r.get("step") is None else int(r["step"]),
        "name": r["name"],
        "n": len(ids),
        "ids": pack_ids(ids),
        "vals": pack_values(values),
    }
