"""The axes of a sweep's grid, declared once.

An axis is a typed column of `configurations` and of the `results` view; its allowed values are the
names of a method registry (read from the registry's source, so validating a sweep imports no torch)
or any positive integer. A configuration's jobs hash the code of the registry entries they name
(orchestrator/codever.py), so editing one method recomputes exactly the configurations that use it.
Adding an axis: one `Axis(...)` line here, its column in a migration (configurations + results view),
and its test.
"""

from __future__ import annotations

from dataclasses import dataclass

from workers.registry import registry_names


@dataclass(frozen=True)
class Axis:
    name: str
    kind: type  # str: a registry's names; int: positive integers
    registry: tuple[str, str] | None  # (module, dict) whose names are the allowed values
    help: str
    default: tuple | None = None  # the grid's value when a sweep file leaves the axis out (None: required)

    def allowed(self) -> list[str]:
        return registry_names(*self.registry) if self.registry else []


AXES: dict[str, Axis] = {a.name: a for a in (
    Axis("scoring", str, ("workers.scoring", "SCORINGS"), "how experts are scored and the K kept are chosen"),
    Axis("grouping", str, ("workers.grouping", "GROUPINGS"), "how the K kept experts form k groups", ("RR",)),
    Axis("dp_scaling", str, ("workers.scaling", "SCALINGS"), "the down-projection scale α of each group",
         ("uniform",)),
    Axis("K", int, None, "experts kept per layer (k ≤ K ≤ E)"),
)}


def method_registries() -> list[tuple[str, str]]:
    """The registries whose entries are code components of their own (never followed from a stage)."""
    return [a.registry for a in AXES.values() if a.registry]
