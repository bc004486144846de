"""The dashboard for exploring a sweep, not only reading it: the results table as a CSV (as filtered and
sorted), each number's standard error and n beside it, several configurations side by side (of any
sweeps), and plots of the sweep drawn by matplotlib as inline SVG (PPL before distillation by K per scoring, accuracy by
parameters, parallel coordinates of the grid). Over test_report's finished sweep, the paper's reference
data and a grid of our own with standard errors, parameter counts, a diverged and an undefined PPL;
checked through HTTP and in headless Chromium."""

from __future__ import annotations

import csv
import http.client
import io
import math
import re
import urllib.parse
import xml.etree.ElementTree as ET
from html.parser import HTMLParser

import pytest
from test_dashboard_charts import (
    SVG,
    area,
    assert_drawn,
    by_class,
    coordinates,
    legend_outside,
    point_at,
    texts,
    tick_value,
    title,
)
from test_dashboard_hardening import browser  # noqa: F401  (headless Chromium, its console log readable)
from test_readonly import snapshot
from test_report import OWN, _key, _run, build_own_sweep

from analysis.latex import fmt_ppl
from analysis.reference import reference_sweeps
from dashboard.server import Background
from db.store import Store

GRID = "explore-grid"  # the grid of our own: SE and n on every number, parameter counts
SCORINGS = ("SF", "CP", "DO-ACP")  # in the paper's order
GROUPINGS = ("RR", "WC")
KS = (2, 4, 8)
BASE = {"SF": 400.0, "CP": 60.0, "DO-ACP": 20.0}  # PPL before distillation spans more than 10×
K_F, G_F = {2: 1.5, 4: 1.2, 8: 1.0}, {"RR": 1.0, "WC": 1.1}
DIVERGED, UNDEFINED = "CP|WC|K=8", "SF|WC|K=2"  # PPL inf and nan
TASKS = ("arc_easy", "hellaswag")
WINDOWS, ITEMS = 64, 500


def ppl_of(s: str, g: str, K: int) -> float:
    if f"{s}|{g}|K={K}" == DIVERGED:
        return math.inf
    if f"{s}|{g}|K={K}" == UNDEFINED:
        return math.nan
    return BASE[s] * K_F[K] * G_F[g]


def acc_of(s: str, g: str, K: int, task: str) -> float:
    return 0.30 + 0.02 * K + {"SF": 0.0, "CP": 0.03, "DO-ACP": 0.06}[s] + (0.05 if task == "arc_easy" else 0)


def _grid(store: Store) -> None:
    sid = store.upsert_sweep(GRID, spec_yaml=f"name: {GRID}", description="a grid with SE and n")
    configs = [
        {
            "config_key": f"{s}|{g}|K={K}",
            "model": "tiny-moe",
            "kind": "moe2dense",
            "scoring": s,
            "grouping": g,
            "dp_scaling": "uniform",
            "K": K,
            "top_k": 2,
            "selected_for_distill": int(g == "RR" and K == 8),
        }
        for s in SCORINGS
        for g in GROUPINGS
        for K in KS
    ] + [{"config_key": "teacher", "model": "tiny-moe", "kind": "teacher", "top_k": 2}]
    ids = store.upsert_configs(sid, configs)
    links = []
    for c in configs:
        ck = c["config_key"]
        teacher = ck == "teacher"
        p = 10.0 if teacher else ppl_of(c["scoring"], c["grouping"], c["K"])
        params = 2e7 if teacher else 1e5 * c["K"] ** 2
        pre = [
            {
                "name": "ppl",
                "stage": "pre",
                "value": p,
                "stderr": p / 100 if math.isfinite(p) else None,
                "total": WINDOWS,
                "n_tokens": 1000,
            },
            {"name": "params", "stage": "pre", "value": params},
        ]
        links.append(
            (ids[ck], "ppl_pre", _run(store, sid, "ppl_pre", _key(GRID, "pre", ck), {"metrics": pre}))
        )
        if not math.isfinite(p) or (not teacher and c["grouping"] == "WC" and c["K"] == 4):
            continue  # not evaluated: its post-distillation numbers are NULL
        ev = [{"name": "ppl", "stage": "post", "value": p / 2, "stderr": p / 400, "total": WINDOWS}]
        for t in TASKS:
            a = 0.7 if teacher else acc_of(c["scoring"], c["grouping"], c["K"], t)
            for m, shift in (("acc", -0.02), ("acc_norm", 0.0)):
                ev.append(
                    {
                        "name": m,
                        "stage": "post",
                        "task": t,
                        "value": a + shift,
                        "stderr": 0.02,
                        "total": ITEMS,
                        "headline": int(m == "acc_norm"),
                    }
                )
        links.append(
            (ids[ck], "evaluate", _run(store, sid, "evaluate", _key(GRID, "ev", ck), {"metrics": ev}))
        )
    store.link(links)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    path = tmp_path_factory.mktemp("explore") / "r.db"
    url = f"sqlite:///{path}"
    store = Store(url)
    store.import_reference(reference_sweeps())
    build_own_sweep(store)
    _grid(store)
    store.engine.dispose()
    srv = Background(Store(url, read_only=True)).start()
    yield {"url": srv.url, "path": path, "store": Store(url, read_only=True), "server": srv}
    srv.stop()


