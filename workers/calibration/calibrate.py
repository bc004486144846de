"""Calibration statistics of every MoE layer in one teacher forward pass.

A forward hook on each layer's router module sees the tokens entering the MoE block (the router's
input is exactly the experts' input in every supported family: the post-attention-norm hidden
states, flattened to [T, H]) and the router's real decision. The hook runs ALL E experts on those
tokens with two large matmuls per token chunk and reduces the outputs on the fly to the sums of
workers.core.types.LayerStats, kept as float64 tensors on the layer's device: no host sync per batch,
no [E, T, H] buffer kept across chunks, no Python loop over experts.

Precision: the expert matmuls run in the weights' dtype (what the teacher itself computes; bf16 on
GPU). Per-token norms, the per-chunk Gram (whose diagonal is Σ‖f‖²) and the per-chunk Σ_t a_e(t) are
reduced in fp32 (fp64 for fp64 models), the input's second moment in fp32 for half-precision inputs
(fp64 otherwise), and everything is then added into float64 accumulators.

Token samples (`sample_tokens` > 0): beside the sums, every layer keeps the block inputs and router
probabilities of the same seeded sample of real tokens, and the file the windows they came from, so a
selector can evaluate the layer's output on real tokens (reconstruction-loss selection) and re-run them.

Padding: the flat attention mask of the current batch is handed to the hooks; padding tokens are
zeroed before the experts and excluded from every sum (torch.where, so even NaN there cannot leak).
"""

from __future__ import annotations

import inspect
import json
import math
import re
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

from workers.core.matmul import HALF, mm_fp32
from workers.core.types import FAMILY_STATS, SAMPLE_SHARED, STATS_TENSORS, ExpertWeights, LayerStats
from workers.methods.experts import all_expert_activations, all_expert_down, fused_gate_up, sample_copy

STAT_FIELDS = STATS_TENSORS
MAX_FIELDS = frozenset({"max_norm_sel"})  # a max over tokens; every other field of LayerStats is a sum
FORMAT = "moesweep.layerstats/4"  # /2 sum_pnorm_sel, max_norm_sel; /3 sum_out, gram_p, sum_xx; /4 sources
SOURCE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")  # no '.': it separates the keys of the file


# ---- the per-layer accumulator ---------------------------------------------------------------------


