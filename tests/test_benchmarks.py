"""The benchmark scripts still run: each one's --smoke mode (seconds, tiny sizes, one repetition,
the same code paths) as a subprocess, offline, with its home and working directory in tmp_path.
Timings are never checked: only that the script exits 0 and prints its ratio lines (fault_injection.py: its
table's zeros of lost, duplicated and differing rows and of processes left behind)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow

SCRIPTS = {  # script → lines its smoke run must print (numbers, never checked against targets)
    "bench_calibration.py": [
        r"^loop / batched\s+:\s+\d+\.\d+x",
        r"^batched / raw throughput:\s+\d+\.\d+%",
        r"^batched vs loop stats\s+: max rel diff \d\.\d+e[-+]\d+$",
        r"^previous / batched time :\s+\d+\.\d+x",
        r"^non-matmul traffic/token: \d+\.\d kB, previous \d+\.\d kB \(\d+\.\d+x less now\)$",
        r"^batched vs previous\s+: max rel diff \d\.\d+e[-+]\d+$",
    ],
    "bench_predistill.py": [
        r"^naive / in-memory, per configuration \(build\+eval\)\s+:\s+\d+\.\d+x",
        r"^max relative \|Δppl\| between the paths\s+: \d\.\d+e[-+]\d+",
    ],
    # faults injected, sweeps completed ≥ 1; rows lost, duplicated, differing and processes left behind: 0
    "fault_injection.py": [
        rf"^\| {kind} \| [1-9]\d* \| [1-9]\d* \| 0 \| 0 \| 0 \| 0 \|"
        for kind in ("kill-serial", "raise", "corrupt", "bitrot", "special", "caches")
    ],
    "bench_edited.py": [
        r"^MoBE infer direct / pruned : \d+\.\d+x$",
        r"^MoBE train rebuild / direct: \d+\.\d+x$",
    ],
    "bench_expert_maxima.py": [
        r"^all-experts / routed: \d+\.\d+x$",
        r"^max \|Δ\| between the passes: \d\.\d+e[-+]\d+$",
    ],
    "bench_kd_loss.py": [
        r"^autograd / fused\s+:\s+\d+\.\d+x",
        r"^fused / FLOP time\s+:\s+\d+\.\d+x",
        r"^fused vs autograd\s+: max rel diff \d\.\d+e[-+]\d+",
        r"^compiled / FLOP time\s+:\s+\d+\.\d+x",
        r"^compiled vs autograd\s+: max rel diff \d\.\d+e[-+]\d+",
    ],
    "bench_rounding.py": [r"^sequential / greedy_round: \d+\.\d+x$", r"^same assignment  : True$"],
    "bench_orchestration.py": [
        r"^executor serial: exit code 0, [1-9]\d* jobs$",
        r"^  wall / Σ compute = \d+\.\d+$",
        r"overhead \(wall − ideal\)/ideal = -?\d+\.\d+%$",
    ],
}


def smoke_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MOESWEEP_", "PYTHON"))}
    env.update(
        PYTHONPATH=str(ROOT),
        MOESWEEP_HOME=str(tmp_path / "home"),
        TMPDIR=str(tmp_path),
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        RAY_DEDUP_LOGS="0",
    )
    return env


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_smoke_mode_runs(script, tmp_path):
    r = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--smoke"],
        cwd=tmp_path,
        env=smoke_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    for pattern in SCRIPTS[script]:
        assert re.search(pattern, r.stdout, flags=re.MULTILINE), f"{pattern!r} not in:\n{r.stdout[-3000:]}"
