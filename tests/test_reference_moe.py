"""The Router KD paper's Tables 2/3 and the REAP paper's Table 2 as reference sweeps of smaller MoEs:
every shipped value lands in the DB once, the axes are the ones our sweeps use, re-importing replaces
them, and the aggregates derived from the printed tables (win counts of the "-R" columns, 25-row means,
the REAP paper's averages and its claims in the text) come out of the DB."""

from __future__ import annotations

import json
import re

import pytest

from analysis.reference import (
    REAP_AVERAGES,
    REAP_TABLE,
    REAP_TASK_NAME,
    ROUTER_KD_MC,
    ROUTER_KD_SWEEP,
    ROUTER_KD_TABLES,
    read_table,
    reference_sweeps,
)
from db.store import Store
from orchestrator.axes import AXES, config_key

SWEEPS = {s["name"]: s for s in reference_sweeps()}
RKD, REAP_QWEN, REAP_GLM = ROUTER_KD_SWEEP, "paper:reap-qwen3-30b-a3b", "paper:reap-glm-4.5-air"
MOE_SWEEPS = (RKD, REAP_QWEN, REAP_GLM)
OURS = {*AXES["scoring"].allowed(), *AXES["merging"].allowed(), *AXES["editing"].allowed()}
OUTPUT_OF = {"MoBE": "edited", "TD-MoE": "edited", "HC-SMoE": "merged", "M-SMoE": "merged"}
METHOD_AXIS = {"moe": "scoring", "merged": "merging", "edited": "editing"}


def key_of(method: str, K: int, recovery: str) -> str:
    return f"{OUTPUT_OF.get(method, 'moe')}|{method}|K={K}|recovery={recovery}"


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Store:
    s = Store(f"sqlite:///{tmp_path_factory.mktemp('db')}/m.db")
    s.import_reference(reference_sweeps())
    return s


def _value(store: Store, sweep: str, key: str, name: str, task: str = "") -> float:
    _, rows = store.query(
        "SELECT m.value FROM config_metrics m JOIN configurations c ON c.id = m.config_id "
        "JOIN sweeps s ON s.id = c.sweep_id WHERE s.name = :s AND c.config_key = :k AND m.name = :n "
        "AND m.task = :t AND m.stage = 'post'",
        {"s": sweep, "k": key, "n": name, "t": task},
    )
    assert len(rows) == 1, (sweep, key, name, task, rows)
    return rows[0][0]


def _rkd(store: Store, key: str, task: str) -> float:
    _, rows = store.query(
        "SELECT m.value FROM config_metrics m JOIN configurations c ON c.id = m.config_id "
        "JOIN sweeps s ON s.id = c.sweep_id WHERE s.name = :s AND c.config_key = :k AND m.task = :t "
        "AND m.stage = 'post'",
        {"s": RKD, "k": key, "t": task},
    )
    assert len(rows) == 1, (key, task, rows)
    return rows[0][0]


def rkd_key(col: str) -> str:
    if col == "Original":
        return "teacher"
    m = col[:-2] if col.endswith("-R") else col
    return key_of(m, 80, "router_kd" if col.endswith("-R") else "none")


# ---- every value, once -----------------------------------------------------------------------------
def test_counts(store):
    _, rows = store.query(
        "SELECT s.name, COUNT(DISTINCT c.id), COUNT(m.id) FROM sweeps s JOIN configurations c "
        "ON c.sweep_id = s.id LEFT JOIN metrics m ON m.config_id = c.id WHERE s.name IN (:a, :b, :c) "
        "GROUP BY s.name ORDER BY s.name",
        {"a": RKD, "b": REAP_QWEN, "c": REAP_GLM},
    )
    # Router KD: Original + 6 methods x (none, router_kd), 25 benchmarks each (Original printed in both
    # tables, stored once); REAP: baseline + 5 methods x 2 ratios, 8 columns (GLM's baseline Math Avg
    # is not printed)
    assert rows == [(REAP_GLM, 11, 87), (REAP_QWEN, 11, 88), (RKD, 13, 325)]


def test_every_router_kd_value_round_trips(store):
    n = 0
    for table, name in ROUTER_KD_TABLES.items():
        rows = read_table(name)
        assert len(rows) == 25
        for r in rows:
            for col in r:
                if col in ("category", "benchmark", "task"):
                    continue
                assert _rkd(store, rkd_key(col), r["task"]) == float(r[col]), (table, col, r["task"])
                n += 1
    assert n == 2 * 25 * 7


def test_every_reap_value_round_trips(store):
    n = 0
    for r in read_table(REAP_TABLE):
        sweep = f"paper:reap-{r['model'].lower()}"
        if r["ratio"] == "":
            key = "teacher"
        else:
            K = {"25%": 96, "50%": 64}[r["ratio"]]
            key = key_of("frequency" if r["method"] == "Frequency" else r["method"], K, "none")
        for col, task in REAP_TASK_NAME.items():
            assert _value(store, sweep, key, "score", task) == float(r[col])
            n += 1
        for col in REAP_AVERAGES:
            if r[col] == "":
                continue
            name = "avg_published" if col == "mc_avg" else col
            assert _value(store, sweep, key, name) == float(r[col]), (sweep, key, col)
            n += 1
    assert n == 22 * 8 - 1