def expert_pass(
    experts: ExpertWeights, x: torch.Tensor, fused: tuple[torch.Tensor, torch.Tensor | None]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every expert on every token of a chunk: (activations a [E, t, I], outputs f [E, t, H])."""
    a = all_expert_activations(experts, x, fused)
    return a, all_expert_down(experts, a)


def _gram(f: torch.Tensor) -> torch.Tensor:
    """Σ_t ⟨f_i(t), f_j(t)⟩ of one chunk f [E, T, H] as an [E, E] fp32 (fp64 for fp64 input) matrix."""
    F = f.reshape(f.shape[0], -1)
    return mm_fp32(F, F.T)


def _second_moment(x: torch.Tensor) -> torch.Tensor:
    """Σ_t x_t x_tᵀ of x [T, H] in float64: half-precision x (exact in fp32) through an fp32-accumulating
    GEMM, not an fp64 one (a few times the expert matmuls' time on a GPU); fp32/fp64 x in fp64."""
    if x.dtype in HALF:
        return mm_fp32(x.T, x).double()
    x64 = x.double()
    return x64.T @ x64


# ---- accumulation -------------------------------------------------------------------------------
class LayerAccumulator:
    """Running LayerStats sums of one MoE layer, on that layer's device.

    The [E, t, H] outputs of a chunk are read once after they are written, by the Gram's GEMM: Σ‖f‖² is
    the Gram's diagonal, the per-token norms are taken of the k routed rows only, and Σ_t f_e(t) is
    down_e·Σ_t a_e(t) (+ the bias per real token), accumulated on the [E, t, I] activations and mapped
    through down once, in finish(). On a GPU these passes over the outputs, not the matmuls, were what kept
    the statistics below the matmuls' throughput.
    """

    expert_outputs = staticmethod(expert_pass)  # (experts, x [t, H], fused) -> (a [E, t, I], f [E, t, H])

    def __init__(self, experts: ExpertWeights, chunk_tokens: int):
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens={chunk_tokens}: must be a positive integer")
        self.experts = experts
        self.chunk = chunk_tokens
        self.sums: dict[str, torch.Tensor] | None = None
        self.sum_act: torch.Tensor | None = None  # Σ_t a_e(t) over real tokens, [E, I] float64
        self.n_tokens: torch.Tensor | None = None

    def _init(self, device: torch.device) -> None:
        E, D, H = self.experts.gate.shape
        kw = {"dtype": torch.float64, "device": device}
        shapes = {"gram": (E, E), "gram_p": (E, E), "sum_xx": (H, H)}
        self.sums = {
            name: torch.zeros(shapes.get(name, (E,)), **kw) for name in STAT_FIELDS if name != "sum_out"
        }
        self.sum_act = torch.zeros(E, D, **kw)
        self.n_tokens = torch.zeros((), dtype=torch.int64, device=device)

    def update(
        self,
        x: torch.Tensor,
        p: torch.Tensor,
        weights: torch.Tensor,
        indices: torch.Tensor,
        mask: torch.Tensor,
    ) -> None:
        """x [T, H] expert input, p [T, E], weights/indices [T, k] the real decision, mask [T] bool."""
        T, E = x.shape[0], self.experts.num_experts
        if p.shape != (T, E) or weights.shape != indices.shape or indices.shape[0] != T or mask.shape != (T,):
            raise ValueError(
                f"router decision shapes p={tuple(p.shape)} weights={tuple(weights.shape)} "
                f"indices={tuple(indices.shape)} mask={tuple(mask.shape)} do not match T={T}, E={E}"
            )
        if self.sums is None:
            self._init(x.device)
        s = self.sums
        m = mask.to(x.device, non_blocking=True)
        k = indices.shape[1]
        idx = indices.to(x.device).long()
        p64 = torch.where(m[:, None], p.double(), 0.0)
        w64 = torch.where(m[:, None], weights.double(), 0.0)
        self.n_tokens += m.sum()  # SF/PP/PS/CP inputs (paper Appendix C): count, Σp, Σp over S(t)
        s["sum_p"] += p64.sum(0)
        s["count"].index_add_(0, idx.reshape(-1), m[:, None].expand(T, k).reshape(-1).double())
        s["sum_p_sel"].index_add_(0, idx.reshape(-1), p64.gather(1, idx).reshape(-1))
        s["gram_p"] += p64.T @ p64  # M-SMoE: router similarity of experts over tokens
        xz = torch.where(m[:, None], x, 0)
        s["sum_xx"] += _second_moment(xz)  # TD-MoE: the block input's second moment (whitening)
        fused = fused_gate_up(self.experts)
        # a(0) = f(0) = 0 exactly without biases, so zeroed padding rows need no second mask
        has_bias = any(
            b is not None for b in (self.experts.gate_bias, self.experts.up_bias, self.experts.down_bias)
        )
        for lo in range(0, T, self.chunk):
            hi = min(T, lo + self.chunk)
            t = hi - lo
            a, f = self.expert_outputs(self.experts, xz[lo:hi], fused)  # [E, t, I], [E, t, H]
            if has_bias:
                a = torch.where(m[None, lo:hi, None], a, 0)
                f = torch.where(m[None, lo:hi, None], f, 0)
            wide = torch.float64 if f.dtype == torch.float64 else torch.float32
            gram = _gram(f).double()
            s["gram"] += gram
            s["sum_sq"] += gram.diagonal()  # Σ_t ‖f_e(t)‖²
            # the routed (t, e) rows of f, [k, t]: REAP (Lasby et al., Eq. 9) Σ g·‖f‖, EAN Σ ‖f‖
            sel = idx[lo:hi].T  # [k, t]
            rows = (sel * t + torch.arange(t, device=sel.device)).reshape(-1)
            flat = f.reshape(E * t, f.shape[-1]).index_select(0, rows)
            nsel = torch.linalg.vector_norm(flat, dim=-1, dtype=wide).double().reshape(k, t)
            s["sum_norm_sel"].index_add_(0, sel.reshape(-1), nsel.reshape(-1))
            s["sum_gnorm_sel"].index_add_(0, sel.reshape(-1), (w64[lo:hi].T * nsel).reshape(-1))
            # REAP-p: the same sum with the full-softmax p in place of the applied gate g
            s["sum_pnorm_sel"].index_add_(
                0, sel.reshape(-1), (p64[lo:hi].gather(1, sel.T).T * nsel).reshape(-1)
            )
            # super-expert detection: the largest routed output norm (padding rows have norm 0)
            s["max_norm_sel"].scatter_reduce_(0, sel.reshape(-1), nsel.reshape(-1), reduce="amax")
            self.sum_act += a.sum(1, dtype=wide).double()  # HC-SMoE's Σ_t f_e(t), before down
            del a, f, flat

    def _sum_out(self) -> torch.Tensor:
        """Σ_t f_e(t) over real tokens = down_e·Σ_t a_e(t) + n·b_e, in float64 [E, H] (8 experts at a time: a
        float64 copy of every down matrix at once would take 4× the memory of the layer's bf16 ones)."""
        down, out = self.experts.down, []
        for lo in range(0, down.shape[0], 8):
            w = down[lo : lo + 8].to(self.sum_act.device, torch.float64)  # [e, H, I]
            out.append(torch.bmm(w, self.sum_act[lo : lo + 8, :, None])[..., 0])
        total = torch.cat(out)
        if self.experts.down_bias is not None:
            total += self.n_tokens.double() * self.experts.down_bias.to(total.device, torch.float64)
        return total

    def finish(self) -> LayerStats:
        if self.sums is None:
            raise ValueError("layer never saw a token: its router hook did not fire")
        return LayerStats(n_tokens=int(self.n_tokens.item()), sum_out=self._sum_out(), **self.sums)


def sample_plan(
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]], n: int, seed: int
) -> tuple[dict[int, torch.Tensor], dict[str, torch.Tensor]]:
    """A seeded sample of min(n, real tokens) real tokens of `batches`, in batch order: per batch index
    the flat offsets of its sampled tokens (into ids.reshape(-1)), and SAMPLE_SHARED (the windows holding
    them, their masks, and each token's window row and position)."""
    lengths = {int(ids.shape[1]) for ids, _ in batches}
    if len(lengths) != 1:
        raise ValueError(f"sample_tokens: batches have sequence lengths {sorted(lengths)}; need one length")
    real = torch.cat([m.reshape(-1).bool().cpu() for _, m in batches])
    where = torch.nonzero(real).reshape(-1)
    g = torch.Generator().manual_seed(int(seed))
    flat = where[torch.randperm(len(where), generator=g)[:n]].sort().values  # global flat offsets
    S = lengths.pop()
    rows, starts, offsets = flat // S, [0], {}
    for ids, _ in batches:
        starts.append(starts[-1] + ids.numel())
    for b in range(len(batches)):
        mine = flat[(flat >= starts[b]) & (flat < starts[b + 1])] - starts[b]
        if len(mine):
            offsets[b] = mine
    windows, window = torch.unique(rows, return_inverse=True)
    all_ids = torch.cat([ids.cpu() for ids, _ in batches])
    all_mask = torch.cat([m.cpu() for _, m in batches])
    shared = {
        "ids": all_ids[windows].long(),
        "mask": all_mask[windows].long(),
        "window": window.long(),
        "pos": (flat % S).long(),
    }
    return offsets, shared


