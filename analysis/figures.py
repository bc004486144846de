"""The paper's figures from the views' frames (Figures 2, 3, 4, 5, 7), PNG and PDF, fixed style.

Figures are drawn on `matplotlib.figure.Figure` with the Agg canvas (no pyplot, no display) under
fixed rcParams, and saved without timestamps so the same DB gives the same files.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from analysis.derived import ordered, plain, records
from analysis.palette import PALETTE, scoring_color
from analysis.uncertainty import seed_label

STYLE: dict[str, Any] = {
    "font.family": "DejaVu Sans",
    "font.size": 9,
    "axes.titlesize": 9.5,
    "axes.labelsize": 9,
    "xtick.labelsize": 8,
    "ytick.labelsize": 8,
    "legend.fontsize": 7.5,
    "legend.frameon": False,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "axes.grid.axis": "y",
    "grid.alpha": 0.3,
    "grid.linewidth": 0.6,
    "axes.axisbelow": True,
    "lines.linewidth": 1.4,
    "savefig.dpi": 150,
    "savefig.bbox": "tight",
    "savefig.pad_inches": 0.05,
    "pdf.fonttype": 3,
    "pdf.compression": 6,
    "svg.hashsalt": "moesweep",
    "image.cmap": "viridis",
    "path.simplify": True,
}
PRUNE, MERGE = "#3a9d5d", "#f08a6c"  # Figure 7: green K = k (pure pruning), coral K > k (merging)


@contextmanager
def style() -> Iterator[None]:
    """Matplotlib's defaults plus STYLE, whatever the user's matplotlibrc says."""
    with matplotlib.rc_context():
        matplotlib.rcdefaults()
        matplotlib.rcParams.update(STYLE)
        yield


def new_figure(w: float, h: float) -> Figure:
    fig = Figure(figsize=(w, h), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def save(fig: Figure, stem: Path) -> list[Path]:
    """stem.png and stem.pdf, without creation dates or software stamps."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    png, pdf = stem.with_suffix(".png"), stem.with_suffix(".pdf")
    fig.savefig(png, format="png", metadata={"Software": None})
    fig.savefig(
        pdf, format="pdf", metadata={"CreationDate": None, "ModDate": None, "Producer": None, "Creator": None}
    )
    return [png, pdf]


def _bar_labels(ax, bars, values, fmt: str = "{:.2f}", size: float = 6.5) -> None:
    for b, v in zip(bars, values, strict=True):
        if v is not None and np.isfinite(v):
            ax.annotate(
                fmt.format(v),
                (b.get_x() + b.get_width() / 2, b.get_height()),
                xytext=(0, 2),
                textcoords="offset points",
                ha="center",
                va="bottom",
                fontsize=size,
            )


def _ylim(ax, values: list[float], errs: list[float] | None = None) -> None:
    """A bar chart's y range: from 0 (a bar's length is its value; a cut axis would exaggerate the
    differences) to above the highest bar or error bar, with room for the value labels."""
    errs = errs or [0.0] * len(values)
    tops = [x + (e or 0.0) for x, e in zip(values, errs, strict=False) if x is not None and np.isfinite(x)]
    if not tops:
        return
    ax.set_ylim(min(0.0, *tops), max(tops) * 1.12 + 0.5)


# marginal panels of another axis than scoring: one colour, a hatch per value, so no two bars look alike
HATCHES = ("", "...", "xxx", "ooo", "+++", "---", "oo..", "xx--")  # never "///": the paper's bars
# Figure 5: lines of one scoring share its colour; the grouping gives each its own line style
GROUPING_STYLE = {
    "RR": "-",
    "WC": "--",
    "RC": "-.",
    "OC": ":",
    "AB": (0, (5, 1.5, 1, 1.5)),
    "OT": (0, (1, 1)),
}


def grouping_style(g: str | None) -> Any:
    if g in GROUPING_STYLE:
        return GROUPING_STYLE[g]
    extra = [(0, (3, 1, 1, 1, 1, 1)), (0, (6, 2)), (0, (2, 2, 6, 2))]
    return extra[sum(map(ord, g or "")) % len(extra)]