def test_spot_checks_against_the_printed_tables(store):
    # Router KD paper, Table 2 (Qwen3-30B-A3B-Instruct-2507, 62.5% retention), as printed:
    # "| General | BBH-Fewshot | 0.3039 | 0.4866 | 0.4810 | 0.0023 | 0.4715 | 0.3107 | 0.3173 |"
    # "| Math | MATH | 0.2712 | 0.2736 | 0.2786 | 0.2438 | 0.4608 | 0.2518 | 0.2578 |"
    assert _rkd(store, "teacher", "bbh_fewshot") == 0.3039
    assert _rkd(store, "moe|REAP|K=80|recovery=none", "bbh_fewshot") == 0.4866
    assert _rkd(store, "edited|MoBE|K=80|recovery=none", "bbh_fewshot") == 0.0023
    assert _rkd(store, "edited|MoBE|K=80|recovery=router_kd", "math") == 0.4608
    assert _rkd(store, "merged|HC-SMoE|K=80|recovery=router_kd", "math") == 0.2578
    # Table 3: "| Multi-Choice | WinoGrande | 0.5683 | 0.5872 | 0.6212 | 0.5801 | 0.5691 | 0.5896 | 0.5872 |"
    # "| Coding | HumanEval-instruct | 0.9390 | 0.0183 | 0.0854 | 0.8171 | 0.8110 | 0.0000 | 0.0000 |"
    assert _rkd(store, "moe|CFES|K=80|recovery=router_kd", "winogrande") == 0.6212
    assert _rkd(store, "edited|TD-MoE|K=80|recovery=none", "winogrande") == 0.5801
    assert _rkd(store, "merged|M-SMoE|K=80|recovery=router_kd", "humaneval_instruct") == 0.0
    assert _rkd(store, "moe|CFES|K=80|recovery=none", "humaneval_instruct") == 0.0183
    # CoT-Zeroshot GSM8k and Math GSM8k are different rows: "| CoT-Zeroshot | GSM8k | 0.5671 | 0.6149 |"
    assert _rkd(store, "teacher", "gsm8k_cot_zeroshot") == 0.5671
    assert _rkd(store, "teacher", "gsm8k") == 0.8628
    # REAP paper, Table 2:
    # "| Qwen3-30B-A3B | 50% | HC-SMoE | 0.543 | 0.185 | 0.364 | 0.008 | 0.760 | 0.696 | 0.728 | 0.542 |"
    assert _value(store, REAP_QWEN, "merged|HC-SMoE|K=64|recovery=none", "score", "wildbench") == 0.008
    assert _value(store, REAP_QWEN, "merged|HC-SMoE|K=64|recovery=none", "math_avg") == 0.728
    # "| GLM-4.5-Air | 25% | REAP | 0.759 | 0.412 | 0.585 | 0.831 | 0.839 | 0.920 | 0.879 | 0.674 |"
    assert _value(store, REAP_GLM, "moe|REAP|K=96|recovery=none", "score", "livecodebench") == 0.412
    assert _value(store, REAP_GLM, "moe|REAP|K=96|recovery=none", "avg_published") == 0.674
    # "| Qwen3-30B-A3B | 25% | Frequency | 0.805 | 0.302 | 0.553 | 0.807 | 0.910 | 0.865 | 0.888 | 0.600 |"
    assert _value(store, REAP_QWEN, "moe|frequency|K=96|recovery=none", "score", "gsm8k") == 0.910


def test_cells_filled_from_table_a6_are_marked(store):
    _, rows = store.query(
        "SELECT s.name, c.config_key, m.value, m.extra_json FROM metrics m JOIN configurations c "
        "ON c.id = m.config_id JOIN sweeps s ON s.id = c.sweep_id WHERE m.extra_json LIKE '%filled_from%' "
        "ORDER BY s.name, c.config_key"
    )
    assert [(s, k, v) for s, k, v, _ in rows] == [
        (REAP_GLM, "merged|M-SMoE|K=64|recovery=none", 0.444),
        (REAP_GLM, "teacher", 0.747),
        (REAP_QWEN, "merged|M-SMoE|K=64|recovery=none", 0.451),
    ]
    assert all(json.loads(e)["filled_from"] == "Table A6" for *_, e in rows)
    _, none = store.query(
        "SELECT COUNT(*) FROM metrics m JOIN configurations c ON c.id = m.config_id JOIN sweeps s "
        "ON s.id = c.sweep_id WHERE s.name = :s AND c.config_key = 'teacher' AND m.name = 'math_avg'",
        {"s": REAP_GLM},
    )
    assert none == [(0,)]  # not printed, not invented