def _get(base: str, path: str, method: str = "GET"):
    """(status, headers with lower-case names, body) of one request."""
    u = urllib.parse.urlsplit(base)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    try:
        c.request(method, path)
        r = c.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        c.close()


def _page(world, path: str) -> str:
    code, _, body = _get(world["url"], path)
    assert code == 200, (path, code, body[:400])
    return body.decode()


def _db(world, sql: str, **params) -> list[dict]:
    cols, rows = world["store"].query(sql, params)
    return [dict(zip(cols, r, strict=True)) for r in rows]


def _id(world, key: str, sweep: str = GRID) -> int:
    return _db(world, "SELECT config_id FROM results WHERE sweep = :s AND config_key = :k", s=sweep, k=key)[
        0
    ]["config_id"]


class _Cells(HTMLParser):
    """The results table: per row its data-config and per cell (attributes, text); and the headers'
    data-sort columns."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.rows: list[tuple[str, list[tuple[dict, str]]]] = []
        self.sorts: list[str] = []
        self.cell: list | None = None
        self.links: dict[str, str] = {}

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "tr" and "data-config" in a:
            self.rows.append((a["data-config"], []))
        elif tag == "td" and self.rows:
            self.cell = [a, ""]
            self.rows[-1][1].append(self.cell)
        elif tag == "a" and "data-sort" in a:
            self.sorts.append(a["data-sort"])
        if tag == "a" and a.get("id"):
            self.links[a["id"]] = a.get("href", "")

    def handle_endtag(self, tag):
        if tag == "td":
            self.cell = None

    def handle_data(self, data):
        if self.cell is not None:
            self.cell[1] += data


def _table(html: str) -> _Cells:
    p = _Cells()
    p.feed(html)
    return p


# ---- 1. the results as CSV ----------------------------------------------------------------------------------
def test_csv_is_the_table_as_filtered_and_sorted(world):
    """The page's CSV link carries its query; the CSV has the page's rows in the page's order, its columns
    (the axes it shows, each number with SE and n) and exact values: the database's floats, empty for
    NULL, `inf` and `nan` as the value_kind says, accuracies as fractions."""
    from dashboard.data import csv_columns

    query = "grouping=WC&sort=ppl_pre&order=desc"
    page = _table(_page(world, f"/sweeps/{GRID}?{query}"))
    assert page.links["csv-link"] == f"/sweeps/{GRID}/results.csv?{query}"
    code, headers, body = _get(world["url"], page.links["csv-link"])
    assert code == 200
    assert headers["content-type"] == "text/csv; charset=utf-8"
    assert headers["content-disposition"].startswith(f'attachment; filename="{GRID}-results.csv"')
    got = list(csv.reader(io.StringIO(body.decode())))
    header, rows = got[0], got[1:]
    shown_axes = [c for c in page.sorts if c not in ("config_id", "ppl_pre", "ppl_post", "avg_acc", "params")]
    shown_axes.remove("selected_for_distill")
    assert header == list(csv_columns(shown_axes))
    assert {"ppl_pre_se", "ppl_pre_n", "avg_acc_se", "avg_acc_n", "scoring", "K"} <= set(header)
    assert [r[0] for r in rows] == [cid for cid, _ in page.rows]  # the same rows, the same order
    by_key = {r[1]: dict(zip(header, r, strict=True)) for r in rows}
    db = {r["config_key"]: r for r in _db(world, "SELECT * FROM results WHERE sweep = :s", s=GRID)}
    assert set(by_key) == {k for k in db if "|WC|" in k}
    assert by_key[DIVERGED]["ppl_pre"] == "inf" and by_key[UNDEFINED]["ppl_pre"] == "nan"
    assert by_key[DIVERGED]["ppl_pre_se"] == "" and by_key[DIVERGED]["ppl_post"] == ""  # NULL: empty
    for key, row in by_key.items():
        for col in header:
            v = db[key][col]
            if col in ("ppl_pre", "ppl_post") and db[key][f"{col}_kind"] != "finite":
                continue
            if v is None:
                assert row[col] == "", (key, col, row[col])
            elif isinstance(v, float):
                assert float(row[col]) == v, (key, col, row[col], v)  # exact: no rounding
            else:
                assert row[col] == str(v), (key, col, row[col], v)
    ok = by_key["DO-ACP|WC|K=8"]
    assert 0 < float(ok["avg_acc"]) < 1 and ok["avg_acc_n"] == str(2 * ITEMS) and ok["ppl_pre_n"] == "64"
    ppls = [
        float(r[header.index("ppl_pre")]) for r in rows if r[header.index("ppl_pre")] not in ("inf", "nan")
    ]
    assert ppls == sorted(ppls, reverse=True) and len(ppls) >= 5


def test_csv_refuses_what_the_page_refuses(world):
    for path, says in (
        (f"/sweeps/{GRID}/results.csv?sort=colour", b"sort: unknown column"),
        (f"/sweeps/{GRID}/results.csv?colour=red", b"unknown query parameter"),
        (f"/sweeps/{GRID}/results.csv?K=x", b"K: &#39;x&#39; is not an integer"),
    ):
        code, _, body = _get(world["url"], path)
        assert code == 400 and says in body, (path, code, body[:300])
    code, _, body = _get(world["url"], "/sweeps/nope/results.csv")
    assert code == 404 and b"no sweep" in body
    code, headers, body = _get(world["url"], "/sweeps/paper:qwen3-30b-a3b/results.csv?K=8")
    assert code == 200 and 'filename="paper_qwen3-30b-a3b-results.csv"' in headers["content-disposition"]
    assert "filename*=UTF-8''paper%3Aqwen3-30b-a3b-results.csv" in headers["content-disposition"]


# ---- 2. standard errors and n -------------------------------------------------------------------------------
def test_numbers_show_their_se_and_n(world):
    html = _page(world, f"/sweeps/{GRID}?scoring=DO-ACP&grouping=RR")
    cells = {cid: c for cid, c in _table(html).rows}
    cid = str(_id(world, "DO-ACP|RR|K=8"))
    measures = {a["data-col"]: (a, t) for a, t in cells[cid] if "data-col" in a}
    attrs, text = measures["ppl_pre"]
    assert text == "20.00 ± 0.20" and attrs["data-n"] == str(WINDOWS)
    assert attrs["title"] == f"SE 0.2 · n = {WINDOWS} windows"
    attrs, text = measures["ppl_post"]
    assert text == "10.00 ± 0.05"
    attrs, text = measures["avg_acc"]
    acc = 100 * sum(acc_of("DO-ACP", "RR", 8, t) for t in TASKS) / len(TASKS)
    se = 100 * math.sqrt(2 * 0.02**2) / 2
    assert text == f"{acc:.2f} ± {se:.2f}" and attrs["title"].endswith(f"n = {2 * ITEMS} items")
    # a diverged student: its PPL is shown as a dash with no standard error
    html = _page(world, f"/sweeps/{GRID}?scoring=CP&grouping=WC&K=8")
    ((_, row),) = _table(html).rows
    attrs, text = next((a, t) for a, t in row if a.get("data-col") == "ppl_pre")
    assert text == "–" and "±" not in text


@pytest.mark.parametrize(
    ("value", "se", "shown"),
    [
        (22.5, 0.2, "0.20"),
        (22.5, 0.0004, "0.0004"),  # never "± 0.00" for a non-zero SE
        (512.0, 3.21, "3.2"),
        (20633.0, 123.4, "123"),
        (120000.0, 3100.0, "3k"),
        (2_800_000.0, 150_000.0, "0.1m"),
        (22.5, 0.0, "0.00"),
    ],
)
def test_a_standard_error_is_shown_as_its_value_is(value, se, shown):
    from dashboard.app import _ppl_se

    assert _ppl_se(value, se) == shown
    assert _ppl_se(value, None) == "" and _ppl_se(None, se) == ""


# ---- 3. configurations side by side ---------------------------------------------------------------------------
def _compare_table(html: str) -> dict[str, list[tuple[dict, str]]]:
    """Per row of the side-by-side table (its data-field) its cells (attributes, text)."""

    class P(HTMLParser):
        def __init__(self):
            super().__init__(convert_charrefs=True)
            self.rows, self.cell, self.heads = {}, None, []

        def handle_starttag(self, tag, attrs):
            a = dict(attrs)
            if tag == "tr" and "data-field" in a:
                self.rows[a["data-field"]] = []
            elif tag == "td" and self.rows:
                self.cell = [a, ""]
                list(self.rows.values())[-1].append(self.cell)
            elif tag == "th" and "data-config" in a:
                self.heads.append(a["data-config"])
            elif tag == "div" and self.cell is not None and "data-delta" in a:
                self.cell[0] = {**self.cell[0], "data-delta": a["data-delta"]}

        def handle_endtag(self, tag):
            if tag == "td":
                self.cell = None

        def handle_data(self, data):
            if self.cell is not None:
                self.cell[1] += data

    p = P()
    p.feed(html)
    p.rows["__heads__"] = [({"id": h}, "") for h in p.heads]
    return p.rows


def test_compare_shows_axes_numbers_tasks_and_differences(world):
    """Across sweeps (ids are global): a configuration of the grid, one of test_report's sweep and one of
    the paper's, side by side; each number with its SE, the difference to the first, per task."""
    a, b = _id(world, "DO-ACP|RR|K=8"), _id(world, "SF|RR|K=4")
    own = _id(world, "DO-ACP|RR|uniform|K=4", OWN)
    paper = _db(world, "SELECT config_id FROM results WHERE sweep = 'paper:qwen3-30b-a3b' AND ppl_pre > 0")[
        0
    ]["config_id"]
    rows = _compare_table(_page(world, f"/configs/compare?c={a}&c={b}&c={own}&c={paper}&c={a}"))
    assert [h["id"] for h, _ in rows["__heads__"]] == [str(a), str(b), str(own), str(paper)]  # repeats once
    assert [t for _, t in rows["sweep"]] == [GRID, GRID, OWN, "paper:qwen3-30b-a3b"]
    scorings = rows["scoring"]
    assert [t for _, t in scorings][:2] == ["DO-ACP", "SF"]
    assert "differs" not in scorings[0][0].get("class", "") and "differs" in scorings[1][0]["class"]
    db = {r["config_id"]: r for r in _db(world, f"SELECT * FROM results WHERE config_id IN ({a}, {b})")}
    for col in ("ppl_pre", "ppl_post", "avg_acc"):
        first, second = rows[col][0], rows[col][1]
        assert "data-delta" not in first[0]  # the reference has no difference to itself
        assert float(second[0]["data-delta"]) == db[b][col] - db[a][col]
        assert "±" in first[1] and "Δ" in second[1]
    d = db[b]["ppl_pre"] - db[a]["ppl_pre"]
    se = math.hypot(db[a]["ppl_pre_se"], db[b]["ppl_pre_se"])
    # shown with the decimals of the larger of the two (480.0: one), relative to the first
    assert f"Δ +{d:.1f} ± {se:.1f} (+{100 * d / db[a]['ppl_pre']:.1f}%)" in rows["ppl_pre"][1][1]
    assert float(rows["params"][1][0]["data-delta"]) == db[b]["params"] - db[a]["params"]
    for t in TASKS:
        cells = rows[f"task:{t}:acc_norm:post"]
        want = acc_of("SF", "RR", 4, t) - acc_of("DO-ACP", "RR", 8, t)
        assert math.isclose(float(cells[1][0]["data-delta"]), want, abs_tol=1e-12)
        assert cells[0][0]["data-n"] == str(ITEMS) and cells[0][1].startswith(
            f"{100 * acc_of('DO-ACP', 'RR', 8, t):.2f} ± 2.00"
        )
        assert cells[3][1] == "–"  # the paper's configuration has no per-task score of the grid's tasks