# ---- Figure 4: marginal effect of each design axis ----------------------------------------------
def marginal_figure(
    f: dict[str, Any], label: str, ref_f: dict[str, Any] | None, ref_label: str
) -> Figure | None:
    """Mean post-distill accuracy per scoring (a) and per grouping (b); the paper's beside ours."""
    mm = f.get("marginal_means") or {}
    axes = [a for a in ("scoring", "grouping") if a in mm] or [a for a in ("dp_scaling", "K") if a in mm][:1]
    if not axes:
        return None
    widths = [max(len(mm[a]), 3) for a in axes]
    fig = new_figure(2.0 + 0.62 * sum(widths) * (1.5 if ref_f else 1.0), 3.2)
    grid = fig.add_gridspec(1, len(axes), width_ratios=widths)
    rmm = (ref_f or {}).get("marginal_means") or {}
    for i, axis in enumerate(axes):
        ax = fig.add_subplot(grid[0, i])
        names = list(mm[axis])
        ours = [mm[axis][n]["mean"] for n in names]
        err = _err95([mm[axis][n].get("se") for n in names])
        x = np.arange(len(names))
        colors = [scoring_color(n) if axis == "scoring" else PALETTE[0] for n in names]
        hatches = ["" if axis == "scoring" else HATCHES[j % len(HATCHES)] for j in range(len(names))]
        allv, allerr = list(ours), list(err)
        if ref_f:
            theirs = [rmm.get(axis, {}).get(n, {}).get("mean") for n in names]
            w = 0.4
            b1 = ax.bar(x - w / 2, ours, w, color=colors, label=f"ours ({label})", yerr=err, **ERR_KW)
            for b, h in zip(b1, hatches, strict=True):
                b.set_hatch(h)
                b.set_edgecolor("white")
            terr = _err95([rmm.get(axis, {}).get(n, {}).get("se") for n in names])
            b2 = ax.bar(
                x + w / 2,
                [t if t is not None else 0.0 for t in theirs],
                w,
                yerr=terr,
                **ERR_KW,
                color=colors,
                alpha=0.45,
                hatch="///",
                edgecolor="white",
                label=f"paper ({ref_label})",
            )
            _bar_labels(ax, b1, ours, size=5.5)
            _bar_labels(ax, b2, theirs, size=5.5)
            allv += [t for t in theirs if t is not None]
            allerr += [e for t, e in zip(theirs, terr, strict=True) if t is not None]
            if i == 0:
                ax.legend(loc="upper left")
        else:
            bars = ax.bar(x, ours, 0.65, color=colors, yerr=err, **ERR_KW)
            for b, h in zip(bars, hatches, strict=True):
                b.set_hatch(h)
                b.set_edgecolor("white")
            _bar_labels(ax, bars, ours)
        ax.set_xticks(x, [str(n) for n in names], rotation=30 if axis == "scoring" else 0)
        _ylim(ax, allv, allerr)
        sp = (f.get("spread") or {}).get(axis)
        title = f"({chr(97 + i)}) {axis.replace('dp_scaling', 'DP scaling')}"
        if sp:
            title += f": {sp['best']} best, spread {sp['pp']:.2f} pp"
            if sp.get("interval") and not sp["interval"]["distinguishable"]:
                title += "\n(not distinguishable at this n)"
        ax.set_title(title)
        if i == 0:
            ax.set_ylabel("mean post-distill accuracy (%)")
    fig.suptitle(
        f"Marginal effect of each design axis, {label} ({f.get('n_distilled')} distilled students); "
        "bars: 95% intervals",
        fontsize=9.5,
    )
    return fig


ERR_KW = {"error_kw": {"elinewidth": 0.8, "capsize": 2.0, "ecolor": "0.25"}}


def _err95(se: list[float | None]) -> list[float]:
    """Half-widths of 95% intervals (1.96 standard errors; 0 where there is none)."""
    return [1.959964 * v if v is not None else 0.0 for v in se]


