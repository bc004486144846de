"""`moesweep launch NAME --dry-run`: the plan, stage by stage, without running or downloading."""

from __future__ import annotations

from itertools import product

from rich.console import Console
from rich.table import Table

from orchestrator import plan as P
from orchestrator.spec import SweepSpec


def plan_counts(spec: SweepSpec) -> list[dict]:
    """Per stage: jobs named by configurations, distinct jobs, and notes. Pure, for tests too."""
    plan = P.build_plan(spec)
    moe = [c for c in plan.configs if c["kind"] == "moe2dense"]
    others = [c for c in plan.configs if c["kind"] != "moe2dense"]
    conv_unique = len({j.key for j in plan.convert.values()})
    rows = []
    if plan.teacher:
        rows.append({"stage": "teacher", "named": 1, "distinct": 1, "note": "train the embedded tiny MoE teacher"})
    if plan.dense_teacher:
        rows.append({"stage": "dense_teacher", "named": 1, "distinct": 1, "note": "train the dense teacher (D2D)"})
    rows.append({"stage": "calibrate", "named": len(moe), "distinct": 1,
                 "note": "one pass, shared by every configuration"})
    rows.append({"stage": "convert", "named": len(moe), "distinct": conv_unique,
                 "note": f"{len(moe) - conv_unique} collapse: K = k makes grouping irrelevant"})
    rows.append({"stage": "ppl_pre", "named": len(plan.configs), "distinct": conv_unique + len(others),
                 "note": "at most; equal conversion plans share one evaluation at run time"})
    if spec.distill is not None:
        if spec.select is not None:
            groups = len(set(product(*[sorted({str(c[a]) for c in moe}) for a in spec.select.per])))
        else:
            groups = len(moe)
        base = sum(1 for c in others if c["kind"] == "baseline" and not c["baseline"].startswith("d2d:"))
        d2d = int(any(c["kind"] == "baseline" and c["baseline"].startswith("d2d:") for c in others))
        variants = len(spec.distill.variants)
        sel = spec.select
        rule = (f"best {sel.best_by} per {'×'.join(sel.per)} over {', '.join(sel.over)}" if sel else "all")
        n = groups + base + d2d
        rows.append({"stage": "select", "named": len(moe), "distinct": groups, "note": rule})
        rows.append({"stage": "distill", "named": n + variants, "distinct": n + variants,
                     "note": f"{groups} selected + {base + d2d} baselines"
                             + (f" + up to {variants} variant runs" if variants else "")})
        if spec.evaluate is not None:
            teacher = int(any(c["kind"] == "teacher" for c in others))
            rows.append({"stage": "evaluate", "named": n + variants + teacher,
                         "distinct": n + variants + teacher,
                         "note": f"suite {spec.evaluate.suite if isinstance(spec.evaluate.suite, str) else 'custom'}"
                                 + (" + teacher" if teacher else "")})
    return rows


def dry_run(spec: SweepSpec, store, console: Console) -> None:
    rows = plan_counts(spec)
    E, k = P.teacher_shape(spec)
    console.print(f"[bold]{spec.name}[/]: teacher {P.teacher_label(spec)} (E={E}, k={k}); "
                  f"{len(spec.grid.scoring)} scorings × {len(spec.grid.grouping)} groupings × "
                  f"{len(spec.grid.dp_scaling)} scalings × K∈{spec.grid.K}")
    t = Table("stage", "named by configs", "distinct jobs", "notes", title="plan (nothing is run)")
    for r in rows:
        t.add_row(r["stage"], str(r["named"]), str(r["distinct"]), r["note"])
    console.print(t)
    if store is not None:
        plan = P.build_plan(spec)
        keys = [j.key for j in plan.static_jobs]
        done = sum(1 for r in store.jobs(keys).values() if r["status"] == "succeeded")
        console.print(f"already done in {store.url}: {done} of {len(keys)} teacher/calibrate/convert jobs")
