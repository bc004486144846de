"""The run functions of the built-in stages (declared in orchestrator/stages/): teacher and
dense_teacher, calibrate, convert, ppl_pre, distill, evaluate.

Each takes a payload (see workers/jobs.py) and returns a plain record. They glue the science
modules together and never touch the database.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from workers.runtime import (
    artifact,
    device,
    eval_texts,
    load_model,
    resident_teacher,
    teacher_path,
    tiny_dir,
    windows,
)


def _metric(name: str, value: float | None, **kw: Any) -> dict[str, Any]:
    return {"name": name, "value": value, **kw}


# ---- teachers --------------------------------------------------------------------------------
def stage_teacher(payload: dict, cache: dict, progress) -> dict:
    from workers.tiny.teacher import TinyTeacherSpec, train_tiny_dense, train_tiny_teacher

    spec = TinyTeacherSpec(**payload["params"]["tiny"])
    out = Path(payload["workdir"]) / "model"
    train = train_tiny_dense if payload["params"]["kind"] == "dense_teacher" else train_tiny_teacher
    rec = train(spec, out, progress=progress, cache_dir=Path(payload["home"]) / "cache" / "tiny")
    metrics = [
        _metric("ppl", rec["valid_ppl_teacher"], stage="train", who="teacher"),
        _metric("ppl", rec["valid_ppl_random_init"], stage="train", who="random_init"),
        _metric("params", float(rec["params"]), stage="train", who="teacher"),
    ]
    metrics += [_metric("train_loss", loss, stage="train", who="teacher", step=i)
                for i, loss in enumerate(rec["train_loss_curve"])]
    keep = {k: v for k, v in rec.items() if k != "train_loss_curve"}
    return {"outputs": {"path": str(out), **keep}, "metrics": metrics, "artifacts": [artifact("model", out)]}


# ---- calibration ------------------------------------------------------------------------------
def stage_calibrate(payload: dict, cache: dict, progress) -> dict:
    """One pass of the teacher over each calibration source's own windows; every source's statistics are
    kept apart in one file (mixed with the sources' weights when they are loaded). `streamed`: the teacher
    is read from its shards one decoder layer at a time (workers.streamed), never resident."""
    from workers.calibrate import (
        calibration_sources,
        collect_stats,
        save_source_stats,
        source_tokens,
        stats_to,
    )
    from workers.families import get_adapter

    p = payload["params"]
    if p.get("streamed"):
        run, tok, model = _streamed_teacher(payload, p.get("offload_hidden", False))
    else:
        model, tok = resident_teacher(payload, cache)
        run = collect_stats
    adapter = get_adapter(model)
    sources = calibration_sources(p)
    n_sample = p.get("sample_tokens", 0)  # absent (= 0) unless set: older job keys stay what they were
    per_source = {}
    for name, src in sources.items():
        ids = windows(payload, cache, tok, src["data"], p["seq_len"], src["n_samples"], p["seed"])
        mask = torch.ones_like(ids)
        batches = [(ids[i:i + p["batch_size"]].to(device()), mask[i:i + p["batch_size"]].to(device()))
                   for i in range(0, len(ids), p["batch_size"])]
        cb = (lambda i, n, name=name: progress(i, n, f"calibrate {name}")) if progress else None
        stats = run(model, adapter, batches, chunk_tokens=p["chunk_tokens"], progress=cb,
                    sample_tokens=n_sample, sample_seed=p["seed"])
        per_source[name] = stats_to(stats, "cpu")  # the next source's pass gets the device memory back
    path = Path(payload["workdir"]) / "stats.safetensors"
    keys = [k for k in ("teacher", "data", "sources", "seq_len", "n_samples", "seed", "sample_tokens") if k in p]
    save_source_stats(per_source, {name: src["weight"] for name, src in sources.items()}, path,
                      metadata={k: json.dumps(p[k], sort_keys=True) for k in keys})
    counts = {name: source_tokens(stats) for name, stats in per_source.items()}
    listed = {name: {"n_tokens": counts[name], "weight": float(src["weight"]), "n_samples": src["n_samples"]}
              for name, src in sources.items()}
    streamed = {"streamed": True} if p.get("streamed") else {}  # convert then reads the teacher streamed too
    return {"outputs": {"stats": str(path), "n_tokens": sum(counts.values()), "layers": sorted(stats),
                        "sources": listed, **streamed},
            "metrics": [_metric("calib_tokens", float(n), stage="calib", task=name, n_tokens=n)
                        for name, n in counts.items()],
            "artifacts": [artifact("calibration_stats", path)]}


def _streamed_contexts(payload: dict, stats: dict) -> Any:
    """The conversion contexts of a streamed teacher (workers.streamed.StreamedContexts): each layer's
    experts read from the shards onto the device when its plan is made."""
    from workers.families import get_adapter
    from workers.runtime import DTYPES
    from workers.streamed import StreamedContexts, StreamedTeacher, checkpoint_dir

    ref = payload["params"]["teacher"]
    teacher = StreamedTeacher(checkpoint_dir(teacher_path(payload), ref.get("revision")),
                              DTYPES[ref.get("dtype", "float32")])
    return StreamedContexts(teacher, get_adapter(teacher.model), stats, device())


def _streamed_teacher(payload: dict, offload: bool) -> tuple[Any, Any, Any]:
    """(collect_stats's stand-in reading the teacher one layer at a time, the tokenizer, the teacher's
    meta-device skeleton): nothing of the teacher is loaded until a pass runs."""
    from transformers import AutoTokenizer

    from workers.runtime import DTYPES
    from workers.streamed import StreamedTeacher, checkpoint_dir, streamed_stats

    ref = payload["params"]["teacher"]
    path = teacher_path(payload)
    teacher = StreamedTeacher(checkpoint_dir(path, ref.get("revision")), DTYPES[ref.get("dtype", "float32")])
    tok = AutoTokenizer.from_pretrained(path, revision=ref.get("revision"))

    def run(model, adapter, batches, **kw: Any) -> dict:
        return streamed_stats(teacher, adapter, batches, offload=offload, **kw)
    return run, tok, teacher.model


# ---- conversion plans -------------------------------------------------------------------------
def stage_convert(payload: dict, cache: dict, progress) -> dict:
    from workers.calibrate import load_stats
    from workers.convert import layer_contexts
    from workers.families import get_adapter
    from workers.planning import plan_signature

    p = {**payload["params"], "workdir": payload["workdir"]}
    stats_path = payload["inputs"]["calibrate"]["stats"]
    weights = p.get("calibration_weights")  # a DCDM mixture's weights (None: the file's own)
    if payload["inputs"]["calibrate"].get("streamed"):  # a streamed teacher: one layer's experts at a time
        plans, factors = convert_plans(_streamed_contexts(payload, load_stats(stats_path, weights=weights)), p)
    else:
        model, _ = resident_teacher(payload, cache)
        adapter = get_adapter(model)
        ckey = ("contexts", stats_path, json.dumps(weights, sort_keys=True))
        if ckey not in cache:
            cache[ckey] = layer_contexts(model, adapter, load_stats(stats_path, weights=weights))
        plans, factors = convert_plans(cache[ckey], p, teacher=(model, adapter))
    plan_key = plan_signature(plans)
    path = Path(payload["workdir"]) / "plan.json"
    path.write_text(json.dumps([plan_to_dict(pl) for pl in plans], indent=1))
    artifacts = [artifact("plan", path)]
    if factors is not None:  # an edited MoE's factors, beside its plan (workers.outputs.edited_student)
        artifacts.append(artifact("factors", factors))
    rows, diag = [], []
    for pl in plans:
        member = {e: (g, w) for g, (grp, ws) in enumerate(zip(pl.groups, pl.merge_weights, strict=True))
                  for e, w in zip(grp, ws, strict=True)}
        for rank, e in enumerate(pl.selected):
            g, w = member[e]
            rows.append({"layer": pl.layer, "expert": e, "score": float(pl.scores[e]), "selected_rank": rank,
                         "group_idx": g, "merge_weight": float(w), "alpha": float(pl.alpha[g])})
        diag += [{"layer": pl.layer, "name": k, "value": float(v)} for k, v in sorted(pl.extras.items())
                 if isinstance(v, int | float)]
    return {"outputs": {"plan_key": plan_key, "plan_path": str(path)}, "plan_rows": rows,
            "layer_diag": diag, "artifacts": artifacts}


OUTPUT_SETTINGS = {"dense": ("shared_gate",), "moe": ("super_experts",), "merged": (), "edited": ()}


def convert_plans(contexts: Mapping, p: dict[str, Any], teacher: tuple | None = None) -> tuple[list, Path | None]:
    """Per MoE layer, what the configuration's output keeps: a dense plan (Algorithm 1), the experts a
    pruned MoE keeps, the clusters of a merged MoE, or an edited MoE's factors (saved beside the plan;
    their sha256 enters every plan, so a refit that differs is another student). `settings`: those of
    the output (`super_experts`: the factor of workers.pruning) and of the method it names (a scoring
    takes settings when its selector has `parse_settings`: they reach it as LayerContext.settings).
    `teacher`: the resident (model, adapter), for scorings that re-run it (sequential inputs). `contexts`
    is looked up once per layer, in layer order (a streamed teacher's are read from its shards then)."""
    from workers.families.base import SHARED_GATE_DEFAULT, shared_gate_scales
    from workers.planning import plan_layer, select_layer

    output, K = p.get("output", "dense"), p["K"]
    settings = dict(p.get("settings") or {})
    own = {k: settings.pop(k) for k in list(settings) if k in OUTPUT_SETTINGS[output]}
    layers = ((layer, contexts[layer]) for layer in sorted(contexts))  # one look-up per layer, in order
    scoring_settings, rerun = _scoring_settings(p, settings, teacher) if output in ("dense", "moe") else (None, None)
    if output == "moe":
        if settings and scoring_settings is None:
            raise ValueError(f"settings {', '.join(sorted(settings))}: a pruned MoE takes "
                             f"{', '.join(OUTPUT_SETTINGS['moe'])}")
        return _scored_plans(layers, scoring_settings, rerun, lambda layer, ctx: select_layer(
            layer, ctx, p["scoring"], K, own.get("super_experts"))), None
    if output == "merged":
        from workers.moe_merging import merge_layer

        return [merge_layer(layer, ctx, p["merging"], K, settings) for layer, ctx in layers], None
    if output == "edited":
        import hashlib

        from safetensors.torch import save_file

        from workers.editing import edit_layer

        plans, tensors = [], {}
        for layer, ctx in layers:
            plan, fac = edit_layer(layer, ctx, p["editing"], K, settings)
            plans.append(plan)
            tensors.update(fac)
        path = Path(p["workdir"]) / "factors.safetensors"
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(path))
        sha = hashlib.sha256(path.read_bytes()).hexdigest()
        for plan in plans:
            plan.extras["student"] = {**plan.extras.get("student", {}), "factors_sha256": sha}
        return plans, path
    if settings and scoring_settings is None:
        raise ValueError(f"settings {', '.join(sorted(settings))}: a dense student takes "
                         f"{', '.join(OUTPUT_SETTINGS['dense'])}")
    gate = own.get("shared_gate")

    def dense_plan(layer: int, ctx) -> Any:
        plan = plan_layer(layer, ctx, p["scoring"], p["grouping"], p["dp_scaling"], K)
        if gate is not None and gate != SHARED_GATE_DEFAULT:  # the default builds the student as before
            scale = shared_gate_scales({layer: ctx.stats}, gate)[layer]
            plan.extras["student"] = {**plan.extras.get("student", {}), "shared_scale": scale}
        return plan

    return _scored_plans(layers, scoring_settings, rerun, dense_plan), None


