"""`moesweep serve`: a read-only web dashboard over the results database (Starlette + Jinja2 templates).

The application only has GET routes: no page can change anything, and the database is opened through
`Store(url, read_only=True)` (SQLite `mode=ro` + `query_only` + an authorizer; PostgreSQL read-only
transactions), so even a bug here could not write. Live pages poll a small JSON endpoint.

Against other web pages in the visitor's browser: a request whose Host header is not one of the
dashboard's names gets a plain 400 (a page whose DNS name was rebound to 127.0.0.1 reads nothing), and
every response carries a Content-Security-Policy without inline script or style (the pages keep it),
X-Content-Type-Options: nosniff and Referrer-Policy: no-referrer. A query string longer than
MAX_QUERY bytes, or an integer outside its range, is a one-line 400.
"""

from __future__ import annotations

import bisect
import contextlib
import csv
import functools
import io
import math
import re
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

from markupsafe import Markup
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, PlainTextResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from analysis.latex import fmt_ppl
from analysis.palette import scoring_color
from dashboard import data as D
from dashboard.reports import ReportCache, compare
from db.store import Store, StoreError

HERE = Path(__file__).parent
POLL_MS = 1500
MAX_QUERY = 2048  # bytes of query string: the longest filter URL is a few hundred
ID_MAX = 2**63 - 1  # a database id above this cannot exist (and SQLite cannot even bind it)
LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "[::1]"})
SECURITY_HEADERS = [
    (
        b"content-security-policy",
        b"default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
        b"object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'",
    ),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"x-frame-options", b"DENY"),
    (b"cross-origin-resource-policy", b"same-origin"),
]


def _ppl(v: Any, kind: str | None = "finite") -> str:
    """A perplexity as the report prints it; '–' for a non-finite one (a diverged student)."""
    if kind not in (None, "finite"):
        return "–"
    return "" if v is None else fmt_ppl(float(v), kind)


def _pct(v: Any, digits: int = 2) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    return f"{100 * float(v):.{digits}f}"


