"""Within-group merging, scaling and block concatenation (paper §3.3–3.4, Algorithm 1, Eq. 1–2).

Pure tensor code: no transformers import.
"""

from __future__ import annotations

import torch

from workers.core.types import DenseFFN, ExpertWeights, LayerPlan
from workers.methods.experts import activation


def merge_group(experts: ExpertWeights, members: list[int], weights: list[float]) -> DenseFFN:
    """W^(g) = Σ_{e∈G_g} w_e W^(e) for gate, up, down and their biases (Eq. 1)."""
    idx = torch.as_tensor(members, dtype=torch.long, device=experts.gate.device)
    w = torch.as_tensor(weights, dtype=torch.float64, device=experts.gate.device)

    def avg(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        sel = t.index_select(0, idx)
        if len(members) == 1:
            return sel[0]
        acc = torch.float64 if sel.dtype == torch.float64 else torch.float32  # bf16 experts merge in fp32
        return torch.tensordot(w.to(acc), sel.to(acc), dims=1).to(sel.dtype)

    return DenseFFN(
        gate=avg(experts.gate),
        up=avg(experts.up),
        down=avg(experts.down),
        gate_bias=avg(experts.gate_bias),
        up_bias=avg(experts.up_bias),
        down_bias=avg(experts.down_bias),
        act=experts.act,
        act_alpha=experts.act_alpha,
        act_limit=experts.act_limit,
    )


def concat_blocks(blocks: list[DenseFFN], alpha: list[float], input_scaled: bool = False) -> DenseFFN:
    """Row-stack gate/up, column-stack α_g·down (Eq. 2); the down bias is Σ_g α_g b_g.

    input_scaled (the router weight multiplies the expert's input): Σ_g f_g(α_g h) instead, exactly: α_g
    multiplies block g's gate and up rows (not their biases, which are added after the input), the down
    projection is stacked unscaled and the down bias is Σ_g b_g."""
    first = blocks[0]
    out_scale = [1.0] * len(blocks) if input_scaled else alpha
    down = torch.cat([a * b.down for a, b in zip(out_scale, blocks, strict=True)], dim=1)

    def rows(name: str) -> torch.Tensor | None:
        parts = [getattr(b, name) for b in blocks]
        return None if parts[0] is None else torch.cat(parts, dim=0)

    def in_rows(name: str) -> torch.Tensor:
        if not input_scaled:
            return rows(name)
        return torch.cat([a * getattr(b, name) for a, b in zip(alpha, blocks, strict=True)], dim=0)

    down_bias = None
    if first.down_bias is not None:
        down_bias = sum(a * b.down_bias for a, b in zip(out_scale, blocks, strict=True))
    return DenseFFN(
        gate=in_rows("gate"),
        up=in_rows("up"),
        down=down,
        gate_bias=rows("gate_bias"),
        up_bias=rows("up_bias"),
        down_bias=down_bias,
        act=first.act,
        act_alpha=first.act_alpha,
        act_limit=first.act_limit,
    )


def build_dense_ffn(experts: ExpertWeights, plan: LayerPlan) -> DenseFFN:
    """Algorithm 1 lines 3–11 for one layer: merge each group, scale, concatenate (α on the input where the
    experts are input-scaled)."""
    blocks = [merge_group(experts, g, w) for g, w in zip(plan.groups, plan.merge_weights, strict=True)]
    return concat_blocks(blocks, plan.alpha, input_scaled=experts.input_scaled)


def ffn_forward(ffn: DenseFFN | ExpertWeights, h: torch.Tensor, expert: int | None = None) -> torch.Tensor:
    """Reference forward of a DenseFFN (or of one expert of an ExpertWeights) on h [..., H]."""
    if expert is not None:
        pick = lambda t: None if t is None else t[expert]  # noqa: E731
        ffn = DenseFFN(
            gate=ffn.gate[expert],
            up=ffn.up[expert],
            down=ffn.down[expert],
            gate_bias=pick(ffn.gate_bias),
            up_bias=pick(ffn.up_bias),
            down_bias=pick(ffn.down_bias),
            act=ffn.act,
            act_alpha=ffn.act_alpha,
            act_limit=ffn.act_limit,
        )
    g = h @ ffn.gate.T
    u = h @ ffn.up.T
    if ffn.gate_bias is not None:
        g = g + ffn.gate_bias
    if ffn.up_bias is not None:
        u = u + ffn.up_bias
    y = activation(g, u, ffn.act, ffn.act_alpha, ffn.act_limit) @ ffn.down.T
    return y if ffn.down_bias is None else y + ffn.down_bias


def routed_forward(
    experts: ExpertWeights, h: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor
) -> torch.Tensor:
    """Reference Σ_j w_j f_{e_j}(h) on h [T, H] for weights, indices [T, k] (Σ_j f_{e_j}(w_j h) where the
    experts are input-scaled), one token at a time."""
    out = []
    for t in range(h.shape[0]):
        y = h.new_zeros(h.shape[-1])
        for w, e in zip(weights[t].tolist(), indices[t].tolist(), strict=True):
            if experts.input_scaled:
                y = y + ffn_forward(experts, w * h[t : t + 1], expert=int(e))[0]
            else:
                y = y + w * ffn_forward(experts, h[t : t + 1], expert=int(e))[0]
        out.append(y)
    return torch.stack(out)
