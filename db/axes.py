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

MOE_OUTPUTS = ("moe", "merged", "edited")  # the outputs that keep a router (a smaller MoE)


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
                outputs=("dense", "moe"),
                method=True,
                order=1,
            ),
            Axis(
                "merging",
                str,
                ("workers.methods.moe_merging", "MERGINGS"),
                "how the E experts are merged into K",
                outputs=("merged",),
                method=True,
                order=7,
            ),
            Axis(
                "editing",
                str,
                ("workers.methods.editing", "EDITINGS"),
                "how every expert is factorised to the size of K",
                outputs=("edited",),
                method=True,
                order=8,
            ),
            Axis(
                "grouping",
                str,
                ("workers.methods.grouping", "GROUPINGS"),
                "how the K kept experts form k groups",
                ("RR",),
                outputs=("dense",),
                order=2,
            ),
            Axis(
                "dp_scaling",
                str,
                ("workers.methods.scaling", "SCALINGS"),
                "the down-projection scale α of each group",
                ("uniform",),
                outputs=("dense",),
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
                choices=("none", "router_kd", "full_kd"),
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
    return next((a.name for a in AXES.values() if a.method and a.applies(output)), None)


def method_registries() -> list[tuple[str, str]]:
    """The registries whose entries are code components of their own (never followed from a stage)."""
    return [a.registry for a in AXES.values() if a.registry]


def config_fields() -> tuple[str, ...]:
    """The columns of `configurations` a writer sets from a configuration's dict: its description and axes."""
    return (*DESCRIPTION_FIELDS, *AXES)
