"""Pieces of the sweep file schema that several stages share, and the one-line error type.

Every stage owns its own section model (orchestrator/stages/*.py); orchestrator/spec.py assembles the
whole schema from the stage registry. Nothing here imports torch: a dry run validates a sweep file
from the source alone.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator, model_validator


class SpecError(ValueError):
    """A sweep file problem, already phrased as one line for the user."""


class OptionError(SpecError):
    """A command-line option's problem (`--set`, `--until`, `--only`), one line naming the option: it is
    shown as it is, not as a problem of the sweep file."""


SHOWN = 80  # at most this many characters of a value are echoed in an error line


def shown(value: Any, limit: int = SHOWN) -> str:
    """repr(value) for an error line, cut to `limit` characters with … (a sweep file may hold a value of
    megabytes; the line names it, it does not repeat it)."""
    if isinstance(value, str) and len(value) > 4 * limit:
        value = value[: 4 * limit] + "…"  # repr of the head only, not of megabytes
    try:
        text = repr(value)
    except (RecursionError, ValueError):
        text = f"<a {type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 1] + "…"


def one_line(message: str, word: int = 1024, limit: int = 4096) -> str:
    """`message` as one line: whitespace runs become one space, a run of more than `word` characters
    without a space (a value echoed without `shown`: paths are shorter) is cut to SHOWN with …, and a line
    still longer than `limit` is cut at the end."""
    words = [w if len(w) <= word else w[: SHOWN - 1] + "…" for w in message.split()]
    line = " ".join(words)
    return line if len(line) <= limit else line[: limit - 1] + "…"


class Strict(BaseModel):
    """Unknown keys are errors; values are not coerced between types (K: "4" or 4.0 is not 4)."""

    model_config = ConfigDict(extra="forbid", strict=True)


PosInt = Annotated[StrictInt, Field(gt=0)]


class Data(Strict):
    """Where text comes from: the embedded corpus, a local JSONL file, or a Hugging Face dataset.

    `format: chat` reads instruction records instead of plain text (a post-trained teacher sees its
    chat format): `messages_field` (a list of {role, content}) or `prompt_field` with an optional
    `response_field`, rendered by the teacher tokenizer's chat template, or by the Jinja file
    `chat_template` (for a tokenizer without one, or to override it).
    """

    source: Literal["tiny", "jsonl", "hf"] = "tiny"
    split: str = "train"
    path: str | None = None  # jsonl file, or HF dataset path (e.g. "Salesforce/wikitext")
    name: str | None = None  # HF config name (e.g. "wikitext-103-raw-v1")
    text_field: str = "text"
    streaming: bool = False
    format: Literal["text", "chat"] = "text"
    messages_field: str | None = None  # format chat: a list of {role, content}
    prompt_field: str | None = None  # format chat: a user turn …
    response_field: str | None = None  # … and, optionally, the assistant's answer
    chat_template: str | None = None  # format chat: a local Jinja file (default: the tokenizer's template)

    @model_validator(mode="after")
    def _needs_path(self) -> Data:
        if self.source in ("jsonl", "hf") and not self.path:
            raise ValueError(f"source {self.source!r} needs a path")
        return self

    @model_validator(mode="after")
    def _chat_fields(self) -> Data:
        from workers.core.data import chat_field_error

        error = chat_field_error(
            self.source,
            self.format,
            self.messages_field,
            self.prompt_field,
            self.response_field,
            self.chat_template,
        )
        if error:
            raise ValueError(error)
        return self


class Teacher(Strict):
    """The MoE teacher (or the dense teacher of the D2D baseline). E, k, renormalisation and shared
    experts come from the model's config; stating them here is optional and checked against it."""

    source: Literal["tiny", "hf"] = "tiny"
    model: str | None = None  # HF id or local directory (source hf)
    revision: str | None = None
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    variant: str | None = None  # a label such as "instruct" or "base"
    label: str | None = None  # the model name shown in results (default: model id or "tiny")
    num_experts: PosInt | None = None  # checked against the config; lets a dry run plan without it
    top_k: PosInt | None = None
    renormalize: bool | None = None
    shared_experts: Annotated[StrictInt, Field(ge=0)] | None = None
    tiny: dict[str, Any] = Field(default_factory=dict)  # workers.tiny.spec.TinyTeacherSpec fields

    @field_validator("tiny")
    @classmethod
    def _tiny(cls, v: dict[str, Any]) -> dict[str, Any]:
        from workers.tiny.spec import TinyTeacherSpec

        return worker_settings(TinyTeacherSpec, v)

    @model_validator(mode="after")
    def _needs_model(self) -> Teacher:
        if self.source == "hf" and not self.model:
            raise ValueError("source 'hf' needs model (a Hugging Face id or a local path)")
        return self


