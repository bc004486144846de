"""DOT-MoE: a dense model's FFNs turned into MoE layers by a learned, balanced neuron → expert assignment
("DOT-MoE: Differentiable Optimal Transport for MoEfication", §3 and App. B, D, E).

Per dense SwiGLU FFN (gate/up/down of width d): a learned affinity A [d, E] (fp32), log-domain Sinkhorn
with τ annealed 1.0 → 0.1 (workers.methods.sinkhorn.sinkhorn), greedy rounding to E experts of s = d/E neurons
(workers.methods.sinkhorn.greedy_round), a learned top-k router W_r [E, H], straight-through estimators for
both hard choices, and the sparse forward Ŷ = (H ⊙ (R_STE M_STEᵀ)) W_down with the dense weights
frozen: only A and W_r train, against KL to the dense model + CE + router z-loss + load balance.
`extract` then slices the frozen weights into a real MoE checkpoint (workers.models.dot_moe_hf).

Baselines that share everything but the assignment: `random` (a fixed random balanced split, as
LLaMA-MoE) and `cluster` (balanced k-means of the neurons' gate/up weight vectors, as MoEfication/LTE);
both train only the router. The baselines built without training (CMoE, LLaMA-MoE-v2) pass through the
same `install` → `align` → `extract` calls to workers.baselines.dense_to_moe_baselines.

Supported dense classes: Qwen3 (`model_type` qwen3, full attention) → a Qwen3-MoE with the same
attention, norms and embeddings. A width d that E does not divide is padded with zero neurons (exact:
SiLU(0)·0 = 0), recorded as `padded_neurons`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from workers.baselines.dense_ffn import copied_config, padded_ffn
from workers.baselines.dot_moe_spec import BASELINES, METHODS, SUPPORTED, DotMoeSpec
from workers.core.schedule import cosine_lr
from workers.core.steplog import StepLog
from workers.methods.sinkhorn import greedy_round, sinkhorn


# ---- the dense model --------------------------------------------------------------------------------
def dense_mlps(model: nn.Module) -> list[nn.Module]:
    """Each decoder layer's SwiGLU FFN (gate_proj, up_proj, down_proj); ValueError (one line) for a model
    this module cannot extract into an MoE."""
    mt = getattr(model.config, "model_type", None)
    if mt not in SUPPORTED:
        raise ValueError(
            f"DOT-MoE: dense model_type {mt!r} ({type(model).__name__}) is not supported; "
            f"supported: {', '.join(SUPPORTED)}"
        )
    if getattr(model.config, "use_sliding_window", False):
        raise ValueError("DOT-MoE: a dense model with sliding-window layers is not supported")
    return [layer.mlp for layer in model.model.layers]


def expert_width(d_ffn: int, experts: int) -> int:
    """s = ⌈d/E⌉ neurons per expert (§2: s = d/E when E divides d)."""
    if not 1 <= experts <= d_ffn:
        raise ValueError(f"experts={experts}: need 1 <= E <= d_ffn={d_ffn}")
    return math.ceil(d_ffn / experts)


# ---- fixed assignments of the baselines ------------------------------------------------------------
def random_owner(n: int, experts: int, gen: torch.Generator) -> list[int]:
    """A uniformly random balanced split (LLaMA-MoE's random partition, App. B.3 baselines)."""
    s = n // experts
    owner = [0] * n
    for j, i in enumerate(torch.randperm(n, generator=gen).tolist()):
        owner[i] = j // s
    return owner


def cluster_owner(features: torch.Tensor, experts: int, gen: torch.Generator, iters: int = 20) -> list[int]:
    """Balanced k-means of neuron weight vectors by cosine similarity (MoEfication / LTE assign neurons by
    clustering their W_gate/W_up weights): each round a balanced assignment by Sinkhorn + greedy rounding
    to the current centroids, then the centroids as the mean of their members."""
    n = features.shape[0]
    f = F.normalize(features.detach().double(), dim=1)
    cap = [n // experts] * experts
    cent = f[torch.randperm(n, generator=gen)[:experts]]
    owner: list[int] = []
    for _ in range(iters):
        soft = sinkhorn(f @ cent.T, torch.tensor(cap, dtype=f.dtype), tau=0.05, iters=50)
        new = greedy_round(soft, cap)
        if new == owner:
            break
        owner = new
        onehot = F.one_hot(torch.tensor(owner), experts).to(f.dtype)
        cent = F.normalize(onehot.T @ f, dim=1)
    return owner


# ---- the trainable MoE view of one dense FFN ----------------------------------------------------------
class DotMoeFFN(nn.Module):
    """One frozen dense FFN with a learned neuron → expert assignment and top-k router (§3).

    `dense = True` runs the dense FFN unchanged (the KL teacher is the same frozen weights with masks off,
    App. D); otherwise the forward is Eq. 16 with the hard masks in the forward pass and the STE
    gradients (Eqs. 11–12) into A and W_r."""

    def __init__(
        self, mlp: nn.Module, experts: int, top_k: int, method: str, spec: DotMoeSpec, gen: torch.Generator
    ) -> None:
        super().__init__()
        if method not in METHODS:
            raise ValueError(f"method {method!r}; allowed: {', '.join(METHODS)}")
        if not 1 <= top_k <= experts:
            raise ValueError(f"top_k={top_k}: need 1 <= top_k <= experts={experts}")
        self.mlp = mlp
        for p in mlp.parameters():
            p.requires_grad_(False)
        self.d = mlp.gate_proj.out_features
        hidden = mlp.gate_proj.in_features
        self.experts, self.top_k, self.method, self.spec = experts, top_k, method, spec
        self.s = expert_width(self.d, experts)
        self.n = self.s * experts  # neurons including the zero padding
        dtype = mlp.gate_proj.weight.dtype
        # App. B.2.2: A is fp32, W_r in the model's dtype; both random (the paper gives no init)
        self.affinity = nn.Parameter(
            torch.randn(self.n, experts, generator=gen) * spec.init_std, requires_grad=method == "dot"
        )
        self.router = nn.Parameter((torch.randn(experts, hidden, generator=gen) * spec.init_std).to(dtype))
        self.fixed: list[int] | None = None
        if method == "random":
            self.fixed = random_owner(self.n, experts, gen)
        elif method == "cluster":
            feats = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight], dim=1).detach().float()
            feats = torch.cat([feats, feats.new_zeros(self.n - self.d, feats.shape[1])])
            self.fixed = cluster_owner(feats, experts, gen, spec.cluster_iters)
        self.tau = spec.tau_start
        self.dense = False
        self.router_logits: torch.Tensor | None = None  # [tokens, E] of the last masked forward
        self._rounded: tuple[tuple, list[int]] | None = None  # (A's version, τ, iterations) → its rounding

    def capacity(self) -> torch.Tensor:
        return torch.full((self.experts,), float(self.s), dtype=torch.float32, device=self.affinity.device)

    def assignment(self) -> tuple[torch.Tensor, list[int]]:
        """(M_STE [n, E], owner): hard in the forward, ∂/∂M_soft → Sinkhorn → A backwards (Eq. 11)."""
        if self.fixed is not None:
            owner = self.fixed
            return F.one_hot(torch.tensor(owner, device=self.affinity.device), self.experts).float(), owner
        soft = sinkhorn(self.affinity, self.capacity(), tau=self.tau, iters=self.spec.sinkhorn_iters)
        # App. B.3.2 rounds once per training step: A only changes at the optimizer's (in-place) step, which
        # moves its version counter, so the micro-batches of one step reuse the step's rounding
        key = (self.affinity._version, self.tau, self.spec.sinkhorn_iters)
        if self._rounded is None or self._rounded[0] != key:
            self._rounded = (key, greedy_round(soft, [self.s] * self.experts))  # every expert gets exactly s
        owner = self._rounded[1]
        hard = F.one_hot(torch.tensor(owner, device=soft.device), self.experts).to(soft.dtype)
        return hard + (soft - soft.detach()), owner

    def owner(self) -> list[int]:
        """The final hard assignment (at τ = tau_end: validation and extraction use it, App. B.2.3)."""
        if self.fixed is not None:
            return list(self.fixed)
        with torch.no_grad():
            soft = sinkhorn(
                self.affinity, self.capacity(), tau=self.spec.tau_end, iters=self.spec.sinkhorn_iters
            )
        return greedy_round(soft, [self.s] * self.experts)

    def route(self, x: torch.Tensor) -> torch.Tensor:
        """R_STE [tokens, E]: the hard top-k mask forward, softmax gradients backward (Eq. 12)."""
        logits = F.linear(x, self.router)
        self.router_logits = logits.reshape(-1, self.experts)
        probs = logits.float().softmax(dim=-1)
        hard = torch.zeros_like(probs).scatter_(-1, probs.topk(self.top_k, dim=-1).indices, 1.0)
        return hard + (probs - probs.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.mlp
        h = m.act_fn(m.gate_proj(x)) * m.up_proj(x)
        if self.dense:
            return m.down_proj(h)
        m_ste, _ = self.assignment()
        mask = self.route(x) @ m_ste.T  # Eq. 16: exactly k·s ones per token in the forward pass
        return m.down_proj(h * mask[..., : self.d].to(h.dtype))

    def trainable(self) -> list[nn.Parameter]:
        return [p for p in (self.affinity, self.router) if p.requires_grad]


def install(model: nn.Module, experts: int, top_k: int, method: str, spec: DotMoeSpec) -> list[DotMoeFFN]:
    """Wrap every dense FFN of `model` (in place) and freeze everything else; returns the wrappers."""
    if method in BASELINES:  # built from calibration statistics in `align`, nothing trained
        from workers.baselines.dense_to_moe_baselines import install_baseline

        return install_baseline(model, experts, top_k, method, spec)
    mlps = dense_mlps(model)
    for p in model.parameters():
        p.requires_grad_(False)
    gen = torch.Generator().manual_seed(spec.seed)
    ffns = []
    for layer, mlp in zip(model.model.layers, mlps, strict=True):
        ffn = DotMoeFFN(mlp, experts, top_k, method, spec, gen).to(mlp.gate_proj.weight.device)
        layer.mlp = ffn
        ffns.append(ffn)
    return ffns


@contextmanager
def dense_mode(ffns: Iterable[DotMoeFFN]) -> Iterator[None]:
    """The masks off: the frozen dense model, the KL teacher (App. D)."""
    ffns = list(ffns)
    for f in ffns:
        f.dense = True
    try:
        yield
    finally:
        for f in ffns:
            f.dense = False


# ---- the objective (App. D, Eqs. 13–15) --------------------------------------------------------------
def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """Eq. 13: mean over tokens of (log Σ_e exp L_e)²."""
    return torch.logsumexp(logits.float(), dim=-1).pow(2).mean()


def balance_loss(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Eq. 14: E · Σ_e f_e p̄_e, f_e the share of tokens routed to e, p̄_e its mean probability."""
    probs = logits.float().softmax(dim=-1)
    n, e = probs.shape
    idx = probs.topk(top_k, dim=-1).indices.flatten()
    f = torch.zeros(e, device=probs.device).index_add_(0, idx, torch.ones_like(idx, dtype=probs.dtype)) / n
    return e * (f * probs.mean(dim=0)).sum()


def objective(
    model: nn.Module, ffns: list[DotMoeFFN], ids: torch.Tensor, spec: DotMoeSpec
) -> dict[str, torch.Tensor]:
    """Eq. 15: w_kl·KL(dense ‖ MoE) + w_ce·CE + w_z·z + w_lb·balance (z and balance: means over layers)."""
    with torch.no_grad(), dense_mode(ffns):
        teacher = model(input_ids=ids).logits.float()
    student = model(input_ids=ids).logits.float()
    t = spec.kl_temperature
    vocab = student.shape[-1]
    kl = (
        F.kl_div(
            F.log_softmax(student / t, -1).reshape(-1, vocab),
            F.log_softmax(teacher / t, -1).reshape(-1, vocab),
            log_target=True,
            reduction="batchmean",
        )
        * t
        * t
    )
    ce = F.cross_entropy(student[:, :-1].reshape(-1, vocab), ids[:, 1:].reshape(-1))
    z = torch.stack([z_loss(f.router_logits) for f in ffns]).mean()
    lb = torch.stack([balance_loss(f.router_logits, f.top_k) for f in ffns]).mean()
    total = spec.w_kl * kl + spec.w_ce * ce + spec.w_z * z + spec.w_lb * lb
    return {"loss": total, "kl": kl, "ce": ce, "z": z, "balance": lb}


def _accumulate(
    model: nn.Module, ffns: list[DotMoeFFN], ids: torch.Tensor, spec: DotMoeSpec
) -> dict[str, torch.Tensor]:
    """One step's gradients over micro-batches of `spec.micro_batch` sequences (each loss weighted by its
    share of the batch); returns the step's loss terms."""
    size = spec.micro_batch or len(ids)
    total: dict[str, torch.Tensor] = {}
    for chunk in ids.split(size):
        terms = objective(model, ffns, chunk, spec)
        share = len(chunk) / len(ids)
        (terms["loss"] * share).backward()
        for k, v in terms.items():
            total[k] = total.get(k, 0) + v.detach() * share
    return total


def align(
    model: nn.Module,
    ffns: list[DotMoeFFN],
    batches: Iterable[torch.Tensor],
    spec: DotMoeSpec,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Train A and W_r only (App. D, Table 6): AdamW, warm-up + cosine, clipping, τ annealing. Returns the
    per-step curve of the loss, its terms and τ, and the number of trained parameters. The baselines built
    without training read their calibration windows from `batches` instead."""
    if any(f.method in BASELINES for f in ffns):
        from workers.baselines.dense_to_moe_baselines import construct

        return construct(model, ffns, batches, spec, progress)
    params = [p for f in ffns for p in f.trainable()]
    opt = torch.optim.AdamW(params, lr=spec.lr, weight_decay=spec.weight_decay)
    curve: list[dict[str, float]] = []
    dev = next(model.parameters()).device
    model.eval()  # no dropout: the frozen model is the teacher too
    steplog = StepLog("dot_moe", spec.steps)
    for step, ids in enumerate(batches):
        if step >= spec.steps:
            break
        tau = spec.tau_at(step)
        for f in ffns:
            f.tau = tau
        for g in opt.param_groups:
            g["lr"] = cosine_lr(step, spec.steps, spec.lr, spec.warmup)  # decay to 0 (Table 6)
        opt.zero_grad(set_to_none=True)
        terms = _accumulate(model, ffns, ids.to(dev), spec)
        torch.nn.utils.clip_grad_norm_(params, spec.grad_clip)
        opt.step()
        curve.append({"step": step, "tau": tau, **{k: float(v) for k, v in terms.items()}})
        steplog(step + 1, curve[-1].get("loss"), (step + 1) * ids.numel())
        if progress is not None:
            progress(step + 1, spec.steps)
    for f in ffns:
        f.tau = spec.tau_end
    return {"curve": curve, "steps": len(curve), "trainable_params": sum(p.numel() for p in params)}


# ---- extraction to a real MoE checkpoint (App. E) -------------------------------------------------
def moe_config(dense_config: Any, experts: int, top_k: int, width: int, combine: str, method: str):
    """The extracted MoE's config: the dense model's attention, norms and embeddings, E experts of width s
    in every layer, top-k, and the combine rule."""
    from workers.models.dot_moe_hf import DotQwen3MoeConfig

    kw = copied_config(dense_config)
    return DotQwen3MoeConfig(
        moe_combine=combine,
        dot_source_model_type=dense_config.model_type,
        dot_method=method,
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=width,
        intermediate_size=width * experts,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        use_sliding_window=False,
        output_router_logits=False,
        **kw,
    )


def expert_tensors(ffn: DotMoeFFN, owner: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up [E, 2s, H], down [E, H, s]) of one layer: expert e holds the columns C_e = {i: owner_i = e}
    of W_gate and W_up and the rows C_e of W_down (App. E; nn.Linear stores their transposes). Padding
    neurons (index >= d) are zero."""
    gate, up, down = padded_ffn(ffn.mlp, ffn.n)
    own = torch.tensor(owner, device=gate.device)
    members = [torch.nonzero(own == e).flatten() for e in range(ffn.experts)]
    gate_up = torch.stack([torch.cat([gate[c], up[c]]) for c in members])
    return gate_up, torch.stack([down[:, c] for c in members])


def extract(model: nn.Module, ffns: list[DotMoeFFN], combine: str = "unit") -> nn.Module:
    """The MoE checkpoint of the aligned model: sliced frozen weights, the learned routers (App. E)."""
    if any(f.method in BASELINES for f in ffns):
        from workers.baselines.dense_to_moe_baselines import extract_baseline

        return extract_baseline(model, ffns)
    from workers.models.dot_moe_hf import DotQwen3MoeForCausalLM

    f0 = ffns[0]
    config = moe_config(model.config, f0.experts, f0.top_k, f0.s, combine, f0.method)
    dtype = f0.mlp.gate_proj.weight.dtype
    moe = DotQwen3MoeForCausalLM(config).to(dtype)
    sd = {k: v for k, v in model.state_dict().items() if ".mlp." not in k}
    for i, ffn in enumerate(ffns):
        gate_up, down = expert_tensors(ffn, ffn.owner())
        sd[f"model.layers.{i}.mlp.experts.gate_up_proj"] = gate_up
        sd[f"model.layers.{i}.mlp.experts.down_proj"] = down
        sd[f"model.layers.{i}.mlp.gate.weight"] = ffn.router.detach()
    moe.load_state_dict(sd, strict=True)
    return moe.to(f0.mlp.gate_proj.weight.device).eval()


def save_assignment(ffns: list[DotMoeFFN], path: Path) -> None:
    """Per layer the hard assignment (int16 owner of every neuron) and, for `dot`, the fp32 affinities."""
    from safetensors.torch import save_file

    t = {}
    for i, f in enumerate(ffns):
        t[f"layer.{i}.owner"] = torch.tensor(f.owner(), dtype=torch.int16)
        if f.method == "dot":
            t[f"layer.{i}.affinity"] = f.affinity.detach().float().cpu().contiguous()
    save_file(
        t,
        str(path),
        metadata={
            "method": ffns[0].method,
            "experts": str(ffns[0].experts),
            "top_k": str(ffns[0].top_k),
            "d_ffn": str(ffns[0].d),
        },
    )


def active_params(moe: nn.Module, top_k: int) -> int:
    """Parameters a token uses at top-k: everything but the (E − k) unchosen experts of every layer."""
    total = sum(p.numel() for p in moe.parameters())
    cfg = moe.config
    per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    return total - cfg.num_hidden_layers * (cfg.num_experts - top_k) * per_expert