# ---- Figure 2: selection overlap ----------------------------------------------------------------------
def overlap_figure(K: int, matrix: pd.DataFrame, label: str) -> Figure:
    n = len(matrix)
    fig = new_figure(1.6 + 0.55 * n, 1.2 + 0.5 * n)
    ax = fig.add_subplot(1, 1, 1)
    ax.grid(False)
    im = ax.imshow(matrix.to_numpy(dtype=float), vmin=0.0, vmax=1.0, cmap="Blues")
    names = list(matrix.index)
    ax.set_xticks(range(n), names, rotation=35, ha="right")
    ax.set_yticks(range(n), names)
    for i in range(n):
        for j in range(n):
            v = float(matrix.iat[i, j])
            if np.isfinite(v):
                ax.text(
                    j,
                    i,
                    f"{v:.2f}",
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white" if v > 0.6 else "black",
                )
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04, label="overlap |A∩B| / K")
    ax.set_title(f"Selection overlap of the top-K={K} experts\n(mean over layers), {label}")
    return fig


# ---- Figure 3: effective rank --------------------------------------------------------------------------
def effective_rank_figure(df: pd.DataFrame, label: str) -> Figure:
    K = int(df["K"].iloc[0])
    names = list(df["scoring"])
    fig = new_figure(max(3.6, 1.5 + 0.55 * len(names)), 3.2)
    ax = fig.add_subplot(1, 1, 1)
    x = np.arange(len(names))
    bars = ax.bar(
        x,
        df["mean"],
        0.65,
        yerr=df["std"],
        capsize=2,
        color=[scoring_color(s) for s in names],
        error_kw={"elinewidth": 0.8},
    )
    for b, m, sd in zip(bars, df["mean"], df["std"], strict=True):
        ax.annotate(
            f"{m:.2f}",
            (b.get_x() + b.get_width() / 2, m + sd),
            xytext=(0, 2),
            textcoords="offset points",
            ha="center",
            va="bottom",
            fontsize=6.5,
        )
    ax.axhline(K, color="black", linestyle="--", linewidth=0.8, label=f"maximum (K={K})")
    ax.set_xticks(x, names, rotation=30)
    ax.set_ylim(0, K * 1.15)
    ax.set_ylabel("effective rank of the kept kernel")
    ax.legend(loc="lower right")
    ax.set_title(f"Effective rank of the K={K} selected experts\n(mean ± std over layers), {label}")
    return fig


# ---- Figure 5: validation CE during distillation ---------------------------------------------------------
def curves_figure(
    curves: pd.DataFrame, results: pd.DataFrame, label: str, max_lines: int = 8
) -> Figure | None:
    """Student validation CE per distilled configuration (one per scoring when many); teacher in black."""
    from analysis.tables import config_label

    if curves.empty:
        return None
    info = {r["config_id"]: r for r in records(results)}
    stud = curves[(curves["who"] == "student") & curves["value"].notna()]
    if stud.empty:
        return None
    final = stud.sort_values(["config_id", "step"]).groupby("config_id")["value"].last()
    ids = [int(c) for c in final.index if c in info]
    moe = [
        c
        for c in ids
        if info[c]["kind"] == "moe2dense"
        and info[c]["distill_loss"] is None
        and info[c]["teacher_top_k"] is None
        and seed_label(info[c].get("variant")) is None  # a seed repeat: its main configuration's line
    ]
    other = [c for c in ids if c not in moe and info[c]["kind"] != "moe2dense"]
    if len(moe) + len(other) > max_lines:  # one line per scoring: its lowest final CE
        best: dict[str, int] = {}
        for c in sorted(moe, key=lambda c: (final[c], c)):
            best.setdefault(info[c]["scoring"], c)
        moe = [best[s] for s in ordered("scoring", best)]
    chosen = moe + other
    use_tokens = stud["tokens"].notna().all()
    fig = new_figure(6.4, 3.4)
    ax = fig.add_subplot(1, 1, 1)
    styles = ["--", "-.", (0, (3, 1, 1, 1, 1, 1)), ":"]
    n_other = 0
    for c in chosen:
        g = stud[stud["config_id"] == c].sort_values("step")
        x = g["tokens"].astype(float) if use_tokens else g["step"].astype(float)
        r = info[c]
        if r["kind"] == "moe2dense":
            ax.plot(
                x,
                g["value"],
                color=scoring_color(r["scoring"]),
                linestyle=grouping_style(r.get("grouping")),
                label=config_label(r),
            )
        else:
            ax.plot(
                x, g["value"], color="#555555", linestyle=styles[n_other % len(styles)], label=config_label(r)
            )
            n_other += 1
    teach = curves[(curves["who"] == "teacher") & curves["value"].notna() & curves["config_id"].isin(chosen)]
    if len(teach):
        first = teach[teach["config_id"] == teach["config_id"].min()].sort_values("step")
        x = first["tokens"].astype(float) if use_tokens else first["step"].astype(float)
        ax.plot(x, first["value"], color="black", linestyle="-", linewidth=0.8, label="teacher")
    ax.set_xlabel("distillation tokens" if use_tokens else "distillation step")
    ax.set_ylabel("validation cross-entropy (nats)")
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.set_title(f"Validation CE during distillation, {label}")
    return fig


