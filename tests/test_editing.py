"""Expert editing (workers.methods.editing: MoBE, Tucker2-experts; TD-MoE's numerics in test_td_moe.py) and
the edited checkpoint (workers.models.edited_model).

The edited model's reference is the teacher itself with every MoE layer's expert weights replaced by the
reconstructed ones (written into the family's fused layout here, not by the module under test): the
factored forward must compute exactly that, and so must the checkpoint reloaded in a fresh interpreter.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from families_cases import CASES, FAMILIES, block_of, ids, make_teacher, router_of

from workers.core.registry import registry_names
from workers.core.types import ExpertWeights, LayerContext, LayerStats
from workers.families import adapter_named, get_adapter
from workers.methods.editing import (
    EDITINGS,
    edit_layer,
    fit_mobe,
    mobe_params,
    reconstruct,
    routed_params,
    solve_rank,
    tucker2,
    tucker2_experts_params,
    whitening,
)

ROOT = Path(__file__).resolve().parents[1]
MOBE = {"kind": "mobe", "activation": "silu", "coef": "softmax"}


def synthetic_ctx(
    E: int = 6,
    I: int = 12,  # noqa: E741
    H: int = 8,
    k: int = 2,
    seed: int = 0,
    scales: torch.Tensor | None = None,
    bias: bool = False,
) -> LayerContext:
    """A layer of random experts with hand-made statistics: Σ x xᵀ of N = 400 inputs whose coordinates have
    standard deviations `scales` (isotropic when None)."""
    g = torch.Generator().manual_seed(seed)
    w = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    x = w(400, H) * (torch.ones(H, dtype=torch.float64) if scales is None else scales)
    z = torch.zeros(E, dtype=torch.float64)
    stats = LayerStats(
        n_tokens=400,
        count=z,
        sum_p=z,
        sum_p_sel=z,
        sum_sq=z,
        sum_gnorm_sel=z,
        sum_norm_sel=z,
        gram=torch.zeros(E, E, dtype=torch.float64),
        sum_xx=x.T @ x,
    )
    biases = dict(gate_bias=w(E, I), up_bias=w(E, I), down_bias=w(E, H)) if bias else {}
    experts = ExpertWeights(gate=w(E, I, H), up=w(E, I, H), down=w(E, H, I), **biases)
    return LayerContext(stats=stats, experts=experts, router_weight=w(E, H), top_k=k, renormalized=True)


# ---- the budget -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["MoBE", "Tucker2-experts"])
@pytest.mark.parametrize("K,bias", [(3, False), (4, False), (5, True)])
def test_the_largest_rank_within_the_budget_of_pruning_to_K(method, K, bias):
    E, I, H = 6, 12, 8  # noqa: E741
    ctx = synthetic_ctx(E, I, H, bias=bias)
    plan, tensors = edit_layer(3, ctx, method, K, {"steps": 5})
    r, limit = plan.extras["rank"], K * routed_params(1, I, H, bias)
    cost = (
        (lambda q: mobe_params(E, I, H, q, 2, bias))
        if method == "MoBE"
        else (lambda q: tucker2_experts_params(E, I, H, q, True, bias))
    )
    assert plan.extras["params_routed"] == sum(t.numel() for t in tensors.values()) == cost(r)
    assert plan.extras["params_routed_original"] == routed_params(E, I, H, bias)
    assert cost(r) <= limit < cost(r + 1)
    assert all(name.startswith("layer.3.") for name in tensors)
    if method == "Tucker2-experts":  # every projection factored: U, core, V each
        assert {n.split(".", 2)[2] for n in tensors} >= {"gate.U", "gate.core", "gate.V", "down.core"}


def test_solve_rank_is_the_largest_fitting_rank_and_refuses_an_impossible_budget():
    cost = lambda r: 7 * r + r * r  # noqa: E731
    for limit in (8, 100, 1000):
        r = solve_rank(cost, limit, 10_000, "x")
        assert cost(r) <= limit < cost(r + 1)
    assert solve_rank(cost, 10**9, 50, "x") == 50  # capped
    with pytest.raises(ValueError, match="no rank >= 1 fits") as e:
        solve_rank(cost, 7, 100, "x")
    assert "\n" not in str(e.value)


def test_mobe_refuses_a_budget_its_dense_down_projections_already_exceed():
    with pytest.raises(ValueError, match="keeps the down") as e:
        edit_layer(0, synthetic_ctx(E=6), "MoBE", 2)
    assert "\n" not in str(e.value)


def test_mobe_budget_in_the_router_kd_papers_setting():
    """Qwen3 layer (H = 2048, I = 768, E = 128) with r = 768, m = 8: gate and up factored, down dense."""
    assert round(mobe_params(128, 768, 2048, 768, 8) / routed_params(128, 768, 2048), 4) == 0.6250


def test_k_out_of_range_and_unknown_method():
    ctx = synthetic_ctx()
    for K in (1, 7):
        with pytest.raises(ValueError, match="out of range"):
            edit_layer(0, ctx, "TD-MoE", K)
    with pytest.raises(ValueError, match="unknown editing"):
        edit_layer(0, ctx, "SVD", 4)
    assert (
        list(EDITINGS)
        == registry_names("workers.methods.editing", "EDITINGS")
        == [
            "MoBE",
            "TD-MoE",
            "Tucker2-experts",
        ]
    )


# ---- MoBE ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("activation", ["none", "silu"])
def test_mobe_with_full_rank_and_one_basis_per_expert_reconstructs(activation):
    W = synthetic_ctx(E=4, I=12, H=8).experts.gate
    f = fit_mobe(W, r=8, m=4, activation=activation, steps=20)
    assert f["A"].shape == (4, 12, 8) and f["bases"].shape == (4, 8, 8) and f["coef"].shape == (4, 4)
    err = (reconstruct({**MOBE, "activation": activation}, f) - W).norm() / W.norm()
    assert err < 1e-6


def test_mobe_error_decreases_as_the_rank_grows():
    W = synthetic_ctx(E=6, I=16, H=12).experts.up
    errs = [
        float((reconstruct(MOBE, fit_mobe(W, r, 2, steps=60)) - W).norm() / W.norm()) for r in (2, 5, 8, 12)
    ]
    assert all(a > b for a, b in zip(errs, errs[1:], strict=False)), errs
    assert errs[-1] < 1e-6  # r = H: act(mixture) is square and invertible


def test_mobe_adam_lowers_the_error_and_is_reproducible_per_seed():
    W = synthetic_ctx(E=4, I=2, H=8).experts.gate  # one expert per group, rank 2 < r = 4: seeded basis rows
    err = lambda f: float((reconstruct(MOBE, f) - W).norm())  # noqa: E731
    a, b = fit_mobe(W, 4, 4, steps=40, seed=1), fit_mobe(W, 4, 4, steps=40, seed=1)
    # the same seed gives the same fit up to rounding (a CPU BLAS may round differently from one call to the
    # next: MKL's results depend on the buffers' alignment); another seed gives another fit
    for n in a:
        torch.testing.assert_close(a[n], b[n], rtol=1e-6, atol=1e-9)
    c = fit_mobe(W, 4, 4, steps=40, seed=2)
    assert (a["bases"] - c["bases"]).abs().max() > 1e-3
    W = synthetic_ctx(E=6, I=12, H=8).experts.gate
    assert err(fit_mobe(W, 3, 2, steps=40)) < 0.99 * err(fit_mobe(W, 3, 2, steps=0))


# ---- Tucker2-experts --------------------------------------------------------------------------------------
@pytest.mark.parametrize("whiten", [False, True])
def test_tucker2_experts_with_full_ranks_is_exact(whiten):
    ctx = synthetic_ctx(E=5, I=12, H=8, scales=torch.logspace(-1, 1, 8, dtype=torch.float64))
    S = whitening(ctx.stats.sum_xx, ctx.stats.n_tokens) if whiten else None
    for W, white in ((ctx.experts.gate, S), (ctx.experts.down, None)):  # down's input is not the block's
        f = tucker2(W, W.shape[1], W.shape[2], white)
        assert f["U"].shape == (W.shape[1],) * 2 and f["core"].shape == W.shape
        torch.testing.assert_close(reconstruct({"kind": "tucker"}, f), W, rtol=1e-9, atol=1e-9)


def test_tucker2_experts_whitening_fits_the_calibration_outputs_better_on_anisotropic_inputs():
    scales = torch.logspace(-2, 1, 8, dtype=torch.float64)  # inputs mostly along the last coordinates
    ctx = synthetic_ctx(E=6, I=12, H=8, scales=scales)
    S = whitening(ctx.stats.sum_xx, ctx.stats.n_tokens, ridge=0.0)
    W = ctx.experts.gate
    white, plain = tucker2(W, 4, 3, S), tucker2(W, 4, 3, None)

    def output_err(f):  # Σ_e ‖(W_e − Ŵ_e) S‖² = mean over the calibration inputs of ‖(W_e − Ŵ_e) x‖²
        return float(((W - reconstruct({"kind": "tucker"}, f)) @ S).pow(2).sum())

    assert not torch.allclose(reconstruct({"kind": "tucker"}, white), reconstruct({"kind": "tucker"}, plain))
    assert output_err(white) < 0.8 * output_err(plain)
    # and through edit_layer: whiten=False gives other factors for gate/up, the same for down (unwhitened)
    p1, t1 = edit_layer(0, ctx, "Tucker2-experts", 4)
    p0, t0 = edit_layer(0, ctx, "Tucker2-experts", 4, {"whiten": False})
    assert not torch.allclose(t1["layer.0.gate.core"], t0["layer.0.gate.core"])
    # exact: down is factored unwhitened either way: the same tucker2 call on the same tensor
    assert torch.equal(t1["layer.0.down.core"], t0["layer.0.down.core"])
    assert p1.signature() != p0.signature()


def test_tucker2_experts_down_keep_leaves_down_dense_and_needs_the_input_statistic():
    ctx = synthetic_ctx()
    plan, tensors = edit_layer(0, ctx, "Tucker2-experts", 4, {"down": "keep"})
    assert torch.equal(tensors["layer.0.down.weight"], ctx.experts.down)  # exact: kept dense, a copy
    assert plan.extras["student"]["factored"] == ["gate", "up"]
    ctx.stats.sum_xx = None
    with pytest.raises(ValueError, match="lack sum_xx"):
        edit_layer(0, ctx, "Tucker2-experts", 4)


def test_edit_layer_plan_keeps_every_expert():
    ctx = synthetic_ctx(E=6)
    plan, _ = edit_layer(2, ctx, "MoBE", 5, {"steps": 5, "bases": 3})
    E = 6
    assert plan.selected == list(range(E)) and plan.groups == [[e] for e in range(E)]
    assert plan.merge_weights == [[1.0]] * E and plan.alpha == [1.0] * E
    assert len(plan.scores) == E and all(0 < s < 1 for s in plan.scores)
    ex = plan.extras
    assert ex["bases"] == 3 and 0 < ex["rel_error"] < 1 and ex["params_routed"] < ex["params_routed_original"]
    student = json.loads(json.dumps(ex["student"]))
    assert (
        student["method"] == "MoBE"
        and student["factored"] == ["gate", "up"]
        and student["activation"] == "silu"
    )
    other, _ = edit_layer(2, ctx, "MoBE", 5, {"steps": 5, "bases": 3, "activation": "none"})
    assert other.signature() != plan.signature()


# ---- the edited model -------------------------------------------------------------------------------------
def edited(family: str, method: str, seed: int = 0):
    """(teacher, edited model, plans, factors): every MoE layer edited at K = E/2 + 1 from real statistics."""
    from workers.calibration.calibrate import collect_stats
    from workers.models.convert import layer_contexts
    from workers.models.edited_model import edited_moe_student

    model = make_teacher(family, seed=seed, dtype=torch.float64, experts_implementation="eager")
    adapter = get_adapter(model)
    x = ids(4, 10, seed=7)
    stats = collect_stats(model, adapter, [(x, torch.ones_like(x))], chunk_tokens=16)
    K = adapter.num_experts(model) // 2 + 1
    plans, factors = [], {}
    for layer, ctx in layer_contexts(model, adapter, stats).items():
        plan, t = edit_layer(layer, ctx, method, K, {"steps": 10} if method == "MoBE" else None)
        plans.append(plan)
        factors.update(t)
    return model, edited_moe_student(model, adapter, plans, factors), plans, factors


def written_back(family: str, model, plans, factors):
    """The teacher (a copy) with every edited layer's expert weights replaced by the reconstructed ones."""
    ref = copy.deepcopy(model)
    for plan in plans:
        ex = block_of(family, ref, plan.layer).experts
        specs = plan.extras["student"]["projections"]
        w = {
            p: reconstruct(
                specs[p],
                {
                    n.split(".")[-1]: t
                    for n, t in factors.items()
                    if n.startswith(f"layer.{plan.layer}.{p}.") and not n.endswith(".bias")
                },
            )
            for p in ("gate", "up", "down")
        }
        with torch.no_grad():
            if (
                family == "gpt_oss"
            ):  # [E, H, 2I] interleaved gate/up columns, down [E, I, H]; biases unchanged
                ex.gate_up_proj[..., 0::2] = w["gate"].transpose(1, 2)
                ex.gate_up_proj[..., 1::2] = w["up"].transpose(1, 2)
                ex.down_proj.copy_(w["down"].transpose(1, 2))
            else:  # [E, 2I, H] gate rows then up rows, down [E, H, I]
                ex.gate_up_proj.copy_(torch.cat([w["gate"], w["up"]], dim=1))
                ex.down_proj.copy_(w["down"])
    return ref


