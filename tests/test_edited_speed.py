"""The edited model's forward without a full weight rebuild per call (workers/models/edited_model.py forward modes;
workers/methods/editing.py factor_steps, grouped_linear, routed_apply).

The reference is the `rebuild` mode: every expert's weights rebuilt from the factors and the family's own experts
forward run on them (what the edited model computed before; tests/test_editing.py checks it against the teacher
with the reconstructed weights written in). In float64 the `direct` mode (the factors applied to the routed
tokens) equals it up to rounding, in outputs and in gradients (factors, hidden states, routing weights); the
`cache` mode equals it exactly, and rebuilds only when a factor changes.
"""

from __future__ import annotations

import copy
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from families_cases import block_of, ids
from test_editing import edited, logits

from workers.families import get_adapter
from workers.methods.editing import (
    ExpertGroups,
    factor_steps,
    grouped_linear,
    reconstruct,
    routed_apply,
    split_shared_tail,
)
from workers.models.edited_model import (
    FactoredExpertsMixin,
    FactoredProjection,
    clear_weight_cache,
    set_forward_mode,
)

ROOT = Path(__file__).resolve().parents[1]
# float64 rounding of a different association of the same products
RTOL, ATOL = 1e-10, 1e-12
CASES = [
    ("qwen3_moe", "MoBE"),
    ("qwen3_moe", "TD-MoE"),
    ("qwen3_moe", "Tucker2-experts"),
    ("gpt_oss", "MoBE"),  # biased experts, interleaved gate/up, clamped SwiGLU
    ("gpt_oss", "TD-MoE"),
    ("gpt_oss", "Tucker2-experts"),
    ("olmoe", "Tucker2-experts"),
]


def chain_product(steps, E: int) -> torch.Tensor:
    """[E, out, in] multiplied out of a chain of steps (first step rightmost)."""
    ids_all = torch.arange(E)
    w = None
    for s in steps:
        m = s.shared.expand(E, *s.shared.shape) if s.shared is not None else s.stack
        m = s.build(ids_all) if m is None else m
        w = m if w is None else m @ w
    return w


def rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


FORMS = {
    "dense": ({"kind": "dense"}, {"weight": (5, 6, 4)}),
    "mobe-silu-softmax": (
        {"kind": "mobe", "activation": "silu", "coef": "softmax"},
        {"A": (5, 6, 3), "bases": (2, 3, 4), "coef": (5, 2)},
    ),
    "mobe-tanh-linear": (
        {"kind": "mobe", "activation": "tanh", "coef": "linear"},
        {"A": (5, 6, 3), "bases": (2, 3, 4), "coef": (5, 2)},
    ),
    "mobe-none-softmax": (
        {"kind": "mobe", "activation": "none", "coef": "softmax"},
        {"A": (5, 6, 3), "bases": (3, 3, 4), "coef": (5, 3)},
    ),
    "tucker2": ({"kind": "tucker"}, {"U": (6, 3), "core": (5, 3, 2), "V": (2, 4)}),
    "tucker3": ({"kind": "tucker"}, {"U": (6, 3), "core": (2, 3, 2), "Ue": (5, 2), "V": (2, 4)}),
}


def form(name: str) -> tuple[dict, dict[str, torch.Tensor]]:
    spec, shapes = FORMS[name]
    return spec, {k: rand(*s, seed=i) for i, (k, s) in enumerate(shapes.items())}


# ---- the pure pieces -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(FORMS))
def test_the_factor_steps_multiply_out_to_the_reconstructed_weights(name):
    spec, t = form(name)
    torch.testing.assert_close(
        chain_product(factor_steps(spec, t), 5), reconstruct(spec, t), rtol=1e-12, atol=1e-12
    )


