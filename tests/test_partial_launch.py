"""Partial launches (`--until STAGE`, `--only CONFIG_KEY`) with fake stage functions: they run what they
name and what it reads, store the selection a full launch would make, and a later full launch reuses every
job they ran and ends where a full launch from scratch ends."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from db.store import Store
from orchestrator import dryrun
from orchestrator.cli import app
from orchestrator.scope import Scope
from orchestrator.spec import OptionError, load_spec
from tests.test_orchestrator import HERE, _launch, fake, fake_sweep  # noqa: F401  (the fake stage functions)

SF_RR = ("SF|RR|uniform|K=2", "SF|RR|uniform|K=4")  # one selection group: scoring SF, grouping RR


def snapshot(store: Store) -> dict[str, list[tuple]]:
    """Everything a launch decides, by key (not by row id, which depends on the order of insertion)."""
    q = store.query
    return {
        "configurations": q(
            "SELECT c.config_key, d.config_key, c.selected_for_distill, c.plan_key, c.distill_tokens, "
            "c.variant, v.config_key FROM configurations c LEFT JOIN configurations d ON d.id = c.duplicate_of "
            "LEFT JOIN configurations v ON v.id = c.variant_of ORDER BY c.config_key"
        )[1],
        "links": q(
            "SELECT c.config_key, cj.stage, j.key FROM config_jobs cj JOIN configurations c ON c.id = cj.config_id "
            "JOIN jobs j ON j.id = cj.job_id ORDER BY c.config_key, cj.stage"
        )[1],
        "jobs": q("SELECT key, stage, status FROM jobs ORDER BY key")[1],
    }


def full(state: dict, sweep: Path, tmp_path: Path, label: str) -> tuple[Store, dict]:
    """A full launch from scratch in a database of its own: what a partial launch is compared with."""
    url, state["db"] = state["db"], f"sqlite:///{tmp_path}/{label}.db"  # the fake distillation reads it
    try:
        store = Store(state["db"])
        assert _launch(store, sweep) == 0
    finally:
        state["db"] = url
    return store, snapshot(store)


def test_until_ppl_pre_stores_the_selection_and_a_full_launch_reuses_it(fake, tmp_path):  # noqa: F811  (the imported fixture)
    calls, state = fake
    state["fail"] = False
    _, reference = full(state, state["sweep"], tmp_path, "reference")
    calls.clear()

    store = Store(state["db"])
    assert _launch(store, state["sweep"], scope=Scope(until="ppl_pre")) == 0
    assert {s for s, _ in calls} == {"calibrate", "convert", "ppl_pre"}  # nothing after ppl_pre ran
    # the selection is made and stored: the configurations a full launch distils
    selected = store.query("SELECT config_key FROM configurations WHERE selected_for_distill = 1 ORDER BY 1")[
        1
    ]
    assert selected == [r[:1] for r in reference["configurations"] if r[2] == 1]
    ran = {k for _, k in calls}

    calls.clear()
    assert _launch(store, state["sweep"]) == 0
    assert not ran & {k for _, k in calls}  # nothing the partial launch ran runs again
    assert {s for s, _ in calls} == {"distill", "evaluate"}
    assert snapshot(store) == reference


def test_only_runs_a_configuration_its_selection_group_and_what_it_reads(fake, tmp_path):  # noqa: F811  (the imported fixture)
    calls, state = fake
    state["fail"] = False
    _, reference = full(state, state["sweep"], tmp_path, "reference")
    picked = {r[0] for r in reference["configurations"] if r[2] == 1}
    winner = next(k for k in SF_RR if k in picked)
    loser = next(k for k in SF_RR if k not in picked)
    jobs_of = {(c, st): k for c, st, k in reference["links"]}
    calls.clear()

    store = Store(state["db"])
    assert _launch(store, state["sweep"], scope=Scope(only=(loser,))) == 0
    # its group's conversions and perplexities (what the selection compares), none of any other configuration
    assert sorted(k for s, k in calls if s == "convert") == sorted({jobs_of[(c, "convert")] for c in SF_RR})
    assert sorted(k for s, k in calls if s == "ppl_pre") == sorted({jobs_of[(c, "ppl_pre")] for c in SF_RR})
    assert not [
        s for s, _ in calls if s in ("distill", "evaluate")
    ]  # the rule does not pick it: not distilled
    assert store.query(
        "SELECT selected_for_distill FROM configurations WHERE config_key = :k", {"k": winner}
    )[1] == [(1,)]

    calls.clear()
    assert _launch(store, state["sweep"], scope=Scope(only=(winner,))) == 0
    # the winner of the group is distilled and evaluated; its conversion and perplexity are reused
    assert sorted(s for s, _ in calls) == ["distill", "evaluate"]
    assert {k for _, k in calls} == {jobs_of[(winner, "distill")], jobs_of[(winner, "evaluate")]}
    done = {k for k, _, status in snapshot(store)["jobs"] if status == "succeeded"}

    calls.clear()
    assert _launch(store, state["sweep"]) == 0
    assert not done & {k for _, k in calls}
    assert snapshot(store) == reference


def test_only_a_baseline_and_the_teacher(fake, tmp_path):  # noqa: F811  (the imported fixture)
    calls, state = fake
    state["fail"] = False
    store = Store(state["db"])
    assert _launch(store, state["sweep"], scope=Scope(only=("baseline:random_ffn", "teacher"))) == 0
    # no conversion: a baseline's student is not converted, and a baseline is always distilled
    assert sorted(s for s, _ in calls) == ["distill", "evaluate", "evaluate", "ppl_pre", "ppl_pre"]
    linked = store.query(
        "SELECT DISTINCT c.config_key FROM config_jobs cj JOIN configurations c ON c.id = cj.config_id ORDER BY 1"
    )[1]
    assert linked == [("baseline:random_ffn",), ("teacher",)]


def test_a_seed_repeat_runs_the_calibration_it_reads(fake, tmp_path):  # noqa: F811  (the imported fixture)
    """A seed repeat of an --only configuration reads a calibration planned under a label of its own (no
    configuration names it): it runs before the repeat's conversion."""
    calls, state = fake
    state["fail"] = False
    sweep = fake_sweep(tmp_path, (HERE / "sweeps" / "fake.yaml").read_text() + "seeds: [1, 2]\n")
    _, reference = full(state, sweep, tmp_path, "reference")
    picked = {r[0] for r in reference["configurations"] if r[2] == 1 and r[5] is None}
    winner = next(k for k in SF_RR if k in picked)
    calls.clear()

    store = Store(state["db"])
    assert _launch(store, sweep, scope=Scope(only=(winner,))) == 0
    assert len([k for s, k in calls if s == "calibrate"]) == 2  # the sweep's and the repeat's seed
    states = dict(
        store.query(
            "SELECT c.config_key, j.status FROM config_jobs cj JOIN configurations c ON c.id = cj.config_id "
            "JOIN jobs j ON j.id = cj.job_id WHERE cj.stage = 'evaluate'"
        )[1]
    )
    assert states == {winner: "succeeded", f"{winner}|seed=2": "succeeded"}
    calls.clear()
    assert _launch(store, sweep) == 0
    assert snapshot(store) == reference


