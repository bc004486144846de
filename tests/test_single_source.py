"""Single-domain calibration (`calibration.single_source`): one variant `<config_key>|calibration=<source>`
per named source of each configuration it applies to, converted from a calibrate job of that source alone
(planned, then run through a whole tiny sweep); the seed003 sweep's plan against the C2F paper's imported
rows; the sweep file's errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from sweep_runs import launched_twice, planned, spec_of

from orchestrator import configs as P
from orchestrator import dryrun
from orchestrator.spec import SpecError, load_spec

HERE = Path(__file__).parent
SWEEP = HERE / "sweeps" / "single_source.yaml"
SEED003 = "seed003-c2f-qwen3-30b-a3b-thinking"
WEIGHTS = "moe|Weights|K=4|recovery=none"
REAP = "moe|REAP|K=4|recovery=none"
DENSE = "SF|RR|uniform|K=2"
SOURCES = ("prose", "code")
N_ALONE, SEQ = 8, 64


def variant(base: str, source: str) -> str:
    return f"{base}|calibration={source}"


# ---- planning ----------------------------------------------------------------------------------------
def test_each_variant_is_planned_with_a_calibrate_job_of_its_source_alone():
    spec = load_spec(str(SWEEP))[0]
    ctx = planned(spec)
    by_key = {c["config_key"]: c for c in ctx.configs}
    variants = {k: c for k, c in by_key.items() if c.get("variant")}
    # REAP is not in apply_to: it has none
    assert set(variants) == {variant(b, s) for b in (WEIGHTS, DENSE) for s in SOURCES}
    axes = ("output", "scoring", "grouping", "dp_scaling", "K", "recovery", "kind", "settings")
    for b in (WEIGHTS, DENSE):
        for s in SOURCES:
            v = variants[variant(b, s)]
            assert (v["variant"], v["variant_of"]) == (f"calibration={s}", b)
            assert {a: v.get(a) for a in axes} == {a: by_key[b].get(a) for a in axes}
    cal, conv = ctx.jobs["calibrate"], ctx.jobs["convert"]
    mixed = cal[WEIGHTS]
    assert cal[REAP].key == cal[DENSE].key == mixed.key and "sources" in mixed.params
    alone = {s: cal[variant(WEIGHTS, s)] for s in SOURCES}
    assert len({mixed.key, *(j.key for j in alone.values())}) == 3
    for s, job in alone.items():
        assert cal[variant(DENSE, s)].key == job.key  # configurations calibrated on one source share its job
        src = spec.calibration.sources[s]
        assert job.params["data"] == src.data.model_dump() and "sources" not in job.params
        assert job.params["n_samples"] == N_ALONE
        same = ("teacher", "seq_len", "seed", "batch_size", "chunk_tokens")
        assert {k: job.params[k] for k in same} == {k: mixed.params[k] for k in same}
        assert job.deps == mixed.deps  # the same teacher job
        for b in (WEIGHTS, DENSE):  # the same conversion, on that calibration
            c = conv[variant(b, s)]
            assert c.params == conv[b].params and c.deps["calibrate"] == job.key != conv[b].deps["calibrate"]
    rows = {r["stage"]: r for r in dryrun.plan_counts(spec)[0]}
    assert (rows["calibrate"]["named"], rows["calibrate"]["distinct"]) == (7, 3)
    assert (rows["convert"]["named"], rows["convert"]["distinct"]) == (7, 7)
    assert rows["ppl_pre"]["named"] == 7


def test_a_source_alone_is_the_job_of_a_sweep_calibrated_on_it_alone(tmp_path):
    raw = yaml.safe_load(SWEEP.read_text())
    cal = raw["calibration"]
    raw["calibration"] = {
        "data": cal["sources"]["code"]["data"],
        "n_samples": N_ALONE,
        "seq_len": cal["seq_len"],
        "batch_size": cal["batch_size"],
    }
    plain = planned(spec_of(raw, tmp_path))
    ours = planned(load_spec(str(SWEEP))[0])
    assert plain.jobs["calibrate"][WEIGHTS].key == ours.jobs["calibrate"][variant(WEIGHTS, "code")].key


def test_existing_configurations_keep_their_order_and_keys(tmp_path):
    """single_source adds configurations and jobs; those of the sweep without it stay the same."""
    spec = load_spec(str(SWEEP))[0]
    raw = yaml.safe_load(SWEEP.read_text())
    del raw["calibration"]["single_source"]
    plain, ours = planned(spec_of(raw, tmp_path)), planned(spec)
    keys = [c["config_key"] for c in plain.configs]
    assert [c["config_key"] for c in ours.configs][: len(keys)] == keys  # variants come last
    for stage, jobs in plain.jobs.items():
        assert {k: j.key for k, j in jobs.items()} == {k: ours.jobs[stage][k].key for k in jobs}, stage
    # the section's dump (what a job reads of it, e.g. the d2d baseline's) never holds single_source
    assert spec.calibration.model_dump() == spec_of(raw, tmp_path).calibration.model_dump()


def test_plan_note_names_each_pass_and_its_samples():
    from orchestrator.stages.calibrate import plan_note

    assert plan_note(planned(load_spec(str(SWEEP))[0])) == (
        f"3 passes of {SEQ}-token windows: mixed prose 16 + code 16; prose alone 8; code alone 8"
    )
    assert plan_note(planned(load_spec(SEED003)[0])) == (
        "4 passes of 4096-token windows: mixed c4 11 + math 11 + code 10; c4 alone 32; math alone 32; "
        "code alone 32"
    )


@pytest.mark.parametrize(
    "change, expect",
    [
        ({"sources": ["web"]}, "calibration.single_source: 'web' is not a calibration source"),
        ({"sources": []}, "calibration.single_source.sources: name at least one calibration source"),
        ({"sources": ["code", "code"]}, "calibration.single_source.sources: 'code' named twice"),
        ({"n_samples": 0}, "calibration.single_source.n_samples: Input should be greater than 0 (got 0)"),
        (
            {"n_samples": "8"},
            "calibration.single_source.n_samples: Input should be a valid integer (got '8')",
        ),
        (
            {"apply_to": {"colour": 1}},
            "calibration.single_source.apply_to: 'colour' is not an axis; allowed:",
        ),
        (
            {"apply_to": []},
            "calibration.single_source.apply_to: a mapping (axis: values) or a non-empty list",
        ),
        ({"apply_to": {"scoring": []}}, "apply_to: scoring: a value or a non-empty list of values, got []"),
        ({"apply_to": {"scoring": "CP"}}, "apply_to: {'scoring': 'CP'} matches no configuration of the grid"),
        (
            {"every": True},
            "calibration.single_source.every: unknown key; allowed: sources, n_samples, apply_to",
        ),
    ],
)
def test_bad_settings_are_one_line_errors(tmp_path, change, expect):
    raw = yaml.safe_load(SWEEP.read_text())
    raw["calibration"]["single_source"].update(change)
    with pytest.raises(SpecError) as e:
        P.build_configs(spec := spec_of(raw, tmp_path), P.stated_shape(spec))
    assert expect in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_single_source_needs_named_sources_and_free_labels(tmp_path):
    raw = yaml.safe_load(SWEEP.read_text())
    raw["calibration"] = {"data": {"source": "tiny"}, "single_source": {}}
    with pytest.raises(SpecError, match=r"calibration\.single_source: needs calibration\.sources"):
        spec_of(raw, tmp_path)
    raw = yaml.safe_load(SWEEP.read_text())
    raw["calibration"]["sources"]["dcdm"] = raw["calibration"]["sources"].pop("code")
    with pytest.raises(SpecError, match=r"source 'dcdm': its variant `calibration=dcdm` would be the DCDM"):
        spec_of(raw, tmp_path)


def test_reaps_super_expert_rule_reads_the_max_activations_of_the_source_alone(tmp_path):
    """A variant that protects super experts by REAP's rule gets the expert_maxima pass of its own windows."""
    raw = yaml.safe_load(SWEEP.read_text())
    raw["grid"][0]["settings"] = {"moe": {"super_experts": "reap"}}
    ctx = planned(spec_of(raw, tmp_path))
    cal, maxima = ctx.jobs["calibrate"], ctx.jobs["expert_maxima"]
    assert set(maxima) == {WEIGHTS, REAP, *(variant(WEIGHTS, s) for s in SOURCES)}
    for s in SOURCES:
        job = maxima[variant(WEIGHTS, s)]
        assert (
            job.params["data"] == cal[variant(WEIGHTS, s)].params["data"]
            and job.params["n_samples"] == N_ALONE
        )
        assert (
            ctx.jobs["convert"][variant(WEIGHTS, s)].deps["expert_maxima"] == job.key != maxima[WEIGHTS].key
        )