def _scoring_settings(p: dict[str, Any], settings: dict[str, Any], teacher: tuple | None) -> tuple:
    """(the method settings, checked, or None when the configuration's scoring takes none; the selector's
    `(layer, kept so far, sample) -> sample` re-run of the teacher, or None): a selector takes settings when
    it has `parse_settings`, and re-runs the teacher when its `layer_inputs` says so (sequential inputs)."""
    from workers.scoring import get_scoring

    select = get_scoring(p["scoring"]).select
    if not hasattr(select, "parse_settings"):
        return None, None
    select.parse_settings(settings)
    return settings, select.layer_inputs(settings, teacher) if hasattr(select, "layer_inputs") else None


def _scored_plans(layers: list, settings: dict[str, Any] | None, rerun, plan_one) -> list:
    """plan_one(layer, ctx) per layer in order; a scoring that takes settings gets them on its context and,
    with `rerun`, the token sample re-run through the earlier layers as they were compressed
    (`recon_input_seconds` records the re-run)."""
    import time
    from dataclasses import replace

    if settings is None:
        return [plan_one(layer, ctx) for layer, ctx in layers]
    plans: list = []
    for layer, ctx in layers:
        ctx = replace(ctx, settings=settings)  # the cached contexts are shared: never changed in place
        seconds = None
        if rerun is not None and plans and ctx.stats.sample is not None:
            t0 = time.perf_counter()
            sample = rerun(layer, {pl.layer: list(pl.selected) for pl in plans}, ctx.stats.sample)
            ctx = replace(ctx, stats=replace(ctx.stats, sample=sample))
            seconds = time.perf_counter() - t0
        plan = plan_one(layer, ctx)
        if seconds is not None:
            plan.extras["recon_input_seconds"] = seconds
        plans.append(plan)
    return plans