def test_compare_refuses_a_bad_choice(world):
    a, b = _id(world, "DO-ACP|RR|K=8"), _id(world, "SF|RR|K=4")
    nine = "&".join(f"c={i}" for i in range(1, 10))
    for path, code, says in (
        (f"/configs/compare?c={a}", 400, "compare: choose 2 to 8 configurations (got 1)"),
        (f"/configs/compare?c={a}&c={a}", 400, "compare: choose 2 to 8 configurations (got 1)"),
        ("/configs/compare", 400, "compare: choose 2 to 8 configurations (got 0)"),
        (f"/configs/compare?{nine}", 400, "compare: choose 2 to 8 configurations (got 9)"),
        (f"/configs/compare?c={a}&c=x", 400, "c: 'x' is not a configuration id"),
        (f"/configs/compare?c={a}&c=-1", 400, "c: '-1' is not a configuration id"),
        (f"/configs/compare?c={a}&c={b}&sort=K", 400, "unknown query parameter 'sort'"),
        (f"/configs/compare?c={a}&c=999999", 404, "no configuration 999999"),
        (f"/configs/compare?c={a}&c={'9' * 30}", 404, "no configuration 9999"),
    ):
        got, _, body = _get(world["url"], path)
        assert got == code, (path, got, body[:300])
        line = re.search(rb'<p class="error" id="error">(.*?)</p>', body).group(1).decode()
        assert line.replace("&#39;", "'").startswith(says), (path, line)


