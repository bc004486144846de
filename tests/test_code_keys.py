"""Keys that see the code: what a code version covers, and a real edit of one scoring relaunched."""

from __future__ import annotations

import ast
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from orchestrator.axes import method_registries
from orchestrator.codever import Fingerprints, clear_caches
from orchestrator.stage import code_components
from workers.core.registry import registry_names

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def toy_pkg(tmp_path, monkeypatch):
    """A package `cvtoy` on sys.path whose files the test rewrites."""
    pkg = tmp_path / "cvtoy"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    clear_caches()
    yield pkg
    clear_caches()


def _write(pkg: Path, name: str, text: str) -> None:
    (pkg / f"{name}.py").write_text(textwrap.dedent(text))
    clear_caches()


def _digest(unit: tuple[str, ...]) -> str:
    return Fingerprints(stop={("cvtoy.methods", "METHODS")}, extra_roots={"cvtoy"}).digest([unit])


def test_docstrings_comments_and_layout_do_not_count_code_does(toy_pkg):
    _write(
        toy_pkg,
        "helpers",
        """
        SCALE = 2.0

        def scaled(x):
            return x * SCALE
    """,
    )
    _write(
        toy_pkg,
        "stage",
        '''
        from cvtoy.helpers import scaled

        def run(x):
            """Run it."""
            return scaled(x) + 1
    ''',
    )
    base = _digest(("cvtoy.stage", "run"))
    _write(
        toy_pkg,
        "stage",
        '''
        from cvtoy.helpers import scaled  # a comment


        def unrelated():
            return 0


        def run(x):
            """Run it, with a longer docstring that says more."""
            # a comment inside
            return scaled(x)    +    1
    ''',
    )
    assert _digest(("cvtoy.stage", "run")) == base
    _write(
        toy_pkg,
        "helpers",
        """
        SCALE = 3.0

        def scaled(x):
            return x * SCALE
    """,
    )  # a constant two modules away, reached through a function the stage calls
    assert _digest(("cvtoy.stage", "run")) != base


def _methods(helper_step: int) -> str:
    """cvtoy.methods: a registry of two methods, B calling a helper that subtracts `helper_step`."""
    return f"""
        def a(x):
            return x + 1

        def b(x):
            return helper(x) * 2

        def helper(x):
            return x - {helper_step}

        METHODS = {{"A": a, "B": b}}

        def get(name):
            return METHODS[name]
    """


def test_a_registry_entry_is_its_own_component_and_not_followed_from_a_stage(toy_pkg):
    _write(toy_pkg, "methods", _methods(helper_step=1))
    _write(
        toy_pkg,
        "stage",
        """
        import cvtoy.methods as m

        def run(name, x):
            return m.get(name)(x)
    """,
    )
    before = {
        u: _digest(u)
        for u in [
            ("cvtoy.stage", "run"),
            ("cvtoy.methods", "METHODS", "A"),
            ("cvtoy.methods", "METHODS", "B"),
        ]
    }
    _write(toy_pkg, "methods", _methods(helper_step=2))  # edit B's helper: only B's component changes
    after = {u: _digest(u) for u in before}
    changed = {u for u in before if before[u] != after[u]}
    assert changed == {("cvtoy.methods", "METHODS", "B")}


def test_every_registry_reads_the_same_names_from_source_as_at_run_time():
    import workers.baselines.baselines
    import workers.methods.editing
    import workers.methods.grouping
    import workers.methods.moe_merging
    import workers.methods.scaling
    import workers.methods.scoring
    import workers.models.outputs
    import workers.training.losses

    for (module, name), obj in {
        ("workers.methods.scoring", "SCORINGS"): workers.methods.scoring.SCORINGS,
        ("workers.models.outputs", "OUTPUTS"): workers.models.outputs.OUTPUTS,
        ("workers.methods.moe_merging", "MERGINGS"): workers.methods.moe_merging.MERGINGS,
        ("workers.methods.editing", "EDITINGS"): workers.methods.editing.EDITINGS,
        ("workers.methods.grouping", "GROUPINGS"): workers.methods.grouping.GROUPINGS,
        ("workers.methods.scaling", "SCALINGS"): workers.methods.scaling.SCALINGS,
        ("workers.training.losses", "LOSSES"): workers.training.losses.LOSSES,
        ("workers.baselines.baselines", "_CANDIDATES"): workers.baselines.baselines._CANDIDATES,
    }.items():
        assert registry_names(module, name) == list(obj), name
    assert {m for m, _ in method_registries()} == {
        "workers.models.outputs",
        "workers.methods.scoring",
        "workers.methods.grouping",
        "workers.methods.scaling",
        "workers.methods.moe_merging",
        "workers.methods.editing",
    }


