"""The core paper's published numbers as reference sweeps.

Each paper table becomes configurations with the same axes and metric names as our own runs
(workers/stages.py), so one query over the `results` view covers both. Accuracies are stored as
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
from pathlib import Path
from typing import Any

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
RULE_PAIR = {"best_by": "ppl_pre", "per": ["scoring", "grouping"], "over": ["K", "dp_scaling"]}
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


def reference_sweeps() -> list[dict[str, Any]]:
    """Every reference sweep of the core paper; the first is its main study (the CLI relies on it)."""
    return [
        qwen3_main(),
        qwen3_extended(),
        qwen3_base(),
        cross_model("DeepSeek-V2-Lite"),
        cross_model("GPT-OSS-20B"),
        architectures(),
    ]
