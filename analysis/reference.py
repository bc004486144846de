"""Published numbers as reference sweeps: the core paper's, the smaller MoEs of the Router KD, REAP and
C2F/DCDM papers, and DOT-MoE's dense → MoE models (at the end of this file).

Each paper table becomes configurations with the same axes and metric names as our own runs
(workers/run/evaluate.py), so one query over the `results` view covers both. Accuracies are stored as
fractions (the CSVs give percentages); the paper's own "avg" column is kept as `avg_published`
and Table 12's stated pre-distill PPL as `ppl_published`, next to the numbers the views compute.

Reference sweeps mirror our sweep files: "paper:qwen3-30b-a3b" holds what sweeps/paper-qwen3-30b-a3b
runs (the 350-grid of Tables 10/11 with the 35 students of Table 12 marked as selected, the
distillation variants of Tables 4/5, the baselines of Table 3 and the dense-to-dense search of
Table 13).

Identities are stored, never inferred: each sweep carries the selection rule the paper used for it
(`select`, stored as `sweeps.select_json`), and the Table 4/5 rows are distillation variants with a
`variant` label (e.g. `teacher_top_k=16`, `loss=reverse_kl`) and `variant_of_key`, the config_key of the
main configuration they vary (stored as `configurations.variant_of`).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from db.axes import default_rule, kind_of

DATA = Path(__file__).parent / "data"
PAPER = "arXiv:2605.28207"
SOURCE = f"paper:{PAPER}"
CITATION = f"Kim et al. 2026, Pruning and Distilling Mixture-of-Experts into Dense Language Models ({PAPER})"

TASKS = ("winogrande", "hellaswag", "arc_easy", "arc_challenge", "mmlu")
# the paper does not say acc vs acc_norm; these are lm-eval's usual headline metrics (§4.1)
HEADLINE = {
    "winogrande": "acc",
    "hellaswag": "acc_norm",
    "arc_easy": "acc_norm",
    "arc_challenge": "acc_norm",
    "mmlu": "acc",
}
FEWSHOT = {"winogrande": 5, "hellaswag": 10, "arc_easy": 25, "arc_challenge": 25, "mmlu": 5}  # §4.1

# model label = the last part of the Hugging Face id, as our sweeps write it (orchestrator.stages.teacher.teacher_label)
MODEL_LABEL = {
    "Qwen3-30B-A3B": "Qwen3-30B-A3B",
    "Qwen3-30B-A3B-Base": "Qwen3-30B-A3B-Base",
    "DeepSeek-V2-Lite": "DeepSeek-V2-Lite",
    "GPT-OSS-20B": "gpt-oss-20b",
}
MAIN = "paper:qwen3-30b-a3b"

# the selection rules between stages (§4.1): the Qwen3 study picks, per scoring × grouping, the
# (K, scaling) with the lowest pre-distill PPL; the base teacher (Table 8) and the cross-model sweeps
# (Tables 16/17) distill each scoring at several K, one student per scoring × K
RULE_PAIR = default_rule()  # the paper's §4.1 rule, every sweep's default (db/axes.py)
RULE_BASE = {"best_by": "ppl_pre", "per": ["scoring", "K"], "over": ["grouping", "dp_scaling"]}
RULE_CROSS = {"best_by": "ppl_pre", "per": ["scoring", "K"], "over": ["dp_scaling"]}

# Table 3 rows that are Table 12 students (printed to one decimal): not imported twice
TABLE3_STUDENTS = {
    "DO-ACP, K=8 (best)": ("DO-ACP", "RR"),
    "SF x AB (MC-SMoE metrics)": ("SF", "AB"),
    "SF x OC (HC-SMoE metrics)": ("SF", "OC"),
}
BASELINE_NAMES = {
    "random ffn + teacher attn": "random_ffn",
    "random ffn": "random_ffn",
    "random initialization": "random_init",
    "random init": "random_init",
}
LOSS_NAMES = {
    "forward_kl": "forward_kl",
    "reverse_kl": "reverse_kl",
    "intermediate (logit KL + hidden MSE)": "intermediate",
}


def read_table(name: str) -> list[dict[str, str]]:
    """Rows of one shipped CSV (analysis/data/NAME.csv) as strings."""
    path = DATA / f"{name}.csv"
    if not path.exists():
        raise ValueError(
            f"reference table {name!r}: no file {path}; allowed: "
            f"{', '.join(sorted(p.stem for p in DATA.glob('*.csv')))}"
        )
    with path.open(newline="") as f:
        return [{k: (v or "").strip() for k, v in r.items()} for r in csv.DictReader(f)]


def _num(s: str) -> float | None:
    return float(s) if s != "" else None


def _int(s: str) -> int | None:
    return int(s) if s != "" else None


def _scaled(s: str) -> float | None:
    """'30.5B' -> 30.5e9 (Tables 2/18 print parameter counts that way)."""
    if s == "":
        return None
    mult = {"K": 1e3, "M": 1e6, "B": 1e9}.get(s[-1].upper())
    return float(s[:-1]) * mult if mult else float(s)


def _ppl(stage: str, s: str, table: str) -> dict[str, Any]:
    """A perplexity; an empty grid cell is the paper's '–' (numerical instability), kept as non-finite."""
    if s == "":
        return {
            "name": "ppl",
            "stage": stage,
            "value": None,
            "value_kind": "nan",
            "extra": {"table": table, "published": "–"},
        }
    return {"name": "ppl", "stage": stage, "value": float(s), "extra": {"table": table}}


