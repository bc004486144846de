"""Output for scripts: `--json` on status, sweeps and a dry run (one strict JSON document on stdout, holding
what the table shows), `sql --format json` strict too, the options' choices in --help and a bad one in one
line, shell completion, and the pandas / parquet recipe of docs/database.md run as written."""

from __future__ import annotations

import datetime
import json
import os
import re
from decimal import Decimal
from pathlib import Path

import pandas as pd
import pytest
from rich.console import Console
from sqlalchemy.exc import OperationalError
from typer.testing import CliRunner

import orchestrator.cli as cli
from db.store import Store
from orchestrator import dryrun
from orchestrator.cli import app
from orchestrator.scope import Scope
from orchestrator.spec import load_spec
from tests.test_orchestrator import fake, fake_sweep  # noqa: F401  (the fake stage functions fixture)

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()
COUNTS = ("succeeded", "running", "dead", "failed", "pending", "stale")


def strict(text: str):
    """The one JSON document `text` is, read as JSON is written: NaN and Infinity refused (Python's json
    reads them; JSON has no such tokens), and so is anything after the document."""

    def refuse(token: str):
        raise ValueError(f"not JSON: {token}")

    return json.loads(text, parse_constant=refuse)


def cells(stdout: str) -> list[list[str]]:
    """The body rows of the rich table(s) in `stdout`, as stripped cells."""
    return [[c.strip() for c in ln.split("│")[1:-1]] for ln in stdout.splitlines() if ln.startswith("│")]


def flat(text: str) -> str:
    return " ".join(text.split())


@pytest.fixture
def wide(monkeypatch):
    """Tables as wide as their rows (no cell wraps), so a row is one line."""
    monkeypatch.setattr(cli, "out", Console(width=500))


def launched(state, *extra: str) -> str:
    """The fake sweep launched serially through the CLI (state['fail']: its CP K=4 conversions fail)."""
    db = state["db"]
    res = runner.invoke(app, ["launch", str(state["sweep"]), "--executor", "serial", "--db", db, *extra])
    assert res.exit_code == (1 if state["fail"] else 0), res.output
    return db


# ---- status ---------------------------------------------------------------------------------------------
def test_status_json_holds_what_the_table_shows(fake, wide):  # noqa: F811
    calls, state = fake
    db = launched(state, "--set", "grid.K=[2,4]")
    store = Store(db)
    calibrate = store.query("SELECT key FROM jobs WHERE stage = 'calibrate'")[1][0][0]
    assert store.mark_stale(calibrate, "stats.safetensors changed")
    convert = store.query("SELECT key FROM jobs WHERE stage = 'convert' AND status = 'succeeded' LIMIT 1")[1][
        0
    ][0]
    with store.tx() as c:  # a job whose launch is gone (no heartbeat for two hours)
        c.exec_driver_sql(
            "UPDATE jobs SET status = 'running', owner = 'elsewhere:1', "
            "heartbeat_at = datetime('now', '-2 hours') WHERE key = ?",
            (convert,),
        )

    human = runner.invoke(app, ["status", "fake", "--db", db])
    res = runner.invoke(app, ["status", "fake", "--db", db, "--json"])
    assert human.exit_code == 0 and res.exit_code == 0, (human.output, res.output)
    assert res.stderr == ""
    doc = strict(res.stdout)
    assert doc["sweep"] == "fake" and doc["database"] == store.shown

    table = {c[0]: c[1:] for c in cells(human.stdout)}
    as_json = {
        s["stage"]: [str(s[k]) for k in COUNTS] + ["–" if s["duplicate"] is None else str(s["duplicate"])]
        for s in doc["stages"]
    }
    assert as_json == table and list(as_json) == list(table)  # the same rows, in the same order
    by_stage = {s["stage"]: s for s in doc["stages"]}
    assert by_stage["convert"]["dead"] == 1 and by_stage["convert"]["failed"] == 2
    assert by_stage["calibrate"]["pending"] == 1 and by_stage["calibrate"]["duplicate"] is None  # shared
    assert "dead = 1 job(s) marked running" in flat(human.stdout)

    assert doc["spec"] == {"extends": [], "set": ["grid.K=[2,4]"]}
    assert "spec of the last launch: --set grid.K=[2,4]" in human.stdout
    assert doc["to_recompute"] == [
        {"stage": "calibrate", "key": calibrate, "reason": "stats.safetensors changed"}
    ]
    assert f"to recompute calibrate {calibrate[:12]}: stats.safetensors changed" in human.stdout

    n = re.search(
        r"configurations: (\d+)  duplicates \(.*\): (\d+)  selected for distillation: (\d+)", human.stdout
    )
    c = doc["configurations"]
    assert [str(c["total"]), str(c["duplicates"]), str(c["selected_for_distill"])] == list(n.groups())
    assert c["total"] > 0 and c["selected_for_distill"] > 0

    failed = store.query("SELECT stage, key, log_path FROM jobs WHERE status = 'failed' ORDER BY stage, key")[
        1
    ]
    got = sorted((f["stage"], f["key"], f["log"]) for f in doc["failures"])
    assert got == sorted(tuple(r) for r in failed) and len(got) == 2
    for f in doc["failures"]:
        assert f["error"] == "ValueError: boom: a deliberately failing method"
        assert flat(f"failed {f['stage']} {f['key'][:12]}: {f['error']}  (log: {f['log']})") in flat(
            human.stdout
        )


