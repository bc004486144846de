"""The table of a sweep's smaller MoEs (`output` = moe, merged or edited): compression method × K ×
recovery, the headline tasks' accuracies and their mean, beside a paper's published smaller MoEs of the
same model.

A smaller MoE is a configuration whose `output` keeps a router: `moe` (pruned: `scoring` names the method
that chose the experts), `merged` (`merging` names the method that merged them) or `edited` (`editing`
names the method that factorised them); `K` is the experts kept per layer (for editing, the parameter
budget of K experts) and `recovery` what ran after it (none; Router KD: only the routers retrained; full
KD: every parameter distilled). The papers' smaller MoEs are reference sweeps of their own
(analysis/reference.py: the Router KD paper's Tables 2/3, the REAP paper's Table 2); `match_moe_reference`
picks the one of the same model.

The same method name is not always the same implementation: each published smaller MoE stores what its
paper ran (`settings` JSON: `implementation`, `settings`, `calibration`, and `vs_ours` — same, differs,
unknown or none — with the `difference`; analysis/data/method_implementations.csv), and the table's caption
says per method whether ours is that implementation or how it differs; its notes give the paper's settings
and calibration.
"""

from __future__ import annotations

import json
from typing import Any

import pandas as pd

from analysis.derived import order_key, pct, plain, records
from analysis.latex import Table, esc, fmt_pct
from analysis.tables import View, _group_header, make_view, task_header
from db.axes import MOE_OUTPUTS, OUTPUTS, RECOVERIES, method_axis

RECOVERY_LABEL = {r.name: r.label for r in RECOVERIES.values()}
SMALLER = MOE_OUTPUTS  # the outputs that keep a router
PARADIGM = {o: OUTPUTS[o].paradigm for o in SMALLER}  # moe: prune, merged: merge, edited: edit
METHOD_AXIS = {o: method_axis(o) for o in SMALLER}  # moe: scoring, merged: merging, edited: editing


def moe_rows(results: pd.DataFrame) -> pd.DataFrame:
    """The smaller MoEs among `results` rows."""
    return results[(results["kind"] == "moe2moe") & results["output"].isin(SMALLER)]


def method_of(r: dict[str, Any]) -> str:
    """The method that made a smaller MoE (its scoring, merging or editing)."""
    return r.get(METHOD_AXIS[r["output"]]) or ""


def moe_models(results: pd.DataFrame) -> list[str]:
    return sorted({m for m in moe_rows(results)["model"] if m is not None})


def match_moe_reference(ref: pd.DataFrame, model: str) -> str | None:
    """The reference sweep with the most smaller MoEs of `model` (ties: by name); None if none has any."""
    rows = moe_rows(ref[(ref["sweep_kind"] == "reference") & (ref["model"] == model)])
    if rows.empty:
        return None
    n = (
        rows.groupby("sweep")
        .size()
        .reset_index(name="n")
        .sort_values(["n", "sweep"], ascending=[False, True])
    )
    return str(n["sweep"].iloc[0])


def moe_view(label: str, results: pd.DataFrame, tasks: pd.DataFrame, model: str) -> View:
    """One model's smaller MoEs and its teacher, with their headline accuracies (%)."""
    rows = results[
        (results["model"] == model) & (results["output"].isin(SMALLER) | (results["kind"] == "teacher"))
    ]
    rows = rows[(rows["kind"] == "teacher") | (rows["kind"] == "moe2moe")]
    return make_view(label, rows, tasks)


def _key(r: dict[str, Any]) -> tuple[str, str, int, str, str]:
    """(output, method, K, recovery, rest): what a configuration key adds after those four (e.g. a DCDM
    mixture's `calibration=dcdm`) makes a row of its own."""
    rest = "|".join(str(r["config_key"]).split("|")[4:])
    return (r["output"], method_of(r), int(r["K"]), r.get("recovery") or "none", rest)


