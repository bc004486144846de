"""Distillation loop (§3.5, §4.3, Appendix J) on a tiny Qwen3-MoE teacher, and its 2-process gloo path."""

import copy
import math

import pytest
import torch
from distill_setup import GLOO_SETTINGS, T, saved_job, teacher_sampled, tiny_teacher

from workers.baselines.baselines import random_ffn_student
from workers.families import get_adapter
from workers.training.distill import DistillSpec, distill, lr_at
from workers.training.losses import forward_kl, hidden_mse, reverse_kl


@pytest.fixture(scope="module")
def teacher():
    return tiny_teacher()


@pytest.fixture(scope="module")
def corpus(teacher):
    return teacher_sampled(teacher, 64)


@pytest.fixture(scope="module")
def adapter(teacher):
    return get_adapter(teacher)


def student_of(teacher, adapter, seed=0):
    return random_ffn_student(teacher, adapter, seed)


def micro_batches(data: torch.Tensor, b: int):
    return (data[i : i + b] for i in range(0, len(data), b))


def spec(**kw) -> DistillSpec:
    base = dict(
        steps=12, batch_size=4, seq_len=T, lr=3e-3, min_lr=3e-4, warmup=2, eval_every=4, val_windows=8
    )
    return DistillSpec(**{**base, **kw})


def test_spec_validation_and_budget():
    s = spec(grad_accum=3, betas=[0.9, 0.95])
    assert s.betas == (0.9, 0.95)
    assert s.tokens == 12 * 4 * 3 * T
    for field, value in [
        ("loss", "kl"),
        ("dtype", "fp16"),
        ("steps", 0),
        ("min_lr", 1.0),
        ("tau", 0.0),
        ("teacher_top_k", 0),
        ("betas", (0.9, 1.0)),
        ("teacher_renormalize", "yes"),
    ]:
        with pytest.raises(ValueError, match=f"DistillSpec.{field}"):
            spec(**{field: value})
    with pytest.raises(ValueError, match="allowed: forward_kl, intermediate, reverse_kl"):
        spec(loss="jsd")


def test_lr_schedule_warmup_then_cosine():
    s = spec(steps=20, warmup=4, lr=1.0, min_lr=0.1)
    lrs = [lr_at(i, s) for i in range(20)]
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert lrs[4] == pytest.approx(1.0) and lrs[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:], strict=False))
    mid = 4 + (19 - 4) / 2  # half way through the decay: the mean of lr and min_lr
    assert lr_at(int(mid), s) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * (int(mid) - 4) / 15)))


def test_distill_lowers_student_val_ce_and_records_curves(teacher, adapter, corpus):
    student = student_of(teacher, adapter)
    val = corpus[48:56]
    s = spec()
    calls = []
    seen = []
    res = distill(
        student,
        teacher,
        adapter,
        micro_batches(corpus[:48], 4),
        val,
        s,
        progress=lambda i, n: calls.append((i, n)),
        on_val=seen.append,
    )
    assert res["tokens"] == s.steps * s.batch_size * s.grad_accum * s.seq_len == 12 * 4 * T
    assert len(res["loss_curve"]) == 12 and res["loss_curve"][-1] < res["loss_curve"][0]
    st = [r for r in res["val"] if r["who"] == "student"]
    te = [r for r in res["val"] if r["who"] == "teacher"]
    assert [r["step"] for r in st] == [0, 4, 8, 12] == [r["step"] for r in te]
    assert [r["tokens"] for r in st] == [0, 4 * 4 * T, 8 * 4 * T, 12 * 4 * T]
    assert st[-1]["value"] < st[0]["value"] - 0.3  # the student learns from the teacher
    assert len({r["value"] for r in te}) == 1 and te[0]["value"] < st[-1]["value"]  # measured once
    assert seen == res["val"] and calls[-1] == (12, 12) and len(calls) == 12
    assert res["teacher_routing"] is None and not student.training