def _accuracies(row: dict[str, str], table: str) -> list[dict[str, Any]]:
    out = []
    for t in TASKS:
        if row.get(t, "") == "":
            continue
        out.append(
            {
                "name": HEADLINE[t],
                "stage": "post",
                "task": t,
                "value": float(row[t]) / 100.0,
                "headline": 1,
                "num_fewshot": FEWSHOT[t],
                "extra": {"table": table, "published_percent": row[t]},
            }
        )
    if row.get("avg", "") != "":
        out.append(
            {
                "name": "avg_published",
                "stage": "post",
                "value": float(row["avg"]) / 100.0,
                "extra": {"table": table, "published_percent": row["avg"]},
            }
        )
    return out


def _top_k() -> dict[str, int]:
    return {MODEL_LABEL[r["model"]]: int(r["top_k"]) for r in read_table("table2_18_architectures")}


def _d2d_name(r: dict[str, str]) -> str:
    return f"{r['strategy']}-L{r['layers']}-H{r['hidden']}-F{r['d_dense']}"


def _baseline_cfg(
    label: str,
    model: str,
    top_k: int | None,
    table: str,
    tokens: str | None,
    metrics: list[dict[str, Any]],
    variant: str | None,
) -> dict[str, Any]:
    """A Table 3/6/8/16/17 row that is not a MoE→dense student."""
    low = label.lower()
    base = BASELINE_NAMES.get(low)
    if base is not None:
        return {
            "config_key": f"baseline:{base}",
            "model": model,
            "kind": "baseline",
            "baseline": base,
            "teacher_variant": variant,
            "top_k": top_k,
            "distill_tokens": tokens,
            "selected_for_distill": 1,
            "table": table,
            "note": label,
            "metrics": metrics,
        }
    if low.startswith("teacher") or low.startswith("d2d teacher"):
        name = label.split("(")[-1].rstrip(")") if "(" in label else model
        own = MODEL_LABEL.get(name, name)
        dense = low.startswith("d2d")
        return {
            "config_key": "teacher" if not dense else f"teacher:{own}",
            "model": own,
            "kind": "teacher",
            "baseline": "dense_teacher" if dense else None,
            "teacher_variant": variant if not dense else None,
            "top_k": top_k if not dense else None,
            "table": table,
            "note": label,
            "metrics": metrics,
        }
    raise ValueError(
        f"reference row {label!r} in {table}: not a known baseline; allowed: "
        f"{', '.join(sorted(BASELINE_NAMES))}, Teacher (...), D2D Teacher (...)"
    )


# ---- the sweeps ---------------------------------------------------------------------------------
def qwen3_main() -> dict[str, Any]:
    """Tables 10/11 (grid), 12 (distilled), 3 (baselines), 4/5 (variants), 13 (dense-to-dense search)."""
    model, k = "Qwen3-30B-A3B", _top_k()["Qwen3-30B-A3B"]
    common = {"model": model, "teacher_variant": "instruct", "kind": "moe2dense", "top_k": k}
    configs: dict[str, dict[str, Any]] = {}
    for r in read_table("table10_11_predistill_ppl_grid"):
        if MODEL_LABEL[r["model"]] != model or r["teacher_variant"] != "instruct":
            raise ValueError(
                f"table10_11: model {r['model']!r}/{r['teacher_variant']!r}; allowed: {model}/instruct"
            )
        key = f"{r['scoring']}|{r['grouping']}|{r['dp_scaling']}|K={r['K']}"
        configs[key] = {
            "config_key": key,
            **common,
            "scoring": r["scoring"],
            "grouping": r["grouping"],
            "dp_scaling": r["dp_scaling"],
            "K": int(r["K"]),
            "selected_for_distill": 0,
            "table": "table10_11",
            "metrics": [_ppl("pre", r["pre_distill_ppl"], "table10_11")],
        }
    for r in read_table("table12_distilled_35"):
        key = f"{r['scoring']}|{r['grouping']}|{r['dp_scaling']}|K={r['K']}"
        if key not in configs:
            raise ValueError(f"table12: configuration {key!r} is not in the Table 10/11 grid")
        cfg = configs[key]
        cfg.update(selected_for_distill=1, distill_tokens=r["distill_tokens"], table="table10_11+table12")
        cfg["metrics"] += [
            _ppl("post", r["post_distill_ppl"], "table12"),
            {
                "name": "ppl_published",
                "stage": "pre",
                "value": float(r["pre_distill_ppl"]),
                "extra": {"table": "table12"},
            },
        ] + _accuracies(r, "table12")
    out = list(configs.values())
    best = ("DO-ACP", "RR", "uniform", 8)  # Tables 4/5 ablate "DO-ACP, K=8", the Table 12 best (§4.3)
    student = {
        **common,
        "scoring": best[0],
        "grouping": best[1],
        "dp_scaling": best[2],
        "K": best[3],
        "selected_for_distill": 1,
        "distill_tokens": "0.3B",
    }
    stem = f"{best[0]}|{best[1]}|{best[2]}|K={best[3]}"
    for r in read_table("table4_expanded_routing"):
        kp = int(r["k_prime"])
        out.append(
            {
                **student,
                "config_key": f"{stem}|teacher_top_k={kp}",
                "teacher_top_k": kp,
                "variant": f"teacher_top_k={kp}",
                "variant_of_key": stem,
                "table": "table4",
                "metrics": _accuracies(r, "table4"),
            }
        )
    for r in read_table("table5_loss_ablation"):
        loss = LOSS_NAMES.get(r["loss"])
        if loss is None:
            raise ValueError(f"table5: loss {r['loss']!r}; allowed: {', '.join(LOSS_NAMES)}")
        out.append(
            {
                **student,
                "config_key": f"{stem}|loss={loss}",
                "distill_loss": loss,
                "variant": f"loss={loss}",
                "variant_of_key": stem,
                "table": "table5",
                "metrics": _accuracies(r, "table5"),
            }
        )
    d2d_selected = None
    for r in read_table("table13_d2d_search"):
        name = _d2d_name(r)
        sel = r["selected"].lower() == "true"
        d2d_selected = name if sel else d2d_selected
        out.append(
            {
                "config_key": f"baseline:d2d:{name}",
                "model": model,
                "kind": "baseline",
                "baseline": f"d2d:{name}",
                "teacher_variant": "instruct",
                "selected_for_distill": int(sel),
                "table": "table13",
                "note": f"pruned from {r['teacher']} ({r['params']} parameters, {r['heads']} heads)",
                "metrics": [_ppl("pre", r["pre_distill_ppl"], "table13")],
            }
        )
    for r in read_table("table3_baselines"):
        label = r["configuration"]
        if label in TABLE3_STUDENTS:
            continue  # the same students as Table 12's rows (tests check the numbers agree)
        metrics = _accuracies(r, "table3")
        if label.startswith("D2D pruning"):
            cfg = next(c for c in out if c["config_key"] == f"baseline:d2d:{d2d_selected}")
            cfg.update(distill_tokens=r["distill_tokens"], table="table13+table3")
            cfg["metrics"] += metrics
            continue
        out.append(_baseline_cfg(label, model, k, "table3", r["distill_tokens"] or None, metrics, "instruct"))
    if stem not in configs:
        raise ValueError(f"tables 4/5: the ablated student {stem!r} is not in the Table 10/11 grid")
    return {
        "name": MAIN,
        "source": SOURCE,
        "select": RULE_PAIR,
        "configs": out,
        "description": f"{CITATION}: Qwen3-30B-A3B (instruct) study — Tables 10/11 (350-configuration "
        "pre-distill PPL grid), 12 (the 35 distilled students), 3 (baselines), 4/5 "
        "(teacher routing and loss ablations), 13 (dense-to-dense search).",
    }