def test_a_conversion_depends_on_its_own_methods_only():
    sf = code_components("convert", {"scoring": "SF", "grouping": "RR", "dp_scaling": "uniform", "K": 2})
    pp = code_components("convert", {"scoring": "PP", "grouping": "RR", "dp_scaling": "uniform", "K": 2})
    assert set(sf) == {"stage:convert", "scoring:SF", "grouping:RR", "dp_scaling:uniform"}
    assert sf["stage:convert"] == pp["stage:convert"] and sf["scoring:SF"] != pp["scoring:PP"]
    fp = Fingerprints(stop=method_registries())
    stage = fp.closure([("workers.run.convert", "stage_convert")])
    assert ("workers.methods.scoring", "pp") not in stage and ("workers.methods.scoring", "sf") not in stage
    assert ("workers.methods.scoring", "pp") in fp.closure([("workers.methods.scoring", "SCORINGS", "PP")])
    # frequency is SF under another name: the same code, the same component hash
    assert fp.digest([("workers.methods.scoring", "SCORINGS", "SF")]) != fp.digest(
        [("workers.methods.scoring", "SCORINGS", "PP")]
    )


SWEEP = """\
name: codeedit
teacher:
  source: tiny
  tiny: {experts: 8, top_k: 2, hidden: 32, layers: 2, heads: 2, kv_heads: 1, moe_intermediate: 32, vocab: 512,
         steps: 20, batch_size: 8, seq_len: 64, warmup: 2, corpus_chars: 300000, eval_windows: 8}
calibration: {data: {source: tiny, split: train}, n_samples: 8, seq_len: 64, batch_size: 8}
grid: {scoring: [SF, PP], grouping: [RR], dp_scaling: [uniform], K: [2, 4]}
ppl: {data: {source: tiny, split: test}, seq_len: 64, max_windows: 4}
select: {best_by: ppl_pre, per: [scoring, grouping], over: [K, dp_scaling]}
distill:
  settings: {steps: 1, batch_size: 2, seq_len: 64, warmup: 0, eval_every: 1, val_windows: 2}
  data: {source: tiny, split: train}
  val_data: {source: tiny, split: valid}
evaluate: {suite: tiny, batch_size: 8, limit: 4}
baselines: [teacher]
execution: {retries: 0}
"""


def _cli(src: Path, home: Path, *args: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": str(src),
        "MOESWEEP_HOME": str(home),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
    }
    return subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", *args],
        cwd=home,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


def _jobs(db: Path) -> dict[str, tuple[str, frozenset[str]]]:
    """job key → (stage, the scorings of the configurations linked to it)."""
    with sqlite3.connect(db) as c:
        rows = c.execute(
            "SELECT j.key, j.stage, c.scoring FROM jobs j LEFT JOIN config_jobs cj ON cj.job_id = j.id "
            "LEFT JOIN configurations c ON c.id = cj.config_id"
        ).fetchall()
    out: dict[str, tuple[str, set[str]]] = {}
    for key, stage, scoring in rows:
        out.setdefault(key, (stage, set()))[1].add(scoring or "-")
    return {k: (s, frozenset(v)) for k, (s, v) in out.items()}


