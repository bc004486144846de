"""Derived facts, computed from the views' frames and never typed in.

Pure functions over pandas frames (no SQL, no plotting): the selection rule and its picks, the
disagreements between the rule and what was distilled, marginal means per design axis and their
spread, how many pairs pick each K, gaps and ablation deltas, selection overlap and effective rank,
and whether a sweep's numbers come from more than one version of the code.
Accuracies arrive as fractions and leave as percentages (pp) where said.

Identities are read, never inferred from metric values or names: a distillation variant is a row
with `variant_of` (the main configuration it varies), and a sweep's selection rule is the one stored
with it (`select_json` of the `sweep_info` view).
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pandas as pd

from analysis.uncertainty import SEED_RULE, SeedValues, Uncertainty, pooled, seed_label
from db.axes import default_rule, design_axes
from db.select_rule import select_best_rows

SCORING_ORDER = ("SF", "PP", "PS", "CP", "ACP", "DO-CP", "DO-ACP", "REAP", "EAN", "frequency", "Weights")
GROUPING_ORDER = ("RR", "WC", "RC", "AB", "OC")
SCALING_ORDER = ("uniform", "proportional", "avg_cp")
TASK_ORDER = ("winogrande", "hellaswag", "arc_easy", "arc_challenge", "mmlu")
LOSS_ORDER = ("forward_kl", "reverse_kl", "intermediate")
ORDERS = {
    "scoring": SCORING_ORDER,
    "grouping": GROUPING_ORDER,
    "dp_scaling": SCALING_ORDER,
    "task": TASK_ORDER,
    "distill_loss": LOSS_ORDER,
}
# the paper's rule (§4.1), used for a sweep that stores none (and said so wherever the rule is stated)
DEFAULT_RULE = default_rule()
# the axes that shape a dense student (the paper's design axes): scoring, grouping, dp_scaling, K
DESIGN_AXES = design_axes("dense")
PRIOR_WORK = {("SF", "AB"): "MC-SMoE metrics", ("SF", "OC"): "HC-SMoE metrics"}  # Table 3 (§4.2)
# differences of marginal means the paper states in words (§4.2), checked against their uncertainty
STATED_PAIRS = (("scoring", "DO-ACP", "ACP"), ("grouping", "RR", "AB"))


# ---- small helpers ------------------------------------------------------------------------------
def plain(v: Any) -> Any:
    """NaN / NA → None, numpy scalars → Python scalars (so rows compare, hash and print plainly)."""
    if v is None or v is pd.NA:
        return None
    if isinstance(v, float | np.floating) and math.isnan(v):
        return None
    if isinstance(v, np.integer):
        return int(v)
    if isinstance(v, np.floating):
        return float(v)
    return v


def records(df: pd.DataFrame) -> list[dict[str, Any]]:
    return [{k: plain(v) for k, v in r.items()} for r in df.to_dict("records")]


def order_key(axis: str, v: Any) -> tuple:
    """Sort key: the paper's order for known names, numbers ascending, other names alphabetically."""
    v = plain(v)
    if v is None:
        return (3, 0.0, "")
    order = ORDERS.get(axis, ())
    if v in order:
        return (0, float(order.index(v)), "")
    if isinstance(v, int | float):
        return (1, float(v), "")
    return (2, 0.0, str(v))


def ordered(axis: str, values) -> list:
    return sorted({plain(v) for v in values}, key=lambda v: order_key(axis, v))


def sort_rows(df: pd.DataFrame, axes: list[str]) -> pd.DataFrame:
    if df.empty:
        return df
    keys = [
        tuple(order_key(a, r[a]) for a in axes) + (plain(r["config_id"]) or 0,) for r in df.to_dict("records")
    ]
    idx = sorted(range(len(df)), key=lambda i: keys[i])
    return df.iloc[idx]


def r4(x: Any) -> float | None:
    x = plain(x)
    return None if x is None else round(float(x), 4)


def pct(x: Any) -> float | None:
    x = plain(x)
    return None if x is None else 100.0 * float(x)


