"""The dashboard's charts, drawn by matplotlib (Agg, under the report's style) as SVG and inlined in the page.

matplotlib (and with the scoring order, pandas) is imported when a chart is drawn: the dashboard starts
without either. The pages' Content-Security-Policy allows no inline style, so matplotlib's SVG is rewritten
before it is inlined: its <style> and metadata dropped, every `style="…"` declaration turned into the
presentation attribute of the same name, every id prefixed by the chart's name (several charts share a
page). The artists a reader or a test looks for are named by their gid (or, for a point or a line, by its
url) with a token that becomes a class, data attributes and a hover <title>; points and lines of a
configuration link to its page. Each chart also lists its data as a table (`Chart.rows`), for a reader who
cannot see the figure, and the same hash salt and no date keep the SVG of the same data the same.
"""

from __future__ import annotations

import bisect
import io
import math
import re
import threading
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from markupsafe import Markup

from analysis.latex import fmt_ppl
from analysis.palette import scoring_color
from dashboard import data as D

GREY, INK = "#6e7781", "#1f2328"
BANDS = ("#1a7f37", "#4c72b0", "#8172b3", "#dd8452", "#c44e52")  # parallel lines by PPL, lowest fifth first
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "h", "<")  # a scoring's marker, beside its colour
CURVE_COLOURS = {"student": "#1f6feb", "teacher": "#d1242f"}
LOG_ABOVE = 10.0  # a positive axis whose largest value is more than this many times its smallest is log
PAD = 0.04  # parallel coordinates: room above and below the axes' ends, in their heights
LEGEND_CHARS = 28  # a longer legend entry is cut (the table below the chart has it whole)
CHART_RC: dict[str, Any] = {
    "svg.fonttype": "none",  # text as <text> in the page's fonts: selectable, readable by the tests
    "svg.hashsalt": "moesweep-dashboard",
    "axes.grid.axis": "both",
    "savefig.bbox": "standard",  # constrained layout has placed everything: one drawing, not two
}
SVG_NS, XLINK_NS = "http://www.w3.org/2000/svg", "http://www.w3.org/1999/xlink"
HREF = f"{{{XLINK_NS}}}href"
PRESENTATION = frozenset(
    {
        "fill",
        "fill-opacity",
        "fill-rule",
        "opacity",
        "stroke",
        "stroke-dasharray",
        "stroke-dashoffset",
        "stroke-linecap",
        "stroke-linejoin",
        "stroke-miterlimit",
        "stroke-opacity",
        "stroke-width",
        "font-family",
        "font-size",
        "font-stretch",
        "font-style",
        "font-variant",
        "font-weight",
        "text-anchor",
        "clip-path",
    }
)
ET.register_namespace("", SVG_NS)
ET.register_namespace("xlink", XLINK_NS)

# matplotlib's rcParams belong to the process: one drawing at a time, the report's figures included
DRAWING = threading.Lock()


@dataclass
class Chart:
    """A chart as the page shows it: the inline SVG (empty when nothing can be drawn), a note of what it
    shows and leaves out, and its data as a table; a cell is (text, link or None)."""

    name: str
    svg: Markup
    note: str
    columns: list[str]
    rows: list[list[tuple[str, str | None]]]


@dataclass
class Marks:
    """Tokens given to matplotlib as an artist's gid or a point's url, and what each becomes in the SVG:
    its class, data attributes, a hover title and (for a point or a line) the page it links to."""

    found: dict[str, tuple[dict[str, str], str | None, str | None]] = field(default_factory=dict)

    def __call__(self, cls: str, title: str | None = None, href: str | None = None, **data: Any) -> str:
        token = f"mark-{len(self.found)}"
        attrs = {"class": cls, **{f"data-{k.replace('_', '-')}": str(v) for k, v in data.items()}}
        self.found[token] = (attrs, title, href)
        return token


def compact(v: float, million: str = "m") -> str:
    """A tick's value in a few characters: 20 · 2.5 · 120k · 1.5m (or 1.5M and 7B for parameters)."""
    a = abs(v)
    if a >= 1e9 and million == "M":
        return f"{v / 1e9:g}B"
    if a >= 1e6:
        return f"{v / 1e6:g}{million}"
    if a >= 1e4:
        return f"{v / 1e3:g}k"
    return f"{v:g}"


