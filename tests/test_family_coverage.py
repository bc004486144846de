"""Every MoE model of the locked transformers is either supported by an adapter or named, with its reason, in
the left-out list of docs/families.md: moving the lock to a transformers that brings a new MoE family fails
here until it is one or the other (`scripts/moe_coverage.py` lists the gap)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from workers.families.coverage import covered, left_out, moe_model_types, supported_types, unsupported

ROOT = Path(__file__).resolve().parents[1]
FAMILIES_PAGE = ROOT / "docs" / "families.md"


def test_every_moe_model_is_supported_or_left_out_with_a_reason():
    named = left_out(FAMILIES_PAGE.read_text())
    missing = [d for d in unsupported() if not covered(d, named)]
    assert not missing, (
        f"MoE models neither supported nor in the left-out list of docs/families.md: {missing} "
        "(scripts/moe_coverage.py lists them)"
    )


def test_no_supported_family_is_also_left_out():
    assert not supported_types() & left_out(FAMILIES_PAGE.read_text())


def test_the_scan_sees_known_moe_models():
    dirs = moe_model_types()
    assert {"qwen3_moe", "mixtral", "deepseek_v3", "dbrx", "phimoe", "llama4", "jamba"} <= dirs
    assert "llama" not in dirs and "qwen3" not in dirs


def test_the_scan_reads_a_models_folder(tmp_path):
    for name, code in {
        "toy_moe": "self.num_local_experts = 8",
        "toy_dense": "self.intermediate_size = 8",
        "qwen3_moe": "num_experts",
    }.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / f"modeling_{name}.py").write_text(code)
    assert moe_model_types(tmp_path) == {"toy_moe", "qwen3_moe"}
    assert unsupported(tmp_path) == ["toy_moe"]  # qwen3_moe has an adapter


def test_left_out_reads_names_but_not_pointers():
    text = (
        "Left out of the installed transformers' MoE models, by reason:\n"
        "- Hybrid: `jamba`, `zaya` (a reason)\n- Multimodal: `llama4` (use `llama4_text`)\n\nNext."
    )
    assert left_out(text) == {"jamba", "zaya", "llama4"}


def test_the_script_reports_the_gap():
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "moe_coverage.py")], capture_output=True, text=True, cwd=ROOT
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "MoE model types" in out.stdout and "left out" in out.stdout
