"""The axes of a sweep's grid, declared once.

An axis is a typed column of `configurations` and of the `results` view; its allowed values are the
names of a method registry (read from the registry's source, so validating a sweep imports no torch),
a fixed set of choices, or any positive integer. A configuration's jobs hash the code of the registry
entries they name (orchestrator/codever.py), so editing one method recomputes exactly the
configurations that use it. Some axes apply to one output only (grouping and dp_scaling shape a dense
student; recovery applies to a smaller MoE): a sub-grid of the other output may not name them, and its
configurations leave them NULL.

Adding an axis: one `Axis(...)` line here, its column in a migration (configurations + results view),
and its test.
"""

from __future__ import annotations

from dataclasses import dataclass

from workers.registry import registry_names


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


AXES: dict[str, Axis] = {a.name: a for a in (
    Axis("output", str, ("workers.outputs", "OUTPUTS"), "a dense student, or a smaller MoE with K experts", ("dense",)),
    Axis("scoring", str, ("workers.scoring", "SCORINGS"), "how experts are scored and the K kept are chosen"),
    Axis("grouping", str, ("workers.grouping", "GROUPINGS"), "how the K kept experts form k groups", ("RR",),
         outputs=("dense",)),
    Axis("dp_scaling", str, ("workers.scaling", "SCALINGS"), "the down-projection scale α of each group",
         ("uniform",), outputs=("dense",)),
    Axis("K", int, None, "experts kept per layer (k ≤ K ≤ E)", named=True),
    Axis("recovery", str, None, "what recovers a smaller MoE before evaluation", ("none",), outputs=("moe",),
         choices=("none", "router_kd"), named=True, after_student=True),
)}


def method_registries() -> list[tuple[str, str]]:
    """The registries whose entries are code components of their own (never followed from a stage)."""
    return [a.registry for a in AXES.values() if a.registry]


def config_key(values: dict) -> str:
    """`SF|RR|uniform|K=8` (a dense configuration), `moe|REAP|K=16|recovery=router_kd` (a smaller MoE)."""
    parts = []
    for name, axis in AXES.items():
        v = values.get(name)
        if v is None or (name == "output" and v == "dense"):
            continue
        parts.append(f"{name}={v}" if axis.named else str(v))
    return "|".join(parts)
