"""`moesweep compress MODEL`: one compressed model, not a sweep (what a REAP or llm-compressor user wants).

It writes a one-configuration sweep (teacher MODEL, one calibration, one grid cell), runs it through the
same stages as any sweep — calibration, conversion and, unless told not to, the pre-distillation
perplexity — in a database and home of its own (`--db`, `$MOESWEEP_HOME`; a second call with the same
settings reuses what the first computed), then builds the student from the conversion's plan and writes it
with its tokenizer, a model card and `moesweep.json` into the output folder. The sweep file it ran is kept
beside the database (`compress/<name>.yaml`), so the run is a named sweep like any other: `moesweep
status`, `sql` and `report` read it.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from db.axes import AXES, OUTPUTS
from db.store import Store, home
from orchestrator.axes import AXES as GRID_AXES
from orchestrator.export import ExportError, model_card, out_problem, registering_module
from orchestrator.version import version_text

DEFAULT_DATA = "hf:Salesforce/wikitext/wikitext-103-raw-v1"


@dataclass
class Request:
    model: str
    out: Path
    output: str = "moe"
    method: str | None = None  # scoring, merging or editing, by the output's method axis (default below)
    K: int = 0
    grouping: str = "RR"
    dp_scaling: str = "uniform"
    data: str = DEFAULT_DATA  # hf:PATH[/NAME] or jsonl:FILE
    n_samples: int = 128
    seq_len: int = 2048
    ppl: bool = True
    dtype: str = "bfloat16"
    name: str | None = None


DEFAULT_METHOD = {"scoring": "REAP", "merging": "HC-SMoE", "editing": "MoBE"}


def data_section(spec: str, split: str) -> dict[str, Any]:
    """`hf:PATH[/NAME]` (a Hugging Face dataset, e.g. hf:Salesforce/wikitext/wikitext-103-raw-v1) or
    `jsonl:FILE` (one {"text": …} per line)."""
    kind, sep, rest = spec.partition(":")
    if kind == "jsonl" and sep and rest:
        path = Path(rest).expanduser().resolve()
        if not path.is_file():
            raise ExportError(f"--data {spec!r}: no such file {path}")
        return {"source": "jsonl", "path": str(path)}
    if kind == "hf" and sep and rest:
        parts = rest.split("/")
        path, name = ("/".join(parts[:2]), "/".join(parts[2:]) or None) if len(parts) > 1 else (rest, None)
        return {"source": "hf", "path": path, **({"name": name} if name else {}), "split": split}
    raise ExportError(f"--data {spec!r}: allowed: hf:PATH[/NAME] (a Hugging Face dataset) or jsonl:FILE")


def sweep_of(r: Request) -> dict[str, Any]:
    """The one-configuration sweep that makes `r`'s model."""
    if r.output not in OUTPUTS:
        raise ExportError(f"--output {r.output!r}: allowed: {', '.join(OUTPUTS)}")
    axis = OUTPUTS[r.output].method_axis
    method = r.method or DEFAULT_METHOD[axis]
    allowed = GRID_AXES[axis].allowed()
    if method not in allowed:
        raise ExportError(f"--{axis} {method!r} (for output {r.output}): allowed: {', '.join(allowed)}")
    if r.K < 1:
        raise ExportError(f"--K {r.K}: give the experts to keep per layer, a positive integer")
    cell: dict[str, Any] = {"output": [r.output], axis: [method], "K": [r.K]}
    if not OUTPUTS[r.output].keeps_router:
        cell |= {"grouping": [r.grouping], "dp_scaling": [r.dp_scaling]}
    slug = (
        re.sub(r"[^A-Za-z0-9._-]+", "-", r.model.rstrip("/").rsplit("/", 1)[-1]).strip("-.").lower()
        or "model"
    )
    name = r.name or f"compress-{slug}-{r.output}-{method.lower()}-k{r.K}"
    sweep: dict[str, Any] = {
        "name": name,
        "description": f"moesweep compress {r.model}: output {r.output}, {axis} {method}, K = {r.K}",
        "teacher": {"source": "hf", "model": r.model, "dtype": r.dtype},
        "calibration": {
            "data": data_section(r.data, "train"),
            "n_samples": r.n_samples,
            "seq_len": r.seq_len,
        },
        "grid": [cell],
        "execution": {"retries": 0},
    }
    if r.ppl:
        held = data_section(r.data, "test")
        sweep["ppl"] = {"data": held, "seq_len": r.seq_len, "max_windows": 64}
    return sweep


