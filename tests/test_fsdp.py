"""Sharded distillation (workers/training/fsdp.py): 2 gloo ranks on CPU against the single-process loop."""

import pytest
import torch
from distill_setup import (
    GLOO_SETTINGS,
    T,
    bench_fsdp_smoke,
    one_rank_group,
    saved_job,
    teacher_sampled,
    tiny_teacher,
)

from workers.baselines.baselines import random_ffn_student
from workers.families import get_adapter
from workers.training.distill import DistillSpec, distill
from workers.training.fsdp import FSDPRanks, mixed_precision


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Qwen3-MoE teacher, its random-FFN student, teacher-sampled text; saved for torchrun."""
    teacher = tiny_teacher()
    adapter = get_adapter(teacher)
    ids = teacher_sampled(teacher, 29)
    d = tmp_path_factory.mktemp("fsdp")
    student = random_ffn_student(teacher, adapter, 0)
    train, val = ids[:24], ids[24:29]  # 5 validation windows: 3 on rank 0, 2 (+1 padding) on rank 1
    job = saved_job(d, teacher, student, train, val)
    single = distill(
        student,
        teacher,
        adapter,
        (train[i : i + 4] for i in range(0, 24, 4)),
        val,
        DistillSpec(**GLOO_SETTINGS),
    )
    return {"dir": d, "job": job, "teacher": teacher, "student": student, "single": single}


def _launch(tiny, name: str, **extra):
    from workers.training.ddp import launch

    d = tiny["dir"]
    job = {**tiny["job"], "out": str(d / name), "sharding": "fsdp", **extra}
    job["spec"] = {**GLOO_SETTINGS, **job.get("spec", {})}
    return launch(job, d / f"{name}_work", nproc=2, timeout=180, env={"OMP_NUM_THREADS": "1"})


def _assert_same_run(multi, tiny, out_dir):
    from transformers import AutoModelForCausalLM

    single = tiny["single"]
    assert multi["tokens"] == single["tokens"] == 3 * 2 * 4 * T
    curve = single["loss_curve"]
    assert abs(curve[-1] - curve[0]) > 1e-2  # the curve moves far more than the tolerance: the check can fail
    assert multi["loss_curve"] == pytest.approx(curve, rel=1e-5)
    assert [(r["who"], r["step"]) for r in multi["val"]] == [(r["who"], r["step"]) for r in single["val"]]
    assert [r["value"] for r in multi["val"]] == pytest.approx([r["value"] for r in single["val"]], rel=1e-5)
    init = AutoModelForCausalLM.from_pretrained(tiny["dir"] / "student")
    trained = AutoModelForCausalLM.from_pretrained(out_dir / "student")  # a normal HF checkpoint
    moved = 0.0
    for (n, p), q, p0 in zip(
        trained.named_parameters(), tiny["student"].parameters(), init.parameters(), strict=True
    ):
        assert torch.allclose(p, q, atol=1e-5), n  # measured: 1.5e-7
        moved = max(moved, float((q - p0).detach().abs().max()))
    assert moved > 1e-3  # training changed the weights 100× more than the tolerance


def test_fsdp_two_ranks_match_single_process_and_shard(tiny):
    multi = _launch(tiny, "plain")
    _assert_same_run(multi, tiny, tiny["dir"] / "plain")
    sh = multi["shards"]
    student, teacher = tiny["student"], tiny["teacher"]
    assert sh["student_total"] == sum(p.numel() for p in student.parameters())
    assert sum(sh["student"]) == sh["student_total"]  # every element on exactly one rank
    assert all(0.45 < n / sh["student_total"] < 0.55 for n in sh["student"])  # about half each
    head = teacher.lm_head.weight.numel()  # the teacher's LM head is whole on every rank
    assert sum(sh["teacher"]) == sh["teacher_total"] + head
    assert all(0.45 < (n - head) / (sh["teacher_total"] - head) < 0.55 for n in sh["teacher"])


def test_validation_rows_are_padded_to_the_same_count():
    ranks = FSDPRanks.__new__(FSDPRanks)
    ranks.world = 2
    x = torch.arange(10).reshape(5, 2)
    counts = []
    for ranks.rank in (0, 1):
        rows, real = ranks.val_rows(x)
        counts.append(rows.shape[0])
        assert torch.equal(rows[real], x[:3] if ranks.rank == 0 else x[3:])  # exact: integer rows, sliced
    assert counts == [3, 3]


def test_a_model_without_base_model_layers_is_one_line():
    """DBRX keeps its decoder layers at transformer.blocks: FSDP, which shards one per unit, refuses it."""
    from families_cases import make_teacher

    from workers.core.types import DenseFFN
    from workers.training.fsdp import decoder_layers

    teacher = make_teacher("dbrx")
    adapter = get_adapter(teacher)
    first = {
        i: adapter.expert_weights(teacher, i) for i in adapter.moe_layers(teacher)
    }  # expert 0 of each layer
    student = adapter.build_student(
        teacher,
        {i: DenseFFN(gate=w.gate[0], up=w.up[0], down=w.down[0]) for i, w in first.items()},
        share_weights=True,
    )
    for model in (teacher, student):
        with pytest.raises(ValueError) as e:
            decoder_layers(model)
        assert str(e.value) == "DbrxForCausalLM: no base_model.layers; FSDP shards one decoder layer per unit"


def test_mixed_precision_policy():
    mp = mixed_precision(torch.bfloat16)
    assert mp.param_dtype == torch.bfloat16 and mp.reduce_dtype == torch.float32
    assert mixed_precision(None).param_dtype is None


# ---- the setting: distill.sharding -------------------------------------------------------------------
def _job_params(monkeypatch, **distill):
    """The params of a distill job for a `distill` section (teacher reference and context faked)."""
    from types import SimpleNamespace

    import orchestrator.stages.distill as stage

    monkeypatch.setattr(stage, "teacher_ref", lambda ctx, which: ({"model": "t"}, {}, None))
    d = stage.Distill(settings={"steps": 1, "batch_size": 1, "seq_len": 8}, **distill)
    ctx = SimpleNamespace(spec=SimpleNamespace(distill=d), job=lambda stage_name, params, deps, **kw: params)
    ppl = SimpleNamespace(params={"student": {"type": "plan"}, "teacher": {}}, deps={})
    return stage.distill_job(ctx, ppl, {})


def test_sharding_setting_enters_the_job_only_when_set(monkeypatch):
    from workers.run.distill import _sharding

    before = {"teacher", "student", "teacher_of_student", "settings", "data", "val_data", "processes"}
    assert set(_job_params(monkeypatch)) == before == set(_job_params(monkeypatch, processes=4))
    p = _job_params(monkeypatch, processes=4, sharding="fsdp", teacher_offload=True)
    assert p["sharding"] == "fsdp" and p["teacher_offload"] is True
    assert _sharding(None, 1) == "none" and _sharding(None, 2) == "ddp" and _sharding("fsdp", 1) == "fsdp"


@pytest.mark.parametrize(
    "section, message",
    [
        (
            {"sharding": "none", "processes": 2},
            "sharding: 'none' runs one process; processes must be 1, got 2",
        ),
        (
            {"teacher_offload": True, "processes": 2},
            "teacher_offload: needs sharding: fsdp, got sharding: None",
        ),
        ({"sharding": "zero3"}, "Input should be 'none', 'ddp' or 'fsdp'"),
    ],
)
def test_bad_sharding_settings_are_one_line(section, message):
    from pydantic import ValidationError

    from orchestrator.stages.distill import Distill

    with pytest.raises(ValidationError, match=message):
        Distill(**section)


# ---- one rank in this process: what the 2-rank runs cannot see from outside --------------------------
@pytest.fixture
def one_rank(tmp_path):
    with one_rank_group(tmp_path):
        yield


def _one_rank_run(tiny, **settings):
    """fsdp_worker on fresh copies of the saved teacher/student; forwards of the student's first MLP counted
    (inside the layer: HF checkpoints a layer's forward, under its FSDP hooks)."""
    from transformers import AutoModelForCausalLM

    from workers.training.fsdp import fsdp_worker

    d = tiny["dir"]
    teacher = AutoModelForCausalLM.from_pretrained(d / "teacher")
    student = AutoModelForCausalLM.from_pretrained(d / "student")
    calls = []
    student.model.layers[0].mlp.register_forward_pre_hook(lambda m, a: calls.append(torch.is_grad_enabled()))
    train, val = torch.load(d / "train.pt"), torch.load(d / "val.pt")
    spec = DistillSpec(**{**GLOO_SETTINGS, "steps": 1, **settings})
    res = fsdp_worker(
        student, teacher, get_adapter(teacher), (train[i : i + 4] for i in range(0, 8, 4)), val, spec
    )
    return res, calls


def test_checkpointing_recomputes_inside_the_sharded_layers(tiny, one_rank):
    plain, calls = _one_rank_run(tiny)
    ckpt, calls_ckpt = _one_rank_run(tiny, grad_checkpoint=True)
    assert ckpt["loss_curve"] == pytest.approx(plain["loss_curve"], rel=1e-6)
    # validation at steps 0 and 1 (no grad, 2 batches each) + 2 micro-batches, which checkpointing runs again
    assert calls == [False, False, True, True, False, False]
    assert calls_ckpt == [False, False, True, True, True, True, False, False]


def test_bf16_mixed_precision_on_one_rank_is_close_to_autocast(tiny, one_rank):
    from transformers import AutoModelForCausalLM

    res, _ = _one_rank_run(tiny, dtype="bf16")
    d = tiny["dir"]
    teacher = AutoModelForCausalLM.from_pretrained(d / "teacher")
    student = AutoModelForCausalLM.from_pretrained(d / "student")
    train, val = torch.load(d / "train.pt"), torch.load(d / "val.pt")
    ref = distill(
        student,
        teacher,
        get_adapter(teacher),
        (train[i : i + 4] for i in range(0, 8, 4)),
        val,
        DistillSpec(**{**GLOO_SETTINGS, "steps": 1, "dtype": "bf16"}),
    )
    assert res["loss_curve"] == pytest.approx(
        ref["loss_curve"], rel=5e-3
    )  # bf16 params vs bf16 autocast: 1e-3
    assert abs(res["loss_curve"][0] - tiny["single"]["loss_curve"][0]) > 1e-3  # and not fp32 (6e-3 away)


# ---- the stage: distill.sharding: fsdp through stage_distill -----------------------------------------
def test_stage_distill_with_fsdp_matches_one_process(tmp_path):
    """stage_distill with processes 2 and sharding fsdp (torchrun; activation checkpointing on, teacher
    offloaded) records the same curves as one process without checkpointing, and writes a student with
    its tokenizer that loads as a normal HF checkpoint."""
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from workers.run.distill import stage_distill
    from workers.tiny.tokenizer import train_tokenizer

    texts = [f"doc {i}: " + "alpha beta gamma delta epsilon " * (2 + i % 4) for i in range(60)]
    data = tmp_path / "text.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    tok = train_tokenizer(texts, 300, tmp_path / "teacher")
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(
        Qwen3MoeConfig(
            vocab_size=len(tok),
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            max_position_embeddings=64,
            tie_word_embeddings=False,
        )
    ).save_pretrained(tmp_path / "teacher")
    settings = dict(steps=2, batch_size=2, seq_len=16, lr=3e-3, warmup=1, eval_every=1, val_windows=3)

    def run(name: str, settings: dict, **extra) -> dict:
        params = {
            "teacher": {"source": "local", "dtype": "float32"},
            "student": {"type": "random_ffn", "seed": 0},
            "settings": settings,
            "data": {"source": "jsonl", "path": str(data)},
            "val_data": {"source": "jsonl", "path": str(data)},
            **extra,
        }
        payload = {
            "params": params,
            "inputs": {"teacher": {"path": str(tmp_path / "teacher")}},
            "workdir": str(tmp_path / name),
            "home": str(tmp_path),
        }
        (tmp_path / name).mkdir()
        return stage_distill(payload, {}, None)

    one = run("one", settings, processes=1)
    two = run(
        "two", {**settings, "grad_checkpoint": True}, processes=2, sharding="fsdp", teacher_offload=True
    )
    curve = [(m["name"], m.get("who"), m.get("step")) for m in one["metrics"]]
    assert curve == [(m["name"], m.get("who"), m.get("step")) for m in two["metrics"]]
    assert [m["value"] for m in two["metrics"]] == pytest.approx(
        [m["value"] for m in one["metrics"]], rel=1e-5
    )
    assert two["metrics"][-1]["extra"] == {**one["metrics"][-1]["extra"], "processes": 2, "sharding": "fsdp"}
    student_ce = [m["value"] for m in one["metrics"] if m["name"] == "val_ce" and m.get("who") == "student"]
    assert (
        len(student_ce) == 3 and abs(student_ce[-1] - student_ce[0]) > 1e-2
    )  # the curve moves: the check can fail
    a = AutoModelForCausalLM.from_pretrained(one["outputs"]["path"])
    b = AutoModelForCausalLM.from_pretrained(two["outputs"]["path"])
    assert all(torch.allclose(p, q, atol=1e-5) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert len(AutoTokenizer.from_pretrained(two["outputs"]["path"])) == len(tok)


def test_benchmark_smoke_mode_runs(tmp_path):
    """benchmarks/bench_fsdp.py --smoke (one CPU process, tiny shapes) prints its JSON line."""
    _, line = bench_fsdp_smoke(tmp_path)
    assert line["ranks"] == 1 and line["tokens_per_s"] > 0 and len(line["loss_curve"]) == 4
