"""Every MoE model of the installed transformers is either supported by an adapter or named, with its reason, in
the README's left-out list: a transformers upgrade that brings a new MoE family fails here until it is one or
the other."""

from __future__ import annotations

import re
from pathlib import Path

import transformers

from workers.families import ADAPTERS

README = Path(__file__).resolve().parents[1] / "README.md"
# what marks a model's code as a mixture of experts: a config field counting routed experts
EXPERT_FIELDS = re.compile(r"\b(num_experts|num_local_experts|n_routed_experts|moe_num_experts)\b")


def moe_model_dirs() -> set[str]:
    root = Path(transformers.__file__).parent / "models"
    return {f.parent.name for f in root.glob("*/modeling_*.py") if EXPERT_FIELDS.search(f.read_text())}


def left_out() -> set[str]:
    text = README.read_text()
    section = text[text.index("Left out of the installed transformers' MoE models"):]
    section = section[:section.index("\n\n", section.index("\n- "))]
    section = re.sub(r"use `[a-z0-9_]+`", "", section)  # "(use `llama4_text`)" points at a supported family
    return set(re.findall(r"`([a-z0-9_]+)`", section))


def test_every_moe_model_is_supported_or_left_out_with_a_reason():
    supported = {mt for a in ADAPTERS for mt in a.model_types}
    named = left_out()
    missing = sorted(d for d in moe_model_dirs()
                     if not ({d, f"{d}_text"} & supported) and not ({d, f"{d}_text"} & named))
    assert not missing, f"MoE models neither supported nor in the README's left-out list: {missing}"


def test_no_supported_family_is_also_left_out():
    supported = {mt for a in ADAPTERS for mt in a.model_types}
    assert not supported & left_out()


def test_the_scan_sees_known_moe_models():
    dirs = moe_model_dirs()
    assert {"qwen3_moe", "mixtral", "deepseek_v3", "dbrx", "phimoe", "llama4", "jamba"} <= dirs
    assert "llama" not in dirs and "qwen3" not in dirs
