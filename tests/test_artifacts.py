"""Artifacts are checked before they are used again: the fake stages write real small files (teacher
folder, calibration statistics, plans, students, lm-eval results) and read their inputs' files, failing
on a corrupt one as a real stage would. A changed, truncated or deleted artifact makes the next launch
recompute its producer (and what read other content), say so in one line, and end with the results of an
undisturbed run; `moesweep verify` finds what size and mtime cannot."""

from __future__ import annotations

import hashlib
import importlib
import io
import json
import os
import re
import shutil
import time
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from db.store import Store
from orchestrator.cli import app
from orchestrator.execute import SerialExecutor
from orchestrator.launch import launch
from orchestrator.spec import load_spec
from tests.test_orchestrator import fake, fake_sweep  # noqa: F401  (the fake stage functions fixture)
from workers.core.artifacts import record

TINY = (
    "teacher: {source: tiny, tiny: {experts: 8, top_k: 2, hidden: 16, layers: 1, heads: 2, kv_heads: 1, "
    "moe_intermediate: 8, vocab: 512}}"
)


# ---- fake stages that write and read real files ----------------------------------------------------
def _write(path: Path, body: str, salt: str) -> None:
    """body, its checksum, and a salt (a nondeterministic producer writes other bytes each time)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{body}\n#sum={hashlib.sha256(body.encode()).hexdigest()}\n#salt={salt:>24}\n")


def _read(path: str | Path) -> str:
    """A stage reading its input: a corrupt or truncated file fails it (with a confusing error)."""
    text = Path(path).read_text()
    body, _, rest = text.partition("\n#sum=")
    if rest[:64] != hashlib.sha256(body.encode()).hexdigest():
        raise ValueError(f"unexpected end of data in {Path(path).name}")
    return body


def _body(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest() * 8


@pytest.fixture
def arts(fake, monkeypatch):  # noqa: F811  (the fixture imported above)
    """`fake` with artifacts: each stage reads its inputs' files and writes its own."""
    calls, state = fake
    state.update(salt=False, sabotage=False)
    orig = {
        n: getattr(importlib.import_module(f"workers.run.{n}"), f"stage_{n}")
        for n in ("calibrate", "convert", "ppl_pre", "distill", "evaluate")
    }

    def salt() -> str:
        return str(time.time_ns()) if state["salt"] else "0"

    def teacher_body(p) -> str:
        return (
            _read(Path(p["inputs"]["teacher"]["path"]) / "weights.bin") if "teacher" in p["inputs"] else "hf"
        )

    def teacher(p, cache, progress):
        calls.append(("teacher", p["key"]))
        out = Path(p["workdir"]) / "model"
        _write(out / "weights.bin", _body("weights", p["params"]), salt())
        _write(out / "config.json", _body("config", p["params"]), "0")
        return {"outputs": {"path": str(out)}, "artifacts": [record("model", out)]}

    def calibrate(p, cache, progress):
        rec = orig["calibrate"](p, cache, progress)
        path = Path(p["workdir"]) / "stats.safetensors"
        _write(path, _body("stats", p["params"]["n_samples"], teacher_body(p)[:8]), salt())
        rec["outputs"]["stats"] = str(path)
        return {**rec, "artifacts": [record("calibration_stats", path)]}

    def convert(p, cache, progress):
        stats = _read(p["inputs"]["calibrate"]["stats"])
        q = p["params"]
        if state["sabotage"] and q["scoring"] == "CP" and q["K"] == 4:
            state["sabotage"] = False  # a disk hiccup deletes the statistics once, mid-stage
            os.remove(p["inputs"]["calibrate"]["stats"])
            raise OSError("transient")
        rec = orig["convert"](p, cache, progress)
        path = Path(p["workdir"]) / "plan.json"
        _write(path, _body("plan", rec["outputs"]["plan_key"], stats[:8]), salt())
        rec["outputs"]["plan_path"] = str(path)
        return {**rec, "artifacts": [record("plan", path)]}

    def ppl_pre(p, cache, progress):
        if "convert" in p["inputs"]:
            _read(p["inputs"]["convert"]["plan_path"])
        teacher_body(p)
        return orig["ppl_pre"](p, cache, progress)

    def distill(p, cache, progress):
        if "convert" in p["inputs"]:
            _read(p["inputs"]["convert"]["plan_path"])
        teacher_body(p)
        rec = orig["distill"](p, cache, progress)
        out = Path(p["workdir"]) / "student"
        _write(out / "model.safetensors", _body("student", p["params"]["student"]) * 4, salt())
        _write(out / "config.json", _body("student config"), "0")
        rec["outputs"]["path"] = str(out)
        return {**rec, "artifacts": [record("student", out)]}

    def evaluate(p, cache, progress):
        if "distill" in p["inputs"]:
            _read(Path(p["inputs"]["distill"]["path"]) / "model.safetensors")
        rec = orig["evaluate"](p, cache, progress)
        path = Path(p["workdir"]) / "results.json"
        _write(path, _body("lm-eval", rec["metrics"]), salt())
        return {**rec, "artifacts": [record("lm_eval_results", path)]}

    for name, fn in dict(
        teacher=teacher,
        calibrate=calibrate,
        convert=convert,
        ppl_pre=ppl_pre,
        distill=distill,
        evaluate=evaluate,
    ).items():
        monkeypatch.setattr(f"workers.run.{name}.stage_{name}", fn)
    state["fail"] = False
    return calls, state


