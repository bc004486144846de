"""Distillation speed settings (workers/training/distill.py): the decoder layers compiled per layer class
(regional compilation), selective activation checkpointing, fused AdamW on CUDA only, and the micro-step
timed by parts into the step log and the result. Inductor runs on the CPU here (it needs a C compiler:
gcc); every compiled run is compared with the eager one on the same models and data."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from distill_setup import T, V, bench_fsdp_smoke, one_rank_group, tiny_teacher
from torch import nn

from workers.baselines.baselines import random_ffn_student
from workers.families import get_adapter
from workers.training.distill import (
    PHASES,
    DistillSpec,
    _checkpointing,
    base_forward,
    compile_on,
    compiled_forward,
    compiled_layers,
    distill,
    fused_adamw,
    make_optimizer,
)

BASE = dict(steps=3, batch_size=4, seq_len=T, lr=3e-3, min_lr=3e-4, warmup=1, eval_every=2, val_windows=4)


def spec(**kw) -> DistillSpec:
    return DistillSpec(**{**BASE, **kw})


@pytest.fixture(scope="module")
def teacher():
    return tiny_teacher()


@pytest.fixture(scope="module")
def data() -> torch.Tensor:
    return torch.randint(0, V, (28, T), generator=torch.Generator().manual_seed(1))


def batches(data: torch.Tensor, n: int, b: int = 4):
    return (data[i : i + b] for i in range(0, n, b))


def _assert_same_training(a: dict, b: dict, sa: nn.Module, sb: nn.Module, start: nn.Module) -> None:
    """Equal loss curves, validation records and trained weights within float32 reordering noise, where
    training moved the weights far more than that."""
    assert abs(a["loss_curve"][-1] - a["loss_curve"][0]) > 1e-3  # the curve moves: the check can fail
    torch.testing.assert_close(
        torch.tensor(b["loss_curve"]), torch.tensor(a["loss_curve"]), rtol=1e-5, atol=1e-6
    )
    assert [(r["who"], r["step"]) for r in b["val"]] == [(r["who"], r["step"]) for r in a["val"]]
    torch.testing.assert_close(
        torch.tensor([r["value"] for r in b["val"]]),
        torch.tensor([r["value"] for r in a["val"]]),
        rtol=1e-5,
        atol=1e-6,
    )
    # AdamW moves an element by about lr·sign(g) whatever |g| is, so an element whose gradient is near 0 can
    # take a step that differs by up to lr between two float orders (seen: 1 of 1024 by 4.6e-5 with ATen at
    # AVX2): all but 0.5% of the elements within 1e-5 (relative 1e-4), and none further than one step, lr
    moved, far, total = 0.0, 0, 0
    for (n, p), q, p0 in zip(sa.named_parameters(), sb.parameters(), start.parameters(), strict=True):
        diff = (q - p).detach().abs()
        far += int((diff > 1e-5 + 1e-4 * p.detach().abs()).sum())
        total += diff.numel()
        assert float(diff.max()) <= BASE["lr"], n
        moved = max(moved, float((p - p0).detach().abs().max()))
    assert far <= 0.005 * total, (far, total)
    assert moved > 1e-3  # 100× the tolerance of the elements that agree


# ---- settings ----------------------------------------------------------------------------------------------
def test_compile_and_checkpointing_settings():
    for value in ("auto", True, False):
        assert spec(compile=value).compile == value
    for value in (False, True, "selective"):
        assert spec(grad_checkpoint=value).grad_checkpoint == value
    with pytest.raises(
        ValueError, match=r"DistillSpec.compile: 'yes' is not allowed; allowed: auto, true or false"
    ):
        spec(compile="yes")
    with pytest.raises(ValueError, match="DistillSpec.compile: 1 is not allowed"):
        spec(compile=1)
    with pytest.raises(
        ValueError,
        match="DistillSpec.grad_checkpoint: 'partial' is not allowed; allowed: false, true or selective",
    ):
        spec(grad_checkpoint="partial")
    assert spec().compile == "auto" and spec().grad_checkpoint is False  # defaults
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert (compile_on(spec(), cpu), compile_on(spec(), cuda)) == (False, True)
    assert compile_on(spec(compile=True), cpu) and not compile_on(spec(compile=False), cuda)


def test_fused_adamw_on_cuda_parameters_only():
    """CUDA parameters are fake tensors here (no GPU): the choice and AdamW's own checks still run."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    opt = make_optimizer(model, spec())
    assert opt.defaults["fused"] is None and not fused_adamw(list(model.parameters()))
    with FakeTensorMode(allow_non_fake_inputs=True):
        for mod in model:
            for name, p in list(mod.named_parameters(recurse=False)):
                setattr(mod, name, nn.Parameter(torch.empty(p.shape, device="cuda")))
        opt = make_optimizer(model, spec(weight_decay=0.1))
        ints = [torch.empty(2, dtype=torch.long, device="cuda")]
    assert opt.defaults["fused"] is True and [g["fused"] for g in opt.param_groups] == [True, True]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]  # matrices / norms and biases
    assert not fused_adamw(ints) and not fused_adamw([])