def check_batches(batches: Sequence[tuple[torch.Tensor, torch.Tensor]], chunk_tokens: int) -> None:
    """One-line errors for what collect_stats (and the streamed pass) cannot run on."""
    if not batches:
        raise ValueError("batches is empty: need at least one (ids, mask) batch")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens}: must be a positive integer")
    for i, (ids, mask) in enumerate(batches):
        if ids.shape != mask.shape:
            raise ValueError(f"batch {i}: ids {tuple(ids.shape)} and mask {tuple(mask.shape)} differ")


def router_hook(
    acc: LayerAccumulator, current: dict[str, torch.Tensor], samples: list[tuple[torch.Tensor, torch.Tensor]]
) -> Callable:
    """fn(x, p, w, idx) for FamilyAdapter.hook_routing on one MoE layer: the router's input and real decision
    into `acc`, the sampled rows into `samples`. `current` holds the running batch's flat mask ('mask') and
    sampled rows ('rows', None for none); one per layer, so a streamed pass can add them one layer at a time."""

    def fn(x: torch.Tensor, p: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> None:
        acc.update(x, p, w, idx, current["mask"])
        rows = current.get("rows")
        if rows is not None:
            r = rows.to(x.device)
            samples.append((sample_copy(x[r]), sample_copy(p[r])))

    return fn


def gate_hook(
    adapter, gate_sums: dict[int, torch.Tensor], layer: int, current: dict[str, torch.Tensor]
) -> Callable:
    """The forward hook on a layer's shared-expert gate: Σ over real tokens of its per-token value
    (FamilyAdapter.shared_gate_values) into gate_sums[layer]."""

    def hook(module: nn.Module, args: tuple, output) -> None:
        g = adapter.shared_gate_values(output).reshape(-1)[current["mask"].to(output.device)]
        gate_sums[layer] = gate_sums.get(layer, 0) + g.double().sum()

    return hook


def attach_gate_sums(
    stats: dict[int, LayerStats], gate_sums: dict[int, torch.Tensor]
) -> dict[int, LayerStats]:
    """`stats` with each gated layer's Σ_t gate as its `sum_shared_gate` [1]."""
    for layer, total in gate_sums.items():
        stats[layer].sum_shared_gate = total.reshape(1).to(stats[layer].count.device)
    return stats


def attach_sample(
    st: LayerStats, parts: list[tuple[torch.Tensor, torch.Tensor]], shared: dict[str, torch.Tensor]
) -> LayerStats:
    """`st` with the layer's sampled (x, p) rows and the shared windows as its token sample (none: as is)."""
    if parts:
        st.sample = {"x": torch.cat([x for x, _ in parts]), "p": torch.cat([p for _, p in parts]), **shared}
    return st


def collect_stats(
    model: nn.Module,
    adapter,
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    chunk_tokens: int,
    progress: Callable[[int, int], None] | None = None,
    sample_tokens: int = 0,
    sample_seed: int = 0,
) -> dict[int, LayerStats]:
    """One teacher forward over `batches` of (ids [B, S], attention mask [B, S]); LayerStats per MoE layer.
    With `sample_tokens` > 0 each LayerStats also carries the token sample of `sample_plan` (sample_copy)."""
    check_batches(batches, chunk_tokens)
    layers = adapter.moe_layers(model)
    if not layers:
        raise ValueError("adapter.moe_layers(model) is empty: the model has no MoE layer to calibrate")
    accs = {layer: LayerAccumulator(adapter.expert_weights(model, layer), chunk_tokens) for layer in layers}
    current: dict[str, torch.Tensor] = {}
    offsets, shared = sample_plan(batches, sample_tokens, sample_seed) if sample_tokens > 0 else ({}, {})
    samples: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {layer: [] for layer in layers}
    gate_sums: dict[int, torch.Tensor] = {}
    extra = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    was_training = model.training
    handles = []
    try:
        model.eval()
        for layer in layers:
            handles += adapter.hook_routing(model, layer, router_hook(accs[layer], current, samples[layer]))
            gate = adapter.shared_gate(model, layer)
            if gate is not None:
                handles.append(gate.register_forward_hook(gate_hook(adapter, gate_sums, layer, current)))
        with torch.no_grad():
            for i, (ids, mask) in enumerate(batches):
                current["mask"] = mask.reshape(-1).bool()
                current["rows"] = offsets.get(i)
                model(input_ids=ids, attention_mask=mask, use_cache=False, **extra)
                if progress is not None:
                    progress(i + 1, len(batches))
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    out = {layer: attach_sample(acc.finish(), samples[layer], shared) for layer, acc in accs.items()}
    return attach_gate_sums(out, gate_sums)


# ---- several sources ------------------------------------------------------------------------------
def calibration_sources(params: dict) -> dict[str, dict]:
    """{name: {data, weight, n_samples}} of a calibrate job's parameters; a single `data` is the one
    source 'default' with weight 1."""
    if params.get("sources"):
        return params["sources"]
    return {"default": {"data": params["data"], "weight": 1.0, "n_samples": params["n_samples"]}}


def mix_stats(
    per_source: dict[str, dict[int, LayerStats]], weights: dict[str, float]
) -> dict[int, LayerStats]:
    """The statistics of a weighted mixture of sources, from each source's own statistics.

    Each source s contributes its weight's share of a token average: every sum field becomes
    Σ_s λ_s·S_s with λ_s = (w_s/Σw)·N/N_s and N = Σ_s N_s, so S/N = Σ_s (w_s/Σw)·S_s/N_s, and ratio
    scores (CP = Σp_sel/count, ...) are mixed at numerator and denominator level, not as ratios.
    `n_tokens` is N and `max_norm_sel` the max over the sources. Sources of weight 0 are left out
    (of N too), so one source with any weight gives back its own statistics exactly (the same objects).
    """
    active = _active_weights(per_source, weights)
    layers = sorted(per_source[next(iter(active))])
    for name in active:
        if sorted(per_source[name]) != layers:
            raise ValueError(f"source {name!r} has layers {sorted(per_source[name])}, another has {layers}")
    return {layer: _mix_layer({name: per_source[name][layer] for name in active}, active) for layer in layers}


def _active_weights(
    per_source: dict[str, dict[int, LayerStats]], weights: dict[str, float]
) -> dict[str, float]:
    """The sources with a positive weight, after checking that `weights` names exactly the sources."""
    if not per_source:
        raise ValueError("per_source is empty: no source to mix")
    if set(weights) != set(per_source):
        raise ValueError(f"weights name {sorted(weights)}; the sources are {sorted(per_source)}")
    for name, w in weights.items():
        if not (isinstance(w, int | float) and math.isfinite(w) and w >= 0):
            raise ValueError(f"weight of source {name!r}: {w!r}; allowed: a finite number >= 0")
    active = {name: float(w) for name, w in weights.items() if w > 0}
    if not active:
        raise ValueError("every weight is 0: nothing to mix")
    return active


def _mix_layer(stats: dict[str, LayerStats], weights: dict[str, float]) -> LayerStats:
    if len(stats) == 1:
        return next(iter(stats.values()))
    for name, st in stats.items():
        if st.n_tokens <= 0:
            raise ValueError(f"source {name!r} has no tokens: it cannot carry a weight")
    n = sum(st.n_tokens for st in stats.values())
    total = sum(weights.values())
    lam = {name: (weights[name] / total) * (n / st.n_tokens) for name, st in stats.items()}
    fields: dict[str, torch.Tensor | None] = {}
    for field in (*STATS_TENSORS, *FAMILY_STATS):
        values = {name: getattr(st, field) for name, st in stats.items()}
        missing = [name for name, v in values.items() if v is None]
        if len(missing) == len(values):
            fields[field] = None
        elif missing:
            raise ValueError(f"{field}: missing in source(s) {', '.join(missing)} only; cannot mix")
        elif field in MAX_FIELDS:
            fields[field] = torch.stack(list(values.values())).amax(0)
        else:
            acc = None
            for name, v in values.items():
                term = v.double() * lam[name]
                acc = term if acc is None else acc + term
            fields[field] = acc
    return LayerStats(
        n_tokens=n, **fields, sample=mix_samples({name: st.sample for name, st in stats.items()}, weights)
    )


def mix_samples(
    samples: dict[str, dict[str, torch.Tensor] | None], weights: dict[str, float]
) -> dict[str, torch.Tensor] | None:
    """The token sample of a mixture: from each source c_s of its sampled tokens (a seeded subset, kept in
    order), c_s its weight's share of the largest source sample (largest remainder, at most what the
    source has), so reconstruction sees the mixture in the proportions of the weights. Their windows
    are stacked (a token's window index shifted by the windows before it). None unless every source has
    a sample."""
    if any(s is None for s in samples.values()):
        return None
    T = max(int(s["x"].shape[0]) for s in samples.values())
    total = sum(weights.values())
    quota = {name: weights[name] / total * T for name in samples}
    counts = {name: int(q) for name, q in quota.items()}
    for name in sorted(quota, key=lambda n: (-(quota[n] - counts[n]), n))[: T - sum(counts.values())]:
        counts[name] += 1
    parts: dict[str, list[torch.Tensor]] = {}
    offset = 0
    for name, smp in samples.items():
        n = int(smp["x"].shape[0])
        keep = (
            torch.randperm(n, generator=torch.Generator().manual_seed(0))[: min(counts[name], n)]
            .sort()
            .values
        )
        for key in ("x", "p"):
            parts.setdefault(key, []).append(smp[key][keep])
        if "ids" in smp:
            parts.setdefault("ids", []).append(smp["ids"])
            parts.setdefault("mask", []).append(smp["mask"])
            parts.setdefault("window", []).append(smp["window"][keep] + offset)
            parts.setdefault("pos", []).append(smp["pos"][keep])
            offset += int(smp["ids"].shape[0])
    return {key: torch.cat(ts) for key, ts in parts.items()}


# ---- storage ------------------------------------------------------------------------------------
def save_stats(
    stats: dict[int, LayerStats], path: str | Path, metadata: dict[str, str] | None = None
) -> None:
    """One safetensors file, keys 'layer.<i>.<field>', exact float64 values."""
    from safetensors.torch import save_file

    if not stats:
        raise ValueError("stats is empty: nothing to save")
    tensors: dict[str, torch.Tensor] = {}
    for layer, st in stats.items():
        tensors.update(
            {k: v.detach().cpu().contiguous() for k, v in st.to_tensors(f"layer.{layer}.").items()}
        )
        if st.sample is not None:  # the windows of the token sample, once per file (every layer shares them)
            tensors.update(
                {
                    f"sample.{n}": st.sample[n].detach().cpu().contiguous()
                    for n in SAMPLE_SHARED
                    if n in st.sample
                }
            )
    meta = {"format": FORMAT, "layers": ",".join(str(i) for i in sorted(stats))}
    meta.update({str(k): str(v) for k, v in (metadata or {}).items()})
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=meta)