def _num(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return "—" if not math.isfinite(v) else f"{v:.6g}"
    return str(v)


def _shown_digits(v: float) -> tuple[float, str, int]:
    """How `fmt_ppl` shows a perplexity of this size: (scale, suffix, decimals)."""
    v = abs(v)
    if v >= 1e6:
        return 1e6, "m", 1
    if v >= 1e5:
        return 1e3, "k", 0
    if v >= 100:
        return 1.0, "", 0 if v >= 1e3 else 1
    return 1.0, "", 2


def _fixed(x: float, decimals: int, signed: bool = False) -> str:
    """`x` with `decimals` decimals (thousands separated), or two significant digits where that would
    round a non-zero number to zero (an SE is never shown as 0.00 unless it is 0)."""
    text = f"{x:{'+' if signed else ''},.{decimals}f}"
    if x != 0 and not float(text.replace(",", "")):
        text = f"{x:{'+' if signed else ''}.2g}"
    return text


def _ppl_se(v: Any, se: Any) -> str:
    """A perplexity's standard error in the units and precision its value is shown with (`120k ± 3k`)."""
    if v is None or se is None or not math.isfinite(float(v)) or not math.isfinite(float(se)):
        return ""
    scale, suffix, digits = _shown_digits(float(v))
    return _fixed(float(se) / scale, digits) + suffix


def _pct_se(se: Any) -> str:
    if se is None or not math.isfinite(float(se)):
        return ""
    return _fixed(100 * float(se), 2)


def _dur(v: Any) -> str:
    if v is None:
        return ""
    v = float(v)
    return f"{v:.1f} s" if v < 120 else f"{v / 60:.1f} min" if v < 7200 else f"{v / 3600:.1f} h"


def _seg(v: Any) -> str:
    """One URL path segment (a sweep name may hold ':' or spaces)."""
    return quote(str(v), safe="")


def nice_ticks(lo: float, hi: float, n: int = 5, integer: bool = False) -> list[float]:
    """About `n` round ticks (steps of 1, 2, 2.5 or 5 × 10^k) from at or below `lo` to at or above `hi`; a
    range of zero is widened around its value, so the ticks always differ."""
    if not hi - lo > abs(hi) * 1e-12:
        if integer:
            hi = lo + 1
        else:
            half = abs(lo) * 0.005 or 0.5
            lo, hi = lo - half, hi + half
    raw = (hi - lo) / max(n - 1, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw * (1 - 1e-9))
    if integer:
        step = max(1, round(step))
    first, last = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
    return [float(f"{i * step:.12g}") for i in range(first, last + 1)]


def tick_labels(ticks: list[float]) -> list[str]:
    """Tick values as text with the fewest decimals that keep every label distinct and exact for the step."""
    step = min((b - a for a, b in zip(ticks, ticks[1:], strict=False)), default=1.0)
    digits = max(0, -math.floor(math.log10(step) + 1e-9)) if step > 0 else 0
    while True:
        out = [f"{t:.{digits}f}" for t in ticks]
        exact = all(abs(float(o) - t) <= step * 1e-6 for o, t in zip(out, ticks, strict=True))
        if (len(set(out)) == len(out) and exact) or digits >= 15:
            return out
        digits += 1


GREY, INK = "#6e7781", "#1f2328"
# the parallel-coordinates lines by PPL, lowest fifth to highest
BANDS = ("#1a7f37", "#4c72b0", "#8172b3", "#dd8452", "#c44e52")
LOG_ABOVE = 10.0  # a positive axis whose largest value is more than this many times its smallest is log


def log_ticks(lo: float, hi: float) -> list[float]:
    """Round ticks for a log axis from at or below `lo` to at or above `hi` (both > 0): 1, 2 and 5 × 10^k
    over at most two decades, every decade over more (every other one past seven)."""
    a, b = math.floor(math.log10(lo) + 1e-9), math.ceil(math.log10(hi) - 1e-9)
    b = max(b, a + 1)
    if b - a <= 2:
        ticks = [float(f"{m}e{e}") for e in range(a, b + 1) for m in (1, 2, 5)]
        first = max(t for t in ticks if t <= lo * (1 + 1e-9))
        last = min(t for t in ticks if t > first and t >= hi * (1 - 1e-9))  # two ticks at least
        return [t for t in ticks if first <= t <= last]
    step = 1 if b - a <= 7 else 2
    return [float(f"1e{e}") for e in range(a, b + step, step)]


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


@dataclass
class Axis:
    """Ticks, their labels and the scale (log or linear) of one axis of a chart."""

    ticks: list[float]
    labels: list[str]
    log: bool = False

    def pos(self, v: float, at_first: float, at_last: float) -> float:
        """Where `v` lies between the pixel of the first tick and that of the last."""
        f = math.log10 if self.log else float
        lo, hi = f(self.ticks[0]), f(self.ticks[-1])
        return at_first + (f(v) - lo) / (hi - lo) * (at_last - at_first)


def axis(
    values: list[float],
    log: bool = False,
    integer: bool = False,
    at: list[float] | None = None,
    million: str | None = None,
) -> Axis:
    """The axis of some values: the given tick positions `at` (a grid's K), round log ticks, or
    `nice_ticks`; labels by `tick_labels`, or short (`compact`) on a log axis and for large numbers."""
    lo, hi = min(values), max(values)
    if at is not None and len(set(at)) > 1:
        ticks = sorted(set(at))
    elif log:
        ticks = log_ticks(lo, hi)
    else:
        ticks = nice_ticks(lo, hi, integer=integer)
    if log or at is not None or (million is not None and max(abs(t) for t in ticks) >= 1e4):
        labels = [compact(t, million or "m") for t in ticks]
    else:
        labels = tick_labels(ticks)
    return Axis(ticks, labels, log)


def wide(values: list[float]) -> bool:
    """Whether positive values span more than LOG_ABOVE× (then their axis is log)."""
    return bool(values) and min(values) > 0 and max(values) > LOG_ABOVE * min(values)


@dataclass
class Series:
    """One line (or one group of scattered points) of a chart, each point with its tooltip."""

    name: str
    points: list[tuple[float, float, str]]
    colour: str = GREY
    line: bool = True
    dashed: bool = False


def _legend(items: list[tuple[str, str, bool, bool]], x: float, top: float, bottom: float) -> list[str]:
    """The legend right of the plot area at `x`: (name, colour, as a line, dashed) per entry."""
    esc = Markup.escape
    step = min(18.0, (bottom - top - 8) / max(len(items), 1))
    out = ['<g class="legend">']
    for i, (name, c, as_line, dashed) in enumerate(items):
        y = f"{top + 8 + step * i:.1f}"
        shown = name if len(name) <= 14 else name[:13] + "…"
        mark = (
            f'<line x1="{x + 14}" y1="{y}" x2="{x + 34}" y2="{y}" stroke="{c}" stroke-width="2"'
            + (' stroke-dasharray="5 3"' if dashed else "")
            + "/>"
            if as_line
            else f'<circle cx="{x + 24}" cy="{y}" r="4" fill="{c}"/>'
        )
        out.append(
            f'<g class="legend-item"><title>{esc(name)}</title>{mark}'
            f'<text class="tick" x="{x + 40}" y="{y}" dy="0.32em">{esc(shown)}</text></g>'
        )
    out.append("</g>")
    return out


def svg_chart(
    series: list[Series],
    *,
    x_label: str,
    y_label: str,
    aria: str,
    css: str = "chart",
    x_log: bool = False,
    y_log: bool = False,
    x_at: list[float] | None = None,
    x_integer: bool = False,
    x_million: str | None = None,
    width: int = 640,
    height: int = 300,
) -> Markup:
    """A line or scatter chart as inline SVG: round ticks on both axes (log where asked), axis labels
    below and left of the plot area, the legend to its right, a tooltip on every point. Points that a
    log axis cannot show (not positive) or that are not finite are left out."""
    ok = [
        Series(
            s.name,
            [
                p
                for p in s.points
                if math.isfinite(p[0])
                and math.isfinite(p[1])
                and (p[0] > 0 or not x_log)
                and (p[1] > 0 or not y_log)
            ],
            s.colour,
            s.line,
            s.dashed,
        )
        for s in series
    ]
    ok = [s for s in ok if s.points]
    pts = [p for s in ok for p in s.points]
    if not pts:
        return Markup("")
    xa = axis([p[0] for p in pts], log=x_log, integer=x_integer, at=x_at, million=x_million)
    ya = axis([p[1] for p in pts], log=y_log)
    left, right, top, bottom = 72, 130, 14, 50  # margins: tick labels and y label; legend; x label
    px0, px1, py0, py1 = left, width - right, top, height - bottom  # the plot area

    def sx(v: float) -> float:
        return xa.pos(v, px0, px1)

    def sy(v: float) -> float:
        return ya.pos(v, py1, py0)

    esc = Markup.escape
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="{css}" viewBox="0 0 {width} {height}" '
        f'width="{width}" height="{height}" role="img" aria-label="{esc(aria)}"'
        f' data-x-scale="{"log" if xa.log else "linear"}" data-y-scale="{"log" if ya.log else "linear"}">',
        f'<rect class="plot-area" x="{px0}" y="{py0}" width="{px1 - px0}" height="{py1 - py0}" fill="none"/>',
    ]
    for t, label in zip(ya.ticks, ya.labels, strict=True):
        y = f"{sy(t):.1f}"
        out.append(f'<line class="grid" x1="{px0}" y1="{y}" x2="{px1}" y2="{y}"/>')
        out.append(
            f'<text class="tick y-tick" x="{px0 - 5}" y="{y}" dy="0.32em" text-anchor="end">{label}</text>'
        )
    for t, label in zip(xa.ticks, xa.labels, strict=True):
        x = f"{sx(t):.1f}"
        out.append(f'<line class="axis" x1="{x}" y1="{py1}" x2="{x}" y2="{py1 + 4}"/>')
        out.append(f'<text class="tick x-tick" x="{x}" y="{py1 + 16}" text-anchor="middle">{label}</text>')
    out += [
        f'<line class="axis" x1="{px0}" y1="{py1}" x2="{px1}" y2="{py1}"/>',
        f'<line class="axis" x1="{px0}" y1="{py0}" x2="{px0}" y2="{py1}"/>',
        f'<text class="label x-label" x="{(px0 + px1) / 2}" y="{height - 10}" text-anchor="middle">'
        f"{esc(x_label)}</text>",
        f'<text class="label y-label" transform="rotate(-90)" x="{-(py0 + py1) / 2}" y="16" '
        f'text-anchor="middle">{esc(y_label)}</text>',
    ]
    for s in ok:
        xy = [(sx(x), sy(y)) for x, y, _ in s.points]
        if s.line:
            out.append(
                f'<polyline class="series" fill="none" stroke="{s.colour}" stroke-width="2" '
                + ('stroke-dasharray="5 3" ' if s.dashed else "")
                + f'points="{" ".join(f"{x:.1f},{y:.1f}" for x, y in xy)}"/>'
            )
        for (_, _, tip), (x, y) in zip(s.points, xy, strict=True):
            out.append(
                f'<circle class="point" r="{3 if s.line else 4}" fill="{s.colour}" cx="{x:.1f}" cy="{y:.1f}" '
                f'data-series="{esc(s.name)}"><title>{esc(tip)}</title></circle>'
            )
    out += _legend([(s.name, s.colour, s.line, s.dashed) for s in ok], px1, py0, py1)
    out.append("</svg>")
    return Markup("".join(out))


