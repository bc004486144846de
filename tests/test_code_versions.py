"""Reports never mix numbers from two code versions silently, read identities instead of guessing them,
and state the selection rule they applied (the stored one, or the paper's default, said so)."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from typer.testing import CliRunner

from analysis import derived as D
from db.store import Store
from orchestrator.cli import app

SWEEP = "cv"


def build(url: str, code: dict[str, str | None], select_json: str | None = None) -> dict[str, int]:
    """A small sweep: one ppl_pre job per configuration key in `code`, whose code_json is the value."""
    s = Store(url)
    sid = s.upsert_sweep(SWEEP, spec_yaml=f"name: {SWEEP}", select_json=select_json)
    cfgs = []
    for i, key in enumerate(code):
        sc, g, K = key.split("|")
        cfgs.append(
            {
                "config_key": key,
                "model": "m",
                "kind": "moe2dense",
                "scoring": sc,
                "grouping": g,
                "dp_scaling": "uniform",
                "K": int(K),
                "top_k": 2,
                "selected_for_distill": int(i == 0),
            }
        )
    ids = s.upsert_configs(sid, cfgs)
    links = []
    for i, (key, cj) in enumerate(code.items()):
        jk = f"job{i}"
        s.register_jobs(sid, [{"key": jk, "stage": "ppl_pre", "params": {"i": i}}])
        assert s.claim(jk, "t")
        s.finish(jk, "t", {"metrics": [{"name": "ppl", "stage": "pre", "value": 10.0 + i}]}, 0.1)
        with s.tx() as c:
            c.exec_driver_sql("UPDATE jobs SET code_json = ? WHERE key = ?", (cj, jk))
        links.append((ids[key], "ppl_pre", s.jobs([jk])[jk]["id"]))
    s.link(links)
    return ids


def report(url: str, out) -> tuple[int, str]:
    r = CliRunner().invoke(app, ["report", SWEEP, "--db", url, "--out", str(out)])
    return r.exit_code, r.output


def test_mixed_code_versions_are_reported(tmp_path):
    url = f"sqlite:///{tmp_path}/m.db"
    old, new = (
        json.dumps({"scoring:SF": "aaa111", "ppl": "p1"}),
        json.dumps({"scoring:SF": "bbb222", "ppl": "p1"}),
    )
    build(url, {"SF|RR|2": old, "SF|WC|2": old, "SF|RR|4": new})
    code, output = report(url, tmp_path / "rep")
    assert code == 0, output
    warning = [ln for ln in output.splitlines() if "warning" in ln]
    assert (
        len(warning) == 1 and "scoring:SF: aaa111 (2 configurations), bbb222 (1 configuration)" in warning[0]
    )
    assert "ppl:" not in warning[0]  # one version of that component throughout
    facts = json.loads((tmp_path / "rep" / "facts.json").read_text())
    assert facts["code_versions"] == {"mixed": {"scoring:SF": {"aaa111": 2, "bbb222": 1}}, "unknown": {}}
    index = (tmp_path / "rep" / "index.md").read_text().splitlines()
    assert index[2].startswith("**Warning:** Numbers from more than one code version — scoring:SF: aaa111")


def test_one_code_version_gives_no_warning_and_states_the_default_rule(tmp_path):
    url = f"sqlite:///{tmp_path}/m.db"
    same = json.dumps({"scoring:SF": "aaa111"})
    build(url, {"SF|RR|2": same, "SF|WC|2": same, "SF|RR|4": same})
    code, output = report(url, tmp_path / "rep")
    assert code == 0 and "warning" not in output, output
    facts = json.loads((tmp_path / "rep" / "facts.json").read_text())
    assert facts["code_versions"] == {"mixed": {}, "unknown": {}}
    index = (tmp_path / "rep" / "index.md").read_text()
    assert "Warning" not in index
    assert (
        "- Selection rule (ours) (the sweep stores no rule: the paper's default): per scoring × grouping"
        in index
    )
    assert facts["facts"]["m"]["selection"]["rule"]["source"] == "default"
    assert "stores no selection rule" in (tmp_path / "rep" / "tables" / "selection.tex").read_text()


def test_stored_rule_is_applied(tmp_path):
    url = f"sqlite:///{tmp_path}/m.db"
    rule = json.dumps({"best_by": "ppl_pre", "per": ["scoring", "K"], "over": ["grouping", "dp_scaling"]})
    build(url, {"SF|RR|2": None, "SF|WC|2": None, "SF|RR|4": None}, select_json=rule)
    code, output = report(url, tmp_path / "rep")
    assert code == 0 and "warning" not in output, output  # nothing recorded at all: nothing to compare
    sel = json.loads((tmp_path / "rep" / "facts.json").read_text())["facts"]["m"]["selection"]
    assert sel["rule"] == {
        "per": ["scoring", "K"],
        "over": ["grouping", "dp_scaling"],
        "by": "ppl_pre (lowest finite)",
        "source": "sweep",
    }
    assert [(p["K"], p["grouping"]) for p in sel["picks"]] == [(2, "RR"), (4, "RR")]


def test_a_broken_stored_rule_is_a_one_line_error(tmp_path):
    url = f"sqlite:///{tmp_path}/m.db"
    build(url, {"SF|RR|2": None}, select_json=json.dumps({"per": "scoring"}))
    code, output = report(url, tmp_path / "rep")
    text = " ".join(output.split())  # the console wraps at its width
    assert (
        code == 2
        and text.startswith("error: select_json")
        and '"per" and "over" (lists of axis names)' in text
    )


def _code(rows):
    return pd.DataFrame(
        rows, columns=["sweep", "config_id", "stage", "job_id", "job_key", "code_version", "code_json"]
    )


def test_code_versions_unknown_only_beside_known():
    a, b = json.dumps({"convert": "c1"}), json.dumps({"convert": "c2"})
    rows = [
        ("s", 1, "convert", 1, "k1", "v", a),
        ("s", 2, "convert", 2, "k2", "v", a),
        ("s", 3, "convert", 3, "k3", None, None),
        ("s", 3, "ppl_pre", 4, "k4", None, None),
    ]
    assert D.code_versions(_code(rows)) == {"mixed": {}, "unknown": {"convert": 1, "ppl_pre": 1}}
    line = D.code_versions_line(D.code_versions(_code(rows)))
    assert line == (
        "Numbers from more than one code version — no recorded code version for convert "
        "(1 configuration), ppl_pre (1 configuration)."
    )
    none = [(s, c, st, j, k, v, None) for s, c, st, j, k, v, _ in rows]
    assert D.code_versions(_code(none)) == {"mixed": {}, "unknown": {}}
    assert D.code_versions_line(D.code_versions(_code(none))) is None
    two = rows[:2] + [("s", 3, "convert", 3, "k3", "w", b)]
    assert D.code_versions(_code(two)) == {"mixed": {"convert": {"c1": 2, "c2": 1}}, "unknown": {}}
    with pytest.raises(ValueError, match="k9.*allowed"):
        D.code_versions(_code([("s", 1, "convert", 9, "k9", "v", "[1, 2]")]))


def test_variants_are_read_from_variant_of_not_from_settings():
    base = {
        "kind": "moe2dense",
        "scoring": "SF",
        "grouping": "RR",
        "dp_scaling": "uniform",
        "K": 4,
        "top_k": 2,
        "avg": 0.5,
        "distill_loss": None,
        "teacher_top_k": None,
        "variant_of": None,
    }
    df = pd.DataFrame(
        [
            {**base, "config_id": 1},
            {**base, "config_id": 2, "teacher_top_k": 4},  # a main configuration with non-default settings
            {
                **base,
                "config_id": 3,
                "variant_of": 1,
            },  # a variant (e.g. steps=400) that changes no axis shown
        ]
    )
    assert list(D.grid_rows(df)["config_id"]) == [1, 2]
    assert list(D.distilled_rows(df)["config_id"]) == [1, 2]
    with pytest.raises(ValueError, match="variant_of"):
        D.grid_rows(df.drop(columns=["variant_of"]))


def test_selection_report_applies_the_rule_it_is_given():
    rows = [(1, "SF", "RR", 2, 5.0, 1), (2, "SF", "RR", 4, 4.0, 0), (3, "SF", "WC", 2, 3.0, 1)]
    df = pd.DataFrame(
        [
            {
                "config_id": i,
                "scoring": s,
                "grouping": g,
                "dp_scaling": "uniform",
                "K": K,
                "top_k": 2,
                "ppl_pre": p,
                "ppl_pre_kind": "finite",
                "selected_for_distill": sel,
                "ppl_pre_published": None,
            }
            for i, s, g, K, p, sel in rows
        ]
    )
    by_k = D.selection_report(df, {"per": ["scoring", "K"], "over": ["grouping", "dp_scaling"]})
    assert by_k["rule"]["source"] == "given" and [p["config_id"] for p in by_k["picks"]] == [3, 2]
    default = D.selection_report(df)  # no select_json column: the paper's rule, said so
    assert default["rule"]["source"] == "default" and [p["config_id"] for p in default["picks"]] == [2, 3]
    assert [d["grouping"] for d in default["disagreements"]] == ["RR"]
