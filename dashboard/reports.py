"""A sweep's report as the dashboard shows it: `analysis.report.write_report` renders the same LaTeX tables
and PNG figures as `moesweep report` into a cache folder, and the tables are parsed back into HTML.

The cache is keyed by what the report depends on (the sweep's jobs, configurations and metrics), so a
report is rendered again only after the database changed.
"""

from __future__ import annotations

import atexit
import html
import json
import re
import shutil
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from markupsafe import Markup

from dashboard.data import rows
from db import axes
from db.store import Store

# the LaTeX the tables write (analysis/latex.py), back to plain characters
_UNTEX = [
    (r"\textbackslash{}", "\\"),
    (r"\textasciitilde{}", "~"),
    (r"\textasciicircum{}", "^"),
    (r"$\times$", "×"),
    (r"$\geq$", "≥"),
    (r"$'$", "′"),
    (r"$\to$", "→"),
    (r"$\Delta$", "Δ"),
    (r"$\neq$", "≠"),
    (r"$\dagger$", "†"),
    (r"$\pm$", "±"),
    (r"$\in$", "∈"),
    (r"$\cdot$", "·"),
    ("---", "—"),
    ("--", "–"),
    (r"\&", "&"),
    (r"\%", "%"),
    (r"\$", "$"),
    (r"\#", "#"),
    (r"\_", "_"),
    (r"\{", "{"),
    (r"\}", "}"),
]
_MULTI = re.compile(r"^\\multicolumn\{(\d+)\}\{[^}]*\}\{(.*)\}$")


@dataclass
class HtmlTable:
    stem: str
    caption: Markup  # HTML already (untex escapes): the template must not escape it again
    head: list[list[tuple[str, int]]]  # rows of (cell HTML, colspan)
    body: list[list[tuple[str, int]]]
    rules_before: set[int] = field(default_factory=set)  # body rows that start a new block (a \midrule)
    notes: list[Markup] = field(default_factory=list)


@dataclass
class Report:
    sweep: str
    folder: Path
    figures: list[tuple[str, str]]  # (file name under figures/, caption)
    tables: list[HtmlTable]
    compared: bool  # with the paper's numbers beside ours
    warning: str | None = None
    other_models: list[tuple[str, str]] = field(default_factory=list)  # (ours, the paper's) that differ


def untex(s: str) -> str:
    """A table cell's LaTeX as HTML: escapes and symbols back to characters, \\textbf as <b>."""
    for a, b in _UNTEX:
        s = s.replace(a, b)
    s = html.escape(s, quote=False)
    s = re.sub(r"\\textbf\{([^{}]*)\}", r"<b>\1</b>", s)
    s = re.sub(r"\\emph\{([^{}]*)\}", r"<i>\1</i>", s)
    s = re.sub(r"\\[a-zA-Z]+\s*", "", s)
    return s.replace("$", "").replace("{", "").replace("}", "").strip()


def _cells(line: str) -> list[tuple[str, int]]:
    line = line.strip()
    if line.endswith(r"\\"):
        line = line[:-2]
    out = []
    for cell in re.split(r"(?<!\\)&", line):
        cell = cell.strip()
        m = _MULTI.match(cell)
        out.append((untex(m.group(2)), int(m.group(1))) if m else (untex(cell), 1))
    return out


def parse_table(tex: str, stem: str) -> HtmlTable:
    """The rows of a table file `report` wrote (analysis/latex.Table.tex), its caption and notes."""
    lines = tex.splitlines()
    cap = next((ln[len(r"\caption{") : -1] for ln in lines if ln.startswith(r"\caption{")), stem)
    t = HtmlTable(stem, Markup(untex(cap)), [], [])
    part = None
    for ln in lines:
        s = ln.strip()
        if s == r"\toprule":
            part = "head"
        elif s == r"\bottomrule":
            part = None
        elif part == "head" and s == r"\midrule":
            part = "body"
        elif (
            part is not None
            and s.startswith("\\")
            and not s.startswith(r"\multicolumn")
            and not s.startswith(r"\textbf")
        ):
            if part == "body" and s.startswith(r"\midrule"):
                t.rules_before.add(len(t.body))
        elif part == "head":
            t.head.append(_cells(s))
        elif part == "body":
            t.body.append(_cells(s))
        elif s.startswith(r"{\footnotesize "):
            t.notes.append(Markup(untex(s[len(r"{\footnotesize ") : -1])))
    return t