@pytest.mark.slow
def test_editing_one_scoring_reruns_exactly_its_configurations(tmp_path):
    """A copy of the code, a real sweep, an edit of PP's formula, a relaunch: the conversions of PP and
    everything downstream of them run again; the teacher, the calibration and every SF job are reused."""
    src = tmp_path / "src"
    for pkg in ("workers", "orchestrator", "db", "analysis", "sweeps"):
        shutil.copytree(ROOT / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    home = tmp_path / "home"
    home.mkdir()
    (home / "codeedit.yaml").write_text(SWEEP)
    db = home / "r.db"
    launch = ["launch", str(home / "codeedit.yaml"), "--executor", "serial", "--db", f"sqlite:///{db}"]
    first = _cli(src, home, *launch)
    assert first.returncode == 0, first.stderr[-3000:]
    before = _jobs(db)

    scoring = src / "workers" / "methods" / "scoring.py"
    text = scoring.read_text()
    old = "    return _f64(ctx.stats.sum_p) / _n(ctx.stats)\n"
    assert text.count(old) == 1
    scoring.write_text(text.replace(old, "    return 1.0 - _f64(ctx.stats.sum_p) / _n(ctx.stats)\n"))

    status = _cli(src, home, "status", "codeedit", "--db", f"sqlite:///{db}")
    assert status.returncode == 0, status.stderr
    row = next(ln for ln in status.stdout.splitlines() if re.search(r"\bconvert\b", ln))
    # succeeded, running, dead, failed, pending, stale: PP's two plans are stale
    assert re.findall(r"\d+|–", row)[:6] == ["2", "0", "0", "0", "0", "2"]

    second = _cli(src, home, *launch)
    assert second.returncode == 0, second.stderr[-3000:]
    after = _jobs(db)
    new = {k: v for k, v in after.items() if k not in before}
    by_stage: dict[str, int] = {}
    for stage, scorings in new.values():
        assert scorings == {"PP"}, (stage, scorings)  # nothing new serves another configuration
        by_stage[stage] = by_stage.get(stage, 0) + 1
    assert by_stage == {"convert": 2, "ppl_pre": 2, "distill": 1, "evaluate": 1}
    # every job of the other configurations (teacher, calibration, SF, the teacher baseline) was reused
    with sqlite3.connect(db) as c:
        linked = c.execute(
            "SELECT DISTINCT j.key FROM config_jobs cj JOIN jobs j ON j.id = cj.job_id "
            "JOIN configurations c ON c.id = cj.config_id WHERE c.scoring IS NOT 'PP'"
        ).fetchall()
    assert {k for (k,) in linked} <= set(before)
    assert "stale" in _cli(src, home, "status", "codeedit", "--db", f"sqlite:///{db}").stdout


def test_the_code_that_builds_a_student_is_part_of_every_job_that_builds_it():
    """A student recipe names its output: the evaluation, distillation and Router KD jobs that build the
    student from its plan hash the builder's code (workers/models/outputs.py), not only the stage's own."""
    for output in ("dense", "moe"):
        recipe = {"type": "plan", "plan_key": "abc", "output": output}
        for stage, params in (
            ("ppl_pre", {"student": recipe}),
            ("distill", {"student": recipe}),
            ("router_kd", {"student": recipe}),
            ("evaluate", {"student": {"type": "router_kd", "base": recipe}}),
        ):
            assert f"output:{output}" in code_components(stage, params), (stage, output)
    fp = Fingerprints(stop=method_registries())
    dense = fp.closure([("workers.models.outputs", "OUTPUTS", "dense")])
    assert ("workers.models.convert", "build_student_from_plans") in dense and (
        "workers.methods.merge",
        "build_dense_ffn",
    ) in dense


def _move_helpers(pkg: Path, subpackage: str, name: str, text: str) -> None:
    """cvtoy/helpers.py moves to cvtoy/<subpackage>/<name>.py (a new subpackage), written as `text`."""
    (pkg / "helpers.py").unlink()
    (pkg / subpackage).mkdir()
    (pkg / subpackage / "__init__.py").write_text("")
    _write(pkg / subpackage, name, text)


def test_moving_a_definition_to_another_module_keeps_its_key_and_an_edit_still_changes_it(toy_pkg):
    """A definition is its name and its source, not the module it lives in: moving `scaled` (reached by a
    from-import, a module alias and a dotted chain) keeps the stage's digest; editing it where it now lives
    does not."""
    helper = """
        SCALE = 2.0

        def scaled(x):
            return x * SCALE
    """
    _write(toy_pkg, "helpers", helper)
    _write(
        toy_pkg,
        "stage",
        """
        import cvtoy.helpers
        import cvtoy.helpers as h

        def run(x):
            from cvtoy.helpers import scaled
            return scaled(x) + h.scaled(x) + cvtoy.helpers.scaled(x)
    """,
    )
    base = _digest(("cvtoy.stage", "run"))
    _move_helpers(toy_pkg, "deep", "numerics", helper)
    _write(
        toy_pkg,
        "stage",
        """
        import cvtoy.deep.numerics
        import cvtoy.deep.numerics as h

        def run(x):
            from cvtoy.deep.numerics import scaled
            return scaled(x) + h.scaled(x) + cvtoy.deep.numerics.scaled(x)
    """,
    )
    assert _digest(("cvtoy.stage", "run")) == base
    _write(toy_pkg / "deep", "numerics", helper.replace("x * SCALE", "x * SCALE + 1"))
    assert _digest(("cvtoy.stage", "run")) != base


def test_a_module_named_in_a_string_and_the_order_of_imports_do_not_count(toy_pkg):
    """A module path in a string (a `-m` argument, a message) is read by the module's last name, and a run of
    imports in sorted order: moving `cvtoy.helpers` into a subpackage, and re-sorting the imports the new path
    reorders, keep the digest; another module named in the string changes it."""
    helper = "def scaled(x):\n    return 2 * x\n"
    _write(toy_pkg, "helpers", helper)
    _write(toy_pkg, "other", helper)
    stage = """
        def run(x):
            import os
            from cvtoy.{a} import scaled
            return [scaled(x), "-m", "cvtoy.{a}", "see cvtoy.{a}.scaled", os.sep]
    """
    _write(toy_pkg, "stage", stage.format(a="helpers"))
    base = _digest(("cvtoy.stage", "run"))
    _move_helpers(toy_pkg, "zz", "helpers", helper)
    _write(
        toy_pkg,
        "stage",
        stage.format(a="zz.helpers").replace(
            "    import os\n            from cvtoy.zz.helpers import scaled\n",
            "    from cvtoy.zz.helpers import scaled\n            import os\n",
        ),
    )
    assert _digest(("cvtoy.stage", "run")) == base
    _write(toy_pkg, "stage", stage.format(a="other"))
    assert _digest(("cvtoy.stage", "run")) != base


COMPONENTS = """
import json
from orchestrator.stage import code_components, stages
from workers.core.registry import registry_names
out = {f"{st.name}:{s}": code_components(st.name, {"scoring": s})
       for st in stages() for s in registry_names("workers.methods.scoring", "SCORINGS")}
print(json.dumps(out, sort_keys=True))
"""


def _components(src: Path) -> dict[str, dict[str, str]]:
    import json

    env = {**os.environ, "PYTHONPATH": str(src)}
    got = subprocess.run(
        [sys.executable, "-c", COMPONENTS], cwd=src, env=env, capture_output=True, text=True, timeout=300
    )
    assert got.returncode == 0, got.stderr[-3000:]
    return json.loads(got.stdout)


def test_moving_a_scoring_to_another_module_keeps_every_key(tmp_path):
    """In a copy of the project: PP's formula and its helpers move out of workers/methods/scoring.py into a module of
    their own; every stage's and every scoring's code component stays; then an edit of PP's body in its new
    home changes `scoring:PP` and nothing else."""
    src = tmp_path / "src"
    for pkg in ("workers", "orchestrator", "db", "analysis", "sweeps"):
        shutil.copytree(ROOT / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    before = _components(src)
    scoring = src / "workers" / "methods" / "scoring.py"
    text = scoring.read_text()
    tree = ast.parse(text)
    moved = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in ("_f64", "_n", "pp")]
    assert len(moved) == 3
    lines = text.splitlines(keepends=True)
    bodies = ["".join(lines[n.lineno - 1 - len(n.decorator_list) : n.end_lineno]) for n in moved]
    for body in bodies:
        text = text.replace(body, "")
    header = "".join(lines[: min(n.lineno for n in tree.body if isinstance(n, ast.FunctionDef)) - 1])
    (src / "workers" / "core" / "moved_scoring.py").write_text(header + "\n\n" + "\n\n".join(bodies))
    scoring.write_text(
        text.replace("\ndef ", "\nfrom workers.core.moved_scoring import _f64, _n, pp  # noqa\n\n\ndef ", 1)
    )
    assert _components(src) == before
    new = (src / "workers" / "core" / "moved_scoring.py").read_text()
    old = "    return _f64(ctx.stats.sum_p) / _n(ctx.stats)\n"
    assert new.count(old) == 1
    (src / "workers" / "core" / "moved_scoring.py").write_text(
        new.replace(old, "    return 2 * _f64(ctx.stats.sum_p) / _n(ctx.stats)\n")
    )
    after = _components(src)
    changed = {(job, comp) for job in before for comp in before[job] if before[job][comp] != after[job][comp]}
    assert changed and {comp for _, comp in changed} == {"scoring:PP"}
