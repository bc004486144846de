"""benchmarks/gpu_check.py, the one command for a lent GPU machine, checked on the CPU: a real run of its
cheapest meaningful part (`--device cpu --quick --only a,d`: the micro sweep through `moesweep launch`,
then the table, its markdown and its JSON), the refusals, the full-size grid's overrides against the
sweep schema (a dry run at the real shapes), and the table with a step that fails."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


check = _load()


def _env(tmp_path: Path) -> dict[str, str]:
    from tests.test_benchmarks import smoke_env

    return smoke_env(tmp_path)


def _run(tmp_path: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=tmp_path,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow
def test_cpu_quick_run_of_the_micro_sweep_writes_one_table(tmp_path):
    out = tmp_path / "out"
    args = (
        "--device",
        "cpu",
        "--quick",
        "--only",
        "a,d",
        "--budget",
        "0",
        "--out",
        str(out),
        "--commit",
        "abc123",
    )
    r = _run(tmp_path, *args, timeout=600)  # no time limits inside: a loaded machine is slow, not wrong
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    assert r.stdout.count("| step | item | status | figure | note |") == 1, r.stdout  # one table

    doc = json.loads((out / "gpu-check.json").read_text())
    assert doc["device"] == "cpu" and doc["quick"] is True and doc["steps"] == ["a", "d"]
    assert doc["commit"] == "abc123" and doc["card"].startswith("cpu: ")
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC", doc["date"])
    import torch
    import transformers

    assert doc["torch"] == torch.__version__ and doc["transformers"] == transformers.__version__
    assert doc["missing"] == [] and doc["conflicts"] == []  # the locked environment meets its own pins

    (row,) = doc["rows"]  # --quick: the micro sweep alone
    assert (row["step"], row["item"], row["status"]) == ("a", "sweep micro", "ok"), row
    data = row["data"]
    assert data["rc"] == 0 and data["jobs"] == data["succeeded"] >= 30 and data["failures"] == []
    stages = [s["stage"] for s in data["stages"]]
    assert stages[:2] == ["teacher", "dense_teacher"] and "distill" in stages and "evaluate" in stages
    assert sum(s["jobs"] for s in data["stages"]) == data["jobs"]
    m = re.fullmatch(r"(\d+)/(\d+) jobs succeeded in (\d+\.\d) s", row["figure"])
    assert m and int(m[1]) == int(m[2]) == data["jobs"], row["figure"]
    assert 0 < data["wall_s"] and float(m[3]) == pytest.approx(data["wall_s"], abs=0.06)

    md = (out / "gpu-check.md").read_text()
    assert f"| a | sweep micro | ok | {row['figure']} |  |" in md
    assert "card: cpu: " in md and "commit abc123" in md and md in r.stdout
    log = (out / "gpu-check.log").read_text()
    assert "===== a-micro:" in log and "--executor serial" in log and "exit 0 after" in log


def test_it_refuses_in_one_line_without_cuda_or_quick(tmp_path):
    import torch

    assert not torch.cuda.is_available(), "this test is for a machine without CUDA"
    for args, says in (
        ((), "torch sees no CUDA device; without one only `--device cpu --quick` runs"),
        (("--device", "cpu"), "--device cpu: only with --quick"),
        (("--device", "cpu", "--quick", "--only", "a,e"), "--only 'a,e': allowed steps a, b, c, d"),
        (("--device", "cpu", "--quick", "--budget", "-1"), "--budget -1: allowed a number of seconds >= 0"),
    ):
        r = _run(tmp_path, *args, timeout=120)
        assert r.returncode == 2 and r.stdout == "", (args, r.stdout, r.stderr)
        assert r.stderr.count("\n") == 1 and says in r.stderr, (args, r.stderr)
    assert not (tmp_path / "report").exists()


def test_a_failing_step_is_a_row_and_the_steps_after_it_run(tmp_path):
    ctx = check.Context("cpu", True, tmp_path, budget=None)

    def broken(c):
        raise RuntimeError("the sweep file vanished\nsecond line")

    def fine(c):
        return [check.Row("c", "bench_x.py", "ok", "2.50× naive", "3 s", {"ratio": 2.5, "worst": math.nan})]

    rows = check.run_steps(ctx, [("a", broken), ("b", lambda c: []), ("c", fine)])
    assert [(r.step, r.item, r.status) for r in rows] == [
        ("a", "test sweeps", "failed"),
        ("c", "bench_x.py", "ok"),
    ]
    assert rows[0].note == "RuntimeError: the sweep file vanished second line"
    meta = {
        "date": "2026-11-26 10:00 UTC",
        "card": "NVIDIA H100 80GB HBM3",
        "torch": "2.11.0",
        "steps": ["a"],
    }
    md = check.markdown(meta, rows)
    table = [ln for ln in md.splitlines() if ln.startswith("| ")]
    assert table == [
        "| step | item | status | figure | note |",
        "| --- | --- | --- | --- | --- |",
        "| a | test sweeps | failed |  | RuntimeError: the sweep file vanished second line |",
        "| c | bench_x.py | ok | 2.50× naive | 3 s |",
    ]
    assert "rows: 1 ok, 1 failed" in md and "card: NVIDIA H100 80GB HBM3" in md
    doc = json.loads(check.report_json(meta, rows))  # strict JSON: the NaN is null
    assert doc["rows"][1]["data"] == {"ratio": 2.5, "worst": None}  # exact: 2.5 through JSON and back
    assert doc["card"] == meta["card"]


def test_a_spent_budget_leaves_the_later_steps_not_run(tmp_path):
    ctx = check.Context("cpu", True, tmp_path, budget=1.0)
    ran = []
    rows = check.run_steps(
        ctx, [("a", lambda c: ran.append("a") or []), ("b", lambda c: ran.append("b") or [])]
    )
    assert ran == [] and [(r.step, r.status, r.note) for r in rows] == [
        ("a", "not run", "the --budget was spent"),
        ("b", "not run", "the --budget was spent"),
    ]


def test_a_missing_benchmark_or_a_refused_flag_is_not_run(tmp_path):
    ctx = check.Context("cpu", False, tmp_path / "work", budget=None)
    folder = tmp_path / "benches"
    folder.mkdir()
    (folder / "bench_strict.py").write_text(
        "import argparse\nap = argparse.ArgumentParser()\nap.add_argument('--preset')\n"
        'ap.add_argument("--device")\nap.parse_args()\n'
    )
    (folder / "bench_ratio.py").write_text(
        "import sys\nprint('machine : x')\nprint('fused / FLOP time : 3.10x   (target <= 2x)')\n"
        "print('autograd / fused   : 1.40x')\nprint(sys.argv[1:])\n"
    )
    missing = check.run_bench(ctx, check.Bench("bench_gone", ("--preset", "real"), check.generic, 30), folder)
    assert (missing.status, missing.note) == ("not run", "no bench_gone.py in benches/")
    refused = check.run_bench(
        ctx, check.Bench("bench_strict", ("--preset", "real", "--accum", "8"), check.generic, 60), folder
    )
    assert refused.status == "not run"
    assert refused.note == (
        "bench_strict.py --preset real --accum 8 --device cpu: bench_strict.py: error: unrecognized arguments: "
        "--accum 8"
    )
    ok = check.run_bench(ctx, check.Bench("bench_ratio", ("--preset", "real"), check.generic, 60), folder)
    assert (ok.status, ok.figure) == ("ok", "fused / FLOP time 3.10x"), ok
    assert ok.note.startswith("autograd / fused 1.40x; ") and ok.note.endswith("bench_ratio.py --preset real")
    assert ok.data["command"] == "bench_ratio.py --preset real"  # it takes no --device: none is passed


def test_the_known_benchmarks_outputs_are_read():
    calibration = (
        "loop / batched          :   1.28x   (target >= 5x)\nbatched / raw throughput:   64.2%   (target >= 50%)\n"
        "collect_stats / forward :   4.35x\nbatched vs loop stats   : max rel diff 1.00e-06\n"
        "peak GPU memory         : 12.9 GiB\n"
    )
    figure, note, d = check.parse_calibration(calibration)
    assert figure == "batched 64.2% of raw matmul, 1.28× the loop"
    assert (
        note == "collect_stats 4.35× a forward; peak 12.9 GiB"
    )  # an output from before the side-by-side lines
    calibration += (
        "previous / raw          :   64.0%\n"
        "non-matmul traffic/token: 2879.4 kB, previous 4412.4 kB (1.53x less now)\n"
    )
    figure, note, d = check.parse_calibration(calibration)
    assert (
        note
        == "previous pass 64.0%; non-matmul traffic 1.53× less; collect_stats 4.35× a forward; peak 12.9 GiB"
    )
    assert d["peak_gib"] == 12.9  # exact: float() of the same decimal text
    line = {
        "device": "NVIDIA H100 80GB HBM3 (torch 2.11.0)",
        "ranks": 1,
        "layers": 8,
        "accum": 8,
        "step_s": 1.79,
        "tokens_per_s": 18300.4,
        "mfu": 0.1333,
        "peak_gb_per_rank": [32.8],
        "model_gb_per_rank": 42.6,
        "loss_curve": [[1, 3.2]],
        "split_s": {"teacher": 0.031, "student": 0.129},
    }
    figure, note, d = check.parse_fsdp("tokens/s: ...\n" + json.dumps(line) + "\ntokens/s: 18300.4\n")
    assert figure == "18,300 tokens/s, MFU 13.3%"
    assert note == "peak 32.8 GB vs model 42.6 GB; step 1.79 s; split_s {teacher 0.031, student 0.129}"
    assert "loss_curve" not in d
    predistill = (
        "naive / in-memory, per configuration (build+eval)   :  35.40x   (target >= 10x)\n"
        "max relative |Δppl| between the paths               : 0.00e+00   (tolerance 0.0001)\n"
        'json    : {"ratio": 35.4, "build_ratio": 108.0}\n'
    )
    figure, note, d = check.parse_predistill(predistill)
    assert (figure, note) == ("35.4× naive / in-memory", "max |Δppl| 0.0e+00")
    assert d["build_ratio"] == 108.0  # exact: json.loads of the same decimal text
    assert check.parse_calibration("Traceback...\nValueError: no\n") == ("ValueError: no", "", {})


def test_the_full_grid_overrides_plan_the_papers_350_configurations(tmp_path):
    """The --set overrides of step b at the real shapes, planned by `moesweep launch --dry-run` against a
    saved Qwen3-30B-A3B-shaped config (no weights): 350 conversions, one calibration, 7 + 1 distillations."""
    check.teacher_config(check.REAL).save_pretrained(tmp_path / "teacher")
    made = {
        "dir": str(tmp_path / "teacher"),
        "corpus": str(tmp_path / "corpus"),
        "arc": str(tmp_path / "a.jsonl"),
    }
    made |= {"dtype": "bfloat16", "experts": 128, "top_k": 8}
    sets = check.grid_overrides(made, quick=False)
    values = {k: yaml.safe_load(v) for k, _, v in (o.partition("=") for o in sets)}
    assert values["teacher"]["model"] == made["dir"] and values["dense_teacher"] is None
    # exact: YAML's float of the text 1.0e-05 (PyYAML reads a bare 1e-05 as a string)
    assert values["distill"]["settings"]["min_lr"] == 1.0e-5
    env = _env(tmp_path)
    r = subprocess.run(
        check.moesweep(
            "launch", check.GRID_SWEEP, "--dry-run", "--json", *[a for o in sets for a in ("--set", o)]
        ),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    plan = json.loads(r.stdout)
    assert plan["sweep"] == check.GRID_NAME
    assert plan["grids"] == [{"output": 1, "scoring": 7, "grouping": 5, "dp_scaling": 2, "K": 5}]
    stages = {s["stage"]: s for s in plan["stages"]}
    assert stages["calibrate"]["distinct"] == 1 and stages["convert"]["distinct"] == 350
    assert stages["distill"]["distinct"] == 8 and stages["evaluate"]["distinct"] == 9


def test_flow_values_are_the_yaml_they_say():
    v = {
        "lr": 1.0e-4,
        "min_lr": 1e-05,
        "steps": 6,
        "on": True,
        "none": None,
        "path": "/tmp/a b: c",
        "K": [4, 16],
    }
    assert yaml.safe_load(check.flow(v)) == v
    assert check.flow(1e-05) == "1.0e-05" and check.flow(2.5) == "2.5"


def test_the_wheels_to_carry_are_what_the_machine_lacks(tmp_path):
    lock = (
        "# header\nnumpy==2.4.6 \\\n    --hash=sha256:aa\n    # via pandas\ntorch==2.13.0 \\\nray==2.60.0 \\\n"
        "lm-eval==0.4.13 \\\ntransformers==5.24.0 \\\nPyYAML==6.0.4 \\\nSQLAlchemy==2.1.9 \\\n"
    )
    held = "numpy==2.5.2  # another build: its own stays\ntransformers==5.17.0\npyyaml\nsqlalchemy==2.1.9\n"
    assert check.carry_pins(lock, held) == ["lm-eval==0.4.13", "transformers==5.24.0"]
    assert check.carry_pins(lock, "numpy\ntransformers==5.24.0\nPyYAML\nlm_eval\nsqlalchemy\n") == []
    assert check.carry_pins(lock, "") == [
        "numpy==2.4.6",
        "lm-eval==0.4.13",
        "transformers==5.24.0",
        "PyYAML==6.0.4",
        "SQLAlchemy==2.1.9",
    ]  # never torch (the machine's CUDA build) nor Ray (the check runs the serial executor)

    pins = [
        ln.split(" ")[0] for ln in (ROOT / "requirements" / "lock.txt").read_text().splitlines() if "==" in ln
    ]
    names = [p.split("==")[0] for p in pins if not p.lower().startswith(("sqlalchemy==", "transformers=="))]
    (tmp_path / "held.txt").write_text("\n".join(names) + "\ntransformers==0.0.1\n")
    r = _run(tmp_path, "--carry", str(tmp_path / "held.txt"), timeout=60)
    assert r.returncode == 0, r.stderr
    assert sorted(r.stdout.split()) == sorted(
        p for p in pins if p.lower().startswith(("sqlalchemy", "transformers"))
    )


def _dist(site: Path, name: str, version: str, *requires: str) -> None:
    """A distribution's metadata in `site` as pip would install it (no module needed for metadata)."""
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    lines = [
        "Metadata-Version: 2.1",
        f"Name: {name}",
        f"Version: {version}",
        *(f"Requires-Dist: {r}" for r in requires),
    ]
    (info / "METADATA").write_text("\n".join(lines) + "\n")


