"""The colours a scoring keeps from chart to chart, in the report's figures and the dashboard's plots
(no matplotlib or pandas import at start-up: the dashboard imports matplotlib when it draws a chart)."""

from __future__ import annotations

PALETTE = (
    "#4c72b0",
    "#dd8452",
    "#55a868",
    "#c44e52",
    "#8172b3",
    "#937860",
    "#da8bc3",
    "#8c8c8c",
    "#ccb974",
    "#64b5cd",
)


def scoring_color(s: str) -> str:
    """A scoring's colour: by its place in the paper's order, else a stable one from its name."""
    from analysis.derived import (
        SCORING_ORDER,
    )  # here: derived imports pandas, which the dashboard's start needs not

    i = SCORING_ORDER.index(s) if s in SCORING_ORDER else len(SCORING_ORDER) + sum(map(ord, s))
    return PALETTE[i % len(PALETTE)]