# ---- the axes ------------------------------------------------------------------------------------
def test_axes_are_our_axes():
    for name in MOE_SWEEPS:
        s = SWEEPS[name]
        assert s["select"] is None and s["source"].startswith("paper:")
        for c in s["configs"]:
            if c["kind"] == "teacher":
                assert c["config_key"] == "teacher" and c.get("output") is None
                continue
            assert c["kind"] == "moe2moe" and c["output"] in AXES["output"].allowed()
            assert c["recovery"] in AXES["recovery"].allowed()
            axis = METHOD_AXIS[c["output"]]
            method = c[axis]
            assert c["output"] == OUTPUT_OF.get(method, "moe")
            assert c["config_key"] == config_key(
                {"output": c["output"], axis: method, "K": c["K"], "recovery": c["recovery"]}
            )
            assert method in OURS, method  # every method of these papers is in our registries
            assert c.get("grouping") is None and c.get("dp_scaling") is None
    rkd = {c["config_key"] for c in SWEEPS[RKD]["configs"]}
    assert {"moe|REAP|K=80|recovery=router_kd", "edited|MoBE|K=80|recovery=none"} <= rkd
    reap = {
        (c.get("scoring") or c.get("merging"), c["K"])
        for c in SWEEPS[REAP_QWEN]["configs"]
        if c["kind"] != "teacher"
    }
    assert reap == {(m, K) for m in ("frequency", "EAN", "REAP", "HC-SMoE", "M-SMoE") for K in (96, 64)}
    assert {c["model"] for c in SWEEPS[RKD]["configs"]} == {"Qwen3-30B-A3B-Instruct-2507"}


def test_our_sweeps_name_the_same_models_and_keys():
    from orchestrator.configs import teacher_label
    from orchestrator.spec import load_spec

    for spec_name, ref in (
        ("seed001-router-kd-qwen3-30b-a3b", RKD),
        ("seed002-reap-qwen3-30b-a3b", REAP_QWEN),
    ):
        spec, _, _ = load_spec(spec_name)
        keys = {c["config_key"] for c in SWEEPS[ref]["configs"]}
        assert {c["model"] for c in SWEEPS[ref]["configs"]} == {teacher_label(spec)}
        ours = set()
        for g in spec.grid if isinstance(spec.grid, list) else [spec.grid]:
            for out in getattr(g, "output", None) or []:
                if out == "dense":
                    continue
                axis = METHOD_AXIS[out]
                for s in getattr(g, axis):
                    for K in g.K:
                        for r in g.recovery or ["none"]:
                            ours.add(config_key({"output": out, axis: s, "K": K, "recovery": r}))
        both = ours & keys
        assert both, (spec_name, sorted(ours))
        # our REAP-p and the K = k control have no published counterpart
        assert all(k.split("|")[1] in ("REAP-p", "ACP") for k in ours - keys), sorted(ours - keys)


def test_headline_tasks_give_a_meaningful_avg_acc(store):
    _, rows = store.query(
        "SELECT config_key, avg_acc FROM results WHERE sweep = :s ORDER BY config_id", {"s": RKD}
    )
    assert len(rows) == 13
    for key, avg in rows:
        mc = [_rkd(store, key, t) for t in ROUTER_KD_MC]
        assert avg == pytest.approx(sum(mc) / len(mc)), key
    _, tasks = store.query(
        "SELECT DISTINCT task, metric FROM task_scores WHERE sweep = :s ORDER BY task", {"s": RKD}
    )
    assert dict(tasks) == ROUTER_KD_MC
    # REAP Table 2 prints no per-task MC accuracy: no headline task, its MC Avg is the published average
    _, reap = store.query(
        "SELECT COUNT(*), COUNT(avg_acc) FROM results WHERE sweep IN (:a, :b)",
        {"a": REAP_QWEN, "b": REAP_GLM},
    )
    assert reap == [(22, 0)]


def test_reimport_replaces(store):
    def counts():
        return tuple(
            store.query(f"SELECT COUNT(*) FROM {t}")[1][0][0] for t in ("sweeps", "configurations", "metrics")
        )

    before = counts()
    assert store.import_reference([SWEEPS[n] for n in MOE_SWEEPS]) == {RKD: 13, REAP_QWEN: 11, REAP_GLM: 11}
    assert counts() == before
    store.import_reference(reference_sweeps())
    assert counts() == before


# ---- aggregates derived from the printed tables -----------------------------------------------------
# (method, R better, equal, R worse, 25-row mean before Router KD, after), strict ">" per benchmark
ROUTER_KD_DERIVED = [
    ("REAP", 16, 0, 9, 0.5456, 0.5454),
    ("MoBE", 19, 1, 5, 0.4844, 0.5412),
    ("HC-SMoE", 21, 0, 4, 0.4608, 0.4722),
    ("CFES", 21, 0, 4, 0.3798, 0.4103),
    ("TD-MoE", 16, 1, 8, 0.4909, 0.4928),
    ("M-SMoE", 18, 4, 3, 0.3616, 0.3683),
]


def _scores(store: Store, key: str) -> dict[str, float]:
    _, rows = store.query(
        "SELECT m.task, m.value FROM config_metrics m JOIN configurations c ON c.id = m.config_id "
        "JOIN sweeps s ON s.id = c.sweep_id WHERE s.name = :s AND c.config_key = :k AND m.stage = 'post'",
        {"s": RKD, "k": key},
    )
    return dict(rows)


