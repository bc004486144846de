"""The paper's published numbers as reference sweeps: same axes and metric names as our own runs,
accuracies as fractions, idempotent `moesweep import-paper`, one query over both."""

from __future__ import annotations

import math

import pytest
from typer.testing import CliRunner

from analysis.reference import MAIN, SOURCE, TASKS, read_table, reference_sweeps
from db.store import CONFIG_FIELDS, METRIC_FIELDS, Store
from orchestrator.cli import app

SWEEPS = reference_sweeps()
BY_NAME = {s["name"]: s for s in SWEEPS}


def test_every_shipped_table_is_imported_with_known_fields():
    assert SWEEPS[0]["name"] == MAIN  # the CLI's --compare relies on the first being the main study
    tables = {t for s in SWEEPS for c in s["configs"] for t in c["table"].split("+")}
    assert tables == {
        "table10_11",
        "table12",
        "table3",
        "table4",
        "table5",
        "table6",
        "table7",
        "table8",
        "table13",
        "table16",
        "table17",
        "table2_18",
        "router_kd_table2",
        "router_kd_table3",
        "reap_table2",
        "c2f_table2",
        "c2f_table3",
        "dot_table3",
        "dot_table8",
    }
    for s in SWEEPS:
        assert s["source"].startswith("paper:") and s["description"]
        keys = [c["config_key"] for c in s["configs"]]
        assert len(keys) == len(set(keys)), s["name"]
        for c in s["configs"]:
            assert set(c) <= set(CONFIG_FIELDS) | {"config_key", "table", "metrics", "variant_of_key"}, c[
                "config_key"
            ]
            assert c["kind"] in ("moe2dense", "moe2moe", "baseline", "teacher", "dense2moe")
            for m in c["metrics"]:
                assert set(m) <= set(METRIC_FIELDS) | {"extra"}, m
                if m["name"] in ("acc", "acc_norm"):  # stored as fractions (the CSVs are percentages)
                    assert 0.0 <= m["value"] <= 1.0 and m["headline"] == 1
                    assert m["task"] in TASKS or s["source"] != SOURCE, (s["name"], m["task"])


def test_main_sweep_matches_our_paper_sweep_axes():
    from orchestrator.configs import build_configs, stated_shape, teacher_label
    from orchestrator.spec import load_spec

    spec, _, _ = load_spec("paper-qwen3-30b-a3b")
    ours = {c["config_key"]: c for c in build_configs(spec, stated_shape(spec)) if c["kind"] == "moe2dense"}
    ref = {c["config_key"]: c for c in BY_NAME[MAIN]["configs"] if c["table"].startswith("table10_11")}
    assert set(ours) == set(ref) and len(ref) == 350
    for key, c in ours.items():
        for f in ("model", "teacher_variant", "scoring", "grouping", "dp_scaling", "K", "top_k"):
            assert ref[key][f] == c[f], (key, f)
    for name, sweep in (
        ("paper-deepseek-v2-lite", "paper:deepseek-v2-lite"),
        ("paper-gpt-oss-20b", "paper:gpt-oss-20b"),
    ):
        s, _, _ = load_spec(name)
        models = {c["model"] for c in BY_NAME[sweep]["configs"]}
        assert models == {teacher_label(s)}
        assert {c["teacher_variant"] for c in BY_NAME[sweep]["configs"]} == {s.teacher.variant}
        assert {c["top_k"] for c in BY_NAME[sweep]["configs"]} == {s.teacher.top_k}


def test_grid_and_distilled_values():
    cfg = {c["config_key"]: c for c in BY_NAME[MAIN]["configs"]}
    sel = [c for c in cfg.values() if c["table"] == "table10_11+table12"]
    assert len(sel) == 35 and all(
        c["selected_for_distill"] == 1 and c["distill_tokens"] == "0.3B" for c in sel
    )
    best = cfg["DO-ACP|RR|uniform|K=8"]
    m = {(x["name"], x["stage"], x.get("task", "")): x["value"] for x in best["metrics"]}
    assert m[("ppl", "pre", "")] == 5134 and m[("ppl", "post", "")] == 19.2
    assert (
        m[("acc", "post", "winogrande")] == pytest.approx(0.5699)
        and m[("avg_published", "post", "")] == 0.4341
    )
    wc = cfg["SF|WC|uniform|K=128"]["metrics"][0]  # a '–' of Table 10: explicit non-finite
    assert wc["value"] is None and wc["value_kind"] == "nan"
    assert cfg["DO-ACP|RR|uniform|K=8|teacher_top_k=16"]["teacher_top_k"] == 16
    assert cfg["DO-ACP|RR|uniform|K=8|loss=reverse_kl"]["distill_loss"] == "reverse_kl"
    d2d = [c for c in cfg.values() if (c.get("baseline") or "").startswith("d2d:")]
    assert len(d2d) == 5 and [c["selected_for_distill"] for c in d2d].count(1) == 1