def test_grad_accum_equals_larger_batch(teacher, adapter, corpus):
    data = corpus[:8]
    a, b = student_of(teacher, adapter), student_of(teacher, adapter)
    val = corpus[48:52]
    ra = distill(a, teacher, adapter, micro_batches(data, 4), val, spec(steps=1, batch_size=4, grad_accum=2))
    rb = distill(b, teacher, adapter, micro_batches(data, 8), val, spec(steps=1, batch_size=8, grad_accum=1))
    assert ra["tokens"] == rb["tokens"] == 8 * T
    assert ra["loss_curve"][0] == pytest.approx(rb["loss_curve"][0], rel=1e-5)
    for (n, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.allclose(pa, pb, atol=1e-6), n


def test_activation_checkpointing_gives_the_same_step(teacher, adapter, corpus):
    data, val = corpus[:4], corpus[48:50]
    a, b = student_of(teacher, adapter), student_of(teacher, adapter)
    ra = distill(a, teacher, adapter, micro_batches(data, 4), val, spec(steps=1))
    during = []
    rb = distill(
        b,
        teacher,
        adapter,
        micro_batches(data, 4),
        val,
        spec(steps=1, grad_checkpoint=True),
        progress=lambda i, n: during.append(
            any(getattr(m, "gradient_checkpointing", False) for m in b.modules())
        ),
    )
    assert during == [True]
    assert ra["loss_curve"] == pytest.approx(rb["loss_curve"], rel=1e-6)
    assert all(torch.allclose(p, q, atol=1e-6) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert not any(getattr(m, "gradient_checkpointing", False) for m in b.modules())


def test_seeded_runs_are_identical(teacher, adapter, corpus):
    data, val = corpus[:16], corpus[48:52]
    runs = []
    for _ in range(2):
        st = student_of(teacher, adapter, seed=7)
        res = distill(st, teacher, adapter, micro_batches(data, 4), val, spec(steps=4, eval_every=2))
        runs.append((res, st))
    # exact: the claim is reproducibility: the same seed and data, the same ops in the same order on the same shapes
    assert runs[0][0]["loss_curve"] == runs[1][0]["loss_curve"]
    assert runs[0][0]["val"] == runs[1][0]["val"]
    assert all(
        torch.equal(p, q) for p, q in zip(runs[0][1].parameters(), runs[1][1].parameters(), strict=True)
    )


def _first_step_loss(teacher, adapter, student, ids, loss, k=None):
    """The loss of the first step recomputed by hand from full logits and hidden states."""
    with torch.no_grad():
        ctx = adapter.routing_top_k(teacher, k) if k else torch.autograd.grad_mode.no_grad()
        with ctx:
            t = teacher(input_ids=ids, output_hidden_states=True)
        s = student(input_ids=ids, output_hidden_states=True)
    if loss == "reverse_kl":
        return reverse_kl(t.logits, s.logits).item()
    value = forward_kl(t.logits, s.logits).item()
    if loss == "intermediate":
        value += 0.5 * hidden_mse(t.hidden_states[1:], s.hidden_states[1:]).item()
    return value


@pytest.mark.parametrize("loss", ["forward_kl", "reverse_kl", "intermediate"])
def test_loop_uses_the_named_loss(teacher, adapter, corpus, loss):
    data = corpus[:4]
    st = student_of(teacher, adapter)
    expected = _first_step_loss(teacher, adapter, copy.deepcopy(st), data, loss)
    res = distill(
        st,
        teacher,
        adapter,
        micro_batches(data, 4),
        corpus[48:50],
        spec(steps=1, loss=loss, hidden_weight=0.5),
    )
    assert res["loss_curve"][0] == pytest.approx(expected, rel=1e-4)


def test_expanded_teacher_routing_changes_targets_and_is_restored(teacher, adapter, corpus):
    ids = corpus[:4]
    with torch.no_grad():
        native = teacher(input_ids=ids).logits
        with adapter.routing_top_k(teacher, 4):
            expanded = teacher(input_ids=ids).logits
    assert (native - expanded).abs().max() > 1e-3  # k′ = 4 > k = 2 changes the KD targets
    st = student_of(teacher, adapter)
    expected = _first_step_loss(teacher, adapter, copy.deepcopy(st), ids, "forward_kl", k=4)
    res = distill(st, teacher, adapter, micro_batches(ids, 4), corpus[48:52], spec(steps=1, teacher_top_k=4))
    assert res["loss_curve"][0] == pytest.approx(expected, rel=1e-4)
    assert res["teacher_routing"] == {"top_k": 4, "renormalize": True, "native_top_k": 2}
    whos = {r["who"] for r in res["val"]}
    assert whos == {"student", "teacher", "teacher_k4"}
    with torch.no_grad():
        # exact: routing restored afterwards: the same model, input and ops as `native`
        assert torch.equal(teacher(input_ids=ids).logits, native)
    with pytest.raises(ValueError, match="teacher_top_k"):
        distill(
            student_of(teacher, adapter),
            teacher,
            None,
            micro_batches(ids, 4),
            ids,
            spec(steps=1, teacher_top_k=4),
        )


def test_bad_batches_and_bf16(teacher, adapter, corpus):
    st = student_of(teacher, adapter)
    with pytest.raises(ValueError, match="ran out after 2 micro-batches"):
        distill(
            st, teacher, adapter, micro_batches(corpus[:8], 4), corpus[48:50], spec(steps=2, grad_accum=2)
        )
    with pytest.raises(ValueError, match=r"expected \[batch_size, seq_len\]"):
        distill(st, teacher, adapter, micro_batches(corpus[:8], 2), corpus[48:50], spec(steps=1))
    st = student_of(teacher, adapter).to(torch.bfloat16)
    res = distill(
        st, teacher, adapter, micro_batches(corpus[:8], 4), corpus[48:52], spec(steps=2, dtype="bf16")
    )
    assert all(math.isfinite(v) for v in res["loss_curve"])
    assert (
        next(st.parameters()).dtype == torch.bfloat16
    )  # trained with fp32 master weights, handed back in bf16


def test_two_process_gloo_matches_single_process(teacher, adapter, corpus, tmp_path):
    from workers.training.ddp import launch

    student = student_of(teacher, adapter)
    train, val = corpus[:24], corpus[48:53]  # odd val count: uneven rank split
    job = {
        **saved_job(tmp_path, teacher, student, train, val),
        "spec": GLOO_SETTINGS,
        "out": str(tmp_path / "out"),
    }
    multi = launch(job, tmp_path, nproc=2, timeout=120, env={"OMP_NUM_THREADS": "1"})
    single = distill(student, teacher, adapter, micro_batches(train, 4), val, DistillSpec(**GLOO_SETTINGS))
    assert multi["tokens"] == single["tokens"] == 3 * 2 * 4 * T
    assert multi["loss_curve"] == pytest.approx(single["loss_curve"], rel=1e-4)
    assert [(r["who"], r["step"]) for r in multi["val"]] == [(r["who"], r["step"]) for r in single["val"]]
    assert [r["value"] for r in multi["val"]] == pytest.approx([r["value"] for r in single["val"]], rel=1e-5)
    from transformers import AutoModelForCausalLM

    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "student")
    for (n, p), q in zip(trained.named_parameters(), student.parameters(), strict=True):
        # Adam divides by sqrt(v) + eps: embedding rows of rare tokens (gradients near eps) amplify the
        # rounding differences of the two reduction orders, up to a few 1e-5 after 3 steps of lr 3e-3
        assert torch.allclose(p, q, atol=1e-4), n


@pytest.mark.parametrize("loss", ["forward_kl", "intermediate"])
def test_a_llama4_text_dense_student_distills(loss):
    """Llama4ForCausalLM's base_model is the model itself: the loop reaches the decoder's hidden states through
    decoder_of. A few steps on the fixture's llama4_text teacher (expanded routing k′ = 3), the first step's loss
    equal to the one from full logits and hidden states, and the loss falling."""
    from families_cases import make_teacher

    teacher = make_teacher("llama4_text")
    adapter = get_adapter(teacher)
    student = student_of(teacher, adapter)
    assert type(student) is type(teacher) and student.config.moe_layers == []
    g = torch.Generator().manual_seed(2)
    data = torch.randint(0, teacher.config.vocab_size, (16, T), generator=g)
    expected = _first_step_loss(teacher, adapter, copy.deepcopy(student), data[:4], loss, k=3)
    res = distill(
        student,
        teacher,
        adapter,
        micro_batches(data[:12], 4),
        data[12:],
        spec(steps=3, eval_every=3, val_windows=4, teacher_top_k=3, loss=loss, hidden_weight=0.5),
    )
    assert res["loss_curve"][0] == pytest.approx(expected, rel=1e-4)
    assert all(math.isfinite(v) for v in res["loss_curve"]) and res["loss_curve"][-1] < res["loss_curve"][0]
    assert res["teacher_routing"] == {"top_k": 3, "renormalize": False, "native_top_k": 2}
    st = [r["value"] for r in res["val"] if r["who"] == "student"]
    assert len(st) == 2 and all(math.isfinite(v) for v in st)