def svg_curve(curves: dict[str, list[tuple[int, float]]], width: int = 640, height: int = 300) -> Markup:
    """Validation CE by distillation step as an inline SVG line chart, one line per who (student, teacher):
    round ticks on both axes, axis labels, and the legend to the right of the plot area."""
    colours = {"student": "#1f6feb", "teacher": "#d1242f"}
    return svg_chart(
        [
            Series(who, [(s, v, f"{who} step {s}: {v:.6g}") for s, v in line], colours.get(who, GREY))
            for who, line in sorted(curves.items())
        ],
        x_label="distillation step",
        y_label="validation cross-entropy",
        aria="validation cross-entropy by distillation step",
        css="curve",
        x_integer=True,
        width=width,
        height=height,
    )


def _finite_ppl(r: dict[str, Any]) -> float | None:
    v = r["ppl_pre"]
    if r.get("ppl_pre_kind") not in (None, "finite") or v is None or not math.isfinite(v) or v <= 0:
        return None
    return float(v)


def _left_out(n: int, what: str) -> str:
    return f"{n} configuration{'s' if n != 1 else ''} {what}" if n else ""


def svg_ppl_by_k(rows: list[dict[str, Any]]) -> tuple[Markup, str]:
    """PPL before distillation by K, one line per scoring (the paper's Figures 7–9): at each K the lowest
    PPL over the rows' other axes (grouping, scaling, …; filter to fix them), the teacher dashed; a log
    PPL axis when it spans more than LOG_ABOVE×. Returns the chart and a note of what it leaves out."""
    grid = [r for r in rows if r["scoring"] is not None and r["K"] is not None and r["kind"] != "teacher"]
    best: dict[str, dict[int, tuple[float, str, int]]] = {}
    diverged = 0
    for r in grid:
        v = _finite_ppl(r)
        if v is None:
            diverged += r.get("ppl_pre_kind") not in (None, "finite")
            continue
        at = best.setdefault(r["scoring"], {})
        old = at.get(r["K"])
        n = (old[2] if old else 0) + 1
        at[r["K"]] = (v, r["config_key"], n) if old is None or v < old[0] else (old[0], old[1], n)
    if not best:
        return Markup(""), "No configuration of the rows shown has a scoring, a K and a finite PPL."
    ks = sorted({k for at in best.values() for k in at})
    series = [
        Series(
            s,
            [
                (k, v, f"{s} K={k}: {fmt_ppl(v)} (lowest of {n}: {key})")
                for k, (v, key, n) in sorted(at.items())
            ],
            scoring_color(s),
        )
        for s, at in sorted(best.items(), key=lambda kv: _scoring_key(kv[0]))
    ]
    teachers = [r for r in rows if r["kind"] == "teacher" and _finite_ppl(r) is not None]
    for t in teachers:
        name = "teacher" if len(teachers) == 1 else f"teacher {t['config_key']}"
        v = _finite_ppl(t)
        series.append(
            Series(name, [(k, v, f"{name}: {fmt_ppl(v)}") for k in (ks[0], ks[-1])], INK, dashed=True)
        )
    values = [p[1] for s in series for p in s.points]
    chart = svg_chart(
        series,
        x_label="K (experts kept per layer)",
        y_label="PPL before distillation" + (" (log scale)" if wide(values) else ""),
        aria="PPL before distillation by K, one line per scoring",
        css="chart ppl-by-k",
        x_log=len(ks) > 1 and ks[-1] >= 4 * ks[0],
        y_log=wide(values),
        x_at=[float(k) for k in ks] if len(ks) <= 12 else None,
        x_integer=True,
    )
    models = {r["model"] for r in grid}
    note = [
        "Each point: the lowest PPL over the other axes at that K among the rows shown (filter to fix them)."
    ]
    if len(models) > 1:
        note.append(f"The rows hold {len(models)} models: filter by model to separate them.")
    if diverged:
        note.append("Left out: " + _left_out(diverged, "whose PPL is not finite") + ".")
    return chart, " ".join(note)


