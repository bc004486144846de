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

import contextlib
import csv
import functools
import io
import math
import re
from collections.abc import AsyncIterator, Callable, Iterable
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
from dashboard import charts
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
    return _page(
        request,
        "plots.html",
        sweep=sw,
        options=D.filter_options(store, name),
        results_url=_with_query(request, f"/sweeps/{_seg(name)}"),
        charts=[
            ("PPL before distillation by K", charts.ppl_by_k_chart(rows)),
            ("Accuracy by parameters", charts.acc_by_params_chart(rows)),
            ("The grid: axes → PPL before distillation", charts.parallel_chart(rows, found["axes"])),
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


def _report(request: Request, store: Store, name: str) -> Any:
    """The sweep's rendered report; its figures are drawn by matplotlib, whose settings the charts share:
    not while a chart is drawn."""
    with charts.DRAWING:
        return request.app.state.reports.get(store, name)


def report_page(request: Request) -> Response:
    store, name = _store(request), request.path_params["name"]
    sw = _one(D.sweep(store, name), f"no sweep {name!r} in this database")
    if not sw.configs:
        return _page(request, "report.html", sweep=sw, report=None, problem="no configurations yet")
    try:
        rep = _report(request, store, name)
    except ValueError as e:
        return _page(request, "report.html", sweep=sw, report=None, problem=str(e))
    return _page(request, "report.html", sweep=sw, report=rep, problem=None)


def report_figure(request: Request) -> Response:
    store, name, file = _store(request), request.path_params["name"], request.path_params["file"]
    _one(D.sweep(store, name), f"no sweep {name!r} in this database")
    rep = _report(request, store, name)
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
        curve=charts.curve_chart(curve),
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
