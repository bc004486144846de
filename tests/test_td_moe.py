"""TD-MoE (workers.methods.editing): a 3-D Tucker decomposition of each decomposed layer's stacked experts
[E, out, in], fitted in a multilinearly whitened space, ranks within a ratio of the parameters, on the
layers the settings name.

References are written here from the formulas, in float64: the mode-n unfoldings' leading left singular
vectors (HOSVD), the core as the tensor times their transposes, the whitening matrices' definitions
(Cholesky factors of second moments), the parameter count of a core and three factors; exactness cases
(full ranks, a tensor of exactly the multilinear rank the budget allows) must reproduce the weights.
"""

from __future__ import annotations

import itertools
import json
import math
import re

import pytest
import torch
from test_editing import edited, logits, synthetic_ctx, written_back

from workers.methods.editing import (
    budget,
    edit_layer,
    output_whitening,
    reconstruct,
    routed_params,
    solve_rank,
    td_moe_budget,
    td_moe_keep,
    td_moe_layers,
    td_moe_model_params,
    td_moe_ranks,
    td_moe_settings,
    tucker2_experts_params,
    tucker3,
    tucker3_params,
    whitening,
)
from workers.training.memory_model import QWEN3_30B_A3B

TUCKER = {"kind": "tucker"}
D = torch.float64


def rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=D)


def spd_factor(n: int, seed: int) -> torch.Tensor:
    """A lower-triangular Cholesky factor of a random, well-conditioned SPD matrix."""
    a = rand(n, n, seed=seed)
    return torch.linalg.cholesky(a @ a.T / n + 0.5 * torch.eye(n, dtype=D))


def unfold(T: torch.Tensor, mode: int) -> torch.Tensor:
    return T.movedim(mode, 0).reshape(T.shape[mode], -1)


def hosvd_reference(W, ranks, S_out=None, S_in=None):
    """Ŵ from the paper's recipe, straightforwardly: T = S_out⁻¹ W S_in; per mode the leading left singular
    vectors of its unfolding; core G = T ×₁ U₁ᵀ ×₂ U₂ᵀ ×₃ U₃ᵀ; T̂ = G ×₁ U₁ ×₂ U₂ ×₃ U₃; Ŵ = S_out T̂ S_in⁻¹."""
    A = torch.eye(W.shape[1], dtype=D) if S_out is None else torch.linalg.inv(S_out)
    B = torch.eye(W.shape[2], dtype=D) if S_in is None else S_in
    T = torch.stack([A @ W[e] @ B for e in range(W.shape[0])])
    Us = [torch.linalg.svd(unfold(T, n), full_matrices=False).U[:, :r] for n, r in enumerate(ranks)]
    G = torch.einsum("eoi,ea,or,iq->arq", T, *Us)
    That = torch.einsum("arq,ea,or,iq->eoi", G, *Us)
    return torch.stack([torch.linalg.inv(A) @ That[e] @ torch.linalg.inv(B) for e in range(W.shape[0])])


def low_multilinear_rank(E, out, inp, ranks, seed=0):
    """G ×₁ A ×₂ B ×₃ C: a tensor of multilinear rank exactly `ranks` (random factors)."""
    G = rand(*ranks, seed=seed)
    A, B, C = (
        rand(n, r, seed=seed + 1 + k) for k, (n, r) in enumerate(zip((E, out, inp), ranks, strict=True))
    )
    return torch.einsum("arq,ea,or,iq->eoi", G, A, B, C)