@pytest.mark.parametrize(("method", "better", "equal", "worse", "before", "after"), ROUTER_KD_DERIVED)
def test_router_kd_win_counts_and_means(store, method, better, equal, worse, before, after):
    a = _scores(store, key_of(method, 80, "none"))
    b = _scores(store, key_of(method, 80, "router_kd"))
    assert set(a) == set(b) and len(a) == 25
    assert sum(b[t] > a[t] for t in a) == better
    assert sum(b[t] == a[t] for t in a) == equal
    assert sum(b[t] < a[t] for t in a) == worse
    assert round(sum(a.values()) / 25, 4) == before and round(sum(b.values()) / 25, 4) == after


def test_router_kd_original_mean_and_the_shared_original_column(store):
    t = _scores(store, "teacher")
    assert round(sum(t.values()) / 25, 4) == 0.5463
    t2, t3 = (read_table(n) for n in ROUTER_KD_TABLES.values())
    assert [r["Original"] for r in t2] == [r["Original"] for r in t3]  # Tables 2 and 3 share it


def _reap(store: Store, sweep: str) -> dict[str, dict[str, float]]:
    _, rows = store.query(
        "SELECT c.config_key, CASE WHEN m.task = '' THEN m.name ELSE m.task END, m.value FROM config_metrics m "
        "JOIN configurations c ON c.id = m.config_id JOIN sweeps s ON s.id = c.sweep_id WHERE s.name = :s",
        {"s": sweep},
    )
    out: dict[str, dict[str, float]] = {}
    for k, n, v in rows:
        out.setdefault(k, {})[n] = v
    return out


def test_reap_averages_are_means_of_their_columns(store):
    """Code Avg = mean(Eval+, LiveCode) and Math Avg = mean(GSM8K, MATH-500), within the printed rounding."""
    n = 0
    for sweep in (REAP_QWEN, REAP_GLM):
        for key, m in _reap(store, sweep).items():
            assert abs(m["code_avg"] - (m["evalplus"] + m["livecodebench"]) / 2) <= 0.0011, (sweep, key)
            if "math_avg" in m:
                assert abs(m["math_avg"] - (m["gsm8k"] + m["math500"]) / 2) <= 0.0011, (sweep, key)
                n += 1
    assert n == 21


def test_reap_claims_in_the_text(store):
    q, g = _reap(store, REAP_QWEN), _reap(store, REAP_GLM)
    # "REAP math decrease 0.1% at 25%" over Qwen3 and GLM: Qwen3 -0.001 (a gain), GLM 0.003 against the
    # baseline's Math Avg derived as the mean of its GSM8K and MATH-500 (0.882), mean 0.001
    glm_base = (g["teacher"]["gsm8k"] + g["teacher"]["math500"]) / 2
    assert round(glm_base, 3) == 0.882
    dq = q["teacher"]["math_avg"] - q["moe|REAP|K=96|recovery=none"]["math_avg"]
    dg = glm_base - g["moe|REAP|K=96|recovery=none"]["math_avg"]
    assert round(dq, 3) == -0.001 and round(dg, 3) == 0.003 and round((dq + dg) / 2, 3) == 0.001
    # M-SMoE has the best creative writing on Qwen3 at 50% (0.725 > REAP 0.718), the worst on GLM
    at50 = {k: m["wildbench"] for k, m in q.items() if "K=64" in k}
    assert (
        max(at50, key=at50.get) == "merged|M-SMoE|K=64|recovery=none"
        and at50["moe|REAP|K=64|recovery=none"] == 0.718
    )
    glm50 = {k: m["wildbench"] for k, m in g.items() if "K=64" in k}
    assert min(glm50, key=glm50.get) == "merged|M-SMoE|K=64|recovery=none"


# ---- the report's table of smaller MoEs -------------------------------------------------------------
def _own_moe_sweep(
    store: Store,
    name: str,
    model: str,
    configs: list[tuple[str, int, str, float]],
    settings: dict[str, dict] | None = None,
) -> None:
    """An own sweep of smaller MoEs with three headline tasks, written the way the stages write it (a
    merging or editing method makes a merged or edited output; `settings`: method → its settings)."""
    sid = store.upsert_sweep(name, spec_yaml=f"name: {name}")
    cfgs = [
        {
            "config_key": key_of(s, K, r),
            "model": model,
            "kind": "moe2moe",
            "output": OUTPUT_OF.get(s, "moe"),
            METHOD_AXIS[OUTPUT_OF.get(s, "moe")]: s,
            "K": K,
            "recovery": r,
            "top_k": 8,
            **({"settings": json.dumps(settings[s], sort_keys=True)} if s in (settings or {}) else {}),
        }
        for s, K, r, _ in configs
    ] + [{"config_key": "teacher", "model": model, "kind": "teacher", "top_k": 8}]
    ids = store.upsert_configs(sid, cfgs)
    accs = [a for *_, a in configs] + [0.6]
    links = []
    for (key, cid), acc in zip(ids.items(), accs, strict=True):
        job = f"{name}:{key}"
        store.register_jobs(sid, [{"key": job, "stage": "evaluate", "params": {"k": job}}])
        assert store.claim(job, "t")
        metrics = [
            {"name": m, "stage": "post", "task": t, "value": acc + d, "headline": 1}
            for t, m, d in (
                ("arc_challenge", "acc_norm", 0.0),
                ("piqa", "acc_norm", 0.1),
                ("winogrande", "acc", 0.2),
            )
        ]
        store.finish(job, "t", {"metrics": metrics}, 0.1)
        links.append((cid, "evaluate", store.jobs([job])[job]["id"]))
    store.link(links)