# ---- selective activation checkpointing --------------------------------------------------------------------
class _OpCount(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ops[name] = self.ops.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def test_selective_checkpointing_keeps_matmuls_and_recomputes_the_rest(teacher, data):
    """Backward of the student's body: whole-layer checkpointing runs the layers' matmuls again, selective
    does not (they are saved) but does run the elementwise ops again; gradients equal in all three."""
    adapter = get_adapter(teacher)
    ids = data[:4]
    grads, ops = {}, {}
    for mode in (False, True, "selective"):
        st = random_ffn_student(teacher, adapter, 0)
        _checkpointing(st, mode)
        st.train()
        h, _ = base_forward(st, ids, False)
        count = _OpCount()
        with count:
            h.pow(2).mean().backward()
        grads[mode] = [p.grad for p in st.parameters()]
        ops[mode] = count.ops
        assert all(getattr(layer, "gradient_checkpointing", False) == bool(mode) for layer in st.model.layers)
    for mode in (True, "selective"):
        for g, ref in zip(grads[mode], grads[False], strict=True):
            torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-7)
    mm = {m: ops[m].get("mm", 0) for m in ops}
    assert mm["selective"] == mm[False] < mm[True]  # 7 projections per layer recomputed by whole layers
    rsqrt = {m: ops[m].get("rsqrt", 0) for m in ops}
    assert rsqrt[False] < rsqrt["selective"] == rsqrt[True]  # the RMSNorms run again in both


# ---- regional compilation ----------------------------------------------------------------------------------
def test_layers_of_a_class_share_one_compiled_function(teacher, data):
    """Every layer of a model, and a second model of the class, run through one compiled entry: one graph
    for them all (backend "eager": the sharing is dynamo's, whatever the backend); on exit the layers have
    their class's forward back and compute as before."""
    from torch._dynamo.utils import counters

    adapter = get_adapter(teacher)
    models = [random_ffn_student(teacher, adapter, seed) for seed in (0, 1)]
    ids = data[:2]
    graphs = counters["stats"]["unique_graphs"]
    for model in models:
        with torch.no_grad():
            eager = base_forward(model, ids, False)[0]
            with compiled_layers(model, backend="eager") as n:
                assert n == 2 and all("forward" in vars(layer) for layer in model.model.layers)
                out = base_forward(model, ids, False)[0]
        torch.testing.assert_close(out, eager, rtol=1e-6, atol=1e-6)
        assert not any("forward" in vars(layer) for layer in model.model.layers)
    assert counters["stats"]["unique_graphs"] - graphs == 1  # 2 models × 2 layers, compiled once
    assert compiled_forward(type(models[0].model.layers[0]), "eager") is compiled_forward(
        type(models[1].model.layers[1]), "eager"
    )
    with compiled_layers(models[0], on=False) as n:
        assert n == 0 and not any("forward" in vars(layer) for layer in models[0].model.layers)


def test_the_checkpoint_is_compiled_inside_the_layer(teacher, data):
    """The layer's checkpointing wrapper runs inside the compiled forward: the traced training graph holds
    the checkpointed region (dynamo's tag_activation_checkpoint), with the selective policy too."""
    graphs: list[str] = []

    def record(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm.code)
        return gm.forward

    adapter = get_adapter(teacher)
    for mode in (False, "selective"):
        st = random_ffn_student(teacher, adapter, 0)
        _checkpointing(st, mode)
        st.train()
        graphs.clear()
        with compiled_layers(st, backend=record):
            base_forward(st, data[:2], False)[0].sum().backward()
        assert len(graphs) == 1  # one graph for both layers
        assert ("tag_activation_checkpoint" in graphs[0]) == bool(mode)