def _sort_key(key: tuple[str, str, int, str, str]) -> tuple:
    out, s, K, rec, variant = key
    return (
        SMALLER.index(out),
        order_key(METHOD_AXIS[out], s),
        -K,
        list(RECOVERY_LABEL).index(rec) if rec in RECOVERY_LABEL else len(RECOVERY_LABEL),
        rec,
        variant,
    )


def _cells(view: View, r: dict[str, Any] | None, tasks: list[str], shared: bool = False) -> list[str]:
    """The row's accuracies on `tasks`, its Avg, and with `shared` the mean over `tasks` alone."""
    if r is None:
        return [""] * (len(tasks) + 1 + shared)
    cid = plain(r["config_id"])
    acc = view.acc.loc[cid] if cid in view.acc.index else None
    vals = [plain(acc.get(t)) if acc is not None else None for t in tasks]
    out = [*(fmt_pct(v) for v in vals), fmt_pct(pct(r["avg"]))]
    if shared:
        out.append(fmt_pct(sum(vals) / len(vals)) if vals and None not in vals else "")
    return out


def _settings(r: dict[str, Any]) -> dict[str, Any]:
    try:
        out = json.loads(r.get("settings") or "{}")
    except ValueError:
        return {}
    return out if isinstance(out, dict) else {}


def _flags(settings: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(settings.items()))


def _sentence(text: str) -> str:
    return text if text.endswith(".") else text + "."


def implementation_notes(
    mine: dict[tuple, dict[str, Any]], theirs: dict[tuple, dict[str, Any]], order: list[tuple]
) -> tuple[str, list[str]]:
    """Per method of the paper's rows (in table order): the caption's sentences on whether ours is the
    implementation the paper ran (its rows' stored `settings`: `vs_ours` and `difference`) and the notes
    with the paper's settings, calibration and source. Settings our own rows were given (their `settings`
    JSON) are named beside the method."""
    imp: dict[str, dict[str, Any]] = {}
    cals: dict[str, list[str]] = {}
    for key in order:
        if key in theirs:
            s = imp.setdefault(key[1], _settings(theirs[key]))
            cal = _settings(theirs[key]).get("calibration") or s.get("calibration")
            if cal and cal not in cals.setdefault(key[1], []):
                cals[key[1]].append(cal)
    ours: dict[str, list[str]] = {}
    for key, r in mine.items():
        flags = _flags(_settings(r))
        if flags and flags not in ours.setdefault(key[1], []):
            ours[key[1]].append(flags)

    def named(m: str) -> str:
        return f"{m} (our runs set {'; '.join(ours[m])})" if ours.get(m) else m

    same = [named(m) for m, s in imp.items() if s.get("implementation") and s.get("vs_ours") == "same"]
    parts = [f"Same implementation as ours: {', '.join(same)}."] if same else []
    for m, s in imp.items():
        status, diff = s.get("vs_ours"), _sentence(s.get("difference") or "")
        if not s.get("implementation"):
            parts.append(
                f"{m}: the paper's implementation is not recorded (moesweep import-paper stores it)."
            )
        elif status == "none":
            parts.append(f"{m}: {s['implementation']}; {diff}")
        elif status != "same":
            what = "not our implementation" if status == "differs" else "perhaps not our implementation"
            parts.append(f"{named(m)}, {what}: the paper ran {s['implementation']}; {diff}")
    notes = [
        f"{m}, the paper's settings: {_flags(s['settings'])}." for m, s in imp.items() if s.get("settings")
    ]
    for label, per in (
        ("Calibration", {m: " | ".join(c) for m, c in cals.items() if c}),
        ("Source", {m: s["source"] for m, s in imp.items() if s.get("source")}),
    ):
        groups: dict[str, list[str]] = {}
        for m, text in per.items():
            groups.setdefault(text, []).append(m)
        for text, ms in groups.items():
            notes.append(
                f"{label} ({', '.join(ms)}): {_sentence(text)}"
                if len(groups) > 1
                else f"{label}: {_sentence(text)}"
            )
    return " ".join(parts), notes


