"""The axes of a sweep's grid, as the orchestrator uses them.

The axes themselves are declared once, in db/axes.py (plain data every reader derives from): a typed column
of `configurations` and of the `results` view each. Here each gets its allowed values: the names of a
method registry (read from the registry's source, so validating a sweep imports no torch), a fixed set of
choices, or any positive integer. A configuration's jobs hash the code of the registry entries they name
(orchestrator/codever.py), so editing one method recomputes exactly the configurations that use it. Some
axes apply to some outputs only (scoring chooses the experts of a dense student or a pruned MoE; merging
and editing make a merged or an edited MoE; grouping and dp_scaling shape a dense student; recovery applies
to the three smaller MoEs): a sub-grid of another output may not name them, and its configurations leave
them NULL.

Adding an axis: see db/axes.py.
"""

from __future__ import annotations

from dataclasses import fields

import db.axes
from workers.core.registry import registry_names


class Axis(db.axes.Axis):
    """An axis of db/axes.py with the values a sweep file may give it."""

    def allowed(self) -> list[str]:
        return registry_names(*self.registry) if self.registry else list(self.choices)


def grid_axes() -> dict[str, Axis]:
    """db/axes.py's table, in its order, each axis able to say its allowed values."""
    return {name: Axis(**{f.name: getattr(a, f.name) for f in fields(a)}) for name, a in db.axes.AXES.items()}


AXES: dict[str, Axis] = grid_axes()


def method_registries() -> list[tuple[str, str]]:
    """The registries whose entries are code components of their own (never followed from a stage)."""
    return db.axes.method_registries()


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
