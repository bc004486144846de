"""`moesweep serve` end to end: the dashboard on a free loopback port over a database holding a finished
sweep (tiny-synth, test_report's records), a sweep being launched (fake stages, held on a gate) and the
paper's reference data; every page opened in headless Chromium (Debian's chromium + chromedriver through
Selenium), checked and screenshotted. Plus: injection through every parameter, no write path, one-line
errors, and `moesweep sweeps` listing the database's sweeps."""

from __future__ import annotations

import io
import json
import os
import shutil
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from rich.console import Console
from sqlalchemy import event
from test_readonly import snapshot
from test_report import OWN, build_own_sweep
from typer.testing import CliRunner

from analysis.reference import reference_sweeps
from dashboard.server import Background
from db.store import Store
from orchestrator.cli import app
from orchestrator.execute import SerialExecutor
from orchestrator.launch import launch
from orchestrator.spec import load_spec

HERE = Path(__file__).parent
RUNNING = "fake"
SHOTS = os.environ.get("MOESWEEP_SCREENSHOTS")  # also copy the screenshots there (docs/dashboard.png)


# ---- the database: a finished sweep, a running one, the paper's numbers -----------------------------------
class Gate:
    """Holds the launch's first conversion until the test opens its page: convert jobs stay pending."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()


def _fake_stages(mp: pytest.MonkeyPatch, gate: Gate) -> None:
    def calibrate(p, cache, progress):
        return {"outputs": {"stats": "fake"}}

    def convert(p, cache, progress):
        q = p["params"]
        print(f"converting {q['scoring']} K={q['K']}")  # goes to the job's log
        gate.entered.set()
        assert gate.release.wait(120), "the test never released the gate"
        if q["scoring"] == "CP" and q["K"] == 4:
            raise ValueError("boom: a deliberately failing method")
        return {
            "outputs": {"plan_key": f"{q['scoring']}|{q.get('grouping')}|{q['K']}"},
            "plan_rows": [
                {
                    "layer": 0,
                    "expert": e,
                    "score": 1.0 / (e + 1),
                    "selected_rank": e,
                    "group_idx": e % 2,
                    "merge_weight": 0.5,
                    "alpha": 0.5,
                }
                for e in range(q["K"])
            ],
        }

    def ppl_pre(p, cache, progress):
        v = 20.0 + len(json.dumps(p["params"]["student"])) % 7
        return {
            "outputs": {"ppl": v},
            "metrics": [{"name": "ppl", "stage": "pre", "value": v, "n_tokens": 512}],
        }

    def distill(p, cache, progress):
        return {
            "outputs": {"path": "nowhere"},
            "metrics": [
                {"name": "val_ce", "stage": "train", "who": "student", "step": s, "value": 4.0 - s / 4}
                for s in (0, 2, 4)
            ],
        }

    def evaluate(p, cache, progress):
        return {
            "outputs": {},
            "metrics": [
                {"name": "ppl", "stage": "post", "value": 9.0, "n_tokens": 512},
                {"name": "acc", "stage": "post", "task": "t", "value": 0.4, "total": 100, "headline": 1},
            ],
        }

    for name, fn in dict(
        calibrate=calibrate, convert=convert, ppl_pre=ppl_pre, distill=distill, evaluate=evaluate
    ).items():
        mp.setattr(f"workers.run.{name}.stage_{name}", fn)


def _fake_sweep(folder: Path) -> Path:
    from transformers import Qwen3MoeConfig

    teacher = folder / "teacher"
    Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=16,
        moe_intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
    ).save_pretrained(teacher)
    f = folder / "fake.yaml"
    f.write_text(
        (HERE / "sweeps" / "fake.yaml")
        .read_text()
        .replace("fake/teacher", str(teacher))
        .replace("execution: {retries: 1}", "execution: {retries: 0}")
    )
    return f


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The database, the launch held at its gate (in a thread), the dashboard (in a thread)."""
    folder = tmp_path_factory.mktemp("serve")
    url = f"sqlite:///{folder / 'r.db'}"
    store = Store(url)
    store.import_reference(reference_sweeps())
    build_own_sweep(store)
    gate = Gate()
    outcome: dict = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MOESWEEP_HOME", str(folder / "home"))
        _fake_stages(mp, gate)
        spec, path, text = load_spec(str(_fake_sweep(folder)))

        def run() -> None:
            try:
                outcome["code"] = launch(
                    spec,
                    text,
                    Store(url),
                    SerialExecutor(),
                    console=Console(quiet=True),
                    show_progress=False,
                    path=str(path),
                )
            except BaseException as e:  # reported by the test that waits for it
                outcome["error"] = e

        thread = threading.Thread(target=run, name="fake-launch", daemon=True)
        thread.start()
        assert gate.entered.wait(60), outcome
        server = Background(Store(url, read_only=True)).start()
        try:
            yield {
                "url": server.url,
                "db": url,
                "path": folder / "r.db",
                "gate": gate,
                "launch": thread,
                "outcome": outcome,
                "store": store,
                "server": server,
            }
        finally:
            gate.release.set()
            thread.join(60)
            server.stop()