def logits(model, x):
    with torch.no_grad():
        return model(input_ids=x, use_cache=False).logits


# dbrx, llama4_text, aria_text refuse the edited output (tests/test_refused_outputs.py)
EDITABLE = [f for f in FAMILIES if "edited" not in adapter_named(f).refused_outputs]


@pytest.mark.parametrize(
    "family,method",
    [(f, "TD-MoE") for f in EDITABLE]
    + [
        ("qwen3_moe", "MoBE"),
        ("gpt_oss", "MoBE"),
        ("qwen3_moe", "Tucker2-experts"),
        ("gpt_oss", "Tucker2-experts"),
    ],
)
def test_edited_model_computes_the_teacher_with_the_reconstructed_experts(family, method, tmp_path):
    from transformers import AutoModelForCausalLM

    model, student, plans, factors = edited(family, method)
    x = ids(3, 12, seed=4)
    want = logits(written_back(family, model, plans, factors), x)
    # a family computing act(gate)·up in a lower precision (Beam: float32) differs by that rounding: the
    # edited forward applies the factors to the routed tokens, the reference rebuilds the experts first
    act = CASES[family].act_dtype if family in CASES else None
    tol = 1e-12 if act is None else 4 * torch.finfo(act).eps * float(want.abs().max())
    torch.testing.assert_close(logits(student, x), want, rtol=1e-12, atol=tol)
    assert not torch.allclose(want, logits(model, x), rtol=1e-3, atol=1e-3)  # editing changed the model
    adapter = get_adapter(student)
    assert type(adapter) is type(get_adapter(model)) and adapter.moe_layers(student) == adapter.moe_layers(
        model
    )
    assert adapter.top_k(student) == adapter.top_k(model)
    t_routers = get_adapter(model).router_parameters(model)
    s_routers = adapter.router_parameters(student)
    # exact: the edited student's routers are the teacher's, copied
    assert len(s_routers) == len(t_routers) and all(
        torch.equal(a, b) for a, b in zip(s_routers, t_routers, strict=True)
    )
    for layer in adapter.moe_layers(student):
        assert torch.equal(  # exact: the same copied router tensors, read through the blocks
            router_of(family, block_of(family, student, layer)).weight,
            router_of(family, block_of(family, model, layer)).weight,
        )

    student.save_pretrained(tmp_path)
    back = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64, experts_implementation="eager")
    assert type(back) is type(student)
    torch.testing.assert_close(logits(back, x), want, rtol=1e-12, atol=tol)
    # the checkpoint holds the factors, not full expert weights: it is smaller than the teacher
    from safetensors.torch import load_file

    saved = {k: v for f in tmp_path.glob("*.safetensors") for k, v in load_file(f).items()}
    routed = sum(v.numel() for k, v in saved.items() if ".experts." in k)
    assert routed == sum(p.extras["params_routed"] for p in plans)
    assert not any(k.endswith(("gate_up_proj", "down_proj")) for k in saved)
    assert sum(v.numel() for v in saved.values()) < sum(p.numel() for p in model.parameters())


