"""The max-activation pass: per MoE layer and expert, the largest signed output element over the tokens
routed to it, the statistic of REAP's super-expert rule (workers.methods.pruning.reap_super_experts).

As the REAP repository's observer records it (`max_activations`, pruning_metrics.update_pruning_state):
for expert e, a_e = max(0, max over real tokens t with e ∈ S(t) and output dims j of f_e(x_t)_j), where
f_e is the unweighted expert (no router weight) and S(t) the router's real top-k decision; 0 for an
expert never routed. A pass of its own, never part of calibrate: a new statistic there would re-key every
stored calibration and everything after it.

The hook on each layer's routing (FamilyAdapter.hook_routing, as calibration) computes each expert on its
routed tokens only: the chunk's (token, expert) pairs are grouped by expert into an [E, C, H] batch (C the
busiest expert's count, the rest zero rows masked out) and run with two batched matmuls: about k·T
expert evaluations (plus that padding) where calibration's all-experts pass does all E·T of them
(benchmarks/bench_expert_maxima.py measures both on the same tokens).
"""

from __future__ import annotations

import inspect
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

from workers.core.types import ExpertWeights
from workers.methods.experts import activation, fused_gate_up

FORMAT = "moesweep.expert_maxima/1"


def grouped_expert_outputs(
    experts: ExpertWeights, xs: torch.Tensor, fused: tuple[torch.Tensor, torch.Tensor | None] | None = None
) -> torch.Tensor:
    """f_e(xs[e, c]) for every expert e and row c: xs [E, C, H] -> [E, C, H] in the weights' dtype (each
    expert on its own rows; workers.methods.experts.all_expert_outputs runs every expert on every row)."""
    E, D, H = experts.gate.shape
    if xs.ndim != 3 or xs.shape[0] != E or xs.shape[2] != H:
        raise ValueError(f"xs of shape {tuple(xs.shape)}: need [E={E}, rows, H={H}]")
    w1, b1 = fused if fused is not None else fused_gate_up(experts)
    xs = xs.to(w1.dtype)
    if b1 is None:
        gu = torch.bmm(xs, w1.transpose(1, 2))  # [E, C, 2I]
    else:
        gu = torch.baddbmm(b1.unsqueeze(1), xs, w1.transpose(1, 2))
    g, u = gu[..., :D], gu[..., D:]
    if experts.act == "silu":
        a = torch.nn.functional.silu(g, inplace=True).mul_(u)
    else:
        a = activation(g, u, experts.act, experts.act_alpha, experts.act_limit)
    f = torch.bmm(a, experts.down.transpose(1, 2))  # [E, C, H]
    if experts.down_bias is not None:
        f.add_(experts.down_bias.unsqueeze(1))
    return f


