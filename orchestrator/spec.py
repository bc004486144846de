"""The sweep file schema (sweeps/NAME.yaml) and its loader.

The schema is assembled from the stage registry: each stage owns its section (orchestrator/stages/),
the grid's axes come from orchestrator/axes.py, and the few sections that belong to no stage (name,
select, baselines, execution) are declared here. Every mistake becomes one line naming the file, the
field and what is allowed. Loading a sweep imports no torch.
"""

from __future__ import annotations

import errno
import hashlib
import importlib.util
import json
import os
import re
import shlex
import stat
import sys
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    Field,
    ValidationError,
    ValidationInfo,
    create_model,
    field_validator,
    model_validator,
)

from db.axes import default_rule
from orchestrator.axes import AXES
from orchestrator.schema import (  # noqa: F401  (re-exported)
    SHOWN,
    Data,
    OptionError,
    Resources,
    SpecError,
    Strict,
    Teacher,
    artifact_root,
    known,
    one_line,
    shown,
)
from orchestrator.stage import get_stage, stages
from orchestrator.stages.calibrate import Calibration, check_rows, named_sections

# matched with fullmatch: `$` would also match before a final newline ("micro\n")
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
BASELINES = ("teacher", "random_ffn", "random_init", "d2d")
# data turned into token windows with the teacher's tokenizer
CHAT_SECTIONS = ("calibration.", "calibrations.", "router_kd.")


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


HOOK_EVENTS = ("on_end", "on_failure", "on_success")
MAX_HOOK_TIMEOUT_S = 86_400  # a hook is a notifier, not a job: a day at most


class Hooks(Strict):
    """Commands run when a launch that got past validation ends (orchestrator/hooks.py): `on_failure` when
    its exit code is not 0, `on_success` when it is, then `on_end` either way. A string is run by `sh -c`,
    a list is an argv run without a shell. Each runs for at most `timeout_s` seconds."""

    on_end: str | list[str] | None = None
    on_failure: str | list[str] | None = None
    on_success: str | list[str] | None = None
    timeout_s: float = Field(60, gt=0, le=MAX_HOOK_TIMEOUT_S)

    @model_validator(mode="before")
    @classmethod
    def _mapping(cls, v: Any) -> Any:
        if not isinstance(v, dict | Hooks):
            raise ValueError(
                f"expected a mapping of {', '.join(cls.model_fields)} (e.g. {{on_failure: CMD}}), got {shown(v)}"
            )
        return v

    @field_validator(*HOOK_EVENTS, mode="before")
    @classmethod
    def _command(cls, v: Any) -> Any:
        allowed = "a shell command (a string, run by sh -c) or an argv list of strings (run without a shell)"
        if v is None:
            return v
        if isinstance(v, str):
            if not v.strip():
                raise ValueError(f"an empty command; expected {allowed}")
            if "\x00" in v:
                raise ValueError(f"{shown(v)} holds a NUL byte; expected {allowed}")
            return v
        if isinstance(v, list):
            if not v:
                raise ValueError(f"an empty list; expected {allowed}")
            for i, a in enumerate(v):
                if not isinstance(a, str) or "\x00" in a or (i == 0 and not a.strip()):
                    raise ValueError(f"item {i} is {shown(a)}; expected {allowed}")
            return v
        raise ValueError(f"expected {allowed}, got {shown(v)}")

    def commands(self, code: int) -> list[tuple[str, str | list[str]]]:
        """(event, command) of the hooks a launch that exits `code` runs, in order."""
        first = ("on_success", self.on_success) if code == 0 else ("on_failure", self.on_failure)
        return [(e, c) for e, c in (first, ("on_end", self.on_end)) if c is not None]


