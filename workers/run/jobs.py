"""Run one job: plain payload in, plain record out (the orchestrator writes the DB).

A payload is {"key", "stage", "run": "module:function", "params", "inputs": {role: upstream outputs},
"resident", "workdir", ...}. A record is {"outputs": {...}, "metrics": [...], "artifacts": [...],
"plan_rows": [...], "layer_diag": [...], "versions": {...}}. `cache` is the worker's memory between
jobs: the resident teacher, loaded calibration statistics and tokenized evaluation text.

Artifacts on shared storage (the payload names `artifacts_url`, the job's prefix at the artifact root):
the job runs in a local scratch `workdir`, then its declared artifacts are uploaded under the prefix and
recorded there, its outputs name them by URL, and the scratch folder is removed. Inputs recorded at URLs
(`fetch`: {an upstream job's prefix: {artifact URL: content hash}}) are fetched into the worker's cache
before the job runs, and the payload's `inputs` name the local copies.
"""

from __future__ import annotations

import importlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from workers.run.runtime import runtime_versions

Progress = Callable[..., None] | None


def resolve(ref: str) -> Callable[..., dict[str, Any]]:
    """'module:function' → the function (a stage's run function, named by the orchestrator's registry)."""
    module, _, name = ref.partition(":")
    obj: Any = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def run_job(payload: dict[str, Any], cache: dict, progress: Progress = None) -> dict[str, Any]:
    payload = with_local_inputs(payload)
    workdir = Path(payload["workdir"])
    if workdir.exists():  # a half-written directory from a killed run is never trusted
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    record = resolve(payload["run"])(payload, cache, progress)
    record.setdefault("versions", runtime_versions())
    if payload.get("artifacts_url"):
        record = uploaded(record, workdir, payload["artifacts_url"])
        shutil.rmtree(workdir)  # everything the job keeps is at the URL now
    return record


# ---- inputs recorded at URLs: fetched once per worker ------------------------------------------------
def fetch_root(payload: dict[str, Any]) -> Path:
    """Where a worker keeps the inputs it fetched: `$MOESWEEP_HOME/cache/fetched` (a cache: deleting it
    costs a download)."""
    return Path(payload["home"]) / "cache" / "fetched"


def with_local_inputs(payload: dict[str, Any]) -> dict[str, Any]:
    """The payload with every input path under a fetched upstream prefix pointing at the local copy; only
    the upstream jobs whose artifacts an input names are fetched."""
    fetch = payload.get("fetch") or {}
    if not fetch:
        return payload
    from workers.core.artifacts import fetch as fetch_job

    local: dict[str, str] = {}

    def rewrite(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: rewrite(x) for k, x in v.items()}
        if isinstance(v, list):
            return [rewrite(x) for x in v]
        if not isinstance(v, str):
            return v
        for prefix, arts in fetch.items():
            if v == prefix or v.startswith(prefix + "/"):
                if prefix not in local:
                    local[prefix] = str(fetch_job(prefix, arts, fetch_root(payload)))
                return local[prefix] + v[len(prefix) :]
        return v

    return {**payload, "inputs": rewrite(payload["inputs"])}


# ---- artifacts uploaded after the job ----------------------------------------------------------------
def _inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def uploaded(record: dict[str, Any], workdir: Path, url: str) -> dict[str, Any]:
    """The record with its artifacts uploaded under `url` and recorded there (the URL, the content hash
    computed here, size and mtime as the store reports them) and its outputs naming them by URL. An
    artifact outside the workdir, or an output that names a file of the workdir that is not an artifact,
    is an error (found before anything is uploaded): only the declared artifacts leave this machine."""
    from workers.core.artifacts import remove, upload

    url, work = url.rstrip("/"), str(workdir)
    moved: dict[str, str] = {}  # local artifact path -> its URL
    for a in record.get("artifacts", []):
        if not _inside(a["path"], work) or a["path"] == work:
            raise ValueError(
                f"artifact {a['kind']!r} at {a['path']} is not inside the job's workdir {work}; "
                "only the workdir's artifacts are uploaded"
            )
        moved[a["path"]] = f"{url}/{Path(a['path']).relative_to(work).as_posix()}"

    def rewrite(v: Any, where: str) -> Any:
        if isinstance(v, dict):
            return {k: rewrite(x, f"{where}.{k}") for k, x in v.items()}
        if isinstance(v, list):
            return [rewrite(x, f"{where}.{i}") for i, x in enumerate(v)]
        if not isinstance(v, str) or not _inside(v, work):
            return v
        for local, there in moved.items():
            if _inside(v, local):
                return there + v[len(local) :].replace(os.sep, "/")
        raise ValueError(
            f"{where} names {v}, a file of the job's workdir that is not a declared artifact; "
            "only declared artifacts are uploaded"
        )

    out = dict(record)
    if "outputs" in record:
        out["outputs"] = rewrite(record["outputs"], "outputs")
    remove(url)  # what an earlier run of this job left there is not part of this one
    arts = []
    for a in record.get("artifacts", []):
        there = moved[a["path"]]
        size, mtime = upload(a["path"], there)
        if size != a["size_bytes"]:
            raise OSError(
                f"artifact {a['kind']!r}: {size} bytes arrived at {there}, {a['size_bytes']} were sent"
            )
        arts.append({**a, "path": there, "size_bytes": size, "mtime": mtime})
    if "artifacts" in record:
        out["artifacts"] = arts
    return out
