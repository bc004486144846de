"""The configuration axes and the default selection rule, declared once for every reader.

An axis is a typed column of `configurations` and of the `results` view (its name is its SQL column,
its key in a configuration and its part of a configuration key). This table is plain data: no torch, no
workers import, so the orchestrator (orchestrator/axes.py adds the allowed values, read from the method
registries), the store (the fields it writes), the dashboard (its columns, filters and labels) and analysis
(the design axes of a dense student, the method of a smaller MoE) all derive what they list from it.

Adding an axis: one `Axis(...)` line here, its column in db/models.py and in a migration (configurations
+ results view), and its test; every reader then lists it.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType


@dataclass(frozen=True)
class Output:
    """What a conversion writes (the `output` axis), as every reader needs to know it. The worker side of an
    output (its plan function, its student builder, its own settings) is its `Output` record in `OUTPUTS` of
    workers/models/outputs.py (workers never import db/); a test holds the two to the same names and
    settings."""

    name: str
    method_axis: str  # the axis whose value names the method that makes it (scoring, merging, editing)
    keeps_router: bool  # a smaller MoE (top-k routing kept) rather than a dense student
    settings: tuple[str, ...]  # its own settings in a sub-grid's `settings: {<output>: {...}}`
    kind: str  # configurations.kind of its rows: moe2dense (a dense student) or moe2moe (a smaller MoE)
    paradigm: str  # how the smaller-MoE table names what it does to the experts (prune, merge, edit)
    label: str
    help: str


OUTPUTS: MappingProxyType[str, Output] = MappingProxyType(
    {
        o.name: o
        for o in (
            Output(
                "dense",
                "scoring",
                False,
                ("shared_gate",),
                "moe2dense",
                "convert",
                "dense student",
                "the kept experts grouped, merged and concatenated into one FFN per layer (Algorithm 1)",
            ),
            Output(
                "moe",
                "scoring",
                True,
                ("super_experts",),
                "moe2moe",
                "prune",
                "pruned MoE",
                "the teacher keeping K scored experts per layer and their router rows",
            ),
            Output(
                "merged",
                "merging",
                True,
                (),
                "moe2moe",
                "merge",
                "merged MoE",
                "the E experts merged into K clusters (HC-SMoE, M-SMoE)",
            ),
            Output(
                "edited",
                "editing",
                True,
                (),
                "moe2moe",
                "edit",
                "edited MoE",
                "every expert kept, factorised to a parameter budget, by default that of K experts (MoBE, TD-MoE)",
            ),
        )
    }
)
MOE_OUTPUTS = tuple(o.name for o in OUTPUTS.values() if o.keeps_router)  # the smaller MoEs
DENSE_OUTPUTS = tuple(o.name for o in OUTPUTS.values() if not o.keeps_router)
CONVERTED_KINDS = tuple(
    dict.fromkeys(o.kind for o in OUTPUTS.values())
)  # the grid's rows: moe2dense, moe2moe


@dataclass(frozen=True)
class Recovery:
    """A value of the `recovery` axis: what runs on a smaller MoE between its conversion and its evaluation."""

    name: str
    stage: str | None  # the stage that recovers it (None: evaluated as converted)
    label: str  # how tables name it
    help: str


RECOVERIES: MappingProxyType[str, Recovery] = MappingProxyType(
    {
        r.name: r
        for r in (
            Recovery("none", None, "none", "evaluated as converted"),
            Recovery("router_kd", "router_kd", "Router KD", "only the routers retrained to the teacher's"),
            Recovery(
                "full_kd",
                "distill",
                "full KD",
                "every parameter distilled with the distill section's settings",
            ),
        )
    }
)


def recovered_by(config: dict) -> str | None:
    """The stage whose model a configuration is evaluated as: its recovery's stage, `ppl_pre` for a smaller
    MoE evaluated as converted (that stage holds the converted student), None for a dense student (the
    selection rule decides whether it is distilled)."""
    rec = RECOVERIES.get(config.get("recovery") or "")
    return None if rec is None else rec.stage or "ppl_pre"


def outputs_of(method_axis: str) -> tuple[str, ...]:
    """The outputs whose method is named by `method_axis` (scoring: dense and moe)."""
    return tuple(o.name for o in OUTPUTS.values() if o.method_axis == method_axis)


def kind_of(output: str | None) -> str:
    """configurations.kind of a grid configuration of `output` (None: a dense student)."""
    return OUTPUTS[output or "dense"].kind


@dataclass(frozen=True)
class Axis:
    name: str  # the SQL column of `configurations` and `results`, the sweep file's and the key's name
    kind: type  # str: a registry's names or the choices; int: positive integers
    registry: tuple[str, str] | None  # (module, dict) whose names are the allowed values (a method registry)
    help: str
    default: tuple | None = None  # the grid's value when a sub-grid leaves the axis out (None: required)
    outputs: tuple[str, ...] | None = None  # the outputs it applies to (None: every output)
    choices: tuple[str, ...] = ()  # allowed values of a str axis without a registry
    named: bool = False  # written `name=value` in configuration keys (else the bare value)
    after_student: bool = False  # changes the student after its conversion (a different final model)
    method: bool = False  # its value names the method that makes the student (a sub-grid's settings key it)
    order: int = 0  # where readers list it among the axes (dashboard columns, filters, configuration page)
    label: str = ""  # how readers title it ("" : its name)

    @property
    def title(self) -> str:
        return self.label or self.name

    def applies(self, output: str) -> bool:
        return self.outputs is None or output in self.outputs


# in the order of a configuration key's parts (the grid's product runs in this order too)
AXES: MappingProxyType[str, Axis] = MappingProxyType(
    {
        a.name: a
        for a in (
            Axis(
                "output",
                str,
                ("workers.models.outputs", "OUTPUTS"),
                "a dense student, or a smaller MoE: pruned (moe), merged or edited",
                ("dense",),
                order=5,
            ),
            Axis(
                "scoring",
                str,
                ("workers.methods.scoring", "SCORINGS"),
                "how experts are scored and the K kept are chosen",
                outputs=outputs_of("scoring"),
                method=True,
                order=1,
            ),
            Axis(
                "merging",
                str,
                ("workers.methods.moe_merging", "MERGINGS"),
                "how the E experts are merged into K",
                outputs=outputs_of("merging"),
                method=True,
                order=7,
            ),
            Axis(
                "editing",
                str,
                ("workers.methods.editing", "EDITINGS"),
                "how every expert is factorised to the size of K",
                outputs=outputs_of("editing"),
                method=True,
                order=8,
            ),
            Axis(
                "grouping",
                str,
                ("workers.methods.grouping", "GROUPINGS"),
                "how the K kept experts form k groups",
                ("RR",),
                outputs=DENSE_OUTPUTS,
                order=2,
            ),
            Axis(
                "dp_scaling",
                str,
                ("workers.methods.scaling", "SCALINGS"),
                "the down-projection scale α of each group",
                ("uniform",),
                outputs=DENSE_OUTPUTS,
                order=3,
            ),
            Axis(
                "K",
                int,
                None,
                "experts kept per layer (k ≤ K ≤ E); for editing, the parameter budget of K experts",
                named=True,
                order=4,
            ),
            Axis(
                "recovery",
                str,
                None,
                "what recovers a smaller MoE before evaluation",
                ("none",),
                outputs=MOE_OUTPUTS,
                choices=tuple(RECOVERIES),
                named=True,
                after_student=True,
                order=6,
            ),
        )
    }
)

# the columns of `configurations` a writer sets besides the axes (the ids, config_key and the links
# duplicate_of / variant_of are the store's own)
DESCRIPTION_FIELDS = (
    "model",
    "teacher_variant",
    "family",
    "kind",
    "baseline",
    "top_k",
    "distill_loss",
    "teacher_top_k",
    "distill_tokens",
    "source_table",
    "selected_for_distill",
    "plan_key",
    "note",
    "variant",
    "settings",
)

# the paper's selection rule (§4.1): per scoring × grouping, the lowest finite pre-distillation perplexity
# over K and dp_scaling; a sweep file's `select:` defaults to it and analysis applies it to a sweep that
# stores none
DEFAULT_RULE = MappingProxyType(
    {"best_by": "ppl_pre", "per": ("scoring", "grouping"), "over": ("K", "dp_scaling")}
)


def default_rule() -> dict:
    """A fresh copy of the default selection rule, axes as lists (as stored in `select_json`)."""
    return {
        "best_by": DEFAULT_RULE["best_by"],
        "per": list(DEFAULT_RULE["per"]),
        "over": list(DEFAULT_RULE["over"]),
    }


# ---- what readers derive ------------------------------------------------------------------------------
def names() -> tuple[str, ...]:
    """Every axis, in the order of a configuration key's parts."""
    return tuple(AXES)