@pytest.fixture(scope="module")
def browser(world):
    """Headless Chromium driven by Selenium, offline: Debian's chromium and chromedriver."""
    chrome = next(
        (shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None
    )
    driver_path = shutil.which("chromedriver")
    if chrome is None or driver_path is None:
        pytest.fail(
            "the browser tests need Chromium and its driver: apt-get install chromium chromium-driver "
            "(as .ci/run does)",
            pytrace=False,
        )
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    opts = Options()
    opts.binary_location = chrome
    for a in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1360,900",
        "--disable-extensions",
        "--no-first-run",
    ):
        opts.add_argument(a)
    d = webdriver.Chrome(service=Service(executable_path=driver_path), options=opts)
    d.set_page_load_timeout(60)
    yield d
    d.quit()


def _shot(driver, tmp_path: Path, name: str) -> Path:
    path = tmp_path / f"{name}.png"
    assert driver.save_screenshot(str(path)) and path.stat().st_size > 5000
    if SHOTS:
        Path(SHOTS).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(SHOTS) / path.name)
    return path


def _open(driver, world, path: str) -> None:
    driver.get(world["url"] + path)
    assert driver.title.endswith("· moesweep"), driver.title


def _texts(driver, css: str) -> list[str]:
    from selenium.webdriver.common.by import By

    return [e.text for e in driver.find_elements(By.CSS_SELECTOR, css)]


# ---- the pages in a browser ----------------------------------------------------------------------------
def test_live_progress_without_reload(world, browser, tmp_path):
    """A jobs page open during the launch: its held conversion runs, the rest are pending; once the gate
    opens they turn succeeded (and one failed) in place, on the same page (no reload)."""
    from selenium.webdriver.support.ui import WebDriverWait

    _open(browser, world, f"/sweeps/{RUNNING}/jobs")
    browser.execute_script("window.__sameDocument = 'yes';")
    statuses = dict(
        browser.execute_script(
            "return [...document.querySelectorAll('tr[data-job]')].map(r => "
            "[r.getAttribute('data-job'), r.querySelector('.status').textContent]);"
        )
    )
    assert "running" in statuses.values() and "pending" in statuses.values(), statuses
    pending = [k for k, s in statuses.items() if s == "pending"]
    _shot(browser, tmp_path, "jobs_running")
    assert _texts(browser, "[data-status-of]")[0] == "running"
    world["gate"].release.set()
    world["launch"].join(60)
    assert world["outcome"].get("code") == 1, world["outcome"]  # the failing method fails the launch

    def settled(d) -> bool:
        got = dict(
            d.execute_script(
                "return [...document.querySelectorAll('tr[data-job]')].map(r => "
                "[r.getAttribute('data-job'), r.querySelector('.status').textContent]);"
            )
        )
        return all(got.get(k) in ("succeeded", "failed") for k in pending) and len(got) > len(statuses)

    WebDriverWait(browser, 30, poll_frequency=0.2).until(settled)
    assert browser.execute_script("return window.__sameDocument;") == "yes"  # updated in place, not reloaded
    db = dict(
        world["store"].query(
            "SELECT j.key, j.status FROM jobs j JOIN sweep_jobs sj ON sj.job_id = j.id "
            "JOIN sweeps s ON s.id = sj.sweep_id WHERE s.name = :s",
            {"s": RUNNING},
        )[1]
    )

    def shown(d) -> dict:
        return dict(
            d.execute_script(
                "return [...document.querySelectorAll('tr[data-job]')].map(r => "
                "[r.getAttribute('data-job'), r.querySelector('.status').textContent]);"
            )
        )

    # the launch has ended, so the database is final; a refresh fetched before it ended may still be on
    # the page: wait for the next one, then the page is the database (jobs registered after the page was
    # loaded appended too)
    try:
        WebDriverWait(browser, 30, poll_frequency=0.2).until(lambda d: shown(d) == db)
    except Exception:
        assert shown(browser) == db
    assert browser.execute_script("return window.__sameDocument;") == "yes"
    WebDriverWait(browser, 10).until(lambda d: _texts(d, "[data-status-of]")[0] == "failed")
    assert "ValueError: boom: a deliberately failing method" in _texts(browser, "tr[data-job] td.err")
    _shot(browser, tmp_path, "jobs_done")