# ---- which rows are what ----------------------------------------------------------------------
def is_variant(df: pd.DataFrame) -> pd.Series:
    """Distillation variants (Tables 4/5): rows that name the main configuration they vary."""
    if "variant_of" not in df.columns:
        raise ValueError("rows: no column 'variant_of'; allowed: frames of the results view (analysis.load)")
    return df["variant_of"].notna()


def is_seed_repeat(df: pd.DataFrame) -> pd.Series:
    """Seed repeats of a selected student (variant `seed=<s>`): the same configuration under another seed."""
    return (
        df["variant"].map(seed_label).notna() if "variant" in df.columns else pd.Series(False, index=df.index)
    )


def grid_rows(results: pd.DataFrame) -> pd.DataFrame:
    """The conversion grid: MoE→dense configurations with a K, variants excluded."""
    return results[(results["kind"] == "moe2dense") & results["K"].notna() & ~is_variant(results)]


def distilled_rows(results: pd.DataFrame) -> pd.DataFrame:
    """The distilled students of the main distillation (variants excluded) with an accuracy."""
    return results[(results["kind"] == "moe2dense") & ~is_variant(results) & results["avg"].notna()]


def finite_ppl(df: pd.DataFrame, col: str = "ppl_pre") -> pd.Series:
    kind = df[f"{col}_kind"] if f"{col}_kind" in df.columns else pd.Series("finite", index=df.index)
    return df[col].notna() & np.isfinite(df[col].astype(float)) & kind.isin(["finite", None])


def moe_models(results: pd.DataFrame) -> list[str]:
    return sorted({m for m in results.loc[results["kind"] == "moe2dense", "model"] if m is not None})


def top_k_of(rows: pd.DataFrame) -> int | None:
    ks = [plain(v) for v in rows["top_k"] if plain(v) is not None]
    return min(ks) if ks else None


# ---- the selection rule (§4.1; one implementation in db/select_rule.py) -----------------------
def select_best(df: pd.DataFrame, per: list[str], over: list[str], by: str = "ppl_pre") -> pd.DataFrame:
    """select_best_rows over a frame; returns the picked rows in the axes' order."""
    for a in [*per, *over, by]:
        if a not in df.columns:
            raise ValueError(f"select_best: column {a!r} missing; allowed: {', '.join(df.columns)}")
    ids = [r["config_id"] for r in select_best_rows(records(df), per, over, by)]
    return sort_rows(df[df["config_id"].isin(ids)], per)


def sweep_rule(rows: pd.DataFrame) -> tuple[dict[str, Any], str]:
    """(rule, source): the selection rule stored with the rows' sweep (`select_json`) and "sweep", or the
    paper's default (per scoring × grouping over K and scaling) and "default" when none is stored."""
    stored = (
        sorted({v for v in rows["select_json"] if v is not None}) if "select_json" in rows.columns else []
    )
    if len(stored) > 1:
        raise ValueError(f"rows: {len(stored)} different selection rules; allowed: the rows of one sweep")
    if not stored:
        return default_rule(), "default"
    try:
        rule = json.loads(stored[0])
    except json.JSONDecodeError:
        rule = None
    ok = (
        isinstance(rule, dict)
        and isinstance(rule.get("best_by", "ppl_pre"), str)
        and all(
            isinstance(rule.get(k), list) and all(isinstance(a, str) for a in rule[k])
            for k in ("per", "over")
        )
    )
    if not ok:
        raise ValueError(
            f"select_json {stored[0]!r}: not a selection rule; allowed: a JSON object with "
            '"per" and "over" (lists of axis names) and optionally "best_by" (a column, e.g. "ppl_pre")'
        )
    return {"best_by": rule.get("best_by", "ppl_pre"), "per": rule["per"], "over": rule["over"]}, "sweep"


def _cell(r: dict[str, Any] | None, over: list[str]) -> dict[str, Any] | None:
    if r is None:
        return None
    return {**{a: plain(r[a]) for a in over}, "ppl_pre": r4(r["ppl_pre"]), "config_id": plain(r["config_id"])}