def fingerprint(store: Store, name: str) -> str:
    """What a sweep's report depends on, in one string: it changes whenever a job of the sweep finishes,
    a configuration is added or selected, or the reference data is imported again."""
    (r,) = rows(
        store,
        "SELECT "
        "(SELECT COUNT(*) FROM sweep_jobs sj JOIN jobs j ON j.id = sj.job_id JOIN sweeps s "
        " ON s.id = sj.sweep_id WHERE s.name = :n AND j.status = 'succeeded') AS done, "
        "(SELECT MAX(j.finished_at) FROM sweep_jobs sj JOIN jobs j ON j.id = sj.job_id "
        " JOIN sweeps s ON s.id = sj.sweep_id WHERE s.name = :n) AS last, "
        "(SELECT COUNT(*) FROM configurations c JOIN sweeps s ON s.id = c.sweep_id "
        " WHERE s.name = :n) AS configs, "
        "(SELECT SUM(c.selected_for_distill) FROM configurations c JOIN sweeps s "
        " ON s.id = c.sweep_id WHERE s.name = :n) AS selected, "
        "(SELECT MAX(s.updated_at) FROM sweeps s) AS updated",
        {"n": name},
    )
    return json.dumps(r, default=str, sort_keys=True)


def reference_ready(store: Store) -> bool:
    """Whether the paper's reference sweeps are imported as this moesweep would import them (else the
    report is rendered without the comparison, as `moesweep report` without --compare)."""
    from analysis.reference import reference_sweeps

    want = {
        s["name"]: json.dumps(s["select"], sort_keys=True) if s.get("select") else None
        for s in reference_sweeps()
    }
    stored = {r["sweep"]: r["select_json"] for r in rows(store, "SELECT sweep, select_json FROM sweep_info")}
    return all(n in stored and stored[n] == rule for n, rule in want.items())


class ReportCache:
    """Rendered reports in a temporary folder, one per sweep and database state; one render at a time.

    The folder ($TMPDIR/moesweep-serve-*) is made at the first report and removed by `close()`, which the
    app calls when the server shuts down (Ctrl-C, SIGTERM) and, as a fallback, at interpreter exit."""

    def __init__(self, root: Path | None = None) -> None:
        self._given = Path(root) if root else None
        self._root = self._given
        self._lock = threading.Lock()
        self._done: dict[str, tuple[str, Report]] = {}

    @property
    def root(self) -> Path:
        if self._root is None:
            self._root = Path(tempfile.mkdtemp(prefix="moesweep-serve-"))
            atexit.register(self.close)
        return self._root

    def get(self, store: Store, name: str) -> Report:
        with self._lock:
            fp = fingerprint(store, name)
            hit = self._done.get(name)
            if hit and hit[0] == fp:
                return hit[1]
            rep = render(store, name, self.root / f"r{len(self._done)}-{abs(hash((name, fp)))}")
            if hit:
                shutil.rmtree(hit[1].folder, ignore_errors=True)
            self._done[name] = (fp, rep)
            return rep

    def close(self) -> None:
        """Remove the folder (waiting a little for a render in progress, never forever: at exit, a
        render may be stuck in a thread that will not finish)."""
        locked = self._lock.acquire(timeout=10)
        try:
            if self._root is not None:
                shutil.rmtree(self._root, ignore_errors=True)
            self._root = self._given
            self._done.clear()
        finally:
            if locked:
                self._lock.release()


def render(store: Store, name: str, out: Path) -> Report:
    """`moesweep report NAME [--compare paper]` into `out`, read back as figures and HTML tables."""
    from analysis.derived import code_versions, code_versions_line
    from analysis.load import load_frames
    from analysis.reference import reference_sweeps
    from analysis.report import write_report

    frames = load_frames(store.engine, [name])
    compare = None
    if reference_ready(store):
        compare = load_frames(store.engine, [s["name"] for s in reference_sweeps()])
    write_report(frames, name, out, compare)
    captions = _captions(out / "index.md")
    figures = [
        (p.name, captions.get(f"figures/{p.name}", p.stem)) for p in sorted((out / "figures").glob("*.png"))
    ]
    order = list(captions)
    tex = sorted(
        (out / "tables").glob("*.tex"),
        key=lambda p: order.index(f"tables/{p.name}") if f"tables/{p.name}" in order else len(order),
    )
    tables = [parse_table(p.read_text(), p.stem) for p in tex]
    line = code_versions_line(code_versions(frames.code[frames.code["sweep"] == name]))
    matched = json.loads((out / "facts.json").read_text()).get("compare") or {}
    other = sorted((ours, m["model"]) for ours, m in matched.items() if m.get("model") != ours)
    return Report(name, out, figures, tables, compare is not None, line or None, other)


