"""Run function of the stages `ppl_pre` and `seed_ppl`: a student's pre-distill perplexity."""

from __future__ import annotations

from typing import Any

import torch

from workers.run.common import _metric
from workers.run.students import make_student, ppl_record


def stage_ppl_pre(payload: dict, cache: dict, progress) -> dict:
    recipe = payload["params"]["student"]
    student, tok = make_student(payload, cache, recipe, for_training=False)
    items: list[dict[str, Any]] = []
    with torch.no_grad():
        m = ppl_record(student, tok, payload, cache, "pre", items)
    params = _metric("params", float(sum(t.numel() for t in student.parameters())), stage="pre")
    return {
        "outputs": {"ppl": m["value"], "value_kind": m["value_kind"]},
        "metrics": [m, params],
        "item_scores": items,
    }
