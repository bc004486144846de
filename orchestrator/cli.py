"""The `moesweep` command: launch, status, verify, stages, families, sweeps, sql, migrate, report, import-paper,
mirror, serve."""

from __future__ import annotations

import csv
import json
import math
import os
import sys
import textwrap
from decimal import Decimal
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import typer
from rich.console import Console
from rich.table import Table
from typer.core import TyperGroup

# click's UsageError and NoArgsIsHelpError, of whichever click typer runs on (typer 0.29 carries its own)
UsageError = typer.BadParameter.__base__
NoArgsIsHelpError = getattr(sys.modules[UsageError.__module__], "NoArgsIsHelpError", ())


class _Commands(TyperGroup):
    """The commands; a command line they cannot take (an unknown command or option, a missing argument) and
    a database found unusable part-way through one (a damaged file, one that cannot be written) are one
    line and exit 2, as a problem opening it is."""

    def make_context(self, info_name, args, parent=None, **extra):
        try:
            return super().make_context(info_name, args, parent, **extra)
        except UsageError as e:  # the command line before any command, e.g. `moesweep --bogus`
            _usage(e, info_name or "moesweep")

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except UsageError as e:
            name = ctx.invoked_subcommand  # set before the subcommand parses its arguments
            _usage(e, f"{ctx.command_path} {name}" if name else ctx.command_path)
        except Exception as e:
            store = sys.modules.get("db.store")  # not imported: no StoreError can have been raised
            if store is None or not isinstance(e, store.StoreError):
                raise
            _fail(str(e))


app = typer.Typer(
    cls=_Commands,
    add_completion=True,  # --install-completion / --show-completion: commands, options and their choices
    no_args_is_help=True,
    help="Experiment sweeps and a results database for MoE compression research: MoE → dense students, smaller MoEs (pruned, merged, edited), dense → MoE.",
)
# in a pipe or a log file (no terminal to measure) tables get room instead of rich's default 80 columns
out = Console(width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True, width=None if sys.stderr.isatty() else 160)

DbOpt = Annotated[
    str | None,
    typer.Option(
        "--db", help="SQLAlchemy URL (default: $MOESWEEP_DB or sqlite:///$MOESWEEP_HOME/moesweep.db)"
    ),
]


def _version(value: bool) -> None:
    if value:
        from orchestrator.version import version_text

        print(version_text())
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            callback=_version,
            is_eager=True,
            help="the version, git commit and locked library versions",
        ),
    ] = False,
) -> None:
    """Experiment sweeps and a results database for MoE→dense compression research."""
    if "MOESWEEP_HOME" in os.environ and not os.environ["MOESWEEP_HOME"].strip():
        del os.environ["MOESWEEP_HOME"]  # set but empty: unset (.moesweep), not the current folder


def _store(
    db: str | None,
    migrate: bool = True,
    read_only: bool = False,
    missing_ok: bool = False,
    create: bool = True,
):
    """The database of --db (else $MOESWEEP_DB, else the default file); any problem opening it is one line
    and exit 2. Read-only: an existing database at the current schema, opened so nothing can change it.
    `create=False`: an existing database at the current schema, opened to write (nothing is created or
    migrated). `missing_ok`: a database file that does not exist yet is None (nothing is done there yet),
    said in a line."""
    from db.store import Store, StoreError

    try:
        return Store(db, migrate=migrate, read_only=read_only, create=create)
    except StoreError as e:
        if missing_ok and str(e).startswith("no database at "):
            err.print(
                str(e).split(" (", 1)[0] + " yet: planned as for a new one (nothing created)", highlight=False
            )
            return None
        source = "--db" if db else "$MOESWEEP_DB" if os.environ.get("MOESWEEP_DB") else "database URL"
        _fail(f"{source}: {e}" if e.about_url else str(e))


def _usage(e: Exception, path: str) -> None:
    """A command line the commands cannot take, as one line: where, what, and where the help is (a bare
    `moesweep`, or a command called without what it needs, shows its help as before)."""
    if isinstance(e, NoArgsIsHelpError):
        raise e
    ctx = getattr(e, "ctx", None)
    where = ctx.command_path if ctx is not None else path
    _fail(f"{where}: {e.format_message()} (see {where} --help)")


def _fail(msg: str, code: int = 2) -> None:
    """One plain line on stderr (never wrapped, whatever the terminal), then exit `code`."""
    print("error: " + " ".join(str(msg).split()), file=sys.stderr, flush=True)
    raise typer.Exit(code)


def _one_of(option: str, choices: Any):
    """The parser of an option whose values are a Literal (listed in --help, completed by the shell): any
    other value is one line, e.g. `--format 'xml': allowed: table, csv, json`."""
    allowed = get_args(choices)

    def parse(value: str) -> str:
        if value not in allowed:
            if _completing():
                raise ValueError(value)  # the shell completes what follows: no message on its terminal
            _fail(f"{option} {value!r}: allowed: {', '.join(allowed)}")
        return value

    return parse


def _completing() -> bool:
    """Whether the command line is being parsed for the shell's completion (nothing is run)."""
    try:
        from typer._click.globals import get_current_context
    except ImportError:  # a typer that keeps click elsewhere: a bad value's line shows while completing
        return False
    ctx = get_current_context(silent=True)
    return ctx is not None and ctx.resilient_parsing


