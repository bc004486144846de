"""The sweep file schema (sweeps/NAME.yaml) and its loader.

The schema is assembled from the stage registry: each stage owns its section (orchestrator/stages/),
the grid's axes come from orchestrator/axes.py, and the few sections that belong to no stage (name,
select, baselines, execution) are declared here. Every mistake becomes one line naming the file, the
field and what is allowed. Loading a sweep imports no torch.
"""

from __future__ import annotations

import hashlib
import os
import re
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, Field, ValidationError, create_model, field_validator, model_validator

from db.axes import default_rule
from orchestrator.axes import AXES
from orchestrator.schema import Data, Resources, SpecError, Strict, Teacher, artifact_root, known  # noqa: F401  (re-exported)
from orchestrator.stage import get_stage, stages

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
BASELINES = ("teacher", "random_ffn", "random_init", "d2d")
CHAT_SECTIONS = ("calibration.", "router_kd.")  # data turned into token windows with the teacher's tokenizer


class Select(Strict):
    """The selection rule between pre-distillation evaluation and distillation (§4.1): for each group of
    `per` axes, the configuration with the lowest `best_by` over the `over` axes."""

    best_by: Literal["ppl_pre"] = default_rule()["best_by"]
    per: list[str] = Field(default_factory=lambda: default_rule()["per"])
    over: list[str] = Field(default_factory=lambda: default_rule()["over"])

    @field_validator("per", "over")
    @classmethod
    def _axes(cls, v: list[str]) -> list[str]:
        return known(v, AXES, "axis")


class Execution(Strict):
    retries: int = Field(1, ge=0)
    max_concurrent: int | None = Field(None, gt=0)
    resources: dict[str, Resources] = Field(default_factory=dict)
    artifacts: str | None = None  # an fsspec URL jobs upload their artifacts to (default: $MOESWEEP_HOME)

    @field_validator("artifacts")
    @classmethod
    def _artifacts(cls, v: str | None) -> str | None:
        return None if v is None else artifact_root(v)

    @field_validator("resources")
    @classmethod
    def _stages(cls, v: dict[str, Resources]) -> dict[str, Resources]:
        known(list(v), (*(s.name for s in stages()), "default"), "stage")
        return v


class SweepSpec(Strict):
    """The sections that belong to no stage; `sweep_model()` adds one field per stage section."""

    name: str
    description: str = ""
    select: Select | None = Field(default_factory=Select)
    baselines: list[str] = Field(default_factory=list)
    execution: Execution = Field(default_factory=Execution)

    @field_validator("name")
    @classmethod
    def _slug(cls, v: str) -> str:
        if not NAME.match(v):
            raise ValueError(
                f"{v!r} is not a sweep name; allowed: letters, digits, '.', '_', '-' "
                "(starting with a letter or digit, at most 100)"
            )
        return v

    @field_validator("baselines")
    @classmethod
    def _baselines(cls, v: list[str]) -> list[str]:
        return known(v, BASELINES, "baseline")

    @model_validator(mode="after")
    def _d2d_needs_dense(self) -> SweepSpec:
        if "d2d" in self.baselines and getattr(self, "dense_teacher", None) is None:
            raise ValueError("baseline 'd2d' needs a dense_teacher section")
        calibration = getattr(self, "calibration", None)
        if "d2d" in self.baselines and calibration is not None and calibration.sources is not None:
            raise ValueError(
                "baseline 'd2d' prunes on calibration.data; with calibration.sources it is not supported yet"
            )
        return self

    def resources(self, stage: str) -> Resources:
        r = self.execution.resources
        return r.get(stage) or r.get("default") or get_stage(stage).resources


def sweep_model() -> type[SweepSpec]:
    return _sweep_model(stages())


@cache
def _sweep_model(registered: tuple) -> type[SweepSpec]:
    fields: dict[str, Any] = {}
    for st in registered:
        if st.section is None or st.section in fields:
            continue
        if st.section_default == "required":
            fields[st.section] = (st.params, ...)
        elif st.section_default == "default":
            fields[st.section] = (st.params, Field(default_factory=st.params))
        else:
            fields[st.section] = (st.params | None, None)
    return create_model("SweepSpec", __base__=SweepSpec, **fields)


# ---- loading ------------------------------------------------------------------------------
def sweep_dirs() -> list[Path]:
    """Where named sweeps are looked up: $MOESWEEP_SWEEPS, ./sweeps, then the packaged ones."""
    dirs = [Path(p) for p in os.environ.get("MOESWEEP_SWEEPS", "").split(os.pathsep) if p]
    dirs.append(Path.cwd() / "sweeps")
    dirs.append(Path(str(resources.files("sweeps"))))
    return dirs


