"""The paper's table layouts, built from the views' frames (Tables 3, 4, 5, 10/11, 12, 16/17).

Every builder returns Table objects (analysis/latex.py) or nothing when the sweep lacks the data.
With a reference view (`ref`), the paper's numbers sit beside ours in the same table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pandas as pd

from analysis.derived import (
    DESIGN_AXES,
    PRIOR_WORK,
    distilled_rows,
    grid_rows,
    order_key,
    ordered,
    pct,
    plain,
    records,
    sort_rows,
    top_k_of,
)
from analysis.latex import DASH, Table, bold, esc, fmt_pct, fmt_ppl
from analysis.uncertainty import SEED_RULE, SeedValues, pooled, seed_words, verdict

TASK_LABEL = {
    "winogrande": "Wino",
    "hellaswag": "Hella",
    "arc_easy": "ARC-E",
    "arc_challenge": "ARC-C",
    "mmlu": "MMLU",
}
SCALING_LABEL = {"uniform": "Uniform", "proportional": "Proportional", "avg_cp": "Avg. CP"}
BASELINE_LABEL = {"random_ffn": "Random FFN + teacher attn", "random_init": "Random initialization"}
MAX_GRID_ROWS = 40  # Tables 10/11 split the 70 grid rows 40/30


@dataclass
class View:
    """What one table source (ours, or the paper's) offers: configuration rows and accuracies."""

    label: str  # shown in captions and column groups
    rows: pd.DataFrame  # `results` rows (one model's, plus the sweep's baselines and teachers)
    acc: pd.DataFrame  # headline accuracy (%) per config_id (index) and task (columns)
    tasks: list[str]

    def task_cells(self, config_id: Any) -> list[str]:
        cid = plain(config_id)
        if cid not in self.acc.index:
            return [""] * len(self.tasks)
        row = self.acc.loc[cid]
        return [fmt_pct(plain(row.get(t))) for t in self.tasks]


def make_view(label: str, results: pd.DataFrame, tasks: pd.DataFrame) -> View:
    t = tasks[
        (tasks["headline"] == 1) & (tasks["stage"] == "post") & tasks["config_id"].isin(results["config_id"])
    ]
    acc = t.assign(value=100.0 * t["value"].astype(float)).pivot_table(
        index="config_id", columns="task", values="value", aggfunc="first"
    )
    acc.index = [int(i) for i in acc.index]
    return View(label, results, acc, ordered("task", t["task"]))


def task_header(tasks: list[str]) -> list[str]:
    return [esc(TASK_LABEL.get(t, t)) for t in tasks]


def axis_text(axis: str, v: Any) -> str:
    v = plain(v)
    if v is None:
        return ""
    if axis == "dp_scaling":
        return esc(SCALING_LABEL.get(v, v))
    return esc(v)


def config_label(r: dict[str, Any]) -> str:
    """A one-line name of a configuration row (plain text)."""
    kind, b = r.get("kind"), r.get("baseline")
    if kind == "teacher":
        return f"D2D teacher ({r['model']})" if b == "dense_teacher" else f"Teacher ({r['model']})"
    if kind == "baseline":
        if b and b.startswith("d2d:"):
            return f"D2D pruning ({b[4:]})"
        if b == "pretrained":
            return f"{r['model']} (pretrained reference)"
        return BASELINE_LABEL.get(b, b or "baseline")
    parts = "×".join(str(r[a]) for a in ("scoring", "grouping") if r.get(a))
    if r.get("K") is not None:
        parts += f", K={r['K']}"
    if r.get("dp_scaling"):
        parts += f", {r['dp_scaling']}"
    return parts


def _group_header(lead: int, groups: list[tuple[str, int]]) -> list[list[str] | str]:
    """A header line of column groups ('Ours' / 'Paper') with cmidrules under them."""
    cells, rules, col = [""] * lead, [], lead + 1
    for name, n in groups:
        cells.append(rf"\multicolumn{{{n}}}{{c}}{{{esc(name)}}}")
        rules.append(rf"\cmidrule(lr){{{col}-{col + n - 1}}}")
        col += n
    return [cells, "".join(rules)]


def slug(model: str, many: bool) -> str:
    return "_" + "".join(ch if ch.isalnum() else "-" for ch in model.lower()) if many else ""


# ---- Tables 10/11: the pre-distill PPL grid ---------------------------------------------------
def _grid_cells(view: View) -> tuple[list[int], dict[tuple, dict[int, tuple[float | None, str | None]]]]:
    g = grid_rows(view.rows)
    ks = [int(k) for k in ordered("K", g["K"])]
    cells: dict[tuple, dict[int, tuple[float | None, str | None]]] = {}
    for r in records(g):
        key = (r["scoring"], r["grouping"], r["dp_scaling"])
        cells.setdefault(key, {})[r["K"]] = (r["ppl_pre"], r["ppl_pre_kind"])
    return ks, cells


def _grid_row_cells(ks: list[int], row: dict[int, tuple[float | None, str | None]]) -> list[str]:
    finite = {k: v for k, (v, kind) in row.items() if v is not None and kind in (None, "finite")}
    best = min(finite, key=lambda k: (finite[k], k)) if finite else None
    out = []
    for k in ks:
        v, kind = row.get(k, (None, None))
        s = fmt_ppl(v, kind) if k in row else ""
        if kind is None and v is None and k in row:
            s = ""
        out.append(bold(s) if k == best else s)
    return out


def ppl_grid_tables(view: View, ref: View | None, stem: str) -> list[Table]:
    """Tables 10/11 layout: scoring × grouping × scaling rows, K columns, best K per row in bold."""
    ks, cells = _grid_cells(view)
    if not cells:
        return []
    rks, rcells = _grid_cells(ref) if ref is not None else ([], {})
    keys = sorted(
        cells,
        key=lambda t: (
            order_key("scoring", t[0]),
            order_key("grouping", t[1]),
            order_key("dp_scaling", t[2]),
        ),
    )
    blocks: list[list[tuple]] = []
    for s in ordered("scoring", [k[0] for k in keys]):
        blocks.append([k for k in keys if k[0] == s])
    parts: list[list[list[tuple]]] = [[]]
    for b in blocks:
        if parts[-1] and sum(map(len, parts[-1])) + len(b) > MAX_GRID_ROWS:
            parts.append([])
        parts[-1].append(b)
    kcols = [f"$K{{=}}{k}$" for k in ks]
    head: list[list[str] | str] = []
    if rks:
        head += _group_header(3, [(f"Ours ({view.label})", len(ks)), (f"Paper ({ref.label})", len(rks))])
        kcols += [f"$K{{=}}{k}$" for k in rks]
    head.append(["Scoring", "Grouping", "DP scaling", *kcols])
    tables = []
    for i, part in enumerate(parts):
        rows: list[list[str] | str] = []
        for bi, block in enumerate(part):
            if bi:
                rows.append(r"\midrule")
            prev_group = object()
            for j, key in enumerate(block):
                s, g, dp = key
                line = [
                    esc(s) if j == 0 else "",
                    axis_text("grouping", g) if g != prev_group else "",
                    axis_text("dp_scaling", dp),
                    *_grid_row_cells(ks, cells[key]),
                ]
                prev_group = g
                if rks:
                    line += _grid_row_cells(rks, rcells[key]) if key in rcells else [""] * len(rks)
                rows.append(line)
        scorings = ", ".join(b[0][0] for b in part)
        name = stem if len(parts) == 1 else f"{stem}_{i + 1}"
        cap = (
            f"Pre-distill perplexity (lower is better) of the {view.label} conversions ({scorings}): "
            "scoring × grouping × down-projection scaling per row, K selected experts per column. "
            f"Bold: best K per row. {DASH}: non-finite (numerical instability); blank: not run."
        )
        if rks:
            cap += f" Left: this sweep; right: the paper's published grid ({ref.label})."
        tables.append(
            Table(
                name,
                cap.replace(DASH, "–"),
                "lll" + "r" * (len(ks) + len(rks)),
                head,
                rows,
                index_caption=f"Pre-distill PPL grid, {view.label}, scorings {scorings} "
                "(Tables 10/11 layout)",
            )
        )
    return tables


# ---- the selection rule's picks -------------------------------------------------------------------
AXIS_HEAD = {"scoring": "Scoring", "grouping": "Grouping", "K": "K", "dp_scaling": "DP"}
AXIS_NAME = {"scoring": "scoring", "grouping": "grouping", "K": "K", "dp_scaling": "scaling"}


def colspec(head: list[str]) -> str:
    """Text columns left, numbers right."""
    return "".join(
        "l" if h in ("Scoring", "Grouping", "DP", "Configuration", "Axis", "Value") else "r" for h in head
    )


def selection_table(
    sel: dict[str, Any], label: str, ref_sel: dict[str, Any] | None, ref_label: str, stem: str
) -> Table:
    """Per pair: the rule's (K, scaling) and PPL, what was distilled, and the paper's pick."""
    per, over = sel["rule"]["per"], sel["rule"]["over"]
    bad = {tuple(d[a] for a in per) for d in sel["disagreements"]}
    distilled = {tuple(d[a] for a in per): d["distilled"] for d in sel["disagreements"]}
    ref_picks = {tuple(p[a] for a in per): p for p in (ref_sel or {}).get("picks", [])} if ref_sel else {}
    compared = sel["compared_with_distilled"]
    cols = [*[AXIS_HEAD[a] for a in over], "PPL"]
    groups = [(f"Rule ({label})", len(cols))]
    if compared:
        groups.append(("Distilled", len(over) + 1))
    if ref_sel:
        groups.append((f"Paper rule ({ref_label})", len(cols)))
    head: list[list[str] | str] = _group_header(len(per), groups)
    last = [
        *[AXIS_HEAD[a] for a in per],
        *cols,
        *([*[AXIS_HEAD[a] for a in over], ""] if compared else []),
        *(cols if ref_sel else []),
    ]
    head.append(last)
    rows: list[list[str] | str] = []
    prev = None
    for p in sel["picks"]:
        key = tuple(p[a] for a in per)
        if prev is not None and key[0] != prev:
            rows.append(r"\midrule")
        line = [axis_text(a, p[a]) if i or key[0] != prev else "" for i, a in enumerate(per)]
        line += [axis_text(a, p[a]) for a in over] + [fmt_ppl(p["ppl_pre"])]
        prev = key[0]
        if compared:
            if key in bad:
                ds = distilled.get(key) or []
                line += [", ".join(axis_text(a, d[a]) for d in ds) for a in over] + [r"$\neq$"]
            else:
                line += [axis_text(a, p[a]) for a in over] + [""]
        if ref_sel:
            rp = ref_picks.get(key)
            line += [axis_text(a, rp[a]) for a in over] + [fmt_ppl(rp["ppl_pre"])] if rp else [""] * len(cols)
        rows.append(line)
    n = len(sel["disagreements"])
    cap = (
        f"The selection rule on {label}: per {' × '.join(AXIS_NAME[a] for a in per)}, the "
        f"({', '.join(AXIS_NAME[a] for a in over)}) with the lowest finite pre-distill perplexity (§4.1). "
    )
    if sel["rule"].get("source") == "default":
        cap += "The sweep stores no selection rule: this is the paper's default. "
    if compared:
        cap += f"Distilled: what the sweep distilled; ≠ marks the {n} disagreement(s) with the rule."
    counts = ", ".join(f"K={k}: {c}" for k, c in sel["k_counts"].items())
    return Table(
        stem,
        cap,
        colspec(last),
        head,
        rows,
        index_caption=f"Selection rule picks per pair, {label} ({counts}; {n} disagreement(s))",
        notes=[f"Pairs per picked K: {counts}."],
    )


# ---- seed repeats: pooled beside the item-level SE -------------------------------------------------
SEED_HEAD = [r"$\pm$ SE", "Seeds", "SD"]


def seed_pools(view: View) -> dict[int, dict[str, Any]]:
    """{main config: its accuracy (%) pooled over its seeds}, empty without seed repeats."""
    return {c: pooled(v, 100.0) for c, v in SeedValues.of(view.rows, "avg").values.items()}


def seed_cells(r: dict[str, Any], pools: dict[int, dict[str, Any]]) -> list[str]:
    """The item-level SE of the first seed's average, the mean over seeds and the between-seed sd."""
    p = pools.get(r["config_id"])
    se = fmt_pct(pct(r.get("avg_acc_se")))
    return [se, fmt_pct(p["mean"]), fmt_pct(p["sd"])] if p else [se, "", ""]


def seed_caption(pools: dict[int, dict[str, Any]]) -> str:
    if not pools:
        return ""
    n = max(len(p["values"]) for p in pools.values())
    return (
        f" ± SE: the item-level standard error of Avg (first seed); Seeds, SD: Avg's mean and "
        f"between-seed standard deviation over {n} seeds (calibration sample, distillation data order, "
        f"lm-eval seeds). A difference is {SEED_RULE}."
    )


# ---- Table 12: the distilled students ------------------------------------------------------------
def distilled_is_pairwise(view: View) -> bool:
    d = distilled_rows(view.rows)
    keys = [(plain(r["scoring"]), plain(r["grouping"])) for r in d.to_dict("records")]
    return bool(keys) and len(keys) == len(set(keys)) and all(g is not None for _, g in keys)


def distilled_table(view: View, ref: View | None, stem: str) -> Table | None:
    """Table 12 layout: one row per scoring×grouping pair, its (K, scaling), PPLs and accuracies."""
    d = sort_rows(distilled_rows(view.rows), list(DESIGN_AXES))
    if d.empty:
        return None
    best = {s: g["avg"].max() for s, g in d.groupby("scoring")}
    rd = distilled_rows(ref.rows) if ref is not None else None
    ref_by = (
        {(r["scoring"], r["grouping"]): r for r in records(sort_rows(rd, ["scoring", "grouping"]))}
        if rd is not None
        else {}
    )
    pools = seed_pools(view)
    cols = ["K", "DP", "Pre", "Post", *task_header(view.tasks), "Avg", *(SEED_HEAD if pools else [])]
    head: list[list[str] | str] = []
    if ref is not None:
        head += _group_header(2, [(f"Ours ({view.label})", len(cols)), (f"Paper ({ref.label})", 3)])
        cols += ["K", "DP", "Avg"]
    head.append(["Scoring", "Grouping", *cols])
    rows: list[list[str] | str] = []
    prev = None
    notes = []
    for r in records(d):
        if prev is not None and r["scoring"] != prev:
            rows.append(r"\midrule")
        avg = fmt_pct(pct(r["avg"]))
        pre = fmt_ppl(r["ppl_pre"], r["ppl_pre_kind"])
        pub = r.get("ppl_pre_published")
        if pub is not None and (r["ppl_pre"] is None or abs(pub - r["ppl_pre"]) > 0.5):
            pre += r"$^\dagger$"
            notes.append(f"{r['scoring']}×{r['grouping']}: {fmt_ppl(pub)}")
        line = [
            esc(r["scoring"]) if r["scoring"] != prev else "",
            axis_text("grouping", r["grouping"]),
            str(r["K"]),
            axis_text("dp_scaling", r["dp_scaling"]),
            pre,
            fmt_ppl(r["ppl_post"], r["ppl_post_kind"]),
            *view.task_cells(r["config_id"]),
            bold(avg) if r["avg"] == best[r["scoring"]] else avg,
            *(seed_cells(r, pools) if pools else []),
        ]
        if ref is not None:
            rr = ref_by.get((r["scoring"], r["grouping"]))
            line += (
                [str(rr["K"]), axis_text("dp_scaling", rr["dp_scaling"]), fmt_pct(pct(rr["avg"]))]
                if rr
                else ["", "", ""]
            )
        prev = r["scoring"]
        rows.append(line)
    cap = (
        f"Distilled students of {view.label}: the best (K, scaling) per scoring × grouping pair. Pre/Post: "
        "perplexity before/after distillation; accuracies in %; Avg: unweighted mean of the tasks. "
        "Bold: best average per scoring." + seed_caption(pools)
    )
    if ref is not None:
        cap += f" Paper: the pair's published configuration and average ({ref.label})."
    if notes:
        notes = [
            "† Pre is the grid's perplexity of the named (K, scaling); the distillation table prints "
            "another: " + "; ".join(notes) + "."
        ]
    return Table(
        stem,
        cap,
        "l" + colspec(head[-1][1:]),
        head,
        rows,
        notes=notes,
        index_caption=f"Distilled configurations, {view.label}, per-benchmark accuracy (Table 12 layout)",
    )


# ---- Tables 16/17: per scoring and K, with baselines -----------------------------------------------
def _side_rows(view: View) -> list[dict[str, Any]]:
    """Baselines and teachers with an accuracy (d2d candidates that were not distilled have none)."""
    r = view.rows
    side = r[r["kind"].isin(["baseline", "teacher"]) & r["avg"].notna()]
    return sorted(records(side), key=lambda x: (x["kind"] == "teacher", _baseline_rank(x), x["config_id"]))


def _baseline_rank(r: dict[str, Any]) -> int:
    b = r.get("baseline") or ""
    order = ["d2d", "random_ffn", "random_init", "pretrained", "dense_teacher"]
    return next((i for i, o in enumerate(order) if b.startswith(o)), len(order))


def _role(r: dict[str, Any]) -> str:
    b = r.get("baseline") or ""
    return f"{r['kind']}:{'d2d' if b.startswith('d2d:') else b}"


def cross_model_table(view: View, ref: View | None, stem: str) -> Table | None:
    """Tables 16/17 layout: rows scoring × K (pure pruning K = k, merging K > k), then baselines."""
    d = sort_rows(distilled_rows(view.rows), ["scoring", "K", "grouping", "dp_scaling"])
    if d.empty:
        return None
    k = top_k_of(d)
    with_pre = d["ppl_pre"].notna().any()
    ref_by: dict[tuple, dict[str, Any]] = {}
    ref_side: dict[str, dict[str, Any]] = {}
    if ref is not None:
        rk = top_k_of(distilled_rows(ref.rows))
        for r in records(distilled_rows(ref.rows)):
            if rk and r["K"] is not None:
                ref_by.setdefault((r["scoring"], r["K"] / rk), r)
        for r in _side_rows(ref):
            ref_side.setdefault(_role(r), r)
    pools = seed_pools(view)
    cols = [
        "K",
        *(["Pre"] if with_pre else []),
        *task_header(view.tasks),
        "Avg",
        *(SEED_HEAD if pools else []),
    ]
    head: list[list[str] | str] = []
    if ref is not None:
        head += _group_header(1, [(f"Ours ({view.label})", len(cols)), (f"Paper ({ref.label})", 2)])
        cols += ["K", "Avg"]
    head.append(["Scoring", *cols])
    moe = records(d)
    best_col = []
    for t in view.tasks:
        vals = [
            plain(view.acc.loc[r["config_id"]].get(t)) if r["config_id"] in view.acc.index else None
            for r in moe
        ]
        best_col.append(max((v for v in vals if v is not None), default=None))
    best_avg = max(r["avg"] for r in moe)
    rows: list[list[str] | str] = []
    for r in moe:
        cells = view.task_cells(r["config_id"])
        cells = [
            bold(c) if c and best_col[i] is not None and c == fmt_pct(best_col[i]) else c
            for i, c in enumerate(cells)
        ]
        avg = fmt_pct(pct(r["avg"]))
        kk = str(r["K"]) + ("" if k is None else (" (=k)" if r["K"] == k else ""))
        line = [
            esc(r["scoring"]),
            kk,
            *([fmt_ppl(r["ppl_pre"], r["ppl_pre_kind"])] if with_pre else []),
            *cells,
            bold(avg) if r["avg"] == best_avg else avg,
            *(seed_cells(r, pools) if pools else []),
        ]
        if ref is not None:
            rr = ref_by.get((r["scoring"], r["K"] / k)) if k else None
            line += [str(rr["K"]), fmt_pct(pct(rr["avg"]))] if rr else ["", ""]
        rows.append(line)
    side = _side_rows(view)
    if side:
        rows.append(r"\midrule")
        for r in side:
            line = [
                r"\multicolumn{2}{l}{" + esc(config_label(r)) + "}",
                *([fmt_ppl(r["ppl_pre"], r["ppl_pre_kind"])] if with_pre else []),
                *view.task_cells(r["config_id"]),
                fmt_pct(pct(r["avg"])),
                *(seed_cells(r, pools) if pools else []),
            ]
            if ref is not None:
                rr = ref_side.get(_role(r))
                line += ["", fmt_pct(pct(rr["avg"])) if rr else ""]
            rows.append(line)
    cap = (
        f"Distilled students of {view.label} by scoring and K (K = k: pure pruning, one expert per group; "
        "K > k: merging), with baselines. Accuracies in %. Bold: best per column." + seed_caption(pools)
    )
    if ref is not None:
        cap += f" Paper: the published average at the same K/k ({ref.label})."
    return Table(
        stem,
        cap,
        "l" + colspec(head[-1][1:]),
        head,
        rows,
        index_caption=f"Distilled students by scoring and K with baselines, {view.label} "
        "(Tables 16/17 layout)",
    )


# ---- Table 3: baselines -------------------------------------------------------------------------------
def baselines_table(view: View, ref: View | None, stem: str) -> Table | None:
    """Table 3 layout: the best student, prior-work metric pairs, baselines and teachers."""
    side = _side_rows(view)
    if not side:
        return None
    d = distilled_rows(view.rows)
    lines: list[tuple[dict[str, Any], str, str]] = []  # (row, label, role)
    for m in ordered("model", d["model"]):
        dm = d[d["model"] == m].sort_values(["avg", "config_id"], ascending=[False, True])
        if len(dm):
            top = records(dm)[0]
            lines.append((top, f"{config_label(top)} (best)", "best"))
        for (s, g), note in PRIOR_WORK.items():
            pr = dm[(dm["scoring"] == s) & (dm["grouping"] == g)]
            if len(pr):
                r = records(pr)[0]
                lines.append((r, f"{s}×{g}, K={r['K']} ({note})", f"pair:{s}:{g}"))
    ref_lines: dict[str, dict[str, Any]] = {}
    if ref is not None:
        rd = distilled_rows(ref.rows).sort_values(["avg", "config_id"], ascending=[False, True])
        if len(rd):
            ref_lines["best"] = records(rd)[0]
        for s, g in PRIOR_WORK:
            pr = rd[(rd["scoring"] == s) & (rd["grouping"] == g)]
            if len(pr):
                ref_lines[f"pair:{s}:{g}"] = records(pr)[0]
        for r in _side_rows(ref):
            ref_lines.setdefault(_role(r), r)
    tokens = any(r.get("distill_tokens") for r in [*side, *(x[0] for x in lines)])
    cols = [*(["Tokens"] if tokens else []), *task_header(view.tasks), "Avg"]
    head: list[list[str] | str] = []
    if ref is not None:
        head += _group_header(1, [(f"Ours ({view.label})", len(cols)), (f"Paper ({ref.label})", 1)])
        cols += ["Avg"]
    head.append(["Configuration", *cols])
    rows: list[list[str] | str] = []
    blocks = [
        lines,
        [(r, config_label(r), _role(r)) for r in side if r["kind"] == "baseline"],
        [(r, config_label(r), _role(r)) for r in side if r["kind"] == "teacher"],
    ]
    for block in blocks:
        if not block:
            continue
        if rows:
            rows.append(r"\midrule")
        for r, label, role in block:
            line = [
                esc(label),
                *([esc(r.get("distill_tokens") or "")] if tokens else []),
                *view.task_cells(r["config_id"]),
                fmt_pct(pct(r["avg"])),
            ]
            if ref is not None:
                rr = ref_lines.get(role)
                line.append(fmt_pct(pct(rr["avg"])) if rr else "")
            rows.append(line)
    cap = (
        f"Comparison to baselines on {view.label}: the best distilled student, the pairs that use prior "
        "work's metrics (MC-SMoE: SF×AB; HC-SMoE: SF×OC), baselines and teachers. Accuracies in %."
    )
    if ref is not None:
        cap += f" Paper: the published average of the same row ({ref.label})."
    return Table(
        stem,
        cap,
        "l" + colspec(head[-1][1:]),
        head,
        rows,
        index_caption=f"Baselines and teachers, {view.label} (Table 3 layout)",
    )


# ---- Tables 4/5: distillation ablations -----------------------------------------------------------
def ablation_tables(
    view: View, abl: list[dict[str, Any]], ref: View | None, ref_abl: list[dict[str, Any]] | None, stem: str
) -> list[Table]:
    """Table 4 (teacher routing k′) and Table 5 (loss) layouts, Δ against the default run."""
    out = []
    for i, entry in enumerate(abl):
        student = config_label(entry)
        for name, what in (("routing", "Teacher routing k′"), ("loss", "Loss")):
            items = entry.get(name)
            if not items:
                continue
            k = entry["top_k"]
            ref_items: dict[Any, dict[str, Any]] = {}
            if ref_abl:
                rk = ref_abl[0]["top_k"]
                for it in ref_abl[0].get(name, []):
                    ref_items[it["value"] / rk if name == "routing" and rk else it["value"]] = it
            cols = [*task_header(view.tasks), "Avg", "Δ"]
            head: list[list[str] | str] = []
            if ref is not None and ref_items:
                head += _group_header(1, [(f"Ours ({view.label})", len(cols)), (f"Paper ({ref.label})", 2)])
                cols += ["Avg", "Δ"]
            head.append([esc(what), *cols])
            rows: list[list[str] | str] = []
            for it in items:
                v = it["value"]
                default = (v == k) if name == "routing" else (v == "forward_kl")
                label = (f"k′ = {v}" if name == "routing" else str(v)) + (" (default)" if default else "")
                line = [
                    esc(label),
                    *view.task_cells(it["config_id"]),
                    fmt_pct(it["avg"]),
                    fmt_pct(it["delta"], signed=True),
                ]
                if ref is not None and ref_items:
                    rr = ref_items.get(v / k if name == "routing" and k else v)
                    line += [fmt_pct(rr["avg"]), fmt_pct(rr["delta"], signed=True)] if rr else ["", ""]
                rows.append(line)
            suffix = "" if len(abl) == 1 else f"_{i + 1}"
            table = "Table 4" if name == "routing" else "Table 5"
            cap = (
                f"Distillation ablation on {view.label}, student {student}: "
                + (
                    "the teacher routes each token to its top-k′ experts during distillation"
                    if name == "routing"
                    else "distillation loss (forward KL is the default)"
                )
                + ". Accuracies in %; Δ: average minus the default run's (pp)."
            )
            if ref is not None and ref_items:
                cap += f" Paper: {ref.label}" + (", matched by k′/k." if name == "routing" else ".")
            out.append(
                Table(
                    f"{stem}_{name}{suffix}",
                    cap,
                    "l" + colspec(head[-1][1:]),
                    head,
                    rows,
                    index_caption=f"{what} ablation, {view.label}, {student} ({table} layout)",
                )
            )
    return out


# ---- Figure 4's numbers --------------------------------------------------------------------------------
def _interval_note(d: dict[str, Any] | None) -> str:
    """A difference's 95% interval for a table note, and whether it is distinguishable at this n."""
    if not d:
        return ""
    ci = f"95% CI [{d['ci'][0]:+.2f}, {d['ci'][1]:+.2f}] pp, n={d['n']}{seed_words(d)}"
    why = verdict(d)
    return f" ({ci})" if why is None else f", {why} ({ci})"


def marginal_table(
    f: dict[str, Any], label: str, ref_f: dict[str, Any] | None, ref_label: str, stem: str
) -> Table | None:
    """Mean post-distill accuracy per value of each design axis, with the best-to-worst spread."""
    mm = f.get("marginal_means") or {}
    if not mm:
        return None
    rmm = (ref_f or {}).get("marginal_means") or {}
    head: list[list[str] | str] = [
        [
            "Axis",
            "Value",
            "n",
            f"Mean ({esc(label)})",
            r"$\pm$ SE",
            *([f"Paper ({esc(ref_label)})", r"$\pm$ SE"] if ref_f else []),
        ]
    ]
    rows: list[list[str] | str] = []
    notes = []
    for axis, values in mm.items():
        if rows:
            rows.append(r"\midrule")
        best = max(v["mean"] for v in values.values())
        for j, (v, m) in enumerate(values.items()):
            mean = fmt_pct(m["mean"])
            line = [
                esc(axis if axis != "dp_scaling" else "DP scaling") if j == 0 else "",
                esc(v),
                str(m["n"]),
                bold(mean) if m["mean"] == best else mean,
                fmt_pct(m.get("se")),
            ]
            if ref_f:
                rv = rmm.get(axis, {}).get(v)
                line += [fmt_pct(rv["mean"]) if rv else "", fmt_pct(rv.get("se")) if rv else ""]
            rows.append(line)
        sp = f["spread"].get(axis)
        if sp:
            notes.append(
                f"{axis}: best {sp['best']} ({sp['best_mean']:.2f}%), worst {sp['worst']} "
                f"({sp['worst_mean']:.2f}%), spread {sp['pp']:.2f} pp{_interval_note(sp.get('interval'))}."
            )
    for st in f.get("stated", []):
        if st.get("interval"):
            notes.append(f"{st['a']} minus {st['b']}: {st['pp']:+.2f} pp{_interval_note(st['interval'])}.")
    cap = (
        f"Marginal effect of each design axis on post-distill average accuracy (%) of the "
        f"{f.get('n_distilled')} distilled students of {label}: mean over the students with that value "
        "(Figure 4), with its standard error (own sweeps: paired bootstrap over items; papers: binomial, "
        "from the benchmarks' published sizes). A spread whose 95% interval holds 0 is not "
        "distinguishable at this n."
    )
    return Table(
        stem,
        cap,
        "llrrr" + ("rr" if ref_f else ""),
        head,
        rows,
        notes=notes,
        index_caption=f"Marginal mean accuracy per design axis, {label} (Figure 4's numbers)",
    )