def selection_report(grid: pd.DataFrame, rule: dict[str, Any] | None = None) -> dict[str, Any]:
    """The rule's picks, how many pick each K, and every disagreement with what was distilled.

    The rule is `rule`, else the one stored with the grid's sweep, else the paper's default (the
    result's `rule.source` says which: "given", "sweep" or "default"). Also lists grid cells without a
    finite PPL, distilled cells whose published pre-distill PPL differs from the grid's, and K = k rows
    that differ across groupings (one expert per group: the grouping cannot change the student when
    the kept set is the same, §4.2)."""
    if rule is None:
        rule, source = sweep_rule(grid)
    else:
        rule, source = {"best_by": "ppl_pre", **rule}, "given"
    per, over, by = list(rule["per"]), list(rule["over"]), rule["best_by"]
    picks = select_best(grid, per, over, by)
    chosen = grid[grid["selected_for_distill"] == 1]

    def key(r: dict[str, Any]) -> tuple:
        return tuple(plain(r[a]) for a in per)

    pick_by = {key(r): r for r in records(picks)}
    chosen_by: dict[tuple, list[dict[str, Any]]] = {}
    for r in records(chosen):
        chosen_by.setdefault(key(r), []).append(r)
    disagreements = []
    if chosen_by:
        for k in sorted(
            set(pick_by) | set(chosen_by),
            key=lambda t: tuple(order_key(a, v) for a, v in zip(per, t, strict=True)),
        ):
            p, cs = pick_by.get(k), chosen_by.get(k, [])
            if p is not None and any(c["config_id"] == p["config_id"] for c in cs):
                continue
            same = p is not None and any(all(c[a] == p[a] for a in over) for c in cs)
            if same:
                continue
            disagreements.append(
                {
                    **dict(zip(per, k, strict=True)),
                    "rule": _cell(p, over),
                    "distilled": [_cell(c, over) for c in cs] or None,
                }
            )
    published = []
    for r in records(chosen):
        pub = r.get("ppl_pre_published")
        if pub is not None and (r["ppl_pre"] is None or abs(r["ppl_pre"] - pub) > 0.5):
            published.append(
                {
                    **{a: r[a] for a in DESIGN_AXES},
                    "ppl_pre_grid": r4(r["ppl_pre"]),
                    "ppl_pre_published": r4(pub),
                }
            )
    nonfinite, missing = [], []
    for r in records(grid):
        if (
            r["ppl_pre"] is not None
            and math.isfinite(r["ppl_pre"])
            and r.get("ppl_pre_kind") in (None, "finite")
        ):
            continue
        cell = {a: r[a] for a in DESIGN_AXES}
        (nonfinite if r.get("ppl_pre_kind") not in (None, "finite") else missing).append(
            {**cell, "value_kind": r.get("ppl_pre_kind")} if r.get("ppl_pre_kind") else cell
        )
    k_eq_k = []
    top = grid[(grid["K"] == grid["top_k"]).fillna(False).astype(bool)]
    for (s, dp), g in sorted(
        top.groupby(["scoring", "dp_scaling"], dropna=False),
        key=lambda kv: (order_key("scoring", kv[0][0]), order_key("dp_scaling", kv[0][1])),
    ):
        vals = {plain(r["grouping"]): r4(r["ppl_pre"]) for r in records(sort_rows(g, ["grouping"]))}
        if len({v for v in vals.values() if v is not None}) > 1:
            k_eq_k.append(
                {"scoring": plain(s), "dp_scaling": plain(dp), "K": plain(g["K"].iloc[0]), "ppl_pre": vals}
            )
    counts = picks["K"].value_counts()
    return {
        "rule": {"per": per, "over": over, "by": f"{by} (lowest finite)", "source": source},
        "picks": [{**{a: plain(r[a]) for a in per}, **_cell(r, over)} for r in records(picks)],
        "k_counts": {int(k): int(counts[k]) for k in sorted(counts.index)},
        "distilled_k_counts": {int(k): int(n) for k, n in sorted(chosen["K"].value_counts().items())},
        "compared_with_distilled": bool(chosen_by),
        "disagreements": disagreements,
        "published_ppl_mismatches": published,
        "nonfinite_cells": nonfinite,
        "missing_cells": missing,
        "k_equals_topk_grouping_differences": k_eq_k,
    }