def test_table3_students_are_table12_rows():
    t12 = {(r["scoring"], r["grouping"]): r for r in read_table("table12_distilled_35")}
    pairs = {
        "DO-ACP, K=8 (best)": ("DO-ACP", "RR"),
        "SF x AB (MC-SMoE metrics)": ("SF", "AB"),
        "SF x OC (HC-SMoE metrics)": ("SF", "OC"),
    }
    rows = {r["configuration"]: r for r in read_table("table3_baselines")}
    for label, pair in pairs.items():
        for t in (*TASKS, "avg"):
            assert float(rows[label][t]) == pytest.approx(float(t12[pair][t]), abs=0.05 + 1e-9), (label, t)


def test_read_table_rejects_unknown_names():
    with pytest.raises(ValueError, match="table99"):
        read_table("table99")


def _counts(store: Store) -> tuple:
    return tuple(
        store.query(f"SELECT COUNT(*) FROM {t}")[1][0][0] for t in ("sweeps", "configurations", "metrics")
    )


def test_import_paper_is_idempotent_and_one_query_covers_both(tmp_path):
    url = f"sqlite:///{tmp_path}/m.db"
    runner = CliRunner()
    r = runner.invoke(app, ["import-paper", "--db", url])
    assert r.exit_code == 0, r.output
    assert f"{MAIN}: 368 configurations" in r.output
    store = Store(url)
    first = _counts(store)
    assert runner.invoke(app, ["import-paper", "--db", url]).exit_code == 0
    assert _counts(store) == first
    # an own sweep with the same axes, written the way the stages write it
    sid = store.upsert_sweep("paper-qwen3-30b-a3b", spec_yaml="name: paper-qwen3-30b-a3b")
    cid = store.upsert_configs(
        sid,
        [
            {
                "config_key": "DO-ACP|RR|uniform|K=8",
                "model": "Qwen3-30B-A3B",
                "kind": "moe2dense",
                "teacher_variant": "instruct",
                "scoring": "DO-ACP",
                "grouping": "RR",
                "dp_scaling": "uniform",
                "K": 8,
                "top_k": 8,
            }
        ],
    )
    store.register_jobs(sid, [{"key": "ppl1", "stage": "ppl_pre", "params": {}}])
    assert store.claim("ppl1", "t")
    store.finish(
        "ppl1", "t", {"metrics": [{"name": "ppl", "stage": "pre", "value": 4000.0, "n_tokens": 10}]}, 0.1
    )
    store.link([(cid["DO-ACP|RR|uniform|K=8"], "ppl_pre", store.jobs(["ppl1"])["ppl1"]["id"])])
    _, rows = store.query(
        "SELECT sweep, sweep_kind, ppl_pre, avg_acc FROM results WHERE model = 'Qwen3-30B-A3B' "
        "AND scoring = 'DO-ACP' AND grouping = 'RR' AND dp_scaling = 'uniform' AND K = 8 "
        "AND distill_loss IS NULL AND teacher_top_k IS NULL AND ppl_pre IS NOT NULL ORDER BY sweep"
    )
    assert [(s, k, p) for s, k, p, _ in rows] == [
        ("paper-qwen3-30b-a3b", "own", 4000.0),
        (MAIN, "reference", 5134.0),
    ]
    assert rows[1][3] == pytest.approx((56.99 + 41.13 + 57.37 + 29.86 + 31.7) / 500)
    _, nan = store.query(
        "SELECT COUNT(*) FROM results WHERE sweep = :s AND ppl_pre_kind = 'nan'", {"s": MAIN}
    )
    assert nan == [(6,)]
    _, acc = store.query(
        "SELECT task, metric, value, num_fewshot FROM task_scores WHERE sweep = :s AND "
        "config_id = (SELECT config_id FROM results WHERE sweep = :s AND scoring = 'DO-ACP' AND "
        "grouping = 'RR' AND K = 8 AND dp_scaling = 'uniform' AND teacher_top_k IS NULL AND "
        "distill_loss IS NULL) ORDER BY task",
        {"s": MAIN},
    )
    assert [(t, n) for t, _, _, n in acc] == [
        ("arc_challenge", 25),
        ("arc_easy", 25),
        ("hellaswag", 10),
        ("mmlu", 5),
        ("winogrande", 5),
    ]
    assert all(0 < v < 1 and not math.isnan(v) for _, _, v, _ in acc)


def test_cli_report_on_the_paper_data(tmp_path):
    url = f"sqlite:///{tmp_path}/m.db"
    runner = CliRunner()
    assert runner.invoke(app, ["import-paper", "--db", url]).exit_code == 0
    out = tmp_path / "rep"
    r = runner.invoke(
        app, ["report", "paper:deepseek-v2-lite", "--db", url, "--out", str(out), "--compare", "paper"]
    )
    assert r.exit_code == 0, r.output
    index = (out / "index.md").read_text()
    assert "tables/distilled_by_k.tex" in index and "figures/accuracy_by_scoring_k.png" in index
    tex = (out / "tables" / "distilled_by_k.tex").read_text()
    assert r"\textbf{42.39}" in tex and "Teacher (DeepSeek-V2-Lite)" in tex and "71.09" in tex


