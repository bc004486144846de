"""`moesweep export`'s card names the module that registers a checkpoint's model class (the end-to-end export
of a distilled student is in tests/test_e2e.py)."""

from __future__ import annotations

import json

import pytest

from orchestrator.export import ExportError, model_card, registering_module


def _folder(tmp_path, model_type: str):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    return tmp_path


def test_the_module_to_import_before_loading(tmp_path):
    from workers.baselines.dense_to_moe_baselines import MODEL_TYPE as D2M
    from workers.models.dot_moe_hf import MODEL_TYPE as DOT

    assert registering_module(_folder(tmp_path, "qwen3")) is None  # transformers' own
    assert registering_module(_folder(tmp_path, DOT)) == "workers.models.dot_moe_hf"
    assert registering_module(_folder(tmp_path, D2M)) == "workers.baselines.dense_to_moe_baselines"
    with pytest.raises(ExportError, match="'nonesuch' is neither transformers'"):
        registering_module(_folder(tmp_path, "nonesuch"))


def test_the_card_says_what_to_import():
    facts = {
        "config_key": "dense2moe|dot|dense_teacher|E=8|k=2",
        "sweep": "s",
        "model": "m",
        "kind": "dense2moe",
        "output_label": None,
        "axes": {"K": 8},
        "scores": {"ppl_pre": 3.5},
        "tasks": [],
        "provenance": {
            "stage": "dot_moe",
            "job_key": "j",
            "code_version": "c",
            "checkpoint_hash": "h",
            "sweep_spec_sha256": "x",
            "exported_by": "moesweep 0",
        },
        "registers": "workers.models.dot_moe_hf",
    }
    card = model_card(facts)
    assert "import workers.models.dot_moe_hf" in card and "| ppl_pre | 3.5 |" in card
    assert "import workers" not in model_card(facts | {"registers": None})


def test_where_a_model_folder_cannot_be_written_is_said_before_anything_runs(tmp_path):
    from orchestrator.export import out_problem

    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("x")
    (tmp_path / "empty").mkdir()
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert out_problem(tmp_path / "new" / "deeper", force=False) is None
    assert out_problem(tmp_path / "empty", force=False) is None
    assert (
        out_problem(full, force=False)
        == f"{full} exists and is not empty: choose another folder, or --force to replace it"
    )
    assert (
        out_problem(afile, force=False)
        == f"{afile} exists and is a file: choose another folder, or --force to replace it"
    )
    assert out_problem(full, force=True) is None and out_problem(afile, force=True) is None
    for under in (afile / "out", afile / "a" / "b"):
        assert out_problem(under, force=True) == f"cannot write {under}: {afile} is a file, not a folder"