def qwen3_extended() -> dict[str, Any]:
    """Table 6: ~4B-token distillation."""
    model, k = "Qwen3-30B-A3B", _top_k()["Qwen3-30B-A3B"]
    rows = {
        "DO-ACP, K=8": ("DO-ACP", "RR", "uniform", 8),  # the Table 12 configurations named in §4.5
        "SF, K=16 (weight clustering)": ("SF", "WC", "uniform", 16),
    }
    d2d = next(_d2d_name(r) for r in read_table("table13_d2d_search") if r["selected"].lower() == "true")
    out = []
    for r in read_table("table6_extended_training"):
        label, metrics = r["configuration"], _accuracies(r, "table6")
        if label in rows:
            s, g, dp, K = rows[label]
            out.append(
                {
                    "config_key": f"{s}|{g}|{dp}|K={K}",
                    "model": model,
                    "teacher_variant": "instruct",
                    "kind": "moe2dense",
                    "scoring": s,
                    "grouping": g,
                    "dp_scaling": dp,
                    "K": K,
                    "top_k": k,
                    "distill_tokens": r["distill_tokens"],
                    "selected_for_distill": 1,
                    "table": "table6",
                    "note": label,
                    "metrics": metrics,
                }
            )
        elif label.startswith("D2D pruning"):
            out.append(
                {
                    "config_key": f"baseline:d2d:{d2d}",
                    "model": model,
                    "kind": "baseline",
                    "baseline": f"d2d:{d2d}",
                    "teacher_variant": "instruct",
                    "distill_tokens": r["distill_tokens"],
                    "selected_for_distill": 1,
                    "table": "table6",
                    "note": label,
                    "metrics": metrics,
                }
            )
        elif r["model"] == "reference":
            name = label.split(" (")[0]
            out.append(
                {
                    "config_key": f"baseline:pretrained:{name}",
                    "model": name,
                    "kind": "baseline",
                    "baseline": "pretrained",
                    "table": "table6",
                    "note": label,
                    "metrics": metrics,
                }
            )
        else:
            out.append(_baseline_cfg(label, model, k, "table6", r["distill_tokens"], metrics, "instruct"))
    return {
        "name": "paper:qwen3-30b-a3b-4b",
        "source": SOURCE,
        "select": RULE_PAIR,
        "configs": out,
        "description": f"{CITATION}: Table 6, ~4B-token distillation of Qwen3-30B-A3B students "
        "and baselines.",
    }


def qwen3_base() -> dict[str, Any]:
    """Tables 7 (best pre-distill PPL per scoring, base teacher) and 8 (base teacher, K=8/16)."""
    model, k = "Qwen3-30B-A3B-Base", _top_k()["Qwen3-30B-A3B"]
    common = {"model": model, "teacher_variant": "base", "top_k": k}
    out = []
    for r in read_table("table7_base_vs_instruct_best_ppl"):
        # the instruct columns equal the Table 10/11 grid minima (tests check it); the base grid is
        # unpublished
        out.append(
            {
                "config_key": f"{r['scoring']}|best-of-grid",
                **common,
                "kind": "moe2dense",
                "scoring": r["scoring"],
                "table": "table7",
                "note": "best pre-distill PPL over the base-teacher 350-grid; its (grouping, scaling, K) "
                "is not published",
                "metrics": [_ppl("pre", r["base_best_ppl"], "table7")],
            }
        )
    for r in read_table("table8_base_teacher_distill"):
        metrics = _accuracies(r, "table8")
        if r["K"] == "":
            out.append(_baseline_cfg(r["scoring"], model, k, "table8", "0.3B", metrics, "base"))
            continue
        out.append(
            {
                "config_key": f"{r['scoring']}|K={r['K']}",
                **common,
                "kind": "moe2dense",
                "scoring": r["scoring"],
                "K": int(r["K"]),
                "distill_tokens": "0.3B",
                "selected_for_distill": 1,
                "table": "table8",
                "metrics": [_ppl("pre", r["pre_distill_ppl"], "table8")] + metrics,
            }
        )
    return {
        "name": "paper:qwen3-30b-a3b-base",
        "source": SOURCE,
        "select": RULE_BASE,
        "configs": out,
        "description": f"{CITATION}: Appendix I, the base teacher Qwen3-30B-A3B-Base — Table 7 (best "
        "pre-distill PPL per scoring) and Table 8 (distilled at K=8 and K=16).",
    }


