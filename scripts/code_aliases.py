"""The bridge from an earlier release's code versions to today's (orchestrator/code_aliases.json).

Job keys hash the code of each stage and method (orchestrator/codever.py). When the way that code is hashed
changes (a definition identified by its name and source instead of its module), or when code only moves, the
digests change although the code computes the same: without a bridge every stored result would be recomputed.
The bridge maps a component's digest, as today's codever computes it, to the digest a BASE release stored, for
exactly the components whose code is the same: today's codever gives the same digest on BASE's tree as on the
current tree. Nothing else is ever aliased, so a code change still recomputes what it touches.

    .venv/bin/python scripts/code_aliases.py BASE            # write the table (BASE: a commit, e.g. 4479044)
    .venv/bin/python scripts/code_aliases.py --check         # verify every entry against its BASE (tests do)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "orchestrator" / "code_aliases.json"

# Run inside a tree (PYTHONPATH = that tree): every component's digest by that tree's own codever, and by the
# codever at CODEVER (today's, loaded from its file, its registry helpers taken from that tree).
PROBE = r"""
import importlib, importlib.util, json, sys, types
def load_current_codever(path):
    try:
        reg = importlib.import_module("workers.core.registry")
    except ImportError:
        reg = importlib.import_module("workers.registry")
    for name in ("workers.core", "workers.core.registry"):
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules["workers.core.registry"].__dict__.update(reg.__dict__)
    spec = importlib.util.spec_from_file_location("orchestrator.codever", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["orchestrator.codever"] = mod
    spec.loader.exec_module(mod)
def components():
    from orchestrator.stage import code_components, stages
    from orchestrator.axes import AXES
    try:
        from workers.core.registry import registry_names
    except ImportError:
        from workers.registry import registry_names
    out = {}
    for st in stages():
        out.update(code_components(st.name, {}))
    for name, axis in AXES.items():
        if axis.registry:
            for v in registry_names(*axis.registry):
                out[f"{name}:{v}"] = code_components("convert", {name: v})[f"{name}:{v}"]
    return out
if sys.argv[1] == "current":
    load_current_codever(sys.argv[2])
    import orchestrator.stage as st
    st.ALIASES = {}
print(json.dumps(components(), sort_keys=True))
"""


def _components(tree: Path, current_codever: Path | None) -> dict[str, str]:
    args = ["current", str(current_codever)] if current_codever else ["own"]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    got = subprocess.run(
        [sys.executable, "-c", PROBE, *args], cwd=tree, env=env, capture_output=True, text=True, timeout=600
    )
    if got.returncode != 0:
        sys.exit(f"computing the code versions of {tree} failed:\n{got.stderr[-3000:]}")
    return json.loads(got.stdout)


def base_versions(base: str) -> tuple[dict[str, str], dict[str, str]]:
    """(what BASE stored, what today's codever computes for BASE's code), from a temporary worktree of BASE."""
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "base"
        add = subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), base],
            capture_output=True,
            text=True,
        )
        if add.returncode != 0:
            sys.exit(
                f"BASE {base!r}: not a commit of this clone ({add.stderr.strip()}); a full clone is needed"
            )
        try:
            return _components(tree, None), _components(tree, ROOT / "orchestrator" / "codever.py")
        finally:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], capture_output=True
            )


def build(base: str) -> dict:
    stored, bridged = base_versions(base)
    now = _components(ROOT, ROOT / "orchestrator" / "codever.py")
    aliases = {
        name: {now[name]: stored[name]}
        for name in sorted(now)
        if name in bridged and bridged[name] == now[name] and stored.get(name) not in (None, now[name])
    }
    return {"base": base, "aliases": aliases}


def check(table: dict) -> list[str]:
    """The entries whose claim does not hold: today's codever on BASE's tree must give the aliased digest,
    and BASE's own codever the digest it maps to."""
    stored, bridged = base_versions(table["base"])
    return [
        f"{name}: {cur} -> {old}"
        for name, pairs in table["aliases"].items()
        for cur, old in pairs.items()
        if bridged.get(name) != cur or stored.get(name) != old
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("base", nargs="?", help="the release whose stored code versions to bridge to")
    ap.add_argument("--check", action="store_true", help="verify the committed table")
    args = ap.parse_args()
    if args.check:
        bad = check(json.loads(TABLE.read_text()))
        print("\n".join(bad) or f"{TABLE.name}: every entry holds")
        return 1 if bad else 0
    if not args.base:
        ap.error("BASE or --check")
    table = build(args.base)
    TABLE.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    print(f"{TABLE.relative_to(ROOT)}: {len(table['aliases'])} components bridged to {args.base}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