# ---- seed 003 --------------------------------------------------------------------------------------------
def test_seed003_plans_every_configuration_the_paper_import_writes():
    """Table 2's single-domain rows (Weights, HC-SMoE, CFES on c4, math, code) are our variants, its fixed
    mix our main CFES configuration, DCDM its mixture (added once DCDM ran), Original our teacher."""
    from analysis.reference import c2f
    from orchestrator.stages.dcdm import mixture_config

    spec = load_spec(SEED003)[0]
    ctx = planned(spec)
    ours = {c["config_key"]: c for c in ctx.configs}
    ours |= {
        m["config_key"]: m
        for m in (mixture_config(c) for c in ctx.configs if c["config_key"] in ctx.jobs["dcdm"])
    }
    ref = {c["config_key"]: c for c in c2f()["configs"]}
    assert len(ref) == 12 and set(ref) <= set(ours), sorted(set(ref) - set(ours))
    single = {k for k, c in ours.items() if (c.get("variant") or "").split("=")[-1] in ("c4", "math", "code")}
    bases = (
        "moe|CFES|K=64|recovery=none",
        "moe|Weights|K=64|recovery=none",
        "merged|HC-SMoE|K=64|recovery=none",
    )
    assert single == {f"{b}|calibration={s}" for b in bases for s in ("c4", "math", "code")}
    assert all(ours[k]["variant_of"] == k.rsplit("|", 1)[0] for k in single)
    for k in single:  # 32 windows of 4,096 tokens of one domain, its data as in the mix
        job = ctx.jobs["calibrate"][k]
        src = spec.calibration.sources[k.rsplit("=", 1)[1]]
        assert (job.params["n_samples"], job.params["seq_len"], job.params["data"]) == (
            32,
            4096,
            src.data.model_dump(),
        )
    mixed = ctx.jobs["calibrate"]["moe|CFES|K=64|recovery=none"].params["sources"]
    assert {s: v["n_samples"] for s, v in mixed.items()} == {"c4": 11, "math": 11, "code": 10}