def test_compiled_distillation_with_selective_checkpointing_equals_eager(teacher, data, monkeypatch):
    """Inductor on the CPU: teacher and student layers compiled (the student's with selective checkpointing
    inside) and the KD loss's closed form compiled give the eager run's losses, validation and weights; the
    layers are compiled while it trains and plain afterwards."""
    from workers.training import losses

    calls = []
    real = losses.call_compiled
    monkeypatch.setattr(losses, "call_compiled", lambda fn, *a: calls.append(fn.__name__) or real(fn, *a))
    adapter = get_adapter(teacher)
    start = random_ffn_student(teacher, adapter, 0)
    sa, sb = copy.deepcopy(start), copy.deepcopy(start)
    a = distill(sa, teacher, adapter, batches(data, 24), data[24:], spec(grad_accum=2, compile=False))
    assert calls == []  # eager: the in-place closed forms
    during = []

    def watch(i: int, n: int) -> None:
        during.append(all("forward" in vars(m) for m in [*sb.model.layers, *teacher.model.layers]))

    b = distill(
        sb,
        teacher,
        adapter,
        batches(data, 24),
        data[24:],
        spec(grad_accum=2, compile=True, grad_checkpoint="selective"),
        progress=watch,
    )
    assert during == [True, True, True]
    assert len(calls) == 3 * 2 and set(calls) == {
        "_forward_kl_fusable"
    }  # 3 steps of 2 micro-steps, one chunk
    assert not any("forward" in vars(m) for m in [*sb.model.layers, *teacher.model.layers])
    assert not any(getattr(m, "gradient_checkpointing", False) for m in sb.modules())
    _assert_same_training(a, b, sa, sb, start)


@pytest.fixture
def one_rank(tmp_path):
    with one_rank_group(tmp_path):
        yield


def test_compiled_fsdp_with_checkpointing_equals_eager(teacher, data, one_rank):
    """fsdp_worker (fully_shard per layer) with the layers compiled after sharding and whole-layer
    checkpointing inside them: FSDP's gathers run around the compiled forward, and the run is the eager
    one-process run."""
    from workers.training.fsdp import fsdp_worker

    adapter = get_adapter(teacher)
    start = random_ffn_student(teacher, adapter, 0)
    sa = copy.deepcopy(start)
    settings = spec(steps=2, eval_every=1)
    a = distill(sa, teacher, adapter, batches(data, 8), data[24:], settings)
    sharded_teacher, sb = copy.deepcopy(teacher), copy.deepcopy(start)
    b = fsdp_worker(
        sb,
        sharded_teacher,
        get_adapter(sharded_teacher),
        batches(data, 8),
        data[24:],
        spec(steps=2, eval_every=1, compile=True, grad_checkpoint=True),
    )
    assert type(sb.model.layers[0]).__name__.startswith("FSDP")  # sharded: a per-layer FSDP class
    full = {n: p.full_tensor() for n, p in sb.named_parameters()}
    trained = copy.deepcopy(start)
    trained.load_state_dict(full)
    _assert_same_training(a, b, sa, trained, start)


# ---- the micro-step by parts -------------------------------------------------------------------------------
def test_the_micro_step_is_timed_by_parts_into_the_step_log(teacher, data, capsys):
    adapter = get_adapter(teacher)
    res = distill(
        random_ffn_student(teacher, adapter, 0),
        teacher,
        adapter,
        batches(data, 24),
        data[24:],
        spec(grad_accum=2, eval_every=2),
    )
    keys = [f"time_{p}_ms" for p in PHASES]
    assert [t["step"] for t in res["timings"]] == [2, 3]  # every eval_every steps and at the end
    for t in res["timings"]:
        assert list(t) == ["step", *keys]
        assert all(math.isfinite(t[k]) and t[k] >= 0 for k in keys)
        assert t["time_teacher_ms"] > 0 and t["time_student_fwd_ms"] > 0 and t["time_backward_ms"] > 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "time_teacher_ms" in ln]
    assert [ln.split("  ")[0] for ln in lines] == ["distill: step 2/3", "distill: step 3/3"]
    for ln in lines:  # "distill: step 2/3  time_teacher_ms 1.2  time_student_fwd_ms 3.4  ..."
        assert [p.split(" ")[0] for p in ln.split("  ")[1:]] == keys
    assert json.dumps(res["timings"])  # plain numbers: result.json takes them


@pytest.mark.slow
def test_benchmark_accumulates_and_prints_the_parts(tmp_path):
    """benchmarks/bench_fsdp.py --smoke --accum 2 --checkpointing selective: its JSON line has the split."""
    stdout, line = bench_fsdp_smoke(tmp_path, "--accum", "2", "--checkpointing", "selective")
    assert (line["accum"], line["checkpointing"], len(line["loss_curve"])) == (2, "selective", 4)
    assert list(line["parts"]) == [f"{p}_ms" for p in PHASES] and line["tokens_per_s"] > 0
    assert "compile auto, checkpointing selective: tokens/s " in stdout