# ---- 4–5. plots -------------------------------------------------------------------------------------------
def _chart(html: str, section: str) -> ET.Element:
    part = html[html.index(f'<section class="plot" id="{section}">') :]
    part = part[: part.index("</section>")]
    return ET.fromstring(part[part.index("<svg") : part.index("</svg>") + len("</svg>")])


def test_ppl_by_k_has_a_line_per_scoring_and_a_log_axis(world):
    """The lowest PPL per scoring and K over the other axes; a log PPL axis (the grid spans 10× and more);
    K on the grid's values; the teacher dashed; the legend right of the plot; the diverged left out; each
    point titled and linked to its configuration, and listed in the data table below the chart."""
    html = _page(world, f"/sweeps/{GRID}/plots")
    svg = _chart(html, "ppl-by-k")
    assert svg.get("data-y-scale") == "log" and svg.get("data-x-scale") == "log"
    assert svg.get("data-drawn-by", "").startswith("matplotlib ")
    assert legend_outside(svg) == [*SCORINGS, "teacher"]
    assert [s.get("data-series") for s in by_class(svg, "series")] == [*SCORINGS, "teacher"]
    (dashed,) = by_class(svg, "teacher")
    assert dashed.find(f"{SVG}path").get("stroke-dasharray")
    assert texts(svg, "x-tick") == [str(k) for k in KS]
    assert [t.text for g in by_class(svg, "y-label") for t in g.iter(f"{SVG}text")] == [
        "PPL before distillation (log scale)"
    ]
    ticks = [tick_value(t) for t in texts(svg, "y-tick")]
    assert ticks == sorted(ticks) and len(set(ticks)) == len(ticks) >= 2
    best = {}
    for s in SCORINGS:
        for K in KS:
            vals = [(ppl_of(s, g, K), f"{s}|{g}|K={K}") for g in GROUPINGS if math.isfinite(ppl_of(s, g, K))]
            best[f"{s} K={K}"] = min(vals)
    x0, y0, x1, y1 = area(svg)
    seen = {}
    for c in by_class(svg, "point"):
        tip = title(c)
        x, y = point_at(c)
        assert x0 <= x <= x1 and y0 <= y <= y1, tip
        if c.get("data-series") != "teacher":
            name, _, rest = tip.partition(": ")
            seen[name] = rest.split(" ")[0]
            key = best[name][1]
            assert c.get("href") == f"/configs/{_id(world, key)}" and rest.endswith(f": {key})"), (
                tip,
                c.attrib,
            )
    assert seen == {k: fmt_ppl(v) for k, (v, _) in best.items()}
    # a point lower on the chart has the lower PPL (the axis is not upside down)
    ys = {title(c).split(":")[0]: point_at(c)[1] for c in by_class(svg, "point")}
    assert ys["DO-ACP K=8"] > ys["CP K=8"] > ys["SF K=8"]
    assert "Left out: 2 configurations whose PPL is not finite" in html  # the diverged (inf) and nan
    data = _data_table(html, "ppl-by-k")
    assert len(data) == len(best) + 1 and [r[0] for r in data[:3]] == [SCORINGS[0]] * 3
    assert {(r[0], r[1]): r[2] for r in data[:-1]} == {
        tuple(k.split(" K=")): fmt_ppl(v) for k, (v, _) in best.items()
    }
    # filtered to one scoring the range is under 10×: a linear axis
    svg = _chart(_page(world, f"/sweeps/{GRID}/plots?scoring=DO-ACP&grouping=WC"), "ppl-by-k")
    assert svg.get("data-y-scale") == "linear"
    assert legend_outside(svg) == ["DO-ACP"]  # the teacher has no scoring: filtered out