def test_edited_model_needs_a_plan_for_every_moe_layer():
    from workers.models.edited_model import edited_moe_student

    model, _, plans, factors = edited("olmoe", "TD-MoE")
    with pytest.raises(ValueError, match="plans cover layers"):
        edited_moe_student(model, get_adapter(model), plans[:1], factors)


def test_edited_checkpoint_reloads_in_a_fresh_interpreter(tmp_path):
    """Save, then load with AutoModelForCausalLM after nothing but `import workers.models.edited_model`."""
    cases = [
        ("qwen3_moe", "MoBE"),
        ("gpt_oss", "TD-MoE"),
        ("deepseek_v2", "TD-MoE"),
        ("olmoe", "Tucker2-experts"),
    ]
    x = ids(2, 9, seed=11)
    want = {}
    for family, method in cases:
        _, student, _, _ = edited(family, method)
        student.save_pretrained(tmp_path / family)
        want[family] = logits(student, x)
    torch.save(x, tmp_path / "x.pt")
    script = (
        "import sys, torch\n"
        "import workers.models.edited_model  # noqa: F401\n"
        "from transformers import AutoModelForCausalLM\n"
        "x = torch.load(sys.argv[1] + '/x.pt')\n"
        "for fam in sys.argv[2:]:\n"
        "    m = AutoModelForCausalLM.from_pretrained(sys.argv[1] + '/' + fam, dtype=torch.float64,\n"
        "                                             experts_implementation='eager')\n"
        "    with torch.no_grad():\n"
        "        torch.save(m(input_ids=x, use_cache=False).logits, sys.argv[1] + '/' + fam + '.pt')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    subprocess.run(
        [sys.executable, "-c", script, str(tmp_path), *want],
        check=True,
        env=env,
        cwd=tmp_path,
        capture_output=True,
        timeout=300,
    )
    for family, expected in want.items():
        torch.testing.assert_close(torch.load(tmp_path / f"{family}.pt"), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_edited_checkpoint_runs_under_every_experts_implementation_and_trains_its_routers(family, tmp_path):
    """The default (grouped_mm), eager and batched_mm give the same logits (float32); with only the routers
    trainable (Router KD), gradients reach the router rows and nothing else."""
    from transformers import AutoModelForCausalLM

    _, student, _, _ = edited(family, "TD-MoE")
    student.save_pretrained(tmp_path)
    x = ids(2, 8, seed=2)
    out = {}
    for impl in (None, "eager", "batched_mm"):
        kw = {} if impl is None else {"experts_implementation": impl}
        m = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, **kw)
        out[impl] = logits(m, x)
    for impl in (None, "batched_mm"):
        torch.testing.assert_close(out[impl], out["eager"], rtol=1e-5, atol=1e-5)
    model = copy.deepcopy(student).train()
    routers = get_adapter(model).router_parameters(model)
    for p in model.parameters():
        p.requires_grad_(False)
    for p in routers:
        p.requires_grad_(True)
    model(input_ids=x, use_cache=False).logits.square().mean().backward()
    assert all(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in routers)
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)


def test_mobe_rank_is_the_papers_at_their_budgets():
    """The Router KD paper's MoBE flags: Qwen3-30B-A3B (E 128, I 768, H 2048) at 62.5% with 8 bases is
    `--truncation 768`, Mixtral-8x7B (E 8, I 14336, H 4096) with 2 bases is 1672; counting the factors and
    bases as the paper does (not the E·m mixing coefficients) these are the largest ranks within K/E."""
    from workers.methods.editing import budget, mobe_params, mobe_rank

    assert mobe_rank(128, 768, 2048, 80, 8) == 768
    assert mobe_rank(8, 14336, 4096, 5, 2) == 1672
    assert mobe_params(128, 768, 2048, 768, 8) - 2 * 128 * 8 == budget(128, 768, 2048, 80)  # exactly 62.5%
    assert mobe_rank(128, 768, 2048, 80, 8, rank=700) == 700
    with pytest.raises(ValueError, match="rank=769 needs"):
        mobe_rank(128, 768, 2048, 80, 8, rank=769)
