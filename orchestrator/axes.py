"""The axes of a sweep's grid, declared once.

An axis is a typed column of `configurations` and of the `results` view; its allowed values are the
names of a method registry (read from the registry's source, so validating a sweep imports no torch),
a fixed set of choices, or any positive integer. A configuration's jobs hash the code of the registry
entries they name (orchestrator/codever.py), so editing one method recomputes exactly the
configurations that use it. Some axes apply to some outputs only (scoring chooses the experts of a dense
student or a pruned MoE; merging and editing make a merged or an edited MoE; grouping and dp_scaling shape
a dense student; recovery applies to the three smaller MoEs): a sub-grid of another output may not name
them, and its configurations leave them NULL.

Adding an axis: one `Axis(...)` line here, its column in a migration (configurations + results view),
and its test.
"""

from __future__ import annotations

from dataclasses import dataclass

from workers.core.registry import registry_names


@dataclass(frozen=True)
class Axis:
    name: str
    kind: type  # str: a registry's names or the choices; int: positive integers
    registry: tuple[str, str] | None  # (module, dict) whose names are the allowed values
    help: str
    default: tuple | None = None  # the grid's value when a sub-grid leaves the axis out (None: required)
    outputs: tuple[str, ...] | None = None  # the outputs it applies to (None: every output)
    choices: tuple[str, ...] = ()  # allowed values of a str axis without a registry
    named: bool = False  # written `name=value` in configuration keys (else the bare value)
    after_student: bool = False  # changes the student after its conversion (a different final model)

    def allowed(self) -> list[str]:
        return registry_names(*self.registry) if self.registry else list(self.choices)

    def applies(self, output: str) -> bool:
        return self.outputs is None or output in self.outputs


MOE_OUTPUTS = ("moe", "merged", "edited")  # the outputs that keep a router (a smaller MoE)

AXES: dict[str, Axis] = {
    a.name: a
    for a in (
        Axis(
            "output",
            str,
            ("workers.models.outputs", "OUTPUTS"),
            "a dense student, or a smaller MoE: pruned (moe), merged or edited",
            ("dense",),
        ),
        Axis(
            "scoring",
            str,
            ("workers.methods.scoring", "SCORINGS"),
            "how experts are scored and the K kept are chosen",
            outputs=("dense", "moe"),
        ),
        Axis(
            "merging",
            str,
            ("workers.methods.moe_merging", "MERGINGS"),
            "how the E experts are merged into K",
            outputs=("merged",),
        ),
        Axis(
            "editing",
            str,
            ("workers.methods.editing", "EDITINGS"),
            "how every expert is factorised to the size of K",
            outputs=("edited",),
        ),
        Axis(
            "grouping",
            str,
            ("workers.methods.grouping", "GROUPINGS"),
            "how the K kept experts form k groups",
            ("RR",),
            outputs=("dense",),
        ),
        Axis(
            "dp_scaling",
            str,
            ("workers.methods.scaling", "SCALINGS"),
            "the down-projection scale α of each group",
            ("uniform",),
            outputs=("dense",),
        ),
        Axis(
            "K",
            int,
            None,
            "experts kept per layer (k ≤ K ≤ E); for editing, the parameter budget of K experts",
            named=True,
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
        ),
    )
}


def method_registries() -> list[tuple[str, str]]:
    """The registries whose entries are code components of their own (never followed from a stage)."""
    return [a.registry for a in AXES.values() if a.registry]


def config_key(values: dict) -> str:
    """`SF|RR|uniform|K=8` (a dense configuration), `moe|REAP|K=16|recovery=router_kd` (a pruned MoE),
    `merged|HC-SMoE|K=6|recovery=none`, `edited|MoBE|K=6|recovery=none`."""
    parts = []
    for name, axis in AXES.items():
        v = values.get(name)
        if v is None or (name == "output" and v == "dense"):
            continue
        parts.append(f"{name}={v}" if axis.named else str(v))
    return "|".join(parts)
