"""Uncertainty of the numbers and differences a report states.

Own sweeps keep per-item scores (the `config_items` view): every comparison is a paired bootstrap
over the items all compared students were evaluated on (lm-eval's doc_id within each leaf task; a
perplexity's windows). One set of resamples per model is drawn (seeded, per task) and shared by every
comparison, so the same DB gives the same intervals and a student's replicates are comparable
across comparisons. A student's accuracy is the mean over tasks of its headline metric on the items
common to all students (equal to `results.avg_acc` when they were all evaluated on the same items).

A paper's numbers come without per-item outputs: each student's average gets the binomial standard
error from its tasks' published sizes (analysis/data/benchmark_sizes.csv), and a difference of group
means the conservative bound √(se_A² + se_B²) with a group's se the mean of its students' (students
scored on the same items err together, so neither averaging nor pairing is assumed to shrink it).

A difference whose 95% interval contains zero is "not distinguishable at this n".

Seed repeats (`seeds: [..]`, configurations with variant `seed=<s>` of a selected student) add a second
test: the difference is recomputed under each seed (the main configuration is the first seed) and its
between-seed 95% interval, mean ± t(S−1)·sd/√S over the S per-seed differences, must exclude zero too.
A comparison is distinguishable only if it survives both (SEED_RULE); one whose students were not all
repeated (a baseline, a runner-up) is judged by the item-level interval alone.
"""

from __future__ import annotations

import csv
import re
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

B = 1000  # bootstrap resamples
SEED = 15  # the report's bootstrap seed (same DB → same intervals)
LEVEL = 0.95
Z = 1.959963984540054  # two-sided 95% normal quantile
SIZES = Path(__file__).parent / "data" / "benchmark_sizes.csv"
NOT_DISTINGUISHABLE = "not distinguishable at this n"
NOT_ACROSS_SEEDS = "not distinguishable across seeds"
SEED_LABEL = re.compile(r"^seed=(\d+)$")  # the variant label of a seed repeat (orchestrator/stages/seeds.py)
MAIN = "main"  # the main configuration: the first listed seed
SEED_RULE = (
    "distinguishable only if both 95% intervals exclude 0: the item-level one (paired bootstrap, first "
    "seed) and the between-seed one (the difference under each seed: mean ± t(S-1)·sd/sqrt(S))"
)


@dataclass(frozen=True)
class Replicates:
    """Per configuration: its statistic on the common items (`point`) and under B shared resamples."""

    point: dict[int, float]
    reps: dict[int, np.ndarray]
    n: int  # items (all tasks together) or windows resampled
    method: str


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def resample_weights(n: int, b: int, rng: np.random.Generator) -> np.ndarray:
    """(b, n) counts: how often each of n items is drawn in each of b resamples with replacement."""
    return rng.multinomial(n, np.full(n, 1.0 / n), size=b).astype(np.float64)


