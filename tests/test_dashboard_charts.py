"""The dashboard's charts are matplotlib's SVG made fit for the pages' policy (dashboard/charts.py): no
<style> and no style attribute, ids prefixed per chart and every reference resolved, the same SVG for the
same data, names shown as written (escaped, no mathtext), round ticks on log axes, and the dashboard's
start importing neither matplotlib nor pandas. Also the SVG readers the page tests share."""

from __future__ import annotations

import math
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SVG = "{http://www.w3.org/2000/svg}"
XLINK = "{http://www.w3.org/1999/xlink}href"
NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?")


# ---- reading a chart's SVG (shared with test_dashboard_explore and test_dashboard_hardening) ----------------
def by_class(svg: ET.Element, cls: str) -> list[ET.Element]:
    return [e for e in svg.iter() if cls in (e.get("class") or "").split()]


def coordinates(el: ET.Element) -> list[tuple[float, float]]:
    """Every point an element draws at (its paths' vertices, its markers' and texts' anchors), in the SVG's
    user units; matplotlib writes absolute coordinates (no transform but a text's rotation about its anchor)."""
    out = []
    for e in el.iter():
        if e.tag == f"{SVG}path" and e.get("d") and not e.get("id"):  # a marker's shape (in defs) is relative
            nums = [float(n) for n in NUMBER.findall(e.get("d"))]
            out += list(zip(nums[::2], nums[1::2], strict=True))
        elif e.tag in (f"{SVG}use", f"{SVG}text") and e.get("x") is not None:
            out.append((float(e.get("x")), float(e.get("y"))))
    return out


def box(el: ET.Element) -> tuple[float, float, float, float]:
    pts = coordinates(el)
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    return min(xs), min(ys), max(xs), max(ys)


def area(svg: ET.Element) -> tuple[float, float, float, float]:
    (a,) = by_class(svg, "plot-area")
    return box(a)


def texts(svg: ET.Element, cls: str) -> list[str]:
    return [t.text for t in by_class(svg, cls)]


def point_at(p: ET.Element) -> tuple[float, float]:
    """Where a point is: matplotlib draws a marker as a <use> at it, or (few points) as a path around it."""
    x0, y0, x1, y1 = box(p)
    return (x0 + x1) / 2, (y0 + y1) / 2


def title(el: ET.Element) -> str:
    return el.findtext(f"{SVG}title")


def legend_outside(svg: ET.Element) -> list[str]:
    """The legend's entries, after checking that everything it draws is right of the plot area."""
    x1 = area(svg)[2]
    (legend,) = by_class(svg, "legend")
    assert box(legend)[0] > x1, (box(legend), x1)
    return texts(legend, "legend-text")


def tick_value(label: str) -> float:
    scale = {"k": 1e3, "m": 1e6, "M": 1e6, "B": 1e9}
    return float(label[:-1]) * scale[label[-1]] if label[-1] in scale else float(label.replace("−", "-"))


def svg_of(chart) -> ET.Element:
    return ET.fromstring(str(chart.svg))


# ---- synthetic rows ---------------------------------------------------------------------------------------
def _rows(
    scorings=("SF", "CP"), ks=(2, 4, 8), ppl=lambda s, i, K: 20.0 * (i + 1) / K, teacher: str | None = None
):
    rows = []
    for i, s in enumerate(scorings):
        for K in ks:
            rows.append(
                {
                    "config_id": len(rows) + 1,
                    "config_key": f"{s}|K={K}",
                    "model": "tiny-moe",
                    "kind": "moe2dense",
                    "scoring": s,
                    "grouping": "RR",
                    "K": K,
                    "ppl_pre": ppl(s, i, K),
                    "ppl_pre_kind": "finite",
                    "params": 1e5 * K * K,
                    "avg_acc": 0.3 + 0.02 * K + 0.01 * i,
                    "selected_for_distill": int(K == ks[-1] and i == 0),
                }
            )
    if teacher is not None:
        rows.append(
            {
                "config_id": len(rows) + 1,
                "config_key": teacher,
                "model": "tiny-moe",
                "kind": "teacher",
                "scoring": None,
                "grouping": None,
                "K": None,
                "ppl_pre": 10.0,
                "ppl_pre_kind": "finite",
                "params": 2e7,
                "avg_acc": 0.7,
                "selected_for_distill": 0,
            }
        )
    return rows