def _launch(store: Store, sweep: Path, **kw) -> tuple[int, list[str]]:
    spec, path, text = load_spec(str(sweep))
    buf = io.StringIO()
    code = launch(
        spec,
        text,
        store,
        SerialExecutor(),
        console=Console(file=buf, width=300),
        show_progress=False,
        path=str(path),
        **kw,
    )
    lines = [ln for ln in buf.getvalue().splitlines() if "recomputing" in ln]
    return code, lines


def _results(store: Store) -> list[tuple]:
    return store.query(
        "SELECT c.config_key, r.ppl_pre, r.ppl_pre_kind, r.ppl_post, r.avg_acc, "
        "r.selected_for_distill, r.duplicate_of IS NOT NULL FROM results r "
        "JOIN configurations c ON c.id = r.config_id ORDER BY c.config_key"
    )[1]


def _reference(tmp_path: Path, sweep: Path) -> list[tuple]:
    """The results of an undisturbed run of the same sweep, in a database and home of their own."""
    old = os.environ["MOESWEEP_HOME"]
    os.environ["MOESWEEP_HOME"] = str(tmp_path / "ref_home")
    try:
        store = Store(f"sqlite:///{tmp_path}/ref.db")
        assert _launch(store, sweep)[0] == 0
        return _results(store)
    finally:
        os.environ["MOESWEEP_HOME"] = old


def _path(store: Store, kind: str) -> Path:
    return Path(
        store.query("SELECT path FROM artifacts WHERE kind = :k ORDER BY id LIMIT 1", {"k": kind})[1][0][0]
    )


def _stages_run(calls, since: int) -> list[str]:
    return [s for s, _ in calls[since:]]


def _tiny_sweep(tmp_path: Path) -> Path:
    text = (Path(__file__).parent / "sweeps" / "fake.yaml").read_text()
    text = re.sub(r"^teacher: .*$", TINY, text, flags=re.M)
    return fake_sweep(tmp_path, text)


# ---- the cases ---------------------------------------------------------------------------------------
def test_overwritten_statistics_same_size_are_recomputed_and_nothing_else(arts, tmp_path):
    calls, state = arts
    store = Store(state["db"])
    assert _launch(store, state["sweep"])[0] == 0
    before = _results(store)
    stats = _path(store, "calibration_stats")
    good = stats.read_bytes()
    time.sleep(0.05)  # past the file system's timestamp tick
    stats.write_bytes(b"x" * len(good))  # same size, other bytes: found by hash because mtime moved
    n = len(calls)
    code, lines = _launch(store, state["sweep"])
    assert code == 0
    assert len(lines) == 1 and re.fullmatch(
        r"calibrate [0-9a-f]{8}…: stats\.safetensors changed since it was recorded \(same size, content hash "
        r"[0-9a-f]{8}… → [0-9a-f]{8}…\); recomputing",
        lines[0],
    ), lines
    assert _stages_run(calls, n) == ["calibrate"]  # recomputed with the same content: the rest stays valid
    assert stats.read_bytes() == good
    assert _results(store) == before == _reference(tmp_path, state["sweep"])
    n = len(calls)
    assert _launch(store, state["sweep"]) == (0, []) and len(calls) == n  # and nothing runs again


def test_restored_mtime_is_caught_by_verify(arts, tmp_path):
    calls, state = arts
    store = Store(state["db"])
    assert _launch(store, state["sweep"])[0] == 0
    before = _results(store)
    stats = _path(store, "calibration_stats")
    st = stats.stat()
    stats.write_bytes(b"y" * st.st_size)
    os.utime(stats, ns=(st.st_atime_ns, st.st_mtime_ns))  # size and mtime as recorded: only a hash tells
    n = len(calls)
    assert _launch(store, state["sweep"]) == (0, []) and len(calls) == n  # the cheap check cannot see it
    r = CliRunner().invoke(app, ["verify", "fake", "--db", state["db"]])
    assert r.exit_code == 1, r.output
    problems = [ln for ln in r.output.splitlines() if "changed" in ln and "artifact(s)" not in ln]
    assert len(problems) == 1 and problems[0].startswith("calibrate ") and "stats.safetensors" in problems[0]
    assert "1 job(s) with a changed or missing artifact marked stale" in r.output
    status = store.query("SELECT status, error FROM jobs WHERE stage = 'calibrate'")[1]
    assert status[0][0] == "pending" and status[0][1].startswith("stale: stats.safetensors changed")
    r = CliRunner().invoke(app, ["status", "fake", "--db", state["db"]])
    assert any(
        ln.startswith("to recompute calibrate ") and "stats.safetensors changed" in ln
        for ln in r.output.splitlines()
    ), r.output
    code, lines = _launch(store, state["sweep"])
    assert (
        code == 0
        and len(lines) == 1
        and lines[0].startswith("calibrate ")
        and "stats.safetensors" in lines[0]
    )
    assert _stages_run(calls, n) == ["calibrate"]
    assert _results(store) == before == _reference(tmp_path, state["sweep"])
    r = CliRunner().invoke(app, ["verify", "--db", state["db"]])
    assert r.exit_code == 0 and "all as recorded" in r.output, r.output