def _aligned(cols: dict[int, tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray] | None:
    """(keys common to every configuration, values matrix [items, configs] in `cols` order)."""
    common = None
    for keys, _ in cols.values():
        common = keys if common is None else np.intersect1d(common, keys)
    if common is None or len(common) == 0:
        return None
    mat = []
    for keys, vals in cols.values():
        order = np.argsort(keys, kind="stable")
        pos = order[np.searchsorted(keys, common, sorter=order)]
        mat.append(vals[pos])
    return common, np.stack(mat, axis=1)


def _item_keys(subtask: str, ids: np.ndarray, subtasks: list[str]) -> np.ndarray:
    """One integer key per (leaf task, doc_id): leaf index in the high bits."""
    return np.int64(subtasks.index(subtask)) * (1 << 40) + ids.astype(np.int64)


def acc_replicates(
    items: pd.DataFrame, tasks: pd.DataFrame, config_ids: Iterable[int], b: int = B, seed: int = SEED
) -> Replicates | None:
    """Paired bootstrap replicates of each configuration's average headline accuracy (a fraction).

    Uses the tasks every configuration with per-item scores has (its first run), their common items,
    and per task one resampling of items shared by all configurations."""
    ids = [int(c) for c in dict.fromkeys(config_ids)]
    head = tasks[(tasks["stage"] == "post") & (tasks["headline"] == 1) & tasks["config_id"].isin(ids)]
    post = items[(items["stage"] == "post") & items["config_id"].isin(ids)] if len(items) else items
    if head.empty or post.empty:
        return None
    metric = {(int(r.config_id), r.task): r.metric for r in head.itertuples()}
    have: dict[int, set[str]] = {}
    for r in post.itertuples():
        if metric.get((int(r.config_id), r.task)) == r.name:
            have.setdefault(int(r.config_id), set()).add(r.task)
    cfgs = [c for c in ids if c in have]
    if not cfgs:
        return None
    common_tasks = sorted(set.intersection(*(have[c] for c in cfgs)))
    cfgs = [c for c in cfgs if {t for (cc, t) in metric if cc == c} == set(common_tasks)]
    if not cfgs or not common_tasks:
        return None
    point = np.zeros(len(cfgs))
    reps = np.zeros((b, len(cfgs)))
    n_items = 0
    for task in common_tasks:
        rows = post[(post["task"] == task) & post["config_id"].isin(cfgs)]
        step = {c: rows.loc[rows["config_id"] == c, "step"].min() for c in cfgs}
        subtasks = sorted(set(rows["subtask"]))
        cols: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        for c in cfgs:
            mine = rows[
                (rows["config_id"] == c) & (rows["step"] == step[c]) & (rows["name"] == metric[(c, task)])
            ]
            mine = mine.drop_duplicates(["subtask"])
            keys = np.concatenate([_item_keys(r.subtask, r.ids, subtasks) for r in mine.itertuples()])
            vals = np.concatenate([r.vals for r in mine.itertuples()])
            cols[c] = (keys, vals)
        got = _aligned(cols)
        if got is None:
            return None
        _, mat = got
        mat = np.nan_to_num(mat, nan=0.0)
        w = resample_weights(len(mat), b, _rng(seed, task))
        point += mat.mean(axis=0)
        reps += w @ mat / len(mat)
        n_items += len(mat)
    t = len(common_tasks)
    return Replicates(
        dict(zip(cfgs, (point / t).tolist(), strict=True)),
        {c: reps[:, i] / t for i, c in enumerate(cfgs)},
        n_items,
        f"paired bootstrap over {n_items} items ({t} task{'s' * (t != 1)}, B={b})",
    )


def ppl_replicates(
    items: pd.DataFrame, config_ids: Iterable[int], stage: str = "pre", b: int = B, seed: int = SEED
) -> Replicates | None:
    """Paired bootstrap replicates of each configuration's perplexity over its windows (Σ NLL / tokens)."""
    ids = [int(c) for c in dict.fromkeys(config_ids)]
    rows = (
        items[(items["stage"] == stage) & (items["task"] == "") & items["config_id"].isin(ids)]
        if len(items)
        else items
    )
    if rows.empty:
        return None
    nll: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    tok: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for r in rows.drop_duplicates(["config_id", "name"]).itertuples():
        (nll if r.name == "nll" else tok if r.name == "tokens" else {})[int(r.config_id)] = (r.ids, r.vals)
    cfgs = [c for c in ids if c in nll and c in tok and np.isfinite(nll[c][1]).all()]
    a, t = _aligned({c: nll[c] for c in cfgs}), _aligned({c: tok[c] for c in cfgs})
    if not cfgs or a is None or t is None or len(a[0]) != len(t[0]) or len(a[0]) < 2:
        return None
    (_, mn), (_, mt) = a, t
    w = resample_weights(len(mn), b, _rng(seed, f"ppl:{stage}"))
    with np.errstate(over="ignore"):
        point = np.exp(mn.sum(axis=0) / mt.sum(axis=0))
        reps = np.exp((w @ mn) / (w @ mt))
    return Replicates(
        dict(zip(cfgs, point.tolist(), strict=True)),
        {c: reps[:, i] for i, c in enumerate(cfgs)},
        len(mn),
        f"paired bootstrap over {len(mn)} windows (B={b})",
    )


# ---- binomial standard errors from published benchmark sizes --------------------------------------
@cache
def benchmark_sizes() -> dict[str, int]:
    """{task: number of evaluation items} of the published benchmarks (analysis/data/benchmark_sizes.csv)."""
    with SIZES.open() as f:
        return {r["task"]: int(r["n"]) for r in csv.DictReader(f)}


def binomial_se(tasks: pd.DataFrame, config_ids: Iterable[int]) -> dict[int, tuple[float, int]]:
    """{config: (se of its average headline accuracy, items)} from each task's published size:
    √(Σ_t p_t(1-p_t)/n_t) / T. Configurations with a task of unknown size are left out."""
    sizes = benchmark_sizes()
    head = tasks[(tasks["stage"] == "post") & (tasks["headline"] == 1)]
    out = {}
    for c in dict.fromkeys(int(x) for x in config_ids):
        mine = head[head["config_id"] == c].drop_duplicates("task")
        if mine.empty or not all(t in sizes for t in mine["task"]):
            continue
        var = sum(
            p * (1 - p) / sizes[t] for t, p in zip(mine["task"], mine["value"].astype(float), strict=True)
        )
        out[c] = (float(np.sqrt(var)) / len(mine), sum(sizes[t] for t in mine["task"]))
    return out


# ---- seed repeats ----------------------------------------------------------------------------------
def seed_label(variant: Any) -> str | None:
    """`seed=2` for a seed repeat's variant label, else None."""
    return variant if isinstance(variant, str) and SEED_LABEL.match(variant) else None


def seed_order(label: str) -> int:
    return -1 if label == MAIN else int(label.split("=", 1)[1])


@dataclass(frozen=True)
class SeedValues:
    """Per main configuration with seed repeats: {seed label: its number} (`main` = the first seed)."""

    values: dict[int, dict[str, float]]

    @classmethod
    def of(cls, rows: pd.DataFrame, col: str) -> SeedValues:
        """From `results` rows: each repeat's `col` under its main configuration's id, beside the main's."""
        if "variant" not in rows.columns or col not in rows.columns:
            return cls({})
        out: dict[int, dict[str, float]] = {}
        for r in rows[rows["variant"].map(seed_label).notna() & rows[col].notna()].itertuples():
            out.setdefault(int(r.variant_of), {})[r.variant] = float(getattr(r, col))
        main = rows.set_index("config_id")[col]
        for c in list(out):
            if c in main.index and pd.notna(main.loc[c]):
                out[c][MAIN] = float(main.loc[c])
            else:
                del out[c]  # no number for the first seed: nothing to pool
        return cls({c: dict(sorted(v.items(), key=lambda kv: seed_order(kv[0]))) for c, v in out.items()})

    def diff(self, a: list[int], b: list[int], scale: float = 1.0) -> dict[str, Any] | None:
        """Group a's mean minus group b's under each seed every member has (at least 2), with its test."""
        if not all(c in self.values for c in a + b):
            return None
        labels = sorted(set.intersection(*(set(self.values[c]) for c in a + b)), key=seed_order)
        if len(labels) < 2:
            return None
        d = [
            scale * (np.mean([self.values[c][s] for c in a]) - np.mean([self.values[c][s] for c in b]))
            for s in labels
        ]
        return seed_test(d, labels)


def pooled(values: dict[str, float], scale: float = 1.0) -> dict[str, Any]:
    """One student's number over its seeds: each seed's, their mean and the between-seed sd (ddof 1)."""
    v = np.array(list(values.values()), dtype=float) * scale
    return {
        "seeds": list(values),
        "values": [_r(x) for x in v],
        "mean": _r(v.mean()),
        "sd": _r(v.std(ddof=1)) if len(v) > 1 else None,
    }


def seed_test(diffs: list[float], labels: list[str]) -> dict[str, Any]:
    """The per-seed differences, their mean, sd and t interval; `survives` when the interval excludes 0."""
    from scipy.stats import t

    d = np.asarray(diffs, dtype=float)
    sd = float(d.std(ddof=1))
    half = float(t.ppf((1 + LEVEL) / 2, len(d) - 1)) * sd / np.sqrt(len(d))
    lo, hi = d.mean() - half, d.mean() + half
    return {
        "seeds": labels,
        "diffs": [_r(x) for x in d],
        "mean": _r(d.mean()),
        "sd": _r(sd),
        "ci": [_r(lo), _r(hi)],
        "n": len(d),
        "survives": bool(lo > 0 or hi < 0),
    }


def with_seeds(iv: dict[str, Any] | None, seeds: dict[str, Any] | None) -> dict[str, Any] | None:
    """An item-level interval with its seed test beside it: `distinguishable` becomes both (SEED_RULE), the
    item-level verdict stays in `item_distinguishable`."""
    if iv is None or seeds is None:
        return iv
    return {
        **iv,
        "item_distinguishable": iv["distinguishable"],
        "seeds": seeds,
        "distinguishable": iv["distinguishable"] and seeds["survives"],
    }


# ---- comparisons ---------------------------------------------------------------------------------
def _r(x: float) -> float:
    return round(float(x), 4)


class Uncertainty:
    """Intervals for one model's comparisons: paired bootstrap where per-item scores exist, else the
    binomial bound from published sizes, else none. Accuracies in pp, perplexities as they are."""

    def __init__(
        self,
        acc: Replicates | None,
        ppl: Replicates | None,
        binom: dict[int, tuple[float, int]] | None = None,
        seed_acc: SeedValues | None = None,
        seed_ppl: SeedValues | None = None,
    ) -> None:
        self.acc, self.ppl, self.binom = acc, ppl, binom or {}
        self.seed_acc, self.seed_ppl = seed_acc or SeedValues({}), seed_ppl or SeedValues({})

    @classmethod
    def of(cls, rows: pd.DataFrame, tasks: pd.DataFrame | None, items: pd.DataFrame | None) -> Uncertainty:
        ids = [int(c) for c in rows["config_id"]]
        acc = ppl = None
        if items is not None and len(items) and tasks is not None:
            acc = acc_replicates(items, tasks, ids)
            ppl = ppl_replicates(items, ids)
        binom = binomial_se(tasks, ids) if tasks is not None and acc is None and len(tasks) else {}
        return cls(acc, ppl, binom, SeedValues.of(rows, "avg"), SeedValues.of(rows, "ppl_pre"))

    def acc_se(self, group: list[int]) -> float | None:
        """Standard error (pp) of the mean accuracy of a group of students."""
        if self.acc and all(c in self.acc.reps for c in group):
            return _r(100 * np.std(np.mean([self.acc.reps[c] for c in group], axis=0), ddof=1))
        if self.binom and all(c in self.binom for c in group):
            return _r(100 * np.mean([self.binom[c][0] for c in group]))
        return None

    def acc_diff(self, a: list[int], b: list[int], stated: float) -> dict[str, Any] | None:
        """The stated difference (pp) of group a's mean accuracy minus group b's with its 95% interval:
        bootstrap percentiles, or stated ± 1.96·se (binomial bound); None without the data."""
        if self.acc and all(c in self.acc.reps for c in a + b):
            return with_seeds(_boot(self.acc, a, b, 100.0, stated), self.seed_acc.diff(a, b, 100.0))
        if self.binom and all(c in self.binom for c in a + b):
            se = 100 * float(
                np.hypot(np.mean([self.binom[c][0] for c in a]), np.mean([self.binom[c][0] for c in b]))
            )
            return interval(
                stated,
                stated - Z * se,
                stated + Z * se,
                se,
                min(self.binom[c][1] for c in a + b),
                "binomial SE from published benchmark sizes, unpaired (conservative)",
            )
        return None

    def ppl_diff(self, a: list[int], b: list[int], stated: float) -> dict[str, Any] | None:
        """The stated difference of group a's mean perplexity minus group b's, paired over windows."""
        if self.ppl and all(c in self.ppl.reps for c in a + b):
            return with_seeds(_boot(self.ppl, a, b, 1.0, stated), self.seed_ppl.diff(a, b))
        return None


def _boot(rep: Replicates, a: list[int], b: list[int], scale: float, stated: float) -> dict[str, Any]:
    diff = np.mean([rep.reps[c] for c in a], axis=0) - np.mean([rep.reps[c] for c in b], axis=0)
    lo, hi = np.quantile(diff, [(1 - LEVEL) / 2, (1 + LEVEL) / 2])
    return interval(stated, scale * lo, scale * hi, scale * np.std(diff, ddof=1), rep.n, rep.method)


def paired_diff(x: np.ndarray, y: np.ndarray, b: int = B, seed: int = SEED) -> dict[str, Any]:
    """Mean of x minus mean of y over the same items (arrays aligned by item), paired bootstrap 95% CI."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    w = resample_weights(len(x), b, _rng(seed, "paired"))
    d = (w @ (x - y)) / len(x)
    lo, hi = np.quantile(d, [(1 - LEVEL) / 2, (1 + LEVEL) / 2])
    return interval(
        float(np.mean(x - y)), lo, hi, float(np.std(d, ddof=1)), len(x), f"paired bootstrap (B={b})"
    )


def interval(point: float, lo: float, hi: float, se: float, n: int, method: str) -> dict[str, Any]:
    """A stated difference with its 95% interval; `distinguishable` false when the interval holds 0."""
    return {
        "diff": _r(point),
        "ci": [_r(lo), _r(hi)],
        "se": _r(se),
        "n": int(n),
        "method": method,
        "distinguishable": bool(lo > 0 or hi < 0),
    }


def verdict(d: dict[str, Any]) -> str | None:
    """Why a difference is not distinguishable (at this n, or across seeds), None when it is."""
    if d["distinguishable"]:
        return None
    return (
        NOT_DISTINGUISHABLE
        if d.get("item_distinguishable", d["distinguishable"]) is False
        else NOT_ACROSS_SEEDS
    )


def seed_words(d: dict[str, Any], unit: str = "pp") -> str:
    """`; over 3 seeds +1.20 ± 0.40 sd, 95% CI [+0.21, +2.19]`: a difference's between-seed test, or ""."""
    s = d.get("seeds")
    if not s:
        return ""
    return (
        f"; over {s['n']} seeds {s['mean']:+.2f} ± {s['sd']:.2f} sd, 95% CI [{s['ci'][0]:+.2f}, "
        f"{s['ci'][1]:+.2f}]{' ' + unit if unit else ''}"
    )


def phrase(d: dict[str, Any] | None, unit: str = "pp") -> str:
    """The words after a stated difference: its interval(s), and whether it is distinguishable."""
    if not d:
        return ""
    ci = f"95% CI [{d['ci'][0]:+.2f}, {d['ci'][1]:+.2f}]{' ' + unit if unit else ''}, n={d['n']}{seed_words(d, unit)}"
    why = verdict(d)
    return f" ({ci})" if why is None else f" — {why} ({ci})"