def _data_table(html: str, section: str) -> list[list[str]]:
    """The cells of the data table below a chart."""
    part = html[html.index(f'<details class="chart-data" id="{section}-data">') :]
    part = part[: part.index("</details>")]
    rows = re.findall(r"<tr>(.*?)</tr>", part, re.S)[1:]
    return [[re.sub(r"<[^>]+>", "", c) for c in re.findall(r"<td>(.*?)</td>", r, re.S)] for r in rows]


def test_accuracy_by_parameters_is_a_scatter_by_scoring(world):
    html = _page(world, f"/sweeps/{GRID}/plots")
    svg = _chart(html, "acc-by-params")
    assert svg.get("data-x-scale") == "log"  # 4e5 to 2e7 parameters
    assert legend_outside(svg) == [*SCORINGS, "teacher"]
    assert [g.get("data-series") for g in by_class(svg, "points")] == [*SCORINGS, "teacher"]
    assert [t.text for g in by_class(svg, "y-label") for t in g.iter(f"{SVG}text")] == ["average accuracy %"]
    assert [t.text for g in by_class(svg, "x-label") for t in g.iter(f"{SVG}text")] == [
        "parameters (log scale)"
    ]
    assert not by_class(svg, "series")  # points, not lines
    db = _db(world, "SELECT * FROM results WHERE sweep = :s AND avg_acc IS NOT NULL", s=GRID)
    points = by_class(svg, "point")
    assert len(points) == len(db) > 5
    assert {p.get("href") for p in points} == {f"/configs/{r['config_id']}" for r in db}
    x0, y0, x1, y1 = area(svg)
    ys = {}
    for c in points:
        x, y = point_at(c)
        assert x0 <= x <= x1 and y0 <= y <= y1
        ys[title(c).split(":")[0]] = (x, y)
    assert ys["teacher"][1] < ys["DO-ACP|RR|K=8"][1] < ys["SF|RR|K=2"][1]  # higher accuracy: higher up
    assert ys["teacher"][0] > ys["DO-ACP|RR|K=8"][0] > ys["SF|RR|K=2"][0]  # more parameters: further right
    xt = [tick_value(t) for t in texts(svg, "x-tick")]
    assert len(xt) >= 2 and xt == sorted(xt) and len(set(xt)) == len(xt)
    data = {r[1]: r for r in _data_table(html, "acc-by-params")}
    assert set(data) == {r["config_key"] for r in db}
    for r in db:
        assert data[r["config_key"]][2:] == [f"{r['params']:,.0f}", f"{100 * r['avg_acc']:.2f}"]
    # test_report's sweep has no parameter counts: a sentence instead of an empty chart
    html = _page(world, f"/sweeps/{OWN}/plots")
    assert "No configuration of the rows shown has both a parameter count and an accuracy." in html
    assert 'id="acc-by-params-figure"' not in html


