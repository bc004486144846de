"""Distillation losses: endpoints, hand-computed values, direction, temperature, chunking (paper §3.5)."""

import math

import pytest
import torch
import torch.nn.functional as F

from workers.training.losses import (
    LOSSES,
    forward_kl,
    head_cross_entropy,
    head_divergence,
    head_weighted_divergence,
    hidden_mse,
    intermediate,
    reverse_kl,
    token_forward_kl,
    token_reverse_kl,
)


def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float64).log().float()


def kl(p: list[float], q: list[float]) -> float:
    """Σ p log(p/q), written out by hand."""
    return sum(pi * math.log(pi / qi) for pi, qi in zip(p, q, strict=True) if pi > 0)


def test_zero_when_student_equals_teacher():
    z = torch.randn(2, 5, 33)
    for fn in (forward_kl, reverse_kl):
        assert fn(z, z.clone()).abs().item() < 1e-6
        assert fn(z, z + 3.0).abs().item() < 1e-5  # a shift of all logits is the same distribution
    h = [torch.randn(2, 5, 8) for _ in range(3)]
    assert hidden_mse(h, [x.clone() for x in h]).item() == 0.0  # exact: x − x is 0 in floating point
    assert intermediate(z, z.clone(), h, [x.clone() for x in h]).abs().item() < 1e-6


def test_known_values_two_and_three_classes():
    p_t, p_s = [0.5, 0.5], [0.25, 0.75]
    # forward = 0.5 ln 2 + 0.5 ln(2/3) = 0.5 ln(4/3); reverse = 0.25 ln 0.5 + 0.75 ln 1.5
    assert forward_kl(logits_of(p_t)[None], logits_of(p_s)[None]).item() == pytest.approx(
        0.5 * math.log(4 / 3), 1e-5
    )
    assert reverse_kl(logits_of(p_t)[None], logits_of(p_s)[None]).item() == pytest.approx(
        0.25 * math.log(0.5) + 0.75 * math.log(1.5), 1e-5
    )
    p_t, p_s = [0.2, 0.3, 0.5], [0.6, 0.3, 0.1]
    assert forward_kl(logits_of(p_t)[None], logits_of(p_s)[None]).item() == pytest.approx(kl(p_t, p_s), 1e-5)
    assert reverse_kl(logits_of(p_t)[None], logits_of(p_s)[None]).item() == pytest.approx(kl(p_s, p_t), 1e-5)


def test_forward_and_reverse_differ_in_the_right_direction():
    # the teacher is bimodal; the student puts its mass on one mode only (mode seeking).
    p_t, p_s = [0.49, 0.49, 0.02], [0.98, 0.01, 0.01]
    t, s = logits_of(p_t)[None], logits_of(p_s)[None]
    fwd, rev = forward_kl(t, s).item(), reverse_kl(t, s).item()
    assert fwd == pytest.approx(kl(p_t, p_s), 1e-5) and rev == pytest.approx(kl(p_s, p_t), 1e-5)
    # forward KL (mass covering) punishes the missed teacher mode much more than reverse KL does
    assert fwd > 2 * rev
    # swapping the roles swaps the two directions exactly
    assert forward_kl(s, t).item() == pytest.approx(rev, 1e-5)
    assert reverse_kl(s, t).item() == pytest.approx(fwd, 1e-5)
    # the argument order is (teacher, student): forward's gradient pulls the student toward the teacher
    s_var = s.clone().requires_grad_(True)
    forward_kl(t, s_var).backward()
    g = s_var.grad[0]  # d/dz_s KL(p_T ‖ p_S) = p_S − p_T
    assert torch.allclose(g, torch.tensor(p_s) - torch.tensor(p_t), atol=1e-5)


def test_temperature():
    p_t, p_s = [0.2, 0.3, 0.5], [0.6, 0.3, 0.1]
    t, s = logits_of(p_t)[None], logits_of(p_s)[None]
    tau = 2.0
    soft = lambda z: torch.softmax(z / tau, -1)[0].tolist()  # noqa: E731
    expected = tau**2 * kl(soft(t), soft(s))  # τ² · KL of the softened distributions
    assert forward_kl(t, s, tau=tau).item() == pytest.approx(expected, 1e-5)
    assert reverse_kl(t, s, tau=tau).item() == pytest.approx(tau**2 * kl(soft(s), soft(t)), 1e-5)
    # high temperature with τ² scaling tends to logit matching (Hinton et al. 2015, §2.1):
    # τ²·KL → 1/(2V) Σ_v (d_v − mean d)² with d = z_T − z_S
    d = (t - s)[0].double()
    limit = ((d - d.mean()) ** 2).sum().item() / (2 * d.numel())
    assert forward_kl(t.double(), s.double(), tau=1e3).item() == pytest.approx(limit, rel=1e-3)
    # a sharper temperature separates the two distributions more (τ < 1)
    assert forward_kl(t, s, tau=0.5).item() / 0.25 > forward_kl(t, s).item()
    with pytest.raises(ValueError, match="tau"):
        forward_kl(t, s, tau=0.0)


def test_masked_mean_over_tokens():
    torch.manual_seed(0)
    t, s = torch.randn(2, 4, 9), torch.randn(2, 4, 9)
    mask = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 0]])
    per_tok = token_forward_kl(t.reshape(-1, 9), s.reshape(-1, 9))
    expected = per_tok[mask.reshape(-1).bool()].mean()
    assert forward_kl(t, s, mask=mask).item() == pytest.approx(expected.item(), 1e-6)
    per_tok = token_reverse_kl(t.reshape(-1, 9), s.reshape(-1, 9))
    assert reverse_kl(t, s, mask=mask).item() == pytest.approx(
        per_tok[mask.reshape(-1).bool()].mean().item(), 1e-6
    )