def plan_to_dict(pl) -> dict[str, Any]:
    from dataclasses import asdict

    return asdict(pl)


def load_plans(path: str):
    from workers.types import LayerPlan

    return [LayerPlan(**d) for d in json.loads(Path(path).read_text())]


# ---- students -------------------------------------------------------------------------------
def make_student(payload: dict, cache: dict, recipe: dict[str, Any], *, for_training: bool):
    """The student a recipe names. For evaluation only, plan students share the teacher's tensors."""
    from workers.families import get_adapter

    kind = recipe["type"]
    if kind == "d2d":
        return d2d_student(payload, cache, recipe["candidate"])
    model, tok = resident_teacher(payload, cache)
    if kind == "teacher":
        return (copy.deepcopy(model) if for_training else model), tok
    adapter = get_adapter(model)
    if kind == "plan":
        from workers.outputs import write_student

        plan_path = payload["inputs"]["convert"]["plan_path"]
        plans = load_plans(plan_path)
        student = write_student(recipe.get("output", "dense"), model, adapter, plans, share_weights=not for_training,
                                plan_path=plan_path)
    elif kind == "random_ffn":
        from workers.baselines import random_ffn_student

        student = random_ffn_student(model, adapter, seed=recipe.get("seed", 0))
    elif kind == "random_init":
        from workers.baselines import random_init_student

        student = random_init_student(model, adapter, seed=recipe.get("seed", 0))
    else:
        raise ValueError(f"unknown student type {kind!r}")
    return student.to(device()), tok