MIRROR_TRACKERS = ("tensorboard", "wandb", "mlflow")
# a W&B project, optionally after its entity: letters, digits, '.', '_', '-' (W&B refuses / \ # ? % :)
WANDB_PROJECT = re.compile(r"(?:[A-Za-z0-9][A-Za-z0-9._-]{0,127}/)?[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def tracker_installed(package: str) -> bool:
    """Whether `package` (wandb, mlflow) can be imported, without importing it."""
    try:
        return importlib.util.find_spec(package) is not None
    except ValueError:  # in sys.modules without a spec (a module made at run time): importable
        return sys.modules.get(package) is not None


class Mirror(Strict):
    """Where the curves (stepped metrics) of each job a launch finishes are mirrored (orchestrator/mirror.py):
    TensorBoard event files under a local folder, a W&B project, an MLflow tracking server. One run per
    job; a tracker that fails is one warning line, never the launch's outcome."""

    tensorboard: str | None = None  # a local folder: DIR/<sweep>/<stage>/<label>-<key prefix>/
    wandb: str | None = None  # a W&B project, PROJECT or ENTITY/PROJECT (needs the wandb package)
    mlflow: str | None = None  # an MLflow tracking URI; the experiment is the sweep's name (needs mlflow)

    @model_validator(mode="before")
    @classmethod
    def _mapping(cls, v: Any) -> Any:
        if not isinstance(v, dict | Mirror):
            raise ValueError(
                f"expected a mapping of {', '.join(MIRROR_TRACKERS)} (e.g. {{tensorboard: runs/tb}}), "
                f"got {shown(v)}"
            )
        return v

    @field_validator("tensorboard", mode="before")
    @classmethod
    def _folder(cls, v: Any) -> Any:
        allowed = "a local folder (absolute, or relative to where the launch runs; ~ is your home)"
        if v is None:
            return v
        if not isinstance(v, str) or not v.strip() or "\x00" in v:
            raise ValueError(f"expected {allowed}, got {shown(v)}")
        if "://" in v:
            raise ValueError(f"{shown(v)} is a URL; expected {allowed}")
        return v

    @field_validator("wandb", mode="before")
    @classmethod
    def _project(cls, v: Any) -> Any:
        if v is None:
            return v
        if not isinstance(v, str) or not WANDB_PROJECT.fullmatch(v):
            raise ValueError(
                f"expected a W&B project, PROJECT or ENTITY/PROJECT (letters, digits, '.', '_', '-'), "
                f"got {shown(v)}"
            )
        if not tracker_installed("wandb"):
            raise ValueError("needs the wandb package: pip install wandb")
        return v

    @field_validator("mlflow", mode="before")
    @classmethod
    def _uri(cls, v: Any) -> Any:
        if v is None:
            return v
        if not isinstance(v, str) or not v.strip() or any(c.isspace() or c == "\x00" for c in v):
            raise ValueError(
                "expected an MLflow tracking URI without spaces (http://HOST:5000, file:///PATH, databricks), "
                f"got {shown(v)}"
            )
        if not tracker_installed("mlflow"):
            raise ValueError("needs the mlflow package: pip install mlflow")
        return v

    @model_validator(mode="after")
    def _some(self) -> Mirror:
        if all(getattr(self, t) is None for t in MIRROR_TRACKERS):
            raise ValueError(
                "names no tracker; give at least one of tensorboard: DIR, wandb: PROJECT, mlflow: URI "
                "(or mirror: null)"
            )
        return self

    def trackers(self) -> dict[str, str]:
        """{tracker: where} of the trackers it names, in MIRROR_TRACKERS order."""
        return {t: getattr(self, t) for t in MIRROR_TRACKERS if getattr(self, t) is not None}


class Execution(Strict):
    retries: int = Field(1, ge=0)
    max_concurrent: int | None = Field(None, gt=0)
    resources: dict[str, Resources] = Field(default_factory=dict)
    artifacts: str | None = None  # an fsspec URL jobs upload their artifacts to (default: $MOESWEEP_HOME)
    hooks: Hooks | None = None  # commands run when a launch ends (orchestrator/hooks.py)
    mirror: Mirror | None = None  # trackers each finished job's curves go to (orchestrator/mirror.py)

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

    @field_validator("calibrations", check_fields=False)  # sweep_model's field, after `calibration`
    @classmethod
    def _calibrations(cls, v: dict[str, Calibration] | None) -> dict[str, Calibration] | None:
        return named_sections(v)

    @field_validator("grid", check_fields=False)  # the convert stage's section, after calibrations
    @classmethod
    def _grid_calibrations(cls, v: Any, info: ValidationInfo) -> Any:
        if "calibrations" not in info.data:  # its own error is reported
            return v
        return check_rows(v, info.data["calibrations"])

    @field_validator("name")
    @classmethod
    def _slug(cls, v: str) -> str:
        if not NAME.fullmatch(v):
            raise ValueError(
                f"{shown(v)} is not a sweep name; allowed: letters, digits, '.', '_', '-' "
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
        if st.section == "calibration":  # and the named sections a sub-grid may choose (stages/calibrate.py)
            fields["calibrations"] = (dict[str, Calibration] | None, None)
    return create_model("SweepSpec", __base__=SweepSpec, **fields)


# ---- loading ------------------------------------------------------------------------------
MAX_DEPTH = 50  # levels a sweep file may nest (the built-in ones nest at most 6)
MAX_VALUES = 1_000_000  # values a sweep file may hold once its YAML aliases are expanded
MAX_EXTENDS = 32  # files one `extends` chain may hold
# the first line of a stored spec that is not a file's text (it extends another, or was launched with --set)
SPEC_HEADER = "# moesweep: the effective spec of "
SET_LINE = "# --set "
EXTENDS_LINE = "# extends: "


def sweep_dirs() -> list[Path]:
    """Where named sweeps are looked up: $MOESWEEP_SWEEPS, ./sweeps, then the packaged ones."""
    dirs = [Path(p) for p in os.environ.get("MOESWEEP_SWEEPS", "").split(os.pathsep) if p]
    dirs.append(Path.cwd() / "sweeps")
    dirs.append(Path(str(resources.files("sweeps"))))
    return dirs


def _file_problem(p: Path) -> str | None:
    """None if `p` is a regular file (through any symlinks), else what it is, for an error line. A FIFO or
    a device is never opened (reading a FIFO waits for a writer)."""
    try:
        st = p.stat()
    except ValueError:  # a NUL byte in the name
        return "not a file name"
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "a symlink loop; expected a sweep YAML file"
        if p.is_symlink():
            return f"a broken symlink (to {shown(os.readlink(p))}); expected a sweep YAML file"
        if e.errno in (errno.ENOENT, errno.ENOTDIR):
            return "no such file"
        return f"cannot read: {e.strerror}"
    mode = st.st_mode
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return "is a directory; expected a sweep YAML file"
    what = (
        "a FIFO"
        if stat.S_ISFIFO(mode)
        else "a socket"
        if stat.S_ISSOCK(mode)
        else "a device"
        if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
        else "not a file"
    )
    return f"not a regular file ({what}); expected a sweep YAML file"


def relaunch_name(name: str, path: str | Path | None) -> str:
    """What `moesweep launch` takes to find the sweep loaded from `path` again: its name where that name
    finds this very file, else the file's absolute path (shell-quoted), e.g. a sweep file outside the sweep
    folders or one `moesweep compress` wrote."""
    if path is None:
        return name
    try:
        same = os.path.samefile(find_sweep(name), path)
    except (SpecError, OSError):  # the name finds no sweep file, or one that cannot be compared
        same = False
    return name if same else shlex.quote(str(Path(path).resolve()))


def find_sweep(name: str) -> Path:
    p = Path(name)
    if p.suffix in (".yaml", ".yml") or os.sep in name:
        problem = _file_problem(p)
        if problem is None:
            return p
        if p.suffix in (".yaml", ".yml") or os.path.lexists(p):
            raise SpecError(f"{p}: {problem}")
    for d in sweep_dirs():
        f = d / f"{name}.yaml"
        if os.path.lexists(f):
            problem = _file_problem(f)
            if problem is not None:
                raise SpecError(f"{f}: {problem}")
            return f
    raise SpecError(f"no sweep named {shown(name)}; known: {', '.join(list_sweeps()) or 'none'}")


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
                    f"key {shown(key)} appears twice in one mapping (line {m.line + 1}, column {m.column + 1})",
                    key_node.start_mark,
                )
            seen[key] = True
        return super().construct_mapping(node, deep=deep)


def _parse(text: str) -> Any:
    """The YAML value of `text`; YAMLError, or RecursionError for a value nested too deeply to parse."""
    return yaml.load(text, Loader=_StrictLoader)  # noqa: S506  (a SafeLoader subclass)


def _yaml_problem(e: yaml.YAMLError) -> tuple[str, str]:
    """(" at line L, column C" or "", the problem) of a YAML error."""
    mark = getattr(e, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    what = getattr(e, "problem", None) or str(e).splitlines()[0]
    return ("" if "appears twice" in what else where), what


def _shape_problem(value: Any) -> str | None:
    """None, or what is wrong with the shape of a parsed YAML value: nested more than MAX_DEPTH levels, more
    than MAX_VALUES values once its aliases are expanded, or an alias that contains itself. The walk visits
    each node once, so neither depth nor aliases make it slow."""
    depth: dict[int, int] = {}
    size: dict[int, int] = {}
    stack: list[tuple[Any, bool, str]] = [(value, False, "")]
    open_: set[int] = set()  # the nodes whose walk is under way: the ancestors of the node at hand
    while stack:
        node, done, top = stack.pop()
        if not isinstance(node, dict | list):
            continue
        i = id(node)
        kids = list(node.values()) if isinstance(node, dict) else node
        if done:
            inner = [id(k) for k in kids if isinstance(k, dict | list)]
            depth[i] = 1 + max((depth[k] for k in inner), default=0)
            size[i] = len(kids) + sum(size[k] for k in inner)
            open_.discard(i)
            at = f"{top}: " if top else ""
            if depth[i] > MAX_DEPTH:
                return f"{at}nested more than {MAX_DEPTH} levels deep; a sweep file nests a few"
            if size[i] > MAX_VALUES:
                return f"{at}more than {MAX_VALUES:,} values once its YAML aliases are expanded"
            continue
        if i in depth:
            continue
        if i in open_:
            return f"{top + ': ' if top else ''}a YAML alias that contains itself"
        open_.add(i)
        stack.append((node, True, top))
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for k, v in items:
            stack.append((v, False, top or shown(k, 40).strip("'")))
    return None


def read_yaml(path: Path) -> tuple[Any, str]:
    """(parsed YAML, text) or a one-line SpecError with the line and column of the problem."""
    problem = _file_problem(path)
    if problem is not None:
        raise SpecError(f"{path}: {problem}")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise SpecError(
            f"{path}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start})"
        ) from None
    except OSError as e:
        raise SpecError(f"{path}: cannot read: {e.strerror}") from None
    try:
        raw = _parse(text)
    except RecursionError:
        raise SpecError(
            f"{path}: nested too deeply to read; a sweep file nests at most {MAX_DEPTH} levels"
        ) from None
    except yaml.YAMLError as e:
        where, what = _yaml_problem(e)
        raise SpecError(f"{path}: not valid YAML{where}: {what}") from None
    problem = _shape_problem(raw)
    if problem is not None:
        raise SpecError(f"{path}: {problem}")
    return raw, text


# ---- extends: a sweep file that states only what differs from another sweep ------------------------
def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` laid over `base`: mappings merge key by key, at any depth; anything else (a list, a value,
    null) replaces what `base` holds."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _extended(ext: Any, child: Path) -> Path:
    """The file of the sweep that `child` extends: a name looked up like `moesweep launch NAME` (a file
    extending the sweep of its own name gets the next one found, e.g. ./sweeps/tiny.yaml the packaged
    tiny), or a path, relative to `child`'s folder."""
    if not isinstance(ext, str) or not ext.strip():
        raise SpecError(
            f"{child}: extends: expected the name of a sweep or a path to its file, got {shown(ext)}"
        )
    if ext.endswith((".yaml", ".yml")) or "/" in ext or os.sep in ext:
        p = Path(ext) if Path(ext).is_absolute() else child.parent / ext
        problem = _file_problem(p)
        if problem is not None:
            raise SpecError(f"{child}: extends: {p}: {problem}")
        return p
    me = os.path.realpath(child)
    itself = False
    for d in sweep_dirs():
        f = d / f"{ext}.yaml"
        if not os.path.lexists(f):
            continue
        if os.path.realpath(f) == me:
            itself = True
            continue
        problem = _file_problem(f)
        if problem is not None:
            raise SpecError(f"{child}: extends: {f}: {problem}")
        return f
    if itself:
        raise SpecError(
            f"{child}: extends: {ext!r} is this file itself (a cycle); no other sweep is named {ext!r}"
        )
    raise SpecError(
        f"{child}: extends: no sweep named {shown(ext)}; known: {', '.join(list_sweeps()) or 'none'}"
    )


def load_raw(path: Path) -> tuple[dict[str, Any], str, list[str]]:
    """(the sweep file's mapping with every sweep it `extends` merged under it, its text, the names it
    extends, nearest first). One-line SpecError: a file that cannot be read, an unknown name, a cycle."""
    raw, text = read_yaml(path)
    if not isinstance(raw, dict):
        raise SpecError(f"{path}: expected a mapping at the top level")
    layers, chain, files = [raw], [], [path]
    while "extends" in layers[-1]:
        ext = layers[-1]["extends"]
        parent = _extended(ext, files[-1])
        if os.path.realpath(parent) in {os.path.realpath(f) for f in files}:
            cycle = " → ".join(str(f) for f in (*files, parent))
            raise SpecError(f"{files[-1]}: extends: {ext!r} leads back to {parent} (a cycle: {cycle})")
        if len(files) > MAX_EXTENDS:
            raise SpecError(f"{path}: extends: a chain of more than {MAX_EXTENDS} sweep files")
        praw, _ = read_yaml(parent)
        if not isinstance(praw, dict):
            raise SpecError(f"{parent}: expected a mapping at the top level (extended by {files[-1]})")
        layers.append(praw)
        chain.append(ext)
        files.append(parent)
    if chain and "name" not in raw:
        raise SpecError(
            f"{path}: name: required (a sweep that extends {chain[0]!r} is a sweep of its own, with its own name)"
        )
    merged: dict[str, Any] = {}
    for layer in reversed(layers):
        merged = merge(merged, {k: v for k, v in layer.items() if k != "extends"})
    if chain:
        problem = _shape_problem(merged)
        if problem is not None:
            raise SpecError(f"{path}: {problem}")
    return merged, text, chain


# ---- --set: overrides from the command line -----------------------------------------------------
@dataclass(frozen=True)
class Override:
    """`--set PATH=VALUE`: a dotted path into the sweep's mapping (a number indexes a list) and a YAML value."""

    text: str
    path: tuple[str, ...]
    value: Any

    @property
    def shown(self) -> str:
        """The override as an error line or a stored comment shows it: one line, cut to 80 characters."""
        text = self.text if self.text.isprintable() else json.dumps(self.text)[1:-1]
        return text if len(text) <= SHOWN else text[: SHOWN - 1] + "…"


def parse_override(text: str) -> Override:
    """`PATH=VALUE` as an Override; a one-line OptionError naming the --set otherwise."""
    where = f"--set {Override(text, (), None).shown}"
    key, eq, value = text.partition("=")
    key = key.strip()
    if not eq:
        raise OptionError(
            f"{where}: expected PATH=VALUE, a dotted path into the sweep file and a YAML value "
            "(e.g. --set grid.K=[4,8])"
        )
    parts = tuple(key.split("."))
    if not key or not all(parts):
        raise OptionError(f"{where}: {shown(key)} is not a dotted path (e.g. grid.K, distill.settings.steps)")
    if parts[0] == "extends":
        raise OptionError(
            f"{where}: extends is read from a sweep file only; write one that says extends: NAME"
        )
    try:
        parsed = _parse(value)
    except RecursionError:
        raise OptionError(
            f"{where}: the value is nested too deeply; a sweep file nests at most {MAX_DEPTH} levels"
        ) from None
    except yaml.YAMLError as e:
        _, what = _yaml_problem(e)
        raise OptionError(f"{where}: the value is not valid YAML: {what}") from None
    problem = _shape_problem([parsed])
    if problem is not None:
        raise OptionError(f"{where}: the value is {problem.removeprefix('0: ')}")
    return Override(text, parts, parsed)


def _step(node: Any, part: str, o: Override, at: tuple[str, ...], path: Path) -> Any:
    """The key or index `part` names in `node` (a mapping or a list), or a one-line SpecError."""
    field = ".".join(at) or "the top level"
    if isinstance(node, dict):
        if part not in node and part.isdigit() and int(part) in node:
            return int(part)
        return part
    if isinstance(node, list):
        if part.isdigit() and int(part) < len(node):
            return int(part)
        allowed = f"0 to {len(node) - 1}" if node else "nothing (it is empty)"
        raise SpecError(
            f"{path}: --set {o.shown}: {field} is a list of {len(node)}; {shown(part)} is not an index of it "
            f"(allowed: {allowed}), or give the whole list: --set {field}=[...]"
        )
    raise SpecError(
        f"{path}: --set {o.shown}: {field} is {shown(node)}, not a mapping; give it whole: --set {field}=..."
    )


def apply_overrides(raw: dict[str, Any], overrides: list[Override], path: Path) -> dict[str, Any]:
    """`raw` with each override applied in order (a missing mapping on the way is created). `raw` is left
    as it is: the mappings and lists on each override's path are copied, so a value YAML aliases share
    elsewhere keeps its value there."""
    root = dict(raw)
    for o in overrides:
        node: Any = root
        for n, part in enumerate(o.path):
            key = _step(node, part, o, o.path[:n], path)
            if n == len(o.path) - 1:
                node[key] = o.value
                break
            cur = node.get(key) if isinstance(node, dict) else node[key]
            node[key] = (
                {}
                if cur is None
                else dict(cur)
                if isinstance(cur, dict)
                else list(cur)
                if isinstance(cur, list)
                else cur
            )
            node = node[key]
    return root


def _related(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    """Whether one field path lies within the other."""
    n = min(len(a), len(b))
    return n > 0 and tuple(map(str, a[:n])) == tuple(map(str, b[:n]))


FIELD = re.compile(r"([A-Za-z0-9_][A-Za-z0-9_.\-]*): ")


def blame(message: str, overrides: list[Override]) -> str:
    """`message` (a line "field: problem") naming the last --set whose path lies within the field or holds
    it; unchanged when none does."""
    m = FIELD.match(message)
    if not overrides or m is None or message.startswith(("--set ", "with --set ")):
        return message
    field = tuple(m.group(1).split("."))
    hit = [o for o in overrides if _related(o.path, field)]
    return f"--set {hit[-1].shown}: {message}" if hit else message


def effective_text(raw: dict[str, Any], path: Path, chain: list[str], overrides: list[Override]) -> str:
    """The spec stored with a sweep that extends another or was launched with --set: a header naming the
    file, what it extends and each --set in order (YAML comments: the text is a sweep file as it is), then
    the merged mapping."""
    lines = [f"{SPEC_HEADER}{path.name}"]  # the file's name only: the text does not depend on where it is
    lines += [f"{EXTENDS_LINE}{name}" for name in chain]
    lines += [f"{SET_LINE}{o.shown}" for o in overrides]
    body = yaml.safe_dump(raw, sort_keys=False, allow_unicode=True, width=100)
    return "\n".join(lines) + "\n" + body


def spec_notes(spec_yaml: str | None) -> tuple[list[str], list[str]]:
    """(the sweeps it extends, its --set overrides in order) as a stored spec's header lists them."""
    extends: list[str] = []
    sets: list[str] = []
    lines = (spec_yaml or "").splitlines()
    if not lines or not lines[0].startswith(SPEC_HEADER):
        return extends, sets
    for line in lines[1:]:
        if line.startswith(EXTENDS_LINE):
            extends.append(line[len(EXTENDS_LINE) :])
        elif line.startswith(SET_LINE):
            sets.append(line[len(SET_LINE) :])
        else:
            break
    return extends, sets


def _validate(raw: dict[str, Any], path: Path, overrides: list[Override], base: dict[str, Any]) -> SweepSpec:
    try:
        return sweep_model().model_validate(raw)
    except ValidationError as e:
        loc, line = _error(e)
    if overrides:
        hit = [o for o in overrides if _related(o.path, loc)]
        if hit:
            line = f"--set {hit[-1].shown}: {line}"
        else:
            try:
                sweep_model().model_validate(base)
                line = f"with {' '.join(f'--set {o.shown}' for o in overrides)}: {line}"
            except ValidationError:
                pass  # the file is wrong without them too
    raise SpecError(f"{path}: {line}")


def load_spec(name_or_path: str, overrides: list[str] | tuple[str, ...] = ()) -> tuple[SweepSpec, Path, str]:
    """(spec, file, text): the sweep file (with what it `extends` merged under it) and each `--set
    PATH=VALUE` applied in order, validated as one. `text` is the file's text, or for a sweep that extends
    another or has overrides the effective spec (effective_text). Raises SpecError with one line naming
    the file (or the --set) and the field."""
    sets = [parse_override(o) for o in overrides]
    path = find_sweep(name_or_path)
    raw, text, chain = load_raw(path)
    eff = apply_overrides(raw, sets, path) if sets else raw
    problem = _shape_problem(eff) if sets else None
    if problem is not None:
        raise SpecError(f"{path}: with {' '.join(f'--set {o.shown}' for o in sets)}: {problem}")
    spec = _validate(eff, path, sets, raw)
    if sets or chain:
        text = effective_text(eff, path, chain, sets)
    return spec, path, text


def _error(e: ValidationError) -> tuple[tuple[Any, ...], str]:
    """(the field's path, one line "field: problem") of a validation error; a value it echoes is cut."""
    err = e.errors()[0]
    loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and (p.startswith("__") or "[" in p)))
    field = ".".join(str(p) for p in loc) or "(top level)"
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        keys = _allowed_keys(loc)
        msg = "unknown key" + (f"; allowed: {', '.join(keys)}" if keys else "")
    elif err["type"] == "missing":
        msg = "required"
    echo = err["type"] not in ("extra_forbidden", "missing", "value_error")
    return loc, one_line(f"{field}: {msg}" + (f" (got {shown(err['input'])})" if echo else ""))


def _candidates(t: Any) -> list[Any]:
    """The alternatives of an annotation: Annotated, Optional and unions unwrapped."""
    origin = get_origin(t)
    if origin is Annotated:
        return _candidates(get_args(t)[0])
    if origin in (Union, UnionType):
        return [c for a in get_args(t) for c in _candidates(a)]
    return [t]


def _allowed_keys(loc: tuple[Any, ...]) -> list[str]:
    """The keys the schema allows where an unknown key `loc` was given (none known: [])."""
    types: list[Any] = [sweep_model()]
    for part in loc[:-1]:
        nxt: list[Any] = []
        for t in (c for u in types for c in _candidates(u)):
            if isinstance(t, type) and issubclass(t, BaseModel):
                if isinstance(part, str) and part in t.model_fields:
                    nxt.append(t.model_fields[part].annotation)
            elif get_origin(t) is list and isinstance(part, int):
                nxt.append(get_args(t)[0])
            elif get_origin(t) is dict and isinstance(part, str):
                nxt.append(get_args(t)[1])
        types = nxt
    keys: list[str] = []
    for t in (c for u in types for c in _candidates(u)):
        if isinstance(t, type) and issubclass(t, BaseModel):
            keys += [k for k in t.model_fields if k not in keys]
    return keys


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