def test_unknown_stage_or_configuration_is_one_line_and_creates_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sweep = fake_sweep(tmp_path)
    db = tmp_path / "db" / "r.db"
    for args, expect in (
        (
            ["--until", "distil"],
            "error: --until 'distil': unknown stage; allowed: teacher, dense_teacher, calibrate",
        ),
        (
            ["--only", "SF|RR|uniform|K=3"],
            "error: --only 'SF|RR|uniform|K=3': sweep fake has no such configuration; e.g. SF|RR|uniform|K=2",
        ),
        (
            ["--only", "SF|RR|uniform|K=2|variant=0"],
            "error: --only 'SF|RR|uniform|K=2|variant=0': a configuration derived from 'SF|RR|uniform|K=2'",
        ),
    ):
        for extra in ([], ["--dry-run"]):
            res = CliRunner().invoke(
                app, ["launch", str(sweep), "--executor", "serial", "--db", f"sqlite:///{db}", *args, *extra]
            )
            assert res.exit_code == 2, res.output
            lines = res.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith(expect), lines
    assert not (tmp_path / "db").exists()


def test_dry_run_of_a_partial_launch():
    spec, _, _ = load_spec("tiny")
    every = [r["stage"] for r in dryrun.plan_counts(spec)[0]]
    rows = {r["stage"]: r for r in dryrun.plan_counts(spec, scope=Scope(until="ppl_pre"))[0]}
    assert list(rows) == every[: every.index("select") + 1]  # up to ppl_pre, and the selection it allows
    only = {r["stage"]: r for r in dryrun.plan_counts(spec, scope=Scope(only=("SF|RR|uniform|K=4",)))[0]}
    assert only["convert"]["distinct"] == 6  # its group: SF × RR over K × dp_scaling
    assert only["select"]["distinct"] == 1 and "dense_teacher" not in only
    with pytest.raises(OptionError, match="unknown stage"):
        dryrun.plan_counts(spec, scope=Scope(until="nope"))


def test_the_note_names_the_sweep_as_launch_finds_it_again(tmp_path, monkeypatch):
    """`moesweep launch X` in a partial launch's note: the name where it finds this very file, else the
    file's path (a sweep file elsewhere, or one `moesweep compress` wrote)."""
    from orchestrator.spec import relaunch_name

    folder = tmp_path / "sweeps"
    folder.mkdir()
    monkeypatch.setenv("MOESWEEP_SWEEPS", str(folder))
    monkeypatch.chdir(tmp_path)
    (folder / "mine.yaml").write_text("name: mine\n")
    other = tmp_path / "my files" / "mine.yaml"  # the same name, another file (and a space in its path)
    other.parent.mkdir()
    other.write_text("name: mine\n")
    elsewhere = tmp_path / "compress" / "compress-x.yaml"
    elsewhere.parent.mkdir()
    elsewhere.write_text("name: compress-x\n")
    assert relaunch_name("mine", folder / "mine.yaml") == "mine"
    assert relaunch_name("mine", Path("sweeps") / "mine.yaml") == "mine"  # relative, the same file
    assert relaunch_name("mine", other) == f"'{other}'"
    assert relaunch_name("compress-x", elsewhere) == str(elsewhere)
    assert relaunch_name("mine", None) == "mine"


def test_the_note_repeats_the_overrides_of_the_partial_launch(fake, tmp_path):  # noqa: F811  (the imported fixture)
    """A partial launch with --set: the note's command relaunches the same effective sweep (its file's path,
    each --set quoted for the shell), so the rest it runs is the rest of this sweep."""
    from rich.console import Console
    from sweep_runs import launch_serial

    _, state = fake
    state["fail"] = False
    spec, path, text = load_spec(str(state["sweep"]), ["grid.K=[2, 4]", "description=a b"])
    console = Console(record=True, width=400)
    code = launch_serial(spec, text, Store(state["db"]), path, console=console, scope=Scope(until="convert"))
    assert code == 0
    (line,) = [ln for ln in console.export_text().splitlines() if ln.startswith("partial launch")]
    assert line.endswith(
        f"`moesweep launch {path.resolve()} --set 'grid.K=[2, 4]' --set 'description=a b'` runs the rest and "
        "reuses every job done"
    ), line
