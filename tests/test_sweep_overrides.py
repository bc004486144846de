"""`--set PATH=VALUE` overrides, `extends: NAME` sweep files, and sweep files that are hostile or odd (too
deep, huge values, a name with a newline, a FIFO, a symlink loop): each problem is one line naming the file
or the option, the field and what is allowed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from db.store import Store
from orchestrator.cli import app
from orchestrator.spec import SpecError, load_spec, spec_hash, spec_notes
from tests.test_orchestrator import HERE, fake, fake_sweep  # noqa: F401  (the fake stage functions)

ROOT = Path(__file__).resolve().parents[1]


def error_line(args: list[str]) -> str:
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2, (args, res.output, res.exception)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), (args, res.stderr[:2000])
    return lines[0]


# ---- --set -------------------------------------------------------------------------------------------
def test_overrides_apply_in_order_and_the_effective_spec_is_the_stored_text():
    sets = ["grid.K=[4,8]", "distill.settings.steps=50", "grid.K=[8]", "execution.resources.ppl_pre.cpus=3"]
    spec, path, text = load_spec("tiny", sets)
    assert spec.grid.K == [8] and spec.distill.settings["steps"] == 50
    assert spec.distill.settings["batch_size"] == 8  # the rest of the mapping is the file's
    assert spec.resources("ppl_pre").cpus == 3
    assert spec_notes(text) == ([], sets)
    # the stored text is a sweep file as it is: the same spec, and no longer the file's text or hash
    f = Path(path).read_text()
    expected = yaml.safe_load(f)
    expected["grid"]["K"] = [8]
    expected["distill"]["settings"]["steps"] = 50
    expected["execution"]["resources"]["ppl_pre"] = {"cpus": 3}
    assert yaml.safe_load(text) == expected
    assert spec_hash(text) != spec_hash(f)
    assert load_spec("tiny")[2] == f and spec_notes(f) == ([], [])  # no override: the file's text, as before


def test_an_override_does_not_change_what_a_yaml_alias_shares_elsewhere(tmp_path):
    sweep = fake_sweep(
        tmp_path,
        (HERE / "sweeps" / "fake.yaml").read_text()
        + "ppl: {data: &d {source: tiny, split: test}}\nrouter_kd: {data: *d}\n",
    )
    spec, _, _ = load_spec(str(sweep), ["ppl.data.split=valid"])
    assert spec.ppl.data.split == "valid" and spec.router_kd.data.split == "test"


@pytest.mark.parametrize(
    "sets, expect",
    [
        (
            ["grid.K"],
            "error: --set grid.K: expected PATH=VALUE, a dotted path into the sweep file and a YAML value",
        ),
        (["grid.K=[4,"], "error: --set grid.K=[4,: the value is not valid YAML: expected the node content"),
        (["grid..K=4"], "error: --set grid..K=4: 'grid..K' is not a dotted path"),
        (["extends=tiny"], "error: --set extends=tiny: extends is read from a sweep file only"),
        (
            ["gird.K=[4]"],
            "{f}: --set gird.K=[4]: gird: unknown key; allowed: name, description, select, baselines, execution, teacher",
        ),
        (
            ["grid.colour=[red]"],
            "{f}: --set grid.colour=[red]: grid.colour: unknown key; allowed: settings, output",
        ),
        (["grid.K=['4']"], "{f}: --set grid.K=['4']: grid.K.0: Input should be a valid integer (got '4')"),
        (
            ["grid.K.x=4"],
            "{f}: --set grid.K.x=4: grid.K is a list of 2; 'x' is not an index of it (allowed: 0 to 1)",
        ),
        (
            ["calibration.n_samples.x=1"],
            "{f}: --set calibration.n_samples.x=1: calibration.n_samples is 4, not a mapping",
        ),
        (
            ["grid.K=[16]"],
            "{f}: --set grid.K=[16]: grid.K: 16 exceeds the number of experts (8); allowed: 2 ≤ K ≤ 8",
        ),
        (
            ["distill.settings.lr_schedule=x"],
            "{f}: --set distill.settings.lr_schedule=x: distill.settings: lr_schedule: unknown key; allowed: batch_size",
        ),
        (
            ["grid.K=[2]", "baselines=[d2d]"],
            "{f}: with --set grid.K=[2] --set baselines=[d2d]: (top level): baseline 'd2d' needs a dense_teacher",
        ),
        (["name=x/y"], "{f}: --set name=x/y: name: 'x/y' is not a sweep name"),
    ],
)
def test_a_bad_override_is_one_line_naming_it(tmp_path, monkeypatch, sets, expect):
    monkeypatch.chdir(tmp_path)
    sweep = fake_sweep(tmp_path)
    db = tmp_path / "db" / "r.db"
    args = [a for s in sets for a in ("--set", s)]
    for extra in (["--dry-run"], ["--executor", "serial"]):
        line = error_line(["launch", str(sweep), "--db", f"sqlite:///{db}", *args, *extra])
        assert line.startswith(expect.replace("{f}", f"error: {sweep}")), line
    assert not db.parent.exists()


def test_the_dry_run_plans_the_overridden_sweep(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(
        app, ["launch", "tiny", "--dry-run", "--set", "grid.K=[4]", "--set", "grid.scoring=[SF]"]
    )
    assert res.exit_code == 0, res.output
    assert "1 scoring × 5 grouping × 2 dp_scaling × 1 K" in res.stdout
    assert "with --set grid.K=[4] --set grid.scoring=[SF]" in res.stdout
    assert "│ convert       │ 10 " in res.stdout


def test_overrides_are_stored_and_a_launch_without_them_replaces_the_spec(fake, tmp_path):  # noqa: F811
    """The sweep is its name: launched with --set and later without, it is one sweep whose spec is the last
    launch's, as when its file is edited between launches (jobs are content-keyed: nothing is lost)."""
    calls, state = fake
    state["fail"] = False
    sweep, db = str(state["sweep"]), state["db"]
    base = ["launch", sweep, "--executor", "serial", "--db", db, "--until", "ppl_pre"]
    res = CliRunner().invoke(app, [*base, "--set", "grid.K=[4]", "--set", "grid.scoring=[SF]"])
    assert res.exit_code == 0, res.output
    ppl = {k for s, k in calls if s == "ppl_pre"}
    status = CliRunner().invoke(app, ["status", "fake", "--db", db])
    assert "spec of the last launch: --set grid.K=[4] --set grid.scoring=[SF]" in status.stdout
    (text,) = Store(db).query("SELECT spec_yaml FROM sweeps WHERE name = 'fake'")[1][0]
    assert spec_notes(text)[1] == ["grid.K=[4]", "grid.scoring=[SF]"]
    assert yaml.safe_load(text)["grid"]["K"] == [4]

    again = CliRunner().invoke(app, [*base, "--set", "grid.K=[4]", "--set", "grid.scoring=[SF]"])
    assert "differs from the last launch's" not in again.stderr  # the same spec: nothing to say

    calls.clear()
    res = CliRunner().invoke(app, base)
    assert res.exit_code == 0, res.output
    assert "sweep fake: its spec differs from the last launch's" in res.stderr  # said in one line
    assert not ppl & {k for _, k in calls}  # the overridden sweep's jobs are reused
    (text, digest) = Store(db).query("SELECT spec_yaml, spec_hash FROM sweeps WHERE name = 'fake'")[1][0]
    assert text == Path(sweep).read_text() and digest == spec_hash(text)
    status = CliRunner().invoke(app, ["status", "fake", "--db", db])
    assert "spec of the last launch" not in status.stdout