def test_seed003_runs_dcdm_on_the_mixed_cfes_only():
    """DCDM mixes the mixed calibration's sources: never a variant's (a single-source file has one)."""
    rows = {r["stage"]: r for r in dryrun.plan_counts(load_spec(SEED003)[0])[0]}
    assert (rows["dcdm"]["named"], rows["calibrate"]["distinct"], rows["convert"]["named"]) == (1, 4, 13)


def own_seed003(store, name: str) -> dict[str, float]:
    """Our seed003 configurations stored as a launch stores them (variants linked to their bases), each
    with an MMLU accuracy of its own; {config_key: accuracy}."""
    from analysis.reference import C2F_MODEL

    spec = load_spec(SEED003)[0]
    configs = [dict(c, model=C2F_MODEL) for c in P.build_configs(spec, P.stated_shape(spec))]
    sid = store.upsert_sweep(name, spec_yaml=f"name: {name}")
    ids = store.upsert_configs(sid, configs)
    store.set_config_fields(
        {ids[c["config_key"]]: {"variant_of": ids[c["variant_of"]]} for c in configs if c.get("variant_of")}
    )
    acc = {ck: round(0.30 + 0.01 * i, 2) for i, ck in enumerate(ids)}
    links = []
    for ck, cid in ids.items():
        job = f"{name}:{ck}"
        store.register_jobs(sid, [{"key": job, "stage": "evaluate", "params": {"k": job}}])
        assert store.claim(job, "t")
        metric = {"name": "acc", "stage": "post", "task": "mmlu", "value": acc[ck], "headline": 1}
        store.finish(job, "t", {"metrics": [metric]}, 0.1)
        links.append((cid, "evaluate", store.jobs([job])[job]["id"]))
    store.link(links)
    return acc