def test_cli_report_to_a_file_or_an_unwritable_place_is_one_line(tmp_path):
    url = f"sqlite:///{tmp_path}/m.db"
    runner = CliRunner()
    assert runner.invoke(app, ["import-paper", "--db", url]).exit_code == 0
    afile = tmp_path / "taken.txt"
    afile.write_text("mine\n")
    blocked = afile / "rep"  # under a file: no folder can be made there
    for out, line in (
        (
            afile,
            f"error: --out {afile}: exists and is not a folder; the report is a folder of tables and figures",
        ),
        (blocked, f"error: report paper:deepseek-v2-lite: cannot write {blocked}: Not a directory"),
    ):
        r = runner.invoke(app, ["report", "paper:deepseek-v2-lite", "--db", url, "--out", str(out)])
        assert r.exit_code == 2 and r.stderr == line + "\n", r.output
    assert afile.read_text() == "mine\n"


def test_reference_identities_are_stored(tmp_path):
    import json

    store = Store(f"sqlite:///{tmp_path}/m.db")
    store.import_reference(SWEEPS)
    _, rows = store.query(
        "SELECT r.variant, m.config_key FROM results r JOIN configurations m ON m.id = r.variant_of "
        "WHERE r.sweep = :s ORDER BY r.config_id",
        {"s": MAIN},
    )
    stem = "DO-ACP|RR|uniform|K=8"
    assert rows == [
        (f"teacher_top_k={r['k_prime']}", stem) for r in read_table("table4_expanded_routing")
    ] + [("loss=forward_kl", stem), ("loss=intermediate", stem), ("loss=reverse_kl", stem)]
    _, n = store.query("SELECT COUNT(*) FROM results WHERE variant IS NOT NULL AND variant_of IS NULL")
    assert n == [(0,)]
    _, info = store.query("SELECT sweep, kind, select_json FROM sweep_info ORDER BY sweep")
    rules = {s: json.loads(r) if r else None for s, k, r in info if k == "reference"}
    pair = {"best_by": "ppl_pre", "per": ["scoring", "grouping"], "over": ["K", "dp_scaling"]}
    assert rules == {
        MAIN: pair,
        "paper:qwen3-30b-a3b-4b": pair,
        "paper:qwen3-30b-a3b-base": {
            "best_by": "ppl_pre",
            "per": ["scoring", "K"],
            "over": ["grouping", "dp_scaling"],
        },
        "paper:deepseek-v2-lite": {"best_by": "ppl_pre", "per": ["scoring", "K"], "over": ["dp_scaling"]},
        "paper:gpt-oss-20b": {"best_by": "ppl_pre", "per": ["scoring", "K"], "over": ["dp_scaling"]},
        "paper:architectures": None,
        "paper:router-kd-qwen3-30b-a3b": None,
        "paper:reap-qwen3-30b-a3b": None,
        "paper:reap-glm-4.5-air": None,
        "paper:c2f-qwen3-30b-a3b-thinking": None,
        "paper:dot-moe": None,
    }


def test_import_reference_is_all_or_nothing(tmp_path):
    store = Store(f"sqlite:///{tmp_path}/m.db")
    store.import_reference(SWEEPS)
    before = _counts(store), store.query("SELECT name, description FROM sweeps ORDER BY name")[1]
    changed = [
        {**SWEEPS[0], "description": "changed", "configs": SWEEPS[0]["configs"][:3]},
        {
            "name": "paper:broken",
            "source": "paper:x",
            "configs": [
                {
                    "config_key": "a",
                    "model": "M",
                    "kind": "moe2dense",
                    "variant_of_key": "nope",
                    "metrics": [],
                }
            ],
        },
    ]
    with pytest.raises(ValueError, match="variant_of_key 'nope'"):
        store.import_reference(changed)
    assert (_counts(store), store.query("SELECT name, description FROM sweeps ORDER BY name")[1]) == before


def test_report_reads_only_and_asks_for_import_paper(tmp_path):
    url = f"sqlite:///{tmp_path}/m.db"
    store = Store(url)
    sid = store.upsert_sweep("own")
    store.upsert_configs(
        sid, [{"config_key": "c", "model": "M", "kind": "moe2dense", "scoring": "SF", "K": 8}]
    )
    runner = CliRunner()
    r = runner.invoke(
        app, ["report", "own", "--db", url, "--out", str(tmp_path / "rep"), "--compare", "paper"]
    )
    assert r.exit_code == 2 and "run 'moesweep import-paper' first" in " ".join(r.output.split()), r.output
    assert _counts(store) == (1, 1, 0) and not (tmp_path / "rep").exists()  # nothing written
    assert runner.invoke(app, ["import-paper", "--db", url]).exit_code == 0
    with store.tx() as c:  # as an import by an older moesweep left it: no stored rule
        c.exec_driver_sql("UPDATE sweeps SET select_json = NULL WHERE name = ?", (MAIN,))
    r = runner.invoke(app, ["report", MAIN, "--db", url, "--out", str(tmp_path / "rep")])
    assert r.exit_code == 2 and "older moesweep" in r.output and MAIN in r.output, r.output