def _plain(value: Any) -> Any:
    """`value` with every non-finite number (NaN, ±inf, as floats or decimals) replaced by None, each other
    decimal by an int or a float, and tuples by lists: what strict JSON can hold."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Decimal):
        if not value.is_finite():
            return None
        return int(value) if value == value.to_integral_value() else float(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _print_json(doc: Any) -> None:
    """One JSON document on stdout, and nothing else: strict JSON (NaN and infinities are null; Python's
    json writes NaN and Infinity, which no JSON parser is bound to read); what JSON has no type for (a
    date, bytes) is its text."""
    sys.stdout.write(json.dumps(_plain(doc), indent=1, allow_nan=False, default=str) + "\n")
    sys.stdout.flush()


JsonOpt = Annotated[
    bool,
    typer.Option("--json", help="print one JSON document on stdout instead (docs/database.md, Scripting)"),
]


def _spec(name: str, overrides: list[str] | None = None):
    from orchestrator.spec import SpecError, load_spec, one_line

    try:
        return load_spec(name, overrides or ())
    except SpecError as e:
        _fail(one_line(str(e)))


def _spec_fail(e: Exception, path, overrides: list[str]) -> None:
    """A sweep problem found after loading (the teacher's config, K against it, data paths, --until,
    --only): one line naming the file, and the --set behind the field where one is."""
    from orchestrator.spec import OptionError, blame, one_line, parse_override

    msg = str(e)
    if isinstance(e, OptionError):
        _fail(one_line(msg))
    msg = msg.removeprefix(f"{path}: ")
    _fail(one_line(f"{path}: {blame(msg, [parse_override(o) for o in overrides])}"))


Executor = Literal["ray", "serial"]
Format = Literal["table", "csv", "json"]
Compare = Literal["paper"]

SetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        metavar="PATH=VALUE",
        help="override the sweep file: a dotted path into it and a YAML value, e.g. grid.K=[4,8] "
        "(repeatable, applied in order; stored with the sweep)",
    ),
]


@app.command()
def launch(
    name: Annotated[str, typer.Argument(help="sweep name (sweeps/NAME.yaml) or a path to a YAML file")],
    db: DbOpt = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="print the plan; run nothing")] = False,
    json_: Annotated[
        bool, typer.Option("--json", help="with --dry-run: the plan as one JSON document on stdout")
    ] = False,
    executor: Annotated[
        Executor,
        typer.Option(
            parser=_one_of("--executor", Executor),
            help="run the jobs on Ray (a local one, or a cluster's) or one at a time in this process",
        ),
    ] = "ray",
    address: Annotated[
        str | None, typer.Option(help="Ray cluster address (default: $RAY_ADDRESS, else a local Ray)")
    ] = None,
    num_cpus: Annotated[int | None, typer.Option(help="CPUs for a local Ray")] = None,
    max_concurrent: Annotated[int | None, typer.Option(help="at most this many jobs at once")] = None,
    retry_failed: Annotated[bool, typer.Option("--retry-failed", help="run failed jobs again")] = False,
    set_: SetOpt = None,
    until: Annotated[
        str | None,
        typer.Option(
            "--until",
            metavar="STAGE",
            help="run the stages up to and including STAGE (`moesweep stages` lists them in order); "
            "with ppl_pre, the selection for distillation is stored",
        ),
    ] = None,
    only: Annotated[
        list[str] | None,
        typer.Option(
            "--only",
            metavar="CONFIG_KEY",
            help="run only the jobs this configuration needs, e.g. 'SF|RR|uniform|K=8' or teacher "
            "(repeatable; what derives from it included)",
        ),
    ] = None,
) -> None:
    """Run a named sweep, or resume it: every job that already succeeded is skipped."""
    from orchestrator.scope import Scope
    from orchestrator.spec import SpecError

    if json_ and not dry_run:
        _fail(
            "--json: only with --dry-run (a launch reports on stderr; `moesweep status NAME --json` after it)"
        )
    for option, value in (("--num-cpus", num_cpus), ("--max-concurrent", max_concurrent)):
        if value is not None and value < 1:  # 0 read as "unset" and a negative count as 1, silently
            _fail(f"{option} {value}: allowed: 1 or more")
    overrides = list(set_ or [])
    scope = Scope(until=until, only=tuple(dict.fromkeys(only or ())))
    try:
        scope.check_until()  # a typo in --until is said before the sweep is read
    except SpecError as e:
        _fail(str(e))
    spec, path, text = _spec(name, overrides)

    if dry_run:
        from orchestrator import configs as P
        from orchestrator.dryrun import dry_run as show

        try:  # the options are checked before the database is looked at
            scope.prepare(spec, P.build_configs(spec, P.stated_shape(spec)))
        except SpecError as e:
            _spec_fail(e, path, overrides)
        store = _store(db, read_only=True, missing_ok=True)
        try:
            if json_:
                from orchestrator.dryrun import plan

                _print_json(plan(spec, store, scope=scope, overrides=overrides))
            else:
                show(spec, store, out, scope=scope, overrides=overrides)
        except SpecError as e:
            _spec_fail(e, path, overrides)
        return
    from orchestrator.launch import launch as run
    from orchestrator.launch import prepare

    try:
        prepared = prepare(spec, str(path))  # every sweep-file error before the database is opened
        scope.prepare(spec, prepared[1])
    except SpecError as e:
        _spec_fail(e, path, overrides)
    ray_at = address or os.environ.get("RAY_ADDRESS")
    if executor == "ray" and ray_at:  # before the database is opened: a typo waits on nothing
        from orchestrator.execute import unreachable

        why = unreachable(ray_at)
        if why is not None:
            _fail(
                f"{'--address' if address else 'RAY_ADDRESS'} {ray_at}: {why}; start the cluster (`ray start "
                "--head`), or leave it out for a local Ray"
            )
    store = _store(db)
    if executor == "serial":
        from orchestrator.execute import SerialExecutor

        ex = SerialExecutor()
    elif executor == "ray":
        from orchestrator.execute import ClusterError, RayExecutor

        ex = RayExecutor(
            address=ray_at,
            num_cpus=num_cpus,
            max_concurrent=max_concurrent or spec.execution.max_concurrent,
        )
        if ray_at:  # a cluster is joined before any job is claimed (a local Ray starts with the first job)
            try:
                ex.connect()
            except ClusterError as e:
                _fail(f"{e}; start it (`ray start --head`), or leave it out for a local Ray")
    else:
        _fail(f"--executor {executor!r}: allowed: ray, serial")
    try:
        code = run(
            spec,
            text,
            store,
            ex,
            retry_failed=retry_failed,
            console=err,
            path=str(path),
            prepared=prepared,
            scope=scope,
        )
    except SpecError as e:
        _spec_fail(e, path, overrides)
    raise typer.Exit(code)


def _default_db_exists() -> bool:
    from db.store import home

    return (home() / "moesweep.db").exists()


@app.command()
def sweeps(db: DbOpt = None, json_: JsonOpt = False) -> None:
    """List the sweeps: the sweep files, and beside them the sweeps in the database (launched ones and
    imported reference ones) with their status and jobs done. The database is opened read-only; without
    --db and $MOESWEEP_DB, only when the default one exists."""
    store = (
        _store(db, read_only=True) if db or os.environ.get("MOESWEEP_DB") or _default_db_exists() else None
    )
    found = _sweep_list(store)
    if json_:
        _print_json({"database": store.shown if store is not None else None, "sweeps": found})
        return
    t = Table("name", "file", "status", "jobs done", "description")
    for r in found:
        jobs = r["jobs"]
        if r["kind"] == "reference":
            done = f"{r['configurations']} configurations"
        elif jobs is not None:
            done = f"{jobs['succeeded']}/{jobs['total']}" + (
                f", {jobs['failed']} failed" if jobs["failed"] else ""
            )
        else:
            done = ""
        file = r["file"] or ("(imported)" if r["kind"] == "reference" else "(no file)")
        desc = "(unreadable)" if r["unreadable"] else r["description"]
        t.add_row(r["name"], file, r["status"] or "–", done, _short(desc))
    out.print(t)
    if store is not None:
        out.print(f"database: {store.shown}", highlight=False, soft_wrap=True)


def _sweep_list(store) -> list[dict[str, Any]]:
    """The sweeps `moesweep sweeps` lists: every sweep file, then each sweep in the database without one.
    Per sweep: name, file (as shown; None: none), kind (own | reference; None: not in the database),
    status (None: no database to ask), jobs by state with their total (launched sweeps), configurations
    (in the database), description, and whether its file could not be read."""
    import yaml

    from orchestrator.spec import find_sweep, list_sweeps, sweep_dirs

    in_db = {}
    if store is not None:
        from dashboard.data import sweeps as db_sweeps

        in_db = {s.name: s for s in db_sweeps(store)}

    def row(name: str, file: str | None, s, description: str | None, unreadable: bool = False) -> dict:
        jobs = None
        if s is not None and s.kind != "reference":
            jobs = dict.fromkeys(("succeeded", "running", "dead", "failed", "pending"), 0) | s.total
            jobs["total"] = sum(jobs.values())
        status = s.status if s is not None else "not launched" if store is not None else None
        return {
            "name": name,
            "file": file,
            "kind": s.kind if s is not None else None,
            "status": status,
            "jobs": jobs,
            "configurations": s.configs if s is not None else None,
            "description": description,
            "unreadable": unreadable,
        }

    found, listed = [], set()
    for n in list_sweeps():
        f = next(d / f"{n}.yaml" for d in sweep_dirs() if os.path.lexists(d / f"{n}.yaml"))
        try:
            f = find_sweep(n)  # a FIFO, a symlink loop: never opened
            doc = yaml.safe_load(f.read_text()) or {}
            desc, name, unreadable = str(doc.get("description") or ""), str(doc.get("name") or n), False
        except Exception:  # a broken file is still listed; `launch` will explain it
            desc, name, unreadable = None, n, True
        listed.add(name)
        shown = os.path.relpath(f) if Path(os.path.realpath(f)).is_relative_to(Path.cwd()) else str(f)
        found.append(row(name, shown, in_db.get(name), desc, unreadable))
    found += [row(name, None, s, s.description) for name, s in in_db.items() if name not in listed]
    return found


def _short(text: str | None) -> str:
    return textwrap.shorten(str(text or ""), 60, placeholder=" …")


STATUS_COLUMNS = ("succeeded", "running", "dead", "failed", "pending", "stale")  # status's job counts


@app.command()
def status(name: str, db: DbOpt = None, json_: JsonOpt = False) -> None:
    """Per stage: succeeded / running / dead (running, but its launch is gone) / failed / pending, stale
    (computed by code that has changed since), duplicate (configurations served by another configuration's
    job), and the failures."""
    store = _store(db, read_only=True)
    sid = store.sweep_id(name)
    if sid is None:
        _fail(f"no sweep {name!r} in {store.shown}")
    facts = _status(store, name, sid)
    if json_:
        _print_json(facts)
        return
    t = Table("stage", *STATUS_COLUMNS, "duplicate", title=f"sweep {name}")
    for row in facts["stages"]:
        dup = row["duplicate"]
        t.add_row(row["stage"], *(str(row[c]) for c in STATUS_COLUMNS), "–" if dup is None else str(dup))
    out.print(t)
    extends, sets = facts["spec"]["extends"], facts["spec"]["set"]
    if extends or sets:
        out.print(
            "spec of the last launch: "
            + "; ".join(
                ([f"extends {' → '.join(extends)}"] if extends else [])
                + ([" ".join(f"--set {o}" for o in sets)] if sets else [])
            ),
            highlight=False,
            soft_wrap=True,
            markup=False,
        )
    out.print(
        "stale = computed by code that has changed since (the next launch recomputes what the sweep uses); "
        "duplicate = configurations served by another configuration's job (same content key)",
        soft_wrap=True,
    )
    dead = sum(row["dead"] for row in facts["stages"])
    if dead:
        out.print(
            f"dead = {dead} job(s) marked running whose launch is gone (its process ended, or no "
            "heartbeat from its host for 10 minutes): the next launch takes them over",
            soft_wrap=True,
        )
    for r in facts["to_recompute"]:
        out.print(
            f"[yellow]to recompute[/] {r['stage']} {r['key'][:12]}: {r['reason']}",
            highlight=False,
            soft_wrap=True,
        )
    c = facts["configurations"]
    out.print(
        f"configurations: {c['total']}  duplicates (share another's student): {c['duplicates']}  "
        f"selected for distillation: {c['selected_for_distill']}"
    )
    for f in facts["failures"]:
        out.print(
            f"[red]failed[/] {f['stage']} {f['key'][:12]}: {f['error']}  (log: {f['log']})", highlight=False
        )


def _status(store, name: str, sid: int) -> dict[str, Any]:
    """What `moesweep status` shows of a sweep: per stage its jobs by state (`duplicate` None where the
    stage is shared by design), the spec of the last launch (extends, --set), artifacts to recompute, the
    configurations, and per failed job its last error line and log."""
    from db.store import owner_dead
    from orchestrator.spec import spec_notes
    from orchestrator.stage import is_stale, stages

    _, jobs = store.query(
        "SELECT j.stage, j.status, j.params_json, j.code_json, j.key FROM jobs j "
        "JOIN sweep_jobs sj ON sj.job_id = j.id WHERE sj.sweep_id = :s",
        {"s": sid},
    )
    running = store.jobs(key for _, st, _, _, key in jobs if st == "running")
    dead = {k for k, r in running.items() if owner_dead(r["owner"], r["heartbeat_at"])}
    counts: dict[tuple[str, str], int] = {}
    for stage, st, params, code, key in jobs:
        col = "dead" if key in dead else "stale" if is_stale(stage, json.loads(params), code) else st
        counts[(stage, col)] = counts.get((stage, col), 0) + 1
    _, shared = store.query(
        "SELECT cj.stage, COUNT(*) - COUNT(DISTINCT cj.job_id) FROM config_jobs cj "
        "JOIN configurations c ON c.id = cj.config_id WHERE c.sweep_id = :s GROUP BY cj.stage",
        {"s": sid},
    )
    dup_by_stage = dict(shared)
    declared = {s.name: s for s in stages()}
    order = list(declared)
    per_stage = [
        {
            "stage": stage,
            **{st: counts.get((stage, st), 0) for st in STATUS_COLUMNS},
            "duplicate": None
            if stage in declared and declared[stage].shared
            else int(dup_by_stage.get(stage, 0)),
        }
        for stage in sorted(
            {s for s, _ in counts}, key=lambda s: order.index(s) if s in order else len(order)
        )
    ]
    _, spec_rows = store.query("SELECT spec_yaml FROM sweeps WHERE id = :s", {"s": sid})
    extends, sets = spec_notes(spec_rows[0][0] if spec_rows else None)
    _, stale_art = store.query(
        "SELECT j.stage, j.key, j.error FROM jobs j JOIN sweep_jobs sj ON sj.job_id = j.id "
        "WHERE sj.sweep_id = :s AND j.status = 'pending' AND j.error LIKE 'stale: %' ORDER BY j.stage",
        {"s": sid},
    )
    _, rows = store.query(
        "SELECT COUNT(*), COUNT(duplicate_of), SUM(selected_for_distill) FROM configurations "
        "WHERE sweep_id = :s",
        {"s": sid},
    )
    n, dup, sel = rows[0]
    _, fails = store.query(
        "SELECT j.stage, j.key, j.error, j.log_path FROM jobs j JOIN sweep_jobs sj ON sj.job_id = j.id "
        "WHERE sj.sweep_id = :s AND j.status = 'failed' ORDER BY j.stage",
        {"s": sid},
    )
    return {
        "sweep": name,
        "database": store.shown,
        "stages": per_stage,
        "spec": {"extends": extends, "set": sets},
        "to_recompute": [
            {"stage": stage, "key": key, "reason": error[len("stale: ") :]} for stage, key, error in stale_art
        ],
        "configurations": {"total": n, "duplicates": dup or 0, "selected_for_distill": int(sel or 0)},
        "failures": [
            {
                "stage": stage,
                "key": key,
                "error": ([ln for ln in (error or "").splitlines() if ln.strip()][-1:] or [""])[0],
                "log": log,
            }
            for stage, key, error, log in fails
        ],
    }


@app.command()
def verify(
    name: Annotated[str | None, typer.Argument(help="sweep name (default: every sweep)")] = None,
    db: DbOpt = None,
) -> None:
    """Rehash every recorded artifact (of a sweep, or all) and compare it with its record: one line per
    problem and a summary. The job that produced a changed or missing artifact is marked stale (the next
    launch recomputes it, and what read other content), and so is every job that may have read changed
    content (it recorded no hash of what it read, or another one). A device, FIFO, socket or a symlink out
    of its job's folder is refused unread. Exit 1 if anything was wrong, else 0."""
    from orchestrator.launch import stale_readers
    from workers.core.artifacts import check

    store = _store(db, create=False)  # a database that is there: a mistyped --db creates or migrates nothing
    sid = None
    if name is not None:
        sid = store.sweep_id(name)
        if sid is None:
            _fail(f"no sweep {name!r} in {store.url}")
    jobs = store.artifact_jobs(sid)
    arts = store.artifacts(j["key"] for j in jobs)
    n, bad, readers = 0, 0, 0
    for j in jobs:
        problems, changed = [], {}
        for a in arts[j["key"]]:
            n += 1
            c = check(a, full=True)
            if c.problem:
                problems.append(c.problem)
                if c.changed and a["content_hash"]:
                    changed[a["path"]] = a["content_hash"]
                out.print(f"{j['stage']} {j['key'][:12]}: {c.problem}", highlight=False, soft_wrap=True)
            elif c.mtime is not None or c.size is not None:
                store.update_artifact(a["id"], mtime=c.mtime, size_bytes=c.size)
        if problems:
            bad += 1
            store.mark_stale(
                j["key"], problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
            )
        if changed:
            for stage, key, why in stale_readers(store, j["key"], changed, f"{j['stage']} {j['key'][:8]}…"):
                readers += 1
                out.print(f"{stage} {key[:12]}: {why}; marked stale", highlight=False, soft_wrap=True)
    where = f"sweep {name}" if name else "every sweep"
    if bad:
        also = f", and {readers} job(s) that may have read changed content" if readers else ""
        out.print(
            f"{n} artifact(s) of {len(jobs)} job(s) in {where}: {bad} job(s) with a changed or missing "
            f"artifact marked stale{also}; the next launch recomputes them",
            highlight=False,
            soft_wrap=True,
        )
        raise typer.Exit(1)
    out.print(
        f"{n} artifact(s) of {len(jobs)} job(s) in {where}: all as recorded", highlight=False, soft_wrap=True
    )