def test_unmet_requirements_of_the_installed_packages_are_named(tmp_path, monkeypatch):
    import packaging

    _dist(
        tmp_path,
        "carried-pkg",
        "1.0",
        "packaging>=999",  # installed, too old
        "no-such-dist-anywhere>=1",  # absent
        "rich",  # met
        'never-here; extra == "docs"',  # an extra: not required
        'never-here-either; python_version < "3"',  # a marker that is false here
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert check.requirement_conflicts(["carried-pkg", "not-installed-at-all"]) == [
        "carried-pkg 1.0 needs no-such-dist-anywhere>=1, absent",
        f"carried-pkg 1.0 needs packaging>=999, has {packaging.__version__}",
    ]
    assert check.requirement_conflicts(["rich", "pyyaml"]) == []


def test_the_probe_names_a_shadowed_package_and_a_module_that_fails_to_import(tmp_path, monkeypatch):
    """As on a GPU machine with wheels installed --no-deps in front of its own packages (PYTHONPATH)."""
    site = tmp_path / "site"
    _dist(site, "datasets", "5.2.0", "pyarrow>=9999")  # shadows the real metadata, as a carried wheel would
    (site / "lm_eval").mkdir()
    (site / "lm_eval" / "__init__.py").write_text("raise ImportError('needs a newer thing\\nsecond line')\n")
    monkeypatch.setenv("PYTHONPATH", str(site))
    got = check.probe("cpu")
    assert "lm_eval (ImportError: needs a newer thing second line)" in got["missing"], got["missing"]
    import pyarrow

    assert got["conflicts"] == [f"datasets 5.2.0 needs pyarrow>=9999, has {pyarrow.__version__}"]
    header = check.header_lines({**got, "date": "d", "commit": "c"})
    assert header[-1] == f"unmet requirements: datasets 5.2.0 needs pyarrow>=9999, has {pyarrow.__version__}"
    assert "missing modules: " in header[1] and "lm_eval (ImportError" in header[1]


def test_wheels_are_downloaded_for_the_machines_python_else_built_from_source(tmp_path):
    calls = []

    def pip(cmd, **kw):  # a fake pip: "sdist-only" has no wheel, "broken" cannot be built either
        calls.append(cmd)
        pin, verb = cmd[-1], cmd[3]
        fails = (verb == "download" and pin.startswith(("sdist-only", "broken"))) or (
            verb == "wheel" and pin.startswith("broken")
        )
        return subprocess.CompletedProcess(cmd, 1 if fails else 0)

    pins = ["good==1.0", "sdist-only==2.0", "broken==3.0"]
    built, failed = check.fetch_wheels(pins, tmp_path / "w", "3.12", run=pip)
    assert (built, failed) == (["sdist-only==2.0"], ["broken==3.0"])
    assert (tmp_path / "w").is_dir()
    downloads = [c for c in calls if c[3] == "download"]
    assert [c[-1] for c in downloads] == pins and [c[-1] for c in calls if c[3] == "wheel"] == pins[1:]
    for c in downloads:
        assert {"--no-deps", "--only-binary=:all:", "--python-version=3.12", "--implementation=cp"} <= set(c)
        assert [c[i + 1] for i, x in enumerate(c) if x == "-d"] == [str(tmp_path / "w")]
        assert {f"--platform={p}" for p in check.PLATFORMS} <= set(c)


def test_wheels_and_python_flags_are_checked(tmp_path):
    r = _run(tmp_path, "--wheels", str(tmp_path / "w"), timeout=60)
    assert (
        r.returncode == 2
        and r.stderr.strip() == "gpu_check: --wheels: only with --carry HELD (which packages to fetch)"
    )
    (tmp_path / "held.txt").write_text("numpy\n")
    r = _run(tmp_path, "--carry", str(tmp_path / "held.txt"), "--wheels", "w", "--python", "3", timeout=60)
    assert r.returncode == 2 and "--python '3': allowed a CPython version MAJOR.MINOR" in r.stderr
    assert not (tmp_path / "w").exists()


def test_the_benchmarks_run_first_whatever_order_only_names():
    """A budget too short for everything cuts the grid, not the measurements a lent GPU is for."""
    assert check.parse_args([]).steps == ["c", "a", "b", "d"]
    assert check.parse_args(["--only", "d,b,a"]).steps == ["a", "b", "d"]
    assert check.parse_args(["--only", "b,c"]).steps == ["c", "b"]
    assert check.STEP_S["c"] >= max(check.STEP_S["a"], check.STEP_S["b"])
