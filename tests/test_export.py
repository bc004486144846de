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