def _table_rows(tex: str) -> list[str]:
    body = tex.split(r"\toprule", 1)[1].split(r"\bottomrule")[0]
    return [ln.strip() for ln in body.splitlines() if ln.strip().endswith(r"\\")]


def test_report_shows_smaller_moes_beside_the_paper(store, tmp_path):
    from analysis.load import load_frames
    from analysis.report import write_report

    model = "Qwen3-30B-A3B-Instruct-2507"
    _own_moe_sweep(store, "own-rkd", model, [("REAP", 80, "none", 0.40), ("REAP", 80, "router_kd", 0.41)])
    _own_moe_sweep(
        store, "own-reap", "Qwen3-30B-A3B", [("REAP", 96, "none", 0.50), ("REAP-p", 96, "none", 0.51)]
    )
    refs = load_frames(store.engine, list(SWEEPS))
    arts = write_report(load_frames(store.engine, ["own-rkd"]), "own-rkd", tmp_path / "rkd", refs)
    assert tmp_path / "rkd" / "tables" / "moe.tex" in arts
    tex = (tmp_path / "rkd" / "tables" / "moe.tex").read_text()
    assert (
        f"Paper ({model}, {RKD})" in tex
        and "mean of its 9 headline tasks" in tex
        and "Shared: its mean" in tex
    )
    rows = _table_rows(tex)
    assert (
        rows[1]
        == r"Kind & Method & K & Recovery & Wino & ARC-C & piqa & Avg & Wino & ARC-C & piqa & Avg & Shared \\"
    )
    # ours (WinoGrande 0.60, ARC-C 0.40, PIQA 0.50) beside the Router KD paper's Table 2 REAP columns:
    # "| Multi-Choice | WinoGrande | 0.5683 | 0.5683 | 0.5841 |", "| ARC-challenge | 0.4787 | 0.4215 | 0.4181 |",
    # "| PIQA | 0.7258 | 0.7203 | 0.7247 |"
    assert (
        r"& Teacher &  &  & 80.00 & 60.00 & 70.00 & 70.00 & 56.83 & 47.87 & 72.58 & 55.05 & 59.09 \\" in rows
    )
    assert (
        r"prune & REAP & 80 & none & 60.00 & 40.00 & 50.00 & 50.00 & 56.83 & 42.15 & 72.03 & 51.11 & 57.00 \\"
        in rows
    )
    assert (
        r"prune & REAP & 80 & Router KD & 61.00 & 41.00 & 51.00 & 51.00 & 58.41 & 41.81 & 72.47 & 51.53 & 57.56 \\"
        in rows
    )
    assert r"edit & MoBE & 80 & Router KD &  &  &  &  & 58.48 & 43.69 & 73.83 & 51.10 & 58.67 \\" in rows
    assert len(rows) == 2 + 1 + 12  # two header lines, teacher, the paper's 12 smaller MoEs (ours among them)
    # the REAP paper's Qwen3-30B-A3B: no per-task MC accuracy published, its Avg is the printed MC Avg
    write_report(load_frames(store.engine, ["own-reap"]), "own-reap", tmp_path / "reap", refs)
    rows = _table_rows((tmp_path / "reap" / "tables" / "moe.tex").read_text())
    assert r"prune & REAP & 96 & none & 70.00 & 50.00 & 60.00 & 60.00 & 66.50 \\" in rows
    assert r"prune & REAP-p & 96 & none & 71.00 & 51.00 & 61.00 & 61.00 &  \\" in rows
    assert r"prune & frequency & 64 & none &  &  &  &  & 48.30 \\" in rows
    assert r"& Teacher &  &  & 80.00 & 60.00 & 70.00 & 70.00 & 72.10 \\" in rows
    # without --compare: our numbers alone; a sweep of dense students gets no such table
    write_report(load_frames(store.engine, ["own-rkd"]), "own-rkd", tmp_path / "alone", None)
    assert "Paper" not in (tmp_path / "alone" / "tables" / "moe.tex").read_text()
    dense = write_report(
        load_frames(store.engine, ["paper:deepseek-v2-lite"]),
        "paper:deepseek-v2-lite",
        tmp_path / "dense",
        refs,
    )
    assert not any(p.name == "moe.tex" for p in dense)


def _caption(tex: str) -> str:
    line = next(ln for ln in tex.splitlines() if ln.startswith(r"\caption{"))
    return line[len(r"\caption{") : -1].replace("\\", "")


def _notes(tex: str) -> list[str]:
    return [
        ln[len(r"{\footnotesize ") : -1].replace("\\", "")
        for ln in tex.splitlines()
        if ln.startswith(r"{\footnotesize ")
    ]


def _stored(store: Store, sweep: str) -> dict[str, dict]:
    """method → the implementation stored on the sweep's published smaller MoEs (all rows agree but for
    the calibration, which the C2F rows vary)."""
    _, rows = store.query(
        "SELECT COALESCE(scoring, merging, editing), settings FROM results WHERE sweep = :s "
        "AND kind = 'moe2moe'",
        {"s": sweep},
    )
    out: dict[str, dict] = {}
    for m, js in rows:
        imp = json.loads(js)
        first = out.setdefault(m, imp)
        assert {k: v for k, v in imp.items() if k != "calibration"} == {
            k: v for k, v in first.items() if k != "calibration"
        }, (sweep, m)
    return out