def test_status_json_of_an_unknown_sweep_is_one_line(tmp_path):
    db = f"sqlite:///{tmp_path / 'r.db'}"
    Store(db).engine.dispose()
    res = runner.invoke(app, ["status", "nope", "--db", db, "--json"])
    assert res.exit_code == 2 and res.stdout == ""
    assert res.stderr == f"error: no sweep 'nope' in {tmp_path / 'r.db'}\n"


# ---- sweeps ---------------------------------------------------------------------------------------------
def test_sweeps_json_holds_what_the_table_shows(fake, wide, tmp_path, monkeypatch):  # noqa: F811
    from analysis.reference import reference_sweeps

    calls, state = fake
    db = launched(state)
    store = Store(db)
    store.import_reference(reference_sweeps()[:1])
    extra = tmp_path / "extra"
    extra.mkdir()
    (extra / "broken.yaml").write_text("name: [unclosed\n")
    monkeypatch.setenv("MOESWEEP_SWEEPS", str(extra))

    human = runner.invoke(app, ["sweeps", "--db", db])
    res = runner.invoke(app, ["sweeps", "--db", db, "--json"])
    assert human.exit_code == 0 and res.exit_code == 0, (human.output, res.output)
    assert res.stderr == ""
    doc = strict(res.stdout)
    assert doc["database"] == store.shown
    by = {s["name"]: s for s in doc["sweeps"]}
    assert len(by) == len(doc["sweeps"])

    total, failed = store.query(
        "SELECT COUNT(*), SUM(j.status = 'failed') FROM jobs j JOIN sweep_jobs sj ON sj.job_id = j.id "
        "JOIN sweeps s ON s.id = sj.sweep_id WHERE s.name = 'fake'"
    )[1][0]
    fake_row = by["fake"]
    assert fake_row["file"] is None and fake_row["kind"] == "own" and fake_row["status"] == "failed"
    assert fake_row["jobs"]["total"] == total and fake_row["jobs"]["failed"] == failed == 2
    assert fake_row["jobs"]["succeeded"] == total - failed
    assert (
        fake_row["configurations"]
        == store.query("SELECT COUNT(*) FROM results WHERE sweep = 'fake'")[1][0][0]
    )
    assert fake_row["description"] == "orchestrator tests with fake stage functions (no model is loaded)"
    paper = by[reference_sweeps()[0]["name"]]
    assert paper["kind"] == "reference" and paper["status"] == "reference" and paper["jobs"] is None
    assert paper["file"] is None and paper["configurations"] > 0
    assert by["tiny"]["status"] == "not launched" and by["tiny"]["kind"] is None
    assert by["tiny"]["file"].endswith("tiny.yaml") and by["tiny"]["jobs"] is None
    assert by["broken"]["unreadable"] and by["broken"]["description"] is None
    assert not by["tiny"]["unreadable"]

    table = {c[0]: c[1:] for c in cells(human.stdout)}
    assert list(table) == list(by)  # the same sweeps, in the same order
    assert table["fake"][:3] == ["(no file)", "failed", f"{total - failed}/{total}, 2 failed"]
    assert table[paper["name"]][:3] == [
        "(imported)",
        "reference",
        f"{paper['configurations']} configurations",
    ]
    assert table["tiny"][1:3] == ["not launched", ""] and table["broken"][3] == "(unreadable)"
    for name, s in by.items():
        assert table[name][1] == s["status"], name