def d2d_student(payload: dict, cache: dict, candidate: str):
    """Minitron-style pruning of the dense teacher (Appendix M)."""
    from workers.baselines import d2d_candidates, prune_dense

    dense, tok = resident_teacher(payload, cache, role="dense_teacher")
    cands = {c["name"]: c for c in d2d_candidates(dense, target_params=moe_student_params(payload))}
    c = payload["params"].get("calibration") or {}
    ids = windows(payload, cache, tok, c.get("data", {"source": "tiny", "split": "train"}),
                  c.get("seq_len", 128), c.get("n_samples", 64), c.get("seed", 0))
    batches = [ids[i:i + 8].to(device()) for i in range(0, len(ids), 8)]
    return prune_dense(dense, cands[candidate], batches).to(device()), tok


def moe_student_params(payload: dict) -> int | None:
    """Parameter count of the MoE→dense student at K = k, from the MoE teacher's config alone (built on
    the meta device: nothing is downloaded but the config). None for the tiny teacher, whose dense twin
    carries the number itself (workers.baselines.d2d_target)."""
    ref = payload["params"].get("moe_teacher") or {}
    if ref.get("source") != "hf":
        return None
    from transformers import AutoConfig, AutoModelForCausalLM

    from workers.families import get_adapter

    config = AutoConfig.from_pretrained(ref["model"], revision=ref.get("revision"))
    with torch.device("meta"):
        moe = AutoModelForCausalLM.from_config(config)
        adapter = get_adapter(moe)
        layer = adapter.moe_layers(moe)[0]
        shared = adapter.shared_ffn(moe, layer)
        width = adapter.top_k(moe) * adapter.expert_weights(moe, layer).intermediate + (shared.width if shared else 0)
        student = AutoModelForCausalLM.from_config(adapter.student_config(moe, width))
    return sum(p.numel() for p in student.parameters())