def test_import_paper_stores_each_methods_implementation_and_settings(tmp_path):
    """`moesweep import-paper` stores, on every published smaller MoE, what its paper ran under that name:
    the Router KD paper's official HC-SMoE / M-SMoE / TD-MoE / MoBE code with their flags and calibration,
    not the REAP paper's re-implementations of the same names."""
    from typer.testing import CliRunner

    from orchestrator.cli import app

    url = f"sqlite:///{tmp_path}/m.db"
    r = CliRunner().invoke(app, ["import-paper", "--db", url])
    assert r.exit_code == 0, r.output
    store = Store(url)
    _, rows = store.query(
        "SELECT c.config_key, c.settings FROM configurations c JOIN sweeps s ON s.id = c.sweep_id "
        "WHERE s.name = :s AND c.kind = 'moe2moe'",
        {"s": RKD},
    )
    got = {k: json.loads(v) for k, v in rows}
    assert len(got) == 12  # six methods, each without and with Router KD
    for method in ("HC-SMoE", "M-SMoE", "TD-MoE", "MoBE"):
        for rec in ("none", "router_kd"):
            imp = got[key_of(method, 80, rec)]
            assert imp["implementation"].startswith(f"the official {method} code"), imp
            assert imp["calibration"] and imp["source"].startswith("Router KD paper")
            assert imp["vs_ours"] == "differs" and imp["difference"].startswith("ours ")
    hc = got[key_of("HC-SMoE", 80, "none")]
    assert "ZipIt merge, group limit 4, silhouette stop, average linkage" in hc["implementation"]
    assert {
        k: hc["settings"][k] for k in ("MERGE_METHOD", "GROUP_LIMIT", "STOP_METRIC", "LINKAGE_METHOD")
    } == {
        "MERGE_METHOD": "zipit",
        "GROUP_LIMIT": "4",
        "STOP_METRIC": "silhouette",
        "LINKAGE_METHOD": "average",
    }
    assert "frequency-weighted average" in hc["difference"] and "no ZipIt" in hc["difference"]
    assert got[key_of("M-SMoE", 80, "none")]["settings"]["similarity_base"] == "router-logits"
    assert got[key_of("M-SMoE", 80, "none")]["calibration"] == "c4"
    assert got[key_of("TD-MoE", 80, "none")]["settings"]["RATIO"] == "0.4"
    assert got[key_of("TD-MoE", 80, "none")]["calibration"].startswith("c4")
    mobe = got[key_of("MoBE", 80, "router_kd")]["settings"]
    assert (mobe["bases"], mobe["truncation"], mobe["num_epochs"]) == ("8", "768", "10000")
    assert got[key_of("CFES", 80, "none")]["settings"]["num_routed_expert"] == "80"
    assert got[key_of("REAP", 80, "none")]["vs_ours"] == "unknown"  # the repository's commit is not given
    # the REAP paper's HC-SMoE is another implementation under the same name
    reap_hc = _stored(store, REAP_QWEN)["HC-SMoE"]
    assert reap_hc["implementation"].startswith("the REAP paper's re-implementation")
    assert reap_hc["settings"]["merge_method"] == "frequency_weighted_average"
    assert "zipit" not in json.dumps(reap_hc).lower()
    # every published smaller MoE carries one, readable through the results view
    for sweep in (*MOE_SWEEPS, "paper:c2f-qwen3-30b-a3b-thinking"):
        for m, imp in _stored(store, sweep).items():
            assert imp["implementation"] and imp["vs_ours"] in ("same", "differs", "unknown", "none"), (
                sweep,
                m,
            )
    c2f = store.query(
        "SELECT config_key, settings FROM results WHERE sweep = 'paper:c2f-qwen3-30b-a3b-thinking' "
        "AND scoring = 'CFES'"
    )[1]
    cals = {k: json.loads(v)["calibration"] for k, v in c2f}
    assert cals["moe|CFES|K=64|recovery=none|calibration=c4"] == "c4 only" and len(set(cals.values())) == 5


def test_implementations_table_is_checked(monkeypatch, tmp_path):
    import analysis.reference as ref

    monkeypatch.setattr(ref, "DATA", tmp_path)
    head = "paper,method,implementation,settings,calibration,vs_ours,difference,source\n"
    for body, says in (
        ("reap,EAN,x,,c,similar,,s\n", "vs_ours 'similar'; allowed: same, differs, unknown, none"),
        ("reap,EAN,x,,c,differs,,s\n", "`difference` must be empty exactly when vs_ours is same"),
        ("reap,EAN,x,a=1; b,c,same,,s\n", "setting 'b'; expected NAME=VALUE"),
        ("reap,EAN,x,,c,same,,s\nreap,EAN,x,,c,same,,s\n", "reap EAN: listed twice"),
    ):
        (tmp_path / "method_implementations.csv").write_text(head + body)
        with pytest.raises(ValueError, match=re.escape(says)):
            ref.implementations()
    (tmp_path / "method_implementations.csv").write_text(head + "reap,EAN,x,,c,same,,s\n")
    with pytest.raises(ValueError, match="no row for paper 'reap', method 'REAP'; listed: EAN"):
        ref.implementation_json(ref.implementations(), "reap", "REAP")