def wide(values: list[float]) -> bool:
    """Whether positive values span more than LOG_ABOVE× (then their axis is log)."""
    return bool(values) and min(values) > 0 and max(values) > LOG_ABOVE * min(values)


def plain(text: str) -> str:
    """Text matplotlib shows as it is: a `$` would start mathtext."""
    return text.replace("$", r"\$")


def short(text: str, n: int = LEGEND_CHARS) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def _scoring_key(s: str) -> tuple[int, str]:
    from analysis.derived import SCORING_ORDER

    return (SCORING_ORDER.index(s) if s in SCORING_ORDER else len(SCORING_ORDER), s)


def scoring_marker(s: str) -> str:
    """A scoring's marker, as stable as its colour (its place in the paper's order, else its name)."""
    from analysis.derived import SCORING_ORDER

    i = SCORING_ORDER.index(s) if s in SCORING_ORDER else len(SCORING_ORDER) + sum(map(ord, s))
    return MARKERS[i % len(MARKERS)]


# ---- drawing and inlining -----------------------------------------------------------------------------------
@contextmanager
def drawing() -> Iterator[None]:
    """The report's matplotlib style plus CHART_RC, one drawing at a time."""
    import matplotlib

    from analysis.figures import style

    with DRAWING, style():
        matplotlib.rcParams.update(CHART_RC)
        yield


def _figure(width: float, height: float) -> Any:
    from analysis.figures import new_figure

    return new_figure(width, height)


def _axes_marks(ax: Any, marks: Marks, x_label: str, y_label: str) -> None:
    """Axis labels, and the tokens that name the plot area, the axes and their labels in the SVG."""
    ax.set_xlabel(plain(x_label))
    ax.set_ylabel(plain(y_label))
    ax.patch.set_gid(marks("plot-area"))
    ax.xaxis.set_gid(marks("x-axis"))
    ax.yaxis.set_gid(marks("y-axis"))
    ax.xaxis.label.set_gid(marks("x-label"))
    ax.yaxis.label.set_gid(marks("y-label"))


