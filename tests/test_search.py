"""distill.search: the space's one-line errors, seeded suggestions, the rung/promotion rule, the dry run's
counts, and a micro sweep whose random search with asha in 2 rungs runs end to end (serial executor)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from orchestrator.search import Search, plan_trials, promote, rung_steps, stopped_trials, suggest
from orchestrator.spec import SpecError, load_spec

HERE = Path(__file__).resolve().parent
MICRO = HERE / "sweeps" / "micro.yaml"
SETTINGS = {"steps": 8, "batch_size": 4, "seq_len": 64, "lr": 1.0e-3, "min_lr": 1.0e-4, "warmup": 1}
SEARCH = {
    "space": {"lr": {"loguniform": [1.0e-4, 1.0e-2]}, "tau": {"choice": [1, 2, 4]}},
    "num_samples": 4,
    "algorithm": "random",
    "seed": 3,
    "scheduler": "asha",
    "grace_steps": 1,
    "reduction_factor": 2,
    "max_steps": 2,
}


def _sweep(tmp: Path, search: dict | None, **distill) -> Path:
    raw = yaml.safe_load(MICRO.read_text())
    if search is not None:
        raw["distill"]["search"] = search
    raw["distill"].update(distill)
    path = tmp / "micro_search.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


# ---- the section's one-line errors ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"space": {"lrr": {"choice": [1e-4]}}}, "space.lrr: not a distillation setting; allowed:"),
        ({"space": {"lr": {"normal": [0, 1]}}}, "space.lr: unknown distribution 'normal'; allowed: grid,"),
        ({"space": {"lr": {"uniform": [1e-4, 1e-3], "choice": [1e-4]}}}, "space.lr: one distribution"),
        ({"space": {"lr": {"loguniform": [0, 1e-3]}}}, "space.lr.loguniform: low > 0"),
        ({"space": {"lr": {"loguniform": [1e-3, 1e-4]}}}, "space.lr.loguniform: low < high"),
        ({"space": {"lr": {"uniform": [1e-4]}}}, "space.lr.uniform: two numbers [low, high]"),
        ({"space": {"warmup": {"uniform": [1, 5]}}}, "space.warmup.uniform: draws floats, and warmup is int"),
        (
            {"space": {"loss": {"grid": ["forward_kl", "l2"]}}},
            "space.loss: DistillSpec.loss: 'l2' is not allowed",
        ),
        ({"space": {"lr": {"loguniform": [1e-6, 1e-3]}}}, "space.lr: DistillSpec.min_lr"),
        ({"space": {"tau": {"choice": [1, 1]}}}, "space.tau.choice: a value is listed twice"),
        ({"space": {}}, "space: empty"),
        ({"algorithm": "grid"}, "algorithm grid: space.lr is loguniform"),
        ({"algorithm": "optuna"}, "algorithm optuna: needs the package optuna"),
        ({"evaluate": "best"}, "distill.search.evaluate: Input should be 'all' or 'finalists' (got 'best')"),
        ({"scheduler": None}, "grace_steps: only with scheduler: asha"),
        ({"grace_steps": None}, "scheduler asha: needs grace_steps"),
        ({"grace_steps": 4, "max_steps": 2}, "grace_steps: 4 is above max_steps 2"),
        ({"reduction_factor": 1}, "reduction_factor"),
        ({"space": {"steps": {"choice": [1, 2]}}}, "space.steps: scheduler asha sets each rung's steps"),
        ({"metric": "acc"}, "metric"),
        ({"on": {"scorin": "SF"}}, "'scorin' is not a configuration field"),
    ],
)
def test_a_bad_search_is_one_line_naming_the_field(tmp_path, change, says):
    search = {k: v for k, v in {**SEARCH, **change}.items() if v is not None}
    if change.get("scheduler", "asha") is None:
        search.pop("scheduler", None)
    with pytest.raises(SpecError) as e:
        load_spec(str(_sweep(tmp_path, search)))
    line = str(e.value)
    assert "\n" not in line and says in line and "search" in line, line


def test_a_good_search_loads(tmp_path):
    spec, _, _ = load_spec(str(_sweep(tmp_path, SEARCH)))
    s = spec.distill.search
    assert (s.algorithm, s.scheduler, s.rungs(spec.distill.settings)) == ("random", "asha", [1, 2])
    assert s.trials(spec.distill.settings) == 4 and s.jobs_bound(spec.distill.settings) == 6


# ---- suggestions -------------------------------------------------------------------------------------------
def test_seeded_suggestions_are_reproducible_and_of_the_fields_types():
    search = Search.model_validate(
        {**SEARCH, "space": {**SEARCH["space"], "loss": {"grid": ["forward_kl", "reverse_kl"]}}}
    )
    _, a = suggest(search, SETTINGS)
    _, b = suggest(search, SETTINGS)
    assert len(a) == 8  # 4 samples × a grid of 2
    assert json.dumps(a) == json.dumps(b)  # exact: the same seed draws the same numbers in the same order
    assert [p["loss"] for p in a] == ["forward_kl", "reverse_kl"] * 4
    assert all(1e-4 <= p["lr"] <= 1e-2 and isinstance(p["tau"], float) and p["tau"] in (1, 2, 4) for p in a)
    _, other = suggest(search.model_copy(update={"seed": 4}), SETTINGS)
    assert [p["lr"] for p in other] != [p["lr"] for p in a]


def test_a_grid_search_suggests_every_point_once():
    search = Search.model_validate(
        {
            "space": {"tau": {"grid": [1, 2]}, "loss": {"grid": ["forward_kl", "reverse_kl"]}},
            "algorithm": "grid",
        }
    )
    _, points = suggest(search, SETTINGS)
    assert sorted((p["tau"], p["loss"]) for p in points) == [
        (1.0, "forward_kl"),
        (1.0, "reverse_kl"),
        (2.0, "forward_kl"),
        (2.0, "reverse_kl"),
    ]


# ---- rungs and promotion -----------------------------------------------------------------------------------
def test_rungs_grow_by_eta_up_to_max_steps():
    assert rung_steps(100, 3, 2700) == [100, 300, 900, 2700]
    assert rung_steps(100, 3, 1000) == [100, 300, 900, 1000]
    assert rung_steps(5, 2, 5) == [5]
    assert rung_steps(1, 2, 2) == [1, 2]


def test_promotion_keeps_the_best_fraction_by_the_metric():
    values = {0: 3.0, 1: 1.0, 2: 2.0, 3: None, 4: 0.5, 5: math.nan}
    assert promote(values, 2, "min") == [1, 2, 4]  # 6 ran: the best 3 finite ones
    assert promote(values, 2, "max") == [0, 1, 2]
    assert promote(values, 3, "min") == [1, 4]
    assert promote({0: 1.0, 1: 1.0, 2: 2.0}, 3, "min") == [0]  # a tie goes to the earlier trial
    assert promote({0: 2.0}, 3, "min") == [0]  # at least one goes on
    assert promote({0: None, 1: math.inf}, 2, "min") == []  # a failed trial never does


# ---- the dry run ---------------------------------------------------------------------------------------------
def test_the_dry_run_counts_up_to_the_trials_and_plans_nothing_else(tmp_path):
    from orchestrator.dryrun import plan_counts

    plain, plain_keys = plan_counts(load_spec(str(MICRO))[0])
    rows, keys = plan_counts(load_spec(str(_sweep(tmp_path, SEARCH)))[0])
    assert keys == plain_keys  # the search adds no job the dry run can plan
    distill = {r["stage"]: r for r in rows}["distill"]
    before = {r["stage"]: r for r in plain}["distill"]
    groups = 4 + 2 + 1  # scoring × grouping selected + random_ffn, random_init + the best d2d
    assert distill["named"] == before["named"] + 4 * groups
    assert distill["distinct"] == before["distinct"] + 6 * groups
    assert (
        "up to 28 search trials in up to 42 jobs" in distill["note"]
        and "2 rungs of 1/2 steps" in distill["note"]
    )
    evaluate = {r["stage"]: r for r in rows}["evaluate"]
    assert evaluate["named"] == {r["stage"]: r for r in plain}["evaluate"]["named"] + 4 * groups


def test_evaluating_only_the_finalists_counts_them_in_the_dry_run(tmp_path):
    from orchestrator.dryrun import plan_counts

    plain, _ = plan_counts(load_spec(str(MICRO))[0])
    rows, _ = plan_counts(load_spec(str(_sweep(tmp_path, {**SEARCH, "evaluate": "finalists"})))[0])
    groups = 4 + 2 + 1
    by = {r["stage"]: r for r in rows}
    assert by["distill"]["named"] == {r["stage"]: r for r in plain}["distill"]["named"] + 4 * groups
    assert "the up to 14 finalists evaluated" in by["distill"]["note"]  # 4 trials, 4 // 2 run the last rung
    assert by["evaluate"]["named"] == {r["stage"]: r for r in plain}["evaluate"]["named"] + 2 * groups


def test_finalists_and_stopped_trials():
    s = Search.model_validate({**SEARCH, "num_samples": 9, "reduction_factor": 3, "max_steps": 9})
    assert (s.trials(SETTINGS), s.finalists(SETTINGS), s.evaluated(SETTINGS)) == (9, 1, 9)
    assert (
        Search.model_validate({**SEARCH, "num_samples": 9, "evaluate": "finalists"}).evaluated(SETTINGS) == 4
    )
    plain = Search.model_validate({"space": SEARCH["space"], "num_samples": 5, "evaluate": "finalists"})
    assert plain.finalists(SETTINGS) == 5  # no scheduler: every trial runs the one rung
    jobs = {
        "B": FakeJob("B", {}),  # the base configuration itself: never a trial
        "B|search=0": FakeJob("B", {"steps": 1}),
        "B|search=1": FakeJob("B", {"steps": 3}),
        "B|search=2": FakeJob("B", {"steps": 9}),
    }
    assert stopped_trials(s, SETTINGS, jobs) == {"B|search=0", "B|search=1"}
    assert stopped_trials(plain, SETTINGS, jobs) == set()


# ---- a micro sweep end to end ---------------------------------------------------------------------------------
class Counting:
    """The serial executor, counting the jobs it runs."""

    def __init__(self) -> None:
        from orchestrator.execute import SerialExecutor

        self.inner, self.ran = SerialExecutor(), []
        self.name = "serial"

    def run(self, payloads, on_done, progress=None, poll=None, claim=None) -> None:
        def counted(p):
            ok = claim is None or claim(p)
            if ok:
                self.ran.append((p["stage"], p["key"]))
            return ok

        self.inner.run(payloads, on_done, progress, poll, counted)

    def close(self) -> None:
        self.inner.close()


@pytest.mark.parametrize("evaluate", ["all", "finalists"])
def test_a_micro_search_with_asha_runs_its_rungs_as_distill_jobs(tmp_path, monkeypatch, evaluate):
    from rich.console import Console

    from db.store import Store
    from orchestrator.launch import launch

    monkeypatch.setenv("MOESWEEP_HOME", str(tmp_path / "home"))
    raw = yaml.safe_load(MICRO.read_text())
    raw["grid"] = {"scoring": ["SF"], "grouping": ["RR"], "dp_scaling": ["uniform"], "K": [2]}
    raw["baselines"] = []
    raw["distill"]["settings"].update(steps=2, eval_every=1)
    raw["distill"]["search"] = {**SEARCH, "evaluate": evaluate}
    path = tmp_path / "micro_search.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    spec, _, text = load_spec(str(path))
    store = Store(f"sqlite:///{tmp_path}/r.db")

    def run() -> tuple[int, list]:
        ex = Counting()
        code = launch(spec, text, store, ex, console=Console(quiet=True), show_progress=False, path=str(path))
        return code, ex.ran

    code, ran = run()
    assert code == 0
    q = lambda sql, **p: store.query(sql, p)[1]  # noqa: E731
    ((base,),) = q(
        "SELECT config_key FROM configurations WHERE selected_for_distill = 1 AND variant_of IS NULL"
    )
    trials = q(
        "SELECT c.config_key, c.variant, c.settings, j.key, j.params_json FROM configurations c "
        "JOIN configurations b ON b.id = c.variant_of JOIN config_jobs cj ON cj.config_id = c.id "
        "JOIN jobs j ON j.id = cj.job_id WHERE cj.stage = 'distill' AND b.config_key = :b ORDER BY c.config_key",
        b=base,
    )
    assert [t[0] for t in trials] == [f"{base}|search={n}" for n in range(4)]
    assert all(
        t[1].startswith(f"search={n}:") and "lr=" in t[1] and "tau=" in t[1] for n, t in enumerate(trials)
    )
    _, points = suggest(spec.distill.search, spec.distill.settings)
    for t, point in zip(trials, points, strict=True):  # each trial's settings in its row and in its job
        info = json.loads(t[2])["search"]
        assert info["settings"] == point and json.loads(t[4])["settings"]["tau"] == point["tau"]
    # rung 0: every trial 1 step; rung 1: the best 4 // 2 of them by their val_ce in the DB, 2 steps
    rung0 = {}
    for key, params in q("SELECT key, params_json FROM jobs WHERE stage = 'distill'"):
        s = json.loads(params)["settings"]
        if s["steps"] == 1:
            ((ce,),) = q(
                "SELECT m.value FROM metrics m JOIN jobs j ON j.id = m.job_id WHERE j.key = :k "
                "AND m.name = 'val_ce' AND m.who = 'student' AND m.step = 1",
                k=key,
            )
            rung0[(s["lr"], s["tau"])] = ce
    assert len(rung0) == 4
    best = sorted(rung0, key=rung0.get)[:2]
    steps = {
        (p["lr"], p["tau"]): json.loads(t[4])["settings"]["steps"]
        for t, p in zip(trials, points, strict=True)
    }
    assert sorted(k for k, s in steps.items() if s == 2) == sorted(best)
    assert sorted(k for k, s in steps.items() if s == 1) == sorted(set(rung0) - set(best))
    assert sum(1 for stage, _ in ran if stage == "distill") == 1 + 4 + 2  # the base, rung 0, rung 1
    notes = [json.loads(t[2])["search"]["rung"] for t in trials]
    assert sorted(notes) == [0, 0, 1, 1]
    # evaluated downstream like any distilled variant (with `evaluate: finalists` only those of the last
    # rung), every trial shown in the results view
    res = q(
        "SELECT config_key, avg_acc IS NOT NULL FROM results WHERE variant LIKE 'search=%' ORDER BY config_key"
    )
    finalists = {t[0] for t in trials if json.loads(t[4])["settings"]["steps"] == 2}
    assert len(res) == 4 and len(finalists) == 2
    assert {ck for ck, ok in res if ok} == ({t[0] for t in trials} if evaluate == "all" else finalists)
    assert (
        sum(1 for stage, _ in ran if stage == "evaluate") == (4 if evaluate == "all" else 2) + 1
    )  # + the base
    code, again = run()
    assert code == 0 and again == []  # a relaunch reuses every trial


class FakeJob:
    def __init__(self, base: str, over: dict) -> None:
        self.params = {"settings": {**SETTINGS, **over}}
        self.key = f"{base}:{json.dumps(self.params, sort_keys=True)}"


def test_rungs_promote_by_made_up_metrics_and_link_each_trial_to_its_last_job():
    from types import SimpleNamespace

    from orchestrator.stages.distill import Distill

    search = {**SEARCH, "num_samples": 9, "grace_steps": 1, "reduction_factor": 3, "max_steps": 9}
    d = Distill.model_validate({"settings": SETTINGS, "search": search})
    _, points = suggest(d.search, d.settings)
    made_up = {json.dumps(p, sort_keys=True): float(i) for i, p in enumerate(points)}  # trial n scores n …
    made_up[json.dumps(points[4], sort_keys=True)] = -1.0  # … but trial 4 is the best, and trial 0 fails
    rounds, added, fields = [], [], {}

    def run_now(stage: str, jobs: dict) -> dict:
        rounds.append(sorted(jobs))
        return {j.key: {} for k, j in jobs.items() if not k.endswith("=0")}

    def job_metrics(keys: list[str], name: str) -> list[dict]:
        out = []
        for k in keys:
            s = json.loads(k.split(":", 1)[1])["settings"]
            point = {f: s[f] for f in ("lr", "tau")}
            value = made_up[json.dumps(point, sort_keys=True)] + 1.0 / s["steps"]
            out += [{"key": k, "who": "student", "step": s["steps"], "value": value}]
            out += [
                {"key": k, "who": "student", "step": 0, "value": 99.0},
                {"key": k, "who": "teacher", "step": 0, "value": 0.0},
            ]
        return out

    ctx = SimpleNamespace(
        spec=SimpleNamespace(distill=d),
        config=lambda ck: {"config_key": ck, "kind": "moe2dense"},
        add_configs=added.extend,
        set_fields=fields.update,
        run_now=run_now,
        job_metrics=job_metrics,
    )
    last = plan_trials(ctx, {"B": "ppl"}, lambda ppl, over: FakeJob("B", over))
    assert [len(r) for r in rounds] == [9, 3, 1]  # rungs of 1, 3 and 9 steps
    assert rounds[1] == ["B|search=1", "B|search=2", "B|search=4"]  # the best 9 // 3, trial 0 failed
    assert rounds[2] == ["B|search=4"]
    steps = {tk: j.params["settings"]["steps"] for tk, j in last.items()}
    assert steps == {f"B|search={n}": 9 if n == 4 else 3 if n in (1, 2) else 1 for n in range(9)}
    assert [c["config_key"] for c in added] == [f"B|search={n}" for n in range(9)]
    assert all(c["variant_of"] == "B" and c["selected_for_distill"] == 1 for c in added)
    info = {tk: json.loads(f["settings"])["search"] for tk, f in fields.items()}
    assert [h["steps"] for h in info["B|search=4"]["rungs"]] == [1, 3, 9]
    assert info["B|search=0"]["rungs"][0]["val_ce"] is None and "failed" in fields["B|search=0"]["note"]
    assert "stopped at rung 1" in fields["B|search=2"]["note"] and "the last" in fields["B|search=4"]["note"]
