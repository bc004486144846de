"""The §4.1 selection rule shared by the orchestrator and analysis."""

from db.select_rule import select_best_rows


def _row(s, g, K, scaling, ppl, kind="finite"):
    return {"scoring": s, "grouping": g, "K": K, "dp_scaling": scaling, "ppl_pre": ppl, "ppl_pre_kind": kind}


def test_lowest_finite_per_pair_with_deterministic_ties():
    rows = [
        _row("SF", "RR", 8, "uniform", 30.0),
        _row("SF", "RR", 16, "uniform", 20.0),
        _row("SF", "RR", 32, "uniform", None, "inf"),
        _row("SF", "RR", 64, "proportional", float("nan")),
        _row("CP", "RR", 16, "uniform", 10.0),
        _row("CP", "RR", 8, "proportional", 10.0),
        _row("ACP", "RR", 8, "uniform", None, "nan"),
    ]
    picked = select_best_rows(rows, ["scoring", "grouping"], ["K", "dp_scaling"])
    got = {(r["scoring"], r["K"], r["dp_scaling"]) for r in picked}
    # SF: 20 beats 30, inf/nan never win; CP: a tie goes to the smaller str() of (K, scaling) -> ("16", ...)
    # ACP: nothing finite -> no pick at all
    assert got == {("SF", 16, "uniform"), ("CP", 16, "uniform")}