def ppl_record(model, tok, payload: dict, cache: dict, stage: str,
               items: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The ppl metric with its standard error over windows (n = `total` = windows); `items`, when given,
    gains the per-window item scores (Σ NLL and scored tokens per window) for paired comparisons."""
    from workers.ppl import perplexity, text_ids, window_stats

    pp = payload["params"]["ppl"]
    texts = eval_texts(payload, cache, pp["data"])
    key = json.dumps(["ppl_ids", pp["data"], tok.name_or_path, len(tok)], sort_keys=True)
    if key not in cache:  # every student of this worker's teacher is scored on the same tokens
        cache[key] = text_ids(tok, texts)
    r = perplexity(model, tok, texts, seq_len=pp["seq_len"], batch_size=pp["batch_size"], add_bos=pp["add_bos"],
                   device=device(), max_windows=pp.get("max_windows"), windows=pp.get("windows", "disjoint"),
                   ids=cache[key])
    se, n = window_stats(r["window_nll"], r["window_tokens"])
    metric = _metric("ppl", r["ppl"], stage=stage, sum_nll=r["sum_nll"], n_tokens=r["n_tokens"], stderr=se,
                     total=n, value_kind=r["value_kind"], extra={"protocol": r["protocol"], "data": pp["data"]})
    if items is not None:
        items += [{"stage": stage, "name": name, "doc_ids": list(range(n)), "values": [float(v) for v in vals]}
                  for name, vals in (("nll", r["window_nll"]), ("tokens", r["window_tokens"]))]
    return metric


def stage_ppl_pre(payload: dict, cache: dict, progress) -> dict:
    recipe = payload["params"]["student"]
    student, tok = make_student(payload, cache, recipe, for_training=False)
    items: list[dict[str, Any]] = []
    with torch.no_grad():
        m = ppl_record(student, tok, payload, cache, "pre", items)
    params = _metric("params", float(sum(t.numel() for t in student.parameters())), stage="pre")
    return {"outputs": {"ppl": m["value"], "value_kind": m["value_kind"]}, "metrics": [m, params],
            "item_scores": items}


# ---- distillation -------------------------------------------------------------------------------
def stage_distill(payload: dict, cache: dict, progress) -> dict:
    from workers.distill import DistillSpec, distill
    from workers.families import get_adapter

    p = payload["params"]
    spec = DistillSpec(**p["settings"])
    recipe = p["student"]
    student, tok = make_student(payload, cache, recipe, for_training=True)
    role = "dense_teacher" if recipe["type"] == "d2d" else "teacher"
    teacher, _ = resident_teacher(payload, cache, role=role)
    adapter = get_adapter(teacher) if role == "teacher" else None
    n_train = spec.steps * spec.batch_size * spec.grad_accum
    val = windows(payload, cache, tok, p["val_data"], spec.seq_len, spec.val_windows, spec.seed + 2)
    out = Path(payload["workdir"]) / "student"
    procs = _processes(p.get("processes", 1))
    sharding = _sharding(p.get("sharding"), procs)
    if sharding != "none":  # ddp or fsdp over this job's GPUs (or CPU processes): torchrun, same loop and losses
        train = windows(payload, cache, tok, p["data"], spec.seq_len, n_train, spec.seed + 1)
        student.to("cpu")  # saved from here; the ranks load their own copies
        with _off_device(teacher):
            rec = _distill_multiprocess(payload, student, tok, teacher_path(payload, role), role, train, val, spec,
                                        procs, sharding, bool(p.get("teacher_offload")))
    else:
        cb = (lambda i, n, *_: progress(i, n, "distill")) if progress else None
        stream = (lambda r: progress(r["step"], spec.steps, "distill", metrics=[_val_metric(r)])) if progress else None
        rec = distill(student, teacher, adapter, _train_batches(payload, cache, tok, spec, n_train), val, spec,
                      progress=cb, on_val=stream)
        student.save_pretrained(out)
        tok.save_pretrained(out)
    metrics = [_val_metric(r) for r in rec["val"]]
    metrics += [_metric("train_loss", v, stage="train", who="student", step=i)
                for i, v in enumerate(rec["loss_curve"])]
    metrics.append(_metric("distill_tokens", float(rec["tokens"]), stage="train", n_tokens=rec["tokens"],
                           extra={"teacher_routing": rec.get("teacher_routing"), "processes": procs,
                                  **({"sharding": sharding} if "sharding" in p else {})}))
    return {"outputs": {"path": str(out), "tokens": rec["tokens"]}, "metrics": metrics,
            "artifacts": [artifact("student", out)]}


def _train_batches(payload: dict, cache: dict, tok, spec, n_train: int):
    """Micro-batches [batch_size, seq_len]: a seeded sample of windows, or, for a streamed source (e.g.
    FineWeb-Edu), the stream's windows in order, tokenized as training consumes them."""
    from itertools import islice

    from workers.data import DataSpec, stream_texts, stream_windows

    data = payload["params"]["data"]
    if data.get("streaming"):
        wins = islice(stream_windows(tok, stream_texts(DataSpec(**data), tiny_dir(payload)), spec.seq_len), n_train)
        return (torch.stack(b) for b in iter(lambda: list(islice(wins, spec.batch_size)), []))
    train = windows(payload, cache, tok, data, spec.seq_len, n_train, spec.seed + 1)
    return (train[i:i + spec.batch_size] for i in range(0, len(train), spec.batch_size))


def _val_metric(r: dict[str, Any]) -> dict[str, Any]:
    return _metric("val_ce", r["value"], stage="train", who=r["who"], step=r["step"], n_tokens=r["tokens"])


def _processes(value: int | str) -> int:
    """`distill.processes`: an integer, or "gpus" = one process per GPU this job holds (at least 1)."""
    if value == "gpus":
        return max(1, torch.cuda.device_count())
    return int(value)


def _sharding(value: str | None, procs: int) -> str:
    """`distill.sharding`: as set, else none for one process and ddp for more (the behaviour before it)."""
    if value is None:
        return "none" if procs == 1 else "ddp"
    if value == "none" and procs != 1:
        raise ValueError(f"distill.sharding: 'none' runs one process; processes must be 1, got {procs}")
    return value


@contextlib.contextmanager
def _off_device(model):
    """The (resident) model moved to the CPU for the block and back: the ranks need this job's GPU memory."""
    where = next(model.parameters()).device
    try:
        model.to("cpu")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        yield
    finally:
        model.to(where)


def _distill_multiprocess(payload: dict, student, tok, teacher_dir: str, role: str, train: torch.Tensor,
                          val: torch.Tensor, spec, procs: int, sharding: str = "ddp",
                          teacher_offload: bool = False) -> dict[str, Any]:
    """Run workers.ddp under torchrun (see its docstring; sharding ddp or fsdp); rank 0 writes the student
    into workdir/student."""
    from dataclasses import asdict

    from workers.ddp import launch

    work = Path(payload["workdir"])
    init = work / "init_student"
    student.save_pretrained(init)
    torch.save(train, work / "train.pt")
    torch.save(val, work / "val.pt")
    ref = payload["params"]["teacher"]
    job = {"student": str(init), "teacher": teacher_dir, "teacher_dtype": ref.get("dtype", "float32"),
           "moe_teacher": role == "teacher", "train": str(work / "train.pt"), "val": str(work / "val.pt"),
           "spec": asdict(spec), "out": str(work), "sharding": sharding, "teacher_offload": teacher_offload}
    rec = launch(job, work / "ddp", nproc=procs)
    tok.save_pretrained(work / "student")
    shutil.rmtree(init)
    return rec


# ---- router KD -------------------------------------------------------------------------------------
def stage_router_kd(payload: dict, cache: dict, progress) -> dict:
    """Retrain only the routers of a smaller MoE against its teacher (the Router KD paper, §4); the
    result is a router delta: the router tensors and the identity of the student they apply to."""
    from workers.families import get_adapter
    from workers.router_kd import calibration_batches, router_kd, save_router_delta
    from workers.router_kd_spec import RouterKDSpec

    p = payload["params"]
    spec = RouterKDSpec(**p["settings"])
    student, tok = make_student(payload, cache, p["student"], for_training=True)
    teacher, _ = resident_teacher(payload, cache)
    ids = windows(payload, cache, tok, p["data"], spec.max_len, spec.max_samples, spec.seed)
    cb = (lambda i, n: progress(i, n, "router_kd")) if progress else None
    rec = router_kd(student, teacher, get_adapter(student), calibration_batches(ids, spec), spec, progress=cb)
    path = Path(payload["workdir"]) / "router_delta.safetensors"
    save_router_delta(path, rec["router_delta"], parent_hash=_recipe_hash(p["student"]),
                      metadata={"kd_loss_norm": rec["kd_loss_norm"], "steps": rec["steps"]})
    metrics = [_metric("train_loss", v, stage="router_kd", who="student", step=i)
               for i, v in enumerate(rec["loss_curve"])]
    metrics += [_metric("trainable_params", float(rec["trainable_params"]), stage="router_kd"),
                _metric("kd_tokens", float(rec["tokens"]), stage="router_kd", n_tokens=rec["tokens"],
                        extra={"router_renorm": rec["router_renorm"], "kd_loss_norm": rec["kd_loss_norm"],
                               "steps": rec["steps"], "sequences": rec["sequences"]})]
    return {"outputs": {"delta": str(path), "parent": _recipe_hash(p["student"]), "steps": rec["steps"]},
            "metrics": metrics, "artifacts": [artifact("router_delta", path)]}


def _recipe_hash(recipe: dict[str, Any]) -> str:
    import hashlib

    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:32]


