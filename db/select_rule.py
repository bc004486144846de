"""The selection rule between stages (paper §4.1): for each group of `per` axes, the configuration
with the lowest finite metric over the `over` axes. Shared by the orchestrator (what to distill) and
analysis (which picks a grid implies), so both always agree. The default rule (the paper's) is stated in
db/axes.py: `DEFAULT_RULE`."""

from __future__ import annotations

import math
from typing import Any

from db.axes import DEFAULT_RULE


def select_best_rows(
    rows: list[dict[str, Any]], per: list[str], over: list[str], by: str = DEFAULT_RULE["best_by"]
) -> list[dict[str, Any]]:
    """Per group of `per`, the row with the lowest finite `by`; ties go to the smallest str() of `over`.
    A row whose `<by>_kind` says inf/nan (a diverged model, the paper's "–") never wins."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(tuple(r[a] for a in per), []).append(r)
    picked = []
    for _, members in sorted(groups.items(), key=lambda kv: str(kv[0])):
        finite = [
            m
            for m in members
            if m.get(by) is not None and math.isfinite(m[by]) and m.get(f"{by}_kind") in (None, "finite")
        ]
        if finite:
            picked.append(min(finite, key=lambda m: (m[by], tuple(str(m[a]) for a in over))))
    return picked