def _scoring_key(s: str) -> tuple[int, str]:
    from analysis.derived import SCORING_ORDER

    return (SCORING_ORDER.index(s) if s in SCORING_ORDER else len(SCORING_ORDER), s)


def svg_acc_by_params(rows: list[dict[str, Any]]) -> tuple[Markup, str]:
    """Average accuracy by the student's parameter count, a point per configuration coloured by scoring
    (the teacher and baselines grey and black); a log parameter axis when it spans more than LOG_ABOVE×."""
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
        return Markup(""), "No configuration of the rows shown has both a parameter count and an accuracy."
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in both:
        groups.setdefault(r["scoring"] or r["kind"] or "other", []).append(r)

    def colour(g: str) -> str:
        if g == "teacher":
            return INK
        return GREY if g in ("baseline", "other", "dense2moe") else scoring_color(g)

    series = [
        Series(
            g,
            [
                (
                    float(r["params"]),
                    100 * float(r["avg_acc"]),
                    f"{r['config_key']}: {_pct(r['avg_acc'])} % at {r['params']:,.0f} parameters",
                )
                for r in sorted(members, key=lambda r: r["params"])
            ],
            colour(g),
            line=False,
        )
        for g, members in sorted(groups.items(), key=lambda kv: _scoring_key(kv[0]))
    ]
    xs = [float(r["params"]) for r in both]
    chart = svg_chart(
        series,
        x_label="parameters" + (" (log scale)" if wide(xs) else ""),
        y_label="average accuracy %",
        aria="average accuracy by parameter count",
        css="chart acc-by-params",
        x_log=wide(xs),
        x_million="M",
    )
    note = f"{len(both)} configuration(s) with both a parameter count and an accuracy."
    if no_params:
        note += " Left out: " + _left_out(no_params, "with an accuracy but no parameter count") + "."
    return chart, note


def _category_key(v: Any) -> tuple[bool, str, Any]:
    return (v is not None, str(type(v)), v if v is not None else 0)


