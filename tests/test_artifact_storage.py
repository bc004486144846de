"""Artifacts on shared storage, end to end: with `MOESWEEP_ARTIFACTS` set to an fsspec URL that is not the
plain local disk under `$MOESWEEP_HOME` (`memory://`, which only the serial executor's one process sees,
and a `file://` folder elsewhere, both read through fsspec), each job runs in a local scratch folder, its
artifacts are uploaded and recorded by URL, and the jobs that read them fetch them into the worker's cache
once. The fake stages of tests/test_artifacts.py write real files and read their inputs' files (a teacher
folder, calibration statistics, plans, students), so a wrong or missing copy fails a job."""

from __future__ import annotations

import collections
import os
import re
import uuid
from pathlib import Path

import fsspec
import pytest
from typer.testing import CliRunner

import workers.core.artifacts
from db.store import Store
from orchestrator.cli import app
from orchestrator.schema import artifact_root
from orchestrator.spec import SpecError, load_spec
from tests.test_artifacts import _launch, _results, _stages_run, _tiny_sweep, arts  # noqa: F401
from tests.test_orchestrator import fake  # noqa: F401  (the fixture `arts` builds on)


@pytest.fixture(params=["memory", "file"])
def root(request, tmp_path, monkeypatch):
    """The artifact root (not under $MOESWEEP_HOME = tmp_path/home), set as $MOESWEEP_ARTIFACTS."""
    if request.param == "memory":
        url = f"memory://moesweep-test-{uuid.uuid4().hex}/artifacts"
    else:
        url = f"file://{tmp_path}/bucket/artifacts"
    monkeypatch.setenv("MOESWEEP_ARTIFACTS", url)
    yield url
    fs, p = fsspec.core.url_to_fs(url)
    if fs.exists(p):
        fs.rm(p, recursive=True)


@pytest.fixture
def downloads(monkeypatch):
    """Every artifact URL a worker downloaded, in order."""
    seen: list[str] = []
    real = workers.core.artifacts.download

    def counting(url: str, local: Path) -> None:
        seen.append(url)
        real(url, local)

    monkeypatch.setattr(workers.core.artifacts, "download", counting)
    return seen


def _files(folder: Path) -> list[str]:
    return sorted(str(f.relative_to(folder)) for f in folder.rglob("*") if f.is_file())


def _local_results(tmp_path: Path, sweep: Path, monkeypatch) -> list[tuple]:
    """The same sweep with artifacts on the local disk (no root), in a database and home of its own."""
    with monkeypatch.context() as m:
        m.delenv("MOESWEEP_ARTIFACTS")
        m.setenv("MOESWEEP_HOME", str(tmp_path / "local_home"))
        store = Store(f"sqlite:///{tmp_path}/local.db")
        assert _launch(store, sweep)[0] == 0
        assert all(
            not p.startswith(("memory:", "file:")) for (p,) in store.query("SELECT path FROM artifacts")[1]
        )
        return _results(store)