def cross_model(csv_model: str) -> dict[str, Any]:
    """Tables 16 (DeepSeek-V2-Lite) and 17 (GPT-OSS-20B)."""
    model = MODEL_LABEL[csv_model]
    k = _top_k()[model]
    # §4.6: DeepSeek-V2-Lite does not renormalize top-k, so α_g is the group's average CP;
    # GPT-OSS: not stated
    dp = "avg_cp" if model == "DeepSeek-V2-Lite" else None
    variant = "base" if model == "DeepSeek-V2-Lite" else "instruct"
    table = "table16" if model == "DeepSeek-V2-Lite" else "table17"
    out = []
    for r in read_table("table16_17_cross_model"):
        if r["model"] != csv_model:
            continue
        metrics = _accuracies(r, table)
        if r["K"] == "":
            out.append(
                _baseline_cfg(
                    r["scoring"],
                    model,
                    k,
                    table,
                    None if r["scoring"] == "Teacher" else "0.3B",
                    metrics,
                    variant,
                )
            )
            continue
        out.append(
            {
                "config_key": f"{r['scoring']}|*|{dp or '*'}|K={r['K']}",
                "model": model,
                "kind": "moe2dense",
                "teacher_variant": variant,
                "scoring": r["scoring"],
                "dp_scaling": dp,
                "K": int(r["K"]),
                "top_k": k,
                "distill_tokens": "0.3B",
                "selected_for_distill": 1,
                "table": table,
                "metrics": metrics,
            }
        )
    for c in out:  # "Teacher (X)" rows are the teacher of this sweep's model
        if c["kind"] == "teacher":
            c.update(model=model, baseline=None, config_key="teacher", top_k=k, teacher_variant=variant)
    return {
        "name": f"paper:{model.lower()}",
        "source": SOURCE,
        "select": RULE_CROSS,
        "configs": out,
        "description": f"{CITATION}: {'Table 16' if table == 'table16' else 'Table 17'}, "
        f"cross-model validation on {csv_model} (§4.6), 0.3B-token distillation.",
    }


def architectures() -> dict[str, Any]:
    """Tables 2 and 18: teacher and student dimensions, one teacher configuration per model."""
    out = []
    for r in read_table("table2_18_architectures"):
        model = MODEL_LABEL[r["model"]]
        metrics = []
        for field in (
            "hidden",
            "d_expert",
            "routed_experts",
            "top_k",
            "shared_experts",
            "d_dense",
            "student_groups",
        ):
            metrics.append(
                {"name": field, "stage": "arch", "value": _int(r[field]), "extra": {"table": "table2_18"}}
            )
        for field in ("total_params", "active_params"):
            metrics.append(
                {
                    "name": field,
                    "stage": "arch",
                    "value": _scaled(r[field]),
                    "extra": {"table": "table2_18", "published": r[field]},
                }
            )
        for field in ("renormalize_topk", "first_layer_dense"):
            metrics.append(
                {
                    "name": field,
                    "stage": "arch",
                    "value": float(r[field].lower() == "true"),
                    "extra": {"table": "table2_18"},
                }
            )
        out.append(
            {
                "config_key": f"arch:{model}",
                "model": model,
                "kind": "teacher",
                "top_k": int(r["top_k"]),
                "table": "table2_18",
                "metrics": metrics,
            }
        )
    return {
        "name": "paper:architectures",
        "source": SOURCE,
        "configs": out,
        "description": f"{CITATION}: Tables 2 and 18, teacher and dense-student dimensions.",
    }