def recovered_student(payload: dict, cache: dict, recipe: dict[str, Any]):
    """The student a recipe names, with a Router KD delta applied when the recipe says so."""
    if recipe["type"] != "router_kd":
        return make_student(payload, cache, recipe, for_training=False)
    from workers.router_kd import apply_router_delta, load_router_delta

    student, tok = make_student(payload, cache, recipe["base"], for_training=True)
    delta, _ = load_router_delta(payload["inputs"]["router_kd"]["delta"], parent_hash=_recipe_hash(recipe["base"]))
    apply_router_delta(student, delta)
    return student, tok


# ---- evaluation ------------------------------------------------------------------------------------
def stage_evaluate(payload: dict, cache: dict, progress) -> dict:
    from workers.evaluate import run_suite

    p = payload["params"]
    ev = p["evaluate"]
    kind = p["student"]["type"]
    saved: list[dict[str, Any]] = []
    if kind == "distilled":
        path = payload["inputs"]["distill"]["path"]
        model, tok = load_model(path)
    elif kind == "teacher":
        model, tok = resident_teacher(payload, cache)
        path = teacher_path(payload)
    else:  # a student built from its recipe (a smaller MoE, with its routers retrained by Router KD or not)
        model, tok = recovered_student(payload, cache, p["student"])
        path = str(Path(payload["workdir"]) / "student")
        if ev["backend"] == "vllm" or ev.get("save"):  # vLLM loads a checkpoint from disk
            model.save_pretrained(path)
            tok.save_pretrained(path)
            saved.append(artifact("student", Path(path)))
    metrics, items = [], []
    if ev.get("ppl", True):
        with torch.no_grad():
            metrics.append(ppl_record(model, tok, payload, cache, "post", items))
    if ev["backend"] == "vllm" and kind != "teacher":  # vLLM loads it from disk itself
        del model
        model = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    res = run_suite(model, tok, ev["suite"], model_key=evaluated_model_key(payload),
                    cache_dir=str(Path(payload["home"]) / "lm_eval_cache"), tiny_dir=tiny_dir(payload),
                    batch_size=ev["batch_size"], backend=ev["backend"], limit=ev.get("limit"), model_path=path,
                    workdir=payload["workdir"], generative=ev.get("generative") or [],
                    allow_cpu=ev.get("allow_cpu", False), allow_code_eval=ev.get("allow_code_eval", False),
                    runs=ev.get("runs"))
    metrics += eval_metrics(res, repeated=ev.get("runs") is not None)
    items += eval_items(res, repeated=ev.get("runs") is not None)
    out = Path(payload["workdir"]) / "lm_eval_results.json"
    out.write_text(json.dumps(res["results_json"], indent=1, default=str, sort_keys=True))
    outputs = {"avg": res.get("average"), **({"student": saved[0]["path"]} if saved else {})}
    if res["not_run"]:
        outputs["not_run"] = res["not_run"]
    if ev.get("runs") is not None:
        outputs["runs"] = [{"step": i, **r["settings"], "avg": r["average"], "reused": r["reused"]}
                           for i, r in enumerate(res["runs"])]
    return {"outputs": outputs, "metrics": metrics, "artifacts": [artifact("lm_eval_results", out), *saved],
            "item_scores": items}