def _all_charts(rows):
    from dashboard import charts

    curve = {"student": [(0, 5.3548), (100, 5.3531), (200, 5.3512)], "teacher": [(0, 5.352), (200, 5.352)]}
    return [
        charts.ppl_by_k_chart(rows),
        charts.acc_by_params_chart(rows),
        charts.parallel_chart(rows, ["scoring", "K"]),
        charts.curve_chart(curve),
    ]


# ---- the tests ------------------------------------------------------------------------------------------
def test_the_dashboard_starts_without_matplotlib_or_pandas(tmp_path):
    """Importing the app and creating it loads neither; drawing a chart then loads matplotlib (so the
    check sees an import when there is one)."""
    from db.store import Store

    url = f"sqlite:///{tmp_path / 'r.db'}"
    Store(url).engine.dispose()
    code = (
        "import sys\n"
        "from db.store import Store\n"
        "import dashboard.server\n"
        "from dashboard.app import create_app\n"
        f"create_app(Store({url!r}, read_only=True))\n"
        "heavy = ('matplotlib', 'pandas')\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & set(heavy)))\n"
        "from dashboard.charts import curve_chart\n"
        "curve_chart({'student': [(0, 1.0), (1, 0.5)]})\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & set(heavy)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["[]", "['matplotlib', 'pandas']"], out.stdout


def test_charts_are_matplotlib_svg_fit_for_the_policy():
    """Each chart: matplotlib's SVG (its figure group, the version on the root), no <style>, <script>, style
    or on… attribute, its ids prefixed by its name and unique, every reference to an id resolved in it."""
    charts = _all_charts(_rows(teacher="teacher"))
    ids_on_page: list[str] = []
    for chart in charts:
        text = str(chart.svg)
        svg = ET.fromstring(text)
        assert svg.get("class") == f"chart {chart.name}"
        assert svg.get("data-drawn-by", "").startswith("matplotlib "), svg.attrib
        assert svg.find(f"{SVG}g").get("id") == f"{chart.name}-figure_1"  # matplotlib's figure group
        assert title(svg) == svg.get("aria-label") and svg.get("role") == "img"
        for e in svg.iter():
            assert e.tag not in (f"{SVG}style", f"{SVG}script", f"{SVG}metadata"), e.tag
            assert "style" not in e.attrib and not [a for a in e.attrib if a.startswith("on")], e.attrib
        ids = [e.get("id") for e in svg.iter() if e.get("id")]
        assert ids and all(i.startswith(chart.name + "-") for i in ids)
        assert len(set(ids)) == len(ids)
        refs = re.findall(r"url\(#([^)]+)\)", text) + [
            e.get(XLINK)[1:] for e in svg.iter() if (e.get(XLINK) or "").startswith("#")
        ]
        assert refs and set(refs) <= set(ids), set(refs) - set(ids)
        ids_on_page += ids
    assert len(set(ids_on_page)) == len(ids_on_page)  # the charts of one page share no id


def test_the_same_data_draws_the_same_svg():
    rows = _rows(teacher="teacher")
    first, again = _all_charts(rows), _all_charts(rows)
    for a, b in zip(first, again, strict=True):
        assert str(a.svg) == str(b.svg), a.name  # exact: text, not floats: the hash salt and no date


def test_names_are_shown_as_written():
    """A `$` starts no mathtext, `<` and `&` are escaped once; a long name is cut in the legend only (its
    point's title and the data table have it whole)."""
    from dashboard import charts

    odd = "tea<b>ch & $x$ er " + "z" * 40
    rows = _rows(scorings=("S$1$<i>",), teacher=odd)
    rows.append({**rows[-1], "config_id": rows[-1]["config_id"] + 1, "config_key": "t2", "ppl_pre": 12.0})
    chart = charts.ppl_by_k_chart(rows)
    svg = svg_of(chart)
    named = f"teacher {odd}"
    assert legend_outside(svg) == ["S$1$<i>", named[: charts.LEGEND_CHARS - 1] + "…", "teacher t2"]
    tips = [title(p) for p in by_class(svg, "point") if p.get("data-series") == named]
    assert tips == [f"{named}: {charts.fmt_ppl(10.0)}"] * 2
    assert [title(p).split(":")[0] for p in by_class(svg, "point")][:3] == [
        "S$1$<i> K=2",
        "S$1$<i> K=4",
        "S$1$<i> K=8",
    ]
    assert "<b>" not in str(chart.svg) and "&lt;b&gt;" in str(chart.svg)
    assert chart.rows[-2][-1] == (odd, f"/configs/{rows[-2]['config_id']}")


def test_a_style_property_without_an_attribute_is_refused():
    """A declaration the policy-safe SVG could not keep as an attribute is a one-line error, not dropped."""
    from dashboard.charts import Marks, inline

    ok = inline(
        b'<svg xmlns="http://www.w3.org/2000/svg"><path d="M 0 0" style="fill: #fff; stroke-width: 2"/></svg>',
        "c",
        "a",
        Marks(),
    )
    path = ET.fromstring(ok).find(f"{SVG}path")
    assert (path.get("fill"), path.get("stroke-width"), path.get("style")) == ("#fff", "2", None)
    with pytest.raises(ValueError, match=r"^chart SVG: style property 'filter: blur\(1px\)'; allowed: "):
        inline(
            b'<svg xmlns="http://www.w3.org/2000/svg"><path style="filter: blur(1px)"/></svg>',
            "c",
            "a",
            Marks(),
        )


@pytest.mark.parametrize(
    ("lo", "hi"),
    [(20.0, 660.0), (4829.0, 21_800_000.0), (0.0012, 0.019), (3.0, 30.1), (9.99, 1000.0)],
)
def test_log_axes_have_round_distinct_ticks_over_the_data(lo, hi):
    """PPL before distillation spanning more than 10×: a log axis whose labelled ticks are 1, 2 or 5 ×
    10^k, distinct, at most ten, inside the plot area, and the data inside it too."""
    from dashboard import charts

    ks = (2, 4, 8)
    values = dict(zip(ks, (hi, math.sqrt(lo * hi), lo), strict=True))
    rows = _rows(scorings=("SF",), ks=ks, ppl=lambda s, i, K: values[K])
    svg = svg_of(charts.ppl_by_k_chart(rows))
    assert svg.get("data-y-scale") == "log"
    x0, y0, x1, y1 = area(svg)
    ticks = by_class(svg, "y-tick")
    vals = [tick_value(t.text) for t in ticks]
    assert 2 <= len(vals) <= 10 and len(set(vals)) == len(vals), vals
    assert all(float(f"{v:.1g}") == v for v in vals), vals  # 1, 2 or 5 × 10^k
    ys = [float(t.get("y")) for t in ticks]
    assert ys == sorted(ys, reverse=True)  # larger values higher up
    assert all(y0 - 6 <= y <= y1 + 6 for y in ys)  # a label's baseline sits half its height below its tick
    for p in by_class(svg, "point"):
        x, y = point_at(p)
        assert x0 <= x <= x1 and y0 <= y <= y1, (x, y, (x0, y0, x1, y1))


def assert_drawn(png: bytes, colours: list[str], what: str) -> None:
    """A browser's screenshot of a chart is not blank: some of it is ink, and each of `colours` (a series'
    colour, as #rrggbb) is on it (a marker's inside is painted in exactly its colour; 12 of 255 allowed
    per channel for the browser's colour handling)."""
    import io

    import numpy as np
    from PIL import Image

    img = np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).astype(int)
    ink = (img.sum(axis=2) < 3 * 235).mean()
    assert ink > 0.01, (what, ink)
    for c in colours:
        want = np.array([int(c[i : i + 2], 16) for i in (1, 3, 5)])
        assert (np.abs(img - want).max(axis=2) <= 12).any(), (what, c)
