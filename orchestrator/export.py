"""`moesweep export`: one configuration's final model as a self-contained Hugging Face folder.

What is exported is the checkpoint a job of the sweep wrote, never a model rebuilt here: the distilled
student (stage `distill`, artifact `student`), else the checkpoint an evaluation saved (`evaluate.save:
true`, artifact `student`: a smaller MoE as converted or after Router KD), else a DOT-MoE model (stage
`dot_moe`). Its content is checked against the record first (a changed or missing checkpoint is refused in
one line), then copied with its tokenizer, and beside it go a model card (`README.md`: the recipe, the
scores, the provenance) and the same facts as JSON (`moesweep.json`). The folder loads with
`AutoModelForCausalLM.from_pretrained(DIR)`; a merged or edited MoE, a DOT-MoE or a dense-to-MoE baseline is a
class of moesweep's own, registered by importing its module first (the card names it).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from db.axes import AXES, OUTPUTS, RECOVERIES
from db.store import Store
from orchestrator.schema import nearest_existing
from orchestrator.version import version_text
from workers.core.artifacts import check, download, is_url

# the stages whose checkpoint is a configuration's final model, in the order they are looked for, with the
# artifact kind each writes it as
SOURCES = (("distill", "student"), ("evaluate", "student"), ("dot_moe", "moe"))


class ExportError(Exception):
    """A one-line reason nothing was exported."""


def find(store: Store, config_key: str, sweep: str | None) -> dict[str, Any]:
    """The configuration `config_key` (of `sweep`, or of the one sweep that has it) with its results row."""
    sql = (
        "SELECT r.*, s.name AS sweep_name FROM results r JOIN configurations c ON c.id = r.config_id "
        "JOIN sweeps s ON s.id = c.sweep_id WHERE c.config_key = :k AND s.kind = 'own'"
    )
    params: dict[str, Any] = {"k": config_key}
    if sweep is not None:
        sql += " AND s.name = :s"
        params["s"] = sweep
    cols, rows = store.query(sql, params)
    found = [dict(zip(cols, r, strict=True)) for r in rows]
    if not found:
        where = f"sweep {sweep!r}" if sweep else "any launched sweep"
        hint = _some_keys(store, sweep)
        raise ExportError(f"no configuration {config_key!r} in {where}" + (f"; e.g. {hint}" if hint else ""))
    if len(found) > 1:
        names = ", ".join(sorted(r["sweep_name"] for r in found))
        raise ExportError(
            f"configuration {config_key!r} is in several sweeps ({names}): name one with --sweep"
        )
    return found[0]


def _some_keys(store: Store, sweep: str | None) -> str:
    sql = "SELECT c.config_key FROM configurations c JOIN sweeps s ON s.id = c.sweep_id WHERE s.kind = 'own'"
    params: dict[str, Any] = {}
    if sweep is not None:
        sql += " AND s.name = :s"
        params["s"] = sweep
    keys = [k for (k,) in store.query(sql + " ORDER BY c.id LIMIT 4", params)[1]]
    return ", ".join(keys)


def checkpoint(store: Store, config_id: int) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """(stage, its job row, the checkpoint's artifact row) of a configuration's final model."""
    cols, rows = store.query(
        "SELECT cj.stage, j.id, j.key, j.status, j.code_version, j.versions_json FROM config_jobs cj "
        "JOIN jobs j ON j.id = cj.job_id WHERE cj.config_id = :c",
        {"c": config_id},
    )
    jobs = {r[0]: dict(zip(cols, r, strict=True)) for r in rows}
    for stage, kind in SOURCES:
        job = jobs.get(stage)
        if job is None or job["status"] != "succeeded":
            continue
        arts = [a for a in store.artifacts([job["key"]])[job["key"]] if a["kind"] == kind]
        if arts:
            return stage, job, arts[0] | {"key": job["key"]}
    have = ", ".join(sorted(s for s, j in jobs.items() if j["status"] == "succeeded")) or "none"
    raise ExportError(
        "no checkpoint was written for it (stages done: "
        f"{have}): a distilled student is saved by its distillation; a model evaluated from its plan only "
        "with evaluate.save: true in the sweep file (then launch again)"
    )


def out_problem(out: Path, force: bool) -> str | None:
    """Why a model folder cannot be written at `out` (None: it can): something there already (unless `force`
    replaces it), or a place where no folder can be made: under a file, or in a folder it may not write."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        what = "is not empty" if out.is_dir() else "is a file"
        return f"{out} exists and {what}: choose another folder, or --force to replace it"
    above = nearest_existing(out)
    if not above.is_dir():
        return f"cannot write {out}: {above} is a file, not a folder"
    if not os.access(above, os.W_OK | os.X_OK):
        return f"cannot write {out}: {above} is not writable"
    return None


def export(store: Store, config_key: str, out: Path, sweep: str | None = None, force: bool = False) -> Path:
    """Write `config_key`'s final model, tokenizer, card and facts into `out` (absent, or empty; `force`:
    replace it). Nothing is written when anything is wrong."""
    row = find(store, config_key, sweep)
    stage, job, art = checkpoint(store, int(row["config_id"]))
    state = check(art, full=True)
    if state.problem is not None:
        raise ExportError(
            f"{stage} checkpoint of {config_key!r}: {state.problem}; `moesweep launch` recomputes it"
        )
    problem = out_problem(out, force)
    if problem is not None:
        raise ExportError(problem)
    tmp = Path(tempfile.mkdtemp(prefix=".moesweep-export-", dir=out.parent if out.parent.exists() else None))
    try:
        model = tmp / "model"
        if is_url(art["path"]):
            download(art["path"], model)
        else:
            shutil.copytree(art["path"], model)
        facts = card_facts(store, row, stage, job, art)
        facts["registers"] = registering_module(model)
        (model / "moesweep.json").write_text(json.dumps(facts, indent=1, sort_keys=True, default=str) + "\n")
        (model / "README.md").write_text(model_card(facts))
        if out.exists():
            shutil.rmtree(out) if out.is_dir() else out.unlink()
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(model), str(out))
    except OSError as e:  # a full disk, a folder gone meanwhile: the checkpoint itself is untouched
        raise ExportError(f"cannot write {out}: {e.strerror or e}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _plain(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def card_facts(
    store: Store, row: dict[str, Any], stage: str, job: dict[str, Any], art: dict[str, Any]
) -> dict[str, Any]:
    """What the card states: the recipe (teacher, axes, settings), the scores, the provenance."""
    sweep = row["sweep_name"]
    cols, rows = store.query(
        "SELECT task, metric, value, stderr, n FROM task_scores WHERE config_id = :c ORDER BY task, metric",
        {"c": row["config_id"]},
    )
    tasks = [{k: _plain(v) for k, v in zip(cols, r, strict=True)} for r in rows]
    spec_hash = store.query("SELECT spec_hash FROM sweeps WHERE name = :s", {"s": sweep})[1]
    output = row.get("output") or ("dense" if row.get("kind") == "moe2dense" else None)
    axes = {a: row.get(a) for a in AXES if row.get(a) is not None}
    return {
        "sweep": sweep,
        "config_key": row["config_key"],
        "model": row.get("model"),
        "teacher_variant": row.get("teacher_variant"),
        "kind": row.get("kind"),
        "output": output,
        "output_label": OUTPUTS[output].label if output in OUTPUTS else None,
        "axes": axes,
        "recovery": RECOVERIES[row["recovery"]].label if row.get("recovery") in RECOVERIES else None,
        "settings": json.loads(row["settings"]) if row.get("settings") else None,
        "baseline": row.get("baseline"),
        "selected_for_distill": bool(row.get("selected_for_distill")),
        "scores": {k: _plain(row.get(k)) for k in ("ppl_pre", "ppl_post", "avg_acc", "params") if k in row},
        "tasks": tasks,
        "provenance": {
            "stage": stage,
            "job_key": job["key"],
            "code_version": job.get("code_version"),
            "checkpoint_hash": art.get("content_hash"),
            "sweep_spec_sha256": spec_hash[0][0] if spec_hash else None,
            "libraries": json.loads(job["versions_json"]) if job.get("versions_json") else None,
            "exported_by": version_text().splitlines()[0],
        },
    }