def svg_parallel(rows: list[dict[str, Any]], axes: list[str], height: int = 340) -> tuple[Markup, str]:
    """Parallel coordinates of the grid: an axis per column that varies among the rows shown (its values
    evenly spaced, sorted; `–` for none), then PPL before distillation (log when it spans more than
    LOG_ABOVE×); a line per configuration coloured by its fifth of them by PPL, the picked ones bold."""
    usable = [(r, v) for r in rows if (v := _finite_ppl(r)) is not None]
    left_out = len(rows) - len(usable)
    dims = [a for a in axes if len({r[a] for r, _ in usable}) > 1]
    if len(usable) < 2 or not dims:
        return Markup(""), "Fewer than two configurations with a finite PPL, or no axis varies among them."
    cats = {a: sorted({r[a] for r, _ in usable}, key=_category_key) for a in dims}
    ppls = [v for _, v in usable]
    pa = axis(ppls, log=wide(ppls))
    n = len(dims) + 1
    left, right, top, bottom = 70, 170, 40, 16
    width = max(640, left + right + 120 * (n - 1))
    px0, px1, py0, py1 = left, width - right, top, height - bottom
    xs = [px0 + i * (px1 - px0) / (n - 1) for i in range(n)]

    def cat_y(a: str, v: Any) -> float:
        vals = cats[a]
        return py1 - vals.index(v) / (len(vals) - 1) * (py1 - py0)

    ranked = sorted(ppls)

    def band(v: float) -> int:
        """The fifth of the rows (by PPL, lowest first) that `v` falls in."""
        return min(len(BANDS) - 1, bisect.bisect_left(ranked, v) * len(BANDS) // len(ranked))

    esc = Markup.escape
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="chart parallel" viewBox="0 0 {width} {height}" '
        f'width="{width}" height="{height}" role="img" aria-label="the grid\'s axes and PPL before '
        f'distillation, a line per configuration" data-y-scale="{"log" if pa.log else "linear"}">',
        f'<rect class="plot-area" x="{px0}" y="{py0}" width="{px1 - px0}" height="{py1 - py0}" fill="none"/>',
    ]
    lines = []
    for r, v in sorted(usable, key=lambda rv: (bool(rv[0]["selected_for_distill"]), -rv[1])):
        pts = [(xs[i], cat_y(a, r[a])) for i, a in enumerate(dims)] + [(xs[-1], pa.pos(v, py1, py0))]
        picked = bool(r["selected_for_distill"])
        tip = f"{r['config_key']}: PPL {fmt_ppl(v)}" + (" ★ picked" if picked else "")
        lines.append(
            f'<polyline class="config-line{" picked" if picked else ""}" data-config="{r["config_id"]}" '
            f'fill="none" stroke="{BANDS[band(v)]}" stroke-width="{2.6 if picked else 1.2}" '
            f'stroke-opacity="{1 if picked else 0.55}" '
            f'points="{" ".join(f"{x:.1f},{y:.1f}" for x, y in pts)}"><title>{esc(tip)}</title></polyline>'
        )
    out += lines
    halo = 'stroke="white" stroke-width="3" paint-order="stroke"'
    for i, a in enumerate(dims):
        x = f"{xs[i]:.1f}"
        name = D.LABELS.get(a, a)
        out.append(f'<line class="axis" x1="{x}" y1="{py0}" x2="{x}" y2="{py1}"/>')
        out.append(
            f'<text class="label dim-label" x="{x}" y="{py0 - 14}" text-anchor="middle" data-axis="{esc(a)}">'
            f"{esc(name)}</text>"
        )
        for v in cats[a]:
            text = "–" if v is None else str(v)
            shown = text if len(text) <= 12 else text[:11] + "…"
            out.append(
                f'<text class="tick cat-tick" x="{xs[i] - 4:.1f}" y="{cat_y(a, v):.1f}" dy="0.32em" '
                f'text-anchor="end" {halo}><title>{esc(text)}</title>{esc(shown)}</text>'
            )
    x = f"{xs[-1]:.1f}"
    out.append(f'<line class="axis" x1="{x}" y1="{py0}" x2="{x}" y2="{py1}"/>')
    out.append(
        f'<text class="label dim-label" x="{x}" y="{py0 - 14}" text-anchor="middle" data-axis="ppl_pre">'
        f"PPL pre{' (log)' if pa.log else ''}</text>"
    )
    for t, label in zip(pa.ticks, pa.labels, strict=True):
        out.append(
            f'<text class="tick y-tick" x="{xs[-1] + 5:.1f}" y="{pa.pos(t, py1, py0):.1f}" dy="0.32em" '
            f"{halo}>{label}</text>"
        )
    bands: dict[int, list[float]] = {}
    for v in ranked:
        bands.setdefault(band(v), []).append(v)
    out += _legend(
        [(f"{fmt_ppl(vs[0])}–{fmt_ppl(vs[-1])}", BANDS[b], True, False) for b, vs in sorted(bands.items())],
        px1 + 40,
        py0,
        py1,
    )
    out.append("</svg>")
    note = (
        f"{len(usable)} configurations; a line's colour is its fifth of them by PPL (lowest: green); bold: "
        "picked by the selection rule."
    )
    if left_out:
        note += " Left out: " + _left_out(left_out, "without a finite PPL") + "."
    return Markup("".join(out)), note


templates = Jinja2Templates(directory=str(HERE / "templates"))
templates.env.filters.update(
    ppl=_ppl, pct=_pct, num=_num, dur=_dur, seg=_seg, last_line=D.last_line, ppl_se=_ppl_se, pct_se=_pct_se
)
templates.env.globals.update(statuses=D.STATUSES, poll_ms=POLL_MS, labels=D.LABELS)


def _store(request: Request) -> Store:
    return request.app.state.store


def _page(request: Request, name: str, **ctx: Any) -> Response:
    return templates.TemplateResponse(request, name, ctx)


def _one(value: Any, what: str) -> Any:
    if value is None:
        raise HTTPException(404, what)
    return value


def _query_url(request: Request, **changes: Any) -> str:
    """This page's URL with some query parameters changed (None drops one)."""
    q = dict(request.query_params)
    for k, v in changes.items():
        if v is None:
            q.pop(k, None)
        else:
            q[k] = str(v)
    return f"{request.url.path}?{urlencode(q)}" if q else request.url.path


def _checked(endpoint: Callable[[Request], Response]) -> Callable[[Request], Response]:
    """The endpoint, refusing an oversized query string first (SQLite refuses a long LIKE pattern, and
    nothing the pages link to comes near MAX_QUERY)."""

    @functools.wraps(endpoint)
    def run(request: Request) -> Response:
        n = len(request.scope.get("query_string", b""))
        if n > MAX_QUERY:
            raise D.BadRequest(f"query string too long: {n} bytes; at most {MAX_QUERY}")
        return endpoint(request)

    return run


# ---- pages ---------------------------------------------------------------------------------------------
def index(request: Request) -> Response:
    return _page(request, "index.html", sweeps=D.sweeps(_store(request)), db=_store(request).shown)


RESULTS_PARAMS = ("sort", "order", "selected", "q")  # the results page's parameters beside the axes


def _results_query(request: Request, store: Store, name: str) -> dict[str, Any]:
    """The sweep's results as this URL filters and sorts them (the results page, its CSV and its plots
    read the same parameters), with the axes that have a value in some row."""
    q = request.query_params
    filters = {a: q[a] for a in D.FILTER_AXES if q.get(a)}
    unknown = sorted(set(q) - set(D.FILTER_AXES) - set(RESULTS_PARAMS))
    if unknown:
        raise D.BadRequest(
            f"unknown query parameter {unknown[0]!r}; allowed: {', '.join(RESULTS_PARAMS)}, "
            + ", ".join(D.FILTER_AXES)
        )
    if q.get("order") not in (None, "", "asc", "desc"):
        raise D.BadRequest(f"order: {q['order']!r}; allowed: asc, desc")
    if q.get("selected") not in (None, "", "0", "1"):
        raise D.BadRequest(f"selected: {q['selected']!r}; allowed: 0, 1")
    sort, desc, selected_only = q.get("sort") or None, q.get("order") == "desc", q.get("selected") == "1"
    found = D.results(
        store,
        name,
        filters,
        sort=sort,
        desc=desc,
        selected_only=selected_only,
        search=q.get("q") or None,
    )
    return {
        "rows": found,
        "filters": filters,
        "axes": [c for c in D.TABLE_AXES if any(r[c] is not None for r in found)],
        "sort": sort,
        "desc": desc,
        "selected_only": selected_only,
        "search": q.get("q") or "",
    }


