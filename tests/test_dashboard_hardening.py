"""The dashboard against a hostile page and a careless URL: it answers only to its own host names (DNS
rebinding), sends a Content-Security-Policy its pages keep (no inline script or style), refuses oversized
numbers and query strings with a one-line 400, and `moesweep serve` leaves no temporary folder behind
when it is stopped. Plus what a user sees: captions escaped once, "vs. paper" only comparing like with
like, and a readable validation-CE chart (distinct ticks, legend outside the plot, axis labels)."""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import xml.etree.ElementTree as ET
from html.parser import HTMLParser
from pathlib import Path

import pytest
from sqlalchemy import text
from test_dashboard_charts import (
    SVG,
    area,
    assert_drawn,
    by_class,
    coordinates,
    legend_outside,
    point_at,
    texts,
    title,
)
from test_report import OWN, _key, _run, build_own_sweep

from analysis.reference import reference_sweeps
from dashboard.server import Background
from db.store import Store

ROOT = Path(__file__).resolve().parent.parent
ODD_MODEL = "tiny & <moe>"  # escaped in HTML, \& in LaTeX: shows a caption escaped twice
PAPER_MODEL = "Qwen3-30B-A3B"
FLAT = "flat-curve"  # a sweep whose validation CE moves in the third decimal (5.351 … 5.355)


# ---- the databases ---------------------------------------------------------------------------------------
def _flat_curve_sweep(store: Store) -> None:
    sid = store.upsert_sweep(FLAT, spec_yaml=f"name: {FLAT}", description="a nearly flat curve")
    ids = store.upsert_configs(
        sid,
        [
            {
                "config_key": "DO-ACP|RR|uniform|K=4",
                "model": "tiny-moe",
                "kind": "moe2dense",
                "scoring": "DO-ACP",
                "grouping": "RR",
                "dp_scaling": "uniform",
                "K": 4,
                "top_k": 2,
            }
        ],
    )
    metrics = [
        {"name": "val_ce", "stage": "train", "who": who, "step": step, "value": v}
        for who, values in (("student", (5.3548, 5.3531, 5.3512)), ("teacher", (5.3520, 5.3520, 5.3520)))
        for step, v in zip((0, 100, 200), values, strict=True)
    ]
    job = _run(store, sid, "distill", _key("distill", FLAT), {"metrics": metrics})
    store.link([(ids["DO-ACP|RR|uniform|K=4"], "distill", job)])


def _database(path: Path, model: str) -> str:
    """The paper's numbers, test_report's finished sweep with its model renamed, and the flat curve."""
    url = f"sqlite:///{path}"
    store = Store(url)
    store.import_reference(reference_sweeps())
    build_own_sweep(store)
    with store.engine.begin() as c:
        c.execute(
            text(
                "UPDATE configurations SET model = :m WHERE model = 'tiny-moe' AND sweep_id = "
                "(SELECT id FROM sweeps WHERE name = :s)"
            ),
            {"m": model, "s": OWN},
        )
    _flat_curve_sweep(store)
    store.engine.dispose()
    return url


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The dashboard over a sweep whose model is not the paper's (and has HTML and LaTeX specials)."""
    url = _database(tmp_path_factory.mktemp("hardening") / "odd.db", ODD_MODEL)
    srv = Background(Store(url, read_only=True)).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def same_model_server(tmp_path_factory):
    """The same sweep, its model named as the paper's."""
    url = _database(tmp_path_factory.mktemp("hardening") / "same.db", PAPER_MODEL)
    srv = Background(Store(url, read_only=True)).start()
    yield srv
    srv.stop()


def _get(base: str, path: str, host: str | None = None, method: str = "GET"):
    """(status, headers with lower-case names, body) of one request, with the Host header of our choice."""
    u = urllib.parse.urlsplit(base)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    try:
        c.putrequest(method, path, skip_host=host is not None)
        if host is not None:
            c.putheader("Host", host)
        c.endheaders()
        r = c.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        c.close()


class _Text(HTMLParser):
    """The text of the elements a page has under some tags (what a visitor reads), and the attributes
    of every element."""

    def __init__(self, tags: set[str]) -> None:
        super().__init__(convert_charrefs=True)
        self.tags, self.open, self.found, self.attrs = tags, [], [], []

    def handle_starttag(self, tag, attrs):
        self.attrs.append((tag, dict(attrs)))
        if tag in self.tags:
            self.open.append([tag, ""])

    def handle_endtag(self, tag):
        if self.open and self.open[-1][0] == tag:
            self.found.append(tuple(self.open.pop()))

    def handle_data(self, data):
        for o in self.open:
            o[1] += data