# ---- the fit ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("side", ["none", "input", "output", "both"])
def test_full_ranks_reproduce_the_weights_whitening_undoing_itself(side):
    W = rand(5, 6, 4)
    S_out = spd_factor(6, 1) if side in ("output", "both") else None
    S_in = spd_factor(4, 2) if side in ("input", "both") else None
    f, ranks = tucker3(W, (5, 6, 4), S_out=S_out, S_in=S_in, iters=1)
    assert ranks == (5, 6, 4)
    assert {n: tuple(t.shape) for n, t in f.items()} == {
        "core": (5, 6, 4),
        "Ue": (5, 5),
        "U": (6, 6),
        "V": (4, 4),
    }
    torch.testing.assert_close(reconstruct(TUCKER, f), W, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("side", ["none", "input", "output", "both"])
def test_hosvd_equals_the_straightforward_reference(side):
    W = rand(6, 7, 5, seed=3)
    S_out = spd_factor(7, 4) if side in ("output", "both") else None
    S_in = spd_factor(5, 5) if side in ("input", "both") else None
    ranks = (3, 4, 2)
    f, _ = tucker3(W, ranks, S_out=S_out, S_in=S_in, iters=0)
    assert f["core"].shape == ranks and f["Ue"].shape == (6, 3)
    want = hosvd_reference(W, ranks, S_out, S_in)
    torch.testing.assert_close(reconstruct(TUCKER, f), want, rtol=1e-9, atol=1e-9)
    assert (want - W).norm() > 0.1 * W.norm()  # a real truncation, not the identity


def test_hooi_sweeps_never_raise_the_whitened_error():
    W, S_in = rand(6, 7, 5, seed=6), spd_factor(5, 7)

    def whitened_err(f):
        return float(((W - reconstruct(TUCKER, f)) @ S_in).pow(2).sum())

    errs = [whitened_err(tucker3(W, (3, 3, 3), S_in=S_in, iters=k)[0]) for k in (0, 1, 4)]
    assert errs[0] >= errs[1] * (1 - 1e-12) and errs[1] >= errs[2] * (1 - 1e-12), errs
    assert errs[2] < errs[0]  # the sweeps moved the factors


def test_the_expert_mode_is_compressed_when_the_experts_share_a_low_rank_structure():
    """Multilinear rank (2, 3, 4) and a budget of exactly its count: the only ranks with a zero error bound
    within it are (2, 3, 4), the expert mode cut from 7 to 2, and the fit is exact."""
    E, out, inp = 7, 9, 10
    W = low_multilinear_rank(E, out, inp, (2, 3, 4))
    limit = tucker3_params(E, out, inp, (2, 3, 4))
    assert limit == 2 * 3 * 4 + 7 * 2 + 9 * 3 + 10 * 4
    f, ranks = tucker3(W, limit=limit, iters=0)
    assert ranks == (2, 3, 4) and sum(t.numel() for t in f.values()) == limit
    torch.testing.assert_close(reconstruct(TUCKER, f), W, rtol=1e-9, atol=1e-9)
    f, ranks = tucker3(W, limit=limit, expert_rank=E, iters=0)  # the expert mode kept whole: not exact
    assert ranks[0] == E and tucker3_params(E, out, inp, ranks) <= limit
    assert (reconstruct(TUCKER, f) - W).norm() > 1e-3 * W.norm()


def test_input_whitening_fits_the_calibration_outputs_better_on_anisotropic_inputs():
    ctx = synthetic_ctx(E=6, I=12, H=8, scales=torch.logspace(-2, 1, 8, dtype=D))
    S = whitening(ctx.stats.sum_xx, ctx.stats.n_tokens, ridge=0.0)
    W = ctx.experts.gate

    def output_err(f):  # Σ_e ‖(W_e − Ŵ_e) S‖² = mean over the calibration inputs of Σ_e ‖(W_e − Ŵ_e) x‖²
        return float(((W - reconstruct(TUCKER, f)) @ S).pow(2).sum())

    white, _ = tucker3(W, (4, 5, 3), S_in=S, iters=4)
    plain, _ = tucker3(W, (4, 5, 3), iters=4)
    assert output_err(white) < 0.8 * output_err(plain)


def test_output_whitening_is_the_cholesky_factor_of_the_mean_output_second_moment():
    """S_out S_outᵀ = (1/E) Σ_e mean_t y_e yᵀ_e + ridge·mean(diag)·I with y_e = W_e x over the tokens
    themselves (the reference never forms Σ_x)."""
    E, out, inp, N = 4, 5, 3, 50
    W, x = rand(E, out, inp, seed=8), rand(N, inp, seed=9) * torch.tensor([3.0, 1.0, 0.2], dtype=D)
    S = output_whitening(W, x.T @ x, N, ridge=0.01)
    m = sum(sum(torch.outer(W[e] @ x[t], W[e] @ x[t]) for t in range(N)) / N for e in range(E)) / E
    want = m + 0.01 * m.diagonal().mean() * torch.eye(out, dtype=D)
    torch.testing.assert_close(S @ S.T, want, rtol=1e-10, atol=1e-10)
    assert torch.allclose(S, S.tril())


# ---- ranks within the budget ---------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("expert_rank", [None, 3])
def test_rank_allocation_is_the_smallest_error_bound_within_the_budget(seed, expert_rank):
    """Against every (r_e, r_out, r_in) within the limit: the chosen ranks fit, r_in is the largest that does,
    and no ranks within it have a smaller Σ_n tail_n(r_n)."""
    E, out, inp = 4, 6, 5
    g = torch.Generator().manual_seed(seed)
    tails = []
    for n in (E, out, inp):
        vals = torch.rand(n, generator=g, dtype=D).sort(descending=True).values
        tails.append(torch.cat([vals.flip(0).cumsum(0).flip(0), torch.zeros(1, dtype=D)]))
    limit = int(0.5 * E * out * inp)
    got = td_moe_ranks(E, out, inp, limit, tuple(tails), expert_rank)
    assert tucker3_params(E, out, inp, got) <= limit
    assert got[2] == inp or tucker3_params(E, out, inp, (got[0], got[1], got[2] + 1)) > limit
    bound = lambda r: float(sum(t[k] for t, k in zip(tails, r, strict=True)))  # noqa: E731
    feasible = [
        r
        for r in itertools.product(range(1, E + 1), range(1, out + 1), range(1, inp + 1))
        if tucker3_params(E, out, inp, r) <= limit and (expert_rank is None or r[0] == expert_rank)
    ]
    assert bound(got) <= min(bound(r) for r in feasible) + 1e-12
    if expert_rank is not None:
        assert got[0] == expert_rank
    with pytest.raises(ValueError, match="no ranks fit the budget") as e:
        td_moe_ranks(E, out, inp, E + out + inp, tuple(tails))
    assert "\n" not in str(e.value)


def test_budget_is_the_kept_fraction_of_the_projection_bias_included():
    assert td_moe_keep(0.4, 80, 128) == td_moe_keep(None, 3, 5) == pytest.approx(0.6)
    assert td_moe_budget(128, 768, 2048, td_moe_keep(0.4, 80, 128)) == math.floor(0.6 * 128 * 768 * 2048)
    assert td_moe_budget(6, 12, 8, td_moe_keep(None, 4, 6)) == 4 * 12 * 8  # K/E: the budget of K experts
    # a dense bias [E, out] counts against the budget: the factors get the rest
    assert td_moe_budget(6, 12, 8, td_moe_keep(None, 4, 6), bias=True) == 4 * 12 * 9 - 6 * 12


# ---- one layer -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("whiten", ["input", "output", "both", "none"])
def test_default_settings_edit_every_layer_within_the_budget_of_k_experts(whiten, bias):
    E, I, H, K = 6, 12, 8, 4  # noqa: E741
    ctx = synthetic_ctx(E, I, H, scales=torch.logspace(-1, 1, H, dtype=D), bias=bias)
    plan, tensors = edit_layer(5, ctx, "TD-MoE", K, {"whiten": whiten})
    student = plan.extras["student"]
    ranks = student["ranks"]
    assert student["decomposed"] and student["method"] == "TD-MoE" and student["whiten"] == whiten
    shapes = {"gate": (I, H), "up": (I, H), "down": (H, I)}
    factors = sum(tucker3_params(E, *shapes[p], tuple(ranks[p])) for p in shapes)
    assert plan.extras["params_routed"] == sum(t.numel() for t in tensors.values())
    assert plan.extras["params_routed"] == factors + (E * (2 * I + H) if bias else 0)
    assert plan.extras["params_routed"] <= budget(E, I, H, K, bias)
    for p, (out, inp) in shapes.items():  # each projection within its share, r_in the largest that fits
        limit = td_moe_budget(E, out, inp, td_moe_keep(None, K, E), bias)
        r = tuple(ranks[p])
        assert tucker3_params(E, out, inp, r) <= limit
        assert r[2] == inp or tucker3_params(E, out, inp, (r[0], r[1], r[2] + 1)) > limit
        assert {n.split(".", 2)[2] for n in tensors if f".{p}." in n} >= {
            f"{p}.core",
            f"{p}.Ue",
            f"{p}.U",
            f"{p}.V",
        }
    assert 0 < plan.extras["rel_error"] < 1
    json.dumps(student)  # stored with the plan


def test_only_the_listed_layers_are_decomposed_the_others_keep_their_experts():
    ctx = synthetic_ctx(E=6, I=12, H=8)
    settings = {"ratio": 0.4, "layers": [1, 3], "whiten": "output"}
    kept, dense = edit_layer(0, ctx, "TD-MoE", 4, settings)
    assert not kept.extras["student"]["decomposed"] and kept.extras["rel_error"] == 0.0
    assert set(dense) == {f"layer.0.{p}.weight" for p in ("gate", "up", "down")}
    for p in ("gate", "up", "down"):  # exact: an undecomposed layer's experts are copies of the teacher's
        assert torch.equal(dense[f"layer.0.{p}.weight"], getattr(ctx.experts, p))
    assert kept.extras["params_routed"] == kept.extras["params_routed_original"] == routed_params(6, 12, 8)
    done, _ = edit_layer(3, ctx, "TD-MoE", 4, settings)
    assert done.extras["student"]["decomposed"] and done.extras["student"]["ratio"] == 0.4
    # 40% removed per projection, K plays no part: the same at another K
    assert done.extras["params_routed"] <= 0.6 * routed_params(6, 12, 8)
    other, _ = edit_layer(3, ctx, "TD-MoE", 5, settings)
    assert other.extras["params_routed"] == done.extras["params_routed"]


def test_layer_selections():
    assert [layer for layer in range(12) if td_moe_layers({"every": 3, "start": 1})(layer)] == [1, 4, 7, 10]
    assert [layer for layer in range(6) if td_moe_layers({"every": 2})(layer)] == [0, 2, 4]
    spread = [layer for layer in range(48) if td_moe_layers({"count": 18, "of": 48})(layer)]
    assert len(spread) == 18 and {b - a for a, b in itertools.pairwise(spread)} <= {2, 3}
    assert all(td_moe_layers("all")(layer) for layer in range(5))
    assert [layer for layer in range(9) if td_moe_layers([8, 2])(layer)] == [2, 8]


@pytest.mark.parametrize(
    "settings,says",
    [
        ({"steps": 5}, "unknown setting steps; allowed: ratio, layers"),
        ({"ratio": 1.5}, "ratio=1.5; allowed: a number in (0, 1)"),
        ({"ratio": True}, "ratio=True"),
        ({"whiten": "gradient"}, "whiten='gradient'; allowed: input, output, both, none"),
        ({"layers": {"count": 0, "of": 4}}, "layers={'count': 0, 'of': 4}; allowed: all, a list"),
        ({"layers": [1, 1]}, "layers=[1, 1]"),
        ({"layers": "some"}, "layers='some'"),
        ({"expert_rank": 0}, "expert_rank=0; allowed: an integer >= 1"),
        ({"iters": -1}, "iters=-1; allowed: an integer >= 0"),
        ({"ridge": -1.0}, "ridge=-1.0; allowed: a number >= 0"),
    ],
)
def test_settings_are_checked(settings, says):
    with pytest.raises(ValueError, match=f"^TD-MoE: {re.escape(says)}") as e:
        edit_layer(0, synthetic_ctx(), "TD-MoE", 4, settings)
    assert "\n" not in str(e.value)


def test_only_gate_and_up_are_whitened():
    """down's input (the intermediate activation) has no statistic, nor its output's Gram: whichever side is
    whitened, its factors are the unwhitened fit's; gate's differ."""
    ctx = synthetic_ctx(E=6, I=12, H=8, scales=torch.logspace(-1, 1, 8, dtype=D))
    fits = {w: edit_layer(0, ctx, "TD-MoE", 4, {"whiten": w})[1] for w in ("none", "input", "output", "both")}
    for w in ("input", "output", "both"):
        for n in ("core", "Ue", "U", "V"):
            # exact: the same tucker3 call on the same down tensor, no whitening either way
            assert torch.equal(fits[w][f"layer.0.down.{n}"], fits["none"][f"layer.0.down.{n}"])
        assert not torch.allclose(
            reconstruct(TUCKER, {n: fits[w][f"layer.0.gate.{n}"] for n in ("core", "Ue", "U", "V")}),
            reconstruct(TUCKER, {n: fits["none"][f"layer.0.gate.{n}"] for n in ("core", "Ue", "U", "V")}),
        )


def test_whitening_needs_the_input_statistic_and_none_does_not():
    ctx = synthetic_ctx()
    ctx.stats.sum_xx = None
    for whiten in ("input", "output", "both"):
        with pytest.raises(ValueError, match="lack sum_xx"):
            edit_layer(0, ctx, "TD-MoE", 4, {"whiten": whiten})
    plan, _ = edit_layer(0, ctx, "TD-MoE", 4, {"whiten": "none"})
    assert plan.extras["student"]["decomposed"]


# ---- the Router KD paper's run -------------------------------------------------------------------------------
def test_the_router_kd_runs_parameter_count_is_24_to_26_billion_not_19_66():
    """Qwen3-30B-A3B (config.json: 48 layers, 128 experts of moe_intermediate 768, hidden 2048, 32 query and
    4 KV heads of 128, vocab 151936, untied embeddings; workers.training.memory_model, checked against the HF
    model in test_memory_model.py): 30.53B, 1.54B of them outside the routed experts. TD-MoE at RATIO 0.4 on
    18 of the 48 layers (Router KD paper, App. F) removes 40% of those layers' expert parameters: 26.18B (the
    other reading, 40% kept, gives 24.01B), where the paper prints the 19.66B of 80 experts per layer."""
    E, I, H, L = 128, 768, 2048, 48  # noqa: E741
    total = QWEN3_30B_A3B.params()
    routed = routed_params(E, I, H)
    assert total == 30_532_122_624 and routed == 603_979_776
    assert total - L * routed == 1_541_093_376  # attention, norms, routers, embeddings, LM head
    nominal = td_moe_model_params(total, E, I, H, 18, 0.4)
    per_layer = 3 * math.floor(0.6 * E * I * H)  # by hand: floor(0.6 · 128·768·2048) per projection
    assert nominal == total - 18 * (routed - per_layer) == 26_183_468_226
    assert 24.0e9 <= nominal <= 26.2e9
    assert 24.0e9 <= td_moe_model_params(total, E, I, H, 18, 0.6) == 24_009_141_000 <= 26.2e9
    # the fitted ranks (here with flat spectra, r_e = E as the run's code keeps it) sit just below the budget
    fitted = 0
    for out, inp in ((I, H), (I, H), (H, I)):
        ranks = td_moe_ranks(E, out, inp, td_moe_budget(E, out, inp, td_moe_keep(0.4, 80, E)), expert_rank=E)
        fitted += tucker3_params(E, out, inp, ranks)
    assert 0 <= per_layer - fitted < 3 * (E * max(I, H) + max(I, H))
    assert 24.0e9 <= total - 18 * (routed - fitted) <= nominal
    # for contrast: every layer at the budget of 80 experts (pruning, MoBE, Tucker2-experts)
    r = solve_rank(lambda q: tucker2_experts_params(E, I, H, q), budget(E, I, H, 80), max(I, H), "x")
    old = total - L * (routed - tucker2_experts_params(E, I, H, r))
    assert old <= total - L * (routed - budget(E, I, H, 80)) == 19_660_486_656
    assert round(old / 1e9, 2) == 19.66


def test_the_seed001_sweep_runs_td_moe_as_the_paper_did():
    from orchestrator.configs import build_configs, stated_shape
    from orchestrator.spec import load_spec

    spec, _, _ = load_spec("seed001-router-kd-qwen3-30b-a3b")
    configs = {c["config_key"]: c for c in build_configs(spec, stated_shape(spec))}
    for rec in ("none", "router_kd"):
        s = td_moe_settings(json.loads(configs[f"edited|TD-MoE|K=80|recovery={rec}"]["settings"]))
        assert s["ratio"] == 0.4 and s["whiten"] == "output" and s["iters"] == 0 and s["expert_rank"] == 128
        assert s["layers"] == [4, 5, 7, 8, 9, 10, 11, 13, 14, 15, 18, 33, 34, 35, 36, 37, 38, 39]
    total = QWEN3_30B_A3B.params()
    assert round(td_moe_model_params(total, 128, 768, 2048, len(s["layers"]), s["ratio"]) / 1e9, 2) == 26.18
    assert "TD-MoE" not in (configs["edited|MoBE|K=80|recovery=none"]["settings"] or "")


# ---- the stored edited model ---------------------------------------------------------------------------------
def test_an_edited_checkpoint_with_some_layers_decomposed_reloads(tmp_path):
    """Output whitening on the first MoE layer only: the student computes the teacher with that layer's
    experts reconstructed (written back independently), the other layers' experts the teacher's; it saves
    the factors and reloads to the same logits."""
    from families_cases import ids, make_teacher
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from workers.calibration.calibrate import collect_stats
    from workers.families import get_adapter
    from workers.models.convert import layer_contexts
    from workers.models.edited_model import edited_moe_student

    model = make_teacher("qwen3_moe", seed=0, dtype=D, experts_implementation="eager")
    adapter = get_adapter(model)
    x = ids(4, 10, seed=7)
    stats = collect_stats(model, adapter, [(x, torch.ones_like(x))], chunk_tokens=16)
    layers = adapter.moe_layers(model)
    settings = {"ratio": 0.5, "layers": layers[:1], "whiten": "output"}
    plans, factors = [], {}
    for layer, ctx in layer_contexts(model, adapter, stats).items():
        plan, t = edit_layer(layer, ctx, "TD-MoE", adapter.num_experts(model), settings)
        plans.append(plan)
        factors.update(t)
    assert [p.extras["student"]["decomposed"] for p in plans] == [True] + [False] * (len(layers) - 1)
    student = edited_moe_student(model, adapter, plans, factors)
    y = ids(3, 12, seed=4)
    want = logits(written_back("qwen3_moe", model, plans, factors), y)
    torch.testing.assert_close(logits(student, y), want, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(want, logits(model, y), rtol=1e-3, atol=1e-3)
    student.save_pretrained(tmp_path)
    back = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=D, experts_implementation="eager")
    torch.testing.assert_close(logits(back, y), want, rtol=1e-12, atol=1e-12)
    saved = {k: v for f in tmp_path.glob("*.safetensors") for k, v in load_file(f).items()}
    assert any(k.endswith(f"layers.{layers[0]}.mlp.experts.gate.Ue") for k in saved)
    assert sum(v.numel() for k, v in saved.items() if ".experts." in k) == sum(
        p.extras["params_routed"] for p in plans
    )


def test_the_shared_edited_model_helper_runs_td_moe_on_every_layer():
    """The helper the edited-model tests of test_editing.py use runs TD-MoE at its defaults: every layer
    decomposed, the 3-D format (an expert-mode factor) stored."""
    _, _, plans, factors = edited("olmoe", "TD-MoE")
    assert all(p.extras["student"]["decomposed"] for p in plans)
    assert any(k.endswith(".Ue") for k in factors)
