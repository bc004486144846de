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
import functools
import math
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


def svg_curve(curves: dict[str, list[tuple[int, float]]], width: int = 640, height: int = 300) -> Markup:
    """Validation CE by distillation step as an inline SVG line chart, one line per who (student, teacher):
    round ticks on both axes, axis labels, and the legend to the right of the plot area."""
    curves = {w: [(s, v) for s, v in line if math.isfinite(v)] for w, line in curves.items()}
    pts = [p for line in curves.values() for p in line]
    if not pts:
        return Markup("")
    xt = nice_ticks(min(p[0] for p in pts), max(p[0] for p in pts), integer=True)
    yt = nice_ticks(min(p[1] for p in pts), max(p[1] for p in pts))
    left, right, top, bottom = 72, 118, 14, 50  # margins: tick labels and y label; legend; x label
    px0, px1, py0, py1 = left, width - right, top, height - bottom  # the plot area

    def sx(s: float) -> float:
        return px0 + (s - xt[0]) / (xt[-1] - xt[0]) * (px1 - px0)

    def sy(v: float) -> float:
        return py1 - (v - yt[0]) / (yt[-1] - yt[0]) * (py1 - py0)

    esc = Markup.escape
    colours = {"student": "#1f6feb", "teacher": "#d1242f"}
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="curve" viewBox="0 0 {width} {height}" '
        f'width="{width}" height="{height}" role="img" '
        'aria-label="validation cross-entropy by distillation step">',
        f'<rect class="plot-area" x="{px0}" y="{py0}" width="{px1 - px0}" height="{py1 - py0}" fill="none"/>',
    ]
    for t, label in zip(yt, tick_labels(yt), strict=True):
        y = f"{sy(t):.1f}"
        out.append(f'<line class="grid" x1="{px0}" y1="{y}" x2="{px1}" y2="{y}"/>')
        out.append(
            f'<text class="tick y-tick" x="{px0 - 5}" y="{y}" dy="0.32em" text-anchor="end">{label}</text>'
        )
    for t, label in zip(xt, tick_labels(xt), strict=True):
        x = f"{sx(t):.1f}"
        out.append(f'<line class="axis" x1="{x}" y1="{py1}" x2="{x}" y2="{py1 + 4}"/>')
        out.append(f'<text class="tick x-tick" x="{x}" y="{py1 + 16}" text-anchor="middle">{label}</text>')
    out += [
        f'<line class="axis" x1="{px0}" y1="{py1}" x2="{px1}" y2="{py1}"/>',
        f'<line class="axis" x1="{px0}" y1="{py0}" x2="{px0}" y2="{py1}"/>',
        f'<text class="label x-label" x="{(px0 + px1) / 2}" y="{height - 10}" text-anchor="middle">'
        "distillation step</text>",
        f'<text class="label y-label" transform="rotate(-90)" x="{-(py0 + py1) / 2}" y="16" '
        'text-anchor="middle">validation cross-entropy</text>',
    ]
    legend = ['<g class="legend">']
    for i, (who, line) in enumerate(sorted(curves.items())):
        c = colours.get(who, "#6e7781")
        xy = [(sx(s), sy(v)) for s, v in line]
        out.append(
            f'<polyline class="series" fill="none" stroke="{c}" stroke-width="2" '
            f'points="{" ".join(f"{x:.1f},{y:.1f}" for x, y in xy)}"/>'
        )
        for (s, v), (x, y) in zip(line, xy, strict=True):
            out.append(
                f'<circle r="3" fill="{c}" cx="{x:.1f}" cy="{y:.1f}">'
                f"<title>{esc(who)} step {s}: {v:.6g}</title></circle>"
            )
        name = who if len(who) <= 12 else who[:11] + "…"
        ly = py0 + 8 + 18 * i
        legend.append(
            f'<g class="legend-item"><title>{esc(who)}</title>'
            f'<line x1="{px1 + 14}" y1="{ly}" x2="{px1 + 34}" y2="{ly}" stroke="{c}" stroke-width="2"/>'
            f'<text class="tick" x="{px1 + 40}" y="{ly}" dy="0.32em">{esc(name)}</text></g>'
        )
    out += [*legend, "</g>", "</svg>"]
    return Markup("".join(out))


templates = Jinja2Templates(directory=str(HERE / "templates"))
templates.env.filters.update(ppl=_ppl, pct=_pct, num=_num, dur=_dur, seg=_seg, last_line=D.last_line)
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


def sweep_page(request: Request) -> Response:
    store, name = _store(request), request.path_params["name"]
    sw = _one(D.sweep(store, name), f"no sweep {name!r} in this database")
    q = request.query_params
    options = D.filter_options(store, name)
    filters = {a: q[a] for a in D.FILTER_AXES if q.get(a)}
    unknown = sorted(set(q) - set(D.FILTER_AXES) - {"sort", "order", "selected", "q"})
    if unknown:
        raise D.BadRequest(
            f"unknown query parameter {unknown[0]!r}; allowed: sort, order, selected, q, "
            + ", ".join(D.FILTER_AXES)
        )
    if q.get("order") not in (None, "", "asc", "desc"):
        raise D.BadRequest(f"order: {q['order']!r}; allowed: asc, desc")
    if q.get("selected") not in (None, "", "0", "1"):
        raise D.BadRequest(f"selected: {q['selected']!r}; allowed: 0, 1")
    sort = q.get("sort") or None
    found = D.results(
        store,
        name,
        filters,
        sort=sort,
        desc=q.get("order") == "desc",
        selected_only=q.get("selected") == "1",
        search=q.get("q") or None,
    )
    shown = [c for c in D.TABLE_AXES if any(r[c] is not None for r in found)]
    return _page(
        request,
        "sweep.html",
        sweep=sw,
        rows=found,
        options=options,
        filters=filters,
        axes=shown,
        sort=sort,
        desc=q.get("order") == "desc",
        selected_only=q.get("selected") == "1",
        search=q.get("q") or "",
        url=lambda **kw: _query_url(request, **kw),
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