def test_the_report_puts_each_single_domain_run_beside_the_papers(tmp_path):
    """`moesweep report --compare paper`'s table of smaller MoEs: each single-domain run on the line of the
    paper's run of the same method on the same domain (matched by key)."""
    from analysis.load import load_frames
    from analysis.reference import C2F_SWEEP, c2f, read_table
    from analysis.report import write_report
    from db.store import Store

    store = Store(f"sqlite:///{tmp_path}/r.db")
    store.import_reference([c2f()])
    acc = own_seed003(store, "own-c2f")
    write_report(
        load_frames(store.engine, ["own-c2f"]),
        "own-c2f",
        tmp_path / "r",
        load_frames(store.engine, [C2F_SWEEP]),
    )
    body = (tmp_path / "r" / "tables" / "moe.tex").read_text().split(r"\toprule", 1)[1]
    lines = [ln.strip() for ln in body.splitlines() if ln.strip().endswith("\\\\")]
    label = {"Weights": ("prune", "Weights"), "HC-SMoE": ("merge", "HC-SMoE"), "Ours": ("prune", "CFES")}
    key = {"Weights": "moe|Weights", "HC-SMoE": "merged|HC-SMoE", "Ours": "moe|CFES"}
    n = 0
    for r in read_table("c2f_table2_3_qwen3_thinking"):
        if r["method"] not in label or r["calibration"] not in ("c4", "math", "code"):
            continue
        kind, method = label[r["method"]]
        ours = 100 * acc[f"{key[r['method']]}|K=64|recovery=none|calibration={r['calibration']}"]
        row = f"{kind} & {method} (calibration={r['calibration']}) & 64 & none & {ours:.2f} & {ours:.2f} & {r['mmlu']}"
        assert any(ln.startswith(row + " & ") for ln in lines), (row, lines)
        n += 1
    assert n == 9