def test_parallel_coordinates_of_the_grid(world):
    html = _page(world, f"/sweeps/{GRID}/plots?kind=moe2dense")
    svg = _chart(html, "parallel")
    assert [t.get("data-axis") for t in by_class(svg, "dim-label")] == [
        "scoring",
        "grouping",
        "K",
        "ppl_pre",
    ]
    assert svg.get("data-y-scale") == "log"
    lines = by_class(svg, "config-line")
    db = {
        str(r["config_id"]): r
        for r in _db(world, "SELECT * FROM results WHERE sweep = :s AND kind = 'moe2dense'", s=GRID)
    }
    finite = {k: r for k, r in db.items() if r["ppl_pre_kind"] == "finite"}
    assert {ln.get("data-config") for ln in lines} == set(finite) and len(lines) == len(finite)
    assert all(ln.get("href") == f"/configs/{ln.get('data-config')}" for ln in lines)
    last_y = {ln.get("data-config"): coordinates(ln)[-1][1] for ln in lines}
    order = sorted(finite, key=lambda k: finite[k]["ppl_pre"])
    assert [last_y[k] for k in order] == sorted(last_y.values(), reverse=True)  # lower PPL, lower down
    picked = {ln.get("data-config") for ln in lines if "picked" in ln.get("class").split()}
    assert picked == {k for k, r in finite.items() if r["selected_for_distill"]} and picked
    cats = [title(t) for t in by_class(svg, "cat-tick")]
    assert cats == [*sorted(SCORINGS), *GROUPINGS, *[str(k) for k in KS]]
    assert "Left out: 2 configurations without a finite PPL" in html
    assert len(legend_outside(svg)) == 5
    ppl_ticks = [tick_value(t) for t in texts(svg, "y-tick")]
    assert len(ppl_ticks) >= 2 and ppl_ticks == sorted(ppl_ticks)
    assert sorted(r[0] for r in _data_table(html, "parallel")) == sorted(
        r["config_key"] for r in finite.values()
    )


# ---- in a browser ---------------------------------------------------------------------------------------
def _violations(driver) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if "Content Security Policy" in e["message"]]