def compress(r: Request, store: Store, executor, console, force: bool = False) -> Path:
    """Run `r`'s sweep and write its model into `r.out`; returns the folder."""
    from orchestrator.launch import launch
    from orchestrator.scope import Scope
    from orchestrator.spec import load_spec

    problem = out_problem(r.out, force)  # said before anything is computed
    if problem is not None:
        raise ExportError(problem)
    sweep = sweep_of(r)
    folder = home() / "compress"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{sweep['name']}.yaml"
    path.write_text(yaml.safe_dump(sweep, sort_keys=False))
    spec, path, text = load_spec(str(path))
    code = launch(
        spec,
        text,
        store,
        executor,
        console=console,
        path=str(path),
        scope=Scope(until="ppl_pre" if r.ppl else "convert"),
    )
    if code != 0:
        raise ExportError(
            f"the run of sweep {spec.name} failed (exit {code}); moesweep status {spec.name} says where"
        )
    (row,) = [c for c in store.configs(store.sweep_id(spec.name)) if c["kind"] in ("moe2dense", "moe2moe")]
    return write_model(store, spec.name, row, r, force)


def write_model(store: Store, sweep: str, row: dict[str, Any], r: Request, force: bool) -> Path:
    """Build the configuration's student from its conversion's plan and save it with its card."""
    from workers.families import get_adapter
    from workers.models.outputs import write_student
    from workers.models.plans import load_plans
    from workers.run.runtime import load_model

    (job,) = store.query(
        "SELECT j.key, j.code_version FROM config_jobs cj JOIN jobs j ON j.id = cj.job_id "
        "WHERE cj.config_id = :c AND cj.stage = 'convert'",
        {"c": row["id"]},
    )[1]
    plan = next(a for a in store.artifacts([job[0]])[job[0]] if a["kind"] == "plan")
    model, tok = load_model(r.model, r.dtype)
    student = write_student(
        row.get("output") or "dense",
        model,
        get_adapter(model),
        load_plans(plan["path"]),
        share_weights=False,
        plan_path=plan["path"],
    )
    tmp = Path(
        tempfile.mkdtemp(prefix=".moesweep-compress-", dir=r.out.parent if r.out.parent.exists() else None)
    )
    try:
        target = tmp / "model"
        student.save_pretrained(target)
        tok.save_pretrained(target)
        facts = compress_facts(store, sweep, row, job, plan, r)
        facts["registers"] = registering_module(target)
        (target / "moesweep.json").write_text(json.dumps(facts, indent=1, sort_keys=True, default=str) + "\n")
        (target / "README.md").write_text(model_card(facts))
        if r.out.exists():
            shutil.rmtree(r.out) if r.out.is_dir() else r.out.unlink()
        r.out.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(target), str(r.out))
    except OSError as e:  # a full disk, a folder gone meanwhile: the sweep's jobs are kept
        raise ExportError(f"cannot write {r.out}: {e.strerror or e}; the same call writes it again") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return r.out


def compress_facts(
    store: Store, sweep: str, row: dict[str, Any], job: tuple, plan: dict[str, Any], r: Request
) -> dict[str, Any]:
    cols, rows = store.query("SELECT * FROM results WHERE config_id = :c", {"c": row["id"]})
    res = dict(zip(cols, rows[0], strict=True)) if rows else {}
    output = row.get("output") or "dense"
    return {
        "sweep": sweep,
        "config_key": row["config_key"],
        "model": r.model,
        "teacher_variant": None,
        "kind": row.get("kind"),
        "output": output,
        "output_label": OUTPUTS[output].label,
        "axes": {a: row.get(a) for a in AXES if row.get(a) is not None},
        "recovery": None,
        "settings": json.loads(row["settings"]) if row.get("settings") else None,
        "baseline": None,
        "scores": {"ppl_pre": res.get("ppl_pre"), "params": res.get("params")},
        "tasks": [],
        "calibration": {"data": r.data, "n_samples": r.n_samples, "seq_len": r.seq_len},
        "provenance": {
            "stage": "convert",
            "job_key": job[0],
            "code_version": job[1],
            "checkpoint_hash": None,
            "plan_hash": plan.get("content_hash"),
            "sweep_spec_sha256": None,
            "exported_by": version_text().splitlines()[0],
        },
    }
