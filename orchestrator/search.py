"""`distill.search`: a search over distillation settings, its trials run as our own distill jobs.

The space names DistillSpec fields and a distribution each (`{lr: {loguniform: [1e-5, 1e-3]}, tau: {choice:
[1, 2, 4]}, loss: {grid: [forward_kl, reverse_kl]}}`). Ray Tune's search algorithms suggest the points through
their `suggest` / `on_trial_complete` interface: `grid` and `random` through Tune's variant generation (what
its BasicVariantGenerator runs), `optuna` through OptunaSearch where optuna is installed; every algorithm is
seeded, so one sweep file suggests the same trials, and a trial's distill job has the same key, at every launch.
Tune never runs a trainable here: a trial is a configuration `<base>|search=<n>` whose distill job the
orchestrator plans, caches and stores like any other.

`scheduler: asha` is successive halving in synchronous rungs (Li et al., "A System for Massively Parallel
Hyperparameter Tuning", §3, ASHA with its promotions made rung by rung): rung r trains every surviving trial
for grace_steps·η^r steps (the last rung max_steps), a job per trial per rung, and the best ⌊n/η⌋ (at least
one) by the metric go on. A longer rung is a new run, not a resume: the cosine schedule depends on the total
steps. Nothing here imports torch or Ray at module level: a dry run validates and counts from the source.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
from collections.abc import Callable
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from db.axes import config_fields
from orchestrator.schema import PosInt, Strict, shown, typed_setting, worker_settings

SUFFIX = "search"  # a trial's configuration key is `<base key>|search=<n>`
METRICS = ("val_ce", "train_loss")  # what a distill job records per student (workers/run/distill.py)
RANDOM = ("uniform", "loguniform", "randint", "lograndint", "choice")  # sampled distributions
DISTRIBUTIONS = ("grid", *RANDOM)


def distill_spec() -> type:
    from workers.training.distill_spec import DistillSpec

    return DistillSpec


def _fields() -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(distill_spec())}


def _check_value(name: str, value: Any, settings: dict[str, Any]) -> Any:
    """`value` of DistillSpec's field `name` typed as the schema types it and accepted by DistillSpec with
    the other settings as the sweep gives them; one ValueError line otherwise."""
    spec = distill_spec()
    try:
        value = typed_setting(spec, name, value)
    except ValueError as e:
        raise ValueError(f"space.{name}: {shown(value)} {e}") from None
    try:
        worker_settings(spec, {**settings, name: value})
    except ValueError as e:
        raise ValueError(f"space.{name}: {e}") from None
    return value


def parse_space(space: dict[str, Any], settings: dict[str, Any]) -> dict[str, tuple[str, list[Any]]]:
    """{field: (distribution, arguments)} of a search space, each checked: a DistillSpec field, one
    distribution of DISTRIBUTIONS with its arguments, every value (or bound) one DistillSpec accepts with the
    sweep's other settings. One ValueError line naming the field otherwise."""
    fields = _fields()
    if not space:
        raise ValueError(
            "space: empty; name at least one DistillSpec field, e.g. {lr: {loguniform: [1e-5, 1e-3]}}"
        )
    out: dict[str, tuple[str, list[Any]]] = {}
    for name, dist in space.items():
        if name not in fields:
            raise ValueError(
                f"space.{name}: not a distillation setting; allowed: {', '.join(sorted(fields))}"
            )
        if not isinstance(dist, dict) or len(dist) != 1:
            raise ValueError(
                f"space.{name}: one distribution as {{name: arguments}}, got {shown(dist)}; "
                f"allowed: {', '.join(DISTRIBUTIONS)}"
            )
        ((kind, args),) = dist.items()
        if kind not in DISTRIBUTIONS:
            raise ValueError(
                f"space.{name}: unknown distribution {shown(kind)}; allowed: {', '.join(DISTRIBUTIONS)}"
            )
        if not isinstance(args, list) or not args:
            raise ValueError(f"space.{name}.{kind}: a non-empty list, got {shown(args)}")
        if kind in ("grid", "choice"):
            values = [_check_value(name, v, settings) for v in args]
            if len({json.dumps(v, sort_keys=True) for v in values}) != len(values):
                raise ValueError(f"space.{name}.{kind}: a value is listed twice in {shown(args)}")
            out[name] = (kind, values)
            continue
        if len(args) != 2 or not all(isinstance(a, int | float) and not isinstance(a, bool) for a in args):
            raise ValueError(f"space.{name}.{kind}: two numbers [low, high], got {shown(args)}")
        low, high = args
        integer = kind in ("randint", "lograndint")
        if integer != (fields[name].type in ("int", int)):
            what = "integers" if integer else "floats"
            raise ValueError(
                f"space.{name}.{kind}: draws {what}, and {name} is {fields[name].type}; "
                f"use {'uniform or loguniform' if not integer else 'randint or lograndint'}, choice or grid"
            )
        if integer and not all(isinstance(a, int) for a in args):
            raise ValueError(f"space.{name}.{kind}: two integers [low, high), got {shown(args)}")
        if not low < high:
            raise ValueError(f"space.{name}.{kind}: low < high, got {shown(args)}")
        if kind.startswith("log") and not low > 0:
            raise ValueError(f"space.{name}.{kind}: low > 0 (a log scale), got {shown(args)}")
        top = high - 1 if integer else high  # randint's high is exclusive
        bounds = [_check_value(name, low, settings), _check_value(name, top, settings)]
        out[name] = (kind, [bounds[0], high if integer else bounds[1]])
    return out