@app.command("stages")
def stages_cmd() -> None:
    """The stages a sweep runs, in order, with their sweep-file section, inputs and default resources."""
    from orchestrator.stage import stages

    for s in stages():
        res = f"{s.resources.cpus:g} CPU" + (f", {s.resources.gpus:g} GPU" if s.resources.gpus else "")
        print(
            f"{s.name}: {s.summary}\n  section: {s.section or '-'}   reads: {', '.join(s.upstream) or '-'}   "
            f"records: {', '.join(sorted(s.records - {'outputs'})) or '-'}   default resources: {res}"
        )


@app.command("families")
def families_cmd() -> None:
    """The supported MoE families (a sweep's teacher must be one): model types, MoE block, routing
    semantics, the dense student's class and any output the family cannot write."""
    from workers.families import ADAPTERS

    for a in ADAPTERS:
        print(
            f"{a.name}: model_type {', '.join(a.model_types)} ({'/'.join(a.block_classes)})\n"
            f"  routing: {a.routing}\n  student: {a.student}"
        )
        for output, reason in a.refused_outputs.items():
            print(f"  refused output {output}: {reason}")


# a query that starts with a `--` comment is the query, not an unknown option
@app.command(context_settings={"ignore_unknown_options": True})
def sql(
    query: Annotated[
        str | None,
        typer.Argument(
            help='SQL, e.g. "SELECT scoring, AVG(ppl_pre) FROM results GROUP BY scoring"; - reads it from stdin',
            show_default=False,
        ),
    ] = None,
    db: DbOpt = None,
    format: Annotated[
        Format,
        typer.Option(
            "--format",
            "-f",
            parser=_one_of("--format", Format),
            help="a table, CSV (a header row, then the rows), or JSON (a list of row objects; NaN and "
            "infinities are null)",
        ),
    ] = "table",
    file: Annotated[
        Path | None, typer.Option("--file", metavar="PATH", help="read the query from this file")
    ] = None,
) -> None:
    """Run one read-only query (SELECT / WITH) against the results database and print the rows.

    The query: the argument (it may start with a -- comment), --file PATH, or - to read stdin. The database
    is opened read-only: writes, DDL, ATTACH and PRAGMA changes are refused; on PostgreSQL only queries run,
    and a login that may touch the server's files (a superuser) reads as the role moesweep_reader."""
    from db.store import StoreError

    query = _query_text(query, file)
    store = _store(db, read_only=True)
    try:
        cols, rows = store.query(query)
    except StoreError as e:
        _fail(str(e))
    if format == "csv":
        w = csv.writer(sys.stdout, lineterminator="\n")  # lines as the shell reads them (no \r)
        w.writerow(cols)
        w.writerows(rows)
    elif format == "json":
        _print_json([dict(zip(cols, r, strict=True)) for r in rows])
    elif format == "table":
        t = Table(*cols)
        for r in rows:
            t.add_row(*("" if v is None else f"{v:.6g}" if isinstance(v, float) else str(v) for v in r))
        out.print(t)


