"""The sweep file schema (sweeps/NAME.yaml) and its loader.

Every mistake becomes one line naming the file, the field and what is allowed. Worker-owned
settings (the tiny teacher, distillation) are validated by the workers' own dataclasses so the
schema has one source of truth.
"""

from __future__ import annotations

import hashlib
import os
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class SpecError(ValueError):
    """A sweep file problem, already phrased as one line for the user."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Data(Strict):
    """Where text comes from: the embedded corpus, a local JSONL file, or a Hugging Face dataset."""

    source: Literal["tiny", "jsonl", "hf"] = "tiny"
    split: str = "train"
    path: str | None = None  # jsonl file, or HF dataset path (e.g. "Salesforce/wikitext")
    name: str | None = None  # HF config name (e.g. "wikitext-103-raw-v1")
    text_field: str = "text"
    streaming: bool = False

    @model_validator(mode="after")
    def _needs_path(self) -> Data:
        if self.source in ("jsonl", "hf") and not self.path:
            raise ValueError(f"source {self.source!r} needs a path")
        return self


class Teacher(Strict):
    source: Literal["tiny", "hf"] = "tiny"
    model: str | None = None  # HF id or local directory (source hf)
    revision: str | None = None
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    variant: str | None = None  # a label such as "instruct" or "base"
    label: str | None = None  # the model name shown in results (default: model id or "tiny")
    num_experts: int | None = Field(None, gt=0)  # known up front so dry runs need no download
    top_k: int | None = Field(None, gt=0)
    tiny: dict[str, Any] = Field(default_factory=dict)  # workers.tiny.teacher.TinyTeacherSpec fields

    @model_validator(mode="after")
    def _needs_model(self) -> Teacher:
        if self.source == "hf" and not self.model:
            raise ValueError("source 'hf' needs model (a Hugging Face id or a local path)")
        return self


class Calibration(Strict):
    data: Data = Field(default_factory=Data)
    n_samples: int = Field(256, gt=0)
    seq_len: int = Field(128, gt=1)
    seed: int = 1234
    batch_size: int = Field(16, gt=0)
    chunk_tokens: int = Field(2048, gt=0)


class Grid(Strict):
    scoring: list[str]
    grouping: list[str] = Field(default_factory=lambda: ["RR"])
    dp_scaling: list[str] = Field(default_factory=lambda: ["uniform"])
    K: list[int]

    @field_validator("scoring")
    @classmethod
    def _scorings(cls, v: list[str]) -> list[str]:
        from workers.scoring import SCORINGS

        return _known(v, SCORINGS, "scoring")

    @field_validator("grouping")
    @classmethod
    def _groupings(cls, v: list[str]) -> list[str]:
        from workers.grouping import GROUPINGS

        return _known(v, GROUPINGS, "grouping")

    @field_validator("dp_scaling")
    @classmethod
    def _scalings(cls, v: list[str]) -> list[str]:
        from workers.scaling import SCALINGS

        return _known(v, SCALINGS, "dp_scaling")

    @field_validator("K")
    @classmethod
    def _positive(cls, v: list[int]) -> list[int]:
        if not v or any(k < 1 for k in v):
            raise ValueError(f"K must be a non-empty list of positive integers, got {v}")
        return v


class Perplexity(Strict):
    data: Data = Field(default_factory=lambda: Data(split="test"))
    seq_len: int = Field(128, gt=1)
    max_windows: int | None = Field(None, gt=0)
    batch_size: int = Field(16, gt=0)
    add_bos: bool = False
    windows: Literal["disjoint", "rolling"] = "disjoint"  # rolling = lm-eval's protocol (needs add_bos)


class Select(Strict):
    best_by: Literal["ppl_pre"] = "ppl_pre"
    per: list[str] = Field(default_factory=lambda: ["scoring", "grouping"])
    over: list[str] = Field(default_factory=lambda: ["K", "dp_scaling"])

    @field_validator("per", "over")
    @classmethod
    def _axes(cls, v: list[str]) -> list[str]:
        return _known(v, AXES, "axis")


class Distill(Strict):
    settings: dict[str, Any] = Field(default_factory=dict)  # workers.distill.DistillSpec fields
    data: Data = Field(default_factory=Data)
    val_data: Data = Field(default_factory=lambda: Data(split="valid"))
    variants: list[dict[str, Any]] = Field(default_factory=list)  # extra runs: overrides of settings
    variants_on: dict[str, Any] = Field(default_factory=dict)  # which selected configs get them
    # data-parallel processes per distillation job: 1, N, or "gpus" (one per GPU the job holds; torchrun)
    processes: int | Literal["gpus"] = 1

    @field_validator("processes")
    @classmethod
    def _procs(cls, v: int | str) -> int | str:
        if isinstance(v, int) and v < 1:
            raise ValueError(f"must be >= 1 or 'gpus', got {v}")
        return v


class Evaluate(Strict):
    suite: str | list[dict[str, Any]] = "tiny"
    backend: Literal["hf", "vllm"] = "hf"
    batch_size: int = Field(16, gt=0)
    limit: int | None = None  # samples per task (for quick looks); None = all
    ppl: bool = True  # also the post-distill perplexity

    @field_validator("suite")
    @classmethod
    def _suite(cls, v: str | list[dict[str, Any]]) -> str | list[dict[str, Any]]:
        from workers.suites import validate_suite

        validate_suite(v)
        return v


class Resources(Strict):
    cpus: float = Field(1, gt=0)
    gpus: float = Field(0, ge=0)


class Execution(Strict):
    retries: int = Field(1, ge=0)
    max_concurrent: int | None = Field(None, gt=0)
    resources: dict[str, Resources] = Field(default_factory=dict)

    @field_validator("resources")
    @classmethod
    def _stages(cls, v: dict[str, Resources]) -> dict[str, Resources]:
        _known(list(v), (*STAGES, "default"), "stage")
        return v


class SweepSpec(Strict):
    name: str
    description: str = ""
    teacher: Teacher = Field(default_factory=Teacher)
    dense_teacher: Teacher | None = None  # for the dense-to-dense baseline
    calibration: Calibration = Field(default_factory=Calibration)
    grid: Grid
    ppl: Perplexity = Field(default_factory=Perplexity)
    select: Select | None = Field(default_factory=Select)
    distill: Distill | None = None
    evaluate: Evaluate | None = None
    baselines: list[str] = Field(default_factory=list)
    execution: Execution = Field(default_factory=Execution)

    @field_validator("baselines")
    @classmethod
    def _baselines(cls, v: list[str]) -> list[str]:
        return _known(v, BASELINES, "baseline")

    @model_validator(mode="after")
    def _d2d_needs_dense(self) -> SweepSpec:
        if "d2d" in self.baselines and self.dense_teacher is None:
            raise ValueError("baseline 'd2d' needs a dense_teacher section")
        return self

    def resources(self, stage: str) -> Resources:
        r = self.execution.resources
        return r.get(stage) or r.get("default") or Resources()


AXES = ("scoring", "grouping", "dp_scaling", "K")
STAGES = ("teacher", "dense_teacher", "calibrate", "convert", "ppl_pre", "distill", "evaluate")
BASELINES = ("teacher", "random_ffn", "random_init", "d2d")


def _known(values: list[str], allowed, what: str) -> list[str]:
    allowed = list(allowed)
    for v in values:
        if v not in allowed:
            raise ValueError(f"unknown {what} {v!r}; allowed: {', '.join(map(str, allowed))}")
    return values


# ---- loading ------------------------------------------------------------------------------
def sweep_dirs() -> list[Path]:
    """Where named sweeps are looked up: $MOESWEEP_SWEEPS, ./sweeps, then the packaged ones."""
    dirs = [Path(p) for p in os.environ.get("MOESWEEP_SWEEPS", "").split(os.pathsep) if p]
    dirs.append(Path.cwd() / "sweeps")
    dirs.append(Path(str(resources.files("sweeps"))))
    return dirs


def find_sweep(name: str) -> Path:
    p = Path(name)
    if p.suffix in (".yaml", ".yml") and p.exists():
        return p
    for d in sweep_dirs():
        f = d / f"{name}.yaml"
        if f.exists():
            return f
    raise SpecError(f"no sweep named {name!r}; known: {', '.join(list_sweeps()) or 'none'}")


def list_sweeps() -> list[str]:
    names: set[str] = set()
    for d in sweep_dirs():
        if d.is_dir():
            names.update(f.stem for f in d.glob("*.yaml"))
    return sorted(names)


def load_spec(name_or_path: str) -> tuple[SweepSpec, Path, str]:
    """(spec, file, text). Raises SpecError with one line naming the file and field."""
    path = find_sweep(name_or_path)
    text = path.read_text()
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise SpecError(f"{path}: not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(raw, dict):
        raise SpecError(f"{path}: expected a mapping at the top level")
    try:
        spec = SweepSpec.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "(top level)"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        raise SpecError(f"{path}: {field}: {msg}" + (f" (got {err['input']!r})"
                        if err["type"] not in ("extra_forbidden", "missing", "value_error") else "")) from None
    _check_worker_settings(spec, path)
    return spec, path, text


def _check_worker_settings(spec: SweepSpec, path: Path) -> None:
    """Validate pass-through sections with the workers' own dataclasses."""
    from workers.distill import DistillSpec
    from workers.tiny.teacher import TinyTeacherSpec

    checks: list[tuple[str, type, dict]] = [("teacher.tiny", TinyTeacherSpec, spec.teacher.tiny)]
    if spec.dense_teacher is not None:
        checks.append(("dense_teacher.tiny", TinyTeacherSpec, spec.dense_teacher.tiny))
    if spec.distill is not None:
        checks.append(("distill.settings", DistillSpec, spec.distill.settings))
        for i, v in enumerate(spec.distill.variants):
            checks.append((f"distill.variants.{i}", DistillSpec, {**spec.distill.settings, **v}))
    for where, cls, values in checks:
        fields = set(getattr(cls, "__dataclass_fields__", {}) or getattr(cls, "model_fields", {}))
        for key in values:
            if key not in fields:
                raise SpecError(f"{path}: {where}.{key}: unknown key; allowed: {', '.join(sorted(fields))}")
        try:
            cls(**values)
        except (TypeError, ValueError) as e:
            raise SpecError(f"{path}: {where}: {str(e).splitlines()[0]}") from None


def spec_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()