def test_compare_caption_says_where_our_implementation_differs(store, tmp_path):
    """The caption never calls a method "the same" when the paper ran another implementation of it: per
    method of the paper's rows it says same, not ours (how), perhaps not ours (what is open), and the
    notes give the paper's flags and calibration."""
    from analysis.load import load_frames
    from analysis.report import write_report

    model = "Qwen3-30B-A3B-Instruct-2507"
    _own_moe_sweep(
        store,
        "own-impl",
        model,
        [("HC-SMoE", 80, "none", 0.40), ("HC-SMoE", 80, "router_kd", 0.42), ("REAP", 80, "none", 0.41)],
        settings={"HC-SMoE": {"linkage": "single"}},
    )
    refs = load_frames(store.engine, list(SWEEPS))
    write_report(load_frames(store.engine, ["own-impl"]), "own-impl", tmp_path / "rkd", refs)
    tex = (tmp_path / "rkd" / "tables" / "moe.tex").read_text()
    cap, notes = _caption(tex), _notes(tex)
    assert not re.search(r"the same method(?! name)", cap) and "the same method name" in cap
    stored = _stored(store, RKD)
    for m, imp in stored.items():
        assert imp["vs_ours"] != "same"
        assert "Same implementation as ours" not in cap
        said = "not our implementation" if imp["vs_ours"] == "differs" else "perhaps not our implementation"
        assert f", {said}: the paper ran {imp['implementation']}; {imp['difference']}." in cap, m
    # HC-SMoE: the official code (ZipIt, group limit 4, silhouette stop) vs ours, with the settings we gave
    assert (
        "HC-SMoE (our runs set linkage=single), not our implementation: the paper ran the official HC-SMoE "
        "code: ZipIt merge, group limit 4, silhouette stop, average linkage" in cap
    )
    assert "frequency-weighted average of its members (no ZipIt)" in cap
    hc_note = next(n for n in notes if n.startswith("HC-SMoE, the paper's settings:"))
    assert "GROUP_LIMIT=4" in hc_note and "MERGE_METHOD=zipit" in hc_note
    assert "Calibration (M-SMoE): c4." in notes and "Source: Router KD paper, Sec. 5.1 and App. F." in notes
    # the REAP paper: frequency and EAN are ours; its HC-SMoE and M-SMoE are re-implementations
    _own_moe_sweep(store, "own-impl-reap", "Qwen3-30B-A3B", [("HC-SMoE", 96, "none", 0.5)])
    write_report(load_frames(store.engine, ["own-impl-reap"]), "own-impl-reap", tmp_path / "reap", refs)
    cap = _caption((tmp_path / "reap" / "tables" / "moe.tex").read_text())
    assert "Same implementation as ours: EAN, frequency." in cap
    assert "HC-SMoE, perhaps not our implementation: the paper ran the REAP paper's re-implementation" in cap
    assert "M-SMoE, not our implementation: the paper ran the REAP paper's re-implementation" in cap
    assert "ZipIt" not in cap
    assert "REAP, perhaps not our implementation:" in cap and "our REAP-p" in cap


def test_caption_without_stored_implementations_claims_nothing():
    from analysis.moe_tables import implementation_notes

    key = ("merged", "HC-SMoE", 80, "none", "")
    said, notes = implementation_notes({}, {key: {"settings": None}}, [key])
    assert said == "HC-SMoE: the paper's implementation is not recorded (moesweep import-paper stores it)."
    assert notes == []


