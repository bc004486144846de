"""Which MoE model types an installed transformers ships, and which of them no adapter supports.

A model directory counts as a mixture of experts when its modeling code names a config field that counts
routed experts. docs/families.md keeps a left-out list (each such model type no adapter supports, with its
reason); `left_out(page_text)` reads the names from it. `scripts/moe_coverage.py` prints the gap when the lock
moves to a new transformers; tests/test_family_coverage.py fails on it for the locked one.
"""

from __future__ import annotations

import re
from pathlib import Path

# what marks a model's code as a mixture of experts: a config field counting routed experts
EXPERT_FIELDS = re.compile(r"\b(num_experts|num_local_experts|n_routed_experts|moe_num_experts)\b")
LEFT_OUT_HEADING = "Left out of the installed transformers' MoE models"


def moe_model_types(models_dir: Path | None = None) -> set[str]:
    """The model directories of a transformers install whose modeling code declares routed experts."""
    if models_dir is None:
        import transformers

        models_dir = Path(transformers.__file__).parent / "models"
    return {f.parent.name for f in models_dir.glob("*/modeling_*.py") if EXPERT_FIELDS.search(f.read_text())}


def supported_types() -> set[str]:
    from workers.families import ADAPTERS

    return {mt for a in ADAPTERS for mt in a.model_types}


def left_out(page_text: str) -> set[str]:
    """The model types the left-out list of docs/families.md names (a "use `x`" pointer at a supported family
    is not one)."""
    start = page_text.index(LEFT_OUT_HEADING)
    section = page_text[start:]
    section = section[: section.index("\n\n", section.index("\n- "))]
    section = re.sub(r"use `[a-z0-9_]+`", "", section)
    return set(re.findall(r"`([a-z0-9_]+)`", section))


def covered(model_type: str, names: set[str]) -> bool:
    """A directory is covered by a name for itself or for its text model (`llama4` by `llama4_text`)."""
    return bool({model_type, f"{model_type}_text"} & names)


def unsupported(models_dir: Path | None = None) -> list[str]:
    """MoE model types of the installed transformers that no adapter supports (left out or new)."""
    supported = supported_types()
    return sorted(d for d in moe_model_types(models_dir) if not covered(d, supported))