def listed() -> tuple[str, ...]:
    """Every axis, in the order readers list them (by `order`, then the key's order)."""
    return tuple(a.name for _, a in sorted(enumerate(AXES.values()), key=lambda ia: (ia[1].order, ia[0])))


def labels() -> dict[str, str]:
    return {a.name: a.title for a in AXES.values()}


def int_axes() -> frozenset[str]:
    return frozenset(a.name for a in AXES.values() if a.kind is int)


def design_axes(output: str = "dense") -> tuple[str, ...]:
    """The axes that shape a student of `output` (not `output` itself), in the key's order; for a dense
    student the paper's four: scoring, grouping, dp_scaling, K."""
    return tuple(a.name for a in AXES.values() if a.name != "output" and a.applies(output))


def method_axes() -> tuple[str, ...]:
    """The axes whose value names the method that makes a student (scoring, merging, editing)."""
    return tuple(a.name for a in AXES.values() if a.method)


def method_axis(output: str) -> str | None:
    """The axis naming the method that makes a student of `output` (a smaller MoE: moe → scoring)."""
    return OUTPUTS[output].method_axis if output in OUTPUTS else None


def method_registries() -> list[tuple[str, str]]:
    """The registries whose entries are code components of their own (never followed from a stage)."""
    return [a.registry for a in AXES.values() if a.registry]


def config_fields() -> tuple[str, ...]:
    """The columns of `configurations` a writer sets from a configuration's dict: its description and axes."""
    return (*DESCRIPTION_FIELDS, *AXES)
