"""The `output` and `recovery` facts (db/axes.py: OUTPUTS, RECOVERIES) are the one table every reader
derives from, and the workers agree with it; smaller MoEs are stored as kind `moe2moe` (migration 0008)."""

from __future__ import annotations

from sqlalchemy import text

import db.axes as ax
from orchestrator.stage import stages
from tests.test_migrations import alembic_config, upgrade_to
from workers.core.registry import registry_names


def test_the_workers_write_the_outputs_the_table_declares_with_its_settings():
    from workers.models.outputs import OUTPUTS

    assert registry_names("workers.models.outputs", "OUTPUTS") == list(ax.OUTPUTS)
    assert {name: o.settings for name, o in OUTPUTS.items()} == {
        o.name: o.settings for o in ax.OUTPUTS.values()
    }


def test_which_axes_apply_to_which_output_derive_from_the_table():
    assert ax.MOE_OUTPUTS == ("moe", "merged", "edited") and ax.DENSE_OUTPUTS == ("dense",)
    assert {o: ax.design_axes(o) for o in ax.OUTPUTS} == {
        "dense": ("scoring", "grouping", "dp_scaling", "K"),
        "moe": ("scoring", "K", "recovery"),
        "merged": ("merging", "K", "recovery"),
        "edited": ("editing", "K", "recovery"),
    }
    assert {o: ax.method_axis(o) for o in ax.OUTPUTS} == {
        "dense": "scoring",
        "moe": "scoring",
        "merged": "merging",
        "edited": "editing",
    }
    assert ax.method_axis("nonesuch") is None
    assert {o: ax.kind_of(o) for o in ax.OUTPUTS} == {
        "dense": "moe2dense",
        "moe": "moe2moe",
        "merged": "moe2moe",
        "edited": "moe2moe",
    }
    assert ax.kind_of(None) == "moe2dense" and ax.CONVERTED_KINDS == ("moe2dense", "moe2moe")


def test_each_recovery_names_a_stage_that_exists():
    names = {s.name for s in stages()}
    assert ax.AXES["recovery"].choices == tuple(ax.RECOVERIES)
    for r in ax.RECOVERIES.values():
        assert r.stage is None or r.stage in names, r
    assert ax.recovered_by({"recovery": "router_kd"}) == "router_kd"
    assert ax.recovered_by({"recovery": "full_kd"}) == "distill"
    assert ax.recovered_by({"recovery": "none"}) == "ppl_pre"  # the converted student itself
    assert ax.recovered_by({"recovery": None}) is None  # a dense student


def test_a_grid_stores_smaller_moes_as_moe2moe(tmp_path):
    from orchestrator.spec import load_spec
    from orchestrator.stages.convert import grid_configs

    f = tmp_path / "g.yaml"
    f.write_text(
        "name: g\nteacher: {source: tiny, label: t, tiny: {}}\n"
        "calibration: {data: {source: tiny, split: train}, n_samples: 4, seq_len: 8}\n"
        "grid:\n"
        "  - {scoring: [SF], K: [4]}\n"
        "  - {output: [moe], scoring: [REAP], K: [4]}\n"
        "  - {output: [merged], merging: [HC-SMoE], K: [4]}\n"
    )
    spec, _, _ = load_spec(str(f))
    kinds = {c["config_key"]: c["kind"] for c in grid_configs(spec, "m", 2)}
    assert kinds == {
        "SF|RR|uniform|K=4": "moe2dense",
        "moe|REAP|K=4|recovery=none": "moe2moe",
        "merged|HC-SMoE|K=4|recovery=none": "moe2moe",
    }


def test_migration_0008_gives_smaller_moes_their_kind_and_back(tmp_path):
    from alembic import command

    from db.store import Store

    store = Store(f"sqlite:///{tmp_path}/k.db", migrate=False)
    upgrade_to(store, "0007")
    with store.engine.begin() as c:
        c.execute(text("INSERT INTO sweeps (id, name, kind, source) VALUES (1, 's', 'own', 'moesweep')"))
        for i, (key, kind, output) in enumerate(
            [
                ("SF|K=4", "moe2dense", None),
                ("moe|REAP|K=4", "moe2dense", "moe"),
                ("d", "moe2dense", "dense"),
                ("merged|X|K=4", "moe2dense", "merged"),
                ("base", "baseline", None),
                ("t", "teacher", None),
            ],
            start=1,
        ):
            c.execute(
                text(
                    "INSERT INTO configurations (id, sweep_id, config_key, model, kind, output, "
                    "selected_for_distill) VALUES (:i, 1, :k, 'm', :kind, :o, 0)"
                ),
                {"i": i, "k": key, "kind": kind, "o": output},
            )
    upgrade_to(store, "0008")

    def kinds() -> list[str]:
        return [k for (k,) in store.query("SELECT kind FROM configurations ORDER BY id")[1]]

    assert kinds() == ["moe2dense", "moe2moe", "moe2dense", "moe2moe", "baseline", "teacher"]
    cfg = alembic_config(store.url)
    with store.engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, "0007")
    assert kinds() == ["moe2dense", "moe2dense", "moe2dense", "moe2dense", "baseline", "teacher"]