# ---- Figure 7: accuracy by scoring and K per model ---------------------------------------------------------
def by_scoring_k_figure(panels: list[dict[str, Any]]) -> Figure | None:
    """One panel per model: best accuracy per scoring and K; green K = k, coral K > k, dashed random FFN.

    Each panel: {"label", "data" (derived.best_by_scoring_k), "top_k", "random_ffn" (% or None)}."""
    panels = [p for p in panels if len(p["data"])]
    if not panels:
        return None
    ncol = min(2, len(panels))
    nrow = -(-len(panels) // ncol)
    fig = new_figure(4.6 * ncol, 2.9 * nrow + 0.6)
    grid = fig.add_gridspec(nrow, ncol)
    handles: dict[str, Any] = {}
    for i, p in enumerate(panels):
        ax = fig.add_subplot(grid[i // ncol, i % ncol])
        d, k = p["data"], p["top_k"]
        names = ordered("scoring", d["scoring"])
        ks = [int(x) for x in ordered("K", d["K"])]
        merges = [x for x in ks if k is None or x > k]
        per = {
            s: [(int(r["K"]), float(r["avg"])) for r in records(d[d["scoring"] == s].sort_values("K"))]
            for s in names
        }
        widest = max(len(v) for v in per.values())
        w = 0.8 / widest
        vals = [y for v in per.values() for _, y in v]
        bars_k: list[tuple[Any, int]] = []
        for si, s in enumerate(names):  # each scoring's bars side by side, only the K it has
            for j, (K, y) in enumerate(per[s]):
                pure = k is not None and K == k
                shade = 1.0 if pure or len(merges) < 2 else 1.0 - 0.5 * merges.index(K) / (len(merges) - 1)
                bar = ax.bar(
                    si + (j - (len(per[s]) - 1) / 2) * w,
                    y,
                    w * 0.92,
                    color=PRUNE if pure else MERGE,
                    alpha=shade,
                    edgecolor="white",
                    linewidth=0.3,
                )
                _bar_labels(ax, bar, [y], fmt="{:.1f}", size=5.0 if widest <= 2 else 4.5)
                handles.setdefault("K = k (pure pruning)" if pure else "K > k (merging)", bar[0])
                bars_k.append((bar[0], K))
        rf = plain(p.get("random_ffn"))
        if rf is not None:
            handles["random FFN"] = ax.axhline(rf, color="black", linestyle="--", linewidth=0.9)
            vals.append(rf)
        ax.set_xticks(np.arange(len(names)), names, rotation=30)
        _ylim(ax, vals)
        lo, hi = ax.get_ylim()
        for b, K in bars_k:  # which K each bar is, at its foot
            ax.text(
                b.get_x() + b.get_width() / 2,
                lo + 0.02 * (hi - lo),
                str(K),
                rotation=90,
                ha="center",
                va="bottom",
                fontsize=5.0,
                color="white",
            )
        ks_text = ", ".join(str(x) for x in ks)
        ax.set_title(f"{p['label']}\n(k={k}; K ∈ {{{ks_text}}})", fontsize=8.5)
        if i % ncol == 0:
            ax.set_ylabel("post-distill accuracy (%)")
    fig.legend(list(handles.values()), list(handles), loc="outside lower center", ncol=len(handles))
    fig.suptitle("Post-distillation accuracy by scoring and K (best over the other axes)", fontsize=9.5)
    return fig


def panel(label: str, data: pd.DataFrame, top_k: int | None, random_ffn: float | None) -> dict[str, Any]:
    return {"label": label, "data": data, "top_k": top_k, "random_ffn": random_ffn}


def is_png(path: Path) -> bool:
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def is_pdf(path: Path) -> bool:
    b = path.read_bytes()
    return b[:5] == b"%PDF-" and b.rstrip()[-5:] == b"%%EOF"