@pytest.mark.parametrize("name", sorted(FORMS))
def test_routed_rows_through_the_factors_equal_the_rebuilt_experts(name):
    """Tokens routed to experts 0, 2, 4 only (1 and 3 receive none): each routed row times its expert's
    rebuilt weight; the same with the shared tail run after the rows (as the down projection does)."""
    spec, t = form(name)
    x = rand(7, 4, seed=10)
    expert = torch.tensor([4, 0, 2, 2, 0, 4, 4, 0, 2, 2])
    token = torch.tensor([0, 1, 2, 3, 4, 5, 6, 0, 1, 2])
    order = torch.argsort(expert, stable=True)
    groups = ExpertGroups(expert[order], 5)
    assert groups.active.tolist() == [0, 2, 4] and groups.bounds("all") == [0, 3, 3, 7, 7, 10]
    W = reconstruct(spec, t)
    want = torch.stack(
        [W[e] @ x[i] for e, i in zip(expert[order].tolist(), token[order].tolist(), strict=True)]
    )
    steps = factor_steps(spec, t)
    torch.testing.assert_close(routed_apply(steps, x, groups, token[order]), want, rtol=1e-12, atol=1e-12)
    body, tail = split_shared_tail(steps)
    got = routed_apply(body, x[token[order]], groups)
    for s in tail:
        got = got @ s.shared.T
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_the_grouped_gemm_kernel_equals_the_loop_with_unaligned_sizes_and_empty_groups():
    """torch's grouped GEMM (the kernel bfloat16 CUDA runs; float32 on CPU here), its sizes zero-padded to 16
    bytes, against one matmul per group: outputs and gradients, float32 tolerance."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 5, generator=g, requires_grad=True)
    w = torch.randn(4, 7, 5, generator=g, requires_grad=True)
    ends = torch.tensor([3, 3, 8, 9])  # group 1 is empty
    loop = grouped_linear(x, w, ends, "loop")
    want = torch.cat([x[0:3] @ w[0].T, x[3:8] @ w[2].T, x[8:9] @ w[3].T])
    torch.testing.assert_close(loop, want, rtol=1e-6, atol=1e-6)
    mm = grouped_linear(x, w, ends, "grouped_mm")
    torch.testing.assert_close(mm, loop, rtol=1e-5, atol=1e-5)
    for a, b in zip(
        torch.autograd.grad(mm.square().sum(), (x, w)),
        torch.autograd.grad(loop.square().sum(), (x, w)),
        strict=True,
    ):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # a plain sum's gradient is stride-0: the grouped GEMM's backward gets it contiguous
    torch.testing.assert_close(
        torch.autograd.grad(grouped_linear(x, w, ends, "grouped_mm").sum(), w)[0],
        torch.autograd.grad(grouped_linear(x, w, ends, "loop").sum(), w)[0],
        rtol=1e-5,
        atol=1e-5,
    )
    assert grouped_linear(x[:0], w, torch.zeros(4, dtype=torch.long), "loop").shape == (0, 7)
    with pytest.raises(ValueError, match="kernel='fast'; allowed: auto, grouped_mm, loop"):
        grouped_linear(x, w, ends, "fast")


def test_auto_runs_the_grouped_gemm_on_cpu_only_where_no_padding_is_needed(monkeypatch):
    calls = []
    original = torch.nn.functional.grouped_mm

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "grouped_mm", counted)
    g = torch.Generator().manual_seed(1)
    ends = torch.tensor([2, 5, 5, 8])
    for dtype, (out, inp), used in [
        (torch.float32, (8, 4), True),
        (torch.float32, (7, 4), False),  # 7 floats: not a 16-byte row
        (torch.bfloat16, (8, 16), True),
        (torch.float64, (8, 4), False),  # no float64 kernel
    ]:
        calls.clear()
        x = torch.randn(8, inp, generator=g).to(dtype)
        w = torch.randn(4, out, inp, generator=g).to(dtype)
        got = grouped_linear(x, w, ends)
        assert bool(calls) is used, (dtype, out, inp)
        tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(got, grouped_linear(x, w, ends, "loop"), rtol=tol, atol=tol)


# ---- the experts module --------------------------------------------------------------------------------------
def experts_of(family: str, student) -> FactoredExpertsMixin:
    layer = get_adapter(student).moe_layers(student)[0]
    ex = block_of(family, student, layer).experts
    assert isinstance(ex, FactoredExpertsMixin)
    return ex


def routing(ex, T: int = 6, seed: int = 3):
    """Hidden states, top-k indices (experts 0 and 1 receive no token) and positive routing weights."""
    E, k = ex.num_experts, 2
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E - 2, generator=g)[:k] + 2 for _ in range(T)])
    h = torch.randn(T, ex.config.hidden_size, generator=g, dtype=torch.float64)
    w = torch.rand(T, k, generator=g, dtype=torch.float64) + 0.1
    return h, idx, w


def run(ex, mode: str, h, idx, w, params):
    """Output and gradients (of a fixed loss) w.r.t. `params`, in `mode`."""
    object.__setattr__(ex, "forward_mode", mode)
    out = ex(h, idx, w)
    loss = (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)).sum()
    return out.detach(), torch.autograd.grad(loss, params)


@pytest.mark.parametrize("family,method", CASES)
def test_the_direct_forward_and_its_gradients_equal_the_rebuild(family, method, monkeypatch):
    _, student, _, _ = edited(family, method)
    ex = experts_of(family, student).train()
    h, idx, w = routing(ex)
    h.requires_grad_(True)
    w.requires_grad_(True)
    factors = [p for p in ex.parameters()]
    params = [*factors, h, w]
    want_out, want_grads = run(ex, "rebuild", h, idx, w, params)

    def no_rebuild(self):
        raise AssertionError("the direct forward rebuilt an expert's weights")

    with monkeypatch.context() as m:
        m.setattr(FactoredProjection, "weights", no_rebuild)
        got_out, got_grads = run(ex, "direct", h, idx, w, params)
    torch.testing.assert_close(got_out, want_out, rtol=RTOL, atol=ATOL)
    assert all(bool(gr.abs().sum() > 0) for gr in want_grads)  # every factor reached
    for got, want in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    # keyword arguments, as the family names them, take the same path
    names = ("hidden_states", "router_indices", "routing_weights") if family == "gpt_oss" else None
    names = names or ("hidden_states", "top_k_index", "top_k_weights")
    with torch.no_grad(), monkeypatch.context() as m:
        m.setattr(FactoredProjection, "weights", no_rebuild)
        kw = ex(**dict(zip(names, (h, idx, w), strict=True)))
    torch.testing.assert_close(kw, want_out, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("family,method", [("qwen3_moe", "MoBE"), ("gpt_oss", "TD-MoE")])
def test_the_student_s_logits_and_gradients_are_the_rebuild_s_in_every_mode(family, method):
    _, student, _, _ = edited(family, method)
    x = ids(2, 7, seed=5)
    set_forward_mode(student, "rebuild")
    want = logits(student, x)
    for mode in ("direct", "cache"):
        set_forward_mode(student, mode)
        torch.testing.assert_close(logits(student, x), want, rtol=RTOL, atol=ATOL)
    student.train()
    grads = {}
    for mode in ("rebuild", "direct", "cache"):
        set_forward_mode(student, mode)
        student.zero_grad(set_to_none=True)
        student(input_ids=x, use_cache=False).logits.square().mean().backward()
        grads[mode] = {n: p.grad.clone() for n, p in student.named_parameters() if p.grad is not None}
    assert any(".experts." in n for n in grads["rebuild"])
    for mode in ("direct", "cache"):  # with factor gradients the cache mode runs direct
        assert grads[mode].keys() == grads["rebuild"].keys()
        for n, g in grads["rebuild"].items():
            torch.testing.assert_close(
                grads[mode][n], g, rtol=1e-9, atol=1e-11, msg=lambda m, n=n: f"{n}: {m}"
            )


def counting_rebuilds(monkeypatch) -> list[int]:
    calls: list[int] = []
    original = FactoredProjection.weights

    def counted(self):
        calls.append(1)
        return original(self)

    monkeypatch.setattr(FactoredProjection, "weights", counted)
    return calls


@pytest.mark.parametrize("family,method", [("qwen3_moe", "MoBE"), ("olmoe", "Tucker2-experts")])
def test_the_cache_rebuilds_once_then_again_after_an_optimizer_step(family, method, monkeypatch):
    _, student, _, _ = edited(family, method)
    layers = len(get_adapter(student).moe_layers(student))
    x = ids(2, 6, seed=8)
    set_forward_mode(student, "cache")
    calls = counting_rebuilds(monkeypatch)
    before = logits(student, x)
    assert len(calls) == 3 * layers  # gate, up, down of every layer, once
    # exact: the same cached weights through the same ops
    torch.testing.assert_close(logits(student, x), before, rtol=0, atol=0)
    assert len(calls) == 3 * layers  # nothing changed: nothing rebuilt

    factors = [p for n, p in student.named_parameters() if ".experts." in n]
    opt = torch.optim.SGD(factors, lr=0.05)
    student.train()
    student(input_ids=x, use_cache=False).logits.square().mean().backward()
    opt.step()
    student.eval()
    after = logits(student, x)
    assert len(calls) == 6 * layers  # the step changed every factor: rebuilt
    assert not torch.allclose(after, before, rtol=1e-6, atol=1e-6)
    set_forward_mode(student, "rebuild")
    # exact: both rebuild the same factors with the same ops and run the same family forward
    torch.testing.assert_close(after, logits(student, x), rtol=0, atol=0)

    # load_state_dict (an in-place copy) and a write through .data with clear_weight_cache
    set_forward_mode(student, "cache")
    state = {k: v.clone() for k, v in student.state_dict().items()}
    logits(student, x)
    with torch.no_grad():
        for p in factors:
            p.mul_(0.5)
    halved = logits(student, x)
    student.load_state_dict(state)
    # exact: the restored factors' bytes, rebuilt and run by the same ops
    torch.testing.assert_close(logits(student, x), after, rtol=0, atol=0)
    for p in factors:
        p.data.mul_(0.5)  # invisible to the version counter
    clear_weight_cache(student)
    # exact: halving is exact, so both halvings give the same bytes, rebuilt and run by the same ops
    torch.testing.assert_close(logits(student, x), halved, rtol=0, atol=0)


def test_the_cache_serves_router_kd_and_the_router_gradients_are_the_rebuild_s(monkeypatch):
    """Factors frozen, routers trainable (Router KD): the cache mode runs the family's forward on the cached
    weights with grad enabled, and the routers' gradients equal the rebuild mode's and the direct mode's."""
    _, student, _, _ = edited("qwen3_moe", "TD-MoE")
    model = copy.deepcopy(student).train()
    routers = get_adapter(model).router_parameters(model)
    model.requires_grad_(False)
    for p in routers:
        p.requires_grad_(True)
    x = ids(2, 8, seed=2)

    def step() -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        model(input_ids=x, use_cache=False).logits.square().mean().backward()
        return [p.grad.clone() for p in routers]

    grads = {}
    for mode in ("rebuild", "direct", "cache"):
        set_forward_mode(model, mode)
        grads[mode] = step()
    calls = counting_rebuilds(monkeypatch)
    # exact: the same cached weights through the same ops
    torch.testing.assert_close(step(), grads["cache"], rtol=0, atol=0)
    assert calls == []  # the second cache-mode step found the first one's weights
    for mode in ("direct", "cache"):
        for got, want in zip(grads[mode], grads["rebuild"], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)