def _texts(body: bytes, *tags: str) -> list[tuple[str, str]]:
    p = _Text(set(tags))
    p.feed(body.decode())
    return p.found


def _error_line(body: bytes) -> str:
    (line,) = [t for tag, t in _texts(body, "p") if t and tag == "p" and "all sweeps" not in t][:1]
    return line


# ---- DNS rebinding: the Host header --------------------------------------------------------------------
def test_a_foreign_host_name_is_refused(server):
    """A page of evil.example whose name was rebound to 127.0.0.1 sends `Host: evil.example:PORT`: it
    gets a short plain 400 and nothing from the database, on every path; the loopback names get in."""
    port = urllib.parse.urlsplit(server.url).port
    for path in (
        "/",
        f"/sweeps/{OWN}",
        "/api/sweeps",
        "/static/style.css",
        "/jobs/x",
        f"/sweeps/{OWN}/report",
    ):
        for host in (f"evil.example:{port}", "evil.example", f"127.0.0.1.evil.example:{port}", ""):
            code, headers, body = _get(server.url, path, host=host)
            assert code == 400, (path, host, code)
            assert headers["content-type"].startswith("text/plain"), headers
            assert len(body.decode().strip().splitlines()) == 1 and len(body) < 300, body
            assert OWN.encode() not in body and b"paper:" not in body
    for host in (f"localhost:{port}", f"LOCALHOST:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "localhost"):
        code, _, body = _get(server.url, "/", host=host)
        assert code == 200 and OWN.encode() in body, (host, code)


def test_trusted_hosts_follow_the_listening_address():
    from dashboard.server import trusted_hosts

    loopback = {"localhost", "127.0.0.1", "[::1]"}
    assert trusted_hosts("127.0.0.1") == loopback
    assert trusted_hosts("::1") == loopback
    assert trusted_hosts("127.0.0.1", "localhost") == loopback
    lan = trusted_hosts("192.0.2.7")
    assert lan is not None and {"192.0.2.7", *loopback} <= lan and "evil.example" not in lan
    assert "[2001:db8::7]" in trusted_hosts("2001:db8::7")
    assert "dash.example" in trusted_hosts("192.0.2.7", "dash.example")
    assert trusted_hosts("0.0.0.0") is None and trusted_hosts("::") is None  # every interface: any name


# ---- headers and the pages' Content-Security-Policy ---------------------------------------------------------
def _paths(srv) -> list[str]:
    st = Store(srv.server.config.app.state.store.url, read_only=True)
    (cid,) = st.query("SELECT config_id FROM results WHERE sweep = :s LIMIT 1", {"s": FLAT})[1][0]
    (key,) = st.query("SELECT key FROM jobs LIMIT 1")[1][0]
    return [
        "/",
        f"/sweeps/{OWN}",
        f"/sweeps/{OWN}/jobs",
        f"/sweeps/{OWN}/report",
        f"/sweeps/{OWN}/compare",
        f"/configs/{cid}",
        f"/jobs/{key}",
        "/sweeps/nope",
    ]


def test_every_response_carries_the_security_headers(server):
    code, _, body = _get(server.url, f"/sweeps/{OWN}/report")
    assert code == 200
    figure = re.search(rb'<img src="([^"]+)"', body).group(1).decode()
    port = urllib.parse.urlsplit(server.url).port
    answers = [
        *[(p, "GET", None) for p in _paths(server)],
        (f"/sweeps/{OWN}?sort=colour", "GET", None),  # 400
        ("/static/style.css", "GET", None),
        ("/static/live.js", "GET", None),
        ("/api/sweeps", "GET", None),
        (f"/api/sweeps/{OWN}/progress", "GET", None),
        (figure, "GET", None),
        ("/", "POST", None),  # 405
        ("/", "GET", f"evil.example:{port}"),  # the refused host
    ]
    for path, method, host in answers:
        code, h, _ = _get(server.url, path, host=host, method=method)
        assert code in (200, 400, 404, 405), (path, code)
        csp = {d.strip().split(" ")[0]: d.strip() for d in h.get("content-security-policy", "").split(";")}
        assert csp.get("default-src") == "default-src 'self'", (path, h)
        assert csp.get("frame-ancestors") == "frame-ancestors 'none'", (path, h)
        assert "'unsafe-inline'" not in h["content-security-policy"], h
        assert h.get("x-content-type-options") == "nosniff", (path, h)
        assert h.get("referrer-policy") == "no-referrer", (path, h)


def test_pages_hold_no_inline_script_style_or_handler(server):
    """What the policy forbids is not in the pages: <script> without src, <style>, style="…", on…="…"."""
    for path in _paths(server):
        _, _, body = _get(server.url, path)
        p = _Text(set())
        p.feed(body.decode())
        for tag, attrs in p.attrs:
            assert tag != "style", path
            assert tag != "script" or attrs.get("src", "").startswith("/static/"), (path, attrs)
            assert "style" not in attrs, (path, tag, attrs)
            assert not [a for a in attrs if a.startswith("on")], (path, tag, attrs)


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium through Selenium (as test_serve), with the console log readable."""
    chrome = next(
        (shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None
    )
    driver_path = shutil.which("chromedriver")
    if chrome is None or driver_path is None:
        pytest.fail(
            "the browser tests need Chromium and its driver: apt-get install chromium chromium-driver",
            pytrace=False,
        )
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    opts = Options()
    opts.binary_location = chrome
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        opts.add_argument(a)
    opts.add_argument("--window-size=1360,900")
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    d = webdriver.Chrome(service=Service(executable_path=driver_path), options=opts)
    d.set_page_load_timeout(60)
    yield d
    d.quit()


def test_pages_work_under_their_policy_in_a_browser(server, browser):
    """Chromium enforces the policy: no page logs a violation, the progress bars have their widths, and a
    filter's select still submits its form on change (the handler lives in a static script now)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    browser.get_log("browser")
    for path in _paths(server):
        browser.get(server.url + path)
        assert browser.title.endswith("· moesweep"), browser.title
    logged = [e["message"] for e in browser.get_log("browser")]
    assert not [m for m in logged if "Content Security Policy" in m], logged
    browser.get(server.url + f"/sweeps/{OWN}")
    widths = browser.execute_script(
        "return [...document.querySelectorAll('.bar i')].map(i => i.getBoundingClientRect().width);"
    )
    assert widths and all(w > 0 for w in widths), widths
    Select(browser.find_element(By.NAME, "scoring")).select_by_visible_text("CP")
    WebDriverWait(browser, 20).until(lambda d: "scoring=CP" in d.current_url)
    assert not [e for e in browser.get_log("browser") if "Content Security Policy" in e["message"]]


# ---- oversized numbers and query strings -------------------------------------------------------------------
def test_oversized_numbers_and_query_strings_are_one_line_400s(server):
    huge = "99999999999999999999999"
    for path, says in (
        (f"/sweeps/{OWN}?K={huge}", "K: '99999999999999999999999' is out of range"),
        (f"/sweeps/{OWN}?K=-1", "K: '-1' is out of range"),
        (f"/sweeps/{OWN}?teacher_top_k={huge}", "teacher_top_k: '99999999999999999999999' is out"),
        (f"/sweeps/{OWN}?q={'a' * 100_000}", "query string too long"),
        (f"/sweeps/{OWN}/jobs?stage={'a' * 100_000}", "query string too long"),
        (f"/sweeps/{OWN}/report?x={'a' * 100_000}", "query string too long"),
    ):
        code, _, body = _get(server.url, path)
        assert code == 400, (path[:80], code, body[:200])
        line = _error_line(body)
        assert line.startswith(says) and "\n" not in line.strip() and len(line) < 200, line
    code, _, body = _get(server.url, f"/api/sweeps/{OWN}/progress?x={'a' * 100_000}")
    assert code == 400 and json.loads(body)["error"].startswith("query string too long")
    code, _, body = _get(server.url, f"/configs/{huge}")
    assert code == 404 and _error_line(body).startswith("no configuration 999999"), body[:300]
    code, _, body = _get(server.url, f"/sweeps/{OWN}?q={'a' * 200}&K=4")  # long but fine
    assert code == 200


# ---- the temporary folder of `serve` ----------------------------------------------------------------------
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_serve_removes_its_temporary_folder_when_stopped(server, tmp_path, sig):
    """`moesweep serve` renders reports into $TMPDIR/moesweep-serve-*; Ctrl-C (or a SIGTERM) removes it."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    db = server.server.config.app.state.store.url
    env = {**os.environ, "TMPDIR": str(tmp), "COLUMNS": "400"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "orchestrator.cli", "serve", "--db", db, "--port", "0"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        seen, url = [], None
        while url is None:
            line = proc.stderr.readline()
            assert line, ("serve ended before it listened", proc.wait(30), seen)
            seen.append(line)
            m = re.search(r"moesweep dashboard on (http://\S+?)/ ", line)
            url = m and m.group(1)
        code, _, _ = _get(url, f"/sweeps/{OWN}/report")
        assert code == 200
        assert list(tmp.glob("moesweep-serve-*")), list(tmp.iterdir())  # the report was rendered there
        proc.send_signal(sig)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert not list(tmp.glob("moesweep-serve-*")), list(tmp.iterdir())


def test_a_background_server_removes_its_reports_when_stopped(tmp_path):
    url = f"sqlite:///{tmp_path / 'r.db'}"
    store = Store(url)
    build_own_sweep(store)
    srv = Background(Store(url, read_only=True)).start()
    try:
        assert _get(srv.url, f"/sweeps/{OWN}/report")[0] == 200
        root = srv.server.config.app.state.reports.root
        assert root.is_dir()
    finally:
        srv.stop()
    deadline = time.monotonic() + 10
    while root.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not root.exists()


# ---- captions ----------------------------------------------------------------------------------------------
def test_captions_are_escaped_once(server):
    """The model's name holds `&` and `<`: captions of tables and figures read it as written (no
    `&amp;` or `&lt;` shown to the visitor)."""
    code, _, body = _get(server.url, f"/sweeps/{OWN}/report")
    assert code == 200
    shown = _texts(body, "caption", "figcaption", "p")
    captions = [t for tag, t in shown if tag in ("caption", "figcaption")]
    assert captions and any(ODD_MODEL in t for tag, t in shown if tag == "caption"), captions
    assert any(ODD_MODEL in t for tag, t in shown if tag == "figcaption"), captions
    for _, t in shown:
        assert "&amp;" not in t and "&lt;" not in t and "&gt;" not in t, t


# ---- vs. paper: like with like ----------------------------------------------------------------------------
def test_vs_paper_says_when_the_models_differ(server):
    code, _, body = _get(server.url, f"/sweeps/{OWN}/compare")
    assert code == 200
    said = " ".join(t for _, t in _texts(body, "p"))
    assert f"Your model: {ODD_MODEL}; the paper's: {PAPER_MODEL}" in said, said
    assert "not the same model" in said and "not a replication check" in said
    heads = [t for _, t in _texts(body, "th")]
    assert not [h for h in heads if "Δ" in h], heads  # no difference presented as comparable
    assert not re.search(rb"<td class=\"num\">[+-]\d", body)  # nor any signed difference in a cell
    code, _, body = _get(server.url, f"/sweeps/{OWN}/report")
    said = " ".join(t for _, t in _texts(body, "p"))
    assert f"Your model: {ODD_MODEL}; the paper's: {PAPER_MODEL}" in said, said


def test_vs_paper_compares_the_same_model(same_model_server):
    code, _, body = _get(same_model_server.url, f"/sweeps/{OWN}/compare")
    assert code == 200
    said = " ".join(t for _, t in _texts(body, "p"))
    assert "not the same model" not in said
    heads = [t for _, t in _texts(body, "th")]
    assert "Δ avg pp" in heads and "Δ pp" in heads, heads
    assert re.search(rb"<td class=\"num\">[+-]\d+\.\d\d</td>", body)


# ---- the configuration page's chart -----------------------------------------------------------------------
def _svg(curves) -> ET.Element:
    from dashboard.charts import curve_chart

    return ET.fromstring(str(curve_chart(curves).svg))


@pytest.mark.parametrize(
    "curves",
    [
        {"student": [(0, 5.3548), (100, 5.3531), (200, 5.3512)], "teacher": [(0, 5.352), (200, 5.352)]},
        {"student": [(0, 5.35), (10, 5.35)]},  # flat: no range at all
        {"student": [(0, 0.000123), (5, 0.000124)]},
        {"student": [(0, 12345.0), (5, 12346.5)]},
        {"student": [(0, 4.0), (30, 3.0)], "teacher": [(0, 2.5), (30, 2.5)]},
    ],
    ids=["third-decimal", "flat", "tiny", "large", "wide"],
)
def test_chart_ticks_are_distinct_and_span_the_data(curves):
    """Whatever the range (a third decimal, none, tiny, large), at least two distinct tick labels in
    plain notation (no offset or power beside the axis), in order, reaching into the data's range from
    both sides, and every point inside the plot area, a larger value higher up."""
    svg = _svg(curves)
    x0, y0, x1, y1 = area(svg)
    for axis, values in (
        ("y", [v for line in curves.values() for _, v in line]),
        ("x", [s for line in curves.values() for s, _ in line]),
    ):
        labels = texts(svg, f"{axis}-tick")
        assert len(labels) >= 2 and len(set(labels)) == len(labels), (axis, labels)
        nums = [float(t.replace("−", "-")) for t in labels]
        assert nums == sorted(nums), labels
        assert nums[0] <= max(values) and nums[-1] >= min(values), (axis, labels, values)
    points = by_class(svg, "point")
    assert len(points) == sum(len(v) for v in curves.values())
    for p in points:
        x, y = point_at(p)
        assert x0 <= x <= x1 and y0 <= y <= y1, (title(p), (x, y), (x0, y0, x1, y1))
    student = {
        int(title(p).split()[2].rstrip(":")): point_at(p)[1]
        for p in points
        if p.get("data-series") == "student"
    }
    values = dict(curves["student"])
    for a in student:
        for b in student:
            if values[a] > values[b]:
                assert student[a] < student[b]  # higher up


def test_chart_has_axis_labels_and_a_legend_outside_the_plot():
    curves = {"student": [(0, 5.3548), (100, 5.3531), (200, 5.3512)], "teacher": [(0, 5.352), (200, 5.352)]}
    svg = _svg(curves)
    x0, y0, x1, y1 = area(svg)
    assert sorted(legend_outside(svg)) == ["student", "teacher"]  # right of the plot area
    assert [t.text for g in by_class(svg, "x-label") for t in g.iter(f"{SVG}text")] == ["distillation step"]
    assert [t.text for g in by_class(svg, "y-label") for t in g.iter(f"{SVG}text")] == [
        "validation cross-entropy"
    ]
    lines = by_class(svg, "series")
    assert [ln.get("data-series") for ln in lines] == ["student", "teacher"]
    for line in lines:
        for x, y in coordinates(line):
            assert x0 <= x <= x1 and y0 <= y <= y1, (x, y)
    assert [title(p) for p in by_class(svg, "point")][:3] == [
        "student step 0: 5.3548",
        "student step 100: 5.3531",
        "student step 200: 5.3512",
    ]


def test_chart_on_the_configuration_page_in_a_browser(server, browser):
    """Laid out by Chromium: the y tick labels differ, the legend's box does not meet the plot's, and
    the axis labels are there."""
    st = Store(server.server.config.app.state.store.url, read_only=True)
    (cid,) = st.query("SELECT config_id FROM results WHERE sweep = :s LIMIT 1", {"s": FLAT})[1][0]
    browser.get(f"{server.url}/configs/{cid}")
    got = browser.execute_script(
        "const s = document.querySelector('svg.curve');"
        "const box = e => { const b = e.getBBox(); return [b.x, b.y, b.x + b.width, b.y + b.height]; };"
        "return {ticks: [...s.querySelectorAll('.y-tick')].map(t => t.textContent),"
        " area: box(s.querySelector('.plot-area')), legend: box(s.querySelector('.legend')),"
        " series: [...s.querySelectorAll('.series')].map(box),"
        " labels: [...s.querySelectorAll('.x-label, .y-label')].map(t => t.textContent)};"
    )
    assert len(got["ticks"]) >= 2 and len(set(got["ticks"])) == len(got["ticks"]), got
    a, g = got["area"], got["legend"]
    assert g[0] >= a[2] or g[2] <= a[0] or g[1] >= a[3] or g[3] <= a[1], got  # no overlap
    for s in got["series"]:
        assert a[0] - 1 <= s[0] and s[2] <= a[2] + 1 and a[1] - 1 <= s[1] and s[3] <= a[3] + 1, got
    assert got["labels"] == ["distillation step", "validation cross-entropy"], got
    chart = browser.find_element("css selector", "svg.curve")
    assert_drawn(chart.screenshot_as_png, ["#1f6feb", "#d1242f"], "curve")  # student and teacher drawn
    rows = browser.find_elements("css selector", "#curve-data tbody tr")
    assert len(rows) == 6  # the data table below the chart: three steps of the student and of the teacher