def routed_max_elements(
    experts: ExpertWeights,
    x: torch.Tensor,
    indices: torch.Tensor,
    mask: torch.Tensor,
    fused: tuple[torch.Tensor, torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """[E] float32: per expert, max over real tokens t routed to it (x [T, H], indices [T, k] the router's
    decision, mask [T] bool) of max_j f_e(x_t)_j; -inf for an expert no real token chose."""
    E, H = experts.num_experts, experts.hidden
    T, k = indices.shape
    if x.shape != (T, H) or mask.shape != (T,):
        raise ValueError(
            f"x {tuple(x.shape)}, indices {tuple(indices.shape)}, mask {tuple(mask.shape)}: need [T, {H}], "
            "[T, k], [T]"
        )
    dev = x.device
    out = torch.full((E,), -math.inf, dtype=torch.float32, device=dev)
    token = torch.arange(T, device=dev).repeat_interleave(k)
    expert = indices.reshape(-1).to(dev).long()
    keep = mask.to(dev).bool()[token]
    token, expert = token[keep], expert[keep]
    if expert.numel() == 0:
        return out
    order = torch.argsort(expert, stable=True)
    token, expert = token[order], expert[order]
    counts = torch.bincount(expert, minlength=E)
    slot = torch.arange(expert.numel(), device=dev) - (torch.cumsum(counts, 0) - counts)[expert]
    C = int(counts.max())  # one host sync per chunk
    fused = fused if fused is not None else fused_gate_up(experts)
    w1 = fused[0]
    rows = torch.full((E, C), T, dtype=torch.long, device=dev)  # row T: a zero row for the empty slots
    rows[expert, slot] = token
    xs = torch.cat([x.to(w1.dtype), x.new_zeros((1, H), dtype=w1.dtype)]).index_select(0, rows.reshape(-1))
    xs = xs.reshape(E, C, H)
    peak = grouped_expert_outputs(experts, xs, fused).amax(-1).float()  # [E, C]
    real = torch.arange(C, device=dev)[None, :] < counts[:, None]
    return torch.where(real, peak, -math.inf).amax(1)


class MaximaAccumulator:
    """The running max activations of one MoE layer (float32 on the layer's device, starting at 0 as
    REAP's observer state does)."""

    def __init__(self, experts: ExpertWeights, chunk_tokens: int):
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens={chunk_tokens}: must be a positive integer")
        self.experts = experts
        self.chunk = chunk_tokens
        self.maxima: torch.Tensor | None = None

    def update(self, x: torch.Tensor, indices: torch.Tensor, mask: torch.Tensor) -> None:
        if self.maxima is None:
            self.maxima = torch.zeros(self.experts.num_experts, dtype=torch.float32, device=x.device)
        fused = fused_gate_up(self.experts)
        for lo in range(0, x.shape[0], self.chunk):
            hi = min(x.shape[0], lo + self.chunk)
            got = routed_max_elements(self.experts, x[lo:hi], indices[lo:hi], mask[lo:hi], fused)
            self.maxima = torch.maximum(self.maxima, got.to(self.maxima.device))

    def finish(self) -> torch.Tensor:
        if self.maxima is None:
            raise ValueError("layer never saw a token: its router hook did not fire")
        return self.maxima.cpu()


def collect_maxima(
    model: nn.Module,
    adapter,
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    chunk_tokens: int,
    progress: Callable[[int, int], None] | None = None,
) -> dict[int, torch.Tensor]:
    """One teacher forward over `batches` of (ids [B, S], attention mask [B, S]); {MoE layer: [E] float32
    max activation} on the CPU."""
    from workers.calibration.calibrate import check_batches

    check_batches(batches, chunk_tokens)
    layers = adapter.moe_layers(model)
    if not layers:
        raise ValueError("adapter.moe_layers(model) is empty: the model has no MoE layer")
    accs = {layer: MaximaAccumulator(adapter.expert_weights(model, layer), chunk_tokens) for layer in layers}
    current: dict[str, torch.Tensor] = {}
    extra = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}

    def hook(acc: MaximaAccumulator) -> Callable:
        def fn(x: torch.Tensor, p: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> None:
            acc.update(x, idx, current["mask"])

        return fn

    was_training = model.training
    handles = []
    try:
        model.eval()
        for layer in layers:
            handles += adapter.hook_routing(model, layer, hook(accs[layer]))
        with torch.no_grad():
            for i, (ids, mask) in enumerate(batches):
                current["mask"] = mask.reshape(-1).bool()
                model(input_ids=ids, attention_mask=mask, use_cache=False, **extra)
                if progress is not None:
                    progress(i + 1, len(batches))
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    return {layer: acc.finish() for layer, acc in accs.items()}


def streamed_maxima(
    teacher,
    adapter,
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    chunk_tokens: int,
    progress: Callable[[int, int], None] | None = None,
    offload: bool = False,
) -> dict[int, torch.Tensor]:
    """collect_maxima of the teacher in a StreamedTeacher's checkpoint, read one decoder layer at a time
    (workers.calibration.streamed.walk_layers: a teacher larger than one device, as a streamed calibration
    reads it); the same hooks on the same layer inputs, so the same maxima. `offload`: the carried hidden
    states wait on the CPU between layers. `progress(layers done, layers to run)`."""
    from workers.calibration.calibrate import check_batches
    from workers.calibration.streamed import walk_layers

    check_batches(batches, chunk_tokens)
    moe = set(adapter.moe_layers(teacher.model))
    accs: dict[int, MaximaAccumulator] = {}
    current: dict[str, torch.Tensor] = {}

    def watch(i: int) -> list:
        if i not in moe:
            return []
        acc = accs[i] = MaximaAccumulator(adapter.expert_weights(teacher.model, i), chunk_tokens)

        def fn(x: torch.Tensor, p: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> None:
            acc.update(x, idx, current["mask"])

        return adapter.hook_routing(teacher.model, i, fn)

    walk_layers(teacher, adapter, batches, watch, current, progress, offload)
    return {layer: accs[layer].finish() for layer in sorted(moe)}


# ---- the file: every source's maxima apart, mixed when loaded ----------------------------------------
def save_maxima(
    per_source: dict[str, dict[int, torch.Tensor]],
    weights: dict[str, float],
    path: str | Path,
    metadata: dict[str, str] | None = None,
) -> None:
    """One safetensors file, keys 'source.<name>.layer.<i>' ([E] float32); metadata 'sources' (each
    source's weight, JSON) and 'layers'."""
    from safetensors.torch import save_file

    from workers.calibration.calibrate import SOURCE_NAME

    if not per_source:
        raise ValueError("per_source is empty: nothing to save")
    if set(weights) != set(per_source):
        raise ValueError(f"weights name {sorted(weights)}; the sources are {sorted(per_source)}")
    layers = sorted(next(iter(per_source.values())))
    tensors: dict[str, torch.Tensor] = {}
    for name, maxima in per_source.items():
        if not SOURCE_NAME.match(name):
            raise ValueError(f"source name {name!r}: allowed letters, digits, '_', '-' (no '.')")
        if sorted(maxima) != layers or not layers:
            raise ValueError(f"source {name!r} has layers {sorted(maxima)}; need the same non-empty {layers}")
        for layer, m in maxima.items():
            tensors[f"source.{name}.layer.{layer}"] = m.detach().to("cpu", torch.float32).contiguous()
    meta = {
        "format": FORMAT,
        "layers": ",".join(map(str, layers)),
        "sources": json.dumps({name: {"weight": float(w)} for name, w in weights.items()}),
    }
    meta.update({str(k): str(v) for k, v in (metadata or {}).items()})
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=meta)


def load_maxima(path: str | Path, weights: dict[str, float] | None = None) -> dict[int, torch.Tensor]:
    """{MoE layer: [E] float32} of a maxima file: the max over the sources of positive weight (`weights`,
    by default those stored; a max does not weigh, so only which sources count matters, as for
    calibration's max_norm_sel)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(path), framework="pt") as fh:
        meta = dict(fh.metadata() or {})
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: format {meta.get('format')!r}; need {FORMAT!r} (an expert_maxima file)")
    stored = {name: float(e["weight"]) for name, e in json.loads(meta["sources"]).items()}
    weights = stored if weights is None else weights
    if set(weights) != set(stored):
        raise ValueError(f"{path}: weights name {sorted(weights)}; the sources are {sorted(stored)}")
    for name, w in weights.items():
        if not (isinstance(w, int | float) and math.isfinite(w) and w >= 0):
            raise ValueError(f"weight of source {name!r}: {w!r}; allowed: a finite number >= 0")
    active = [name for name, w in weights.items() if w > 0]
    if not active:
        raise ValueError(f"{path}: every weight is 0: no source counts")
    tensors = load_file(str(path))
    layers = [int(i) for i in meta["layers"].split(",")]
    return {
        layer: torch.stack([tensors[f"source.{name}.layer.{layer}"] for name in active]).amax(0)
        for layer in layers
    }
