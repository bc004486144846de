"""The axes and the default selection rule are declared once (db/axes.py): the store's fields, the
dashboard's columns, filters and labels, analysis's design axes and the orchestrator's grid all derive
from that table, so an axis added to it shows up in every reader, and no reader restates the list."""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd
import pytest

import analysis.derived
import analysis.moe_tables
import analysis.reference
import dashboard.data
import dashboard.reports
import db.axes
import db.store
import orchestrator.axes
from db.axes import Axis, default_rule

ROOT = Path(__file__).resolve().parent.parent
KEY_ORDER = ("output", "scoring", "merging", "editing", "grouping", "dp_scaling", "K", "recovery")
LISTED = ("scoring", "grouping", "dp_scaling", "K", "output", "recovery", "merging", "editing")


@pytest.fixture
def added(monkeypatch):
    """The table with one more axis: a dense student's, with a label, listed last."""
    new = Axis(
        "sharing",
        str,
        None,
        "which experts share their down projection",
        ("none",),
        outputs=("dense",),
        choices=("none", "all"),
        order=9,
        label="expert sharing",
    )
    monkeypatch.setattr(db.axes, "AXES", {**db.axes.AXES, "sharing": new})
    return new


def test_an_axis_added_to_the_table_shows_up_in_every_reader(added):
    # the database: the fields a writer sets
    assert "sharing" in db.axes.config_fields()
    # the dashboard: results columns (after the other axes, before top_k), filters, the results page's and
    # the configuration page's columns, titled by its label
    cols = dashboard.data.result_columns()
    assert cols[cols.index("editing") + 1] == "sharing" and cols[cols.index("sharing") + 1] == "top_k"
    assert "sharing" in dashboard.data.filter_axes() and "sharing" in dashboard.data.table_axes()
    page = dashboard.data.config_page_fields()
    assert page[page.index("editing") + 1] == "sharing"
    assert dashboard.data.labels()["sharing"] == "expert sharing"
    # analysis: a dense student's design axes, and the key order
    assert db.axes.design_axes("dense") == ("scoring", "grouping", "dp_scaling", "K", "sharing")
    assert "sharing" not in db.axes.design_axes("moe")
    assert db.axes.names() == (*KEY_ORDER, "sharing") and db.axes.listed() == (*LISTED, "sharing")
    # the orchestrator: a grid axis with its allowed values
    grid = orchestrator.axes.grid_axes()
    assert list(grid) == [*KEY_ORDER, "sharing"]
    assert grid["sharing"].allowed() == ["none", "all"] and grid["sharing"].applies("dense")
    assert not grid["sharing"].applies("moe")


def test_every_reader_lists_what_the_table_derives():
    """Each reader's list is the derivation's (so none is typed by hand), and today's lists are unchanged."""
    assert db.axes.names() == KEY_ORDER and db.axes.listed() == LISTED
    assert db.store.CONFIG_FIELDS == db.axes.config_fields()
    assert set(db.store.CONFIG_FIELDS) >= set(KEY_ORDER) | {"model", "kind", "selected_for_distill"}
    d = dashboard.data
    assert d.RESULT_COLUMNS == d.result_columns() and d.FILTER_AXES == d.filter_axes()
    assert d.TABLE_AXES == d.table_axes() and d.CONFIG_PAGE_FIELDS == d.config_page_fields()
    assert d.LABELS == d.labels() and "K" in d.INT_AXES
    assert d.FILTER_AXES == ("model", "kind", "baseline", *LISTED, "variant", "distill_loss", "teacher_top_k")
    assert dashboard.reports.MATCH_AXES == (
        "kind",
        "baseline",
        "scoring",
        "grouping",
        "dp_scaling",
        "K",
        "output",
        "variant",
    )
    assert (
        analysis.derived.DESIGN_AXES
        == db.axes.design_axes("dense")
        == ("scoring", "grouping", "dp_scaling", "K")
    )
    assert analysis.moe_tables.METHOD_AXIS == {"moe": "scoring", "merged": "merging", "edited": "editing"}
    assert list(orchestrator.axes.AXES) == list(KEY_ORDER)
    for name, axis in orchestrator.axes.AXES.items():
        assert isinstance(axis, db.axes.Axis) and axis == orchestrator.axes.grid_axes()[name]
        assert (axis.registry, axis.outputs, axis.named) == (
            db.axes.AXES[name].registry,
            db.axes.AXES[name].outputs,
            db.axes.AXES[name].named,
        )
    from orchestrator.stages.convert import METHOD_AXES

    assert METHOD_AXES == db.axes.method_axes() == ("scoring", "merging", "editing")


def test_the_default_selection_rule_is_one_rule():
    from orchestrator.spec import Select

    rule = default_rule()
    assert rule == {"best_by": "ppl_pre", "per": ["scoring", "grouping"], "over": ["K", "dp_scaling"]}
    assert Select().model_dump() == rule  # a sweep file without `select:`
    assert analysis.derived.sweep_rule(pd.DataFrame({"select_json": [None]})) == (
        rule,
        "default",
    )
    assert analysis.reference.RULE_PAIR == rule
    rule["per"].append("K")  # each reader gets its own copy
    assert default_rule()["per"] == ["scoring", "grouping"]


# the readers that once restated the axes or the default rule by hand
READERS = [
    *sorted((ROOT / "dashboard").rglob("*.py")),
    *sorted((ROOT / "dashboard" / "templates").glob("*.html")),
    *sorted((ROOT / "analysis").glob("*.py")),
    ROOT / "db" / "store.py",
    ROOT / "db" / "select_rule.py",
    ROOT / "orchestrator" / "spec.py",
    ROOT / "orchestrator" / "axes.py",
]
Q = r"""['"]"""
RESTATED = {
    "the design axes": re.compile(rf"{Q}scoring{Q},\s*{Q}grouping{Q},\s*{Q}dp_scaling{Q},\s*{Q}K{Q}"),
    "the default rule": re.compile(rf"{Q}per{Q}:\s*\[{Q}scoring{Q},\s*{Q}grouping{Q}\]"),
    "the default rule's per": re.compile(rf"lambda:\s*\[{Q}scoring{Q}"),
}


def restated(text: str) -> list[str]:
    return [what for what, pattern in RESTATED.items() if pattern.search(text)]


def test_no_reader_restates_the_axes_or_the_default_rule():
    assert len(READERS) > 15
    found = {p.relative_to(ROOT).as_posix(): w for p in READERS if (w := restated(p.read_text()))}
    assert found == {}


def test_the_restatement_check_sees_one():
    assert restated('for a in ("scoring", "grouping", "dp_scaling", "K"):') == ["the design axes"]
    assert restated("{'best_by': 'ppl_pre', 'per': ['scoring', 'grouping'], 'over': []}") == [
        "the default rule"
    ]
    assert restated("per: list[str] = Field(default_factory=lambda: ['scoring', 'grouping'])") == [
        "the default rule's per"
    ]
    assert restated("RULE_BASE = {'per': ['scoring', 'K']}") == []