def test_tick_compare_and_download_in_a_browser(world, browser):  # noqa: F811
    """On the results page: the compare button waits for two ticks, submits the ticked ids (in the
    table's order) to the side-by-side page; the CSV link downloads the rows the page shows."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get_log("browser")
    browser.get(f"{world['url']}/sweeps/{GRID}?grouping=RR&sort=ppl_pre")
    button = browser.find_element(By.ID, "compare-button")
    boxes = browser.find_elements(By.CSS_SELECTOR, '#results input[type="checkbox"][name="c"]')
    ids = [b.get_attribute("value") for b in boxes]
    assert len(boxes) == len(browser.find_elements(By.CSS_SELECTOR, "#results tbody tr[data-config]"))
    assert not button.is_enabled()
    boxes[2].click()
    assert not button.is_enabled() and "1 ticked" in browser.find_element(By.ID, "compare-count").text
    boxes[0].click()
    boxes[4].click()
    assert button.is_enabled() and "3 ticked" in browser.find_element(By.ID, "compare-count").text
    button.click()
    WebDriverWait(browser, 20).until(lambda d: "/configs/compare" in d.current_url)
    q = urllib.parse.parse_qs(urllib.parse.urlsplit(browser.current_url).query)
    assert q == {"c": [ids[0], ids[2], ids[4]]}
    heads = [
        h.get_attribute("data-config") for h in browser.find_elements(By.CSS_SELECTOR, "th[data-config]")
    ]
    assert heads == [ids[0], ids[2], ids[4]]
    deltas = browser.find_elements(By.CSS_SELECTOR, 'tr[data-field="ppl_pre"] .delta')
    assert len(deltas) == 2 and all(
        d.text.startswith("Δ +") for d in deltas
    )  # sorted by PPL: the first is lowest
    # the CSV of the page's rows, fetched by the page's own link
    browser.get(f"{world['url']}/sweeps/{GRID}?grouping=RR&sort=ppl_pre")
    href = browser.find_element(By.ID, "csv-link").get_attribute("href")
    assert href.endswith(f"/sweeps/{GRID}/results.csv?grouping=RR&sort=ppl_pre")
    text = browser.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "fetch(arguments[0]).then(r => r.text()).then(done, e => done('failed: ' + e));",
        href,
    )
    got = list(csv.reader(io.StringIO(text)))
    assert [r[0] for r in got[1:]] == ids
    assert not _violations(browser)


def test_plots_laid_out_in_a_browser(world, browser):  # noqa: F811
    """Laid out by Chromium under the pages' policy: every chart's legend is beside its plot area, not on
    it, the tick labels differ, and the charts fit their figure."""
    browser.get_log("browser")
    browser.get(f"{world['url']}/sweeps/{GRID}/plots")
    got = browser.execute_script(
        "const box = e => { const b = e.getBBox(); return [b.x, b.y, b.x + b.width, b.y + b.height]; };"
        "return [...document.querySelectorAll('svg.chart')].map(s => ({"
        " cls: s.getAttribute('class'), area: box(s.querySelector('.plot-area')),"
        " legend: box(s.querySelector('.legend')),"
        " ticks: [...s.querySelectorAll('.y-tick')].map(t => t.textContent),"
        " width: s.getBoundingClientRect().width}));"
    )
    assert [g["cls"] for g in got] == ["chart ppl-by-k", "chart acc-by-params", "chart parallel"]
    for g in got:
        a, lg = g["area"], g["legend"]
        assert lg[0] >= a[2] or lg[2] <= a[0] or lg[1] >= a[3] or lg[3] <= a[1], g  # no overlap
        assert len(g["ticks"]) >= 2 and len(set(g["ticks"])) == len(g["ticks"]), g
        assert g["width"] > 300
    assert not _violations(browser)
    assert browser.find_element("css selector", "nav.tabs a.on").text == "plots"


def test_plots_are_visible_in_a_browser(world, browser):  # noqa: F811
    """Each chart as Chromium paints it (a screenshot of its element): not blank, every series' colour on it;
    and a point's title is the hover text of what the pointer is over."""
    from selenium.webdriver.common.by import By

    from analysis.palette import scoring_color

    browser.get(f"{world['url']}/sweeps/{GRID}/plots")
    colours = [scoring_color(s) for s in SCORINGS]
    for name, want in (
        ("ppl-by-k", colours),
        ("acc-by-params", colours),
        ("parallel", ["#1a7f37", "#c44e52"]),
    ):
        el = browser.find_element(By.CSS_SELECTOR, f"svg.chart.{name}")
        assert el.is_displayed() and el.size["width"] > 300 and el.size["height"] > 150, (name, el.size)
        assert_drawn(el.screenshot_as_png, want, name)
    hovered = browser.execute_script(
        "const p = document.querySelector('svg.ppl-by-k .point'); p.scrollIntoView({block: 'center'});"
        "const b = p.getBoundingClientRect();"
        "const e = document.elementFromPoint(b.x + b.width / 2, b.y + b.height / 2);"
        "return e && e.closest('.point') ? e.closest('.point').querySelector('title').textContent : e;"
    )
    assert hovered.startswith(f"{SCORINGS[0]} K={KS[0]}: "), hovered


