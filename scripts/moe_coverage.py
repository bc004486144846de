"""List the MoE model types of the installed transformers that no moesweep adapter supports.

Run it in the environment of a new lock (`make lock`, then `.venv/bin/python scripts/moe_coverage.py`):
each type is marked `left out` where the left-out list of docs/families.md names it (with its reason there)
and `NEW` where it does not. Exit status 1 when any is new: write an adapter or add it, with its reason, to
that list.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import transformers  # noqa: E402

from workers.families.coverage import covered, left_out, moe_model_types, unsupported  # noqa: E402

FAMILIES_PAGE = Path(__file__).resolve().parents[1] / "docs" / "families.md"


def main() -> int:
    named = left_out(FAMILIES_PAGE.read_text())
    gaps = unsupported()
    new = [d for d in gaps if not covered(d, named)]
    print(
        f"transformers {transformers.__version__}: {len(moe_model_types())} MoE model types, "
        f"{len(gaps)} without an adapter ({len(new)} new)"
    )
    for d in gaps:
        print(f"  {d:28s} {'NEW' if d in new else 'left out'}")
    return 1 if new else 0


if __name__ == "__main__":
    sys.exit(main())
