"""Partial launches: `--until STAGE` and `--only CONFIG_KEY`.

`--until STAGE` runs every job of the stages up to and including STAGE in the stage order (`moesweep
stages`); when that includes the stage the selection rule reads (ppl_pre), the selection is made and
stored, so the configurations a full launch would distil are known before paying for distillation.

`--only KEY` (repeatable) runs the jobs of those configurations, of the configurations derived from them
(their distillation variants, seed repeats, DCDM mixture, the DOT-MoE students of their distilled
student), and every job these read (the teacher, the calibration, ...). A dense student's distillation
depends on the selection rule, which compares it with the rest of its group (the configurations with its
values of `select.per`): their pre-distillation perplexities run too (only up to the stage the rule
reads), so a configuration is distilled exactly when a full launch would distil it.

Every job keeps its content key, so a later full launch reuses whatever a partial one finished.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from orchestrator.schema import OptionError, shown
from orchestrator.stage import JobSpec, Stage, get_stage, stages


def competes(c: dict[str, Any]) -> bool:
    """Whether a configuration (or a row of `results`) competes in the selection rule: a dense student of
    the grid, not a variant of another configuration."""
    return c.get("variant_of") is None and c.get("kind") == "moe2dense" and c.get("output") in (None, "dense")


def is_d2d(c: dict[str, Any]) -> bool:
    """A dense-to-dense baseline candidate: the best of them (by the same metric) is distilled."""
    return c.get("kind") == "baseline" and (c.get("baseline") or "").startswith("d2d:")


def base_of(c: dict[str, Any]) -> str | None:
    """The configuration a derived configuration comes from (a variant, a seed repeat, a DCDM mixture, a
    DOT-MoE student of a distilled student), else None."""
    if c.get("variant_of"):
        return c["variant_of"]
    if c.get("kind") == "dense2moe" and c.get("settings"):
        try:
            return json.loads(c["settings"]).get("source_config")
        except (TypeError, ValueError):
            return None
    return None


@dataclass
class Scope:
    """What a launch runs: everything (the default), the stages up to `until`, the jobs `only` needs."""

    until: str | None = None
    only: tuple[str, ...] = ()
    group: set[str] = field(default_factory=set)  # configurations the selection of `only` compares
    group_stages: set[str] = field(default_factory=set)  # … and the stages they run in
    best_by: str = "ppl_pre"  # the stage whose results the selection rule reads

    @property
    def partial(self) -> bool:
        return self.until is not None or bool(self.only)

    def check_until(self) -> None:
        """--until names a stage: one-line OptionError otherwise."""
        names = [s.name for s in stages()]
        if self.until is not None and self.until not in names:
            raise OptionError(f"--until {shown(self.until)}: unknown stage; allowed: {', '.join(names)}")

    def stages(self) -> tuple[Stage, ...]:
        """The stages this launch runs, in order."""
        every = stages()
        if self.until is None:
            return every
        names = [s.name for s in every]
        return every[: names.index(self.until) + 1]

    def prepare(self, spec, configs: list[dict[str, Any]]) -> None:
        """Check --until and --only against the sweep (one-line OptionError naming the option and a few
        allowed values) and find the configurations the selection of the --only ones compares."""
        self.check_until()
        if not self.only:
            return
        by_key = {c["config_key"]: c for c in configs}
        for key in self.only:
            if key not in by_key:
                raise OptionError(_unknown(key, spec.name, list(by_key)))
        selects = spec.distill is not None or bool(getattr(spec, "seeds", None))
        best_by = self.best_by = spec.select.best_by if spec.select is not None else "ppl_pre"
        self.group = set()
        for key in self.only:
            c = by_key[key]
            if selects and competes(c) and spec.select is not None:
                per = spec.select.per
                self.group |= {
                    o["config_key"] for o in configs if competes(o) and all(o.get(a) == c.get(a) for a in per)
                }
            elif selects and is_d2d(c):
                self.group |= {o["config_key"] for o in configs if is_d2d(o)}
        self.group -= set(self.only)
        # the rule reads its stage's results; that stage plans a configuration's job from the outputs of
        # its direct upstream stages (the jobs those read in turn follow from job dependencies)
        self.group_stages = {best_by, *get_stage(best_by).upstream} if self.group else set()

    def family(self, configs: list[dict[str, Any]]) -> set[str]:
        """The --only configurations and every configuration derived from them (at any remove)."""
        out = set(self.only)
        derived = [(c["config_key"], base_of(c)) for c in configs]
        grew = True
        while grew:
            grew = False
            for key, base in derived:
                if base in out and key not in out:
                    out.add(key)
                    grew = True
        return out

    def considered(self, stage: str, configs: list[dict[str, Any]]) -> set[str] | None:
        """The configuration keys whose jobs of `stage` this launch runs (None: every one)."""
        if not self.only:
            return None
        return self.family(configs) | (self.group if stage in self.group_stages else set())

    def keep(self, stage: str, jobs: dict[str, JobSpec], configs: list[dict[str, Any]]) -> dict[str, JobSpec]:
        """The jobs of a stage's plan this launch runs (before the jobs they read that did not run yet)."""
        keys = self.considered(stage, configs)
        return dict(jobs) if keys is None else {k: j for k, j in jobs.items() if k in keys}

    def describe(self) -> str:
        """The options as typed, for a line on the console."""
        parts = [f"--until {self.until}"] if self.until else []
        parts += [f"--only {k}" for k in self.only]
        return " ".join(parts)


def _unknown(key: str, sweep: str, keys: list[str]) -> str:
    """The line for an --only key the sweep does not define: a derived configuration's base, or a few keys."""
    base = next(
        (
            k
            for k in sorted(keys, key=len, reverse=True)
            if key.startswith(k + "|") or f"distilled:{k}|" in key
        ),
        None,
    )
    if base is not None:
        return (
            f"--only {shown(key)}: a configuration derived from {base!r}, planned once that one ran; "
            f"--only {base!r} runs it with its base"
        )
    few = ", ".join(keys[:4] + [k for k in keys[4:] if "|" not in k][:4])
    return (
        f"--only {shown(key)}: sweep {sweep} has no such configuration; e.g. {few} ({len(keys)} in all; "
        "a grid configuration's key lists its axis values, e.g. SF|RR|uniform|K=8)"
    )