def save_source_stats(
    per_source: dict[str, dict[int, LayerStats]],
    weights: dict[str, float],
    path: str | Path,
    metadata: dict[str, str] | None = None,
) -> None:
    """One safetensors file of every source's statistics apart, keys 'source.<name>.layer.<i>.<field>';
    metadata 'sources' lists each source's weight and token count (JSON, in the given order)."""
    from safetensors.torch import save_file

    if not per_source:
        raise ValueError("per_source is empty: nothing to save")
    if set(weights) != set(per_source):
        raise ValueError(f"weights name {sorted(weights)}; the sources are {sorted(per_source)}")
    tensors: dict[str, torch.Tensor] = {}
    listed: dict[str, dict[str, float | int]] = {}
    for name, stats in per_source.items():
        if not SOURCE_NAME.match(name):
            raise ValueError(f"source name {name!r}: allowed letters, digits, '_', '-' (no '.')")
        if not stats:
            raise ValueError(f"source {name!r} has no statistics: nothing to save")
        for layer, st in stats.items():
            tensors.update(
                {
                    k: v.detach().cpu().contiguous()
                    for k, v in st.to_tensors(f"source.{name}.layer.{layer}.").items()
                }
            )
            if st.sample is not None:  # the windows of the source's token sample, once per source
                tensors.update(
                    {
                        f"source.{name}.sample.{n}": st.sample[n].detach().cpu().contiguous()
                        for n in SAMPLE_SHARED
                        if n in st.sample
                    }
                )
        listed[name] = {"weight": float(weights[name]), "n_tokens": source_tokens(stats)}
    layers = sorted(next(iter(per_source.values())))
    meta = {"format": FORMAT, "layers": ",".join(map(str, layers)), "sources": json.dumps(listed)}
    meta.update({str(k): str(v) for k, v in (metadata or {}).items()})
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=meta)