def _query_text(query: str | None, file: Path | None) -> str:
    """The query of `moesweep sql`: the argument, the --file, or stdin for `-`; one line if none or two."""
    if file is not None and query is not None:
        _fail(f"--file {file} and a query {_short(query)!r}: give one of them")
    if file is not None:
        try:
            query = file.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            _fail(f"--file {file}: not UTF-8 text; allowed: a file holding one SQL query")
        except OSError as e:
            _fail(f"--file {file}: cannot read it: {e.strerror}")
    elif query == "-":
        query = sys.stdin.read()
    if query is None:
        _fail('no query: give one, e.g. moesweep sql "SELECT 1", or --file PATH, or - to read it from stdin')
    if not query.strip():
        _fail(f"the query{f' in {file}' if file else ''} is empty; allowed: one SQL query (SELECT, WITH, …)")
    return query


@app.command()
def migrate(db: DbOpt = None) -> None:
    """Create the database, or upgrade its schema to this moesweep's revision (launch does this too)."""
    from db.store import head_revision

    store = _store(db)
    print(f"{store.shown}: schema at revision {head_revision()}")


@app.command("import-paper")
def import_paper(db: DbOpt = None) -> None:
    """Load published numbers (the core paper; the Router KD, REAP, C2F/DCDM and DOT-MoE papers) as reference sweeps
    (idempotent, one transaction)."""
    from analysis.reference import reference_sweeps

    store = _store(db)
    try:
        counts = store.import_reference(reference_sweeps())
    except ValueError as e:
        _fail(f"import-paper: {e}")
    for name, n in counts.items():
        out.print(f"{name}: {n} configurations")


