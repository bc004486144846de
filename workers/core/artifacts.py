"""Size, modification time and content hash of an artifact (a file, or a folder of files).

Workers record them when a job writes an artifact (workers.run.runtime.artifact); the orchestrator
(which may import workers, as the database may not be imported by workers) compares them before a recorded artifact is used again: size and mtime on every use (cheap), the
content hash only where either changed (`check`), every hash with `moesweep verify`.

An artifact's path is a local path or an fsspec URL (`s3://`, `gs://`, `memory://`, `file://`): the
same fingerprints, read through fsspec, so an artifact on shared storage is checked where it lives and
never assumed to be on this machine's disk. (An object store has no folders and no folder mtimes: a
folder is the files under its prefix, its mtime their latest.)

The orchestrator stores a folder's hash as `p1:` over its files' relative paths and sizes too (`sealed`,
from the hash its worker recorded, without reading a file again): a file moved within the folder is a
change. A record from before (no prefix) is compared as it was computed. Before anything is read or
followed, an artifact that is or holds a device, FIFO, socket, or a symlink out of its job's folder is
refused (`refused`). Workers call `record`, `stat` and `content_hash` only: job keys hash that code, so
what the orchestrator alone needs is kept out of them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat as statmod
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
    `size` to store when the content is unchanged but the cheap fingerprint moved (or was never stored);
    `changed`: what is there is not the recorded content (a missing artifact is not `changed`)."""

    problem: str | None = None
    mtime: float | None = None
    size: int | None = None
    hashed: bool = False
    changed: bool = False


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


# ---- what only the orchestrator calls (a job's key hashes the code its stage calls: `record`, `stat`
# and `content_hash` stay as they are, and what follows is never reached from a stage) ----------------
LAYOUT = "p1:"  # a folder's record over its files' relative paths and sizes too (`sealed`)
_SPECIAL = (
    (statmod.S_ISCHR, "character device"),
    (statmod.S_ISBLK, "block device"),
    (statmod.S_ISFIFO, "FIFO"),
    (statmod.S_ISSOCK, "socket"),
)


def _local(path: str | Path) -> Path | None:
    """The local path of a plain path or a `file://` URL; None for any other URL."""
    if not is_url(path):
        return Path(path)
    s = str(path)
    return Path(s[len("file://") :]) if s.startswith("file://") else None


def job_folder(path: str | Path, key: str | None = None) -> Path:
    """The folder an artifact may not leave: the one named after its job's key above it (a job writes
    under `<stage>/<key>/`), else the artifact itself when it is a folder, else the folder it is in."""
    p = Path(path)
    for q in (p, *p.parents):
        if key and q.name == key:
            return q
    return p if p.is_dir() and not p.is_symlink() else p.parent


def _inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _entry_problem(entry: Path, root: str) -> str | None:
    lst = os.lstat(entry)
    st = lst
    if statmod.S_ISLNK(lst.st_mode):
        target = os.path.realpath(entry)
        if not _inside(target, root):
            return f"is a symlink to {target}, outside its job's folder"
        try:
            st = os.stat(entry)
        except OSError:
            return f"is a symlink to {target}, which does not resolve (dangling)"
    for test, what in _SPECIAL:
        if test(st.st_mode):
            return f"is a {what}, not a regular file"
    return None


def refused(path: str | Path, key: str | None = None) -> str | None:
    """One line if the artifact at `path` is, or holds, anything but regular files and folders inside its
    job's folder (`job_folder`): a device, FIFO or socket (reading one never ends, or blocks), a dangling
    symlink, or a symlink that resolves outside that folder. Checked on lstat, before anything is read or
    followed; None when it is fine or missing (which `check` says), and for URLs other than `file://`."""
    local = _local(path)
    if local is None:
        return None
    try:
        os.lstat(local)
    except FileNotFoundError:
        return None
    root = os.path.realpath(job_folder(local, key))
    if not _inside(os.path.realpath(local), root):  # (also through a symlinked folder above it)
        where = os.path.realpath(local)
        return f"{name(local)} resolves to {where}, outside its job's folder: refused"

    def entries():
        yield local  # first: a folder is walked only once its own path is found inside the root
        if local.is_dir():  # (a symlinked folder inside it is an entry, never walked into)
            for folder, dirs, files in os.walk(local):
                yield from (Path(folder) / n for n in sorted(dirs) + sorted(files))

    for e in entries():
        try:
            why = _entry_problem(e, root)
        except OSError as err:
            why = f"cannot be read ({err.strerror or err})"
        if why:
            shown = name(local) + (e.relative_to(local).as_posix() if e != local else "")
            return f"{shown} {why}: refused (an artifact is regular files and folders in its job's folder)"
    return None


