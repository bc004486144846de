"""What a job reads is the content recorded, whatever kept size and mtime, and an artifact is a plain file
or folder of its job's: the attacks of an independent review, each reproduced on a small fake sweep whose
stages write and read real files (tests/test_artifacts.py).

- bit rot with the mtime kept (`cp -p`, rsync): a new job about to read the statistics hashes them first,
  finds them changed and recomputes their producer before it reads them; jobs that read an artifact
  without such a hash (recorded before it was taken) are recomputed once `verify` finds it changed
- a symlink to /dev/zero, a FIFO, a symlink out of the job's folder: refused in one line, never read
- a file moved into a subfolder of a student: its folder hash covers relative paths
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest
from typer.testing import CliRunner

import workers.run.ppl_pre
from db.store import Store
from orchestrator.cli import app
from tests.test_artifacts import (  # noqa: F401  (fixtures)
    _body,
    _launch,
    _path,
    _read,
    _reference,
    _results,
    _stages_run,
    _write,
    arts,
)
from tests.test_orchestrator import _num, fake  # noqa: F401  (the fixture `arts` builds on)
from workers.core.artifacts import check, content_hash, record


@pytest.fixture(autouse=True)
def no_hang():
    """A check that reads /dev/zero or opens a FIFO never returns: fail the test instead of hanging it."""

    def hung(signum, frame):
        raise TimeoutError("hung reading an artifact")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(120)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.fixture
def plan_ppl(arts, monkeypatch):  # noqa: F811
    """`arts` where a student's perplexity depends on its plan's bytes (so on the statistics it was
    converted from): a conversion that read other statistics shows in the result rows."""
    inner = workers.run.ppl_pre.stage_ppl_pre

    def ppl_pre(p, cache, progress):
        rec = inner(p, cache, progress)
        if "convert" in p["inputs"]:
            v = _num(_read(p["inputs"]["convert"]["plan_path"]))
            rec["outputs"]["ppl"] = rec["metrics"][0]["value"] = v
        return rec

    monkeypatch.setattr("workers.run.ppl_pre.stage_ppl_pre", ppl_pre)
    return arts


def _with_k3(sweep: Path) -> Path:
    """The same sweep with K = 3 added: new conversions that read the statistics."""
    out = sweep.with_name("fake_k3.yaml")
    text = sweep.read_text()
    assert "K: [2, 4]" in text
    out.write_text(text.replace("K: [2, 4]", "K: [2, 3, 4]"))
    return out


def _rot(path: Path, body: str) -> None:
    """Other bytes of the same size, checksum valid (a reader sees nothing wrong), mtime as it was."""
    st = path.stat()
    _write(path, body, "0")
    assert path.stat().st_size == st.st_size
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _verify(db: str, *args: str):
    return CliRunner().invoke(app, ["verify", *args, "--db", db])


# ---- bit rot that kept size and mtime ----------------------------------------------------------------
def test_bit_rot_with_the_mtime_kept_is_never_read_by_a_new_job(plan_ppl, tmp_path):
    calls, state = plan_ppl
    store = Store(state["db"])
    assert _launch(store, state["sweep"])[0] == 0
    stats = _path(store, "calibration_stats")
    _rot(stats, _body("rotten"))
    k3 = _with_k3(state["sweep"])
    n = len(calls)
    code, lines = _launch(store, k3)  # the K = 3 conversions read the statistics
    assert code == 0
    assert lines and lines[0].startswith("calibrate ") and "stats.safetensors changed" in lines[0], lines
    assert "same size" in lines[0] and len(lines) == 1, lines
    assert _stages_run(calls, n)[0] == "calibrate"  # recomputed before anything read it
    assert _read(stats) != _body("rotten")
    assert _results(store) == _reference(tmp_path, k3)
    r = _verify(state["db"], "fake")
    assert r.exit_code == 0 and "all as recorded" in r.output, r.output
    n = len(calls)
    assert _launch(store, k3) == (0, []) and len(calls) == n
    # what a job read is recorded as hashed from the content it read
    inputs = [
        json.loads(s) for (s,) in store.query("SELECT inputs_json FROM jobs WHERE stage = 'convert'")[1]
    ]
    assert inputs and all(i.get("~hashed") for i in inputs)


def test_verify_recomputes_the_jobs_that_read_an_artifact_unhashed_once_it_is_found_changed(
    plan_ppl, tmp_path, monkeypatch
):
    """Jobs recorded without a hash of what they read (as every launch recorded them before) that read
    an artifact `verify` then finds changed are recomputed too, not only its producer."""
    calls, state = plan_ppl
    store = Store(state["db"])
    assert _launch(store, state["sweep"])[0] == 0
    stats = _path(store, "calibration_stats")
    _rot(stats, _body("rotten"))
    k3 = _with_k3(state["sweep"])
    with monkeypatch.context() as m:  # a launch as before: size and mtime only before a job reads
        m.setattr("orchestrator.launch.Runner._hash_inputs", lambda self, rows: self._problem(rows))
        assert _launch(store, k3) == (0, [])
    wrong = _results(store)
    expected = _reference(tmp_path, k3)
    assert wrong != expected  # the K = 3 conversions read the rotten statistics
    r = _verify(state["db"], "fake")
    assert r.exit_code == 1, r.output
    assert any(
        ln.startswith("calibrate ") and "stats.safetensors changed" in ln for ln in r.output.splitlines()
    )
    readers = [ln for ln in r.output.splitlines() if ln.startswith("convert ")]
    assert len(readers) == 4 and all("may have read" in ln for ln in readers), r.output  # K = 3 only
    n = len(calls)
    code, lines = _launch(store, k3)
    assert code == 0
    ran = _stages_run(calls, n)
    assert ran[0] == "calibrate" and ran.count("convert") == 4, ran
    assert _results(store) == expected
    assert _verify(state["db"], "fake").exit_code == 0


# ---- special files and symlinks ------------------------------------------------------------------
def test_a_symlink_to_dev_zero_is_refused_by_launch_and_verify(arts, tmp_path):  # noqa: F811
    calls, state = arts
    store = Store(state["db"])
    assert _launch(store, state["sweep"])[0] == 0
    before = _results(store)
    stats = _path(store, "calibration_stats")
    stats.unlink()
    stats.symlink_to("/dev/zero")
    r = _verify(state["db"])
    assert r.exit_code == 1, r.output
    line = next(ln for ln in r.output.splitlines() if ln.startswith("calibrate "))
    assert "stats.safetensors" in line and "/dev/zero" in line and "refused" in line, r.output
    stats.unlink()
    stats.symlink_to("/dev/zero")  # (and a launch that finds it, with no verify before)
    with store.tx() as c:
        c.exec_driver_sql("UPDATE jobs SET status = 'succeeded', error = NULL WHERE stage = 'calibrate'")
    n = len(calls)
    code, lines = _launch(store, state["sweep"])
    assert code == 0 and len(lines) == 1 and "refused" in lines[0] and "/dev/zero" in lines[0], lines
    assert _stages_run(calls, n) == ["calibrate"]
    assert not stats.is_symlink() and stats.is_file()
    assert _results(store) == before


def test_a_fifo_in_a_student_folder_is_refused(arts, tmp_path):  # noqa: F811
    calls, state = arts
    store = Store(state["db"])
    assert _launch(store, state["sweep"])[0] == 0
    before = _results(store)
    student = _path(store, "student")
    st = student.stat()
    fifo = student / "pipe"
    os.mkfifo(fifo)
    for p in (fifo, student):  # size and mtime as recorded: the cheap check passes, verify hashes
        os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)
    r = _verify(state["db"])
    assert r.exit_code == 1, r.output
    line = next(ln for ln in r.output.splitlines() if ln.startswith("distill "))
    assert "pipe" in line and "FIFO" in line and "refused" in line, r.output
    n = len(calls)
    code, lines = _launch(store, state["sweep"])
    assert code == 0 and len(lines) == 1 and lines[0].startswith("distill "), lines
    assert _stages_run(calls, n) == ["distill"]
    assert not fifo.exists() and _results(store) == before


def test_a_symlink_out_of_the_job_folder_is_refused_even_to_the_same_bytes(arts, tmp_path):  # noqa: F811
    calls, state = arts
    store = Store(state["db"])
    assert _launch(store, state["sweep"])[0] == 0
    before = _results(store)
    stats = _path(store, "calibration_stats")
    outside = tmp_path / "elsewhere" / "stats.safetensors"
    outside.parent.mkdir()
    shutil.copy2(stats, outside)  # the very content, size and mtime
    stats.unlink()
    stats.symlink_to(outside)
    r = _verify(state["db"])
    assert r.exit_code == 1, r.output
    line = next(ln for ln in r.output.splitlines() if ln.startswith("calibrate "))
    assert "outside" in line and str(outside) in line, r.output
    n = len(calls)
    code, lines = _launch(store, state["sweep"])
    assert code == 0 and len(lines) == 1 and lines[0].startswith("calibrate "), lines
    assert _stages_run(calls, n) == ["calibrate"]
    assert not stats.is_symlink() and _results(store) == before


def test_symlinks_inside_the_folder_are_fine_and_special_files_are_refused(tmp_path):
    d = tmp_path / "job" / "student"
    _write(d / "model.safetensors", "m" * 64, "0")
    (d / "alias.safetensors").symlink_to("model.safetensors")  # inside the folder: read as a file
    row = record("student", d)
    assert check(row, full=True).problem is None
    (d / "zero").symlink_to("/dev/zero")
    c = check(row, full=True)
    assert "zero" in c.problem and "/dev/zero" in c.problem and "outside" in c.problem
    (d / "zero").unlink()
    (d / "dangling").symlink_to(d / "nothing")
    assert "dangling" in check(row, full=True).problem
    (d / "dangling").unlink()
    assert check(row, full=True).problem is None
    f = tmp_path / "job" / "dev"
    f.symlink_to("/dev/null")
    assert "outside" in check({"path": str(f), "content_hash": "x", "size_bytes": 0, "mtime": 0}).problem
    real = tmp_path / "real"  # a folder above the artifact, in its job's folder, that is a symlink out
    _write(real / "plan.json", "p" * 64, "0")
    (tmp_path / "k1").mkdir()
    (tmp_path / "k1" / "sub").symlink_to(real)
    row = {**record("plan", tmp_path / "k1" / "sub" / "plan.json"), "key": "k1"}
    assert "outside its job's folder" in check(row, full=True).problem
    fifo = tmp_path / "job" / "stats.safetensors"  # an artifact that is a FIFO itself: never opened
    os.mkfifo(fifo)
    c = check({"path": str(fifo), "content_hash": "x", "size_bytes": 1, "mtime": 0}, full=True)
    assert "stats.safetensors is a FIFO, not a regular file: refused" in c.problem and c.changed


# ---- folder hashes cover relative paths ----------------------------------------------------------
def test_a_file_moved_into_a_subfolder_of_a_student_is_found_and_recomputed(arts, tmp_path):  # noqa: F811
    calls, state = arts
    store = Store(state["db"])
    assert _launch(store, state["sweep"])[0] == 0
    before = _results(store)
    student = _path(store, "student")
    (student / "m").mkdir()
    (student / "model.safetensors").rename(student / "m" / "model.safetensors")
    r = _verify(state["db"])
    assert r.exit_code == 1, r.output
    line = next(ln for ln in r.output.splitlines() if ln.startswith("distill "))
    assert "student/ changed since it was recorded" in line, r.output
    n = len(calls)
    code, lines = _launch(store, state["sweep"])
    assert code == 0 and len(lines) == 1 and lines[0].startswith("distill "), lines
    assert _stages_run(calls, n) == ["distill"]  # same bytes at the same paths again: evaluate stays valid
    assert (student / "model.safetensors").is_file() and _results(store) == before


def test_folder_hashes_are_versioned_and_old_records_still_match(tmp_path):
    """A folder's record is `p1:` + a digest over its files' relative paths, sizes and content (64
    characters, as the column holds); a record of before (no prefix: names and content only) is compared
    the old way, so a stored folder hash stays valid."""
    from workers.core.artifacts import sealed

    d = tmp_path / "student"
    _write(d / "model.safetensors", "m" * 64, "0")
    _write(d / "config.json", "c" * 16, "0")
    old = record("student", d)
    assert ":" not in old["content_hash"]  # what a worker records: unchanged, so are job keys
    new = sealed(old)
    assert new["content_hash"].startswith("p1:") and len(new["content_hash"]) == 64
    assert check(old, full=True).problem is None and check(new, full=True).problem is None
    f = tmp_path / "stats.safetensors"
    _write(f, "s" * 64, "0")
    assert sealed(record("stats", f))["content_hash"] == content_hash(f)  # a file: as before
    (d / "m").mkdir()
    (d / "model.safetensors").rename(d / "m" / "model.safetensors")
    assert "changed since it was recorded" in check(new, full=True).problem
    assert check(old, full=True).problem is None  # the old way cannot see a move: recorded before


def test_a_database_of_before_p1_keeps_its_folder_records_and_their_readers(arts, tmp_path):  # noqa: F811
    """Folder records and inputs of jobs as launches stored them before `p1:` (names and content only,
    inputs copied from records) verify as they are; a student recomputed to the same bytes gets a `p1:`
    record, and the evaluation that read it as recorded before stays valid."""
    calls, state = arts
    store = Store(state["db"])
    assert _launch(store, state["sweep"])[0] == 0
    before = _results(store)
    with store.tx() as c:  # back to how they were stored before
        old = {}
        for i, path, h in c.exec_driver_sql("SELECT id, path, content_hash FROM artifacts").fetchall():
            if h.startswith("p1:"):
                old[h] = content_hash(path)
                c.exec_driver_sql("UPDATE artifacts SET content_hash = ? WHERE id = ?", (old[h], i))
        for i, text in c.exec_driver_sql("SELECT id, inputs_json FROM jobs").fetchall():
            inputs = json.loads(text or "null")
            if inputs:
                inputs.pop("~hashed", None)
                inputs = {d: {p: old.get(h, h) for p, h in v.items()} for d, v in inputs.items()}
                c.exec_driver_sql("UPDATE jobs SET inputs_json = ? WHERE id = ?", (json.dumps(inputs), i))
    assert old  # (the students are folders)
    r = _verify(state["db"])
    assert r.exit_code == 0 and "all as recorded" in r.output, r.output
    student = _path(store, "student")
    shutil.rmtree(student)
    n = len(calls)
    code, lines = _launch(store, state["sweep"])
    assert code == 0 and len(lines) == 1 and lines[0].startswith("distill "), lines
    assert _stages_run(calls, n) == ["distill"]  # the evaluation read these very bytes: not run again
    assert store.query("SELECT a.content_hash FROM artifacts a WHERE a.path = :p", {"p": str(student)})[1][0][
        0
    ].startswith("p1:")
    assert _results(store) == before
    n = len(calls)
    assert _launch(store, state["sweep"]) == (0, []) and len(calls) == n