def test_sweeps_json_without_a_database(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MOESWEEP_DB", raising=False)
    monkeypatch.setenv("MOESWEEP_HOME", str(tmp_path / "home"))
    res = runner.invoke(app, ["sweeps", "--json"])
    assert res.exit_code == 0 and res.stderr == "", res.output
    doc = strict(res.stdout)
    assert doc["database"] is None and doc["sweeps"]
    assert all(s["status"] is None and s["kind"] is None and s["jobs"] is None for s in doc["sweeps"])
    assert not (tmp_path / "home").exists()


# ---- a dry run ------------------------------------------------------------------------------------------
SETS = ["grid.K=[4]", "grid.scoring=[SF]"]


def test_dry_run_json_holds_the_plan_the_table_shows(tmp_path, monkeypatch, wide):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MOESWEEP_DB", raising=False)
    monkeypatch.setenv("MOESWEEP_HOME", str(tmp_path / "home"))
    args = ["launch", "tiny", "--dry-run", *(a for s in SETS for a in ("--set", s))]
    human = runner.invoke(app, args)
    res = runner.invoke(app, [*args, "--json"])
    assert human.exit_code == 0 and res.exit_code == 0, (human.output, res.output)
    # the warning stays on stderr; stdout is the document alone
    assert res.stderr.startswith(f"no database at {tmp_path / 'home' / 'moesweep.db'} yet")
    doc = strict(res.stdout)

    spec, _, _ = load_spec("tiny", SETS)
    rows, _ = dryrun.plan_counts(spec)
    assert [(s["stage"], s["named"], s["distinct"], s["note"]) for s in doc["stages"]] == [
        (r["stage"], *(n if isinstance(n, int) else None for n in (r["named"], r["distinct"])), r["note"])
        for r in rows
    ]
    for s in doc["stages"]:
        assert s["shared"] == (None if s["named"] is None else s["named"] - s["distinct"])
    convert = next(s for s in doc["stages"] if s["stage"] == "convert")
    assert (convert["named"], convert["distinct"], convert["shared"]) == (10, 10, 0)
    calibrate = next(s for s in doc["stages"] if s["stage"] == "calibrate")
    assert calibrate["distinct"] == 1 and calibrate["shared"] == calibrate["named"] - 1 > 0

    table = [c for c in cells(human.stdout) if c[0]]
    assert [c[:3] for c in table] == [
        [s["stage"], *("–" if s[k] is None else str(s[k]) for k in ("named", "distinct"))]
        for s in doc["stages"]
    ]
    assert doc["sweep"] == "tiny" and doc["overrides"] == SETS
    assert "with --set grid.K=[4] --set grid.scoring=[SF]" in human.stdout
    assert doc["grids"][0]["scoring"] == 1 and doc["grids"][0]["K"] == 1
    grids = "; ".join(" × ".join(f"{n} {a}" for a, n in g.items()) for g in doc["grids"])
    t = doc["teacher"]
    assert (
        f"tiny: teacher {t['label']} (E={t['num_experts']}, k={t['top_k']}, from the {t['shape_from']}); {grids}"
        in human.stdout
    )
    assert doc["partial"] is None and doc["already_done"] is None


def test_dry_run_json_of_a_partial_launch_against_a_database(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    db = tmp_path / "r.db"
    shown = Store(f"sqlite:///{db}").shown
    res = runner.invoke(
        app, ["launch", "tiny", "--dry-run", "--json", "--until", "ppl_pre", "--db", f"sqlite:///{db}"]
    )
    assert res.exit_code == 0 and res.stderr == "", res.output
    doc = strict(res.stdout)
    spec, _, _ = load_spec("tiny")
    rows, keys = dryrun.plan_counts(spec, scope=Scope(until="ppl_pre"))
    assert [s["stage"] for s in doc["stages"]] == [r["stage"] for r in rows]
    assert doc["already_done"] == {"database": shown, "succeeded": 0, "planned": len(keys)}
    assert doc["partial"] == {"scope": Scope(until="ppl_pre").describe(), "compared_configurations": 0}


def test_json_without_dry_run_is_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = runner.invoke(app, ["launch", "tiny", "--json", "--db", f"sqlite:///{tmp_path / 'r.db'}"])
    assert res.exit_code == 2 and res.stdout == ""
    assert res.stderr.startswith("error: --json: only with --dry-run") and res.stderr.count("\n") == 1
    assert os.listdir(tmp_path) == []


# ---- strict JSON ----------------------------------------------------------------------------------------
def non_finite_db(path: Path) -> str:
    """A database whose sweep 'tiny' has three configurations: ppl_pre 12.5, inf and NaN (as the Store
    writes them: NULL, with their kind), and a sweep 'other' the recipe must leave out."""
    s = Store(f"sqlite:///{path}")
    for sweep, values in (("tiny", (12.5, float("inf"), float("nan"))), ("other", (7.0,))):
        sid = s.upsert_sweep(sweep, spec_yaml=f"name: {sweep}")
        jobs = [{"key": f"{sweep}{i}", "stage": "ppl_pre", "params": {"i": i}} for i in range(len(values))]
        ids = s.register_jobs(sid, jobs)
        configs = [
            {
                "config_key": f"c{i}",
                "model": "m",
                "kind": "moe2dense",
                "scoring": "SF",
                "grouping": "RR",
                "dp_scaling": "uniform",
                "K": 4 + i,
                "top_k": 2,
            }
            for i in range(len(values))
        ]
        cids = s.upsert_configs(sid, configs)
        s.link([(cids[f"c{i}"], "ppl_pre", ids[f"{sweep}{i}"]) for i in range(len(values))])
        for i, v in enumerate(values):
            assert s.claim(f"{sweep}{i}", "me")
            s.finish(f"{sweep}{i}", "me", {"metrics": [{"name": "ppl", "stage": "pre", "value": v}]}, 1.0)
    s.engine.dispose()
    return f"sqlite:///{path}"


def test_sql_json_is_strict(tmp_path):
    db = non_finite_db(tmp_path / "r.db")
    res = runner.invoke(
        app,
        [
            "sql",
            "SELECT 1e999 AS up, -1e999 AS down, 0.25 AS q, NULL AS none, 'NaN' AS s",
            "-f",
            "json",
            "--db",
            db,
        ],
    )
    assert res.exit_code == 0, res.output
    assert strict(res.stdout) == [{"up": None, "down": None, "q": 0.25, "none": None, "s": "NaN"}]
    res = runner.invoke(
        app,
        [
            "sql",
            "SELECT config_key, ppl_pre, ppl_pre_kind FROM results WHERE sweep = 'tiny' ORDER BY config_key",
            "--format",
            "json",
            "--db",
            db,
        ],
    )
    assert res.exit_code == 0, res.output
    assert strict(res.stdout) == [
        {"config_key": "c0", "ppl_pre": 12.5, "ppl_pre_kind": "finite"},
        {"config_key": "c1", "ppl_pre": None, "ppl_pre_kind": "inf"},
        {"config_key": "c2", "ppl_pre": None, "ppl_pre_kind": "nan"},
    ]


def test_sql_json_is_strict_on_postgresql(pg_database):
    url = pg_database("cli_json")
    Store(url).engine.dispose()
    query = (
        "SELECT 'NaN'::float8 AS nan, 'Infinity'::float8 AS inf, '-Infinity'::float8 AS ninf, "
        "'NaN'::numeric AS dnan, 2.50::numeric AS half, 3::numeric AS three, 0.1::float8 AS tenth"
    )
    res = runner.invoke(app, ["sql", query, "--format", "json", "--db", url])
    assert res.exit_code == 0, res.output
    assert strict(res.stdout) == [
        {"nan": None, "inf": None, "ninf": None, "dnan": None, "half": 2.5, "three": 3, "tenth": 0.1}
    ]


def test_every_json_output_is_strict(capsys):
    when = datetime.datetime(2024, 5, 1, 12, 30)
    cli._print_json(
        {
            "floats": [float("nan"), float("inf"), -float("inf"), 1.5],
            "nested": {"t": (1, float("nan")), 2: Decimal("sNaN")},
            "decimals": [Decimal("NaN"), Decimal("Infinity"), Decimal("2.50"), Decimal("1E+1")],
            "when": when,
        }
    )
    text = capsys.readouterr().out
    assert text.endswith("}\n")
    assert strict(text) == {
        "floats": [None, None, None, 1.5],
        "nested": {"t": [1, None], "2": None},
        "decimals": [None, None, 2.5, 10],
        "when": str(when),
    }


# ---- choices and completion -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "command, shown", [("launch", "<ray|serial>"), ("sql", "<table|csv|json>"), ("report", "<paper>")]
)
def test_an_options_choices_are_listed_in_help(command, shown):
    res = runner.invoke(app, [command, "--help"])
    assert res.exit_code == 0, res.output
    assert shown in res.stdout


def test_every_commands_help_renders():
    """Help text is rich markup: a bracket in it (`hf:PATH[/NAME]` was read as a closing tag) must not turn
    `--help` into a traceback, for any command or subcommand."""
    import typer.main

    group = typer.main.get_command(app)
    paths = []
    for name, cmd in sorted(group.commands.items()):
        paths.append([name])
        paths += [[name, sub] for sub in sorted(getattr(cmd, "commands", {}))]
    assert ["compress"] in paths and len(paths) >= 10
    for path in paths:
        res = runner.invoke(app, [*path, "--help"])
        assert res.exit_code == 0 and "Usage" in res.stdout, (path, res.output[-600:])


@pytest.mark.parametrize(
    "args, line",
    [
        (["status"], "moesweep status: Missing argument 'name'. (see moesweep status --help)"),
        (["status", "x", "--bogus"], "moesweep status: No such option: --bogus (see moesweep status --help)"),
        (["launch", "tiny", "--K"], "moesweep launch: No such option: --K (see moesweep launch --help)"),
        (
            ["launch", "tiny", "--max-concurrent"],
            "moesweep launch: Option '--max-concurrent' requires an argument. (see moesweep launch --help)",
        ),
        (["nosuch"], "moesweep: No such command 'nosuch'. (see moesweep --help)"),
        (["--bogus"], "moesweep: No such option: --bogus (see moesweep --help)"),
    ],
)
def test_a_command_line_the_commands_cannot_take_is_one_line(args, line, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = runner.invoke(app, args, prog_name="moesweep")
    assert res.exit_code == 2 and res.stderr == f"error: {line}\n" and res.stdout == "", res.output
    assert os.listdir(tmp_path) == []


def test_a_bare_moesweep_still_shows_its_help():
    res = runner.invoke(app, [], prog_name="moesweep")
    assert res.exit_code == 2 and "Usage: moesweep" in res.stdout and "launch" in res.stdout
    assert "error" not in res.stderr


def test_a_value_not_among_the_choices_is_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    db = f"sqlite:///{tmp_path / 'r.db'}"
    for args, line in (
        (
            ["launch", "tiny", "--executor", "local", "--db", db],
            "error: --executor 'local': allowed: ray, serial",
        ),
        (["report", "tiny", "--compare", "theirs", "--db", db], "error: --compare 'theirs': allowed: paper"),
        (["sql", "SELECT 1", "-f", "xml", "--db", db], "error: --format 'xml': allowed: table, csv, json"),
        (
            ["launch", "tiny", "--max-concurrent", "0", "--db", db],
            "error: --max-concurrent 0: allowed: 1 or more",
        ),
        (["launch", "tiny", "--num-cpus", "-2", "--db", db], "error: --num-cpus -2: allowed: 1 or more"),
    ):
        res = runner.invoke(app, args)
        assert res.exit_code == 2 and res.stderr == line + "\n" and res.stdout == "", (args, res.output)
    assert os.listdir(tmp_path) == []  # refused before any database is opened


def complete(words: str) -> list[str]:
    """What bash's completion function (from --show-completion) gets for the command line `words`."""
    res = runner.invoke(
        app,
        [],
        prog_name="moesweep",
        env={
            "_MOESWEEP_COMPLETE": "complete_bash",
            "COMP_WORDS": words,
            "COMP_CWORD": str(len(words.split(" ")) - 1),
        },
    )
    assert res.exit_code == 0 and res.stderr == "", res.output
    return res.stdout.split()


def test_shell_completion(monkeypatch):
    res = runner.invoke(app, ["--help"])
    assert "--install-completion" in res.stdout and "--show-completion" in res.stdout
    monkeypatch.setenv("_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION", "1")  # name the shell, not detect it
    res = runner.invoke(app, ["--show-completion", "bash"], prog_name="moesweep")
    assert res.exit_code == 0, res.output
    assert "_MOESWEEP_COMPLETE=complete_bash" in res.stdout
    assert "complete -o default -F _moesweep_completion moesweep" in res.stdout
    monkeypatch.delenv("_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION")
    assert {"status", "stages"} <= set(complete("moesweep st")) and "sql" not in complete("moesweep st")
    assert complete("moesweep sql --format ") == ["table", "csv", "json"]
    assert complete("moesweep launch tiny --executor ") == ["ray", "serial"]
    assert complete("moesweep report tiny --compare ") == ["paper"]
    assert "--json" in complete("moesweep status tiny --j")
    assert complete("moesweep sql --format xml --d") == [
        "--db"
    ]  # a bad value: no error line while completing


# ---- the pandas / parquet recipe of docs/database.md ----------------------------------------------------
def recipe() -> str:
    text = (ROOT / "docs" / "database.md").read_text(encoding="utf-8")
    section = text[text.index("## Scripting") :]
    start = section.index("```python\n") + len("```python\n")
    return section[start : section.index("```", start)]


def test_the_pandas_recipe_runs_as_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MOESWEEP_DB", raising=False)
    monkeypatch.delenv("MOESWEEP_HOME", raising=False)  # the default database: ./.moesweep/moesweep.db
    non_finite_db(tmp_path / ".moesweep" / "moesweep.db")
    code = recipe()
    assert "mode=ro&uri=true" in code and "to_parquet" in code

    ns: dict = {}
    exec(compile(code, "docs/database.md", "exec"), ns)
    df = ns["df"]
    assert sorted(df["config_key"]) == ["c0", "c1", "c2"] and set(df["sweep"]) == {"tiny"}
    by = df.set_index("config_key")
    assert by.loc["c0", "ppl_pre"] == 12.5 and by[["ppl_pre"]].loc[["c1", "c2"]].isna().all().all()
    assert list(by.loc[["c0", "c1", "c2"], "ppl_pre_kind"]) == ["finite", "inf", "nan"]
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "results.parquet"), df)

    # the recipe's engine is read-only: a write is refused and nothing changes
    with pytest.raises(OperationalError, match="readonly"):
        with ns["engine"].begin() as conn:
            conn.exec_driver_sql("DELETE FROM sweeps")
    ns["engine"].dispose()
    assert Store(None, read_only=True).query("SELECT COUNT(*) FROM sweeps")[1] == [(2,)]

    # the CSV route: moesweep sql --format csv ... > results.csv, read back
    res = runner.invoke(app, ["sql", "--format", "csv", "SELECT * FROM results WHERE sweep = 'tiny'"])
    assert res.exit_code == 0, res.output
    assert "\r" not in res.stdout and res.stdout.count("\n") == len(df) + 1  # `| tail -1` gives a clean value
    (tmp_path / "results.csv").write_text(res.stdout)
    back = pd.read_csv(tmp_path / "results.csv")
    assert list(back.columns) == list(df.columns) and len(back) == len(df)
    assert back.set_index("config_key")["ppl_pre"].loc["c0"] == 12.5


def test_the_recipes_url_reads_an_absolute_path(tmp_path):
    from sqlalchemy import create_engine, text

    db = tmp_path / "data" / "moesweep.db"
    db.parent.mkdir()
    non_finite_db(db)
    engine = create_engine(f"sqlite:///file:{db}?mode=ro&uri=true")
    with engine.connect() as conn:
        df = pd.read_sql(
            text("SELECT config_key FROM results WHERE sweep = :sweep"), conn, params={"sweep": "other"}
        )
    engine.dispose()
    assert df["config_key"].tolist() == ["c0"]
