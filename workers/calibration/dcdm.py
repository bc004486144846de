"""Dynamic Calibration Dataset Mixing (DCDM): "Compressing Large MoE Models via Efficient Pruning and
Data-Aware Calibration", §4.2, Algorithm 2.

Given N_D calibration domains, start from mixing weights w⁰ and repeat for t = 1..T: compress the
ORIGINAL teacher with the configuration's own method on the calibration mix w^{t−1}, measure the
discrepancy d^t_i between the compressed model and the teacher on held-out data of each domain i, and
set w^t = softmax(d^t / temperature), so a domain the compressed model serves worse is sampled more in
the next round. Stop when the weights stop changing, or after T rounds.

No calibration pass is repeated: statistics are sums over tokens, so the statistics of a mixture are a
reweighting of each source's own sums (workers.calibration.calibrate.mix_stats). Each round costs one compression
(workers.models.outputs.convert_plans, the same code a conversion job runs) plus, per domain, a teacher and a
student forward over `n_eval` held-out windows (the teacher is recomputed per round, never cached: its
logits over a large vocabulary do not fit in memory for a real model).

Where the paper is silent:
- the discrepancy is an O(1)-scale output-level metric, since the paper's softmax has no temperature:
  `kl` = the mean per-token KL(teacher ‖ student) of next-token distributions, or `log_ppl` = the gap
  of mean per-token negative log-likelihoods (log-perplexity of the student minus the teacher's);
- `temperature` (default 1.0 = the paper) divides d before the softmax;
- w⁰ is `uniform` (the paper's "Fixed" mix is 1:1:1, so its pools were equal-sized) or `tokens`
  (proportional to each source's calibration tokens, the paper's w⁰_i = |D_i| / Σ_j |D_j|);
- "w^t == w^{t−1}" on floats: stop when the largest-remainder integer counts of the n calibration
  samples repeat (`counts`), when max_i |w^t_i − w^{t−1}_i| < tol (`tol`), or when the counts return
  to those of an earlier round (`cycle`); otherwise after `max_iters` rounds (`max_iters`);
- the result is the last round's compression, and its weights w^{t−1} (the mix that compression was
  made from), so a conversion with those weights reproduces its plan exactly. Every round is logged.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from workers.calibration.dcdm_spec import METRICS, W0_RULES, DCDMSpec


# ---- the update and the stopping rule ---------------------------------------------------------------
def initial_weights(tokens: dict[str, int], rule: str) -> dict[str, float]:
    """w⁰: equal weights, or each source's share of the calibration tokens (the paper's |D_i| / Σ|D_j|)."""
    if rule == "uniform":
        return {name: 1.0 / len(tokens) for name in tokens}
    if rule == "tokens":
        total = sum(tokens.values())
        if total <= 0:
            raise ValueError("w0='tokens': the sources have no tokens")
        return {name: n / total for name, n in tokens.items()}
    raise ValueError(f"w0={rule!r}: allowed {', '.join(W0_RULES)}")


def softmax_weights(d: dict[str, float], temperature: float = 1.0) -> dict[str, float]:
    """w = exp(d / τ) / ‖exp(d / τ)‖₁ (§4.2, Algorithm 2 line 5; τ = 1 is the paper), max-shifted."""
    if not d:
        raise ValueError("no discrepancy to turn into weights")
    bad = [name for name, v in d.items() if not math.isfinite(v)]
    if bad:
        raise ValueError(f"discrepancy of {', '.join(bad)} is not finite: {[d[n] for n in bad]}")
    top = max(v / temperature for v in d.values())
    e = {name: math.exp(v / temperature - top) for name, v in d.items()}
    z = sum(e.values())
    return {name: v / z for name, v in e.items()}


def sample_counts(w: dict[str, float], n: int) -> dict[str, int]:
    """The integer sample counts of `n` calibration samples drawn with proportions `w` (Algorithm 2
    line 2): largest-remainder rounding (ties by source order), then at least one sample per domain when
    n allows, taken from the largest count."""
    if n < 1:
        raise ValueError(f"n={n}: must be a positive integer")
    total = sum(w.values())
    quota = {name: n * v / total for name, v in w.items()}
    counts = {name: math.floor(q) for name, q in quota.items()}
    order = sorted(quota, key=lambda name: -(quota[name] - counts[name]))  # stable: source order on ties
    for name in order[: n - sum(counts.values())]:
        counts[name] += 1
    if n >= len(w):
        for name in w:
            if counts[name] == 0:
                counts[max(counts, key=counts.get)] -= 1
                counts[name] = 1
    return counts


def stop_reason(history: list[dict[str, float]], n: int, tol: float) -> str | None:
    """Why DCDM stops after the newest weights `history[-1]` (history = w⁰ … w^t), or None to go on.

    `counts`: its integer counts equal the previous round's (the sampled calibration set would repeat);
    `tol`: no weight moved by tol or more; `cycle`: its counts equal those of an earlier round (the
    iteration oscillates and would never settle)."""
    if len(history) < 2:
        return None
    new, prev = history[-1], history[-2]
    counts = sample_counts(new, n)
    if counts == sample_counts(prev, n):
        return "counts"
    if max(abs(new[name] - prev[name]) for name in new) < tol:
        return "tol"
    if any(counts == sample_counts(w, n) for w in history[:-2]):
        return "cycle"
    return None


# ---- the discrepancy -------------------------------------------------------------------------------
@torch.no_grad()
def domain_discrepancy(
    teacher, student, ids: torch.Tensor, batch_size: int, device: torch.device | str
) -> dict[str, float]:
    """Next-token distributions of teacher and student on held-out windows `ids` [n, S]: the mean
    per-token KL(teacher ‖ student), each model's mean negative log-likelihood, and the token count."""
    kl = nll_t = nll_s = 0.0
    tokens = 0
    for i in range(0, len(ids), batch_size):
        batch = ids[i : i + batch_size].to(device)
        target = batch[:, 1:]
        lt = torch.log_softmax(teacher(input_ids=batch, use_cache=False).logits[:, :-1].float(), dim=-1)
        ls = torch.log_softmax(student(input_ids=batch, use_cache=False).logits[:, :-1].float(), dim=-1)
        kl += (lt.exp() * (lt - ls)).sum().item()
        nll_t -= lt.gather(-1, target.unsqueeze(-1)).sum().item()
        nll_s -= ls.gather(-1, target.unsqueeze(-1)).sum().item()
        tokens += target.numel()
    return {"kl": kl / tokens, "nll_teacher": nll_t / tokens, "nll_student": nll_s / tokens, "tokens": tokens}


