"""`moesweep serve`: a read-only web dashboard over the results database (Starlette + Jinja2 templates).

The application only has GET routes: no page can change anything, and the database is opened through
`Store(url, read_only=True)` (SQLite `mode=ro` + `query_only` + an authorizer; PostgreSQL read-only
transactions), so even a bug here could not write. Live pages poll a small JSON endpoint.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

from markupsafe import Markup
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates

from analysis.latex import fmt_ppl
from dashboard import data as D
from dashboard.reports import ReportCache, compare
from db.store import Store, StoreError

HERE = Path(__file__).parent
POLL_MS = 1500


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


def svg_curve(curves: dict[str, list[tuple[int, float]]], width: int = 560, height: int = 260) -> Markup:
    """Validation CE by step as an inline SVG line chart (one line per who: student, teacher)."""
    pts = [p for line in curves.values() for p in line]
    if not pts:
        return Markup("")
    x0, x1 = min(p[0] for p in pts), max(p[0] for p in pts)
    y0, y1 = min(p[1] for p in pts), max(p[1] for p in pts)
    x1, y1 = (x1 if x1 > x0 else x0 + 1), (y1 if y1 > y0 else y0 + 1e-9)
    pad = 44

    def xy(s: float, v: float) -> str:
        return f"{pad + (s - x0) / (x1 - x0) * (width - 2 * pad):.1f},{height - pad - (v - y0) / (y1 - y0) * (height - 2 * pad):.1f}"

    colours = {"student": "#1f6feb", "teacher": "#d1242f"}
    out = [
        f'<svg class="curve" viewBox="0 0 {width} {height}" width="{width}" height="{height}" role="img" '
        f'aria-label="validation cross-entropy by step">',
        f'<line x1="{pad}" y1="{height - pad}" x2="{width - pad}" y2="{height - pad}" class="axis"/>',
        f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{height - pad}" class="axis"/>',
        f'<text x="{pad}" y="{height - pad + 16}" class="tick">{x0}</text>',
        f'<text x="{width - pad}" y="{height - pad + 16}" class="tick" text-anchor="end">{x1}</text>',
        f'<text x="{pad - 4}" y="{height - pad}" class="tick" text-anchor="end">{y0:.3g}</text>',
        f'<text x="{pad - 4}" y="{pad + 4}" class="tick" text-anchor="end">{y1:.3g}</text>',
        f'<text x="{width / 2}" y="{height - 8}" class="tick" text-anchor="middle">step</text>',
    ]
    for i, (who, line) in enumerate(sorted(curves.items())):
        c = colours.get(who, "#6e7781")
        out.append(
            f'<polyline fill="none" stroke="{c}" stroke-width="2" points="{" ".join(xy(s, v) for s, v in line)}"/>'
        )
        for s, v in line:
            out.append(
                f'<circle r="3" fill="{c}" cx="{xy(s, v).split(",")[0]}" cy="{xy(s, v).split(",")[1]}">'
                f"<title>{Markup.escape(who)} step {s}: {v:.4g}</title></circle>"
            )
        out.append(
            f'<text x="{width - pad}" y="{pad + 14 * i}" text-anchor="end" fill="{c}" class="tick">'
            f"{Markup.escape(who)}</text>"
        )
    out.append("</svg>")
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
    cfg = _one(D.config(store, cid), f"no configuration {cid}")
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


def create_app(store: Store, reports: ReportCache | None = None) -> Starlette:
    """The dashboard over `store`, which must be read-only (a writable one is refused)."""
    if not store.read_only:
        raise ValueError("the dashboard only reads: open the store with Store(url, read_only=True)")
    routes = [
        Route("/", index),
        Route("/sweeps/{name}", sweep_page),
        Route("/sweeps/{name}/jobs", jobs_page),
        Route("/sweeps/{name}/report", report_page),
        Route("/sweeps/{name}/report/figures/{file}", report_figure),
        Route("/sweeps/{name}/compare", compare_page),
        Route("/configs/{config_id:int}", config_page),
        Route("/jobs/{key}", job_page),
        Route("/api/sweeps", api_sweeps),
        Route("/api/sweeps/{name}/progress", api_progress),
        Mount("/static", StaticFiles(directory=str(HERE / "static")), name="static"),
    ]
    app = Starlette(
        routes=routes,
        exception_handlers={HTTPException: _http_error, D.BadRequest: _bad_request, StoreError: _store_error},
    )
    app.state.store = store
    app.state.reports = reports or ReportCache()
    return app
