"""`moesweep report`: LaTeX tables, PNG/PDF figures, derived facts and an index for one sweep.

Everything comes from the frames loaded from the DB's views (analysis/load.py); the same DB gives
byte-identical LaTeX, JSON and Markdown (figures: see analysis/figures.py).

What the report writes is declared once, in ARTEFACTS: one entry per table or figure (its name, which
parts of the sweep it is written for, what it needs from their data, the function that renders it, its
file stem and index caption). write_report walks the registry in order, then writes facts.json and
index.md. A new table is one render function and one entry.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

import pandas as pd

from analysis import dot_tables as dt
from analysis import figures as fg
from analysis import moe_tables as mt
from analysis import tables as tb
from analysis.derived import (
    DESIGN_AXES,
    baseline_avg,
    best_by_scoring_k,
    code_versions,
    code_versions_line,
    distilled_rows,
    effective_rank,
    facts,
    moe_models,
    selection_overlap,
    top_k_of,
)
from analysis.latex import Table
from analysis.load import Frames
from analysis.uncertainty import NOT_ACROSS_SEEDS, NOT_DISTINGUISHABLE, phrase


def match_reference(ref: pd.DataFrame, model: str, variant: str | None) -> tuple[str, str] | None:
    """The (reference sweep, model) to show beside ours: the same model and teacher variant, else the
    same model, else the reference study with the largest conversion grid (the paper's main one)."""
    moe = ref[ref["kind"] == "moe2dense"]
    if moe.empty:
        return None
    for cond in ((moe["model"] == model) & (moe["teacher_variant"] == variant), moe["model"] == model):
        hit = moe[cond]
        if len(hit):
            n = hit.groupby(["sweep", "model"]).size().reset_index(name="n")
            n = n.sort_values(["n", "sweep"], ascending=[False, True])
            return str(n["sweep"].iloc[0]), str(n["model"].iloc[0])
    grid = moe[moe["K"].notna() & moe["ppl_pre"].notna()]
    n = (grid if len(grid) else moe).groupby(["sweep", "model"]).size().reset_index(name="n")
    n = n.sort_values(["n", "sweep", "model"], ascending=[False, True, True])
    return str(n["sweep"].iloc[0]), str(n["model"].iloc[0])


# ---- what a report reads: the sweep, and the parts its artefacts are written for --------------------
@dataclass
class SweepData:
    """The loaded frames narrowed to one sweep, and what every artefact shares (derived once)."""

    name: str
    frames: Frames
    compare: Frames | None  # the reference sweeps (--compare paper), or None
    everything: pd.DataFrame  # all the sweep's configurations
    res: pd.DataFrame  # its dense students: the core paper's tables and figures
    tasks: pd.DataFrame
    cres: pd.DataFrame | None  # the other sweeps of the comparison, dense students only
    ctasks: pd.DataFrame | None
    tables_compare: bool  # the tables show the paper's numbers beside ours
    facts: dict[str, Any]  # ours, per model
    ref_facts: dict[str, Any]  # the comparison's, per sweep and model
    models: list[str]  # the MoE models of the dense students
    matched: dict[str, dict[str, str]]  # model -> the reference {sweep, model} shown beside it


def load_sweep(frames: Frames, name: str, compare: Frames | None = None) -> SweepData:
    everything = frames.results[frames.results["sweep"] == name]
    if everything.empty:
        raise ValueError(
            f"sweep {name!r}: no configurations in the loaded frames; allowed: {', '.join(frames.sweeps)}"
        )
    # dense students go through the core paper's tables and figures; smaller MoEs have a table of their own
    res = everything[~everything["output"].isin(mt.SMALLER) & (everything["kind"] != "dense2moe")]
    tasks = frames.tasks[frames.tasks["sweep"] == name]
    cres = compare.results[compare.results["sweep"] != name] if compare is not None else None
    if cres is not None:  # the papers' smaller MoEs are compared in their own table, not as dense students
        cres = cres[~cres["output"].isin(mt.SMALLER) & (cres["kind"] != "dense2moe")]
    # a reference sweep is not compared with itself or its siblings in tables; Figure 7 still
    # gains the other models' panels
    tables_compare = cres is not None and "reference" not in set(res["sweep_kind"])
    ctasks = compare.tasks if compare is not None else None
    models = moe_models(res)
    matched: dict[str, dict[str, str]] = {}
    if tables_compare:
        for model in models:
            rows = res[res["model"] == model]
            variant = next((v for v in rows["teacher_variant"] if v is not None), None)
            m = match_reference(cres, model, variant)
            if m is not None:
                matched[model] = {"sweep": m[0], "model": m[1]}
    return SweepData(
        name=name,
        frames=frames,
        compare=compare,
        everything=everything,
        res=res,
        tasks=tasks,
        cres=cres,
        ctasks=ctasks,
        tables_compare=tables_compare,
        facts=facts(res, tasks, frames.items).get(name, {}),
        ref_facts=facts(cres, ctasks, compare.items) if cres is not None and len(cres) else {},
        models=models,
        matched=matched,
    )


@dataclass
class Part:
    """What one artefact is written for: the sweep itself, one of its models or one reference sweep (key);
    slug fills the {slug} of the artefact's file stem."""

    sweep: SweepData
    key: str
    slug: str = ""


@dataclass
class ModelPart(Part):
    """One MoE model of the sweep's dense students, beside the reference model it is matched with."""

    @cached_property
    def rows(self) -> pd.DataFrame:
        return self.sweep.res[self.sweep.res["model"] == self.key]

    @cached_property
    def view(self) -> tb.View:
        return tb.make_view(self.key, self.rows, self.sweep.tasks)

    @property
    def facts(self) -> dict[str, Any]:
        return self.sweep.facts.get(self.key, {})

    @property
    def match(self) -> dict[str, str] | None:
        return self.sweep.matched.get(self.key)

    @property
    def ref_label(self) -> str:
        m = self.match
        return f"{m['model']}, {m['sweep']}" if m else ""

    @cached_property
    def ref(self) -> tb.View | None:
        m, s = self.match, self.sweep
        if m is None:
            return None
        rrows = s.cres[(s.cres["sweep"] == m["sweep"]) & (s.cres["model"] == m["model"])]
        return tb.make_view(self.ref_label, rrows, s.ctasks[s.ctasks["sweep"] == m["sweep"]])

    @property
    def ref_facts(self) -> dict[str, Any] | None:
        m = self.match
        return self.sweep.ref_facts.get(m["sweep"], {}).get(m["model"]) if m else None

    @cached_property
    def overlap(self) -> tuple[int | None, pd.DataFrame]:
        sel = self.sweep.frames.selections
        return selection_overlap(sel[sel["sweep"] == self.sweep.name], self.key)

    @cached_property
    def effective_rank(self) -> pd.DataFrame:
        d = self.sweep.frames.diagnostics
        return effective_rank(d[d["sweep"] == self.sweep.name], self.sweep.res, self.key)


def _model_parts(s: SweepData) -> list[Part]:
    return [ModelPart(s, m, tb.slug(m, len(s.models) > 1)) for m in s.models]


def _smaller_moe_parts(s: SweepData) -> list[Part]:
    small = mt.moe_models(s.everything)
    return [Part(s, m, tb.slug(m, len(small) > 1)) for m in small]


def _dot_paper_parts(s: SweepData) -> list[Part]:
    if s.compare is None:
        return []
    ref = dt.dense2moe_rows(s.compare.results[s.compare.results["sweep_kind"] == "reference"])
    return [Part(s, rs, tb.slug(rs, True).strip("_")) for rs in sorted(set(ref["sweep"]))]


Scope = Literal["sweep", "model", "smaller_moe", "dot_paper"]
SCOPES: dict[str, Callable[[SweepData], list[Part]]] = {
    "sweep": lambda s: [Part(s, s.name)],  # once
    "model": _model_parts,  # per MoE model of the dense students (ModelPart)
    "smaller_moe": _smaller_moe_parts,  # per model of the smaller MoEs (output moe/merged/edited)
    "dot_paper": _dot_paper_parts,  # per reference sweep with dense -> MoE rows (with --compare)
}


# ---- what the report's artefacts need from the data --------------------------------------------------
def has_dense2moe(p: Part) -> bool:
    """The sweep has dense -> MoE (DOT-MoE) rows."""
    return len(dt.dense2moe_rows(p.sweep.everything)) > 0


def has_selection(p: ModelPart) -> bool:
    """The model's facts hold the selection rule's picks (a pre-distill PPL grid)."""
    return "selection" in p.facts


def has_ablations(p: ModelPart) -> bool:
    return bool(p.facts.get("ablations"))


def pairwise_distilled(p: ModelPart) -> bool:
    """The distilled students are one per scoring x grouping (Table 12), not a cross-model list."""
    return tb.distilled_is_pairwise(p.view)


def has_overlap(p: ModelPart) -> bool:
    """The plans' kept experts at one K for several scorings (Figure 2)."""
    return p.overlap[0] is not None


def has_effective_rank(p: ModelPart) -> bool:
    return len(p.effective_rank) > 0


def always(p: Part) -> bool:
    return True


# ---- the renderers: a Part and the file stem -> a Table, Tables, a Figure, or None (nothing to show) ----
def _ppl_grid(p: ModelPart, stem: str) -> list[Table]:
    return tb.ppl_grid_tables(p.view, p.ref, stem)


def _selection(p: ModelPart, stem: str) -> Table | None:
    ref = (p.ref_facts or {}).get("selection")
    return tb.selection_table(p.facts["selection"], p.key, ref, p.ref_label, stem)


def _distilled(p: ModelPart, stem: str) -> Table | None:
    return tb.distilled_table(p.view, p.ref, stem)


def _distilled_by_k(p: ModelPart, stem: str) -> Table | None:
    return tb.cross_model_table(p.view, p.ref, stem)


def _ablations(p: ModelPart, stem: str) -> list[Table]:
    ref = (p.ref_facts or {}).get("ablations")
    return tb.ablation_tables(p.view, p.facts["ablations"], p.ref, ref, stem)


def _marginal(p: ModelPart, stem: str) -> Table | None:
    return tb.marginal_table(p.facts, p.key, p.ref_facts, p.ref_label, stem)


def _baselines(p: Part, stem: str) -> Table | None:
    s = p.sweep
    ref = None
    if s.cres is not None and s.matched:
        m = next(iter(s.matched.values()))
        ref = tb.make_view(
            f"{m['model']}, {m['sweep']}",
            s.cres[s.cres["sweep"] == m["sweep"]],
            s.ctasks[s.ctasks["sweep"] == m["sweep"]],
        )
    label = s.models[0] if len(s.models) == 1 else s.name
    return tb.baselines_table(tb.make_view(label, s.res, s.tasks), ref, stem)


def _dense2moe(p: Part, stem: str) -> Table | None:
    s = p.sweep
    return dt.dot_table(dt.dense2moe_rows(s.everything), s.frames.dense2moe, s.name, stem)


def _dense2moe_paper(p: Part, stem: str) -> Table | None:
    c = p.sweep.compare
    ref = dt.dense2moe_rows(c.results[c.results["sweep_kind"] == "reference"])
    return dt.dot_paper_table(ref[ref["sweep"] == p.key], c.tasks[c.tasks["sweep"] == p.key], p.key, stem)


def _moe(p: Part, stem: str) -> Table | None:
    """Smaller MoEs (output = moe), beside a paper's of the same model."""
    s, model = p.sweep, p.key
    ref = None
    rs = mt.match_moe_reference(s.compare.results, model) if s.tables_compare else None
    if rs is not None:
        rrows = s.compare.results[s.compare.results["sweep"] == rs]
        ref = mt.moe_view(f"{model}, {rs}", rrows, s.compare.tasks[s.compare.tasks["sweep"] == rs], model)
    return mt.moe_table(mt.moe_view(model, s.everything, s.tasks, model), ref, stem)


def _marginal_figure(p: ModelPart, stem: str):
    return fg.marginal_figure(p.facts, p.key, p.ref_facts, p.ref_label)


def _overlap_figure(p: ModelPart, stem: str):
    K, mat = p.overlap
    return fg.overlap_figure(K, mat, p.key)


def _effective_rank_figure(p: ModelPart, stem: str):
    return fg.effective_rank_figure(p.effective_rank, p.key)


def _curves_figure(p: ModelPart, stem: str):
    s = p.sweep
    cur = s.frames.curves[(s.frames.curves["sweep"] == s.name) & (s.frames.curves["model"] == p.key)]
    return fg.curves_figure(cur, s.res, p.key)


def _by_scoring_k_figure(p: Part, stem: str):
    """Figure 7: the sweep's models, then the comparison's other models, largest study first."""
    s = p.sweep
    panels = [_fig7_panel(f"{m} ({s.name})", s.res[s.res["model"] == m]) for m in s.models]
    if s.cres is not None:
        extra = []
        for rs, mm in s.ref_facts.items():
            for rm, rmf in mm.items():
                if rm not in s.models and _ref_sweep_for(s.cres, rm) == rs:
                    extra.append((-rmf.get("n_distilled", 0), rs, rm))
        for _, rs, rm in sorted(extra):
            panels.append(
                _fig7_panel(f"{rm} ({rs})", s.cres[(s.cres["sweep"] == rs) & (s.cres["model"] == rm)])
            )
    return fg.by_scoring_k_figure(panels)


def _ref_sweep_for(cres: pd.DataFrame, model: str) -> str | None:
    """The reference sweep with the most distilled students of `model`."""
    d = distilled_rows(cres[cres["model"] == model])
    if d.empty:
        return None
    n = d.groupby("sweep").size().reset_index(name="n").sort_values(["n", "sweep"], ascending=[False, True])
    return str(n["sweep"].iloc[0])


def _fig7_panel(label: str, rows):
    """One model's Figure 7 panel: best accuracy per scoring and K, the router's k, the random-FFN line."""
    return fg.panel(
        label,
        best_by_scoring_k(distilled_rows(rows)),
        top_k_of(rows[rows["kind"] == "moe2dense"]),
        baseline_avg(rows, "random_ffn"),
    )


# ---- the registry ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Artefact:
    """One table or figure of the report.

    scope: what it is written for, one per part (SCOPES: the sweep, each model of its dense students, each
    model of its smaller MoEs, each reference DOT-MoE sweep); needs: whether a part's data calls for it;
    render(part, stem): the Table(s) or Figure, or None when there is nothing to show; stem: the file
    name, {slug} filled per part (a table: tables/<stem>.tex, a split table tables/<stem>_1.tex, ...; a
    figure: figures/<stem>.png and .pdf); caption: the index entry (a figure's; None for a table: its own
    index caption), a string or a function of the part."""

    name: str
    scope: Scope
    kind: Literal["table", "figure"]
    stem: str
    render: Callable[[Any, str], Any]
    needs: Callable[[Any], bool] = always
    caption: str | Callable[[Any], str] | None = None

    def __post_init__(self) -> None:
        if self.scope not in SCOPES or self.kind not in ("table", "figure"):
            raise ValueError(
                f"artefact {self.name!r}: scope {self.scope!r} / kind {self.kind!r}; allowed: scopes "
                f"{', '.join(SCOPES)}, kinds table, figure"
            )

    def index_caption(self, p: Part) -> str | None:
        return self.caption(p) if callable(self.caption) else self.caption


# Written in this order; consecutive entries of one scope go part by part (all of one model's tables
# before the next model's), which is the order of the index.
ARTEFACTS: list[Artefact] = [
    Artefact("ppl_grid", "model", "table", "ppl_grid{slug}", _ppl_grid),
    Artefact("selection", "model", "table", "selection{slug}", _selection, needs=has_selection),
    Artefact("distilled", "model", "table", "distilled{slug}", _distilled, needs=pairwise_distilled),
    Artefact(
        "distilled_by_k",
        "model",
        "table",
        "distilled_by_k{slug}",
        _distilled_by_k,
        needs=lambda p: not pairwise_distilled(p),
    ),
    Artefact("ablation", "model", "table", "ablation{slug}", _ablations, needs=has_ablations),
    Artefact("marginal", "model", "table", "marginal{slug}", _marginal),
    Artefact("baselines", "sweep", "table", "baselines", _baselines),
    Artefact("dense2moe", "sweep", "table", "dense2moe", _dense2moe, needs=has_dense2moe),
    Artefact(
        "dense2moe_paper", "dot_paper", "table", "dense2moe_{slug}", _dense2moe_paper, needs=has_dense2moe
    ),
    Artefact("moe", "smaller_moe", "table", "moe{slug}", _moe),
    Artefact(
        "marginal_accuracy",
        "model",
        "figure",
        "marginal_accuracy{slug}",
        _marginal_figure,
        caption=lambda p: f"Mean post-distill accuracy per scoring and per grouping, {p.key} (Figure 4)",
    ),
    Artefact(
        "selection_overlap",
        "model",
        "figure",
        "selection_overlap{slug}",
        _overlap_figure,
        needs=has_overlap,
        caption=lambda p: (
            f"Overlap of the top-K={p.overlap[0]} experts kept by each scoring, mean over layers, "
            f"{p.key} (Figure 2)"
        ),
    ),
    Artefact(
        "effective_rank",
        "model",
        "figure",
        "effective_rank{slug}",
        _effective_rank_figure,
        needs=has_effective_rank,
        caption=lambda p: (
            "Effective rank of the kept experts' kernel per scoring at "
            f"K={int(p.effective_rank['K'].iloc[0])}, {p.key} (Figure 3)"
        ),
    ),
    Artefact(
        "val_ce_curves",
        "model",
        "figure",
        "val_ce_curves{slug}",
        _curves_figure,
        caption=lambda p: f"Validation cross-entropy during distillation, {p.key} (Figure 5)",
    ),
    Artefact(
        "accuracy_by_scoring_k",
        "sweep",
        "figure",
        "accuracy_by_scoring_k",
        _by_scoring_k_figure,
        caption="Post-distill accuracy by scoring and K per model; green K = k, coral K > k, dashed: random "
        "FFN (Figure 7)",
    ),
]


def planned(s: SweepData, registry: list[Artefact] | None = None) -> Iterator[tuple[Artefact, Part]]:
    """The (artefact, part) pairs the registry (ARTEFACTS unless given) calls for on this sweep, in the
    report's order."""
    parts: dict[str, list[Part]] = {}
    for scope, group in itertools.groupby(ARTEFACTS if registry is None else registry, lambda a: a.scope):
        entries = list(group)
        for p in parts.setdefault(scope, SCOPES[scope](s)):
            for a in entries:
                if a.needs(p):
                    yield a, p


def _write(a: Artefact, p: Part, out_dir: Path) -> list[tuple[Path, str]]:
    """Render one artefact for one part; its files and their index captions (none: nothing to show)."""
    stem = a.stem.format(slug=p.slug)
    made = a.render(p, stem)
    if a.kind == "figure":
        if made is None:
            return []
        with fg.style():
            paths = fg.save(made, out_dir / "figures" / stem)
        return [(q, a.index_caption(p)) for q in paths]
    items = []
    for t in made if isinstance(made, list) else [made]:
        if t is None:
            continue
        path = out_dir / "tables" / f"{t.stem}.tex"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(t.tex())
        items.append((path, a.index_caption(p) or t.index_caption or t.caption))
    return items


def write_report(frames: Frames, name: str, out_dir: Path, compare: Frames | None = None) -> list[Path]:
    """Write the report of sweep `name` into out_dir; returns the artefact paths (index.md last)."""
    out_dir = Path(out_dir)
    s = load_sweep(frames, name, compare)
    out_dir.mkdir(parents=True, exist_ok=True)
    items: list[tuple[Path, str]] = []
    with fg.style():
        for a, p in planned(s):
            items += _write(a, p, out_dir)
    fact_path = out_dir / "facts.json"
    cv = code_versions(frames.code[frames.code["sweep"] == name])
    doc = {
        "sweep": name,
        "code_versions": cv,
        "facts": s.facts,
        "compare": {
            m: {**v, "facts": s.ref_facts.get(v["sweep"], {}).get(v["model"])} for m, v in s.matched.items()
        },
    }
    fact_path.write_text(json.dumps(doc, indent=1, sort_keys=True, default=str) + "\n")
    items.append(
        (fact_path, "Derived facts (selection picks, disagreements, marginal means, spreads, gaps) as JSON")
    )
    index = out_dir / "index.md"
    index.write_text(
        _index(name, s.everything, items, s.facts, s.ref_facts, s.matched, out_dir, code_versions_line(cv))
    )
    return [p for p, _ in items] + [index]


# ---- the index -----------------------------------------------------------------------------------
def _cell(d: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in d.items() if k not in ("config_id",) and v is not None)


def _fact_lines(f: dict[str, Any], who: str) -> list[str]:
    out = []
    sel = f.get("selection")
    if sel:
        per, over = " × ".join(sel["rule"]["per"]), " × ".join(sel["rule"]["over"])
        counts = ", ".join(f"K={k}: {n}" for k, n in sel["k_counts"].items())
        by = sel["rule"]["by"].split(" ")[0]
        metric = "pre-distill PPL" if by == "ppl_pre" else by
        default = sel["rule"].get("source") == "default"
        stated = " (the sweep stores no rule: the paper's default)" if default else ""
        out.append(
            f"- Selection rule ({who}){stated}: per {per}, the lowest finite {metric} over {over}; "
            f"{len(sel['picks'])} picks — {counts}."
        )
        if sel["compared_with_distilled"]:
            out.append(
                f"- Disagreements between the rule and the distilled configurations: "
                f"{len(sel['disagreements'])}."
            )
            for d in sel["disagreements"]:
                key = ", ".join(f"{a}={d[a]}" for a in sel["rule"]["per"])
                dist = "; ".join(_cell(x) for x in d["distilled"] or []) or "none distilled"
                out.append(f"  - {key}: rule picks ({_cell(d['rule'] or {})}), distilled ({dist}).")
        for m in sel["published_ppl_mismatches"]:
            out.append(
                f"- Published pre-distill PPL {m['ppl_pre_published']:g} for {m['scoring']}×{m['grouping']} "
                f"(K={m['K']}, {m['dp_scaling']}) is not the grid's {m['ppl_pre_grid']}."
            )
        if sel["nonfinite_cells"]:
            cells = "; ".join(
                f"{c['scoring']}×{c['grouping']} {c['dp_scaling']} K={c['K']}" for c in sel["nonfinite_cells"]
            )
            out.append(f"- Non-finite grid cells ({len(sel['nonfinite_cells'])}, shown as –): {cells}.")
        if sel["missing_cells"]:
            out.append(f"- Grid cells without a perplexity: {len(sel['missing_cells'])}.")
        for m in sel.get("margins", []):
            if m["interval"] is not None:
                key = ", ".join(f"{a}={m[a]}" for a in sel["rule"]["per"])
                out.append(
                    f"  - Rule's pick vs runner-up ({key}): ({_cell(m['pick'])}) vs ({_cell(m['runner_up'])}), "
                    f"runner-up PPL higher by {m['ppl_diff']:g}{phrase(m['interval'], '')}."
                )
        for d in sel["k_equals_topk_grouping_differences"]:
            vals = ", ".join(f"{g}: {v:g}" for g, v in d["ppl_pre"].items() if v is not None)
            out.append(
                f"- At K = k = {d['K']} the grouping cannot change the student, yet {d['scoring']} "
                f"({d['dp_scaling']}) differs across groupings: {vals}."
            )
    for axis, sp in (f.get("spread") or {}).items():
        means = ", ".join(
            f"{k} {v['mean']:.2f}{_pm(v.get('se'))}" for k, v in f["marginal_means"][axis].items()
        )
        out.append(
            f"- Mean accuracy per {axis} ({who}): {means}; best {sp['best']}, worst {sp['worst']}, "
            f"spread {sp['pp']:.2f} pp{phrase(sp.get('interval'))}."
        )
    for st in f.get("stated", []):
        if st["interval"] is not None:
            out.append(
                f"- Stated difference {st['a']} − {st['b']} ({st['axis']} means, {who}): "
                f"{st['pp']:+.2f} pp{phrase(st['interval'])}."
            )
    if "best" in f:
        b = f["best"]
        out.append(
            f"- Best distilled student ({who}): {_cell({k: v for k, v in b.items() if k != 'avg'})} at "
            f"{b['avg']:.2f}%; students at K = k before the first K > k in the accuracy ranking: "
            f"{f.get('top_n_at_k_equals_topk')}."
        )
    out += _seed_lines(f.get("seeds"), who)
    if "scoring_gap_at_k_equals_topk" in f:
        g = f["scoring_gap_at_k_equals_topk"]
        out.append(
            f"- Scoring gap at K = k: {g['pp']:.2f} pp ({g['best']} vs {g['worst']}){phrase(g.get('interval'))}."
        )
    iv = f.get("intervals", {})
    for b in ("random_init", "random_ffn"):
        if f"gain_over_{b}" in f:
            out.append(
                f"- Best student minus {b}: {f[f'gain_over_{b}']:+.2f} pp{phrase(iv.get(f'gain_over_{b}'))}."
            )
    if f.get("merge_minus_prune"):
        mpi = iv.get("merge_minus_prune", {})
        mp = ", ".join(f"{s} {v:+.2f}{_mark(mpi.get(s))}" for s, v in f["merge_minus_prune"].items())
        out.append(f"- Merging (smallest K > k) minus pure pruning (K = k), per scoring: {mp} pp.")
    for a in f.get("ablations", []):
        for name in ("routing", "loss"):
            if a.get(name):
                items = ", ".join(
                    f"{it['value']}: {it['avg']:.2f} ({it['delta']:+.2f}{_mark(it.get('interval'))})"
                    for it in a[name]
                    if it["delta"] is not None
                )
                out.append(
                    f"- {name.capitalize()} ablation ({a['scoring']}×{a['grouping']}, K={a['K']}): {items}."
                )
    return out


def _seed_lines(sd: dict[str, Any] | None, who: str) -> list[str]:
    """Per repeated student: its numbers under each seed, their mean and between-seed sd."""
    if not sd:
        return []
    out = [
        f"- Seed repeats ({who}): each selected student under every seed (first: the main configuration), "
        f"mean ± between-seed sd; a stated difference is {sd['rule']}."
    ]
    for st in sd["students"]:
        parts = []
        for col, name, fmt in (
            ("avg", "accuracy", ".2f"),
            ("ppl_pre", "pre-distill PPL", ".1f"),
            ("ppl_post", "post-distill PPL", ".1f"),
        ):
            p = st.get(col)
            if p:
                vals = ", ".join(f"{v:{fmt}}" for v in p["values"])
                se = f", item SE {p['item_se']:.2f}" if p.get("item_se") is not None else ""
                parts.append(f"{name} {vals} → {p['mean']:{fmt}}{_pm(p['sd'])}{se}")
        axes = _cell({a: st[a] for a in DESIGN_AXES})
        out.append(f"  - {axes}: " + "; ".join(parts) + ".")
    return out


def _pm(se: float | None) -> str:
    return f" ± {se:.2f}" if se is not None else ""


def _mark(d: dict[str, Any] | None) -> str:
    """A short note for a difference inside a list: its interval, and † when it is indistinguishable."""
    if not d:
        return ""
    return f" [{d['ci'][0]:+.2f}, {d['ci'][1]:+.2f}]" + ("" if d["distinguishable"] else " †")


def _index(
    name: str,
    res: pd.DataFrame,
    items: list[tuple[Path, str]],
    f: dict[str, Any],
    rf: dict[str, Any],
    matched: dict[str, dict[str, str]],
    out_dir: Path,
    code_line: str | None = None,
) -> str:
    kinds = sorted({k for k in res["sweep_kind"] if k is not None})
    sources = sorted({s for s in res["source"] if s is not None})
    lines = [f"# Report: {name}", ""]
    if code_line:
        lines += [f"**Warning:** {code_line}", ""]
    lines += [
        f"Sweep `{name}` ({', '.join(kinds)}; source: {', '.join(sources)}), {len(res)} configurations. "
        "Generated by `moesweep report` from the results database only.",
        "",
    ]
    if matched:
        lines += [
            "Compared with: " + "; ".join(f"{m} ↔ {v['model']} ({v['sweep']})" for m, v in matched.items()),
            "",
        ]
    lines += ["## Artefacts", ""]
    for path, cap in items:
        lines.append(
            f"- [`{path.relative_to(out_dir).as_posix()}`]({path.relative_to(out_dir).as_posix()}) — {cap}"
        )
    lines += [
        "",
        "## Derived facts",
        "",
        "Each stated difference carries its 95% interval: a paired bootstrap over the items (or perplexity "
        "windows) all compared students were scored on, or, for a paper's numbers, the binomial standard "
        "error from the benchmarks' published sizes (unpaired, conservative). A difference whose interval "
        f"contains zero is {NOT_DISTINGUISHABLE} (marked † in lists); ± is one standard error. Where the "
        "students were repeated with other seeds, a difference must also survive the seeds: its between-seed "
        f"95% interval must exclude zero too (else: {NOT_ACROSS_SEEDS}).",
        "",
    ]
    for model, mf in f.items():
        lines += [f"### {model}", "", *_fact_lines(mf, "ours" if not matched else "this sweep"), ""]
        m = matched.get(model)
        if m and rf.get(m["sweep"], {}).get(m["model"]):
            lines += [
                f"#### Paper: {m['model']} ({m['sweep']})",
                "",
                *_fact_lines(rf[m["sweep"]][m["model"]], "paper"),
                "",
            ]
    return "\n".join(lines).rstrip() + "\n"