def discrepancy(m: dict[str, float], metric: str) -> float:
    """d_i of one domain: the mean KL, or the student's log-perplexity minus the teacher's."""
    if metric == "kl":
        return m["kl"]
    if metric == "log_ppl":
        return m["nll_student"] - m["nll_teacher"]
    raise ValueError(f"metric={metric!r}: allowed {', '.join(METRICS)}")


# ---- one compression from a mix ----------------------------------------------------------------------
def compress(
    model, adapter, per_source: dict, weights: dict[str, float], params: dict[str, Any], workdir: Path
) -> tuple[list, Any, Path]:
    """The configuration's own compression of the ORIGINAL teacher from the per-source statistics mixed
    with `weights` (§4.2, Algorithm 2 line 3): (plans, student, plan file). The same code a conversion
    job runs (workers.models.outputs.convert_plans) and a student evaluation builds from (workers.models.outputs)."""
    from workers.calibration.calibrate import mix_stats
    from workers.models.convert import layer_contexts
    from workers.models.outputs import convert_plans, write_student
    from workers.models.plans import plan_to_dict

    workdir.mkdir(parents=True, exist_ok=True)
    contexts = layer_contexts(model, adapter, mix_stats(per_source, weights))
    plans, _ = convert_plans(contexts, {**params, "workdir": str(workdir)})
    path = workdir / "plan.json"
    path.write_text(json.dumps([plan_to_dict(pl) for pl in plans], indent=1))
    student = write_student(
        params.get("output") or "dense", model, adapter, plans, share_weights=True, plan_path=str(path)
    )
    return plans, student, path


# ---- the loop ----------------------------------------------------------------------------------------
@dataclass
class DCDMResult:
    weights: dict[str, float]  # the final mix: the weights the last round's compression was made from
    plans: list
    plan_path: Path
    stop: str  # counts | tol | cycle | max_iters
    trajectory: list[dict[str, float]]  # w⁰ … w^t
    rounds: list[dict[str, Any]] = field(default_factory=list)  # per round t: weights used, d^t, per domain


def run_dcdm(
    model,
    adapter,
    per_source: dict,
    held_out: dict[str, torch.Tensor],
    spec: DCDMSpec,
    n_samples: int,
    params: dict[str, Any],
    workdir: Path,
    device: torch.device | str,
    progress: Callable[[int, int], None] | None = None,
) -> DCDMResult:
    """Algorithm 2 of §4.2 for one configuration (`params`: its output, method, K and settings, as a
    conversion job's). `held_out[name]`: the held-out windows of each source's domain."""
    from workers.calibration.calibrate import source_tokens

    if set(held_out) != set(per_source):
        raise ValueError(
            f"held-out data for {sorted(held_out)}; the calibration sources are {sorted(per_source)}"
        )
    if len(per_source) < 2:
        raise ValueError(f"DCDM mixes domains: the calibration has {len(per_source)} source(s), needs >= 2")
    history = [initial_weights({name: source_tokens(st) for name, st in per_source.items()}, spec.w0)]
    rounds: list[dict[str, Any]] = []
    stop, last = "max_iters", None
    for t in range(1, spec.max_iters + 1):
        used = history[-1]
        plans, student, path = compress(model, adapter, per_source, used, params, workdir / f"round{t}")
        student.to(device).eval()
        per_domain = {
            name: domain_discrepancy(model, student, ids, spec.batch_size, device)
            for name, ids in held_out.items()
        }
        del student
        d = {name: discrepancy(m, spec.metric) for name, m in per_domain.items()}
        history.append(softmax_weights(d, spec.temperature))  # Algorithm 2 line 5
        rounds.append(
            {
                "round": t,
                "weights": used,
                "counts": sample_counts(used, n_samples),
                "discrepancy": d,
                "domains": per_domain,
                "plans": plans,
                "plan_path": path,
            }
        )
        last = rounds[-1]
        if progress is not None:
            progress(t, spec.max_iters)
        reason = stop_reason(history, n_samples, spec.tol)  # Algorithm 2 line 6
        if reason is not None:
            stop = reason
            break
    assert last is not None
    return DCDMResult(
        weights=last["weights"],
        plans=last["plans"],
        plan_path=last["plan_path"],
        stop=stop,
        trajectory=history,
        rounds=rounds,
    )
