"""A new output is its module plus one `Output(...)` line in each registry: the workers' (workers/models/outputs.py:
its plan function and student builder) and the readers' torch-free facts (db/axes.py). In a copy of the project,
a toy output (a pruned MoE keeping the K experts with the largest router rows) is added that way and nothing
else; a micro sweep plans, converts and evaluates it, stores it as a smaller MoE, and a relaunch runs nothing."""

from __future__ import annotations

import difflib
import json
import shutil
import sqlite3
import textwrap
from pathlib import Path

import pytest

from tests.test_code_keys import _cli

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("workers", "orchestrator", "db", "analysis", "dashboard", "sweeps")

TOY_MODULE = '''\
"""A toy output: a pruned MoE keeping, per layer, the K experts whose router rows have the largest norm."""

from __future__ import annotations

from typing import Any

from torch import nn

from workers.core.types import LayerPlan


def toy_plans(layers, p: dict[str, Any], own: dict, settings: dict, teacher) -> tuple[list, None]:
    plans = []
    for layer, ctx in layers:
        norms = ctx.router_weight.detach().double().norm(dim=1)
        kept = sorted(sorted(range(len(norms)), key=lambda e: (-float(norms[e]), e))[: p["K"]])
        plans.append(
            LayerPlan(
                layer=layer,
                selected=kept,
                scores=norms.tolist(),
                groups=[[e] for e in kept],
                merge_weights=[[1.0] for _ in kept],
                alpha=[1.0] * len(kept),
            )
        )
    return plans, None


def toy_student(model: nn.Module, adapter, plans, share_weights: bool, plan_path=None) -> nn.Module:
    return adapter.pruned_moe_student(model, {pl.layer: sorted(pl.selected) for pl in plans})
'''

SWEEP = """\
name: toyout
teacher:
  source: tiny
  tiny: {experts: 8, top_k: 2, hidden: 32, layers: 2, heads: 2, kv_heads: 1, moe_intermediate: 32, vocab: 512,
         steps: 20, batch_size: 8, seq_len: 64, warmup: 2, corpus_chars: 300000, eval_windows: 8}
calibration: {data: {source: tiny, split: train}, n_samples: 8, seq_len: 64, batch_size: 8}
grid:
  - {output: [toy], scoring: [SF], K: [2, 4], recovery: [none]}
  - {output: [moe], scoring: [SF], K: [4], recovery: [none]}
ppl: {data: {source: tiny, split: test}, seq_len: 64, max_windows: 4}
select: null
execution: {retries: 0}
"""


def add_line_after(path: Path, anchor: str, line: str) -> None:
    text = path.read_text()
    assert text.count(anchor) == 1, anchor
    path.write_text(text.replace(anchor, anchor + line, 1))


def changed_lines(src: Path) -> dict[str, list[str]]:
    """file → the lines the copy differs by from the project (+ added, - removed), new files in full."""
    out: dict[str, list[str]] = {}
    for pkg in PACKAGES:
        for f in sorted((src / pkg).rglob("*.py")):
            rel = f.relative_to(src).as_posix()
            orig = ROOT / rel
            new = f.read_text().splitlines()
            if not orig.exists():
                out[rel] = ["+" + ln for ln in new]
                continue
            diff = difflib.unified_diff(orig.read_text().splitlines(), new, lineterm="", n=0)
            lines = [ln for ln in diff if ln[:1] in "+-" and ln[:3] not in ("+++", "---")]
            if lines:
                out[rel] = lines
    return out


@pytest.mark.slow
def test_a_toy_output_added_by_one_line_per_registry_runs_through_a_micro_sweep(tmp_path):
    src = tmp_path / "src"
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    (src / "workers" / "models" / "toy_output.py").write_text(TOY_MODULE)
    outputs = src / "workers" / "models" / "outputs.py"
    add_line_after(
        outputs,
        "from workers.models.plans import dense_plans, edited_plans, merged_plans, moe_plans\n",
        "from workers.models.toy_output import toy_plans, toy_student\n",
    )
    add_line_after(
        outputs,
        '    "edited": Output(edited_plans, edited_student),\n',
        '    "toy": Output(toy_plans, toy_student),\n',
    )
    add_line_after(
        src / "db" / "axes.py",
        "        for o in (\n",
        textwrap.indent(
            'Output("toy", "scoring", True, (), "moe2moe", "prune", "toy MoE", "the K largest router rows kept"),\n',
            " " * 12,
        ),
    )
    # exactly what a new output takes: its module, its import and registry line, its line of facts
    changed = changed_lines(src)
    new_module = "/".join(("workers", "models", "toy_output.py"))  # only in the copy
    assert sorted(changed) == ["db/axes.py", "workers/models/outputs.py", new_module]
    assert [len(changed["db/axes.py"]), len(changed["workers/models/outputs.py"])] == [1, 2]
    assert all(ln.startswith("+") for lines in changed.values() for ln in lines)

    home = tmp_path / "home"
    home.mkdir()
    (home / "toyout.yaml").write_text(SWEEP)
    db = home / "r.db"
    launch = ["launch", str(home / "toyout.yaml"), "--executor", "serial", "--db", f"sqlite:///{db}"]
    dry = _cli(src, home, *launch, "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr[-3000:]
    first = _cli(src, home, *launch)
    assert first.returncode == 0, first.stderr[-3000:] + first.stdout[-3000:]

    with sqlite3.connect(db) as c:
        rows = c.execute(
            "SELECT config_key, kind, output, K, ppl_pre FROM results WHERE output = 'toy' ORDER BY K"
        ).fetchall()
        plans = c.execute(
            "SELECT j.outputs_json FROM jobs j JOIN config_jobs cj ON cj.job_id = j.id "
            "JOIN configurations g ON g.id = cj.config_id WHERE j.stage = 'convert' AND g.output = 'toy' "
            "ORDER BY g.K"
        ).fetchall()
    assert [(r[0], r[1], r[2], r[3]) for r in rows] == [
        ("toy|SF|K=2|recovery=none", "moe2moe", "toy", 2),
        ("toy|SF|K=4|recovery=none", "moe2moe", "toy", 4),
    ]
    assert all(r[4] is not None and 1.0 < r[4] < 1e4 for r in rows)  # a finite perplexity of a real model
    # the plan the toy's function wrote: K experts per layer, each its own group
    for (outputs_json,), K in zip(plans, (2, 4), strict=True):
        plan = json.loads(Path(json.loads(outputs_json)["plan_path"]).read_text())
        assert [len(layer["selected"]) for layer in plan] == [K, K]

    with sqlite3.connect(db) as c:
        before = c.execute("SELECT key, attempts, finished_at FROM jobs ORDER BY key").fetchall()
    again = _cli(src, home, *launch)
    assert again.returncode == 0, again.stderr[-3000:]
    with sqlite3.connect(db) as c:  # every job reused: none added, none run again
        assert c.execute("SELECT key, attempts, finished_at FROM jobs ORDER BY key").fetchall() == before