@app.command()
def report(
    name: str,
    db: DbOpt = None,
    out_dir: Annotated[
        Path | None, typer.Option("--out", help="output folder (default: report/NAME)")
    ] = None,
    compare: Annotated[
        Compare | None,
        typer.Option(parser=_one_of("--compare", Compare), help="paper: our numbers beside the paper's"),
    ] = None,
) -> None:
    """LaTeX tables, PNG/PDF figures and an index for a sweep, from the database only (reads, never writes
    results; `moesweep import-paper` is what loads the paper's numbers)."""
    from analysis.derived import code_versions, code_versions_line
    from analysis.load import load_frames
    from analysis.reference import reference_sweeps
    from analysis.report import write_report

    if compare is not None and compare != "paper":
        _fail(f"--compare {compare!r}: allowed: paper")
    store = _store(db, read_only=True)
    if store.sweep_id(name) is None:
        _fail(f"no sweep {name!r} in {store.shown} (moesweep import-paper loads the paper's)")
    refs = {
        s["name"]: json.dumps(s["select"], sort_keys=True) if s.get("select") else None
        for s in reference_sweeps()
    }
    needed = [n for n in refs if compare is not None or n == name]
    stored = dict(store.query("SELECT sweep, select_json FROM sweep_info")[1])
    missing = [n for n in needed if n not in stored]
    if missing:
        _fail(
            f"reference sweeps {', '.join(missing)} are not in {store.shown}; "
            "run 'moesweep import-paper' first"
        )
    stale = [n for n in needed if stored[n] != refs[n]]
    if stale:
        _fail(
            f"reference sweeps {', '.join(stale)} were imported by an older moesweep (their stored "
            "selection rule is not the paper's); run 'moesweep import-paper' first"
        )
    target = out_dir or Path("report") / name.replace(":", "_")  # paper:x -> report/paper_x
    if target.exists() and not target.is_dir():
        _fail(f"--out {target}: exists and is not a folder; the report is a folder of tables and figures")
    try:
        frames = load_frames(store.engine, [name])
        cmp = load_frames(store.engine, list(refs)) if compare is not None else None
        arts = write_report(frames, name, target, cmp)
        line = code_versions_line(code_versions(frames.code[frames.code["sweep"] == name]))
    except ValueError as e:
        _fail(str(e))
    except OSError as e:  # a folder that cannot be made or written (permissions, a full disk)
        _fail(f"report {name}: cannot write {e.filename or target}: {e.strerror or e}")
    if line:
        err.print(
            f"[yellow]warning:[/] sweep {name}: {line} (see {target / 'index.md'})",
            highlight=False,
            soft_wrap=True,
        )
    out.print(f"{len(arts)} artefacts in {target}/ (index: {target / 'index.md'})")


