"""Micro sweeps through `launch` on more families (GLM-4-MoE, PhiMoE, Llama-4 text, ...): a tiny random teacher of the family, built
in-process and saved with a byte-level tokenizer (teacher: {source: hf, model: <dir>}), calibrated on a
small jsonl corpus, converted to a dense student and to a pruned MoE (PhiMoE, which writes no dense student: a
pruned and a merged MoE), and evaluated for perplexity."""

from __future__ import annotations

import json
import random

import pytest
import yaml
from families_cases import make_teacher
from sweep_runs import launch_serial

from db.store import Store
from orchestrator.launch import prepare
from orchestrator.spec import SpecError, load_spec

WORDS = "the a model expert router token layer dense sparse gate scale sum mean group shared weight".split()


def corpus(path, n: int = 200, seed: int = 0) -> None:
    rng = random.Random(seed)
    with open(path, "w") as fh:
        for _ in range(n):
            fh.write(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(60))}) + "\n")


def teacher_dir(tmp_path, family: str):
    from workers.tiny.tokenizer import train_tokenizer

    out = tmp_path / family
    corpus(tmp_path / "corpus.jsonl")
    texts = [json.loads(line)["text"] for line in open(tmp_path / "corpus.jsonl")]
    tok = train_tokenizer(texts, 300, out)
    make_teacher(
        family,
        vocab_size=len(tok),
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    ).save_pretrained(out)
    return out


DENSE_AND_MOE = [
    {"scoring": ["SF"], "grouping": ["RR"], "K": [2]},
    {"output": ["moe"], "scoring": ["REAP"], "K": [4]},
]
MOE_ONLY = [
    {"output": ["moe"], "scoring": ["REAP"], "K": [4]},
    {"output": ["merged"], "merging": ["HC-SMoE"], "K": [4]},
]


def sweep(tmp_path, family: str, grid: list[dict] | None = None) -> str:
    """A micro sweep file of a tiny `family` teacher; grid: its sub-grids (default: a dense and a pruned one)."""
    data = {"source": "jsonl", "path": str(tmp_path / "corpus.jsonl")}
    raw = {
        "name": f"micro-{family.replace('_', '-')}",
        "description": f"micro sweep of a tiny {family}",
        "teacher": {"source": "hf", "model": str(teacher_dir(tmp_path, family))},
        "calibration": {"data": data, "n_samples": 8, "seq_len": 32, "batch_size": 4},
        "grid": DENSE_AND_MOE if grid is None else grid,
        "ppl": {"data": data, "seq_len": 32, "max_windows": 4},
        "execution": {"retries": 0},
    }
    f = tmp_path / "sweep.yaml"
    f.write_text(yaml.safe_dump(raw, sort_keys=False))
    return str(f)


# PhiMoE writes no dense student (tests/test_refused_outputs.py): its micro sweep has the pruned and merged sub-grids
MICRO = [
    (f, DENSE_AND_MOE, ["dense", "moe"])
    for f in ("glm4_moe", "minimax_m2", "flex_olmo", "cohere2_moe", "dbrx", "llama4_text")
]
MICRO += [("phimoe", MOE_ONLY, ["moe", "merged"])]


@pytest.mark.parametrize("family,grid,outputs", MICRO, ids=[m[0] for m in MICRO])
def test_micro_sweep_of_a_new_family(family, grid, outputs, tmp_path, monkeypatch):
    monkeypatch.setenv("MOESWEEP_HOME", str(tmp_path / "home"))
    spec, path, text = load_spec(sweep(tmp_path, family, grid))
    store = Store(f"sqlite:///{tmp_path}/r.db")
    assert launch_serial(spec, text, store, path) == 0
    rows = store.query(
        "SELECT output, config_key, ppl_pre FROM results WHERE kind IN ('moe2dense', 'moe2moe') ORDER BY config_id"
    )[1]
    assert [r[0] for r in rows] == outputs
    assert all(r[2] is not None and r[2] == r[2] and 1 < r[2] < 1e6 for r in rows), rows


def test_an_unsupported_model_is_a_one_line_error_listing_the_families(tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2
    ).save_pretrained(tmp_path / "llama")
    f = tmp_path / "bad.yaml"
    f.write_text(
        yaml.safe_dump(
            {
                "name": "bad",
                "teacher": {"source": "hf", "model": str(tmp_path / "llama")},
                "calibration": {"n_samples": 4, "seq_len": 8},
                "grid": {"scoring": ["SF"], "grouping": ["RR"], "K": [2]},
            }
        )
    )
    spec, path, _ = load_spec(str(f))
    with pytest.raises(SpecError) as e:
        prepare(spec, str(path))  # what launch and the dry run do first
    msg = str(e.value)
    assert "\n" not in msg and "'llama'" in msg and "moesweep families" in msg
    for family in ("qwen3_moe", "glm4_moe", "dots1", "minimax_m2", "flex_olmo"):
        assert family in msg


def test_families_command_lists_every_adapter():
    from typer.testing import CliRunner

    from orchestrator.cli import app
    from workers.families import ADAPTERS

    out = CliRunner().invoke(app, ["families"])
    assert out.exit_code == 0, out.output
    for a in ADAPTERS:
        assert a.routing and a.student, a.name
        assert f"{a.name}: model_type" in out.output and a.student in out.output