def stats_to(stats: dict[int, LayerStats], device: str | torch.device) -> dict[int, LayerStats]:
    """The same statistics with every tensor on `device`."""
    from dataclasses import fields, replace

    return {
        layer: replace(
            st,
            **{
                f.name: getattr(st, f.name).to(device)
                for f in fields(st)
                if isinstance(getattr(st, f.name), torch.Tensor)
            },
        )
        for layer, st in stats.items()
    }


def source_tokens(stats: dict[int, LayerStats]) -> int:
    """The calibration tokens behind one source's statistics (every layer saw the same tokens)."""
    return int(next(iter(stats.values())).n_tokens)


def load_stats(
    path: str | Path, device: str | torch.device = "cpu", *, weights: dict[str, float] | None = None
) -> dict[int, LayerStats]:
    """The calibration statistics of a file, its sources mixed (mix_stats) with `weights`, by default the
    weights stored in the file. A file without sources (older moesweep) is one source, returned as stored."""
    per_source = load_source_stats(path, device)
    try:
        return mix_stats(per_source, source_weights(path) if weights is None else weights)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def load_source_stats(
    path: str | Path, device: str | torch.device = "cpu"
) -> dict[str, dict[int, LayerStats]]:
    """{source name: {layer: LayerStats}}, every source's statistics apart (an older file without
    sources: the one source 'default'), so a caller can mix them with weights of its own."""
    from safetensors.torch import load_file

    tensors = load_file(str(path), device=str(device))
    prefixes: dict[str, set[int]] = {}
    for key in tensors:
        parts = key.split(".")
        if parts[0] == "source" and len(parts) > 4 and parts[2] == "layer":
            prefixes.setdefault(f"source.{parts[1]}.", set()).add(int(parts[3]))
        elif parts[0] == "layer":
            prefixes.setdefault("", set()).add(int(parts[1]))
    if not prefixes:
        raise ValueError(
            f"{path}: no 'layer.<i>.' or 'source.<name>.layer.<i>.' tensors; "
            "not a calibration statistics file"
        )
    try:
        out = {
            (prefix.split(".")[1] if prefix else "default"): {
                layer: LayerStats.from_tensors(tensors, f"{prefix}layer.{layer}.") for layer in sorted(layers)
            }
            for prefix, layers in prefixes.items()
        }
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    for prefix in prefixes:  # a source's token sample: its windows once, beside every layer's x and p
        shared = {
            n: tensors[f"{prefix}sample.{n}"] for n in SAMPLE_SHARED if f"{prefix}sample.{n}" in tensors
        }
        for st in out[prefix.split(".")[1] if prefix else "default"].values():
            if st.sample is not None:
                st.sample.update(shared)
    return out


def source_weights(path: str | Path) -> dict[str, float]:
    """The mixing weights stored with a statistics file ({'default': 1.0} for a file without sources)."""
    listed = stats_metadata(path).get("sources")
    if listed is None:
        return {"default": 1.0}
    return {name: float(entry["weight"]) for name, entry in json.loads(listed).items()}


def stats_metadata(path: str | Path) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as fh:
        return dict(fh.metadata() or {})
