"""The bridge to an earlier release's code versions (orchestrator/code_aliases.json): every entry maps the digest
today's codever gives a component to the digest the release stored for the very same code, and nothing else."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import orchestrator.stage as stage_mod
from orchestrator.stage import code_components, is_stale

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("code_aliases_script", ROOT / "scripts" / "code_aliases.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_entry_of_the_bridge_holds_against_its_release():
    got = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "code_aliases.py"), "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert got.returncode == 0, got.stdout + got.stderr[-3000:]
    table = json.loads((ROOT / "orchestrator" / "code_aliases.json").read_text())
    assert table["aliases"], "the bridge is empty"


def test_the_check_refuses_an_entry_whose_code_differs():
    table = json.loads((ROOT / "orchestrator" / "code_aliases.json").read_text())
    name, pairs = next(iter(table["aliases"].items()))
    cur, old = next(iter(pairs.items()))
    forged = {"base": table["base"], "aliases": {name: {cur: "0" * 16}, "stage:convert": {"f" * 16: old}}}
    assert sorted(_script().check(forged)) == sorted(
        [f"{name}: {cur} -> {'0' * 16}", f"stage:convert: {'f' * 16} -> {old}"]
    )


def test_an_aliased_digest_is_reported_as_the_release_stored_it(monkeypatch):
    monkeypatch.setattr(stage_mod, "ALIASES", {})
    raw = code_components("convert", {"scoring": "SF"})
    monkeypatch.setattr(
        stage_mod,
        "ALIASES",
        {"stage:convert": {raw["stage:convert"]: "a" * 16}, "scoring:SF": {"not-today's": "b" * 16}},
    )
    bridged = code_components("convert", {"scoring": "SF"})
    assert bridged == {
        "stage:convert": "a" * 16,
        "scoring:SF": raw["scoring:SF"],
    }  # only an exact digest maps
    assert not is_stale("convert", {"scoring": "SF"}, json.dumps(bridged))
    assert is_stale("convert", {"scoring": "SF"}, json.dumps(raw))
