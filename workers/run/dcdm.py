"""Run function of the stage `dcdm`: dynamic calibration-dataset mixing over the calibration's sources."""

from __future__ import annotations

from pathlib import Path

from workers.run.common import _metric
from workers.run.runtime import (
    artifact,
    device,
    resident_teacher,
    windows,
)


def stage_dcdm(payload: dict, cache: dict, progress) -> dict:
    """DCDM for one configuration ("Compressing Large MoE Models via Efficient Pruning and Data-Aware
    Calibration", §4.2, Algorithm 2; workers/calibration/dcdm.py): every round's weights, per-domain discrepancies and
    perplexities as metric rows (`step` = the round, `task` = the source), the final mix and its plan."""
    import math

    from workers.calibration.calibrate import load_source_stats
    from workers.calibration.dcdm import DCDMSpec, run_dcdm
    from workers.families import get_adapter
    from workers.methods.planning import plan_signature

    p = payload["params"]
    spec = DCDMSpec(**p["dcdm"])
    model, tok = resident_teacher(payload, cache)
    per_source = load_source_stats(payload["inputs"]["calibrate"]["stats"])
    held = {
        name: windows(payload, cache, tok, data, spec.seq_len, spec.n_eval, spec.seed)
        for name, data in p["held_out"].items()
    }
    cb = (lambda i, n: progress(i, n, "dcdm")) if progress else None
    res = run_dcdm(
        model,
        get_adapter(model),
        per_source,
        held,
        spec,
        p["n_samples"],
        p["convert"],
        Path(payload["workdir"]),
        device(),
        progress=cb,
    )
    extra = {"metric": spec.metric, "temperature": spec.temperature, "w0": spec.w0}
    metrics = [
        _metric("dcdm_weight", w, stage="dcdm", task=name, step=t, extra=extra)
        for t, ws in enumerate(res.trajectory)
        for name, w in ws.items()
    ]
    for r in res.rounds:
        for name, m in r["domains"].items():
            metrics += [
                _metric(
                    "dcdm_discrepancy",
                    r["discrepancy"][name],
                    stage="dcdm",
                    task=name,
                    step=r["round"],
                    n_tokens=m["tokens"],
                    extra={**extra, "kl": m["kl"]},
                ),
                _metric(
                    "dcdm_ppl",
                    math.exp(m["nll_student"]),
                    stage="dcdm",
                    task=name,
                    who="student",
                    step=r["round"],
                    sum_nll=m["nll_student"] * m["tokens"],
                    n_tokens=m["tokens"],
                ),
                _metric("dcdm_samples", float(r["counts"][name]), stage="dcdm", task=name, step=r["round"]),
            ]
    first = res.rounds[0]["domains"]  # the teacher's perplexity is the same every round
    metrics += [
        _metric(
            "dcdm_ppl",
            math.exp(m["nll_teacher"]),
            stage="dcdm",
            task=name,
            who="teacher",
            sum_nll=m["nll_teacher"] * m["tokens"],
            n_tokens=m["tokens"],
        )
        for name, m in first.items()
    ]
    rounds = [
        {
            "round": r["round"],
            "weights": r["weights"],
            "counts": r["counts"],
            "discrepancy": r["discrepancy"],
            "plan_key": plan_signature(r["plans"]),
        }
        for r in res.rounds
    ]
    return {
        "outputs": {
            "weights": res.weights,
            "stop": res.stop,
            "rounds": len(res.rounds),
            "plan_key": plan_signature(res.plans),
            "plan_path": str(res.plan_path),
            "trajectory": res.trajectory,
            "history": rounds,
        },
        "metrics": metrics,
        "artifacts": [artifact("plan", res.plan_path)],
    }