def _listing(path: str | Path) -> list[tuple[str, int]] | None:
    """(path relative to the folder, size) of each file of a folder, in the order `content_hash` reads
    them; None for a file. FileNotFoundError when nothing is there."""
    if is_url(path):
        found = _remote(str(path))
        if found is None:
            raise FileNotFoundError(str(path))
        fs, p, files = found
        if files is None:
            return None
        base = p.rstrip("/") + "/"
        out = [(f[len(base) :] if f.startswith(base) else f, fs.size(f)) for f in files]
    else:
        p = Path(path)
        if not p.is_dir():
            if not p.exists():
                raise FileNotFoundError(str(path))
            return None
        out = [(f.relative_to(p).as_posix(), f.stat().st_size) for f in p.rglob("*") if f.is_file()]
    return sorted(out, key=lambda e: e[0].split("/"))


def _layout(digest: str, listing: list[tuple[str, int]]) -> str:
    """`p1:` + 61 hex digits (the 64 characters a record holds) over a folder's names-and-content digest
    and its files' relative paths and sizes: with the sizes, that digest's bytes split into one content
    per relative path, so moving, renaming or swapping a file changes it."""
    blob = json.dumps([digest, listing], separators=(",", ":")).encode()
    return LAYOUT + hashlib.sha256(blob).hexdigest()[: 64 - len(LAYOUT)]


def sealed(row: dict) -> dict:
    """An artifact record as the orchestrator stores it: a folder's content hash as a worker recorded it
    (its files' names and content) made `p1:` (`_layout`) from the folder's listing now (no file is read
    again); a file's record, one already `p1:`, or one whose path cannot be listed here, as it is."""
    digest = row.get("content_hash")
    if not digest or digest.startswith(LAYOUT):
        return row
    try:
        listing = _listing(row["path"])
    except OSError:
        return row
    return row if listing is None else {**row, "content_hash": _layout(digest, listing)}


def hash_like(path: str | Path, recorded: str | None) -> str:
    """The content hash of `path` in the form of `recorded`: `p1:` for a folder recorded so, else as
    `content_hash` computes it (a folder recorded before `p1:`: its names and content, as then)."""
    digest = content_hash(path)
    if recorded and recorded.startswith(LAYOUT):
        listing = _listing(path)
        return digest if listing is None else _layout(digest, listing)
    return digest


def same_content(path: str | Path, old: str, new: str, key: str | None = None) -> bool:
    """Whether a hash recorded before `p1:` (`old`: names and content) and a `p1:` record (`new`) of
    the artifact at `path` are both its content now (so the same content): a job that read it as `old`
    read what `new` records."""
    if refused(path, key) is not None:
        return False
    try:
        digest = content_hash(path)
        listing = _listing(path)
    except OSError:
        return False
    return digest == old and listing is not None and _layout(digest, listing) == new


def check(row: dict, full: bool = False) -> Check:
    """Compare an artifact with its stored row (path, size_bytes, mtime, content_hash; `key`, its job's,
    where known). First what it is (`refused`: a special file or a symlink out of its job's folder is
    never read), then size and mtime; the content hash only when one of them differs, the row has no
    mtime, or `full`. A `p1:` record is compared over relative paths too (`hash_like`)."""
    path = row["path"]
    why = refused(path, row.get("key"))
    if why is not None:
        return Check(why, changed=True)
    now = stat(path)
    if now is None:
        return Check(f"{PurePosixPath(str(path).rstrip('/')).name} is missing (recorded at {path})")
    size, mtime = now
    if not full and row.get("mtime") is not None and size == row.get("size_bytes") and mtime == row["mtime"]:
        return Check()
    digest = hash_like(path, row.get("content_hash"))
    if (
        digest != row.get("content_hash")
        and not digest.startswith(LAYOUT)
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
    return Check(f"{name(path)} changed since it was recorded ({how})", hashed=True, changed=True)


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
            got = hash_like(tmp / rel, h)
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