# ---- accuracies ---------------------------------------------------------------------------------
def marginal_means(distilled: pd.DataFrame, axis: str) -> pd.DataFrame:
    """Mean post-distill accuracy (%) per value of one design axis (Figure 4)."""
    d = distilled[distilled[axis].notna()]
    rows = []
    for v in ordered(axis, d[axis]):
        a = d.loc[d[axis] == v, "avg"]
        rows.append({axis: v, "mean": 100.0 * float(a.mean()), "n": int(a.size)})
    return pd.DataFrame(rows, columns=[axis, "mean", "n"])


def spread(means: pd.DataFrame, axis: str) -> dict[str, Any] | None:
    """Best and worst value of an axis by mean accuracy and the gap between them (pp)."""
    if len(means) < 2:
        return None
    rows = records(means)
    best = max(rows, key=lambda r: r["mean"])  # ties: the first in the axis' order
    worst = min(rows, key=lambda r: r["mean"])
    return {
        "best": best[axis],
        "best_mean": r4(best["mean"]),
        "worst": worst[axis],
        "worst_mean": r4(worst["mean"]),
        "pp": r4(best["mean"] - worst["mean"]),
    }


def best_by_scoring_k(distilled: pd.DataFrame) -> pd.DataFrame:
    """Per scoring and K, the best distilled accuracy over the other axes (Figure 7)."""
    rows = []
    for r in records(distilled):
        rows.append(
            {
                "scoring": r["scoring"],
                "K": r["K"],
                "top_k": r["top_k"],
                "avg": pct(r["avg"]),
                "grouping": r["grouping"],
                "dp_scaling": r["dp_scaling"],
                "config_id": r["config_id"],
            }
        )
    df = pd.DataFrame(rows, columns=["scoring", "K", "top_k", "avg", "grouping", "dp_scaling", "config_id"])
    if df.empty:
        return df
    df = df.sort_values(["avg", "config_id"], ascending=[False, True]).drop_duplicates(["scoring", "K"])
    return sort_rows(df, ["scoring", "K"]).reset_index(drop=True)


def baseline_avg(rows: pd.DataFrame, name: str) -> float | None:
    b = rows[(rows["kind"] == "baseline") & (rows["baseline"] == name) & rows["avg"].notna()]
    return pct(b["avg"].iloc[0]) if len(b) else None


def ablations(rows: pd.DataFrame) -> list[dict[str, Any]]:
    """Tables 4/5: per ablated student, accuracy per teacher routing k′ and per loss, Δ to the default.

    The variants of a student are the rows whose `variant_of` is its configuration."""
    moe = rows[rows["kind"] == "moe2dense"]
    var = moe[is_variant(moe) & ~is_seed_repeat(moe) & moe["avg"].notna()]
    base = distilled_rows(moe)
    axes = list(DESIGN_AXES)
    out = []
    students = []
    for main in {plain(m) for m in var["variant_of"]}:
        v, b, m = (
            var[var["variant_of"] == main],
            base[base["config_id"] == main],
            moe[moe["config_id"] == main],
        )
        first = records(m if len(m) else v)[0]  # the student's axes: its main configuration's
        students.append((tuple(plain(first[a]) for a in axes), main, v, b))
    for st, _, v, b in sorted(
        students, key=lambda t: (tuple(order_key(a, x) for a, x in zip(axes, t[0], strict=True)), t[1])
    ):
        k = top_k_of(v) or top_k_of(b)
        b_avg = pct(b["avg"].iloc[0]) if len(b) else None
        entry: dict[str, Any] = {**dict(zip(axes, st, strict=True)), "top_k": k}
        routing = {plain(r["teacher_top_k"]): pct(r["avg"]) for r in records(v[v["teacher_top_k"].notna()])}
        if routing and k is not None and k not in routing and b_avg is not None:
            routing[k] = b_avg
        loss = {plain(r["distill_loss"]): pct(r["avg"]) for r in records(v[v["distill_loss"].notna()])}
        if loss and "forward_kl" not in loss and b_avg is not None:
            loss["forward_kl"] = b_avg
        for name, table, ref in (("routing", routing, k), ("loss", loss, "forward_kl")):
            if not table:
                continue
            r0 = table.get(ref)
            entry[name] = [
                {
                    "value": key,
                    "avg": r4(a),
                    "delta": r4(a - r0) if r0 is not None else None,
                    "config_id": _config_of(v, b, name, key),
                }
                for key, a in sorted(
                    table.items(), key=lambda kv: order_key("distill_loss" if name == "loss" else "K", kv[0])
                )
            ]
        out.append(entry)
    return out