# ---- extends -------------------------------------------------------------------------------------------
@pytest.fixture
def sweeps(tmp_path, monkeypatch):
    """A folder of sweep files that $MOESWEEP_SWEEPS names; write(name, text) adds one."""
    d = tmp_path / "mine"
    d.mkdir()
    monkeypatch.setenv("MOESWEEP_SWEEPS", str(d))

    def write(name: str, text: str) -> Path:
        f = d / f"{name}.yaml"
        f.write_text(text)
        return f

    return write


def test_extends_merges_mappings_and_replaces_lists(sweeps):
    sweeps(
        "small",
        "extends: tiny\nname: small\ngrid: {K: [4]}\ndistill: {settings: {steps: 5}}\nbaselines: [teacher]\n",
    )
    sweeps("smaller", "extends: small\nname: smaller\ngrid: {scoring: [SF]}\nselect: null\n")
    tiny, _, _ = load_spec("tiny")
    spec, path, text = load_spec("smaller")
    assert spec.name == "smaller" and spec.description == tiny.description
    assert spec.grid.scoring == ["SF"] and spec.grid.K == [4] and spec.grid.grouping == tiny.grid.grouping
    assert spec.distill.settings == {**tiny.distill.settings, "steps": 5}  # merged key by key
    assert spec.baselines == ["teacher"] and spec.select is None  # a list, or null, replaces
    assert spec_notes(text) == (["small", "tiny"], [])
    assert load_spec(str(path), ["grid.K=[8]"])[0].grid.K == [8]  # --set applies to the merged spec