# ---- read-only, guarded -------------------------------------------------------------------------------------
def _new_paths(world) -> list[str]:
    a, b = _id(world, "DO-ACP|RR|K=8"), _id(world, "SF|RR|K=4")
    return [
        f"/sweeps/{GRID}/results.csv",
        f"/sweeps/{GRID}/plots",
        f"/configs/compare?c={a}&c={b}",
        f"/sweeps/{GRID}",
    ]


PAYLOADS = ["' OR '1'='1", "x'; DROP TABLE jobs; --", "1 UNION SELECT key, key FROM jobs --", '" OR 1=1 --']


def test_the_new_pages_write_nothing_and_keep_the_policy(world):
    """GET only (anything else 405), the security headers on every answer, no inline script or style,
    injection through every parameter answered with a page or a one-line 400/404, the database unchanged."""
    from dashboard.data import FILTER_AXES

    before = snapshot(world["path"])
    for path in _new_paths(world):
        for method in ("POST", "PUT", "PATCH", "DELETE"):
            assert _get(world["url"], path, method)[0] == 405, (method, path)
        code, headers, body = _get(world["url"], path)
        assert code == 200
        assert "'unsafe-inline'" not in headers["content-security-policy"]
        assert headers["x-content-type-options"] == "nosniff"
        if path.endswith(".csv"):
            continue
        text = body.decode()
        assert "<style" not in text and " style=" not in text and not re.search(r"\son[a-z]+=", text)
        assert all(src.startswith("/static/") for src in re.findall(r'<script src="([^"]*)"', text))
        assert "<script>" not in text
    for path in (f"/sweeps/{GRID}/results.csv", f"/sweeps/{GRID}/plots"):
        for p in ("sort", "order", "selected", "q", *FILTER_AXES):
            for attack in PAYLOADS:
                code, _, body = _get(world["url"], f"{path}?{urllib.parse.urlencode({p: attack})}")
                assert code in (200, 400), (path, p, attack, code)
                if code == 200 and p in ("q", "scoring", "grouping", "kind", "model"):
                    if path.endswith(".csv"):
                        assert body.count(b"\n") == 1, (path, p, attack)  # the header only
                    else:
                        assert b"data-config=" not in body, (path, p, attack)
    for attack in PAYLOADS:
        code, _, _ = _get(
            world["url"], f"/configs/compare?{urllib.parse.urlencode({'c': [attack, '1']}, doseq=True)}"
        )
        assert code == 400
    assert snapshot(world["path"]) == before


def test_the_new_pages_over_postgresql(pg_database):
    """The CSV, the side-by-side page and the plots over PostgreSQL (read-only transactions): the same
    exact values (integers as integers, `inf` spelled out), the same charts."""
    url = pg_database("explore")
    store = Store(url)
    build_own_sweep(store)
    _grid(store)
    ids = [
        r[0]
        for r in store.query(
            "SELECT config_id FROM results WHERE sweep = :s ORDER BY config_id", {"s": GRID}
        )[1]
    ]
    srv = Background(Store(url, read_only=True)).start()
    try:
        code, _, body = _get(srv.url, f"/sweeps/{GRID}/results.csv?grouping=WC&sort=ppl_pre")
        assert code == 200
        rows = list(csv.DictReader(io.StringIO(body.decode())))
        by_key = {r["config_key"]: r for r in rows}
        assert by_key[DIVERGED]["ppl_pre"] == "inf" and by_key[UNDEFINED]["ppl_pre"] == "nan"
        assert by_key["DO-ACP|WC|K=8"]["ppl_pre_n"] == str(WINDOWS)
        assert by_key["DO-ACP|WC|K=8"]["avg_acc_n"] == str(2 * ITEMS)
        assert float(by_key["DO-ACP|WC|K=8"]["ppl_pre"]) == 22.0
        code, _, body = _get(srv.url, f"/configs/compare?c={ids[0]}&c={ids[1]}&c={ids[-1]}")
        assert code == 200 and b"data-delta=" in body and b"hellaswag acc_norm" in body
        html = _get(srv.url, f"/sweeps/{GRID}/plots")[2].decode()
        assert _chart(html, "ppl-by-k").get("data-y-scale") == "log"
        assert len(by_class(_chart(html, "acc-by-params"), "point")) > 5
        assert len(by_class(_chart(html, "parallel"), "config-line")) == len(ids) - 2
    finally:
        srv.stop()
