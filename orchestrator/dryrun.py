"""`moesweep launch NAME --dry-run`: the jobs, stage by stage, without running, downloading or importing
torch (the teacher's shape comes from the sweep file or the tiny teacher's settings)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from orchestrator import configs as P
from orchestrator.axes import AXES
from orchestrator.spec import SweepSpec
from orchestrator.stage import SweepContext, TeacherShape, stages, unique
from orchestrator.stages.convert import subgrids


def plan_counts(spec: SweepSpec, shape: TeacherShape | None = None) -> tuple[list[dict[str, Any]], list[str]]:
    """(per stage: jobs named by configurations, distinct jobs, a note; the keys of the jobs planned
    without running anything). Pure, for tests too."""
    shape = shape or P.stated_shape(spec)
    ctx = SweepContext(spec, shape, P.build_configs(spec, shape))
    rows: list[dict[str, Any]] = []
    keys: list[str] = []
    for st in stages():
        if st.estimate is not None:
            rows += st.estimate(ctx, rows)
            continue
        jobs = st.jobs(ctx)
        ctx.jobs[st.name] = jobs
        distinct = unique(jobs.values())
        keys += [j.key for j in distinct]
        if jobs:
            rows.append({"stage": st.name, "named": len(jobs), "distinct": len(distinct), "note": st.summary})
        elif st.section and getattr(ctx.spec, st.section, None) is None:
            continue  # its section is absent: the stage does not run
        elif any(ctx.jobs.get(u) for u in st.upstream):  # its plan needs results that do not exist yet
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


def dry_run(spec: SweepSpec, store, console: Console) -> None:
    shape = P.stated_shape(spec)
    rows, keys = plan_counts(spec, shape)
    grids = "; ".join(
        " × ".join(f"{len(v)} {a}" for a, v in g.model_dump().items() if v is not None and a in AXES)
        for g in subgrids(spec)
    )
    console.print(
        f"[bold]{spec.name}[/]: teacher {P.teacher_label(spec)} (E={shape.num_experts}, k={shape.top_k}, "
        f"from the {shape.source}); {grids}"
    )
    t = Table("stage", "named by configs", "distinct jobs", "notes", title="jobs (nothing is run)")
    for r in rows:
        t.add_row(r["stage"], str(r["named"]), str(r["distinct"]), r["note"])
    console.print(t)
    if store is not None:
        done = sum(1 for r in store.jobs(keys).values() if r["status"] == "succeeded")
        console.print(
            f"already done in {store.shown}: {done} of {len(keys)} jobs planned so far "
            "(later stages are planned from earlier results)"
        )