def test_a_sweep_keeps_its_artifacts_at_a_url(arts, root, downloads, tmp_path, monkeypatch):  # noqa: F811
    calls, state = arts
    sweep = _tiny_sweep(tmp_path)  # teacher -> calibrate -> convert -> ppl_pre -> distill -> evaluate
    store = Store(state["db"])
    home = Path(os.environ["MOESWEEP_HOME"])
    assert _launch(store, sweep)[0] == 0

    # (a) every artifact is recorded by its URL under <root>/<stage>/<key>/, and is as recorded there
    rows = store.query(
        "SELECT j.stage, j.key, a.kind, a.path FROM artifacts a JOIN jobs j ON j.id = a.job_id"
    )[1]
    assert {kind for _, _, kind, _ in rows} == {
        "model",
        "calibration_stats",
        "plan",
        "student",
        "lm_eval_results",
    }
    for stage, key, _, path in rows:
        assert path.startswith(f"{root}/{stage}/{key}/"), path
    r = CliRunner().invoke(app, ["verify", "--db", state["db"]])  # rehashes every artifact where it lives
    assert r.exit_code == 0 and f"{len(rows)} artifact(s)" in r.output and "all as recorded" in r.output, (
        r.output
    )
    # the outputs name artifacts by URL too (what the next job reads), never a path under $MOESWEEP_HOME
    outputs = " ".join(o for (o,) in store.query("SELECT outputs_json FROM jobs")[1])
    assert str(home) not in outputs and f"{root}/calibrate/" in outputs
    # the same numbers as with artifacts on the local disk
    assert _results(store) == _local_results(tmp_path, sweep, monkeypatch)

    # (b) $MOESWEEP_HOME holds caches and logs only: the scratch folders are gone, nothing under artifacts/
    assert not (home / "artifacts").exists()
    assert _files(home / "scratch") == []
    assert {Path(f).parts[0] for f in _files(home)} == {"cache", "logs"}
    fetched = {Path(f).parts[1] for f in _files(home / "cache") if f.startswith("fetched/")}
    assert fetched  # the inputs' local copies, one folder per upstream job's content

    # (d) each input fetched once into the worker's cache, however many jobs read it
    per_url = collections.Counter(downloads)
    assert set(per_url.values()) == {1}, per_url
    stats = next(p for _, _, kind, p in rows if kind == "calibration_stats")
    converts = [k for s, k in calls if s == "convert"]
    assert per_url[stats] == 1 and len(converts) > 1
    assert len(fetched) == len({u.rsplit("/", 1)[0] for u in per_url})  # one copy per upstream job read
    # a relaunch reuses everything: no job runs, nothing is fetched
    n, d = len(calls), len(downloads)
    assert _launch(store, sweep) == (0, []) and len(calls) == n and len(downloads) == d

    # (c) an artifact deleted at the URL: its producer is recomputed and uploaded again; its readers,
    # which read the same content, stay valid (and the teacher the recomputation reads is in the cache)
    fs, p = fsspec.core.url_to_fs(stats)
    fs.rm(p)
    before = _results(store)
    code, lines = _launch(store, sweep)
    assert code == 0
    assert len(lines) == 1 and re.fullmatch(
        rf"calibrate [0-9a-f]{{8}}…: stats\.safetensors is missing \(recorded at {re.escape(stats)}\); "
        rf"recomputing",
        lines[0],
    ), lines
    assert _stages_run(calls, n) == ["calibrate"] and len(downloads) == d
    assert fs.exists(p) and _results(store) == before
    assert _files(home / "scratch") == [] and not (home / "artifacts").exists()


def test_the_artifact_root_setting():
    assert artifact_root("/mnt/shared/moesweep/") == "file:///mnt/shared/moesweep"
    assert artifact_root("memory://x/y") == "memory://x/y"
    with pytest.raises(ValueError, match=r"^'rel/dir' is neither a URL .* nor an absolute path$"):
        artifact_root("rel/dir")
    with pytest.raises(ValueError, match=r"^nope:// is not a protocol fsspec knows$"):
        artifact_root("nope://bucket")
    try:
        import s3fs  # noqa: F401
    except ImportError:  # not installed here: the error names the package
        with pytest.raises(
            ValueError, match=r"^s3:// needs its fsspec package \(Install s3fs to access S3\)$"
        ):
            artifact_root("s3://bucket/x")


def test_a_local_artifact_root_under_a_file_is_refused_when_read(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    for value in (f"{afile}/art", f"file://{afile}/a/b"):
        with pytest.raises(ValueError) as e:
            artifact_root(value)
        url = value if value.startswith("file://") else f"file://{value}"
        assert str(e.value) == f"{url}: {afile} is a file, not a folder"
    assert artifact_root(f"{tmp_path}/new/art") == f"file://{tmp_path}/new/art"  # made when a job writes
    assert not (tmp_path / "new").exists()


def test_a_bad_artifact_root_is_one_line_before_anything_runs(tmp_path, monkeypatch):
    from tests.test_orchestrator import fake_sweep

    sweep = fake_sweep(tmp_path)
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        sweep.read_text().replace("execution: {retries: 1}", "execution: {retries: 1, artifacts: nope://x}")
    )
    with pytest.raises(SpecError) as e:
        load_spec(str(bad))
    assert str(e.value) == f"{bad}: execution.artifacts: nope:// is not a protocol fsspec knows"
    monkeypatch.setenv("MOESWEEP_ARTIFACTS", "nope://x")
    monkeypatch.setenv("MOESWEEP_HOME", str(tmp_path / "home"))
    r = CliRunner().invoke(
        app, ["launch", str(sweep), "--executor", "serial", "--db", f"sqlite:///{tmp_path}/r.db"]
    )
    assert r.exit_code == 2 and "MOESWEEP_ARTIFACTS: nope:// is not a protocol fsspec knows" in r.output, (
        r.output
    )
    assert not (tmp_path / "r.db").exists() and not (tmp_path / "home").exists()