def _with_query(request: Request, path: str) -> str:
    """`path` with this page's query string (the CSV and the plots of the rows a page shows)."""
    query = request.url.query
    return f"{path}?{query}" if query else path


def sweep_page(request: Request) -> Response:
    store, name = _store(request), request.path_params["name"]
    sw = _one(D.sweep(store, name), f"no sweep {name!r} in this database")
    found = _results_query(request, store, name)
    base = f"/sweeps/{_seg(name)}"
    return _page(
        request,
        "sweep.html",
        sweep=sw,
        options=D.filter_options(store, name),
        url=lambda **kw: _query_url(request, **kw),
        csv_url=_with_query(request, base + "/results.csv"),
        plots_url=_with_query(request, base + "/plots"),
        max_compared=D.MAX_COMPARED,
        **found,
    )


def csv_value(row: dict[str, Any], col: str) -> str:
    """One CSV cell, exact: empty for NULL, a perplexity's `inf` / `-inf` / `nan` as its value_kind
    says, floats in their shortest exact form, accuracies as fractions (as the database has them)."""
    kind = row.get(f"{col}_kind")
    if kind not in (None, "finite"):
        return str(kind)
    v = row[col]
    if v is None:
        return ""
    if isinstance(v, bool):
        return str(int(v))
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        return ("inf" if v > 0 else "-inf") if math.isinf(v) else repr(v)
    return str(v)


def results_csv(request: Request) -> Response:
    """The results table as the same query filters and sorts it, as a CSV attachment."""
    store, name = _store(request), request.path_params["name"]
    _one(D.sweep(store, name), f"no sweep {name!r} in this database")
    found = _results_query(request, store, name)
    cols = D.csv_columns(found["axes"])
    buf = io.StringIO()
    out = csv.writer(buf, lineterminator="\r\n")
    out.writerow(cols)
    out.writerows([csv_value(r, c) for c in cols] for r in found["rows"])
    plain = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "sweep"
    return Response(
        buf.getvalue(),
        media_type="text/csv",
        headers={
            "content-disposition": f'attachment; filename="{plain}-results.csv"; '
            f"filename*=UTF-8''{quote(name + '-results.csv', safe='')}"
        },
    )


def plots_page(request: Request) -> Response:
    store, name = _store(request), request.path_params["name"]
    sw = _one(D.sweep(store, name), f"no sweep {name!r} in this database")
    found = _results_query(request, store, name)
    rows = found["rows"]
    by_k, by_k_note = svg_ppl_by_k(rows)
    scatter, scatter_note = svg_acc_by_params(rows)
    parallel, parallel_note = svg_parallel(rows, found["axes"])
    return _page(
        request,
        "plots.html",
        sweep=sw,
        options=D.filter_options(store, name),
        results_url=_with_query(request, f"/sweeps/{_seg(name)}"),
        charts=[
            ("ppl-by-k", "PPL before distillation by K", by_k, by_k_note),
            ("acc-by-params", "Accuracy by parameters", scatter, scatter_note),
            ("parallel", "The grid: axes → PPL before distillation", parallel, parallel_note),
        ],
        **found,
    )


def jobs_page(request: Request) -> Response:
    store, name = _store(request), request.path_params["name"]
    sw = _one(D.sweep(store, name), f"no sweep {name!r} in this database")
    q = request.query_params
    if q.get("status") and q["status"] not in D.STATUSES:
        raise D.BadRequest(f"status: {q['status']!r}; allowed: {', '.join(D.STATUSES)}")
    found = D.sweep_jobs(store, name, stage=q.get("stage") or None, status=q.get("status") or None)
    return _page(
        request,
        "jobs.html",
        sweep=sw,
        jobs=found,
        stage=q.get("stage") or "",
        status=q.get("status") or "",
        live=not (q.get("stage") or q.get("status")),
    )


def report_page(request: Request) -> Response:
    store, name = _store(request), request.path_params["name"]
    sw = _one(D.sweep(store, name), f"no sweep {name!r} in this database")
    if not sw.configs:
        return _page(request, "report.html", sweep=sw, report=None, problem="no configurations yet")
    try:
        rep = request.app.state.reports.get(store, name)
    except ValueError as e:
        return _page(request, "report.html", sweep=sw, report=None, problem=str(e))
    return _page(request, "report.html", sweep=sw, report=rep, problem=None)


def report_figure(request: Request) -> Response:
    store, name, file = _store(request), request.path_params["name"], request.path_params["file"]
    _one(D.sweep(store, name), f"no sweep {name!r} in this database")
    rep = request.app.state.reports.get(store, name)
    if file not in {
        f for f, _ in rep.figures
    }:  # only files the report listed: no path from the URL is opened
        raise HTTPException(404, f"no figure {file!r} in the report of {name}")
    return FileResponse(rep.folder / "figures" / file, media_type="image/png")