# ---- smaller MoEs: the Router KD paper and the REAP paper -------------------------------------------
# Their compressed models are configurations with `output` = moe (pruned), merged or edited, the method
# in the matching axis (`scoring`, `merging`, `editing`), `K` = experts kept per layer (for editing, the
# parameter budget of K experts) and `recovery` = none | router_kd, keyed as our own sweeps key them
# (`moe|REAP|K=80|recovery=none`, `merged|HC-SMoE|K=80|recovery=none`: the format of
# orchestrator.axes.config_key; tests check they agree). The method names are our registries' (REAP,
# EAN, frequency, CFES, HC-SMoE, M-SMoE, MoBE, TD-MoE). The same name in two papers need not be the same
# implementation (the Router KD paper ran each method's official code; the REAP paper's HC-SMoE is its
# own re-implementation, merging by frequency-weighted averaging), nor ours: each published smaller MoE
# carries its implementation, settings and calibration in `settings` (JSON, from
# analysis/data/method_implementations.csv), with whether ours is the same (`vs_ours`) and how it differs.
ROUTER_KD_TITLE = (
    "Hyeon and Do, Is Retraining-Free Enough? The Necessity of Router Calibration for Efficient MoE "
    "Compression (the Router KD paper)"
)
REAP_TITLE = (
    "Lasby et al., REAP the Experts: Why Pruning Prevails for One-Shot MoE Compression (the REAP paper)"
)
ROUTER_KD_SOURCE = "paper:Hyeon and Do (Router KD)"
REAP_SOURCE = "paper:Lasby et al. (REAP)"
ROUTER_KD_SWEEP = "paper:router-kd-qwen3-30b-a3b"
ROUTER_KD_MODEL = "Qwen3-30B-A3B-Instruct-2507"  # 128 routed experts, top-8 (Sec. 5.2)
# 62.5% expert retention of 128 experts (Sec. 5.1): the pruning methods (REAP; CFES with
# num_routed_expert=80) and the merging methods (HC-SMoE, M-SMoE) keep 80 experts per layer; the
# editing methods (MoBE, TD-MoE) keep all 128 and factorise them (MoBE to the same parameter budget, which
# our `edited` output states as K = 80, the budget of 80 experts; the paper's TD-MoE run removed 40% of the
# expert parameters of 18 of 48 layers instead, which seed001 sets as its TD-MoE settings)
ROUTER_KD_METHODS = {
    "REAP": ("pruning", 80),
    "CFES": ("pruning", 80),
    "MoBE": ("editing", 80),
    "TD-MoE": ("editing", 80),
    "HC-SMoE": ("merging", 80),
    "M-SMoE": ("merging", 80),
}
# paradigm → (our output, the axis that names the method)
PARADIGM_OUTPUT = {
    "pruning": ("moe", "scoring"),
    "merging": ("merged", "merging"),
    "editing": ("edited", "editing"),
}
# the Multi-Choice rows are the headline tasks (`results.avg_acc` is their mean, the other 16 rows are
# generative and stored as `score`); the paper does not say acc or acc_norm: named as lm-eval's usual
# headline metric, as our sweeps evaluate these tasks
ROUTER_KD_MC = {
    "arc_challenge": "acc_norm",
    "arc_easy": "acc_norm",
    "hellaswag": "acc_norm",
    "medmcqa": "acc",
    "medqa": "acc",
    "openbookqa": "acc_norm",
    "piqa": "acc_norm",
    "winogrande": "acc",
    "mmlu": "acc",
}
ROUTER_KD_TABLES = {
    "router_kd_table2": "router_kd_table2_qwen3_62p5",
    "router_kd_table3": "router_kd_table3_qwen3_62p5",
}
REAP_TABLE = "reap_table2_domain_calibration"
# the REAP paper's Table 1: routed experts per layer and router top-k
REAP_MODELS = {"Qwen3-30B-A3B": (128, 8), "GLM-4.5-Air": (128, 8)}
REAP_SCORING = {  # the paper's method → (our name, paradigm)
    "Frequency": ("frequency", "pruning"),
    "EAN": ("EAN", "pruning"),
    "REAP": ("REAP", "pruning"),
    "HC-SMoE": ("HC-SMoE", "merging"),
    "M-SMoE": ("M-SMoE", "merging"),
}
# Table 2's columns: per-task scores (fractions; WildBench: the normalised judge score) and its averages
REAP_TASKS = {
    "evalplus": "Eval+",
    "livecode": "LiveCode",
    "wildbench": "WildBench",
    "gsm8k": "GSM8K",
    "math500": "MATH-500",
}
REAP_TASK_NAME = {
    "evalplus": "evalplus",
    "livecode": "livecodebench",
    "wildbench": "wildbench",
    "gsm8k": "gsm8k",
    "math500": "math500",
}
REAP_AVERAGES = {"code_avg": "Code Avg", "math_avg": "Math Avg", "mc_avg": "MC Avg"}


IMPLEMENTATIONS_TABLE = "method_implementations"
# vs_ours: same (our method of that name is this implementation), differs (`difference` says how),
# unknown (the paper does not say enough to tell; `difference` says what is open), none (not ours)
VS_OURS = ("same", "differs", "unknown", "none")