def evaluated_model_key(payload: dict) -> str:
    """A content key of the evaluated model alone (its recipe and the upstream outputs it is built from),
    not of the evaluation: a run added to the evaluate section finds the runs stored for the same model."""
    import hashlib

    p = payload["params"]
    blob = json.dumps({"student": p["student"], "teacher": p["teacher"], "inputs": payload["inputs"]},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def eval_metrics(res: dict[str, Any], repeated: bool) -> list[dict[str, Any]]:
    """Metric rows of run_suite's result: each run's scores with their n (`total`), in `step` = the run's
    index when the section lists runs (-1 otherwise), and one row per task not run (value NULL,
    value_kind 'skipped', its reason in extra)."""
    from workers.suites import GENERATIVE

    rows = []
    for i, run in enumerate(res["runs"]):
        step = i if repeated else -1
        common = {"backend": res.get("backend"), "lm_eval": res.get("lm_eval_version"),
                  **({"run": run["settings"]} if repeated else {})}
        for t in run["tasks"]:
            extra = common | {"task_hash": t.get("task_hash")}
            for metric in ("acc", "acc_norm"):
                if t.get(metric) is None:
                    continue
                se = item_stderr(t.get("items") or [], metric, t[metric])
                rows.append(_metric(metric, t[metric], stage="post", task=t["task"], step=step,
                                    stderr=t.get(f"{metric}_stderr") if se is None else se, total=t.get("n"),
                                    num_fewshot=t.get("num_fewshot"), headline=int(metric == t["headline"]),
                                    extra=extra))
            for name, value in sorted(t.get("other", {}).items()):
                if name.endswith("_stderr") or name.partition(":")[0].endswith("_stderr"):
                    continue
                stderr = t["other"].get(_stderr_name(name))
                rows.append(_metric(name, value, stage="post", task=t["task"], step=step, total=t.get("n"),
                                    num_fewshot=t.get("num_fewshot"), stderr=stderr,
                                    extra=extra | ({"score": True} if name == t.get("score") else {})))
        for task, reason in sorted(run["not_run"].items()):
            rows.append(_metric(GENERATIVE[task].score, None, stage="post", task=task, step=step,
                                value_kind="skipped", extra=common | {"not_run": reason}))
    return rows


def eval_items(res: dict[str, Any], repeated: bool) -> list[dict[str, Any]]:
    """item_scores records of run_suite's result: per run, task, leaf task and per-sample metric (and the
    choices' log-likelihoods), keyed by lm-eval's doc_id so students are paired on the same items."""
    out = []
    for i, run in enumerate(res["runs"]):
        step = i if repeated else -1
        for t in run["tasks"]:
            for it in t.get("items") or []:
                common = {"stage": "post", "task": t["task"], "subtask": it["subtask"], "step": step}
                for name, vals in sorted(it["metrics"].items()):
                    out.append(common | {"name": name, "doc_ids": it["doc_ids"], "values": vals})
                if it["loglik"]:
                    out.append(common | {"name": "loglik", "doc_ids": it["loglik_doc"], "values": it["loglik"]})
    return out


def item_stderr(items: list[dict[str, Any]], metric: str, value: float) -> float | None:
    """Standard error of a task's metric from its per-item scores (sample sd / √n, as lm-eval's): over all
    items when `value` is their mean (one task, or a group weighted by size), else the macro mean's over
    its leaf tasks. None without items."""
    leaves = [[x for x in it["metrics"].get(metric, []) if not math.isnan(x)] for it in items]
    leaves = [v for v in leaves if v]
    flat = [x for v in leaves for x in v]
    if len(flat) < 2:
        return None

    def var(v: list[float]) -> float:
        m = sum(v) / len(v)
        return sum((x - m) ** 2 for x in v) / (len(v) - 1) if len(v) > 1 else 0.0

    if abs(sum(flat) / len(flat) - value) < 1e-6:
        return math.sqrt(var(flat) / len(flat))
    return math.sqrt(sum(var(v) / len(v) for v in leaves)) / len(leaves)


def _stderr_name(name: str) -> str:
    metric, sep, filt = name.partition(":")
    return f"{metric}_stderr{sep}{filt}"


# ---- dense → MoE (DOT-MoE) -------------------------------------------------------------------------
def stage_dot_moe(payload: dict, cache: dict, progress) -> dict:
    """Align one dense model into an MoE (DOT-MoE §3, App. D), extract it (App. E), save it, and record its
    perplexity at every `eval_top_k` (Table 8: inference sparsity without retraining) beside the dense
    model's. Metrics: `ppl` (stage dot_moe, who student, step = the evaluated top-k; who dense, step -1),
    the per-step loss and its terms, parameter counts."""
    from workers.dot_moe import active_params, align, extract, install, save_assignment
    from workers.dot_moe_hf import set_top_k
    from workers.dot_moe_spec import DotMoeSpec

    p = payload["params"]
    spec = DotMoeSpec(**p["settings"])
    if p["source"] == "dense_teacher":
        dense, tok = resident_teacher(payload, cache, role="dense_teacher")
        dense = copy.deepcopy(dense)
    else:
        dense, tok = load_model(payload["inputs"]["distill"]["path"], p.get("teacher", {}).get("dtype", "float32"))
    with torch.no_grad():
        dense_ppl = ppl_record(dense, tok, payload, cache, "dot_moe")
    ffns = install(dense, p["experts"], p["top_k"], p["method"], spec)
    cb = (lambda i, n: progress(i, n, "dot_moe")) if progress else None
    batches = _train_batches(payload, cache, tok, spec, spec.steps * spec.batch_size)  # streamed if the data is
    rec = align(dense, ffns, batches, spec, progress=cb)
    moe = extract(dense, ffns, spec.combine)
    work = Path(payload["workdir"])
    out, assign = work / "moe", work / "dot_assignment.safetensors"
    moe.save_pretrained(out)
    tok.save_pretrained(out)
    save_assignment(ffns, assign)
    info = {"method": p["method"], "source": p["source"], "experts": p["experts"], "top_k": p["top_k"],
            "combine": spec.combine}
    metrics = [{**dense_ppl, "who": "dense", "extra": {**dense_ppl["extra"], **info}}]
    ppl: dict[str, float | None] = {}
    with torch.no_grad():
        for k in p["eval_top_k"]:
            set_top_k(moe, k)
            m = ppl_record(moe, tok, payload, cache, "dot_moe")
            ppl[str(k)] = m["value"]
            metrics.append({**m, "who": "student", "step": k,
                            "extra": {**m["extra"], **info, "active_fraction": k / p["experts"]}})
    set_top_k(moe, p["top_k"])
    for r in rec["curve"]:
        metrics += [_metric(f"train_{t}" if t != "loss" else "train_loss", r[t], stage="dot_moe", who="student",
                            step=r["step"]) for t in ("loss", "kl", "ce", "z", "balance", "tau")]
    tokens = rec["steps"] * spec.batch_size * spec.seq_len
    metrics += [_metric("params", float(sum(t.numel() for t in moe.parameters())), stage="dot_moe", who="student"),
                _metric("active_params", float(active_params(moe, p["top_k"])), stage="dot_moe", who="student"),
                _metric("trainable_params", float(rec["trainable_params"]), stage="dot_moe", who="student"),
                _metric("dot_tokens", float(tokens), stage="dot_moe", n_tokens=tokens, extra=info)]
    outputs = {"path": str(out), "ppl": ppl, "dense_ppl": dense_ppl["value"], "padded_neurons": ffns[0].n - ffns[0].d,
               "expert_width": ffns[0].s, "steps": rec["steps"], **info}
    return {"outputs": outputs, "metrics": metrics,
            "artifacts": [artifact("moe", out), artifact("dot_assignment", assign)]}


# ---- dynamic calibration dataset mixing --------------------------------------------------------------
def stage_dcdm(payload: dict, cache: dict, progress) -> dict:
    """DCDM for one configuration ("Compressing Large MoE Models via Efficient Pruning and Data-Aware
    Calibration", §4.2, Algorithm 2; workers/dcdm.py): every round's weights, per-domain discrepancies and
    perplexities as metric rows (`step` = the round, `task` = the source), the final mix and its plan."""
    import math

    from workers.calibrate import load_source_stats
    from workers.dcdm import DCDMSpec, run_dcdm
    from workers.families import get_adapter
    from workers.planning import plan_signature

    p = payload["params"]
    spec = DCDMSpec(**p["dcdm"])
    model, tok = resident_teacher(payload, cache)
    per_source = load_source_stats(payload["inputs"]["calibrate"]["stats"])
    held = {name: windows(payload, cache, tok, data, spec.seq_len, spec.n_eval, spec.seed)
            for name, data in p["held_out"].items()}
    cb = (lambda i, n: progress(i, n, "dcdm")) if progress else None
    res = run_dcdm(model, get_adapter(model), per_source, held, spec, p["n_samples"], p["convert"],
                   Path(payload["workdir"]), device(), progress=cb)
    extra = {"metric": spec.metric, "temperature": spec.temperature, "w0": spec.w0}
    metrics = [_metric("dcdm_weight", w, stage="dcdm", task=name, step=t, extra=extra)
               for t, ws in enumerate(res.trajectory) for name, w in ws.items()]
    for r in res.rounds:
        for name, m in r["domains"].items():
            metrics += [_metric("dcdm_discrepancy", r["discrepancy"][name], stage="dcdm", task=name, step=r["round"],
                                n_tokens=m["tokens"], extra={**extra, "kl": m["kl"]}),
                        _metric("dcdm_ppl", math.exp(m["nll_student"]), stage="dcdm", task=name, who="student",
                                step=r["round"], sum_nll=m["nll_student"] * m["tokens"], n_tokens=m["tokens"]),
                        _metric("dcdm_samples", float(r["counts"][name]), stage="dcdm", task=name,
                                step=r["round"])]
    first = res.rounds[0]["domains"]  # the teacher's perplexity is the same every round
    metrics += [_metric("dcdm_ppl", math.exp(m["nll_teacher"]), stage="dcdm", task=name, who="teacher",
                        sum_nll=m["nll_teacher"] * m["tokens"], n_tokens=m["tokens"]) for name, m in first.items()]
    rounds = [{"round": r["round"], "weights": r["weights"], "counts": r["counts"], "discrepancy": r["discrepancy"],
               "plan_key": plan_signature(r["plans"])} for r in res.rounds]
    return {"outputs": {"weights": res.weights, "stop": res.stop, "rounds": len(res.rounds),
                        "plan_key": plan_signature(res.plans), "plan_path": str(res.plan_path),
                        "trajectory": res.trajectory, "history": rounds},
            "metrics": metrics, "artifacts": [artifact("plan", res.plan_path)]}
