"""The checkpoint class of an MoE extracted by DOT-MoE, registered with transformers' Auto classes.

A Qwen3-MoE model (same attention, norms and embeddings as the dense Qwen3 it came from) whose router
honours `config.moe_combine`: `unit` weights every chosen expert by 1, the forward DOT-MoE trains
("DOT-MoE: Differentiable Optimal Transport for MoEfication", Eq. 16: a binary mask, no gate); `prob`
by the router's softmax probabilities; `renorm_prob` by those renormalised over the top-k. Stock
Qwen3-MoE always weights by probabilities, so a `unit` model needs this class; its own model_type
(`dot_qwen3_moe`) keeps a stock loader from silently reading it as a probability-weighted MoE.
Importing this module registers it (workers.run.runtime.load_model imports it), so
`AutoModelForCausalLM.from_pretrained(path)` reloads such a checkpoint offline.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F
from transformers import AutoConfig, AutoModelForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

MODEL_TYPE = "dot_qwen3_moe"
COMBINES = ("unit", "prob", "renorm_prob")


class DotQwen3MoeConfig(Qwen3MoeConfig):
    """Qwen3-MoE config plus the combine rule and where the MoE came from (dense model type, method)."""

    model_type = MODEL_TYPE

    def __init__(
        self,
        moe_combine: str = "unit",
        dot_source_model_type: str | None = None,
        dot_method: str | None = None,
        **kwargs,
    ) -> None:
        if moe_combine not in COMBINES:
            raise ValueError(f"moe_combine={moe_combine!r}; allowed: {', '.join(COMBINES)}")
        self.moe_combine = moe_combine
        self.dot_source_model_type = dot_source_model_type
        self.dot_method = dot_method
        kwargs["norm_topk_prob"] = moe_combine == "renorm_prob"
        super().__init__(**kwargs)


class DotMoeRouter(Qwen3MoeTopKRouter):
    """Top-k router whose combine weights follow `moe_combine`; `top_k` may be changed at run time."""

    def __init__(self, config: DotQwen3MoeConfig) -> None:
        super().__init__(config)
        self.combine = config.moe_combine

    def forward(self, hidden_states: torch.Tensor):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        logits = F.linear(hidden_states, self.weight)
        probs = logits.softmax(dim=-1, dtype=torch.float)
        top, idx = torch.topk(probs, self.top_k, dim=-1)
        if self.combine == "unit":  # Eq. 16: the chosen experts' neurons enter with weight 1
            top = torch.ones_like(top)
        elif self.combine == "renorm_prob":
            top = top / top.sum(dim=-1, keepdim=True)
        return logits, top.to(logits.dtype), idx


class DotQwen3MoeForCausalLM(Qwen3MoeForCausalLM):
    config_class = DotQwen3MoeConfig

    def __init__(self, config: DotQwen3MoeConfig) -> None:
        super().__init__(config)
        for layer in self.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate = DotMoeRouter(config)
        self.post_init()


def set_top_k(model: torch.nn.Module, k: int) -> int:
    """Route every MoE layer of `model` to `k` experts from now on (inference-sparsity sweep, DOT-MoE
    Table 8); returns the previous k. Needs 1 <= k <= E."""
    routers = [m for m in model.modules() if isinstance(m, Qwen3MoeTopKRouter)]
    if not routers:
        raise ValueError(f"{type(model).__name__} has no Qwen3-MoE routers to set top-k on")
    n = routers[0].num_experts
    if not 1 <= k <= n:
        raise ValueError(f"top_k={k}: need 1 <= top_k <= {n} experts")
    before = routers[0].top_k
    for r in routers:
        r.top_k = k
    model.config.num_experts_per_tok = k
    return before


AutoConfig.register(MODEL_TYPE, DotQwen3MoeConfig, exist_ok=True)
AutoModelForCausalLM.register(DotQwen3MoeConfig, DotQwen3MoeForCausalLM, exist_ok=True)
