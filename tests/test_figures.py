"""The report's bar charts: bars start at 0 and the axis holds every error bar; bars of one panel that are
different values of an axis never look alike; Figure 5's lines of one scoring differ by grouping."""

from __future__ import annotations

import pandas as pd

from analysis.figures import curves_figure, marginal_figure, style


def _marginal() -> dict:
    mm = {
        "scoring": {"SF": {"mean": 61.0, "se": 1.5}, "CP": {"mean": 62.5, "se": 4.0}},
        "grouping": {g: {"mean": 60.0 + i, "se": 0.8} for i, g in enumerate(("RR", "WC", "RC", "OC"))},
    }
    return {"marginal_means": mm, "n_distilled": 8}


def test_bars_start_at_zero_and_hold_their_error_bars():
    with style():
        fig = marginal_figure(_marginal(), "ours", None, "")
        for ax in fig.axes:
            lo, hi = ax.get_ylim()
            tops = [b.get_height() for b in ax.patches]
            assert lo == 0.0, lo  # not cut at 23% as before
            assert hi >= 62.5 + 1.959964 * 4.0  # CP's error bar inside the axis
            assert hi >= max(tops)


def test_bars_of_different_groupings_look_different():
    with style():
        fig = marginal_figure(_marginal(), "ours", None, "")
        grouping = next(ax for ax in fig.axes if "grouping" in ax.get_title())
        looks = [(b.get_facecolor(), b.get_hatch()) for b in grouping.patches]
        assert len(looks) == 4 and len(set(looks)) == 4
        with_paper = marginal_figure(_marginal(), "ours", _marginal(), "paper")
        grouping = next(ax for ax in with_paper.axes if "grouping" in ax.get_title())
        ours = [b.get_hatch() for b in grouping.patches[:4]]
        assert len(set(ours)) == 4 and "///" not in ours  # the paper's bars are the /// ones


def test_curves_of_one_scoring_differ_by_grouping():
    results = pd.DataFrame(
        [
            {
                "config_id": i,
                "kind": "moe2dense",
                "scoring": "SF",
                "grouping": g,
                "dp_scaling": "uniform",
                "K": 4,
                "distill_loss": None,
                "teacher_top_k": None,
                "variant": None,
                "config_key": f"SF|{g}|uniform|K=4",
                "baseline": None,
            }
            for i, g in ((1, "RR"), (2, "WC"))
        ]
    )
    curves = pd.DataFrame(
        [
            {"config_id": c, "who": "student", "step": s, "value": 5.0 - s * 0.1 * c, "tokens": None}
            for c in (1, 2)
            for s in range(3)
        ]
    )
    with style():
        fig = curves_figure(curves, results, "ours")
    lines = [ln for ln in fig.axes[0].get_lines() if ln.get_label().startswith("SF")]
    assert len(lines) == 2
    assert lines[0].get_color() == lines[1].get_color()  # one scoring, one colour
    assert lines[0].get_linestyle() != lines[1].get_linestyle()  # told apart by grouping