def test_sweeps_page(world, browser, tmp_path):
    world["launch"].join(60)
    _open(browser, world, "/")
    rows = {r.split("\n")[0].split(" ")[0]: r for r in _texts(browser, "#sweeps tbody tr")}
    assert {OWN, RUNNING, "paper:qwen3-30b-a3b"} <= set(rows)
    assert (
        "finished" in rows[OWN] and "failed" in rows[RUNNING] and "reference" in rows["paper:qwen3-30b-a3b"]
    )
    bars = _texts(browser, f'[data-progress="{OWN}"] .stage')
    assert [b.split()[0] for b in bars] == ["convert", "ppl_pre", "distill", "evaluate"]
    assert all(b.split()[-1].split("/")[0] == b.split()[-1].split("/")[1] for b in bars)  # all done
    _shot(browser, tmp_path, "dashboard")


def test_results_page_sorts_filters_and_marks_picks(world, browser, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    _open(browser, world, f"/sweeps/{OWN}")
    n_rows, n_picked = world["store"].query(
        "SELECT COUNT(*), SUM(selected_for_distill) FROM results WHERE sweep = :s", {"s": OWN}
    )[1][0]
    assert len(_texts(browser, "#results tbody tr")) == n_rows
    assert len(_texts(browser, "#results tbody tr.picked")) == n_picked
    assert all(t.endswith("★") or "★" in t for t in _texts(browser, "#results tbody tr.picked td.pick"))
    browser.find_element(By.CSS_SELECTOR, 'a[data-sort="ppl_pre"]').click()  # sort by PPL, ascending
    col = [h.text for h in browser.find_elements(By.CSS_SELECTOR, "#results thead th")].index("PPL pre ▲")
    vals = [
        r.find_elements(By.TAG_NAME, "td")[col].text
        for r in browser.find_elements(By.CSS_SELECTOR, "#results tbody tr")
    ]
    nums = [float(v.replace(",", "")) for v in vals if v not in ("", "–")]
    assert nums == sorted(nums) and len(nums) > 10
    Select(browser.find_element(By.NAME, "scoring")).select_by_visible_text("DO-ACP")  # submits the form
    browser.find_element(By.CSS_SELECTOR, "#row-count")
    assert "scoring=DO-ACP" in browser.current_url and "sort=ppl_pre" in browser.current_url
    heads = [h.text.split(" ")[0] for h in browser.find_elements(By.CSS_SELECTOR, "#results thead th")]
    cells = [
        r.find_elements(By.TAG_NAME, "td")[heads.index("scoring")].text
        for r in browser.find_elements(By.CSS_SELECTOR, "#results tbody tr")
    ]
    assert cells and set(cells) == {"DO-ACP"}
    _shot(browser, tmp_path, "results")


def test_report_page_shows_figures_and_tables(world, browser, tmp_path):
    from selenium.webdriver.common.by import By

    _open(browser, world, f"/sweeps/{OWN}/report")
    imgs = browser.find_elements(By.CSS_SELECTOR, ".figures img")
    assert len(imgs) >= 4
    for img in imgs:
        browser.execute_script("arguments[0].scrollIntoView();", img)
    browser.execute_script("window.scrollTo(0, 0);")
    time.sleep(0.3)
    loaded = browser.execute_script(
        "return [...document.querySelectorAll('.figures img')].map(i => i.complete && i.naturalWidth > 100);"
    )
    assert all(loaded), loaded
    caps = _texts(browser, "table.tex caption")
    assert any("selection rule" in c.lower() for c in caps)
    text = browser.find_element(By.CSS_SELECTOR, "#table-baselines").text
    assert (
        "Random" in text and "\\" not in text and "&" not in text.replace("&amp;", "")
    )  # rendered, not LaTeX
    assert "Paper" in browser.page_source  # the paper's numbers beside ours (reference data imported)
    _shot(browser, tmp_path, "report")


def test_compare_page(world, browser, tmp_path):
    _open(browser, world, f"/sweeps/{OWN}/compare")
    heads = _texts(browser, "h2")
    assert any("Qwen3-30B-A3B" in h for h in heads)
    picks = _texts(browser, "table.picks tbody tr")
    assert any(p.startswith("DO-ACP × RR") and "—" not in p for p in picks)  # ours and the paper's pick
    _shot(browser, tmp_path, "compare")
    _open(browser, world, "/sweeps/paper:qwen3-30b-a3b")
    assert len(_texts(browser, "#results tbody tr.picked")) > 0
    _open(browser, world, "/sweeps/paper:qwen3-30b-a3b/compare")
    assert "published numbers themselves" in browser.page_source


def test_configuration_and_job_pages(world, browser, tmp_path):
    from selenium.webdriver.common.by import By

    store = world["store"]
    (cid,) = store.query(
        "SELECT config_id FROM results WHERE sweep = :s AND selected_for_distill = 1 "
        "AND kind = 'moe2dense' AND variant IS NULL ORDER BY config_id LIMIT 1",
        {"s": OWN},
    )[1][0]
    _open(browser, world, f"/configs/{cid}")
    plan = _texts(browser, "#plan tbody tr")
    assert len(plan) == 2 and all("e" in p and "α" in p for p in plan)  # two layers, experts with α
    metrics = _texts(browser, "#metrics tbody tr")
    assert any(m.startswith("acc_norm post tiny_mc") and " 200 " in f" {m} " for m in metrics)  # its n
    assert browser.find_elements(By.CSS_SELECTOR, "svg.curve .series path")  # the validation-CE curve
    assert {s.text for s in browser.find_elements(By.CSS_SELECTOR, "details.job .status")} == {"succeeded"}
    _shot(browser, tmp_path, "configuration")
    # the failed conversion of the launched sweep: its traceback and its log
    (fid,) = store.query(
        "SELECT c.id FROM configurations c JOIN sweeps s ON s.id = c.sweep_id "
        "JOIN config_jobs cj ON cj.config_id = c.id JOIN jobs j ON j.id = cj.job_id "
        "WHERE s.name = :s AND j.status = 'failed' LIMIT 1",
        {"s": RUNNING},
    )[1][0]
    _open(browser, world, f"/configs/{fid}")
    tb = browser.find_element(By.CSS_SELECTOR, "details.job[open] pre.traceback").text
    assert "Traceback" in tb and "boom: a deliberately failing method" in tb
    assert "converting CP K=4" in browser.find_element(By.CSS_SELECTOR, "details.job[open] pre.log").text
    browser.find_element(By.CSS_SELECTOR, "details.job[open] summary a").click()
    assert (
        "/jobs/" in browser.current_url
        and "boom" in browser.find_element(By.CSS_SELECTOR, "pre.traceback").text
    )
    _shot(browser, tmp_path, "job")


def test_missing_things_are_one_line_404s(world, browser):
    from selenium.webdriver.common.by import By

    for path, says in (
        ("/sweeps/nope", "no sweep 'nope'"),
        ("/configs/999999", "no configuration 999999"),
        ("/jobs/nope", "no job 'nope'"),
        (f"/sweeps/{OWN}?sort=colour", "sort: unknown column"),
    ):
        _open(browser, world, path)
        assert browser.find_element(By.ID, "error").text.startswith(says)


# ---- read-only: no write path, parameters bound ----------------------------------------------------------
PAYLOADS = [
    "' OR '1'='1",
    "x'; DROP TABLE jobs; --",
    "1 UNION SELECT key, key FROM jobs --",
    '" OR 1=1 --',
    "%' OR 1=1 --",
    "1); DELETE FROM metrics; --",
    "K\"; ATTACH 'x' AS y; --",
]
MARK = "INJECTED"


def _get(url: str, method: str = "GET") -> tuple[int, bytes]:
    req = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _routes(world) -> list[tuple[str, list[str]]]:
    """Every page and endpoint with the query parameters it reads (None: the path parameter)."""
    own, job = OWN, world["store"].query("SELECT key FROM jobs LIMIT 1")[1][0][0]
    from dashboard.data import FILTER_AXES

    return [
        ("/", []),
        (f"/sweeps/{own}", ["sort", "order", "selected", "q", *FILTER_AXES]),
        (f"/sweeps/{own}/jobs", ["stage", "status"]),
        (f"/sweeps/{own}/report", []),
        (f"/sweeps/{own}/compare", []),
        ("/configs/1", []),
        (f"/jobs/{job}", []),
        ("/api/sweeps", []),
        (f"/api/sweeps/{own}/progress", []),
    ]


def test_injection_through_every_parameter_changes_nothing(world):
    """Every query parameter and path parameter gets SQL injection attempts: each answer is a page, an
    empty result, a 400 or a 404; no statement the server runs contains the attacker's text (values are
    bound, never spliced), no filter matches more than an honest value would, and the database is
    byte-for-byte unchanged."""
    world["launch"].join(60)
    server_store = world["server"].server.config.app.state.store
    seen: list[str] = []
    listener = lambda conn, cur, stmt, params, ctx, many: seen.append(stmt)  # noqa: E731
    event.listen(server_store.engine, "before_cursor_execute", listener)
    before = snapshot(world["path"])
    base = world["url"]
    try:
        for path, params in _routes(world):
            for p in params:
                for attack in PAYLOADS:
                    code, body = _get(f"{base}{path}?{urllib.parse.urlencode({p: MARK + attack})}")
                    assert code in (200, 400), (path, p, attack, code)
                    if code == 200 and p in ("q", "scoring", "grouping", "kind", "model", "stage"):
                        assert b"data-config=" not in body and b'data-job="' not in body, (path, p, attack)
            segments = [s for s in path.split("/") if s]
            for i, seg in enumerate(segments):
                if seg in ("sweeps", "configs", "jobs", "api", "report", "compare"):
                    continue
                for attack in PAYLOADS:
                    bad = "/".join(
                        segments[:i] + [urllib.parse.quote(MARK + attack, safe="")] + segments[i + 1 :]
                    )
                    code, _ = _get(f"{base}/{bad}")
                    assert code == 404, (bad, code)
        code, _ = _get(f"{base}/sweeps/{OWN}/report/figures/..%2F..%2Fr.db")
        assert code == 404  # a figure is served only by a name the report listed
    finally:
        event.remove(server_store.engine, "before_cursor_execute", listener)
    assert seen and not [s for s in seen if MARK in s or "DROP" in s.upper() or "ATTACH" in s.upper()]
    assert snapshot(world["path"]) == before


def test_no_page_accepts_a_write(world):
    before = snapshot(world["path"])
    for path, _ in _routes(world):
        for method in ("POST", "PUT", "PATCH", "DELETE"):
            code, _ = _get(world["url"] + path, method)
            assert code == 405, (method, path, code)
    assert snapshot(world["path"]) == before


def test_the_dashboard_refuses_a_writable_store(tmp_path):
    from dashboard.app import create_app

    with pytest.raises(ValueError, match="read_only=True"):
        create_app(Store(f"sqlite:///{tmp_path / 'w.db'}"))


# ---- the command line ----------------------------------------------------------------------------------
runner = CliRunner()


def _one_line(result) -> str:
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def test_serve_errors_are_one_line(world, tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        line = _one_line(runner.invoke(app, ["serve", "--db", world["db"], "--port", str(port)]))
    assert line == f"error: port {port} on 127.0.0.1 is in use (another server?); choose another with --port"
    line = _one_line(runner.invoke(app, ["serve", "--db", f"sqlite:///{tmp_path / 'none.db'}"]))
    assert line.startswith(f"error: no database at {tmp_path / 'none.db'}")
    assert not (tmp_path / "none.db").exists()
    assert (
        _one_line(runner.invoke(app, ["serve", "--db", world["db"], "--port", "70000"]))
        == "error: --port 70000: allowed: 0 to 65535"
    )


def test_sweeps_lists_the_database_beside_the_files(world, monkeypatch):
    world["launch"].join(60)
    monkeypatch.setenv("COLUMNS", "250")
    result = runner.invoke(app, ["sweeps", "--db", world["db"]])
    assert result.exit_code == 0, result.output
    cells = [
        [c.strip() for c in ln.split("│")[1:-1]] for ln in result.stdout.splitlines() if ln.startswith("│")
    ]
    lines = {c[0]: " ".join(c) for c in cells if c[0]}
    assert "finished" in lines[OWN] and "failed" in lines[RUNNING]
    assert "reference" in lines["paper:qwen3-30b-a3b"]
    assert "not launched" in lines["tiny"]  # a sweep file the database has not seen


def test_launch_without_a_terminal_prints_progress_lines(tmp_path, monkeypatch):
    """nohup, CI, a log file: no bars, but a line per stage at a steady interval, and where each ended."""
    gate = Gate()
    monkeypatch.setenv("MOESWEEP_HOME", str(tmp_path / "home"))
    _fake_stages(monkeypatch, gate)
    spec, path, text = load_spec(str(_fake_sweep(tmp_path)))
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=False, width=160)
    done: dict = {}
    thread = threading.Thread(
        target=lambda: done.setdefault(
            "code",
            launch(
                spec,
                text,
                Store(f"sqlite:///{tmp_path / 'r.db'}"),
                SerialExecutor(),
                console=console,
                path=str(path),
                lines_s=0.2,
            ),
        ),
        daemon=True,
    )
    thread.start()
    assert gate.entered.wait(60)
    deadline = time.monotonic() + 20
    while buf.getvalue().count("stage convert: 0/8 (") < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    held = buf.getvalue()
    assert held.count("stage convert: 0/8 (") >= 2, held  # repeated while the stage is held
    assert "stage calibrate: 1/1 done" in held and held.count("stage calibrate") == 1  # a finished stage once
    gate.release.set()
    thread.join(60)
    out = buf.getvalue()
    assert done["code"] == 1  # the deliberately failing conversion
    for stage, n in (("convert", 8), ("ppl_pre", 8), ("evaluate", 6)):
        assert f"stage {stage}: {n}/{n} done" in out, out
    assert "\x1b[" not in out  # plain text, no terminal codes


def test_the_dashboard_over_postgresql(pg_database):
    """The same pages over PostgreSQL (read-only transactions): the queries are portable."""
    url = pg_database("serve")
    store = Store(url)
    store.import_reference(reference_sweeps())
    build_own_sweep(store)
    (cid,) = store.query(
        "SELECT config_id FROM results WHERE sweep = :s AND selected_for_distill = 1 "
        "AND kind = 'moe2dense' ORDER BY config_id LIMIT 1",
        {"s": OWN},
    )[1][0]
    (key,) = store.query("SELECT key FROM jobs LIMIT 1")[1][0]
    server = Background(Store(url, read_only=True)).start()
    try:
        for path, says in (
            ("/", b"tiny-synth"),
            (f"/sweeps/{OWN}?K=4&teacher_top_k=4&sort=K&order=desc", b"DO-ACP"),
            (f"/sweeps/{OWN}?q=SF&selected=1&sort=ppl_pre", b"SF|"),
            (f"/sweeps/{OWN}/jobs", b"evaluate"),
            (f"/sweeps/{OWN}/compare", b"DO-ACP"),
            (f"/configs/{cid}", b"val_ce"),
            (f"/jobs/{key}", b"Parameters"),
            (f"/api/sweeps/{OWN}/progress", b"succeeded"),
            (f"/sweeps/{OWN}?scoring={urllib.parse.quote(PAYLOADS[0])}", b"No configuration matches"),
        ):
            code, body = _get(server.url + path)
            assert code == 200 and says in body, (path, code, body[:300])
        assert _get(server.url + f"/sweeps/{OWN}?K=x")[0] == 400
    finally:
        server.stop()
