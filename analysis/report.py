"""`moesweep report`: LaTeX tables, PNG/PDF figures, derived facts and an index for one sweep.

Everything comes from the frames loaded from the DB's views (analysis/load.py); the same DB gives
byte-identical LaTeX, JSON and Markdown (figures: see analysis/figures.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd

from analysis import dot_tables as dt
from analysis import figures as fg
from analysis import moe_tables as mt
from analysis import tables as tb
from analysis.derived import (
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


class _Writer:
    def __init__(self, out_dir: Path) -> None:
        self.out = out_dir
        self.items: list[tuple[Path, str]] = []

    def table(self, t: Table | None) -> None:
        if t is None:
            return
        path = self.out / "tables" / f"{t.stem}.tex"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(t.tex())
        self.items.append((path, t.index_caption or t.caption))

    def figure(self, fig, stem: str, caption: str) -> None:
        if fig is None:
            return
        with fg.style():
            paths = fg.save(fig, self.out / "figures" / stem)
        for p in paths:
            self.items.append((p, caption))


def write_report(frames: Frames, name: str, out_dir: Path, compare: Frames | None = None) -> list[Path]:
    """Write the report of sweep `name` into out_dir; returns the artefact paths (index.md last)."""
    out_dir = Path(out_dir)
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
    ours_facts = facts(res, tasks, frames.items).get(name, {})
    ref_facts = facts(cres, ctasks, compare.items) if cres is not None and len(cres) else {}
    models = moe_models(res)
    many = len(models) > 1
    w = _Writer(out_dir)
    matched: dict[str, dict[str, Any]] = {}
    fig7: list[dict[str, Any]] = []
    with fg.style():
        for model in models:
            rows = res[res["model"] == model]
            view = tb.make_view(model, rows, tasks)
            slug = tb.slug(model, many)
            f = ours_facts.get(model, {})
            ref = rf = None
            ref_label = ""
            if tables_compare:
                variant = next((v for v in rows["teacher_variant"] if v is not None), None)
                m = match_reference(cres, model, variant)
                if m is not None:
                    rs, rm = m
                    rrows = cres[(cres["sweep"] == rs) & (cres["model"] == rm)]
                    ref_label = f"{rm}, {rs}"
                    ref = tb.make_view(ref_label, rrows, ctasks[ctasks["sweep"] == rs])
                    rf = ref_facts.get(rs, {}).get(rm)
                    matched[model] = {"sweep": rs, "model": rm}
            for t in tb.ppl_grid_tables(view, ref, f"ppl_grid{slug}"):
                w.table(t)
            if "selection" in f:
                w.table(
                    tb.selection_table(
                        f["selection"], model, (rf or {}).get("selection"), ref_label, f"selection{slug}"
                    )
                )
            if tb.distilled_is_pairwise(view):
                w.table(tb.distilled_table(view, ref, f"distilled{slug}"))
            else:
                w.table(tb.cross_model_table(view, ref, f"distilled_by_k{slug}"))
            if f.get("ablations"):
                for t in tb.ablation_tables(
                    view, f["ablations"], ref, (rf or {}).get("ablations"), f"ablation{slug}"
                ):
                    w.table(t)
            w.table(tb.marginal_table(f, model, rf, ref_label, f"marginal{slug}"))
            fig7.append(_fig7_panel(f"{model} ({name})", rows))
        w.table(
            tb.baselines_table(
                tb.make_view(models[0] if len(models) == 1 else name, res, tasks),
                _sweep_ref(cres, ctasks, matched),
                "baselines",
            )
        )
        dense2moe = dt.dense2moe_rows(everything)
        if len(dense2moe):  # dense → MoE models (DOT-MoE), and the published ones as context
            w.table(dt.dot_table(dense2moe, frames.dense2moe, name, "dense2moe"))
            if compare is not None:
                ref = dt.dense2moe_rows(compare.results[compare.results["sweep_kind"] == "reference"])
                for rs in sorted(set(ref["sweep"])):
                    w.table(
                        dt.dot_paper_table(
                            ref[ref["sweep"] == rs],
                            compare.tasks[compare.tasks["sweep"] == rs],
                            rs,
                            f"dense2moe_{tb.slug(rs, True).strip('_')}",
                        )
                    )
        small = mt.moe_models(everything)
        for model in small:  # smaller MoEs (output = moe), beside a paper's of the same model
            ref = None
            rs = mt.match_moe_reference(compare.results, model) if tables_compare else None
            if rs is not None:
                rrows = compare.results[compare.results["sweep"] == rs]
                ref = mt.moe_view(f"{model}, {rs}", rrows, compare.tasks[compare.tasks["sweep"] == rs], model)
            view = mt.moe_view(model, everything, tasks, model)
            w.table(mt.moe_table(view, ref, f"moe{tb.slug(model, len(small) > 1)}"))
        for model in models:
            slug = tb.slug(model, many)
            f = ours_facts.get(model, {})
            rf = ref_facts.get(matched.get(model, {}).get("sweep", ""), {}).get(
                matched.get(model, {}).get("model", "")
            )
            w.figure(
                fg.marginal_figure(f, model, rf, _ref_label(matched.get(model))),
                f"marginal_accuracy{slug}",
                f"Mean post-distill accuracy per scoring and per grouping, {model} (Figure 4)",
            )
            K, mat = selection_overlap(frames.selections[frames.selections["sweep"] == name], model)
            if K is not None:
                w.figure(
                    fg.overlap_figure(K, mat, model),
                    f"selection_overlap{slug}",
                    f"Overlap of the top-K={K} experts kept by each scoring, mean over layers, {model} "
                    "(Figure 2)",
                )
            er = effective_rank(frames.diagnostics[frames.diagnostics["sweep"] == name], res, model)
            if len(er):
                w.figure(
                    fg.effective_rank_figure(er, model),
                    f"effective_rank{slug}",
                    f"Effective rank of the kept experts' kernel per scoring at K={int(er['K'].iloc[0])}, "
                    f"{model} (Figure 3)",
                )
            cur = frames.curves[(frames.curves["sweep"] == name) & (frames.curves["model"] == model)]
            w.figure(
                fg.curves_figure(cur, res, model),
                f"val_ce_curves{slug}",
                f"Validation cross-entropy during distillation, {model} (Figure 5)",
            )
        if cres is not None:  # the other models of the comparison, largest study first
            extra = []
            for rs, mm in ref_facts.items():
                for rm, rmf in mm.items():
                    if rm not in models and _ref_sweep_for(cres, rm) == rs:
                        extra.append((-rmf.get("n_distilled", 0), rs, rm))
            for _, rs, rm in sorted(extra):
                rrows = cres[(cres["sweep"] == rs) & (cres["model"] == rm)]
                fig7.append(_fig7_panel(f"{rm} ({rs})", rrows))
        w.figure(
            fg.by_scoring_k_figure(fig7),
            "accuracy_by_scoring_k",
            "Post-distill accuracy by scoring and K per model; green K = k, coral K > k, dashed: random FFN "
            "(Figure 7)",
        )
    fact_path = out_dir / "facts.json"
    cv = code_versions(frames.code[frames.code["sweep"] == name])
    doc = {
        "sweep": name,
        "code_versions": cv,
        "facts": ours_facts,
        "compare": {
            m: {**v, "facts": ref_facts.get(v["sweep"], {}).get(v["model"])} for m, v in matched.items()
        },
    }
    fact_path.write_text(json.dumps(doc, indent=1, sort_keys=True, default=str) + "\n")
    w.items.append(
        (fact_path, "Derived facts (selection picks, disagreements, marginal means, spreads, gaps) as JSON")
    )
    index = out_dir / "index.md"
    index.write_text(
        _index(name, everything, w.items, ours_facts, ref_facts, matched, out_dir, code_versions_line(cv))
    )
    return [p for p, _ in w.items] + [index]


def _ref_label(m: dict[str, str] | None) -> str:
    return f"{m['model']}, {m['sweep']}" if m else ""


def _ref_sweep_for(cres: pd.DataFrame, model: str) -> str | None:
    """The reference sweep with the most distilled students of `model`."""
    d = distilled_rows(cres[cres["model"] == model])
    if d.empty:
        return None
    n = d.groupby("sweep").size().reset_index(name="n").sort_values(["n", "sweep"], ascending=[False, True])
    return str(n["sweep"].iloc[0])


def _sweep_ref(cres: pd.DataFrame | None, ctasks: pd.DataFrame | None, matched: dict[str, dict[str, str]]):
    if cres is None or not matched:
        return None
    m = next(iter(matched.values()))
    return tb.make_view(
        _ref_label(m), cres[cres["sweep"] == m["sweep"]], ctasks[ctasks["sweep"] == m["sweep"]]
    )


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
        axes = _cell({a: st[a] for a in ("scoring", "grouping", "dp_scaling", "K")})
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


def _fig7_panel(label: str, rows):
    """One model's Figure 7 panel: best accuracy per scoring and K, the router's k, the random-FFN line."""
    return fg.panel(
        label,
        best_by_scoring_k(distilled_rows(rows)),
        top_k_of(rows[rows["kind"] == "moe2dense"]),
        baseline_avg(rows, "random_ffn"),
    )