# ---- Weights (CD-MoE's PS / SF) ----------------------------------------------------------------------------
def raw_router(seed: int, N: int = 300, E: int = 10, k: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """(p, routed) of a router on N tokens: the softmax over E logits and the top-k mask; expert E-1's
    logits are so low that it is never selected."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(N, E, generator=gen, dtype=torch.float64) * 2
    logits[:, -1] -= 50
    p = logits.softmax(-1)
    routed = torch.zeros(N, E, dtype=torch.bool).scatter_(1, p.topk(k, dim=1).indices, True)
    return p, routed


def weights_ctx(p: torch.Tensor, routed: torch.Tensor, k: int = 2):
    from test_scoring import ctx_from_stats

    from workers.methods.diagnostics import stats_from_tokens

    f = torch.ones(*p.shape, 1, dtype=torch.float64)
    return ctx_from_stats(stats_from_tokens(p, routed, p * routed, f), k=k)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_weights_is_mean_routing_weight_over_activation_frequency(seed):
    from workers.methods.scoring import weights

    p, routed = raw_router(seed)
    avg_weight = (p * routed).sum(0) / p.shape[0]  # over all tokens, 0 where not selected
    freq = routed.double().sum(0) / p.shape[0]
    want = torch.where(freq > 0, avg_weight / freq.clamp_min(1e-300), torch.zeros_like(freq))
    got = weights(weights_ctx(p, routed))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    assert float(got[-1]) == 0.0 and float(freq[-1]) == 0.0  # exact: never selected, so 0 by definition


@pytest.mark.parametrize("seed", [3, 4, 5])
def test_weights_equals_cp_and_ranks_like_it(seed):
    from workers.methods.scoring import SCORINGS, cp, weights
    from workers.methods.selection import top_k

    ctx = weights_ctx(*raw_router(seed))
    torch.testing.assert_close(weights(ctx), cp(ctx), rtol=1e-12, atol=0)
    for K in range(2, 11):
        assert SCORINGS["Weights"].select(ctx, weights(ctx), K).selected == top_k(cp(ctx), K)


def test_weights_is_a_scoring_sweeps_name():
    from orchestrator.axes import AXES
    from orchestrator.stage import code_components
    from workers.methods.scoring import SCORINGS, select_top_k, weights

    assert SCORINGS["Weights"].score is weights and SCORINGS["Weights"].select is select_top_k
    assert "Weights" in AXES["scoring"].allowed()  # read from the registry's source, as a sweep is checked
    code = code_components("convert", {"output": "moe", "scoring": "Weights", "K": 4})
    assert set(code) == {"stage:convert", "output:moe", "scoring:Weights"}


# ---- a sweep --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def run(tmp_path_factory):
    with launched_twice(SWEEP, tmp_path_factory.mktemp("single_source")) as launched:
        yield launched


def rows(store, sql: str, **params) -> list[tuple]:
    return store.query(sql, params)[1]


def linked(store, stage: str) -> dict[str, tuple[str, dict, dict]]:
    """{config_key: (job key, params, outputs)} of the jobs linked to configurations for `stage`."""
    return {
        ck: (key, json.loads(params), json.loads(outputs or "null"))
        for ck, key, params, outputs in rows(
            store,
            "SELECT c.config_key, j.key, j.params_json, j.outputs_json FROM config_jobs cj "
            "JOIN configurations c ON c.id = cj.config_id JOIN jobs j ON j.id = cj.job_id WHERE cj.stage = :s",
            s=stage,
        )
    }


@pytest.mark.slow
def test_the_variants_are_stored_converted_and_measured(run):
    store = run["store"]
    assert run["code"] == 0
    got = rows(
        store,
        "SELECT v.config_key, v.variant, b.config_key, r.ppl_pre FROM configurations v "
        "JOIN configurations b ON b.id = v.variant_of JOIN results r ON r.config_id = v.id ORDER BY v.config_key",
    )
    want = sorted(variant(b, s) for b in (WEIGHTS, DENSE) for s in SOURCES)
    assert [g[0] for g in got] == want
    for key, label, base, ppl in got:
        assert label == f"calibration={key.rsplit('=', 1)[1]}" and key == f"{base}|{label}"
        assert ppl is not None and math.isfinite(ppl)  # its conversion and ppl_pre ran
    cal, conv = linked(store, "calibrate"), linked(store, "convert")
    assert set(conv) >= set(want) and set(linked(store, "ppl_pre")) >= set(want)
    for s in SOURCES:
        assert cal[variant(WEIGHTS, s)][0] == cal[variant(DENSE, s)][0] != cal[WEIGHTS][0]
        # the same conversion parameters, another job: its key hashes the other calibration
        assert (
            conv[variant(WEIGHTS, s)][1] == conv[WEIGHTS][1]
            and conv[variant(WEIGHTS, s)][0] != conv[WEIGHTS][0]
        )
    assert cal[variant(WEIGHTS, "prose")][0] != cal[variant(WEIGHTS, "code")][0]
    assert len({k for k, _, _ in cal.values()}) == 3
    # the variants' plans come from their own statistics (the mixed and the code-only plans differ)
    plans = dict(rows(store, "SELECT config_key, plan_key FROM results WHERE plan_key IS NOT NULL"))
    assert plans[variant(WEIGHTS, "code")] != plans[variant(WEIGHTS, "prose")]


@pytest.mark.slow
def test_a_source_alone_holds_n_samples_of_it(run):
    from workers.calibration.calibrate import load_source_stats, stats_metadata

    store, spec = run["store"], run["spec"]
    cal = linked(store, "calibrate")
    for s in SOURCES:
        _, params, out = cal[variant(WEIGHTS, s)]
        assert out["sources"] == {"default": {"n_tokens": N_ALONE * SEQ, "weight": 1.0, "n_samples": N_ALONE}}
        assert out["n_tokens"] == N_ALONE * SEQ
        meta = stats_metadata(out["stats"])
        assert json.loads(meta["data"]) == spec.calibration.sources[s].data.model_dump() == params["data"]
        assert json.loads(meta["n_samples"]) == N_ALONE
        per = load_source_stats(out["stats"])
        assert list(per) == ["default"] and {st.n_tokens for st in per["default"].values()} == {N_ALONE * SEQ}
    _, _, mixed = cal[WEIGHTS]
    assert {s: v["n_samples"] for s, v in mixed["sources"].items()} == {"prose": 16, "code": 16}


@pytest.mark.slow
def test_a_variants_weights_plan_is_that_of_its_sources_raw_router_outputs(run):
    """The code-only Weights plan recomputed apart: the teacher's routers on 8 windows of the code domain,
    each expert's mean routing weight over all tokens (0 where not selected) over its selection frequency."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from workers.core.data import DataSpec, load_texts, token_windows

    store = run["store"]
    ((teacher_out,),) = rows(store, "SELECT outputs_json FROM jobs WHERE stage = 'teacher'")
    tdir = json.loads(teacher_out)["path"]
    teacher = AutoModelForCausalLM.from_pretrained(tdir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tdir)
    ids = token_windows(
        tok, load_texts(DataSpec(source="tiny", split="train:code"), tiny_dir=tdir), SEQ, N_ALONE, 1234
    )
    seen: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    hooks = [
        layer.mlp.gate.register_forward_hook(
            lambda m, a, out, i=i: seen.setdefault(i, []).append((out[0].double(), out[2]))
        )
        for i, layer in enumerate(teacher.model.layers)
    ]
    with torch.no_grad():
        teacher(input_ids=ids)
    for h in hooks:
        h.remove()
    key, _, out = linked(store, "convert")[variant(WEIGHTS, "code")]
    plan = rows(
        store,
        "SELECT p.layer, p.expert, p.score FROM plan_rows p JOIN jobs j ON j.id = p.job_id WHERE j.key = :k",
        k=key,
    )
    assert {layer for layer, _, _ in plan} == set(seen)
    for layer, parts in seen.items():
        logits = torch.cat([lg for lg, _ in parts])
        idx = torch.cat([ix for _, ix in parts])
        p = logits.softmax(-1)
        routed = torch.zeros_like(p, dtype=torch.bool).scatter_(1, idx, True)
        assert p.shape[0] == N_ALONE * SEQ
        avg_weight, freq = (p * routed).mean(0), routed.double().mean(0)
        want = torch.where(freq > 0, avg_weight / freq.clamp_min(1e-300), torch.zeros_like(freq))
        kept = {e: s for lyr, e, s in plan if lyr == layer}
        assert sorted(kept) == sorted(want.topk(4).indices.tolist())
        got = torch.tensor([kept[e] for e in sorted(kept)], dtype=torch.float64)
        torch.testing.assert_close(got, want[sorted(kept)], rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_a_relaunch_runs_nothing(run):
    assert run["code2"] == 0
    assert run["again"] == run["jobs"] and all(status == "succeeded" for *_, status in run["jobs"])