def seed_report(rows: pd.DataFrame) -> dict[str, Any] | None:
    """Per repeated student: accuracy (pp) and perplexities under each seed, pooled (mean, between-seed sd),
    beside the item-level SE of its first seed's accuracy; None without seed repeats."""
    moe = rows[rows["kind"] == "moe2dense"]
    cols = {"avg": 100.0, "ppl_pre": 1.0, "ppl_post": 1.0}
    seeds = {col: SeedValues.of(moe, col).values for col in cols}
    ids = set().union(*(v.keys() for v in seeds.values()))
    if not ids:
        return None
    axes = list(DESIGN_AXES)
    students = []
    for r in records(sort_rows(moe[moe["config_id"].isin(ids)], axes)):
        e: dict[str, Any] = {**{a: r[a] for a in axes}, "config_id": r["config_id"]}
        for col, scale in cols.items():
            if r["config_id"] in seeds[col]:
                e[col] = pooled(seeds[col][r["config_id"]], scale)
        if "avg" in e:
            e["avg"]["item_se"] = r4(pct(r.get("avg_acc_se")))
        students.append(e)
    return {"rule": SEED_RULE, "students": students}


def _config_of(v: pd.DataFrame, b: pd.DataFrame, name: str, key: Any) -> int | None:
    col = "teacher_top_k" if name == "routing" else "distill_loss"
    hit = v[v[col] == key]
    if len(hit):
        return plain(hit["config_id"].iloc[0])
    return plain(b["config_id"].iloc[0]) if len(b) else None