def _scale(
    ax: Any, which: str, values: list[float], log: bool, million: str | None = None, integer: bool = False
) -> None:
    """Round ticks on one axis: on a log one 1, 2, 5 × 10^k over up to two and a half decades (else only
    the decades), labelled short (`compact`); on a linear one matplotlib's round steps in plain notation
    (short where they reach 10,000 and `million` is given)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter, ScalarFormatter

    axis = getattr(ax, f"{which}axis")
    if log:
        getattr(ax, f"set_{which}scale")("log")
        subs = (1.0, 2.0, 5.0) if math.log10(max(values) / min(values)) <= 2.5 else (1.0,)
        axis.set_major_locator(LogLocator(base=10, subs=subs))
        axis.set_major_formatter(FuncFormatter(lambda v, _: compact(v, million or "m")))
        axis.set_minor_formatter(NullFormatter())
        return
    axis.set_major_locator(MaxNLocator(nbins="auto", steps=[1, 2, 2.5, 5, 10], integer=integer))
    if million is not None and max(abs(v) for v in values) >= 1e4:
        axis.set_major_formatter(FuncFormatter(lambda v, _: compact(v, million)))
    else:
        fmt = ScalarFormatter(useOffset=False)
        fmt.set_scientific(False)
        axis.set_major_formatter(fmt)


def _legend(fig: Any, handles: list[Any], marks: Marks) -> None:
    """The legend right of the axes and their labels, outside the data."""
    fig.legend(handles=handles, loc="outside right upper").set_gid(marks("legend"))


def _render(fig: Any, ax: Any, name: str, aria: str, marks: Marks, y_ax: Any = None) -> Markup:
    """The figure as inline SVG, its root saying the scales matplotlib drew (`ax`'s x, `y_ax`'s y)."""
    import matplotlib

    buf = io.BytesIO()
    fig.savefig(buf, format="svg", metadata={"Date": None})
    root = {
        "data-drawn-by": f"matplotlib {matplotlib.__version__}",
        "data-x-scale": ax.get_xscale(),
        "data-y-scale": (y_ax or ax).get_yscale(),
    }
    return Markup(inline(buf.getvalue(), name, aria, marks, root))


def _style_attrs(el: ET.Element) -> None:
    """`style="a: b; c: d"` → a="b" c="d" (presentation attributes: the policy forbids inline style)."""
    style = el.attrib.pop("style", "")
    for decl in style.split(";"):
        if not decl.strip():
            continue
        key, sep, value = decl.partition(":")
        key = key.strip()
        if not sep or key not in PRESENTATION:
            raise ValueError(
                f"chart SVG: style property {decl.strip()!r}; allowed: {', '.join(sorted(PRESENTATION))}"
            )
        value = value.strip()
        if key == "font-family" and "sans-serif" not in value:
            value += ", sans-serif"  # where the reader's browser has no DejaVu Sans
        el.set(key, value)


def inline(svg: bytes, name: str, aria: str, marks: Marks, root_attrs: dict[str, str] | None = None) -> str:
    """matplotlib's SVG as an element of the page: no <style>, no style attributes, ids prefixed by
    `name`, the marked artists classed and titled, the class `chart <name>`, `aria` as its label and
    `root_attrs` on the root."""
    root = ET.fromstring(svg)
    for parent in list(root.iter()):
        for child in list(parent):
            if child.tag in (f"{{{SVG_NS}}}metadata", f"{{{SVG_NS}}}style"):
                parent.remove(child)
    ref = re.compile(r"url\(#([^)]+)\)")
    for el in root.iter():
        _style_attrs(el)
        for k, v in list(el.attrib.items()):
            if "url(#" in v:
                el.set(k, ref.sub(lambda m: f"url(#{name}-{m.group(1)})", v))
        href = el.get(HREF)
        if href is not None and href.startswith("#"):
            el.set(HREF, f"#{name}-{href[1:]}")
        elif href in marks.found:
            found, tip, link = marks.found[href]
            del el.attrib[HREF]
            el.attrib.pop("target", None)
            if link is None:
                el.tag = f"{{{SVG_NS}}}g"
            else:
                el.set("href", link)
            _mark(el, found, tip)
        mid = el.get("id")
        if mid in marks.found:
            del el.attrib["id"]
            found, tip, _ = marks.found[mid]
            _mark(el, found, tip)
        elif mid is not None:
            el.set("id", f"{name}-{mid}")
        if el.tag not in (f"{{{SVG_NS}}}text", f"{{{SVG_NS}}}tspan", f"{{{SVG_NS}}}title"):
            el.text = None if el.text is None or not el.text.strip() else el.text
        el.tail = None if el.tail is None or not el.tail.strip() else el.tail
    _class_texts(root, "x-axis", "x-label", "x-tick")
    _class_texts(root, "y-axis", "y-label", "y-tick")
    _class_texts(root, "legend", None, "legend-text")
    for parent in list(root.iter()):
        for child in list(parent):
            if child.tag == f"{{{SVG_NS}}}defs" and not len(child):
                parent.remove(child)
    w, h = (float(root.get(a, "0").removesuffix("pt")) for a in ("width", "height"))
    root.set("width", f"{w * 4 / 3:.0f}")  # pt → CSS px
    root.set("height", f"{h * 4 / 3:.0f}")
    root.attrib.pop("version", None)
    root.set("class", f"chart {name}")
    root.set("role", "img")
    root.set("aria-label", aria)
    for k, v in (root_attrs or {}).items():
        root.set(k, v)
    root.set("stroke-linejoin", "round")  # matplotlib's <style>: * {stroke-linejoin: round; …}
    root.set("stroke-linecap", "butt")
    title = ET.Element(f"{{{SVG_NS}}}title")
    title.text = aria
    root.insert(0, title)
    return ET.tostring(root, encoding="unicode")


def _mark(el: ET.Element, attrs: dict[str, str], title: str | None) -> None:
    for k, v in attrs.items():
        el.set(k, f"{el.get(k)} {v}" if k == "class" and el.get(k) else v)
    if title is not None:
        t = ET.Element(f"{{{SVG_NS}}}title")
        t.text = title
        el.insert(0, t)


def _classes(el: ET.Element) -> list[str]:
    return (el.get("class") or "").split()


def _class_texts(root: ET.Element, group: str, skip: str | None, cls: str) -> None:
    """Class `cls` on every <text> inside the groups of class `group`, but those inside `skip` groups."""
    text = f"{{{SVG_NS}}}text"
    for g in (e for e in root.iter() if group in _classes(e)):
        skipped = {id(t) for s in g.iter() if skip in _classes(s) for t in s.iter(text)}
        for t in g.iter(text):
            if id(t) not in skipped:
                t.set("class", " ".join([*_classes(t), cls]))


# ---- the charts -----------------------------------------------------------------------------------------
def _finite_ppl(r: dict[str, Any]) -> float | None:
    v = r["ppl_pre"]
    if r.get("ppl_pre_kind") not in (None, "finite") or v is None or not math.isfinite(v) or v <= 0:
        return None
    return float(v)


def _left_out(n: int, what: str) -> str:
    return f"{n} configuration{'s' if n != 1 else ''} {what}" if n else ""


def _config(r: dict[str, Any]) -> tuple[str, str | None]:
    return str(r["config_key"]), f"/configs/{r['config_id']}"


def curve_chart(curves: dict[str, list[tuple[int, float]]]) -> Chart:
    """Validation CE by distillation step, a line per who (student, teacher), each point titled."""
    from matplotlib.lines import Line2D

    columns = ["who", "step", "validation cross-entropy"]
    rows = [
        [(who, None), (str(s), None), (f"{v:.6g}", None)]
        for who, pts in sorted(curves.items())
        for s, v in pts
    ]
    lines = {who: [(s, v) for s, v in pts if math.isfinite(v)] for who, pts in sorted(curves.items())}
    lines = {who: pts for who, pts in lines.items() if pts}
    if not lines:
        return Chart("curve", Markup(""), "", columns, rows)
    marks = Marks()
    with drawing():
        fig = _figure(6.6, 3.0)
        ax = fig.add_subplot()
        handles = []
        for who, pts in lines.items():
            colour = CURVE_COLOURS.get(who, GREY)
            xs, ys = [float(s) for s, _ in pts], [v for _, v in pts]
            ax.plot(xs, ys, color=colour, gid=marks("series", series=who))
            ax.scatter(
                xs,
                ys,
                s=14,
                color=colour,
                zorder=3,
                gid=marks("points", series=who),
                urls=[marks("point", title=f"{who} step {s}: {v:.6g}", series=who) for s, v in pts],
            )
            handles.append(Line2D([], [], color=colour, marker="o", markersize=4, label=plain(short(who))))
        _axes_marks(ax, marks, "distillation step", "validation cross-entropy")
        values = [v for pts in lines.values() for _, v in pts]
        _scale(ax, "x", [s for pts in lines.values() for s, _ in pts], log=False, integer=True)
        _scale(ax, "y", values, log=False)
        _legend(fig, handles, marks)
        svg = _render(fig, ax, "curve", "validation cross-entropy by distillation step", marks)
    return Chart("curve", svg, "", columns, rows)


def ppl_by_k_chart(rows: list[dict[str, Any]]) -> Chart:
    """PPL before distillation by K, one line per scoring (the paper's Figures 7–9): at each K the lowest
    PPL over the rows' other axes (grouping, scaling, …; filter to fix them), the teacher dashed; a log
    PPL axis when it spans more than LOG_ABOVE×, a log K axis when the largest is 4× the smallest."""
    from matplotlib.lines import Line2D

    columns = ["scoring", "K", "PPL before distillation", "lowest of", "configuration"]
    grid = [r for r in rows if r["scoring"] is not None and r["K"] is not None and r["kind"] != "teacher"]
    best: dict[str, dict[int, tuple[float, dict[str, Any], int]]] = {}
    diverged = 0
    for r in grid:
        v = _finite_ppl(r)
        if v is None:
            diverged += r.get("ppl_pre_kind") not in (None, "finite")
            continue
        at = best.setdefault(r["scoring"], {})
        old = at.get(r["K"])
        n = (old[2] if old else 0) + 1
        at[r["K"]] = (v, r, n) if old is None or v < old[0] else (old[0], old[1], n)
    if not best:
        return Chart(
            "ppl-by-k",
            Markup(""),
            "No configuration of the rows shown has a scoring, a K and a finite PPL.",
            columns,
            [],
        )
    ks = sorted({k for at in best.values() for k in at})
    scorings = sorted(best, key=_scoring_key)
    teachers = [r for r in rows if r["kind"] == "teacher" and _finite_ppl(r) is not None]
    table = [
        [(s, None), (str(k), None), (fmt_ppl(v), None), (str(n), None), _config(r)]
        for s in scorings
        for k, (v, r, n) in sorted(best[s].items())
    ] + [
        [("teacher", None), ("all", None), (fmt_ppl(_finite_ppl(t)), None), ("", None), _config(t)]
        for t in teachers
    ]
    values = [v for at in best.values() for v, _, _ in at.values()] + [_finite_ppl(t) for t in teachers]
    y_log, x_log = wide(values), len(ks) > 1 and ks[-1] >= 4 * ks[0]
    marks = Marks()
    with drawing():
        from matplotlib.ticker import FixedLocator, NullLocator

        fig = _figure(6.6, 3.1)
        ax = fig.add_subplot()
        handles = []
        for s in scorings:
            pts = sorted(best[s].items())
            xs, ys = [float(k) for k, _ in pts], [v for _, (v, _, _) in pts]
            colour, marker = scoring_color(s), scoring_marker(s)
            ax.plot(xs, ys, color=colour, gid=marks("series", series=s))
            ax.scatter(
                xs,
                ys,
                s=18,
                color=colour,
                marker=marker,
                zorder=3,
                gid=marks("points", series=s),
                urls=[
                    marks(
                        "point",
                        title=f"{s} K={k}: {fmt_ppl(v)} (lowest of {n}: {r['config_key']})",
                        href=f"/configs/{r['config_id']}",
                        series=s,
                        config=r["config_id"],
                    )
                    for k, (v, r, n) in pts
                ],
            )
            handles.append(Line2D([], [], color=colour, marker=marker, markersize=4, label=plain(short(s))))
        for t in teachers:
            name = "teacher" if len(teachers) == 1 else f"teacher {t['config_key']}"
            v = _finite_ppl(t)
            xs = [float(ks[0]), float(ks[-1])]
            ax.plot(xs, [v, v], color=INK, linestyle="--", gid=marks("series teacher", series=name))
            ax.scatter(
                xs,
                [v, v],
                s=10,
                color=INK,
                zorder=3,
                gid=marks("points", series=name),
                urls=[
                    marks(
                        "point",
                        title=f"{name}: {fmt_ppl(v)}",
                        href=f"/configs/{t['config_id']}",
                        series=name,
                        config=t["config_id"],
                    )
                    for _ in xs
                ],
            )
            handles.append(Line2D([], [], color=INK, linestyle="--", label=plain(short(name))))
        _axes_marks(
            ax,
            marks,
            "K (experts kept per layer)",
            "PPL before distillation" + (" (log scale)" if y_log else ""),
        )
        _scale(ax, "x", [float(k) for k in ks], log=x_log, integer=True)
        if len(ks) <= 12:
            ax.xaxis.set_major_locator(FixedLocator([float(k) for k in ks]))
            ax.xaxis.set_minor_locator(NullLocator())
        _scale(ax, "y", values, log=y_log)
        _legend(fig, handles, marks)
        svg = _render(fig, ax, "ppl-by-k", "PPL before distillation by K, one line per scoring", marks)
    models = {r["model"] for r in grid}
    note = [
        "Each point: the lowest PPL over the other axes at that K among the rows shown (filter to fix them)."
    ]
    if len(models) > 1:
        note.append(f"The rows hold {len(models)} models: filter by model to separate them.")
    if diverged:
        note.append("Left out: " + _left_out(diverged, "whose PPL is not finite") + ".")
    return Chart("ppl-by-k", svg, " ".join(note), columns, table)


def _group_colour(g: str) -> str:
    if g == "teacher":
        return INK
    return GREY if g in ("baseline", "other", "dense2moe") else scoring_color(g)


def acc_by_params_chart(rows: list[dict[str, Any]]) -> Chart:
    """Average accuracy by the student's parameter count, a point per configuration coloured (and marked)
    by scoring, the teacher black and baselines grey; a log parameter axis when it spans more than
    LOG_ABOVE×."""
    from matplotlib.lines import Line2D

    columns = ["scoring or kind", "configuration", "parameters", "average accuracy %"]
    both = [
        r
        for r in rows
        if r["params"] is not None
        and math.isfinite(r["params"])
        and r["params"] > 0
        and r["avg_acc"] is not None
        and math.isfinite(r["avg_acc"])
    ]
    no_params = sum(1 for r in rows if r["avg_acc"] is not None and r not in both)
    if not both:
        return Chart(
            "acc-by-params",
            Markup(""),
            "No configuration of the rows shown has both a parameter count and an accuracy.",
            columns,
            [],
        )
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in both:
        groups.setdefault(r["scoring"] or r["kind"] or "other", []).append(r)
    ordered = sorted(groups.items(), key=lambda kv: _scoring_key(kv[0]))
    table = [
        [(g, None), _config(r), (f"{r['params']:,.0f}", None), (f"{100 * float(r['avg_acc']):.2f}", None)]
        for g, members in ordered
        for r in sorted(members, key=lambda r: r["params"])
    ]
    xs_all = [float(r["params"]) for r in both]
    x_log = wide(xs_all)
    marks = Marks()
    with drawing():
        fig = _figure(6.6, 3.1)
        ax = fig.add_subplot()
        handles = []
        for g, members in ordered:
            members = sorted(members, key=lambda r: r["params"])
            colour = _group_colour(g)
            marker = "o" if g in ("teacher", "baseline", "other", "dense2moe") else scoring_marker(g)
            ax.scatter(
                [float(r["params"]) for r in members],
                [100 * float(r["avg_acc"]) for r in members],
                s=22,
                color=colour,
                marker=marker,
                zorder=3,
                gid=marks("points", series=g),
                urls=[
                    marks(
                        "point",
                        title=f"{r['config_key']}: {100 * float(r['avg_acc']):.2f} % at {r['params']:,.0f} parameters",
                        href=f"/configs/{r['config_id']}",
                        series=g,
                        config=r["config_id"],
                    )
                    for r in members
                ],
            )
            handles.append(
                Line2D(
                    [], [], color=colour, marker=marker, linestyle="none", markersize=5, label=plain(short(g))
                )
            )
        _axes_marks(ax, marks, "parameters" + (" (log scale)" if x_log else ""), "average accuracy %")
        _scale(ax, "x", xs_all, log=x_log, million="M")
        _scale(ax, "y", [100 * float(r["avg_acc"]) for r in both], log=False)
        _legend(fig, handles, marks)
        svg = _render(fig, ax, "acc-by-params", "average accuracy by parameter count", marks)
    note = f"{len(both)} configuration(s) with both a parameter count and an accuracy."
    if no_params:
        note += " Left out: " + _left_out(no_params, "with an accuracy but no parameter count") + "."
    return Chart("acc-by-params", svg, note, columns, table)


def _category_key(v: Any) -> tuple[bool, str, Any]:
    return (v is not None, str(type(v)), v if v is not None else 0)


def parallel_chart(rows: list[dict[str, Any]], axes: list[str]) -> Chart:
    """Parallel coordinates of the grid: an axis per column that varies among the rows shown (its values
    evenly spaced, sorted; `–` for none), then PPL before distillation (log when it spans more than
    LOG_ABOVE×); a line per configuration coloured by its fifth of them by PPL, the picked ones bold."""
    from matplotlib.collections import LineCollection
    from matplotlib.lines import Line2D

    usable = [(r, v) for r in rows if (v := _finite_ppl(r)) is not None]
    left_out = len(rows) - len(usable)
    dims = [a for a in axes if len({r[a] for r, _ in usable}) > 1]
    columns = ["configuration", *[D.LABELS.get(a, a) for a in dims], "PPL before distillation", "picked"]
    if len(usable) < 2 or not dims:
        return Chart(
            "parallel",
            Markup(""),
            "Fewer than two configurations with a finite PPL, or no axis varies among them.",
            columns,
            [],
        )
    cats = {a: sorted({r[a] for r, _ in usable}, key=_category_key) for a in dims}
    ppls = [v for _, v in usable]
    log = wide(ppls)
    ranked = sorted(ppls)

    def band(v: float) -> int:
        """The fifth of the rows (by PPL, lowest first) that `v` falls in."""
        return min(len(BANDS) - 1, bisect.bisect_left(ranked, v) * len(BANDS) // len(ranked))

    def shown(v: Any) -> str:
        return "–" if v is None else str(v)

    order = sorted(usable, key=lambda rv: (bool(rv[0]["selected_for_distill"]), -rv[1]))
    table = [
        [
            _config(r),
            *[(shown(r[a]), None) for a in dims],
            (fmt_ppl(v), None),
            ("★" if r["selected_for_distill"] else "", None),
        ]
        for r, v in sorted(usable, key=lambda rv: (rv[1], rv[0]["config_id"]))
    ]
    n = len(dims) + 1
    marks = Marks()
    with drawing():
        fig = _figure(max(6.6, 2.2 + 1.3 * (n - 1)), 3.5)
        ax = fig.add_subplot()
        ppl_ax = ax.twinx()
        _scale(ppl_ax, "y", ppls, log=log)
        f, f_inv = (math.log10, lambda y: 10**y) if log else (float, float)
        lo, hi = f(min(ppls)), f(max(ppls))
        ppl_ax.set_ylim(f_inv(lo - PAD * (hi - lo)), f_inv(hi + PAD * (hi - lo)))  # as the category axes

        def at(v: float) -> float:
            return (f(v) - lo) / (hi - lo)

        def cat_y(a: str, v: Any) -> float:
            return cats[a].index(v) / (len(cats[a]) - 1)

        for picked in (False, True):
            drawn = [(r, v) for r, v in order if bool(r["selected_for_distill"]) == picked]
            if not drawn:
                continue
            ax.add_collection(
                LineCollection(
                    [[(i, cat_y(a, r[a])) for i, a in enumerate(dims)] + [(n - 1, at(v))] for r, v in drawn],
                    colors=[BANDS[band(v)] for _, v in drawn],
                    linewidths=2.4 if picked else 1.0,
                    alpha=1.0 if picked else 0.55,
                    zorder=3 if picked else 2,
                    gid=marks("config-lines"),
                    urls=[
                        marks(
                            "config-line picked" if picked else "config-line",
                            title=f"{r['config_key']}: PPL {fmt_ppl(v)}" + (" ★ picked" if picked else ""),
                            href=f"/configs/{r['config_id']}",
                            config=r["config_id"],
                        )
                        for r, v in drawn
                    ],
                )
            )
        ax.set_xlim(0, n - 1)
        ax.set_ylim(-PAD, 1 + PAD)
        ax.set_xticks([])
        ax.set_yticks([])
        ax.grid(False)
        ppl_ax.grid(False)
        for a in (ax, ppl_ax):
            for side in ("top", "right", "left", "bottom"):
                a.spines[side].set_visible(False)
        ax.patch.set_gid(marks("plot-area"))
        ppl_ax.yaxis.set_gid(marks("y-axis"))
        top = ax.get_xaxis_transform()
        for i, a in enumerate([*dims, "ppl_pre"]):
            ax.axvline(i, color="#8c959f", linewidth=0.8, zorder=1)
            name = D.LABELS.get(a, a) if a != "ppl_pre" else "PPL pre" + (" (log)" if log else "")
            ax.text(
                i, 1.03, plain(name), transform=top, ha="center", va="bottom", gid=marks("dim-label", axis=a)
            )
        for i, a in enumerate(dims):
            for v in cats[a]:
                ax.annotate(
                    plain(short(shown(v), 12)),
                    (i, cat_y(a, v)),
                    xytext=(-4, 0),
                    textcoords="offset points",
                    ha="right",
                    va="center",
                    fontsize=7.5,
                    zorder=5,
                    bbox={
                        "boxstyle": "square,pad=0.1",
                        "facecolor": "white",
                        "edgecolor": "none",
                        "alpha": 0.8,
                    },
                    gid=marks("cat-tick", title=shown(v), axis=a),
                )
        bands: dict[int, list[float]] = {}
        for v in ranked:
            bands.setdefault(band(v), []).append(v)
        _legend(
            fig,
            [
                Line2D([], [], color=BANDS[b], linewidth=2, label=f"{fmt_ppl(vs[0])}–{fmt_ppl(vs[-1])}")
                for b, vs in sorted(bands.items())
            ],
            marks,
        )
        svg = _render(
            fig,
            ax,
            "parallel",
            "the grid's axes and PPL before distillation, a line per configuration",
            marks,
            y_ax=ppl_ax,
        )
    note = (
        f"{len(usable)} configurations; a line's colour is its fifth of them by PPL (lowest: green); bold: "
        "picked by the selection rule."
    )
    if left_out:
        note += " Left out: " + _left_out(left_out, "without a finite PPL") + "."
    return Chart("parallel", svg, note, columns, table)