def test_a_file_extending_the_sweep_of_its_own_name_extends_the_next_one(sweeps, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sweeps").mkdir()
    (tmp_path / "sweeps" / "tiny.yaml").write_text("extends: tiny\nname: tiny\ngrid: {K: [4]}\n")
    spec, path, _ = load_spec("tiny")
    assert path == Path.cwd() / "sweeps" / "tiny.yaml" and spec.grid.K == [4] and spec.grid.scoring


@pytest.mark.parametrize(
    "files, launched, expect",
    [
        ({"a": "extends: nope\nname: a\n"}, "a", "{a}: extends: no sweep named 'nope'; known: a,"),
        (
            {"a": "extends: b\nname: a\n", "b": "extends: a\nname: b\n"},
            "a",
            "{b}: extends: 'a' leads back to {a} (a cycle: {a} → {b} → {a})",
        ),
        ({"a": "extends: a\nname: a\n"}, "a", "{a}: extends: 'a' is this file itself (a cycle)"),
        (
            {"a": "extends: [tiny]\nname: a\n"},
            "a",
            "{a}: extends: expected the name of a sweep or a path to its file",
        ),
        ({"a": "extends: tiny\ngrid: {K: [4]}\n"}, "a", "{a}: name: required (a sweep that extends 'tiny'"),
        ({"a": "extends: ./gone.yaml\nname: a\n"}, "a", "{a}: extends: {d}/gone.yaml: no such file"),
        (
            {"a": "extends: b\nname: a\n", "b": "- x\n"},
            "a",
            "{b}: expected a mapping at the top level (extended by {a})",
        ),
        (
            {"a": "extends: tiny\nname: a\ngrid: {K: [64]}\n"},
            "a",
            "{a}: grid.K: 64 exceeds the number of experts (32)",
        ),
    ],
)
def test_a_bad_extends_is_one_line(sweeps, tmp_path, monkeypatch, files, launched, expect):
    monkeypatch.chdir(tmp_path)
    paths = {name: sweeps(name, text) for name, text in files.items()}
    line = error_line(["launch", launched, "--dry-run"])
    want = expect.format(d=paths[launched].parent, **paths)
    assert line.startswith(f"error: {want}"), line


# ---- robustness ------------------------------------------------------------------------------------------
def _deep(n: int) -> str:
    return "name: x\nteacher: " + "[" * n + "]" * n + "\n"


@pytest.mark.parametrize(
    "text, expect",
    [
        (_deep(3000), "nested too deeply to read; a sweep file nests at most 50 levels"),
        (
            "name: x\nteacher:\n" + "".join("  " * (i + 1) + "a:\n" for i in range(3000)),
            "nested too deeply to read",
        ),
        (_deep(60), "teacher: nested more than 50 levels deep"),
        (
            "name: x\na: &a [x, x, x, x, x, x, x, x, x, x]\n"
            + "".join(
                f"{c}: &{c} [{', '.join([f'*{p}'] * 10)}]\n" for p, c in zip("abcdef", "bcdefg", strict=True)
            ),
            "g: more than 1,000,000 values once its YAML aliases are expanded",
        ),
        ("name: x\nteacher: &t {tiny: *t}\n", "teacher: a YAML alias that contains itself"),
        ('name: "micro\\n"\n', "name: 'micro\\n' is not a sweep name"),
    ],
    ids=["3000 deep (flow)", "3000 deep (block)", "60 deep", "aliases", "recursive alias", "newline"],
)
def test_a_hostile_sweep_file_is_one_short_line(tmp_path, text, expect):
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    line = error_line(["launch", str(f), "--dry-run"])
    assert line.startswith(f"error: {f}: ") and expect in line, line[:500]
    assert len(line) < 400


@pytest.mark.parametrize(
    "text, expect",
    [
        ("name: '" + "A" * 5_000_000 + "'\n", "name: 'AAAA"),
        (
            "name: x\nteacher: {source: '" + "B" * 5_000_000 + "'}\ngrid: {K: [2]}\n",
            "Input should be 'tiny' or 'hf' (got 'BBB",
        ),
        (
            "name: x\nteacher: {source: tiny}\ngrid: {K: '" + "1 " * 3_000_000 + "'}\n",
            "grid.K: Input should be a valid list (got '1 1 1",
        ),
        (
            "name: x\nteacher: {source: tiny}\ngrid: {scoring: [" + "Z" * 5_000_000 + "], K: [2]}\n",
            "unknown scoring 'ZZZ",
        ),
        (
            "name: x\nteacher: {source: tiny}\ngrid: {K: [2], scoring: [SF], grouping: [RR], dp_scaling: [uniform]}\n"
            "evaluate: {suite: " + "Q" * 5_000_000 + "}\n",
            "evaluate.suite: unknown suite 'QQQ",
        ),
    ],
    ids=["name", "literal", "list", "axis value", "a stage's own message"],
)
def test_a_huge_value_is_echoed_cut(tmp_path, text, expect):
    f = tmp_path / "huge.yaml"
    f.write_text(text)
    line = error_line(["launch", str(f), "--dry-run"])
    assert expect in line and "…" in line and len(line) < 1200, line[:2000]


def test_a_sweep_path_that_is_a_fifo_or_a_symlink_says_what_it_is(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    os.mkfifo(tmp_path / "fifo.yaml")
    (tmp_path / "loop.yaml").symlink_to(tmp_path / "loop.yaml")
    (tmp_path / "broken.yaml").symlink_to(tmp_path / "nothing.yaml")
    (tmp_path / "sweeps").mkdir()
    os.mkfifo(tmp_path / "sweeps" / "named.yaml")
    cases = {
        "fifo.yaml": "fifo.yaml: not a regular file (a FIFO); expected a sweep YAML file",
        "loop.yaml": "loop.yaml: a symlink loop; expected a sweep YAML file",
        "broken.yaml": f"broken.yaml: a broken symlink (to '{tmp_path / 'nothing.yaml'}')",
        "named": f"{tmp_path / 'sweeps' / 'named.yaml'}: not a regular file (a FIFO)",
    }
    for name, expect in cases.items():
        line = error_line(["launch", name, "--dry-run"])
        assert expect in line, line
    with pytest.raises(SpecError, match="not a regular file"):
        load_spec(str(tmp_path / "fifo.yaml"))


def test_an_empty_moesweep_home_is_unset(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MOESWEEP_DB", raising=False)
    monkeypatch.setenv("MOESWEEP_HOME", "")
    res = CliRunner().invoke(app, ["launch", str(ROOT / "tests" / "sweeps" / "micro.yaml"), "--dry-run"])
    assert res.exit_code == 0, res.output
    assert res.stderr.strip() == (
        f"no database at {tmp_path / '.moesweep' / 'moesweep.db'} yet: planned as for a new one (nothing created)"
    )


def test_an_empty_moesweep_home_is_unset_for_the_store_too(tmp_path, monkeypatch):
    from db.store import home

    monkeypatch.chdir(tmp_path)
    for value in ("", "  "):
        monkeypatch.setenv("MOESWEEP_HOME", value)
        assert home() == tmp_path / ".moesweep"  # not the current folder itself