def implementations() -> dict[tuple[str, str], dict[str, Any]]:
    """(paper, method) → what the paper ran under that name: `implementation`, `settings` (its flags as
    printed, a dict of strings), `calibration`, `vs_ours`, `difference` and `source`
    (analysis/data/method_implementations.csv; `paper` is router_kd, reap or c2f)."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for r in read_table(IMPLEMENTATIONS_TABLE):
        key = (r["paper"], r["method"])
        where = f"{IMPLEMENTATIONS_TABLE}: {r['paper']} {r['method']}"
        if key in out:
            raise ValueError(f"{where}: listed twice")
        if r["vs_ours"] not in VS_OURS:
            raise ValueError(f"{where}: vs_ours {r['vs_ours']!r}; allowed: {', '.join(VS_OURS)}")
        if (r["vs_ours"] == "same") == bool(r["difference"]):
            raise ValueError(f"{where}: `difference` must be empty exactly when vs_ours is same")
        settings: dict[str, str] = {}
        for part in (p.strip() for p in r["settings"].split(";")):
            name, eq, value = part.partition("=")
            if not part:
                continue
            if not eq or not name.strip():
                raise ValueError(f"{where}: setting {part!r}; expected NAME=VALUE, separated by ';'")
            settings[name.strip()] = value.strip()
        out[key] = {
            "implementation": r["implementation"],
            "settings": settings,
            "calibration": r["calibration"],
            "vs_ours": r["vs_ours"],
            "difference": r["difference"],
            "source": r["source"],
        }
    return out


def implementation_json(
    imps: dict[tuple[str, str], dict[str, Any]], paper: str, method: str, calibration: str | None = None
) -> str:
    """The `settings` JSON of a published smaller MoE: what `paper` ran as `method` (a row's own
    calibration, where the table varies it, replaces the method's)."""
    imp = imps.get((paper, method))
    if imp is None:
        raise ValueError(
            f"{IMPLEMENTATIONS_TABLE}: no row for paper {paper!r}, method {method!r}; listed: "
            f"{', '.join(m for p, m in imps if p == paper) or 'none'}"
        )
    if calibration is not None:
        imp = {**imp, "calibration": calibration}
    return json.dumps(imp, sort_keys=True)


def moe_key(method: str, K: int, recovery: str, output: str = "moe") -> str:
    """The config_key our sweeps give a smaller MoE (orchestrator.axes.config_key's format)."""
    return f"{output}|{method}|K={K}|recovery={recovery}"


def moe_fields(method: str, paradigm: str, K: int, recovery: str) -> dict[str, Any]:
    """A published smaller MoE's key and axis columns."""
    output, axis = PARADIGM_OUTPUT[paradigm]
    return {
        "config_key": moe_key(method, K, recovery, output),
        "kind": kind_of(output),
        "output": output,
        axis: method,
        "K": K,
        "recovery": recovery,
    }


def _router_kd_metrics(rows: list[dict[str, str]], column: str, table: str) -> list[dict[str, Any]]:
    out = []
    for r in rows:
        task = r["task"]
        if r.get(column, "") == "":
            raise ValueError(f"{table}: {column} has no value for {r['benchmark']!r} ({r['category']})")
        out.append(
            {
                "name": ROUTER_KD_MC.get(task, "score"),
                "stage": "post",
                "task": task,
                "value": float(r[column]),
                "headline": int(task in ROUTER_KD_MC),
                "extra": {
                    "table": table,
                    "category": r["category"],
                    "benchmark": r["benchmark"],
                    "published": r[column],
                },
            }
        )
    return out


def router_kd() -> dict[str, Any]:
    """The Router KD paper's Tables 2 and 3: Qwen3-30B-A3B-Instruct-2507 at 62.5% expert retention,
    six compression methods each without and with Router KD (the "-R" columns), 25 benchmarks."""
    common = {"model": ROUTER_KD_MODEL, "teacher_variant": "instruct", "top_k": 8}
    imps = implementations()
    out: list[dict[str, Any]] = []
    original: list[dict[str, Any]] | None = None
    for table, name in ROUTER_KD_TABLES.items():
        rows = read_table(name)
        tasks = [r["task"] for r in rows]
        if len(rows) != 25 or len(set(tasks)) != 25:
            raise ValueError(
                f"{name}: {len(rows)} rows, {len(set(tasks))} distinct tasks; expected 25 and 25"
            )
        methods = [c for c in rows[0] if c not in ("category", "benchmark", "task", "Original")]
        teacher = _router_kd_metrics(rows, "Original", table)
        if original is None:
            original = teacher
            out.append(
                {
                    "config_key": "teacher",
                    **common,
                    "kind": "teacher",
                    "table": table,
                    "note": "the original model (the tables' Original column)",
                    "metrics": teacher,
                }
            )
        else:
            if [m["value"] for m in teacher] != [m["value"] for m in original]:
                raise ValueError(f"{name}: the Original column differs from the first table's")
            out[0]["table"] += f"+{table}"
        for col in methods:
            method, recovery = (col[:-2], "router_kd") if col.endswith("-R") else (col, "none")
            if method not in ROUTER_KD_METHODS:
                raise ValueError(
                    f"{name}: column {col!r}; allowed: Original, "
                    f"{', '.join(f'{m}, {m}-R' for m in ROUTER_KD_METHODS)}"
                )
            paradigm, K = ROUTER_KD_METHODS[method]
            out.append(
                {
                    **moe_fields(method, paradigm, K, recovery),
                    **common,
                    "table": table,
                    "note": f"{paradigm}, 62.5% expert retention ({col})",
                    "settings": implementation_json(imps, "router_kd", method),
                    "metrics": _router_kd_metrics(rows, col, table),
                }
            )
    return {
        "name": ROUTER_KD_SWEEP,
        "source": ROUTER_KD_SOURCE,
        "select": None,
        "configs": out,
        "description": f"{ROUTER_KD_TITLE}: Tables 2 and 3, {ROUTER_KD_MODEL} at 62.5% expert retention — "
        "REAP, MoBE, HC-SMoE, CFES, TD-MoE and M-SMoE, each without and with Router KD, on 25 benchmarks.",
    }


def reap(model: str) -> dict[str, Any]:
    """The REAP paper's Table 2 for one model: frequency, EAN, REAP, HC-SMoE and M-SMoE at 25% and 50% of
    the experts pruned per layer, domain-specific calibration; coding, creative writing, math and MC."""
    if model not in REAP_MODELS:
        raise ValueError(f"REAP Table 2: model {model!r}; allowed: {', '.join(REAP_MODELS)}")
    E, k = REAP_MODELS[model]
    imps = implementations()
    out = []
    for r in read_table(REAP_TABLE):
        if r["model"] != model:
            continue
        filled = dict(f.split(":", 1) for f in r["filled_from"].split(";") if f)
        # Qwen3-30B-A3B's coding and MC columns are 3-seed means; its other columns and GLM's are 1 seed
        seeds = {
            c: 3 if model == "Qwen3-30B-A3B" and c in ("evalplus", "livecode", "code_avg", "mc_avg") else 1
            for c in (*REAP_TASKS, *REAP_AVERAGES)
        }
        metrics = []
        for col, label in REAP_TASKS.items():
            if r[col] != "":
                metrics.append(
                    {
                        "name": "score",
                        "stage": "post",
                        "task": REAP_TASK_NAME[col],
                        "value": float(r[col]),
                        "extra": {
                            "table": "reap_table2",
                            "column": label,
                            "published": r[col],
                            "seeds": seeds[col],
                        },
                    }
                )
        for col, label in REAP_AVERAGES.items():
            if r[col] != "":
                extra = {"table": "reap_table2", "column": label, "published": r[col], "seeds": seeds[col]}
                if col in filled:
                    extra["filled_from"] = filled[col]
                metrics.append(
                    {
                        "name": "avg_published" if col == "mc_avg" else col,
                        "stage": "post",
                        "value": float(r[col]),
                        "extra": extra,
                    }
                )
        common = {
            "model": model,
            "teacher_variant": "instruct",
            "top_k": k,
            "table": "reap_table2",
            "metrics": metrics,
        }
        if r["ratio"] == "":
            out.append({"config_key": "teacher", **common, "kind": "teacher", "note": "the baseline model"})
            continue
        pruned = float(r["ratio"].rstrip("%")) / 100.0
        K = round(E * (1.0 - pruned))
        if r["method"] not in REAP_SCORING:
            raise ValueError(f"REAP Table 2: method {r['method']!r}; allowed: {', '.join(REAP_SCORING)}")
        method, paradigm = REAP_SCORING[r["method"]]
        note = f"{r['ratio']} of the experts pruned or merged per layer"
        if method == "M-SMoE":  # the REAP paper, Sec. 5: cluster counts from global usage frequency
            note += "; M-SMoE's cluster count varies per layer, K is its mean"
        out.append(
            {
                **moe_fields(method, paradigm, K, "none"),
                **common,
                "note": note,
                "settings": implementation_json(imps, "reap", method),
            }
        )
    return {
        "name": f"paper:reap-{model.lower()}",
        "source": REAP_SOURCE,
        "select": None,
        "configs": out,
        "description": f"{REAP_TITLE}: Table 2, {model} — frequency, EAN, REAP, HC-SMoE and M-SMoE at 25% and "
        "50% of the experts pruned or merged per layer (domain-specific calibration): Eval+, LiveCodeBench, "
        "WildBench creative writing, GSM8K, MATH-500 and the paper's Code, Math and MC averages.",
    }


# ---- seed 003 (coarse-to-fine pruning, DCDM) and seed 004 (DOT-MoE) --------------------------------
C2F_TITLE = "Compressing Large MoE Models via Efficient Pruning and Data-Aware Calibration (anonymous)"
C2F_SOURCE = "paper:C2F/DCDM (anonymous)"
C2F_SWEEP = "paper:c2f-qwen3-30b-a3b-thinking"
C2F_MODEL = "Qwen3-30B-A3B-Thinking-2507"  # 128 routed experts, top-8; 50% pruned → 64 (Sec. 5.1)
C2F_TABLE = "c2f_table2_3_qwen3_thinking"
# the table's columns: MMLU is multiple choice (acc, headline); the others are generative scores
C2F_TASKS = {"mmlu": ("acc", 1), "math500": ("score", 0), "aime25": ("score", 0), "lcb": ("score", 0)}
C2F_TASK_NAME = {"mmlu": "mmlu", "math500": "math500", "aime25": "aime25", "lcb": "livecodebench"}
# the paper's method → (our name, paradigm); "Weights" (CD-MoE's routing-weight ratio) is our scoring Weights (PS/SF)
C2F_METHODS = {
    "Ours": ("CFES", "pruning"),
    "DCDM": ("CFES", "pruning"),
    "Fixed": ("CFES", "pruning"),
    "Weights": ("Weights", "pruning"),
    "HC-SMoE": ("HC-SMoE", "merging"),
}


def c2f() -> dict[str, Any]:
    """The C2F/DCDM paper's Tables 2 and 3: Qwen3-30B-A3B-Thinking at 64 of 128 experts per layer, each
    method calibrated on one domain, and the paper's method on a fixed 1:1:1 mix and on DCDM's mix. Keys
    as our seed003 sweep writes them: the mixed run is the main configuration, a single-domain or DCDM run
    a variant of it (`…|calibration=<name>`)."""
    out: list[dict[str, Any]] = []
    imps = implementations()
    main = moe_key("CFES", 64, "none")
    seen: set[str] = set()
    for r in read_table(C2F_TABLE):
        metrics = [
            {
                "name": name,
                "stage": "post",
                "task": C2F_TASK_NAME[col],
                "value": float(r[col]) / 100.0,
                "headline": head,
                "extra": {"table": r["table"], "published": r[col]},
            }
            for col, (name, head) in C2F_TASKS.items()
        ]
        metrics.append(
            {
                "name": "avg_published",
                "stage": "post",
                "value": float(r["average"]) / 100.0,
                "extra": {"table": r["table"], "published": r["average"], "over": "all four columns"},
            }
        )
        common = {
            "model": C2F_MODEL,
            "teacher_variant": "thinking",
            "top_k": 8,
            "table": f"c2f_{r['table']}",
            "metrics": metrics,
        }
        if r["method"] == "Original":
            out.append({"config_key": "teacher", "kind": "teacher", "note": "the original model", **common})
            continue
        if r["method"] not in C2F_METHODS:
            raise ValueError(
                f"{C2F_TABLE}: method {r['method']!r}; allowed: Original, {', '.join(C2F_METHODS)}"
            )
        method, paradigm = C2F_METHODS[r["method"]]
        fields = moe_fields(method, paradigm, 64, "none")
        if r["calibration"] != "fixed":
            fields["config_key"] += f"|calibration={r['calibration']}"
            if fields["config_key"].startswith(
                main + "|"
            ):  # a variant of the mixed run (the others have none)
                fields["variant"] = f"calibration={r['calibration']}"
                fields["variant_of_key"] = main
        if fields["config_key"] in seen:  # DCDM is printed in Tables 2 and 3 with the same numbers
            first = next(c for c in out if c["config_key"] == fields["config_key"])
            if [m["value"] for m in first["metrics"]] != [m["value"] for m in metrics]:
                raise ValueError(f"{C2F_TABLE}: {r['method']} differs between Tables 2 and 3")
            first["table"] += f"+c2f_{r['table']}"
            continue
        seen.add(fields["config_key"])
        cal = {
            "fixed": "the fixed 1:1:1 mix of C4, OpenR1-Math and rStar-Coder",
            "dcdm": "the mix DCDM found (2:1:1, code up-weighted)",
        }.get(r["calibration"], f"{r['calibration']} only")
        out.append(
            {
                **fields,
                **common,
                "note": f"{r['method']}, 50% of the routed experts pruned, calibrated on {cal}",
                "settings": implementation_json(imps, "c2f", method, cal),
            }
        )
    return {
        "name": C2F_SWEEP,
        "source": C2F_SOURCE,
        "select": None,
        "configs": out,
        "description": f"{C2F_TITLE}: Tables 2 and 3, {C2F_MODEL} with 64 of 128 experts per layer — "
        "Weights, HC-SMoE and coarse-to-fine selection per calibration domain, fixed and DCDM mixes.",
    }


DOT_TITLE = "Bamba et al., DOT-MoE: Differentiable Optimal Transport for MoEfication"
DOT_SOURCE = "paper:Bamba et al. (DOT-MoE)"
DOT_SWEEP = "paper:dot-moe"
# Table 3: (task, metric, shots) per column
DOT_T3 = {
    "boolq": ("acc", 32),
    "sciq": ("acc", 0),
    "piqa": ("acc", 0),
    "winogrande": ("acc", 5),
    "arc_challenge": ("acc_norm", 25),
    "hellaswag": ("acc_norm", 10),
}
DOT_T8 = {
    "arc_easy": "acc_norm",
    "arc_challenge": "acc_norm",
    "piqa": "acc_norm",
    "winogrande": "acc",
    "hellaswag": "acc_norm",
}


def _slug(text: str) -> str:
    """`CMoE (E8A1S1)` → `cmoe-e8a1s1`, `Qwen2.5 7B` → `qwen2-5-7b`."""
    return "-".join("".join(c.lower() if c.isalnum() else " " for c in text).split())


def dot_moe() -> dict[str, Any]:
    """The DOT-MoE paper's Table 3 (zero-shot after alignment only, three dense models, against pruning
    and dense-to-MoE baselines) and Table 8 (Qwen2.5-7B trained at 50% / 75% FFN sparsity, evaluated at
    four inference sparsities). Configurations of kind dense2moe, keyed by model, method and size."""
    out: list[dict[str, Any]] = []
    for r in read_table("dot_moe_table3_zero_shot"):
        metrics = [
            {
                "name": m,
                "stage": "post",
                "task": t,
                "value": float(r[t]) / 100.0,
                "headline": 1,
                "num_fewshot": n,
                "extra": {"table": "dot_table3", "published": r[t]},
            }
            for t, (m, n) in DOT_T3.items()
        ]
        metrics.append(
            {
                "name": "avg_published",
                "stage": "post",
                "value": float(r["avg"]) / 100.0,
                "extra": {"table": "dot_table3", "published": r["avg"]},
            }
        )
        out.append(
            {
                "config_key": f"dense2moe|{_slug(r['method'])}|{_slug(r['model'])}|active={r['active_params_b']}B",
                "model": r["model"],
                "kind": "dense2moe",
                "baseline": r["method"],
                "table": "dot_table3",
                "note": f"{r['method']} on {r['model']}, {r['active_params_b']}B active parameters, zero-shot "
                "after alignment only (dense weights never trained)",
                "metrics": metrics,
            }
        )
    for r in read_table("dot_moe_table8_sparsity"):
        metrics = [
            {
                "name": m,
                "stage": "post",
                "task": t,
                "value": float(r[t]) / 100.0,
                "headline": 1,
                "extra": {"table": "dot_table8", "published": r[t]},
            }
            for t, m in DOT_T8.items()
        ]
        metrics.append(
            {
                "name": "avg_published",
                "stage": "post",
                "value": float(r["avg"]) / 100.0,
                "extra": {"table": "dot_table8", "published": r["avg"]},
            }
        )
        out.append(
            {
                "config_key": f"dense2moe|dot-moe|qwen2-5-7b|trained={r['trained_sparsity']}%"
                f"|inference={r['inference_sparsity']}%",
                "model": "Qwen2.5 7B",
                "kind": "dense2moe",
                "baseline": "DOT-MoE",
                "table": "dot_table8",
                "note": f"DOT-MoE trained at {r['trained_sparsity']}% FFN sparsity, evaluated at "
                f"{r['inference_sparsity']}% (inference top-k changed, no retraining)",
                "metrics": metrics,
            }
        )
    return {
        "name": DOT_SWEEP,
        "source": DOT_SOURCE,
        "select": None,
        "configs": out,
        "description": f"{DOT_TITLE}: Table 3 (zero-shot after alignment, LLaMA-2 7B, LLaMA-3 8B, Qwen2.5 7B) "
        "and Table 8 (training × inference sparsity, Qwen2.5-7B).",
    }


def reference_sweeps() -> list[dict[str, Any]]:
    """Every reference sweep: the core paper's (the first is its main study; the CLI relies on it), then
    the smaller-MoE studies of the Router KD, REAP and C2F/DCDM papers, and DOT-MoE's dense → MoE."""
    return [
        qwen3_main(),
        qwen3_extended(),
        qwen3_base(),
        cross_model("DeepSeek-V2-Lite"),
        cross_model("GPT-OSS-20B"),
        architectures(),
        router_kd(),
        reap("Qwen3-30B-A3B"),
        reap("GLM-4.5-Air"),
        c2f(),
        dot_moe(),
    ]