RAY_BUILTIN = ("CPU", "GPU", "memory", "object_store_memory")


class Resources(Strict):
    """What one job of a stage holds while it runs. `custom`: Ray custom resources (`ray start
    --resources '{"a100": 8}'`), so a stage runs only on the nodes that declare them."""

    cpus: Annotated[float, Field(gt=0, strict=False)] = 1
    gpus: Annotated[float, Field(ge=0, strict=False)] = 0
    custom: dict[str, Annotated[float, Field(gt=0, strict=False)]] = Field(default_factory=dict)

    @field_validator("custom")
    @classmethod
    def _custom(cls, v: dict[str, float]) -> dict[str, float]:
        for name in v:
            if name in RAY_BUILTIN:
                raise ValueError(f"custom resource {name!r} is built in; use cpus / gpus")
        return v


def worker_settings(cls: type, values: dict[str, Any], where: str = "") -> dict[str, Any]:
    """`values` checked by a worker's torch-free settings dataclass (the worker builds the same object
    from them): an unknown key or a value the dataclass refuses is one ValueError line."""
    fields = sorted(getattr(cls, "__dataclass_fields__", {}))
    at = f"{where}." if where else ""
    for key in values:
        if key not in fields:
            raise ValueError(f"{at}{key}: unknown key; allowed: {', '.join(fields)}")
    try:
        cls(**values)
    except (TypeError, ValueError) as e:
        raise ValueError((f"{where}: " if where else "") + str(e).splitlines()[0]) from None
    return values


TYPE_RULES: dict[str, tuple[tuple[type, ...], str]] = {
    "int": ((int,), "an integer"),
    "float": ((int, float), "a number"),
    "str": ((str,), "a string"),
    "bool": ((bool,), "true or false"),
}


def typed_setting(cls: type, key: str, value: Any) -> Any:
    """One value of a worker's settings dataclass read as strictly as the sweep schema reads a value: of
    the field's declared type (`int`, `float`, `str` or `bool`; other annotations are left to the
    dataclass), a boolean being no number, and an integer of a `float` field made a float (as pydantic
    does, so job parameters keep their types). A ValueError line otherwise."""
    f = next(f for f in dataclasses.fields(cls) if f.name == key)
    rule = TYPE_RULES.get(f.type if isinstance(f.type, str) else getattr(f.type, "__name__", ""))
    if rule is None:
        return value
    allowed, what = rule
    if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
        raise ValueError(f"must be {what}")
    if f.type in ("float", float) and isinstance(value, int):
        try:
            return float(value)
        except OverflowError:
            raise ValueError("must be a finite number") from None
    return value


def known(values: list[Any], allowed, what: str) -> list[Any]:
    """`values` unchanged if each is allowed and none repeats; else one ValueError line."""
    allowed = list(allowed)
    seen: set[Any] = set()
    for v in values:
        if v not in allowed:
            raise ValueError(f"unknown {what} {shown(v)}; allowed: {', '.join(map(str, allowed))}")
        if v in seen:
            raise ValueError(f"{what} {shown(v)} is listed twice")
        seen.add(v)
    return values


def artifact_root(value: str) -> str:
    """Where jobs upload their artifacts (`execution.artifacts`, `$MOESWEEP_ARTIFACTS`): an fsspec URL
    (`s3://bucket/prefix`, `gs://…`, `file:///mnt/shared/x`, `memory://x` in one process) or an absolute
    path (read as `file://`). A protocol fsspec does not know, or whose package is not installed (`s3fs`,
    `gcsfs`), is a ValueError line when the sweep is read, not after a job ran."""
    import fsspec

    if "://" not in value:
        if not value.startswith("/"):
            raise ValueError(f"{value!r} is neither a URL (s3://…, gs://…, file:///…) nor an absolute path")
        value = "file://" + value
    protocol = value.split("://", 1)[0]
    try:
        fsspec.get_filesystem_class(protocol)
    except ImportError as e:
        raise ValueError(f"{protocol}:// needs its fsspec package ({str(e).splitlines()[0]})") from None
    except ValueError:
        raise ValueError(f"{protocol}:// is not a protocol fsspec knows") from None
    blocked = blocking_file(Path(value[len("file://") :])) if protocol == "file" else None
    if blocked is not None:  # a local folder that cannot be made is said now, not by the first job
        raise ValueError(f"{value}: {blocked} is a file, not a folder")
    return value.rstrip("/")


def nearest_existing(path: Path) -> Path:
    """`path`'s nearest ancestor that exists: where making the folders of `path` would start."""
    above = path.absolute().parent
    while not above.exists():
        above = above.parent
    return above


def blocking_file(path: Path) -> Path | None:
    """The file that stands where a folder on `path`'s way would have to be made, if any."""
    above = nearest_existing(path)
    return None if above.is_dir() else above