def test_the_checkpoint_layout_is_the_factors_and_copies_drop_the_cache(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    _, student, plans, factors = edited("gpt_oss", "MoBE")
    set_forward_mode(student, "cache")
    x = ids(2, 6, seed=1)
    want = logits(student, x)
    expected = {
        f"model.layers.{key.split('.')[1]}.mlp.experts.{key.split('.', 2)[2]}": t
        for key, t in factors.items()
    }
    state = student.state_dict()
    assert {k for k in state if ".experts." in k} == set(expected)  # no cache or other new state
    for k, t in expected.items():
        torch.testing.assert_close(state[k], t, rtol=0, atol=0)  # exact: the factors copied unchanged

    student.save_pretrained(tmp_path)
    saved = {k: v for f in tmp_path.glob("*.safetensors") for k, v in load_file(f).items()}
    assert {k for k in saved if ".experts." in k} == set(expected)
    back = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64, experts_implementation="eager")
    assert all(m.forward_mode == "direct" for m in back.modules() if isinstance(m, FactoredExpertsMixin))
    torch.testing.assert_close(logits(back, x), want, rtol=RTOL, atol=ATOL)

    ex = experts_of("gpt_oss", student)
    assert ex._weight_cache().weights is not None
    for other in (copy.deepcopy(student), pickle.loads(pickle.dumps(student))):
        assert experts_of("gpt_oss", other)._weight_cache().weights is None
        # exact: copied factors' bytes, rebuilt and run by the same ops
        torch.testing.assert_close(logits(other, x), want, rtol=0, atol=0)


