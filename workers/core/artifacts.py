"""Size, modification time and content hash of an artifact (a file, or a folder of files).

Workers record them when a job writes an artifact (workers.run.runtime.artifact); the orchestrator
(which may import workers, as the database may not be imported by workers) compares them before a recorded artifact is used again: size and mtime on every use (cheap), the
content hash only where either changed (`check`), every hash with `moesweep verify`.

An artifact's path is a local path or an fsspec URL (`s3://`, `gs://`, `memory://`, `file://`): the
same fingerprints, read through fsspec, so an artifact on shared storage is checked where it lives and
never assumed to be on this machine's disk. (An object store has no folders and no folder mtimes: a
folder is the files under its prefix, its mtime their latest.)
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import uuid
from dataclasses import dataclass
from pathlib import Path, PurePosixPath


def is_url(path: str | Path) -> bool:
    return "://" in str(path)


def _remote(url: str):
    """(fsspec filesystem, path in it, its files in sorted order or None for a file) of an existing URL;
    None when nothing is there."""
    import fsspec

    fs, p = fsspec.core.url_to_fs(url)
    if fs.isfile(p):
        return fs, p, None
    files = sorted(fs.find(p), key=lambda f: f.split("/"))  # as local paths sort: by their parts
    return (fs, p, files) if files or fs.isdir(p) else None


def _remote_mtime(fs, p: str) -> float:
    try:
        return fs.modified(p).timestamp()
    except (NotImplementedError, AttributeError, OSError):
        return 0.0  # a store that keeps no times: size and hash only


def _remote_stat(url: str) -> tuple[int, float] | None:
    found = _remote(url)
    if found is None:
        return None
    fs, p, files = found
    files = [p] if files is None else files
    return sum(fs.size(f) for f in files), max((_remote_mtime(fs, f) for f in files), default=0.0)


def stat(path: str | Path) -> tuple[int, float] | None:
    """(size in bytes, mtime in seconds) of a file, or of a folder over everything in it: the sum of its
    files' sizes and the latest mtime of the folder, its subfolders and its files (so adding or removing a
    file shows too). None when the path does not exist."""
    if is_url(path):
        return _remote_stat(str(path))
    p = Path(path)
    try:
        st = p.stat()
    except FileNotFoundError:
        return None
    if not p.is_dir():
        return st.st_size, st.st_mtime_ns / 1e9
    size, mtime = 0, st.st_mtime_ns
    for f in p.rglob("*"):
        s = f.stat()
        mtime = max(mtime, s.st_mtime_ns)
        if f.is_file():
            size += s.st_size
    return size, mtime / 1e9


def content_hash(path: str | Path, canonical: bool = True) -> str:
    """sha256 of a file; of a folder: over its files in sorted order, each file's name then its content.
    A .safetensors file's content is its header with the keys sorted, then its tensor bytes: safetensors
    writes the header's `__metadata__` in an arbitrary order, so two writes of the same tensors and metadata
    differ in bytes but not in content (`canonical=False`: the raw bytes, as hashes were recorded before)."""
    if is_url(path):
        found = _remote(str(path))
        if found is None:
            raise FileNotFoundError(str(path))
        fs, p, files = found
        opener = fs.open
    else:
        p = Path(path)
        files = [str(f) for f in sorted(f for f in p.rglob("*") if f.is_file())] if p.is_dir() else None
        opener = open
    h = hashlib.sha256()
    for f in [None] if files is None else files:
        if f is not None:  # a folder: each file's name, then its content
            h.update(PurePosixPath(f).name.encode())
        with opener(p if f is None else f, "rb") as fh:
            if canonical and str(path if f is None else f).endswith(".safetensors"):
                _safetensors_header(fh, h)
            for chunk in iter(lambda fh=fh: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def _safetensors_header(fh, h) -> None:
    """Hash the header of a safetensors file with its keys sorted and leave `fh` after it; a file that is
    not valid safetensors is left at its start (hashed as plain bytes)."""
    head = fh.read(8)
    n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
    if 0 <= n <= 100 << 20:
        try:
            header = json.loads(fh.read(n))
        except ValueError:
            header = None
        if isinstance(header, dict):
            h.update(b"safetensors\0" + json.dumps(header, sort_keys=True, separators=(",", ":")).encode())
            return
    fh.seek(0)


def record(kind: str, path: str | Path) -> dict:
    """An `artifacts` row as a job reports it."""
    size, mtime = stat(path) or (None, None)
    if size is None:
        raise FileNotFoundError(f"artifact {kind!r}: {path} does not exist")
    return {
        "kind": kind,
        "path": str(path),
        "content_hash": content_hash(path),
        "size_bytes": size,
        "mtime": mtime,
    }


@dataclass
class Check:
    """The outcome of comparing an artifact with its record: `problem` (one line) or None; `mtime` and
    `size` to store when the content is unchanged but the cheap fingerprint moved (or was never stored)."""

    problem: str | None = None
    mtime: float | None = None
    size: int | None = None
    hashed: bool = False


def _files(path: str | Path) -> list[str]:
    if is_url(path):
        found = _remote(str(path))
        return [] if found is None else (found[2] if found[2] is not None else [found[1]])
    p = Path(path)
    return [str(f) for f in p.rglob("*") if f.is_file()] if p.is_dir() else [str(p)]


def name(path: str | Path) -> str:
    if is_url(path):
        found = _remote(str(path))
        folder = found is not None and found[2] is not None
        return PurePosixPath(str(path).rstrip("/")).name + ("/" if folder else "")
    p = Path(path)
    return p.name + ("/" if p.is_dir() else "")


def check(row: dict, full: bool = False) -> Check:
    """Compare an artifact with its stored row (path, size_bytes, mtime, content_hash). Size and mtime
    first; the content hash only when one of them differs, the row has no mtime, or `full`."""
    path = row["path"]
    now = stat(path)
    if now is None:
        return Check(f"{PurePosixPath(str(path).rstrip('/')).name} is missing (recorded at {path})")
    size, mtime = now
    if not full and row.get("mtime") is not None and size == row.get("size_bytes") and mtime == row["mtime"]:
        return Check()
    digest = content_hash(path)
    if (
        digest != row.get("content_hash")
        and any(f.endswith(".safetensors") for f in _files(path))
        and content_hash(path, canonical=False) == row.get("content_hash")
    ):
        digest = row[
            "content_hash"
        ]  # recorded as raw bytes (before canonical safetensors headers): unchanged
    if row.get("content_hash") in (None, digest):
        moved = mtime != row.get("mtime") or size != row.get("size_bytes")
        return Check(mtime=mtime if moved else None, size=size if moved else None, hashed=True)
    was = row.get("size_bytes")
    how = (
        f"size {was} → {size}"
        if was is not None and was != size
        else f"same size, content hash {row['content_hash'][:8]}… → {digest[:8]}…"
    )
    return Check(f"{name(path)} changed since it was recorded ({how})", hashed=True)


# ---- artifacts on shared storage: uploaded after a job, fetched before one -----------------------
# (kept apart from the fingerprints above: a job's key hashes the code its stage calls, and stage
# functions record artifacts through `record`, never through what follows)
def upload(local: str | Path, url: str) -> tuple[int, float]:
    """Copy a file or folder to `url` (fsspec `put`, recursive for a folder; whatever was there is
    replaced) and return its (size, mtime) as the store reports them, which later checks compare with."""
    import fsspec

    fs, p = fsspec.core.url_to_fs(url)
    if fs.exists(p):
        fs.rm(p, recursive=True)
    fs.makedirs(fs._parent(p), exist_ok=True)
    fs.put(str(local), p, recursive=Path(local).is_dir())
    now = stat(url)
    if now is None:
        raise OSError(f"uploading {local} to {url} left nothing there")
    return now


def remove(url: str) -> None:
    """Delete what is at `url` (a job's prefix before its artifacts are uploaded again); nothing there is fine."""
    import fsspec

    fs, p = fsspec.core.url_to_fs(url)
    if fs.exists(p):
        fs.rm(p, recursive=True)


def download(url: str, local: Path) -> None:
    """Copy a file or folder at `url` to `local` (which must not exist yet)."""
    found = _remote(url)
    if found is None:
        raise FileNotFoundError(f"{url} does not exist")
    fs, p, files = found
    local.parent.mkdir(parents=True, exist_ok=True)
    fs.get(p, str(local), recursive=files is not None)


def fetch(prefix: str, artifacts: dict[str, str], cache_root: str | Path) -> Path:
    """A local copy of the artifacts one job uploaded under `prefix` ({URL: content hash}), laid out as
    they are there (a plan's factors stay beside the plan). The copy is cached under `cache_root` by the
    artifacts' names and content hashes, so a worker fetches each job's artifacts once, whoever reads them,
    and a recomputed artifact with other content is fetched anew. Each file is hashed after the download:
    content that changed since it was recorded is an error, never used."""
    prefix = prefix.rstrip("/")
    listing = sorted((url[len(prefix) :].lstrip("/"), h) for url, h in artifacts.items())
    digest = hashlib.sha256(json.dumps(listing).encode()).hexdigest()
    root = Path(cache_root)
    dest = root / digest
    if dest.is_dir():
        return dest
    tmp = root / f".{digest}.{os.getpid()}.{uuid.uuid4().hex[:8]}"  # renamed into place when complete
    try:
        for rel, h in listing:
            download(f"{prefix}/{rel}", tmp / rel)
            got = content_hash(tmp / rel)
            if got != h:
                raise ValueError(
                    f"{prefix}/{rel} changed since it was recorded (content hash {h[:8]}… → {got[:8]}…)"
                )
        tmp.mkdir(parents=True, exist_ok=True)  # a job with no artifact to fetch still gets its folder
        try:
            os.rename(tmp, dest)
        except OSError:  # another worker on this machine fetched it first: theirs is the same content
            if not dest.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest
