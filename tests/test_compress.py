"""`moesweep compress`: one compressed model from a teacher folder, through the same stages as a sweep,
written as a folder transformers loads, with a card; a second call reuses what the first computed; bad
choices are one line."""

from __future__ import annotations

import json

import torch
from test_family_sweeps import teacher_dir
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from orchestrator.cli import app


def test_compress_writes_a_pruned_moe_that_reloads(tmp_path, monkeypatch):
    monkeypatch.setenv("MOESWEEP_HOME", str(tmp_path / "home"))
    teacher = teacher_dir(tmp_path, "qwen3_moe")
    out = tmp_path / "pruned"
    db = f"sqlite:///{tmp_path}/c.db"
    args = ["compress", str(teacher), "--out", str(out), "--output", "moe", "--scoring", "REAP", "--K", "4"]
    args += ["--data", f"jsonl:{tmp_path / 'corpus.jsonl'}", "--n-samples", "8", "--seq-len", "32"]
    args += ["--dtype", "float32", "--db", db]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.num_experts == 4  # 4 of the teacher's experts kept per layer
    facts = json.loads((out / "moesweep.json").read_text())
    assert facts["config_key"] == "moe|REAP|K=4|recovery=none" and facts["registers"] is None
    assert facts["scores"]["ppl_pre"] is not None and 1 < facts["scores"]["ppl_pre"] < 1e6
    assert "moe|REAP|K=4|recovery=none" in (out / "README.md").read_text()
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[1, 2, 3, 4]])).logits).all()

    again = CliRunner().invoke(app, [*args, "--force"])  # the same request: nothing is computed again
    assert again.exit_code == 0, again.output
    from db.store import Store

    attempts = Store(db).query("SELECT stage, attempts FROM jobs ORDER BY stage")[1]
    assert attempts and all(a == 1 for _, a in attempts), attempts


def test_bad_choices_are_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("MOESWEEP_HOME", str(tmp_path / "home"))
    base = ["compress", "some/model", "--out", str(tmp_path / "o"), "--db", f"sqlite:///{tmp_path}/c.db"]
    for extra, msg in (
        (["--output", "sparse", "--K", "4"], "--output 'sparse': allowed: dense, moe, merged, edited"),
        (["--scoring", "NOPE", "--K", "4"], "--scoring 'NOPE' (for output moe): allowed:"),
        (["--K", "0"], "--K 0: give the experts to keep per layer"),
        (["--K", "4", "--data", "csv:x"], "--data 'csv:x': allowed: hf:PATH[/NAME]"),
        (["--K", "4", "--scoring", "REAP", "--merging", "HC-SMoE"], "give one of --scoring, --merging"),
    ):
        r = CliRunner().invoke(app, [*base, *extra])
        assert r.exit_code == 2 and msg in r.output and len(r.output.strip().splitlines()) == 1, r.output
    assert not (tmp_path / "o").exists()


def test_an_out_folder_that_cannot_be_written_is_one_line_before_anything_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("MOESWEEP_HOME", str(tmp_path / "home"))
    (tmp_path / "afile").write_text("x")
    out = tmp_path / "afile" / "model"
    args = ["compress", "some/model", "--out", str(out), "--K", "4", "--scoring", "REAP"]
    r = CliRunner().invoke(app, [*args, "--db", f"sqlite:///{tmp_path}/c.db"])
    assert r.exit_code == 2, r.output
    assert r.output.strip() == (
        f"error: compress some/model: cannot write {out}: {tmp_path / 'afile'} is a file, not a folder"
    )
    assert not (tmp_path / "home" / "compress").exists()  # no sweep written, nothing run