def moe_table(view: View, ref: View | None, stem: str) -> Table | None:
    """Rows: the teacher, then method × K × recovery (ours and the paper's, matched on all three);
    columns: our headline tasks and Avg, then the paper's values on the tasks it shares with ours and
    its Avg."""
    mine = {_key(r): r for r in records(moe_rows(view.rows)) if r["K"] is not None}
    if not mine:
        return None
    theirs = (
        {_key(r): r for r in records(moe_rows(ref.rows)) if r["K"] is not None} if ref is not None else {}
    )
    common = [t for t in view.tasks if ref is not None and t in ref.tasks]
    # the paper's mean over the tasks it shares with ours, where its Avg covers other tasks too
    shared = bool(common) and ref is not None and set(common) != set(ref.tasks)
    cols = [*task_header(view.tasks), "Avg"]
    head: list[list[str] | str] = []
    if ref is not None:
        head += _group_header(
            4, [(f"Ours ({view.label})", len(cols)), (f"Paper ({ref.label})", len(common) + 1 + shared)]
        )
        cols += [*task_header(common), "Avg", *(["Shared"] if shared else [])]
    head.append(["Kind", "Method", "K", "Recovery", *cols])

    def teacher(v: View) -> dict[str, Any] | None:
        t = records(v.rows[v.rows["kind"] == "teacher"].sort_values("config_id"))
        return t[0] if t else None

    rows: list[list[str] | str] = []
    order = sorted(set(mine) | set(theirs), key=_sort_key)
    t_ours, t_ref = teacher(view), teacher(ref) if ref is not None else None
    if t_ours is not None or t_ref is not None:
        line = ["", "Teacher", "", "", *_cells(view, t_ours, view.tasks)]
        if ref is not None:
            line += _cells(ref, t_ref, common, shared)
        rows += [line, r"\midrule"]
    for key in order:
        out, s, K, rec, variant = key
        line = [
            PARADIGM[out],
            esc(f"{s} ({variant})" if variant else s),
            str(K),
            esc(RECOVERY_LABEL.get(rec, rec)),
            *_cells(view, mine.get(key), view.tasks),
        ]
        if ref is not None:
            line += _cells(ref, theirs.get(key), common, shared)
        rows.append(line)
    cap = (
        f"Smaller MoEs of {view.label}: per kind (prune, merge, edit) and compression method, K experts "
        "kept per layer (edit: the parameter budget of K experts) and recovery (none; Router KD: only the "
        "routers retrained; full KD: every parameter distilled), the headline tasks' accuracies in % and "
        "their mean (Avg). Blank: not run or not published."
    )
    if ref is not None:
        pub = ref.rows["avg_published"].notna().any() if "avg_published" in ref.rows.columns else False
        what = (
            "the average the paper prints"
            if pub
            else f"the mean of its {len(ref.tasks)} headline tasks ({', '.join(ref.tasks)})"
        )
        said, notes = implementation_notes(mine, theirs, order)
        cap += (
            f" Paper ({ref.label}): the published numbers under the same method name, K and recovery, on the "
            f"tasks it shares with ours; its Avg is {what}"
            + ("; Shared: its mean over the tasks shown." if shared else ".")
            + (f" {said}" if said else "")
            + (
                " The paper's settings and calibration per method are in the notes; our runs calibrate every "
                "method on this sweep's calibration data."
                if notes
                else ""
            )
        )
    else:
        notes = []
    return Table(
        stem,
        cap,
        "lllr" + "r" * (len(cols)),
        head,
        rows,
        index_caption=f"Smaller MoEs by method, K and recovery, {view.label}"
        + (f", beside {ref.label}" if ref is not None else ""),
        notes=notes,
    )