def grid_size(parsed: dict[str, tuple[str, list[Any]]]) -> int:
    return math.prod(len(args) for kind, args in parsed.values() if kind == "grid")


def rung_steps(grace: int, eta: int, max_steps: int) -> list[int]:
    """The steps of each rung: grace·η^r while below max_steps, then max_steps."""
    steps, s = [], grace
    while s < max_steps:
        steps.append(s)
        s *= eta
    return [*steps, max_steps]


def promote(values: dict[int, float | None], eta: int, mode: str) -> list[int]:
    """The trials that go on to the next rung: the best ⌊n/η⌋ (at least one) of the n that ran by their
    metric (`mode` min or max), ties to the earlier trial; a trial without a finite value (its job failed)
    never goes on. In trial order."""
    ok = {t: v for t, v in values.items() if v is not None and math.isfinite(v)}
    if not ok:
        return []
    keep = max(1, len(values) // eta)
    sign = 1.0 if mode == "min" else -1.0
    ranked = sorted(ok, key=lambda t: (sign * ok[t], t))
    return sorted(ranked[:keep])


def final_value(rows: list[dict[str, Any]]) -> float | None:
    """A job's metric: its student's row at the last step (rows of one metric name and one job)."""
    mine = [r for r in rows if r.get("who") == "student"] or rows
    if not mine:
        return None
    value = max(mine, key=lambda r: -1 if r.get("step") is None else r["step"])["value"]
    return None if value is None else float(value)


class Search(Strict):
    """`distill.search`: which settings are searched, how, on which selected configurations."""

    space: dict[str, Any]
    num_samples: PosInt = 1  # points drawn (each grid point that many times, as Tune's num_samples)
    algorithm: Literal["grid", "random", "optuna"] = "random"
    metric: Literal["val_ce", "train_loss"] = "val_ce"
    mode: Literal["min", "max"] = "min"
    seed: int = 0
    scheduler: Literal["asha"] | None = None
    grace_steps: PosInt | None = None  # asha: the steps of the first rung
    reduction_factor: int = 3  # asha: η, each rung keeps the best 1/η
    max_steps: PosInt | None = None  # asha: the steps of the last rung (default: distill.settings.steps)
    # configuration field -> value (or list of values): which selected configurations are searched (all: {})
    on: dict[str, Any] = Field(default_factory=dict)
    # which trials the evaluate stage evaluates: all of them, or the finalists (those that ran the last rung)
    evaluate: Literal["all", "finalists"] = "all"

    @field_validator("reduction_factor")
    @classmethod
    def _eta(cls, v: int) -> int:
        if v < 2:
            raise ValueError(f"an integer >= 2 (each rung keeps the best 1/reduction_factor), got {v}")
        return v

    @field_validator("on")
    @classmethod
    def _on(cls, v: dict[str, Any]) -> dict[str, Any]:
        allowed = config_fields()
        for name, value in v.items():
            if name not in allowed:
                raise ValueError(f"{name!r} is not a configuration field; allowed: {', '.join(allowed)}")
            values = value if isinstance(value, list) else [value]
            if not values or any(not isinstance(x, str | int) or isinstance(x, bool) for x in values):
                raise ValueError(f"{name}: a value or a non-empty list of values, got {shown(value)}")
        return v

    @model_validator(mode="after")
    def _scheduler(self) -> Search:
        asha = ("grace_steps", "max_steps")
        if self.scheduler is None:
            given = [k for k in asha if getattr(self, k) is not None]
            if given or self.reduction_factor != 3:
                raise ValueError(
                    f"{(given or ['reduction_factor'])[0]}: only with scheduler: asha (early stopping)"
                )
        elif self.grace_steps is None:
            raise ValueError("scheduler asha: needs grace_steps (the steps of the first rung)")
        if self.algorithm == "optuna" and importlib.util.find_spec("optuna") is None:
            raise ValueError(
                "algorithm optuna: needs the package optuna (pip install optuna); allowed here: grid, random"
            )
        return self

    def checked(self, settings: dict[str, Any]) -> Search:
        """The section read against `distill.settings`: the space parsed (values DistillSpec accepts with the
        other settings), the algorithm's kind of space, and the rungs."""
        parsed = parse_space(self.space, settings)
        if self.algorithm == "grid" and any(kind != "grid" for kind, _ in parsed.values()):
            bad = next(n for n, (kind, _) in parsed.items() if kind != "grid")
            raise ValueError(
                f"algorithm grid: space.{bad} is {parsed[bad][0]}; grid takes {{grid: [...]}} only (or algorithm: random)"
            )
        if self.algorithm == "optuna" and any(kind == "grid" for kind, _ in parsed.values()):
            bad = next(n for n, (kind, _) in parsed.items() if kind == "grid")
            raise ValueError(f"algorithm optuna: space.{bad} is a grid; optuna samples: use choice")
        if self.scheduler == "asha":
            if "steps" in parsed:
                raise ValueError(
                    "space.steps: scheduler asha sets each rung's steps (grace_steps … max_steps)"
                )
            top = self.top_steps(settings)
            if self.grace_steps > top:
                raise ValueError(f"grace_steps: {self.grace_steps} is above max_steps {top}")
        return self

    def top_steps(self, settings: dict[str, Any]) -> int:
        return self.max_steps or settings["steps"]

    def rungs(self, settings: dict[str, Any]) -> list[int | None]:
        """The steps of each rung (one rung of None without a scheduler: each trial's own steps)."""
        if self.scheduler is None:
            return [None]
        return rung_steps(self.grace_steps, self.reduction_factor, self.top_steps(settings))

    def trials(self, settings: dict[str, Any]) -> int:
        """How many trials each searched configuration gets."""
        parsed = parse_space(self.space, settings)
        return self.num_samples * grid_size(parsed)

    def finalists(self, settings: dict[str, Any]) -> int:
        """Trials per searched configuration that run the last rung, at most (all of them without a scheduler)."""
        n = self.trials(settings)
        for _ in self.rungs(settings)[1:]:
            n = max(1, n // self.reduction_factor)
        return n

    def evaluated(self, settings: dict[str, Any]) -> int:
        """Trials per searched configuration the evaluate stage evaluates, at most."""
        return self.trials(settings) if self.evaluate == "all" else self.finalists(settings)

    def jobs_bound(self, settings: dict[str, Any]) -> int:
        """Distill jobs per searched configuration at most (every rung's survivors)."""
        n, total = self.trials(settings), 0
        for _ in self.rungs(settings):
            total += n
            n = max(1, n // self.reduction_factor)
        return total


# ---- suggestions: Ray Tune's searchers -------------------------------------------------------------------
def tune_space(parsed: dict[str, tuple[str, list[Any]]]) -> dict[str, Any]:
    """The space as Ray Tune's domains."""
    from ray import tune

    make: dict[str, Callable[[list[Any]], Any]] = {
        "grid": tune.grid_search,
        "choice": tune.choice,
        "uniform": lambda a: tune.uniform(*a),
        "loguniform": lambda a: tune.loguniform(*a),
        "randint": lambda a: tune.randint(*a),
        "lograndint": lambda a: tune.lograndint(*a),
    }
    return {name: make[kind](args) for name, (kind, args) in parsed.items()}


def searcher(search: Search, parsed: dict[str, tuple[str, list[Any]]]):
    """A seeded Ray Tune `Searcher` of the space: grid and random by Tune's variant generation (the points
    BasicVariantGenerator makes, num_samples passes over the grid), optuna by OptunaSearch."""
    from ray.tune.search import Searcher

    space = tune_space(parsed)
    if search.algorithm == "optuna":
        from ray.tune.search.optuna import OptunaSearch

        return OptunaSearch(space=space, metric=search.metric, mode=search.mode, seed=search.seed)

    class Variants(Searcher):
        """Tune's variant generation behind the Searcher interface (it learns nothing from results)."""

        def __init__(self) -> None:
            import numpy as np
            from ray.tune.search.variant_generator import generate_variants

            super().__init__(metric=search.metric, mode=search.mode)
            rng = np.random.default_rng(search.seed)
            self.points = [
                spec["config"]
                for _ in range(search.num_samples)
                for _, spec in generate_variants({"config": space}, random_state=rng)
            ]

        def suggest(self, trial_id: str) -> dict[str, Any] | str:
            return self.points.pop(0) if self.points else Searcher.FINISHED

        def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
            pass

    return Variants()


def typed(point: dict[str, Any]) -> dict[str, Any]:
    """A suggested point as job settings: plain Python values of each field's type (a float field's
    integer a float, numpy scalars as Python's)."""
    spec = distill_spec()
    out = {}
    for name, value in point.items():
        value = value.item() if hasattr(value, "item") else value
        out[name] = typed_setting(spec, name, value)
    return out


def suggest(
    search: Search, settings: dict[str, Any], n: int | None = None
) -> tuple[Any, list[dict[str, Any]]]:
    """(the searcher, the first `n` points it suggests: every trial of a configuration by default)."""
    parsed = parse_space(search.space, settings)
    s = searcher(search, parsed)
    n = search.trials(settings) if n is None else n
    points = []
    for i in range(n):
        p = s.suggest(str(i))
        if p is None or p == "FINISHED":
            break
        points.append(typed(p))
    return s, points


# ---- planning: rungs of trials, run by the orchestrator ---------------------------------------------------
def label(point: dict[str, Any]) -> str:
    """`loss=reverse_kl,lr=0.000123,tau=2.0`: a trial's settings, short."""

    def fmt(v: Any) -> str:
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    return ",".join(f"{k}={fmt(point[k])}" for k in sorted(point))


def matches(cfg: dict[str, Any], on: dict[str, Any]) -> bool:
    return all(cfg.get(a) in (v if isinstance(v, list) else [v]) for a, v in on.items())


def trial_config(base: dict[str, Any], n: int, point: dict[str, Any], row: dict[str, Any]) -> dict[str, Any]:
    return {
        **base,
        "config_key": f"{base['config_key']}|{SUFFIX}={n}",
        "selected_for_distill": 1,
        "variant": f"{SUFFIX}={n}:{label(point)}",
        "variant_of": base["config_key"],
        "distill_loss": point.get("loss"),
        "teacher_top_k": point.get("teacher_top_k"),
        **row,
    }


def plan_trials(
    ctx: Any, bases: dict[str, Any], make_job: Callable[[Any, dict[str, Any]], Any]
) -> dict[str, Any]:
    """Every trial of the search on `bases` ({config key: its ppl_pre job}): the rungs run now, one round per
    rung (ctx.run_now), each round's metrics read back (ctx.job_metrics) and fed to each configuration's
    searcher; returns {trial config key: the distill job of its last rung}. `make_job(ppl job, overrides)`
    is a distill job with the distillation settings overridden."""
    d = ctx.spec.distill
    search, settings = d.search, d.settings
    run_now, job_metrics = getattr(ctx, "run_now", None), getattr(ctx, "job_metrics", None)
    if run_now is None or job_metrics is None:
        raise RuntimeError(
            "distill.search: this launch cannot run a stage's jobs in rounds (run_now, job_metrics)"
        )
    rungs = search.rungs(settings)
    state: dict[str, dict[str, Any]] = {}  # trial config key -> its base, trial number, point, history
    live: dict[str, list[str]] = {}  # base -> its trials still running
    searchers: dict[str, Any] = {}
    for ck in bases:
        searchers[ck], points = suggest(search, settings)
        keys = []
        for n, point in enumerate(points):
            tk = f"{ck}|{SUFFIX}={n}"
            state[tk] = {"base": ck, "n": n, "point": point, "history": []}
            keys.append(tk)
        live[ck] = keys
    ctx.add_configs(
        [
            trial_config(ctx.config(s["base"]), s["n"], s["point"], _row(search, s, rungs))
            for s in state.values()
        ]
    )
    last: dict[str, Any] = {}
    for r, steps in enumerate(rungs):
        jobs = {}
        for tk in (t for keys in live.values() for t in keys):
            s = state[tk]
            over = dict(s["point"]) if steps is None else {**s["point"], "steps": steps}
            jobs[tk] = last[tk] = make_job(bases[s["base"]], over)
        done = run_now("distill", jobs)
        rows: dict[str, list[dict[str, Any]]] = {}
        for row in job_metrics([j.key for j in jobs.values() if j.key in done], search.metric):
            rows.setdefault(row["key"], []).append(row)
        final = r == len(rungs) - 1
        for ck, keys in live.items():
            values = {}
            for tk in keys:
                j = jobs[tk]
                value = final_value(rows.get(j.key, [])) if j.key in done else None
                values[state[tk]["n"]] = value
                state[tk]["history"].append(
                    {"rung": r, "steps": j.params["settings"]["steps"], search.metric: value, "job": j.key}
                )
            kept = [] if final else promote(values, search.reduction_factor, search.mode)
            for tk in keys:
                s = state[tk]
                value = values[s["n"]]
                steps_run = state[tk]["history"][-1]["steps"]
                result = (
                    None
                    if value is None
                    else {search.metric: value, "rung": r, "training_iteration": steps_run}
                )
                if s["n"] in kept:
                    if result is not None:
                        searchers[ck].on_trial_result(str(s["n"]), result)
                else:
                    searchers[ck].on_trial_complete(str(s["n"]), result, error=value is None)
            live[ck] = [tk for tk in keys if state[tk]["n"] in kept]
        if not any(live.values()):
            break
    ctx.set_fields({tk: _row(search, s, rungs) for tk, s in state.items()})
    return last


def _row(search: Search, s: dict[str, Any], rungs: list[int | None]) -> dict[str, Any]:
    """A trial's configuration fields: `settings` (JSON: {"search": its point, rung, every rung's steps,
    metric and job}) and a `note` saying where it stopped."""
    hist = s["history"]
    if not hist:
        where = "planned"
    else:
        h = hist[-1]
        value = h[search.metric]
        shown_value = "failed" if value is None else f"{search.metric}={value:.4g}"
        if len(rungs) == 1:
            where = f"{shown_value}"
        elif h["rung"] == len(rungs) - 1:
            where = f"rung {h['rung']} of 0..{len(rungs) - 1} ({h['steps']} steps, the last): {shown_value}"
        else:
            where = f"stopped at rung {h['rung']} of 0..{len(rungs) - 1} ({h['steps']} steps): {shown_value}"
    info = {
        "search": {
            "trial": s["n"],
            "algorithm": search.algorithm,
            "seed": search.seed,
            "scheduler": search.scheduler,
            "settings": s["point"],
            "rung": hist[-1]["rung"] if hist else None,
            "rungs": hist,
        }
    }
    note = f"search trial {s['n']} of {s['base']} ({label(s['point'])}): {where}"
    return {"settings": json.dumps(info, sort_keys=True), "note": note}


def stopped_trials(search: Search, settings: dict[str, Any], jobs: dict[str, Any]) -> set[str]:
    """The trial configurations among `jobs` ({config key: its distill job}) that stopped before the last rung:
    their job trained fewer steps than the last rung's (none without a scheduler)."""
    if search.scheduler is None:
        return set()
    top = search.top_steps(settings)
    return {ck for ck, j in jobs.items() if f"|{SUFFIX}=" in ck and j.params["settings"]["steps"] < top}


def searched_bases(ctx: Any, selected: list[str], ppl: dict[str, Any]) -> dict[str, Any]:
    """The selected configurations the search runs on ({config key: its ppl_pre job})."""
    on = ctx.spec.distill.search.on
    return {ck: ppl[ck] for ck in selected if ck in ppl and matches(ctx.config(ck), on)}


def estimate_note(search: Search, settings: dict[str, Any], selected: int) -> tuple[int, int, str]:
    """(trial configurations, distill jobs, a note) the search plans at most on `selected` configurations;
    the note says how many the evaluate stage evaluates where that is only the finalists."""
    trials = search.trials(settings)
    rungs = search.rungs(settings)
    jobs = search.jobs_bound(settings)
    where = " of those matching its on:" if search.on else ""
    how = f"{search.algorithm} search: {trials} trials each{where}"
    if search.scheduler:
        how += (
            f", asha in {len(rungs)} rungs of {'/'.join(map(str, rungs))} steps (η={search.reduction_factor})"
        )
    if search.evaluate == "finalists":
        how += f"; the up to {selected * search.finalists(settings)} finalists evaluated"
    return (
        selected * trials,
        selected * jobs,
        f"up to {selected * trials} search trials in up to {selected * jobs} jobs ({how})",
    )
