"""`moesweep launch NAME --dry-run`: the jobs, stage by stage, without running, downloading or importing
torch (the teacher's shape comes from the sweep file or the tiny teacher's settings)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from orchestrator import configs as P
from orchestrator.axes import AXES
from orchestrator.scope import Scope
from orchestrator.spec import SweepSpec
from orchestrator.stage import SweepContext, stages, unique
from orchestrator.stages.convert import subgrids
from workers.core.shape import TeacherShape


def plan_counts(
    spec: SweepSpec, shape: TeacherShape | None = None, scope: Scope | None = None
) -> tuple[list[dict[str, Any]], list[str]]:
    """(per stage: jobs named by configurations, distinct jobs, a note; the keys of the jobs planned
    without running anything). Pure, for tests too. `scope` (--until, --only; checked against the sweep
    here): the stages up to --until, the --only configurations and those their selection compares."""
    shape = shape or P.stated_shape(spec)
    configs = P.build_configs(spec, shape)
    scope = scope or Scope()
    scope.prepare(spec, configs)
    if scope.only:
        configs = [c for c in configs if c["config_key"] in {*scope.only, *scope.group}]
    ctx = SweepContext(spec, shape, configs)
    names = {st.name for st in scope.stages()}
    best_by = spec.select.best_by if spec.select is not None else "ppl_pre"
    shown = names | ({"select"} if best_by in names else set())
    rows: list[dict[str, Any]] = []
    keys: list[str] = []
    for st in stages():
        if st.estimate is not None:
            rows += [
                _bounded(r, scope) for r in st.estimate(ctx, rows) if r["stage"] in shown or st.name in names
            ]
            continue
        if st.name not in names:
            continue
        ctx.jobs[st.name] = st.jobs(ctx)
        jobs = scope.keep(st.name, ctx.jobs[st.name], ctx.configs)
        distinct = unique(jobs.values())
        keys += [j.key for j in distinct]
        if jobs:
            note = (st.describe(ctx) if st.describe is not None else "") or st.summary
            rows.append({"stage": st.name, "named": len(jobs), "distinct": len(distinct), "note": note})
        elif st.section and getattr(ctx.spec, st.section, None) is None:
            continue  # its section is absent: the stage does not run
        elif not st.static and any(ctx.jobs.get(u) for u in st.upstream):  # needs results not there yet
            rows.append(
                {
                    "stage": st.name,
                    "named": "–",
                    "distinct": "–",
                    "note": f"planned from the results of {', '.join(st.upstream)}"
                    + (f"; {st.summary}" if st.summary else ""),
                }
            )
    return rows, keys


def _bounded(row: dict[str, Any], scope: Scope) -> dict[str, Any]:
    """An estimate's row for --only: the estimates count from the whole grid, so what they say of the
    distinct jobs of a few configurations is bounded by the jobs those configurations name."""
    named, distinct = row["named"], row["distinct"]
    if scope.only and isinstance(named, int) and isinstance(distinct, int) and not 0 <= distinct <= named:
        return {**row, "distinct": named, "note": "at most (fewer where plans coincide)"}
    return row


def plan(
    spec: SweepSpec, store, scope: Scope | None = None, overrides: list[str] | None = None
) -> dict[str, Any]:
    """What the dry run shows, as data (`moesweep launch NAME --dry-run --json`): the teacher and its shape,
    the grid, the --set overrides, the partial launch, per stage its jobs (`named` by configurations,
    `distinct`, `shared` = named - distinct, the configurations served by a job another one names; None
    where the stage is planned from results that do not exist yet) and its note, and what `store` (None:
    no database yet) already holds of the jobs planned so far."""
    shape = P.stated_shape(spec)
    scope = scope or Scope()
    rows, keys = plan_counts(spec, shape, scope)
    stages = []
    for r in rows:
        named, distinct = (n if isinstance(n, int) else None for n in (r["named"], r["distinct"]))
        shared = named - distinct if named is not None and distinct is not None else None
        stages.append(
            {"stage": r["stage"], "named": named, "distinct": distinct, "shared": shared, "note": r["note"]}
        )
    done = None
    if store is not None:
        done = {
            "database": store.shown,
            "succeeded": sum(1 for r in store.jobs(keys).values() if r["status"] == "succeeded"),
            "planned": len(keys),
        }
    return {
        "sweep": spec.name,
        "teacher": {
            "label": P.teacher_label(spec),
            "num_experts": shape.num_experts,
            "top_k": shape.top_k,
            "shape_from": P.shape_source(spec),
        },
        "grids": [
            {a: len(v) for a, v in g.model_dump().items() if v is not None and a in AXES}
            for g in subgrids(spec)
        ],
        "overrides": list(overrides or []),
        "partial": {"scope": scope.describe(), "compared_configurations": len(scope.group)}
        if scope.partial
        else None,
        "stages": stages,
        "already_done": done,
    }


def dry_run(
    spec: SweepSpec, store, console: Console, scope: Scope | None = None, overrides: list[str] | None = None
) -> None:
    """Print the plan. `overrides`: the --set options it was loaded with, named in its first line."""
    p = plan(spec, store, scope, overrides)
    teacher = p["teacher"]
    grids = "; ".join(" × ".join(f"{n} {a}" for a, n in g.items()) for g in p["grids"])
    console.print(
        f"[bold]{spec.name}[/]: teacher {teacher['label']} (E={teacher['num_experts']}, k={teacher['top_k']}, "
        f"from the {teacher['shape_from']}); {grids}"
    )
    if overrides:
        console.print("with " + " ".join(f"--set {o}" for o in overrides), highlight=False, markup=False)
    if p["partial"] is not None:
        what = f"partial launch ({p['partial']['scope']})"
        if p["partial"]["compared_configurations"]:
            what += f": and {p['partial']['compared_configurations']} configuration(s) the selection compares them with"
        console.print(what, highlight=False, markup=False)
    t = Table("stage", "named by configs", "distinct jobs", "notes", title="jobs (nothing is run)")
    for r in p["stages"]:
        t.add_row(r["stage"], *("–" if r[c] is None else str(r[c]) for c in ("named", "distinct")), r["note"])
    console.print(t)
    if p["already_done"] is not None:
        done = p["already_done"]
        console.print(
            f"already done in {done['database']}: {done['succeeded']} of {done['planned']} jobs planned so far "
            "(later stages are planned from earlier results)"
        )