def compare_page(request: Request) -> Response:
    store, name = _store(request), request.path_params["name"]
    sw = _one(D.sweep(store, name), f"no sweep {name!r} in this database")
    return _page(request, "compare.html", sweep=sw, cmp=compare(store, name))


def _delta(a: dict[str, Any], b: dict[str, Any], col: str, pct: bool = False) -> Markup:
    """`b`'s difference to `a` in one number, with the standard error of the difference where both have
    one (√(se_a² + se_b²): as if independent, not paired over the same items); a PPL's also relative."""
    va, vb = a.get(col), b.get(col)
    if a.get(f"{col}_kind") not in (None, "finite") or b.get(f"{col}_kind") not in (None, "finite"):
        return Markup("")
    if va is None or vb is None or not math.isfinite(float(va)) or not math.isfinite(float(vb)):
        return Markup("")
    d = float(vb) - float(va)
    sa, sb = a.get(f"{col}_se"), b.get(f"{col}_se")
    se = math.hypot(float(sa), float(sb)) if sa is not None and sb is not None else None
    if pct:
        text = f"Δ {_fixed(100 * d, 2, signed=True)} pp" + (
            f" ± {_fixed(100 * se, 2)}" if se is not None else ""
        )
    elif col == "params":
        text = f"Δ {d:+,.0f}" + (f" ({100 * d / float(va):+.1f}%)" if va else "")
    else:
        scale, suffix, digits = _shown_digits(max(abs(float(va)), abs(float(vb))))
        text = f"Δ {_fixed(d / scale, digits, signed=True)}{suffix}"
        if se is not None:
            text += f" ± {_fixed(se / scale, digits)}{suffix}"
        if va:
            text += f" ({100 * d / float(va):+.1f}%)"
    return Markup('<div class="delta" data-delta="{}">{}</div>').format(repr(d), text)


COMPARE_NUMBERS = (
    ("ppl_pre", "PPL before distillation", False),
    ("ppl_post", "PPL after", False),
    ("avg_acc", "avg accuracy %", True),
)


def configs_compare_page(request: Request) -> Response:
    """2 to MAX_COMPARED configurations (of any sweeps) side by side: `/configs/compare?c=ID&c=ID…`."""
    store, q = _store(request), request.query_params
    unknown = sorted(set(q) - {"c"})
    if unknown:
        raise D.BadRequest(
            f"unknown query parameter {unknown[0]!r}; allowed: c (a configuration id, repeated)"
        )
    ids: list[int] = []
    for v in q.getlist("c"):
        v = v.strip()
        if not v:
            continue
        if not (v.isascii() and v.isdigit()):
            raise D.BadRequest(f"c: {D.shown(v)} is not a configuration id")
        if int(v) > ID_MAX:
            raise HTTPException(404, f"no configuration {v if len(v) <= 40 else v[:40] + '…'}")
        if int(v) not in ids:
            ids.append(int(v))
    if not 2 <= len(ids) <= D.MAX_COMPARED:
        raise D.BadRequest(f"compare: choose 2 to {D.MAX_COMPARED} configurations (got {len(ids)})")
    found = D.configs(store, ids)
    for i in ids:
        _one(found.get(i), f"no configuration {i}")
    cfgs = [found[i] for i in ids]
    first = cfgs[0]
    fields = ["sweep", *D.CONFIG_PAGE_FIELDS, "selected_for_distill"]
    described = []
    for f in fields:
        cells = [c.get(f) for c in cfgs]
        if any(v is not None for v in cells):
            described.append((f, D.LABELS.get(f, f), cells, [v != cells[0] for v in cells]))
    numbers = [
        (col, label, pct, [Markup("")] + [_delta(first, c, col, pct) for c in cfgs[1:]])
        for col, label, pct in COMPARE_NUMBERS
    ]
    params = [Markup("")] + [_delta(first, c, "params") for c in cfgs[1:]]
    per: dict[tuple[str, str, str], dict[int, dict[str, Any]]] = {}
    for t in D.task_scores(store, ids):
        cell = {"v": t["value"], "v_se": t["stderr"], "v_n": t["n"], "headline": t["headline"]}
        per.setdefault((t["task"], t["metric"], t["stage"]), {}).setdefault(t["config_id"], cell)
    tasks = []
    for (task, metric, stage), by in sorted(per.items()):
        cells = [by.get(i) for i in ids]
        ref = cells[0]
        for cell in cells[1:]:
            if cell is not None:
                cell["delta"] = _delta(ref, cell, "v", pct=True) if ref is not None else Markup("")
        label = f"{task} {metric}" + ("" if stage == "post" else f" ({stage})")
        tasks.append((f"{task}:{metric}:{stage}", label, any(c and c["headline"] for c in cells), cells))
    return _page(
        request,
        "compare_configs.html",
        cfgs=cfgs,
        described=described,
        numbers=numbers,
        params=params,
        tasks=tasks,
    )


def config_page(request: Request) -> Response:
    store, cid = _store(request), request.path_params["config_id"]
    shown = str(cid) if len(str(cid)) <= 40 else str(cid)[:40] + "…"
    cfg = _one(D.config(store, cid) if cid <= ID_MAX else None, f"no configuration {shown}")
    jobs = D.config_jobs(store, cid)
    for j in jobs:
        j["log"] = D.log_tail(j["log_path"])
    curve = D.curve(store, cid)
    return _page(
        request,
        "config.html",
        cfg=cfg,
        fields=D.CONFIG_PAGE_FIELDS,
        plan=D.plan(store, cid),
        metrics=D.metrics(store, cid),
        curve=svg_curve(curve),
        curve_points=sum(len(v) for v in curve.values()),
        jobs=jobs,
    )