def model_facts(results: pd.DataFrame, model: str, unc: Uncertainty | None = None) -> dict[str, Any]:
    """Every derived fact about one teacher model's rows; each stated difference carries its
    `interval` (analysis/uncertainty.py; None where the data for one is missing)."""
    unc = unc or Uncertainty(None, None)
    rows = results[results["model"] == model]
    grid, dist = grid_rows(rows), distilled_rows(rows)
    k = top_k_of(rows[rows["kind"] == "moe2dense"])
    variants = sorted({v for v in rows["teacher_variant"] if v is not None})
    f: dict[str, Any] = {"model": model, "teacher_variant": variants, "top_k": k}
    fin = rows[(rows["kind"] == "moe2dense") & ~is_variant(rows) & finite_ppl(rows)]
    if len(grid) and finite_ppl(grid).any():
        f["selection"] = selection_report(grid)
        f["selection"]["margins"] = selection_margins(grid, f["selection"], unc)
    if len(fin):
        best = {}
        for s in ordered("scoring", fin["scoring"]):
            r = records(fin[fin["scoring"] == s].sort_values(["ppl_pre", "config_id"]))[0]
            best[s] = {
                "ppl_pre": r4(r["ppl_pre"]),
                "K": r["K"],
                "grouping": r["grouping"],
                "dp_scaling": r["dp_scaling"],
            }
        f["best_ppl_per_scoring"] = best
    if len(dist):
        f["n_distilled"] = int(len(dist))
        f["marginal_means"], f["spread"] = {}, {}
        for axis in DESIGN_AXES:
            m = marginal_means(dist, axis)
            if len(m) >= 2:
                groups = {v: [int(c) for c in dist.loc[dist[axis] == v, "config_id"]] for v in m[axis]}
                f["marginal_means"][axis] = {
                    str(r[axis]): {"mean": r4(r["mean"]), "n": int(r["n"]), "se": unc.acc_se(groups[r[axis]])}
                    for r in records(m)
                }
                sp = spread(m, axis)
                sp["interval"] = unc.acc_diff(groups[sp["best"]], groups[sp["worst"]], sp["pp"])
                f["spread"][axis] = sp
        f["stated"] = _stated_pairs(dist, f["marginal_means"], unc)
        ranked = records(dist.sort_values(["avg", "config_id"], ascending=[False, True]))
        top = ranked[0]
        f["best"] = {a: top[a] for a in DESIGN_AXES} | {"avg": r4(pct(top["avg"]))}
        f["intervals"] = {}
        if k is not None:
            n = next((i for i, r in enumerate(ranked) if r["K"] != k), len(ranked))
            f["top_n_at_k_equals_topk"] = n
            at_k = best_by_scoring_k(dist)
            at_k = at_k[at_k["K"] == k]
            if len(at_k) >= 2:
                hi, lo = at_k.loc[at_k["avg"].idxmax()], at_k.loc[at_k["avg"].idxmin()]
                pp = r4(hi["avg"] - lo["avg"])
                f["scoring_gap_at_k_equals_topk"] = {
                    "best": hi["scoring"],
                    "worst": lo["scoring"],
                    "pp": pp,
                    "interval": unc.acc_diff([int(hi["config_id"])], [int(lo["config_id"])], pp),
                }
            pairs = _merge_prune_pairs(dist, k)
            f["merge_minus_prune"] = {s: v for s, (v, _, _) in pairs.items()}
            f["intervals"]["merge_minus_prune"] = {
                s: unc.acc_diff([m], [p], v) for s, (v, m, p) in pairs.items()
            }
        for b in ("random_init", "random_ffn"):
            a = baseline_avg(rows, b)
            if a is not None:
                f[f"gain_over_{b}"] = r4(pct(top["avg"]) - a)
                bid = rows[(rows["kind"] == "baseline") & (rows["baseline"] == b) & rows["avg"].notna()]
                f["intervals"][f"gain_over_{b}"] = unc.acc_diff(
                    [int(top["config_id"])], [int(bid["config_id"].iloc[0])], f[f"gain_over_{b}"]
                )
    seeds = seed_report(rows)
    if seeds:
        f["seeds"] = seeds
    abl = ablations(rows)
    if abl:
        for a in abl:
            for name in ("routing", "loss"):
                ref = next((it for it in a.get(name, []) if it["delta"] == 0), None)
                for it in a.get(name, []):
                    ok = ref is not None and it["delta"] is not None and it is not ref
                    ok = ok and it["config_id"] is not None and ref["config_id"] is not None
                    it["interval"] = (
                        unc.acc_diff([it["config_id"]], [ref["config_id"]], it["delta"]) if ok else None
                    )
        f["ablations"] = abl
    return f


def _stated_pairs(dist: pd.DataFrame, mm: dict[str, Any], unc: Uncertainty) -> list[dict[str, Any]]:
    """The differences of marginal means the paper states (STATED_PAIRS) where both values are present."""
    out = []
    for axis, a, b in STATED_PAIRS:
        means = mm.get(axis, {})
        if a in means and b in means:
            pp = r4(means[a]["mean"] - means[b]["mean"])
            ids = {v: [int(c) for c in dist.loc[dist[axis] == v, "config_id"]] for v in (a, b)}
            out.append({"axis": axis, "a": a, "b": b, "pp": pp, "interval": unc.acc_diff(ids[a], ids[b], pp)})
    return out