def test_forward_modes_are_checked():
    _, student, _, _ = edited("olmoe", "TD-MoE")
    with pytest.raises(ValueError, match="mode='fast'; allowed: direct, cache, rebuild"):
        set_forward_mode(student, "fast")
    assert set_forward_mode(student, "cache") == len(get_adapter(student).moe_layers(student))
    ex = experts_of("olmoe", student)
    object.__setattr__(ex, "forward_mode", "fast")
    with pytest.raises(ValueError, match="forward_mode='fast'; allowed: direct, cache, rebuild"):
        logits(student, ids(1, 3))


@pytest.mark.slow
def test_the_benchmark_smoke_run_prints_its_ratios(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MOESWEEP_", "PYTHON"))}
    env.update(PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    r = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_edited.py"), "--smoke", "--methods", "MoBE,TD-MoE"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    for method in ("MoBE", "TD-MoE"):
        for mode in ("direct", "cache", "rebuild"):
            assert re.search(rf"^{method} infer {mode} / pruned : \d+\.\d+x$", r.stdout, re.M), r.stdout
        assert re.search(rf"^{method} train rebuild / direct: \d+\.\d+x$", r.stdout, re.M), r.stdout
        assert re.search(rf"^{method} cache vs rebuild logits: max rel diff 0\.0e\+00$", r.stdout, re.M)