@app.command()
def mirror(
    name: Annotated[str, typer.Argument(help="the sweep, by its name in the database")],
    tensorboard: Annotated[
        str | None,
        typer.Option(
            metavar="DIR", help="TensorBoard event files under DIR/NAME/STAGE/RUN (tensorboard --logdir DIR)"
        ),
    ] = None,
    wandb: Annotated[
        str | None,
        typer.Option(
            metavar="PROJECT", help="a W&B project, PROJECT or ENTITY/PROJECT (needs the wandb package)"
        ),
    ] = None,
    mlflow: Annotated[
        str | None,
        typer.Option(
            metavar="URI", help="an MLflow tracking URI; the experiment is NAME (needs the mlflow package)"
        ),
    ] = None,
    db: DbOpt = None,
) -> None:
    """Mirror the curves of a sweep's finished jobs (their stepped metrics: distillation's training loss and
    validation cross-entropy, Router KD's and DOT-MoE's losses, ...) to TensorBoard, W&B or MLflow: one run
    per job, with its configuration's fields and the job's settings as hyperparameters. Without an option,
    to the trackers of the sweep's `execution.mirror`. A job mirrored again replaces its run. The database
    is read, never written; exit 1 when a run could not be written."""
    from orchestrator.mirror import MirrorError, mirror_sweep, stored_targets, targets_of, warn

    store = _store(db, read_only=True)
    if store.sweep_id(name) is None:
        _fail(f"no sweep {name!r} in {store.shown}")
    try:
        targets = targets_of({"tensorboard": tensorboard, "wandb": wandb, "mlflow": mlflow})
        targets = targets or stored_targets(store, name)
    except MirrorError as e:
        _fail(f"mirror: {e}")
    if not targets:
        _fail(
            f"mirror: sweep {name} names no tracker in its execution.mirror; give --tensorboard DIR, "
            "--wandb PROJECT or --mlflow URI"
        )
    done, failed = mirror_sweep(store, name, targets, lambda m: warn(err, m))
    where = ", ".join(f"{t} {w}" for t, w in targets.items())
    if not done and not failed:
        out.print(
            f"sweep {name}: no finished job has curves (stepped metrics); nothing mirrored", highlight=False
        )
        return
    out.print(f"sweep {name}: {done} run(s) mirrored to {where}", highlight=False, soft_wrap=True)
    if failed:
        _fail(f"mirror: {failed} run(s) could not be written (the warnings above say why)", code=1)


