"""Artifacts on shared storage: an fsspec URL (here `memory://`, a backend that is not this machine's disk)
gets the same fingerprints as the local folder it was copied from, and a change or a loss there is found."""

from __future__ import annotations

import uuid

import fsspec

from workers.core.artifacts import check, content_hash, record, stat


def test_an_artifact_at_a_url_is_fingerprinted_and_checked_where_it_lives(tmp_path):
    local = tmp_path / "student"
    (local / "sub").mkdir(parents=True)
    (local / "config.json").write_text('{"a": 1}')
    (local / "sub" / "b.bin").write_bytes(b"\0" * 100)
    (local / "sub-c.bin").write_bytes(b"xyz")  # sorts between the folder's files as local paths do
    url = f"memory://moesweep-test-{uuid.uuid4().hex}/artifacts/convert/k1/student"
    fs, root = fsspec.core.url_to_fs(url)
    fs.put(str(local), root, recursive=True)

    here, there = record("student", local), record("student", url)
    assert there["content_hash"] == here["content_hash"] and there["size_bytes"] == here["size_bytes"] == 111
    assert content_hash(f"{url}/config.json") == content_hash(local / "config.json")
    assert check(there).problem is None and check(there, full=True).problem is None

    fs.pipe(f"{root}/sub/b.bin", b"\1" * 100)  # same size, other content
    c = check({**there, "mtime": None})
    assert (
        c.problem == f"student/ changed since it was recorded (same size, content hash "
        f"{there['content_hash'][:8]}… → {content_hash(url)[:8]}…)"
    )
    fs.rm(root, recursive=True)
    assert stat(url) is None
    assert check(there).problem == f"student is missing (recorded at {url})"