def test_moe_table_compiles_alone(store, tmp_path):
    import shutil
    import subprocess

    from analysis.load import load_frames
    from analysis.report import write_report

    if shutil.which("pdflatex") is None:
        pytest.skip("pdflatex not installed: the smaller-MoE table's compilation was not checked")
    model = "Qwen3-30B-A3B-Instruct-2507"
    _own_moe_sweep(store, "own-tex", model, [("REAP", 80, "none", 0.40)])
    write_report(
        load_frames(store.engine, ["own-tex"]), "own-tex", tmp_path, load_frames(store.engine, list(SWEEPS))
    )
    tex = tmp_path / "tables" / "moe.tex"
    assert tex.read_text().isascii()
    r = subprocess.run(
        ["pdflatex", "-interaction=nonstopmode", "-halt-on-error", tex.name],
        cwd=tex.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout[-3000:]
    assert "Overfull \\hbox" not in tex.with_suffix(".log").read_text(errors="replace")


# ---- seeds 003 (C2F/DCDM) and 004 (DOT-MoE) ----------------------------------------------------------
def test_every_c2f_and_dot_moe_value_round_trips(store):
    from analysis.reference import C2F_SWEEP, DOT_SWEEP, _slug

    assert _slug("CMoE (E8A1S1)") == "cmoe-e8a1s1" and _slug("Qwen2.5 7B") == "qwen2-5-7b"
    n = 0
    for r in read_table("c2f_table2_3_qwen3_thinking"):
        if r["method"] == "Original":
            key = "teacher"
        else:
            out, method = {"HC-SMoE": ("merged", "HC-SMoE"), "Weights": ("moe", "Weights")}.get(
                r["method"], ("moe", "CFES")
            )
            key = f"{out}|{method}|K=64|recovery=none" + (
                "" if r["calibration"] == "fixed" else f"|calibration={r['calibration']}"
            )
        for col, task in (
            ("mmlu", "mmlu"),
            ("math500", "math500"),
            ("aime25", "aime25"),
            ("lcb", "livecodebench"),
        ):
            assert (
                _value(store, C2F_SWEEP, key, "acc" if col == "mmlu" else "score", task)
                == float(r[col]) / 100
            )
            n += 1
        assert _value(store, C2F_SWEEP, key, "avg_published") == float(r["average"]) / 100
    assert n == 13 * 4
    for r in read_table("dot_moe_table3_zero_shot"):
        key = f"dense2moe|{_slug(r['method'])}|{_slug(r['model'])}|active={r['active_params_b']}B"
        assert _value(store, DOT_SWEEP, key, "avg_published") == float(r["avg"]) / 100, key
        assert _value(store, DOT_SWEEP, key, "acc_norm", "hellaswag") == float(r["hellaswag"]) / 100
    _, rows = store.query(
        "SELECT COUNT(*) FROM configurations c JOIN sweeps s ON s.id = c.sweep_id "
        "WHERE s.name = :s AND c.kind = 'dense2moe'",
        {"s": DOT_SWEEP},
    )
    assert rows[0][0] == 16 + 8


def test_c2f_keys_are_those_our_seed003_sweep_writes():
    """The 1:1:1 CFES run and its DCDM mixture are configurations our sweep makes; the single-domain runs
    are variants of the mixed one."""
    from analysis.reference import C2F_SWEEP, c2f
    from orchestrator.spec import load_spec
    from orchestrator.stages.convert import grid_configs
    from orchestrator.stages.dcdm import mixture_config

    spec, _, _ = load_spec("seed003-c2f-qwen3-30b-a3b-thinking")
    ours = {c["config_key"]: c for c in grid_configs(spec, "Qwen3-30B-A3B-Thinking-2507", 8)}
    ours |= {
        m["config_key"]: m for m in (mixture_config(c) for c in list(ours.values()) if c["scoring"] == "CFES")
    }
    ref = {c["config_key"]: c for c in c2f()["configs"]}
    assert {"moe|CFES|K=64|recovery=none", "moe|CFES|K=64|recovery=none|calibration=dcdm"} <= set(ours) & set(
        ref
    )
    assert (
        ref["moe|CFES|K=64|recovery=none|calibration=dcdm"]["variant_of_key"] == "moe|CFES|K=64|recovery=none"
    )
    assert c2f()["name"] == C2F_SWEEP


def test_report_shows_a_dcdm_variant_beside_the_paper(store, tmp_path):
    from analysis.load import load_frames
    from analysis.reference import C2F_MODEL, C2F_SWEEP
    from analysis.report import write_report

    sid = store.upsert_sweep("own-c2f", spec_yaml="name: own-c2f")
    base = {
        "model": C2F_MODEL,
        "kind": "moe2moe",
        "output": "moe",
        "scoring": "CFES",
        "K": 64,
        "recovery": "none",
        "top_k": 8,
    }
    cfgs = [
        {**base, "config_key": "moe|CFES|K=64|recovery=none"},
        {**base, "config_key": "moe|CFES|K=64|recovery=none|calibration=dcdm", "variant": "calibration=dcdm"},
    ]
    ids = store.upsert_configs(sid, cfgs)
    links = []
    for (key, cid), acc in zip(ids.items(), (0.40, 0.45), strict=True):
        job = f"own-c2f:{key}"
        store.register_jobs(sid, [{"key": job, "stage": "evaluate", "params": {"k": job}}])
        assert store.claim(job, "t")
        store.finish(
            job,
            "t",
            {"metrics": [{"name": "acc", "stage": "post", "task": "mmlu", "value": acc, "headline": 1}]},
            0.1,
        )
        links.append((cid, "evaluate", store.jobs([job])[job]["id"]))
    store.link(links)
    refs = load_frames(store.engine, list(SWEEPS))
    write_report(load_frames(store.engine, ["own-c2f"]), "own-c2f", tmp_path / "c2f", refs)
    tex = (tmp_path / "c2f" / "tables" / "moe.tex").read_text()
    rows = _table_rows(tex)
    # ours (MMLU 40.00 / 45.00) beside the paper's Table 3 (Fixed 50.58, DCDM 52.56; its Avg over 4 tasks)
    assert any(r.startswith("prune & CFES & 64 & none & 40.00 & 40.00 & 50.58") for r in rows), rows
    assert any(
        r.startswith("prune & CFES (calibration=dcdm) & 64 & none & 45.00 & 45.00 & 52.56") for r in rows
    )
    assert any(r.startswith("merge & HC-SMoE (calibration=c4) & 64 & none &  &  & 39.42") for r in rows), rows
    assert C2F_SWEEP in tex