@app.command()
def export(
    config_key: Annotated[str, typer.Argument(help="the configuration's key, e.g. 'SF|RR|uniform|K=8'")],
    out_dir: Annotated[Path, typer.Option("--out", help="the folder to write (absent or empty)")],
    sweep: Annotated[str | None, typer.Option(help="the sweep (needed when several have the key)")] = None,
    force: Annotated[bool, typer.Option(help="replace a folder that is not empty")] = False,
    db: DbOpt = None,
) -> None:
    """A configuration's final model as a self-contained Hugging Face folder: the checkpoint its sweep
    wrote (a distilled student, a saved evaluation model, a DOT-MoE), checked against its record, with its
    tokenizer, a model card (recipe, scores, provenance) and moesweep.json. The database is read, never
    written."""
    from orchestrator.export import ExportError
    from orchestrator.export import export as write

    store = _store(db, read_only=True)
    try:
        path = write(store, config_key, out_dir, sweep=sweep, force=force)
    except ExportError as e:
        _fail(f"export {config_key}: {e}")
    out.print(f"exported {config_key} to {path}/ (model card: {path / 'README.md'})", highlight=False)


@app.command()
def slurm(
    name: Annotated[str, typer.Argument(help="the sweep (a name or a sweep file), as `launch` takes it")],
    nodes: Annotated[
        int, typer.Option(help="nodes of the allocation (Ray: the head and nodes - 1 workers)")
    ] = 1,
    gpus_per_node: Annotated[int, typer.Option(help="GPUs per node")] = 0,
    cpus_per_node: Annotated[int, typer.Option(help="CPUs per node (Slurm's --cpus-per-task)")] = 8,
    time: Annotated[str, typer.Option(help="Slurm's --time, e.g. 12:00:00 or 2-00:00:00")] = "24:00:00",
    partition: Annotated[str | None, typer.Option(help="Slurm's --partition")] = None,
    account: Annotated[str | None, typer.Option(help="Slurm's --account")] = None,
    resource: Annotated[
        list[str] | None, typer.Option(help="a Ray custom resource per node, NAME=N (repeatable)")
    ] = None,
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="an override passed to launch (repeatable)")
    ] = None,
    out_file: Annotated[
        Path | None, typer.Option("--out", help="write the script here (default: print it)")
    ] = None,
) -> None:
    """An sbatch script that runs the sweep on a Slurm allocation: a Ray cluster (head on the first node,
    a worker per other node, by srun), `moesweep launch` against it, the cluster stopped afterwards; the
    launch's exit code is the job's. Needs MOESWEEP_DB (a database every node reaches) when it runs."""
    from orchestrator.slurm import SlurmJob, render
    from orchestrator.spec import SpecError, load_spec

    try:
        load_spec(name)  # a sweep that does not exist or does not validate fails here, not on the cluster
    except SpecError as e:
        _fail(str(e))
    resources: dict[str, float] = {}
    for r in resource or []:
        key, sep, value = r.partition("=")
        try:
            resources[key] = float(value) if sep else float("nan")
        except ValueError:
            resources[key] = float("nan")
        if not sep or not resources[key] > 0:
            _fail(f"--resource {r!r}: allowed: NAME=positive number, e.g. a100_80g=8")
    args = [a for s in set_ or [] for a in ("--set", s)]
    job = SlurmJob(
        name,
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        cpus_per_node=cpus_per_node,
        time=time,
        partition=partition,
        account=account,
        resources=resources,
        workdir=str(Path.cwd()),
        launch_args=args,
    )
    try:
        text = render(job)
    except ValueError as e:
        _fail(str(e))
    if out_file is None:
        sys.stdout.write(text)
        return
    try:
        out_file.write_text(text)
    except OSError as e:
        _fail(f"--out {out_file}: cannot write it: {e.strerror or e}")
    out.print(f"wrote {out_file}: submit it with sbatch {out_file}", highlight=False)