def _captions(index: Path) -> dict[str, str]:
    """{relative path: caption} from the report's index.md, in its order."""
    out: dict[str, str] = {}
    for ln in index.read_text().splitlines():
        m = re.match(r"^- \[`([^`]+)`\]\([^)]*\) — (.*)$", ln)
        if m:
            out[m.group(1)] = m.group(2)
    return out


# ---- the side-by-side view against the paper ------------------------------------------------------
# a dense student's design axes (db/axes.py) with what says which configuration it is
MATCH_AXES = ("kind", "baseline", *axes.design_axes("dense"), "output", "variant")
INT_AXES = axes.int_axes()


def compare(store: Store, name: str) -> dict[str, Any]:
    """Our configurations beside the paper's of the same model (or the closest reference study, as the
    report matches them): pre-distill PPL and mean accuracy, and the differences."""
    from analysis.load import load_frames
    from analysis.reference import reference_sweeps
    from analysis.report import match_reference

    refs = [s["name"] for s in reference_sweeps()]
    stored = {r["sweep"] for r in rows(store, "SELECT sweep FROM sweep_info WHERE kind = 'reference'")}
    present = [n for n in refs if n in stored]
    if not present:
        return {
            "error": "no reference data in this database: `moesweep import-paper` loads the paper's numbers"
        }
    ours = load_frames(store.engine, [name]).results
    if ours.empty:
        return {"error": f"sweep {name!r} has no configurations yet"}
    if set(ours["sweep_kind"]) == {"reference"}:
        return {"error": f"{name} holds the published numbers themselves; open one of our sweeps to compare"}
    ref = load_frames(store.engine, present).results
    out = []
    for model in sorted({m for m in ours["model"] if m is not None}):
        mine = ours[ours["model"] == model]
        variant = next((v for v in mine["teacher_variant"] if v is not None), None)
        m = match_reference(ref, model, variant)
        if m is None:
            continue
        theirs = ref[(ref["sweep"] == m[0]) & (ref["model"] == m[1])]
        index = {_match_key(r): r for r in theirs.to_dict("records")}
        pairs = []
        for r in mine.to_dict("records"):
            p = index.get(_match_key(r))
            pairs.append({"ours": r, "paper": p})
        pairs.sort(key=lambda x: (x["paper"] is None, x["ours"]["config_id"]))
        out.append(
            {
                "model": model,
                "ref_sweep": m[0],
                "ref_model": m[1],
                "same_model": m[1] == model,  # else the closest study: no difference is a replication check
                "pairs": pairs,
                "matched": sum(p["paper"] is not None for p in pairs),
                "picks": _picks(mine, theirs),
            }
        )
    return {"models": out}


def _picks(mine, theirs) -> list[dict[str, Any]]:
    """Per scoring × grouping, the configuration the selection rule picked (and distilled), ours beside the
    paper's: comparable even where the grids differ in K (a smaller model, another expert count)."""
    out: dict[tuple, dict[str, Any]] = {}
    for side, frame in (("ours", mine), ("paper", theirs)):
        sel = frame[
            (frame["kind"] == "moe2dense") & (frame["selected_for_distill"] == 1) & frame["variant"].isna()
        ]
        for r in sel.to_dict("records"):
            out.setdefault((str(r["scoring"]), str(r["grouping"])), {})[side] = r
    return [
        {"scoring": k[0], "grouping": k[1], "ours": v.get("ours"), "paper": v.get("paper")}
        for k, v in sorted(out.items())
    ]


def _match_key(r: dict[str, Any]) -> tuple:
    def norm(a: str) -> Any:
        v = r.get(a)
        if a == "output" and v is None:
            return "dense"
        if v is None or v != v:  # NaN from pandas
            return None
        return int(v) if a in INT_AXES else v

    return tuple(norm(a) for a in MATCH_AXES)