def find_sweep(name: str) -> Path:
    p = Path(name)
    if p.suffix in (".yaml", ".yml") or os.sep in name:
        if p.is_dir():
            raise SpecError(f"{p}: is a directory; expected a sweep YAML file")
        if p.is_file():
            return p
        if p.suffix in (".yaml", ".yml"):
            raise SpecError(f"{p}: no such file")
    for d in sweep_dirs():
        f = d / f"{name}.yaml"
        if f.is_file():
            return f
    raise SpecError(f"no sweep named {name!r}; known: {', '.join(list_sweeps()) or 'none'}")


def list_sweeps() -> list[str]:
    names: set[str] = set()
    for d in sweep_dirs():
        if d.is_dir():
            names.update(f.stem for f in d.glob("*.yaml"))
    return sorted(names)


class _StrictLoader(yaml.SafeLoader):
    """safe_load that refuses a key given twice in one mapping (YAML would keep the last silently)."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                m = key_node.start_mark
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"key {key!r} appears twice in one mapping (line {m.line + 1}, column {m.column + 1})",
                    key_node.start_mark,
                )
            seen[key] = True
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: Path) -> tuple[Any, str]:
    """(parsed YAML, text) or a one-line SpecError with the line and column of the problem."""
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise SpecError(
            f"{path}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start})"
        ) from None
    except OSError as e:
        raise SpecError(f"{path}: cannot read: {e.strerror}") from None
    try:
        return yaml.load(text, Loader=_StrictLoader), text  # noqa: S506  (a SafeLoader subclass)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        what = getattr(e, "problem", None) or str(e).splitlines()[0]
        if "appears twice" in what:
            where = ""
        raise SpecError(f"{path}: not valid YAML{where}: {what}") from None


def load_spec(name_or_path: str) -> tuple[SweepSpec, Path, str]:
    """(spec, file, text). Raises SpecError with one line naming the file and field."""
    path = find_sweep(name_or_path)
    raw, text = read_yaml(path)
    if not isinstance(raw, dict):
        raise SpecError(f"{path}: expected a mapping at the top level")
    try:
        spec = sweep_model().model_validate(raw)
    except ValidationError as e:
        raise SpecError(f"{path}: {_one_line(e)}") from None
    return spec, path, text


def _one_line(e: ValidationError) -> str:
    err = e.errors()[0]
    loc = [p for p in err["loc"] if not (isinstance(p, str) and (p.startswith("__") or "[" in p))]
    field = ".".join(str(p) for p in loc) or "(top level)"
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        msg = "unknown key"
    elif err["type"] == "missing":
        msg = "required"
    shown = err["type"] not in ("extra_forbidden", "missing", "value_error")
    return f"{field}: {msg}" + (f" (got {err['input']!r})" if shown else "")


def data_sections(spec: SweepSpec) -> list[tuple[str, Data]]:
    """Every data source a sweep names, with where it is named (found in every section, so a new
    stage's data is checked too)."""
    out: list[tuple[str, Data]] = []

    def walk(node: Any, where: str) -> None:
        if isinstance(node, Data):
            out.append((where, node))
        elif isinstance(node, BaseModel):
            for name in type(node).model_fields:
                walk(getattr(node, name), f"{where}.{name}" if where else name)
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{where}.{i}")
        elif isinstance(node, dict):  # e.g. calibration.sources: name -> source
            for k, v in node.items():
                walk(v, f"{where}.{k}")

    walk(spec, "")
    return out


def check_local_paths(spec: SweepSpec, path: Path | str) -> None:
    """A local data file that does not exist is an error when the plan is made, not after a teacher trained."""
    for where, data in data_sections(spec):
        if data.source == "jsonl" and not Path(data.path).is_file():
            raise SpecError(f"{path}: {where}.path: no such file {data.path!r}")
        if data.chat_template and not Path(data.chat_template).is_file():
            raise SpecError(f"{path}: {where}.chat_template: no such file {data.chat_template!r}")
        if data.format == "chat" and not where.startswith(CHAT_SECTIONS):
            raise SpecError(
                f"{path}: {where}.format: 'chat' is read with the teacher's tokenizer only in "
                f"{', '.join(s.rstrip('.') for s in CHAT_SECTIONS)}"
            )
    if (
        spec.teacher.source == "hf"
        and spec.teacher.model
        and (spec.teacher.model.startswith(("/", "./", "../")) and not Path(spec.teacher.model).is_dir())
    ):
        raise SpecError(f"{path}: teacher.model: no such directory {spec.teacher.model!r}")


def spec_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()