def selection_margins(grid: pd.DataFrame, sel: dict[str, Any], unc: Uncertainty) -> list[dict[str, Any]]:
    """Per pick of the selection rule: its runner-up in the same cell (the next lowest finite pre-distill
    PPL of another student) and the PPL difference runner-up minus pick with its interval."""
    per = sel["rule"]["per"]
    over = sel["rule"]["over"]
    fin = grid[finite_ppl(grid)]
    out = []
    for p in sel["picks"]:
        cell = fin
        for a in per:
            cell = cell[cell[a] == p[a]] if p[a] is not None else cell[cell[a].isna()]
        cell = cell[
            (cell["config_id"] != p["config_id"]) & (cell["duplicate_of"].fillna(-1) != p["config_id"])
        ]
        cell = cell[cell["ppl_pre"].astype(float) != float(p["ppl_pre"])]  # not the same student again
        if cell.empty:
            continue
        r = records(cell.sort_values(["ppl_pre", "config_id"]))[0]
        diff = r4(r["ppl_pre"] - p["ppl_pre"])
        out.append(
            {
                **{a: p[a] for a in per},
                "pick": _cell(p, over),
                "runner_up": _cell(r, over),
                "ppl_diff": diff,
                "interval": unc.ppl_diff([r["config_id"]], [p["config_id"]], diff),
            }
        )
    return out


def _merge_prune_pairs(dist: pd.DataFrame, k: int) -> dict[str, tuple[float, int, int]]:
    """Per scoring: (best accuracy at the smallest K > k minus the best at K = k in pp, their configs)."""
    b = best_by_scoring_k(dist)
    out = {}
    for s in ordered("scoring", b["scoring"]):
        g = b[b["scoring"] == s]
        prune = g[g["K"] == k]
        merge = g[g["K"] > k].sort_values("K")
        if len(prune) and len(merge):
            out[s] = (
                r4(merge["avg"].iloc[0] - prune["avg"].iloc[0]),
                int(merge["config_id"].iloc[0]),
                int(prune["config_id"].iloc[0]),
            )
    return out


def facts(
    results: pd.DataFrame, tasks: pd.DataFrame | None = None, items: pd.DataFrame | None = None
) -> dict[str, dict[str, Any]]:
    """Derived facts per sweep and teacher model (JSON-ready, deterministic). Sweeps are kept apart:
    one sweep's distilled set is what its selection rule is checked against. With `tasks` (task_scores)
    and `items` (config_items) every stated difference gets an interval: a paired bootstrap over items,
    or without items the binomial bound from the benchmarks' published sizes."""
    out: dict[str, dict[str, Any]] = {}
    for sweep in sorted({s for s in results["sweep"]}):
        rows = results[results["sweep"] == sweep]
        models = {}
        for m in moe_models(rows):
            mine = rows[rows["model"] == m]
            t = tasks[tasks["config_id"].isin(mine["config_id"])] if tasks is not None else None
            i = (
                items[items["config_id"].isin(mine["config_id"])]
                if items is not None and len(items)
                else None
            )
            models[m] = model_facts(rows, m, Uncertainty.of(mine, t, i))
        if models:
            out[sweep] = models
    return out


# ---- diagnostics (Figures 2 and 3) -------------------------------------------------------------
def _one_config_per_scoring(df: pd.DataFrame) -> dict[str, int]:
    """At the smallest K, one configuration per scoring (the kept set does not depend on grouping)."""
    out = {}
    for s in ordered("scoring", df["scoring"]):
        g = sort_rows(df[df["scoring"] == s].drop_duplicates("config_id"), ["grouping", "dp_scaling"])
        out[s] = plain(g["config_id"].iloc[0])
    return out