def test_upload_and_fetch_keep_a_jobs_layout_and_refuse_what_they_cannot_vouch_for(tmp_path):
    """A job's folder of artifacts arrives as it was written (the factors beside the plan); an output
    naming a workdir file that is not an artifact, or an artifact outside the workdir, is an error; a copy
    whose content is not the recorded one is never used."""
    from workers.core.artifacts import fetch, record
    from workers.run.jobs import uploaded, with_local_inputs

    url = f"memory://moesweep-test-{uuid.uuid4().hex}/convert/k1"
    work = tmp_path / "scratch" / "convert" / "k1"
    (work / "round1").mkdir(parents=True)
    (work / "round1" / "plan.json").write_text("[1, 2]")
    (work / "round1" / "factors.safetensors").write_bytes(b"\0" * 16)
    (work / "junk.txt").write_text("not an artifact")
    plan, factors = work / "round1" / "plan.json", work / "round1" / "factors.safetensors"
    rec = {
        "outputs": {"plan_path": str(plan), "n": 3},
        "artifacts": [record("plan", plan), record("factors", factors)],
    }
    up = uploaded(rec, work, url)
    assert up["outputs"] == {"plan_path": f"{url}/round1/plan.json", "n": 3}
    assert [a["path"] for a in up["artifacts"]] == [
        f"{url}/round1/plan.json",
        f"{url}/round1/factors.safetensors",
    ]
    assert [a["content_hash"] for a in up["artifacts"]] == [a["content_hash"] for a in rec["artifacts"]]

    recorded = {a["path"]: a["content_hash"] for a in up["artifacts"]}
    payload = {"home": str(tmp_path / "home"), "inputs": {"convert": up["outputs"]}, "fetch": {url: recorded}}
    local = Path(with_local_inputs(payload)["inputs"]["convert"]["plan_path"])
    assert local.read_text() == "[1, 2]" and local.with_name("factors.safetensors").read_bytes() == b"\0" * 16
    assert local.parent.parent.parent == tmp_path / "home" / "cache" / "fetched"
    assert with_local_inputs(payload)["inputs"]["convert"]["plan_path"] == str(local)  # cached: the same copy

    with pytest.raises(
        ValueError,
        match=r"^outputs\.log names .*junk\.txt, a file of the job's workdir that is "
        r"not a declared artifact; only declared artifacts are uploaded$",
    ):
        uploaded({**rec, "outputs": {"log": str(work / "junk.txt")}}, work, url)
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text("{}")
    with pytest.raises(ValueError, match=r"^artifact 'plan' at .* is not inside the job's workdir"):
        uploaded({"artifacts": [record("plan", elsewhere)]}, work, url)

    fs, p = fsspec.core.url_to_fs(f"{url}/round1/plan.json")
    fs.pipe(p, b"[9, 9]")  # changed at the URL after it was recorded
    with pytest.raises(
        ValueError,
        match=r"^memory://.*/round1/plan\.json changed since it was recorded "
        r"\(content hash [0-9a-f]{8}… → [0-9a-f]{8}…\)$",
    ):
        fetch(url, recorded, tmp_path / "other_cache")
    assert list((tmp_path / "other_cache").iterdir()) == []  # nothing half-fetched is left to be trusted
    fs.rm(fsspec.core.url_to_fs(url)[1], recursive=True)