@pytest.mark.parametrize("fn", [forward_kl, reverse_kl])
def test_chunked_equals_unchunked_values_and_gradients(fn):
    torch.manual_seed(1)
    t = torch.randn(3, 7, 11)
    s1 = torch.randn(3, 7, 11, requires_grad=True)
    s2 = s1.detach().clone().requires_grad_(True)
    a = fn(t, s1, tau=1.5, chunk=4)
    b = fn(t, s2, tau=1.5, chunk=10_000)
    a.backward()
    b.backward()
    assert a.item() == pytest.approx(b.item(), 1e-6)
    assert torch.allclose(s1.grad, s2.grad, atol=1e-7)


def test_head_divergence_matches_materialised_logits():
    torch.manual_seed(2)
    ht, hs = torch.randn(2, 6, 8), torch.randn(2, 6, 8)
    wt = torch.randn(13, 8)
    ws1 = torch.randn(13, 8, requires_grad=True)
    ws2 = ws1.detach().clone().requires_grad_(True)
    hs1, hs2 = hs.clone().requires_grad_(True), hs.clone().requires_grad_(True)
    for name in ("forward_kl", "reverse_kl"):
        ref_fn = forward_kl if name == "forward_kl" else reverse_kl
        a = head_divergence(LOSSES[name].token_loss, ht, wt, hs1, ws1, tau=2.0, chunk=5)
        b = ref_fn(F.linear(ht, wt), F.linear(hs2, ws2), tau=2.0)
        a.backward()
        b.backward()
        assert a.item() == pytest.approx(b.item(), 1e-5)
    assert torch.allclose(ws1.grad, ws2.grad, atol=1e-5)
    assert torch.allclose(hs1.grad, hs2.grad, atol=1e-5)


def test_head_weighted_divergence_is_the_weighted_sum_of_token_divergences():
    torch.manual_seed(4)
    ht, hs = torch.randn(2, 6, 8), torch.randn(2, 6, 8, requires_grad=True)
    wt, ws = torch.randn(13, 8), torch.randn(13, 8)
    bt, bs = torch.randn(13), torch.randn(13)
    w = torch.rand(2, 6)
    a = head_weighted_divergence(
        LOSSES["forward_kl"].token_loss, ht, wt, hs, ws, w, tau=2.0, chunk=5, teacher_bias=bt, student_bias=bs
    )
    per_token = token_forward_kl(
        F.linear(ht, wt, bt).reshape(-1, 13), F.linear(hs, ws, bs).reshape(-1, 13), 2.0
    )
    b = (per_token * w.reshape(-1)).sum()
    assert a.item() == pytest.approx(b.item(), 1e-5)
    (ga,) = torch.autograd.grad(a, hs)
    (gb,) = torch.autograd.grad(b, hs)
    assert torch.allclose(ga, gb, atol=1e-5)
    with pytest.raises(ValueError, match="weights has 11 entries"):
        head_weighted_divergence(LOSSES["forward_kl"].token_loss, ht, wt, hs, ws, w.reshape(-1)[:11])


def test_head_cross_entropy():
    torch.manual_seed(3)
    h, w = torch.randn(2, 5, 8), torch.randn(17, 8)
    y = torch.randint(0, 17, (2, 5))
    s, n = head_cross_entropy(h, w, y, chunk=3)
    assert n == 10
    assert s.item() == pytest.approx(
        F.cross_entropy(F.linear(h, w).reshape(-1, 17), y.reshape(-1), reduction="sum").item(), 1e-5
    )


def test_hidden_mse_and_intermediate_values():
    t = [torch.zeros(1, 2, 4), torch.zeros(1, 2, 4)]
    s = [torch.ones(1, 2, 4), torch.full((1, 2, 4), 3.0)]
    assert hidden_mse(t, s).item() == pytest.approx((1.0 + 9.0) / 2)  # mean over layers of per-layer MSE
    mask = torch.tensor([[1, 0]])
    s_masked = [torch.tensor([[[1.0] * 4, [100.0] * 4]])] * 2
    assert hidden_mse(t, s_masked, mask).item() == pytest.approx(1.0)  # the masked token is ignored
    z_t, z_s = logits_of([0.5, 0.5])[None, None], logits_of([0.25, 0.75])[None, None]
    assert intermediate(z_t, z_s, t[:1], s[:1], hidden_weight=0.5).item() == pytest.approx(
        0.5 * math.log(4 / 3) + 0.5 * 1.0, 1e-5
    )
    with pytest.raises(ValueError, match="same non-zero number of layers"):
        hidden_mse(t, s[:1])
    with pytest.raises(ValueError, match="shape"):
        hidden_mse(t, [torch.zeros(1, 2, 3), torch.zeros(1, 2, 3)])


def test_registry_names_directions():
    assert set(LOSSES) == {"forward_kl", "reverse_kl", "intermediate"}
    assert LOSSES["forward_kl"].token_loss is token_forward_kl and not LOSSES["forward_kl"].uses_hidden
    assert LOSSES["reverse_kl"].token_loss is token_reverse_kl
    assert LOSSES["intermediate"].token_loss is token_forward_kl and LOSSES["intermediate"].uses_hidden