# the modules that register moesweep's own model classes with transformers' Auto classes
CUSTOM_MODULES = (
    "workers.models.merged_model",
    "workers.models.edited_model",
    "workers.models.dot_moe_hf",
    "workers.baselines.dense_to_moe_baselines",
)


def registering_module(folder: Path) -> str | None:
    """The module to import before `from_pretrained` loads the checkpoint in `folder` (None: transformers
    knows its model type)."""
    import importlib

    from transformers import CONFIG_MAPPING
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    if model_type in CONFIG_MAPPING_NAMES:  # transformers' own (not one registered at run time)
        return None
    for mod in CUSTOM_MODULES:
        importlib.import_module(mod)
    if model_type in CONFIG_MAPPING:
        return CONFIG_MAPPING[model_type].__module__
    raise ExportError(
        f"its model type {model_type!r} is neither transformers' nor a class moesweep registers"
    )


def model_card(f: dict[str, Any]) -> str:
    """The model card (Markdown): what this model is, how it was made, what it scored, where it came from."""
    axes = ", ".join(f"{k} = {v}" for k, v in f["axes"].items()) or "—"
    what = f["output_label"] or f["kind"] or "model"
    lines = [
        "---",
        "library_name: transformers",
        "tags: [moesweep, mixture-of-experts, compression]",
        "---",
        "",
        f"# {f['config_key']} ({f['sweep']})",
        "",
        f"A {what} made by moesweep from the teacher `{f['model']}`"
        + (f" ({f['teacher_variant']})" if f.get("teacher_variant") else "")
        + f": configuration `{f['config_key']}` of sweep `{f['sweep']}`, exported from stage `{f['provenance']['stage']}`.",
        "",
        "## Recipe",
        "",
        f"- axes: {axes}",
    ]
    if f.get("recovery"):
        lines.append(f"- recovery: {f['recovery']}")
    if f.get("settings"):
        lines.append(f"- settings: `{json.dumps(f['settings'], sort_keys=True)}`")
    if f.get("baseline"):
        lines.append(f"- baseline: {f['baseline']}")
    lines += ["", "## Scores", "", "| measure | value |", "|---|---|"]
    lines += [f"| {k} | {_fmt(v)} |" for k, v in f["scores"].items()]
    if f["tasks"]:
        lines += ["", "| task | metric | value | stderr | n |", "|---|---|---|---|---|"]
        lines += [
            f"| {t['task']} | {t['metric']} | {_fmt(t['value'])} | {_fmt(t['stderr'])} | {t['n'] or ''} |"
            for t in f["tasks"]
        ]
    p = f["provenance"]
    lines += [
        "",
        "## Provenance",
        "",
        f"- job `{p['job_key']}` (code version `{p['code_version']}`)",
        *([f"- checkpoint content hash `{p['checkpoint_hash']}`"] if p.get("checkpoint_hash") else []),
        *(
            [f"- built from the conversion plan with content hash `{p['plan_hash']}`"]
            if p.get("plan_hash")
            else []
        ),
        *([f"- sweep file hash `{p['sweep_spec_sha256']}`"] if p.get("sweep_spec_sha256") else []),
        f"- exported by {p['exported_by']}",
        "",
        "## Loading",
        "",
        "```python",
    ]
    if f.get("registers"):
        lines.append(
            f"import {f['registers']}  # registers moesweep's model class (from a moesweep checkout)"
        )
    lines += [
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "model = AutoModelForCausalLM.from_pretrained('.')",
        "tokenizer = AutoTokenizer.from_pretrained('.')",
        "```",
        "",
        "`moesweep.json` holds these facts as JSON.",
        "",
    ]
    return "\n".join(lines)


def _fmt(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)
