"""Expert arithmetic every wing shares: an expert's activation, the stacked gate/up weights, every expert's
output on every token, and how a sampled tensor is stored."""

from __future__ import annotations

import torch

from workers.core.compiled import call_compiled
from workers.core.matmul import HALF
from workers.core.types import ExpertWeights


def activation(
    g: torch.Tensor, u: torch.Tensor, act: str, alpha: float = 1.702, limit: float = 7.0
) -> torch.Tensor:
    if act == "silu":
        return torch.nn.functional.silu(g) * u
    if act == "gptoss":  # GPT-OSS clamped SwiGLU (transformers GptOssExperts)
        g = g.clamp(max=limit)
        u = u.clamp(min=-limit, max=limit)
        return (u + 1) * g * torch.sigmoid(g * alpha)
    raise ValueError(f"unknown expert activation {act!r}; allowed: silu, gptoss")


def fused_gate_up(experts: ExpertWeights) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[E, 2I, H] gate rows then up rows (and the [E, 2I] bias or None).

    A zero-copy view when gate and up are the two halves of one fused tensor (Qwen3/Mixtral/...
    `gate_up_proj`), otherwise one concatenated copy (e.g. GPT-OSS's interleaved layout).
    """
    g, u = experts.gate, experts.up
    E, D, H = g.shape
    fused = None
    if (
        g.dtype == u.dtype
        and g.device == u.device
        and g.stride() == (2 * D * H, H, 1)
        and u.stride() == g.stride()
        and u.data_ptr() == g.data_ptr() + D * H * g.element_size()
    ):
        fused = g.as_strided((E, 2 * D, H), (2 * D * H, H, 1))
    if fused is None:
        fused = torch.cat([g, u], dim=1)
    bias = None
    if experts.gate_bias is not None or experts.up_bias is not None:
        zeros = torch.zeros(E, D, dtype=g.dtype, device=g.device)
        gb = experts.gate_bias if experts.gate_bias is not None else zeros
        ub = experts.up_bias if experts.up_bias is not None else zeros
        bias = torch.cat([gb, ub], dim=1)
    return fused, bias


def all_expert_outputs(
    experts: ExpertWeights, x: torch.Tensor, fused: tuple[torch.Tensor, torch.Tensor | None] | None = None
) -> torch.Tensor:
    """f_e(x_t) for every expert e and token t: x [T, H] -> [E, T, H] in the weights' dtype.

    Two batched matmuls over the stacked weights (all_expert_activations, then all_expert_down).
    `fused` is fused_gate_up(experts), to reuse across chunks.
    """
    return all_expert_down(experts, all_expert_activations(experts, x, fused))


def swiglu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """silu(g)·u, as one function for torch.compile (workers.core.compiled)."""
    return torch.nn.functional.silu(g) * u


def all_expert_activations(
    experts: ExpertWeights,
    x: torch.Tensor,
    fused: tuple[torch.Tensor, torch.Tensor | None] | None = None,
    compiled: bool | None = None,
) -> torch.Tensor:
    """a_e(x_t) = act(gate_e x_t) * (up_e x_t) for every expert and token: x [T, H] -> [E, T, I].

    One batched matmul [E, T, H] x [E, H, 2I] (x broadcast, not copied, on CUDA) for gate and up together.
    SiLU: with `compiled` (None: on CUDA for bf16/fp16, where the elementwise passes cost a sizeable share of
    the matmuls' time) one fused kernel (`swiglu` compiled: reads g and u and writes the result, 3 passes over
    an [E, T, I] buffer where eager's in-place silu_ then mul_ make 5); otherwise, or where it cannot compile,
    activated in place in the gate half of that buffer (a view of it is returned: no temporaries).
    """
    E, D, H = experts.gate.shape
    w1, b1 = fused if fused is not None else fused_gate_up(experts)
    x = x.to(w1.dtype)
    T = x.shape[0]
    xe = x.unsqueeze(0).expand(E, T, H)
    if b1 is None:
        gu = torch.bmm(xe, w1.transpose(1, 2))  # [E, T, 2I]
    else:
        gu = torch.baddbmm(b1.unsqueeze(1), xe, w1.transpose(1, 2))
    g, u = gu[..., :D], gu[..., D:]
    if experts.act != "silu":
        return activation(g, u, experts.act, experts.act_alpha, experts.act_limit)
    if compiled is None:
        compiled = gu.is_cuda and gu.dtype in HALF
    a = call_compiled(swiglu, g, u) if compiled else None
    if a is None:  # in place on the fresh buffer: one pass, no temporaries
        a = torch.nn.functional.silu(g, inplace=True).mul_(u)
    return a


def all_expert_down(experts: ExpertWeights, a: torch.Tensor) -> torch.Tensor:
    """f = down_e a_e (+ the down bias) for every expert: a [E, T, I] -> [E, T, H]."""
    f = torch.bmm(a, experts.down.transpose(1, 2))
    if experts.down_bias is not None:
        f.add_(experts.down_bias.unsqueeze(1))
    return f


def sample_copy(t: torch.Tensor) -> torch.Tensor:
    """A sampled tensor as stored: on the CPU, float32 (float64 stays float64: no precision is lost)."""
    return t.detach().to("cpu", t.dtype if t.dtype == torch.float64 else torch.float32)