@app.command()
def compress(
    model: Annotated[
        str, typer.Argument(help="the MoE to compress: a Hugging Face model id or a local folder")
    ],
    out_dir: Annotated[Path, typer.Option("--out", help="the folder to write the compressed model to")],
    output: Annotated[str, typer.Option(help="dense, moe (pruned), merged or edited")] = "moe",
    scoring: Annotated[
        str | None, typer.Option(help="for dense or moe: how experts are scored (REAP…)")
    ] = None,
    merging: Annotated[str | None, typer.Option(help="for merged: HC-SMoE or M-SMoE")] = None,
    editing: Annotated[str | None, typer.Option(help="for edited: MoBE, TD-MoE…")] = None,
    k: Annotated[int, typer.Option("--K", help="experts kept per layer (the budget of K for edited)")] = 0,
    data: Annotated[
        str, typer.Option(help="calibration text: hf:PATH, hf:PATH/NAME (a dataset's config) or jsonl:FILE")
    ] = ("hf:Salesforce/wikitext/wikitext-103-raw-v1"),
    n_samples: Annotated[int, typer.Option(help="calibration windows")] = 128,
    seq_len: Annotated[int, typer.Option(help="tokens per calibration window")] = 2048,
    ppl: Annotated[
        bool, typer.Option(help="measure the held-out perplexity too (the data's test split)")
    ] = True,
    dtype: Annotated[str, typer.Option(help="the teacher's dtype")] = "bfloat16",
    force: Annotated[bool, typer.Option(help="replace a folder that is not empty")] = False,
    executor: Annotated[str, typer.Option(help="ray or serial")] = "serial",
    db: DbOpt = None,
) -> None:
    """One compressed model instead of a sweep: calibrate MODEL, convert it to OUTPUT with one method and K
    (the same stages a sweep runs, as a one-configuration sweep in the database), and write the student
    with its tokenizer, a model card and moesweep.json to --out."""
    from orchestrator.compress import Request
    from orchestrator.compress import compress as run_compress
    from orchestrator.execute import RayExecutor, SerialExecutor
    from orchestrator.export import ExportError
    from orchestrator.spec import SpecError

    methods = [m for m in (scoring, merging, editing) if m is not None]
    if len(methods) > 1:
        _fail("give one of --scoring, --merging, --editing (the method of the output)")
    if executor not in ("ray", "serial"):
        _fail(f"--executor {executor!r}: allowed: ray, serial")
    req = Request(
        model=model,
        out=out_dir.resolve(),
        output=output,
        method=methods[0] if methods else None,
        K=k,
        data=data,
        n_samples=n_samples,
        seq_len=seq_len,
        ppl=ppl,
        dtype=dtype,
    )
    store = _store(db)
    try:
        path = run_compress(
            req, store, SerialExecutor() if executor == "serial" else RayExecutor(), err, force
        )
    except (ExportError, SpecError, ValueError) as e:
        _fail(f"compress {model}: {e}")
    out.print(f"wrote {path}/ (model card: {path / 'README.md'})", highlight=False)


@app.command()
def serve(
    db: DbOpt = None,
    host: Annotated[
        str, typer.Option(help="address to listen on (loopback by default: the dashboard has no login)")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port to listen on (0: any free port)")] = 8765,
) -> None:
    """A read-only web dashboard: sweeps and their live progress, results, reports, configurations, jobs
    and their logs, and the paper's numbers beside ours. The database is opened read-only."""
    from dashboard.server import ServeError, bind, make_server

    if not 0 <= port <= 65535:
        _fail(f"--port {port}: allowed: 0 to 65535")
    store = _store(db, read_only=True)
    try:
        sock = bind(host, port)
    except ServeError as e:
        _fail(str(e))
    shown = f"[{host}]" if ":" in host else host
    err.print(
        f"moesweep dashboard on http://{shown}:{sock.getsockname()[1]}/ (database {store.shown}, "
        "read-only); Ctrl-C stops it",
        highlight=False,
        soft_wrap=True,
    )
    make_server(store, sock, host=host).run(sockets=[sock])


if __name__ == "__main__":
    app()
