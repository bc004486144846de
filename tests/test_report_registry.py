"""The report is driven by a registry (analysis/report.py ARTEFACTS): an entry registered there is rendered,
written and listed in index.md without touching write_report; entries whose data is missing are skipped;
the registry's names and file stems are unique."""

from __future__ import annotations

import pytest
from test_report import OWN, store  # noqa: F401  (the report tests' database fixture)

from analysis import report as R
from analysis.latex import Table
from analysis.load import load_frames


@pytest.fixture(scope="module")
def frames(store):  # noqa: F811
    return load_frames(store.engine, [OWN])


def _toy_table(p: R.Part, stem: str) -> Table:
    """Configurations per kind: a table no built-in entry writes."""
    n = p.sweep.everything.groupby("kind").size()
    return Table(
        stem=stem,
        caption=f"Configurations per kind, {p.key}",
        colspec="lr",
        head=[["Kind", "N"]],
        rows=[[k, str(int(v))] for k, v in n.items()],
        index_caption="Toy: configurations per kind",
    )


def test_a_registered_table_is_written_and_indexed(frames, tmp_path, monkeypatch):
    plain = R.write_report(frames, OWN, tmp_path / "plain")
    toy = R.Artefact("toy", "sweep", "table", "toy_counts", _toy_table)
    never = R.Artefact("toy_never", "sweep", "table", "toy_never", _toy_table, needs=lambda p: False)
    per_model = R.Artefact(
        "toy_model",
        "model",
        "table",
        "toy_model{slug}",
        _toy_table,
        needs=R.has_selection,
        caption=lambda p: f"Toy per model: {p.key}",
    )
    monkeypatch.setattr(R, "ARTEFACTS", [*R.ARTEFACTS, toy, never, per_model])
    out = tmp_path / "toy"
    paths = R.write_report(frames, OWN, out)
    rel = [p.relative_to(out).as_posix() for p in paths]
    # the new entries come after the built-in artefacts, before facts.json and index.md
    assert rel == [
        *[p.relative_to(tmp_path / "plain").as_posix() for p in plain[:-2]],
        "tables/toy_counts.tex",
        "tables/toy_model.tex",
        "facts.json",
        "index.md",
    ]
    tex = (out / "tables" / "toy_counts.tex").read_text()
    assert r"\caption{Configurations per kind, tiny-synth}" in tex and r"moe2dense & 50 \\" in tex
    assert not (out / "tables" / "toy_never.tex").exists()
    index = (out / "index.md").read_text()
    assert "- [`tables/toy_counts.tex`](tables/toy_counts.tex) — Toy: configurations per kind" in index
    assert "- [`tables/toy_model.tex`](tables/toy_model.tex) — Toy per model: tiny-moe" in index
    assert "toy_never" not in index
    # everything else is as without the new entries
    for p in plain[:-2]:
        assert p.read_bytes() == (out / p.relative_to(tmp_path / "plain")).read_bytes(), p.name
    plain_index = (tmp_path / "plain" / "index.md").read_text()
    assert (
        index.replace(
            "- [`tables/toy_counts.tex`](tables/toy_counts.tex) — Toy: configurations per kind\n"
            "- [`tables/toy_model.tex`](tables/toy_model.tex) — Toy per model: tiny-moe\n",
            "",
        )
        == plain_index
    )


def test_the_registry_plans_the_own_sweep_in_order(frames):
    s = R.load_sweep(frames, OWN)
    assert [(a.name, p.key) for a, p in R.planned(s)] == [
        *[(n, "tiny-moe") for n in ("ppl_grid", "selection", "distilled", "ablation", "marginal")],
        ("baselines", OWN),
        *[
            (n, "tiny-moe")
            for n in ("marginal_accuracy", "selection_overlap", "effective_rank", "val_ce_curves")
        ],
        ("accuracy_by_scoring_k", OWN),
    ]


def test_registry_entries_are_unique_and_well_formed():
    names = [a.name for a in R.ARTEFACTS]
    assert len(names) == len(set(names))
    stems = [(a.kind, a.stem) for a in R.ARTEFACTS]
    assert len(stems) == len(set(stems))
    assert all(a.scope in R.SCOPES for a in R.ARTEFACTS)
    with pytest.raises(ValueError, match="scope 'per_layer'"):
        R.Artefact("bad", "per_layer", "table", "bad", _toy_table)


def test_a_report_with_no_table_or_figure_still_writes_its_index(store, tmp_path):  # noqa: F811
    """A reference sweep with nothing to tabulate alone (paper:architectures, no --compare): facts.json and
    index.md into a folder that did not exist."""
    name = "paper:architectures"
    out = tmp_path / "new" / "dir"
    paths = R.write_report(load_frames(store.engine, [name]), name, out)
    assert [p.relative_to(out).as_posix() for p in paths] == ["facts.json", "index.md"]
    assert (out / "index.md").read_text().startswith(f"# Report: {name}\n")