def test_truncated_statistics_and_student(arts, tmp_path):
    calls, state = arts
    store = Store(state["db"])
    assert _launch(store, state["sweep"])[0] == 0
    before = _results(store)
    stats = _path(store, "calibration_stats")
    size = stats.stat().st_size
    with open(stats, "r+b") as f:
        f.truncate(size // 2)
    student = _path(store, "student") / "model.safetensors"
    with open(student, "r+b") as f:
        f.truncate(10)
    n = len(calls)
    code, lines = _launch(store, state["sweep"])
    assert code == 0
    assert len(lines) == 2, lines
    assert re.fullmatch(
        rf"calibrate [0-9a-f]{{8}}…: stats\.safetensors changed since it was recorded "
        rf"\(size {size} → {size // 2}\); recomputing",
        lines[0],
    ), lines
    assert lines[1].startswith("distill ") and "student/ changed since it was recorded (size" in lines[1]
    assert sorted(_stages_run(calls, n)) == [
        "calibrate",
        "distill",
    ]  # same content again: evaluate stays valid
    assert _results(store) == before == _reference(tmp_path, state["sweep"])


def test_deleted_teacher_folder_recomputes_it_and_everything_that_read_other_weights(arts, tmp_path):
    calls, state = arts
    sweep = _tiny_sweep(tmp_path)
    store = Store(state["db"])
    state["salt"] = True  # training is not bit-reproducible here: a retrained teacher has other bytes
    assert _launch(store, sweep)[0] == 0
    before = _results(store)
    first = [s for s, _ in calls]
    teacher = _path(store, "model")
    shutil.rmtree(teacher)
    n = len(calls)
    code, lines = _launch(store, sweep)
    assert code == 0
    assert re.fullmatch(
        r"teacher [0-9a-f]{8}…: model is missing \(recorded at .*\); recomputing", lines[0]
    ), lines
    assert teacher.is_dir()
    # everything that read the teacher, and what read what was recomputed, ran again: the whole sweep
    assert sorted(_stages_run(calls, n)) == sorted(first)
    assert all("its input" in ln and "was recomputed with other content" in ln for ln in lines[1:])
    assert len(lines) == len(first)  # one line per job: the teacher, then each job that read other content
    assert _results(store) == before == _reference(tmp_path, sweep)
    # a teacher retrained to the same bytes: only the teacher runs again, its readers stay valid
    state["salt"] = False
    shutil.rmtree(teacher)
    assert _launch(store, sweep)[0] == 0  # (from salted bytes to unsalted ones: everything once more)
    shutil.rmtree(teacher)
    n = len(calls)
    code, lines = _launch(store, sweep)
    assert code == 0 and len(lines) == 1 and lines[0].startswith("teacher ")
    assert _stages_run(calls, n) == ["teacher"]
    assert _results(store) == before


def test_an_artifact_broken_mid_launch_is_recomputed_before_it_is_read(arts, tmp_path):
    calls, state = arts
    store = Store(state["db"])
    state["sabotage"] = True  # the first CP K=4 conversion deletes the statistics, then fails once
    code, lines = _launch(store, state["sweep"])
    assert code == 0
    assert len(lines) == 1 and re.fullmatch(
        r"calibrate [0-9a-f]{8}…: stats\.safetensors is missing \(recorded at .*\); recomputing", lines[0]
    ), lines
    assert [s for s, _ in calls].count("calibrate") == 2
    assert store.query("SELECT COUNT(*) FROM jobs WHERE status <> 'succeeded'")[1] == [(0,)]
    assert _results(store) == _reference(tmp_path, state["sweep"])


def test_fingerprints_of_files_and_folders(tmp_path):
    """Size and mtime of a folder cover every file in it (added, removed, changed); a safetensors file is
    hashed by its content, whatever order its header's keys were written in; a hash recorded over the raw
    bytes (before that) still matches."""
    import struct

    from workers.core.artifacts import check, content_hash, stat

    d = tmp_path / "model"
    _write(d / "a.bin", "a" * 100, "0")
    row = record("model", d)
    assert check(row).problem is None and not check(row).hashed  # size and mtime as recorded: no hash
    time.sleep(0.05)  # past the file system's timestamp tick (a change within it shows only to `verify`)
    (d / "extra.txt").write_text("")  # an empty file added: the size is the same, the folder's mtime moved
    c = check(row)
    assert c.hashed and "model/ changed since it was recorded (same size" in c.problem
    (d / "extra.txt").unlink()
    c = check(row)
    assert c.problem is None and c.mtime is not None and c.mtime != row["mtime"]  # same content: new mtime
    assert (
        stat(tmp_path / "nowhere") is None
        and "is missing" in check({**row, "path": str(tmp_path / "x")}).problem
    )

    def safetensors(meta_order: list[str]) -> bytes:
        header = {
            "__metadata__": {k: "v" + k for k in meta_order},
            "t": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
        }
        blob = json.dumps(header).encode()
        return struct.pack("<Q", len(blob)) + blob + b"\0\0\x80?"

    f = tmp_path / "stats.safetensors"
    f.write_bytes(safetensors(["a", "b", "c"]))
    raw, canon = content_hash(f, canonical=False), content_hash(f)
    g = tmp_path / "other.safetensors"
    g.write_bytes(safetensors(["c", "a", "b"]))
    assert content_hash(g) == canon and content_hash(g, canonical=False) != raw
    legacy = {**record("calibration_stats", f), "content_hash": raw, "mtime": None}
    assert check(legacy).problem is None  # a raw-bytes hash recorded before still matches
    f.write_bytes(safetensors(["a", "b", "c"])[:-1] + b"@")
    assert "changed since it was recorded" in check(legacy).problem


def test_verify_names_a_deleted_student_and_refuses_an_unknown_sweep(arts):
    calls, state = arts
    store = Store(state["db"])
    assert _launch(store, state["sweep"])[0] == 0
    r = CliRunner().invoke(app, ["verify", "fake", "--db", state["db"]])
    assert r.exit_code == 0 and "all as recorded" in r.output, r.output
    student = _path(store, "student")
    shutil.rmtree(student)
    r = CliRunner().invoke(app, ["verify", "--db", state["db"]])
    assert r.exit_code == 1
    lines = r.output.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("distill ") and "student is missing" in lines[0], r.output
    n = len(calls)
    code, said = _launch(store, state["sweep"])
    assert code == 0 and len(said) == 1 and said[0].startswith("distill ") and student.is_dir()
    assert _stages_run(calls, n) == ["distill"]
    r = CliRunner().invoke(app, ["verify", "nope", "--db", state["db"]])
    assert (
        r.exit_code == 2 and "error: no sweep 'nope' in" in r.output
    )  # (_fail wraps at the terminal's width)
