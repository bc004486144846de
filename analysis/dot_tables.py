"""Tables of dense → MoE models (configurations of kind `dense2moe`: DOT-MoE and its baselines).

Ours: per method and dense source (the dense teacher, or a distilled dense student), E experts (for CMoE
and LLaMA-MoE-v2 S of them shared, always on: "(S=…)" after the method) and the top-k it was aligned at,
the dense model's perplexity and the extracted MoE's at every top-k it was evaluated at (the inference
sparsity sweep, no retraining). The DOT-MoE paper's numbers are on other models (LLaMA-2/3, Qwen2.5) and
tasks than ours, so with `--compare` they come as a table of their own, for context, matched on nothing.
"""

from __future__ import annotations

import json
from typing import Any

import pandas as pd

from analysis.latex import Table, esc, fmt_pct, fmt_ppl

DOT_TASKS = ("boolq", "sciq", "piqa", "winogrande", "arc_easy", "arc_challenge", "hellaswag")
TASK_LABEL = {
    "boolq": "BoolQ",
    "sciq": "SciQ",
    "piqa": "PIQA",
    "winogrande": "Wino",
    "arc_easy": "ARC-E",
    "arc_challenge": "ARC-C",
    "hellaswag": "HellaS",
}


def dense2moe_rows(results: pd.DataFrame) -> pd.DataFrame:
    return results[results["kind"] == "dense2moe"]


def _settings(r: dict[str, Any]) -> dict[str, Any]:
    try:
        return json.loads(r.get("settings") or "{}")
    except ValueError:
        return {}


def dot_table(rows: pd.DataFrame, metrics: pd.DataFrame, label: str, stem: str) -> Table | None:
    """Our dense → MoE models: method, source, E, trained k, dense PPL, PPL at each evaluated top-k."""
    ours = [r for r in rows.to_dict("records") if _settings(r).get("method")]
    if not ours:
        return None
    ppl = metrics[(metrics["name"] == "ppl") & (metrics["stage"] == "dot_moe")]
    ks = sorted({int(k) for k in ppl[ppl["who"] == "student"]["step"].dropna()})
    head = [["Method", "Source", "E", "k", "Dense", *[f"k={k}" for k in ks]]]
    body: list[list[str] | str] = []
    for r in sorted(
        ours, key=lambda r: (_settings(r).get("source") or "", _settings(r)["method"], r["config_key"])
    ):
        s = _settings(r)
        mine = ppl[ppl["config_id"] == r["config_id"]]
        dense = mine[mine["who"] == "dense"]["value"]
        by_k = {int(m["step"]): m["value"] for m in mine[mine["who"] == "student"].to_dict("records")}
        source = s.get("source") or ""
        if s.get("source_config"):
            source += f" ({s['source_config']})"
        method = s["method"] + (f" (S={s['shared']})" if s.get("shared") else "")
        body.append(
            [
                esc(method),
                esc(source),
                str(s.get("experts", "")),
                str(s.get("top_k", "")),
                fmt_ppl(dense.iloc[0] if len(dense) else None),
                *[fmt_ppl(by_k.get(k)) for k in ks],
            ]
        )
    return Table(
        stem,
        f"Dense to MoE ({label}): per method and dense source, E experts, the top-k k it was "
        "aligned at, the dense model's held-out perplexity and the extracted MoE's at every evaluated "
        "top-k (inference sparsity, no retraining). The baselines built without training (cmoe, "
        "llama\\_moe\\_v2) count S always-on shared experts in E and route k of the other E - S. "
        "Blank: not evaluated.",
        "ll" + "r" * (3 + len(ks)),
        head,
        body,
        index_caption=f"Dense to MoE: perplexity by method and top-k, {label}",
    )


def dot_paper_table(rows: pd.DataFrame, tasks: pd.DataFrame, label: str, stem: str) -> Table | None:
    """The DOT-MoE paper's published rows (its Tables 3 and 8) as context: model, method, accuracy per task."""
    ref = rows.to_dict("records")
    if not ref:
        return None
    present = [t for t in DOT_TASKS if t in set(tasks["task"])]
    head = [["Model", "Method", *[TASK_LABEL[t] for t in present], "Avg"]]
    body: list[list[str] | str] = []
    for r in ref:
        t = tasks[tasks["config_id"] == r["config_id"]]
        acc = {x["task"]: x["value"] for x in t.to_dict("records")}
        what = r["config_key"].split("|", 3)[-1].replace("|", ", ")
        body.append(
            [
                esc(r["model"]),
                esc(f"{r.get('baseline') or ''} ({what})"),
                *[fmt_pct(100 * acc[x] if x in acc else None) for x in present],
                fmt_pct(100 * r["avg"] if pd.notna(r.get("avg")) else None),
            ]
        )
    return Table(
        stem,
        f"Published dense-to-MoE results ({label}; other models and tasks than ours: context, "
        "matched on nothing): accuracy in % per task and the paper's average.",
        "ll" + "r" * (len(present) + 1),
        head,
        body,
        index_caption=f"Published dense-to-MoE results, {label}",
    )