def selection_overlap(selections: pd.DataFrame, model: str) -> tuple[int | None, pd.DataFrame]:
    """(K, scoring×scoring matrix): mean over layers of |S_a ∩ S_b| / K at the smallest K (Figure 2)."""
    sel = selections[(selections["model"] == model) & selections["scoring"].notna() & selections["K"].notna()]
    if sel.empty:
        return None, pd.DataFrame()
    K = int(sel["K"].min())
    sel = sel[sel["K"] == K]
    ids = _one_config_per_scoring(sel)
    sets = {
        s: {
            int(layer): set(g["expert"].astype(int))
            for layer, g in sel[sel["config_id"] == cid].groupby("layer")
        }
        for s, cid in ids.items()
    }
    names = list(ids)
    m = np.zeros((len(names), len(names)))
    for i, a in enumerate(names):
        for j, b in enumerate(names):
            layers = sorted(set(sets[a]) & set(sets[b]))
            m[i, j] = np.mean([len(sets[a][x] & sets[b][x]) / K for x in layers]) if layers else np.nan
    return K, pd.DataFrame(m, index=names, columns=names)


def effective_rank(
    diagnostics: pd.DataFrame, results: pd.DataFrame, model: str, name: str = "effective_rank"
) -> pd.DataFrame:
    """Per scoring at the smallest K: mean and std over layers of the kept kernel's effective rank (Fig 3)."""
    d = diagnostics[(diagnostics["name"] == name) & diagnostics["K"].notna()]
    d = d[d["config_id"].isin(results.loc[results["model"] == model, "config_id"])]
    cols = ["scoring", "K", "mean", "std", "layers", "config_id"]
    if d.empty:
        return pd.DataFrame(columns=cols)
    K = int(d["K"].min())
    d = d[d["K"] == K]
    rows = []
    for s, cid in _one_config_per_scoring(d).items():
        v = d.loc[d["config_id"] == cid, "value"].astype(float)
        rows.append(
            {
                "scoring": s,
                "K": K,
                "mean": float(v.mean()),
                "std": float(v.std(ddof=0)),
                "layers": int(v.size),
                "config_id": cid,
            }
        )
    return pd.DataFrame(rows, columns=cols)


# ---- code versions -----------------------------------------------------------------------------
def code_versions(code: pd.DataFrame) -> dict[str, Any]:
    """Whether one sweep's numbers come from more than one version of the code (`config_code` rows).

    `mixed`: {component: {hash: number of configurations}} for every component (a name in the jobs'
    `code_json`) that the configurations' jobs carry with two or more hashes. `unknown`: {stage: number
    of configurations} whose job of that stage records no `code_json` (written before jobs recorded
    it); listed only when some job of the sweep does record one, since then those numbers may come from
    other code. Both empty: one version throughout (or none recorded at all)."""
    seen: dict[str, dict[str, set[int]]] = {}
    missing: dict[str, set[int]] = {}
    for r in records(code):
        if r["code_json"] is None:
            missing.setdefault(r["stage"], set()).add(r["config_id"])
            continue
        try:
            comps = json.loads(r["code_json"])
        except json.JSONDecodeError:
            comps = None
        if not isinstance(comps, dict) or not all(isinstance(h, str) for h in comps.values()):
            raise ValueError(
                f"job {r['job_key']}: code_json {r['code_json']!r} is not a JSON object; "
                "allowed: {component: hash}"
            )
        for comp, h in comps.items():
            seen.setdefault(comp, {}).setdefault(h, set()).add(r["config_id"])
    mixed = {
        comp: {h: len(ids) for h, ids in sorted(hashes.items())}
        for comp, hashes in sorted(seen.items())
        if len(hashes) > 1
    }
    unknown = {stage: len(ids) for stage, ids in sorted(missing.items())} if seen else {}
    return {"mixed": mixed, "unknown": unknown}


def code_versions_line(cv: dict[str, Any]) -> str | None:
    """One sentence naming the mixed components and how many configurations each version covers."""
    parts = []
    for comp, hashes in cv["mixed"].items():
        versions = ", ".join(f"{h} ({n} configuration{'s' * (n != 1)})" for h, n in hashes.items())
        parts.append(f"{comp}: {versions}")
    if cv["unknown"]:
        stages = ", ".join(f"{s} ({n} configuration{'s' * (n != 1)})" for s, n in cv["unknown"].items())
        parts.append(f"no recorded code version for {stages}")
    if not parts:
        return None
    return "Numbers from more than one code version — " + "; ".join(parts) + "."