def job_page(request: Request) -> Response:
    store, key = _store(request), request.path_params["key"]
    j = _one(D.job(store, key), f"no job {key!r}")
    return _page(request, "job.html", job=j, log=D.log_tail(j["log_path"]))


# ---- JSON for the live pages --------------------------------------------------------------------------
def api_sweeps(request: Request) -> Response:
    return JSONResponse(
        {
            "sweeps": [
                {"name": s.name, "status": s.status, "stages": s.counts} for s in D.sweeps(_store(request))
            ]
        }
    )


def api_progress(request: Request) -> Response:
    store, name = _store(request), request.path_params["name"]
    _one(D.sweep(store, name), f"no sweep {name!r} in this database")
    return JSONResponse(D.progress(store, name))


# ---- errors: one line ---------------------------------------------------------------------------------
def _error(request: Request, code: int, message: str) -> Response:
    if request.url.path.startswith("/api/"):
        return JSONResponse({"error": message}, status_code=code)
    return templates.TemplateResponse(
        request, "error.html", {"code": code, "message": message}, status_code=code
    )


async def _http_error(request: Request, exc: HTTPException) -> Response:
    return _error(request, exc.status_code, exc.detail or "")


async def _bad_request(request: Request, exc: D.BadRequest) -> Response:
    return _error(request, 400, str(exc))


async def _store_error(request: Request, exc: StoreError) -> Response:
    return _error(request, 503, str(exc))


# ---- the outermost layer: Host check and headers ------------------------------------------------------------
def host_name(header: str) -> str:
    """A Host header's name without its port, lower case: `LOCALHOST:8765` -> `localhost`,
    `[::1]:8765` -> `[::1]`."""
    v = header.strip().lower()
    if v.startswith("["):
        return v[: v.find("]") + 1] if "]" in v else v
    name, sep, port = v.rpartition(":")
    if sep and port.isdigit():
        v = name
    return v[:-1] if v.endswith(".") else v


class Guard:
    """ASGI wrapper around the whole application (500s included): refuses a Host that is not one of
    `hosts` (None: any) with a short plain 400 and adds SECURITY_HEADERS to every response."""

    def __init__(self, app: ASGIApp, hosts: frozenset[str] | None) -> None:
        self.app, self.hosts = app, hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_secured(message: Message) -> None:
            if message["type"] == "http.response.start":
                have = {k.lower() for k, _ in message.get("headers", [])}
                extra = [(k, v) for k, v in SECURITY_HEADERS if k not in have]
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        if self.hosts is not None:
            header = dict(scope.get("headers") or []).get(b"host", b"").decode("latin-1")
            if host_name(header) not in self.hosts:
                told = header if len(header) <= 60 else header[:60] + "…"
                refused = PlainTextResponse(
                    f"400 refused: Host {told!r} is not a name of this dashboard (it answers to "
                    f"{', '.join(sorted(self.hosts))}; see moesweep serve --host)\n",
                    status_code=400,
                )
                await refused(scope, receive, send_secured)
                return
        await self.app(scope, receive, send_secured)


class Dashboard(Starlette):
    """Starlette with the Guard outside its own error handling, so even a 500 carries the headers."""

    hosts: frozenset[str] | None = LOOPBACK_HOSTS

    def build_middleware_stack(self) -> ASGIApp:
        return Guard(super().build_middleware_stack(), self.hosts)


@contextlib.asynccontextmanager
async def _lifespan(app: Starlette) -> AsyncIterator[None]:
    """At shutdown (Ctrl-C, SIGTERM, `Background.stop`): remove the rendered reports' temporary folder."""
    try:
        yield
    finally:
        app.state.reports.close()


def create_app(
    store: Store, reports: ReportCache | None = None, hosts: Iterable[str] | None = LOOPBACK_HOSTS
) -> Starlette:
    """The dashboard over `store`, which must be read-only (a writable one is refused); it answers to
    the Host names `hosts` (with any port; None: to any name)."""
    if not store.read_only:
        raise ValueError("the dashboard only reads: open the store with Store(url, read_only=True)")
    pages = [
        ("/", index),
        ("/sweeps/{name}", sweep_page),
        ("/sweeps/{name}/jobs", jobs_page),
        ("/sweeps/{name}/report", report_page),
        ("/sweeps/{name}/report/figures/{file}", report_figure),
        ("/sweeps/{name}/compare", compare_page),
        ("/sweeps/{name}/results.csv", results_csv),
        ("/sweeps/{name}/plots", plots_page),
        ("/configs/compare", configs_compare_page),
        ("/configs/{config_id:int}", config_page),
        ("/jobs/{key}", job_page),
        ("/api/sweeps", api_sweeps),
        ("/api/sweeps/{name}/progress", api_progress),
    ]
    routes = [Route(path, _checked(endpoint)) for path, endpoint in pages]
    routes.append(Mount("/static", StaticFiles(directory=str(HERE / "static")), name="static"))
    app = Dashboard(
        routes=routes,
        exception_handlers={HTTPException: _http_error, D.BadRequest: _bad_request, StoreError: _store_error},
        lifespan=_lifespan,
    )
    app.hosts = None if hosts is None else frozenset(host_name(h) for h in hosts)
    app.state.store = store
    app.state.reports = reports or ReportCache()
    return app
