"""The baselines of §4.2 / Appendix M: random FFN + teacher attention, random initialisation, and
dense-to-dense (D2D) Minitron-style structured pruning of a dense teacher.

Random students have exactly the architecture of the MoE→dense students (built by the family adapter);
D2D candidates are smaller dense models of the dense teacher's own class (Qwen3 for `tiny`; also
Llama and Mistral). Each D2D candidate is sized to the parameter count of the MoE→dense student at
K = k, the comparison the paper makes (Table 13: five candidates near 3.4B pruned from Qwen3-32B).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from workers.core.types import DenseFFN
from workers.models.decoder import decoder_of

# ---- random students (§4.2) --------------------------------------------------------------------------


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """`model.base_model.layers`; a one-line ValueError for a model keeping them elsewhere (DBRX: blocks)."""
    layers = getattr(decoder_of(model), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        found = [n for n, m in decoder_of(model).named_children() if isinstance(m, nn.ModuleList)]
        raise ValueError(
            f"model_type={model.config.model_type!r}: decoder layers at base_model."
            f"{', base_model.'.join(found) or '(none)'}, not base_model.layers; the baselines need "
            "base_model.layers"
        )
    return layers


def _init_std(model: nn.Module) -> float:
    return float(getattr(model.config, "initializer_range", 0.02))


def random_ffn_student(teacher: nn.Module, adapter: Any, seed: int) -> nn.Module:
    """The MoE→dense student architecture (FFN width k·I, plus shared experts) with the teacher's
    attention, embeddings and norms copied and every FFN parameter drawn afresh, like the model's own
    init: weights ~ N(0, initializer_range), biases 0 (§4.2 "random FFN + teacher attention").
    Dense teacher layers (e.g. DeepSeek's first) are random too: no FFN weight comes from the teacher."""
    decoder_layers(teacher)  # refused before any student is built
    k = adapter.top_k(teacher)
    ffns: dict[int, DenseFFN] = {}
    for layer in adapter.moe_layers(teacher):
        ew = adapter.expert_weights(teacher, layer)
        width, hidden = k * ew.intermediate, ew.hidden

        def z(*shape: int, ref: torch.Tensor = ew.gate) -> torch.Tensor:
            return ref.new_zeros(shape)

        ffns[layer] = DenseFFN(
            gate=z(width, hidden),
            up=z(width, hidden),
            down=z(hidden, width),
            gate_bias=None if ew.gate_bias is None else z(width),
            up_bias=None if ew.up_bias is None else z(width),
            down_bias=None if ew.down_bias is None else z(hidden),
            act=ew.act,
            act_alpha=ew.act_alpha,
            act_limit=ew.act_limit,
        )
    student = adapter.build_student(teacher, ffns, share_weights=False)
    ref = next(student.parameters())
    gen = torch.Generator(device=ref.device).manual_seed(seed)
    std = _init_std(student)
    with torch.no_grad():
        for layer in decoder_layers(student):
            for p in getattr(layer, adapter.student_ffn_attr).parameters():
                if p.dim() >= 2:
                    p.copy_(torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32) * std)
                else:
                    p.zero_()
    return student


def random_init_student(teacher: nn.Module, adapter: Any, seed: int) -> nn.Module:
    """The same student architecture with every parameter freshly initialised by the model class's
    own initialisation (§4.2 "random initialization"), seeded; on the teacher's device and dtype."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(random_ffn_student(teacher, adapter, seed).config)
    ref = next(teacher.parameters())
    devices = [ref.device.index] if ref.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    return model.to(device=ref.device, dtype=ref.dtype).eval()


# ---- dense-to-dense: candidates (Appendix M, Table 13) ------------------------------------------------
D2D_TYPES = ("qwen3", "llama", "mistral")  # dense classes with an explicit head_dim (hidden can shrink)

# name → (strategy, which widths shrink, fraction of layers dropped, minimum layers dropped)
_CANDIDATES: dict[str, tuple[str, tuple[str, ...], float, int]] = {
    "width": ("width", ("ffn",), 0.0, 0),
    "width+hidden": ("width", ("ffn", "hidden"), 0.0, 0),
    "width+hidden+heads": ("width", ("ffn", "hidden", "heads"), 0.0, 0),
    "width+depth12": ("width+depth", ("ffn",), 1 / 8, 1),
    "width+depth25": ("width+depth", ("ffn",), 1 / 4, 2),
}


def d2d_candidate_names() -> list[str]:
    """The candidate architectures, by name (static: the sweep plan is built before any model loads)."""
    return list(_CANDIDATES)


def _dims(config: Any) -> dict[str, int]:
    heads = int(config.num_attention_heads)
    return {
        "layers": int(config.num_hidden_layers),
        "hidden": int(config.hidden_size),
        "ffn": int(config.intermediate_size),
        "heads": heads,
        "kv_heads": int(getattr(config, "num_key_value_heads", None) or heads),
        "head_dim": int(getattr(config, "head_dim", None) or config.hidden_size // heads),
    }


def _config_for(config: Any, dims: dict[str, int], keep_layers: list[int] | None = None) -> Any:
    cfg = copy.deepcopy(config)
    cfg.num_hidden_layers = dims["layers"]
    cfg.hidden_size = dims["hidden"]
    cfg.intermediate_size = dims["ffn"]
    cfg.num_attention_heads = dims["heads"]
    cfg.num_key_value_heads = dims["kv_heads"]
    cfg.head_dim = dims["head_dim"]
    if getattr(cfg, "layer_types", None) is not None:
        last = len(config.layer_types) - 1
        keep = keep_layers if keep_layers is not None else [min(i, last) for i in range(dims["layers"])]
        cfg.layer_types = [config.layer_types[i] for i in keep]
    return cfg


_COUNTS: dict[tuple, int] = {}


def _n_params(config: Any, dims: dict[str, int]) -> int:
    """Exact parameter count of the class at `dims`: built on the meta device with 1 and 2 layers."""
    from transformers import AutoModelForCausalLM

    key = (config.to_json_string(), tuple(sorted(dims.items())))
    if key in _COUNTS:
        return _COUNTS[key]
    counts = []
    for n in (1, 2):
        with torch.device("meta"):
            m = AutoModelForCausalLM.from_config(_config_for(config, {**dims, "layers": n}))
        counts.append(sum(p.numel() for p in m.parameters()))
    per_layer = counts[1] - counts[0]
    _COUNTS[key] = counts[0] + (dims["layers"] - 1) * per_layer
    return _COUNTS[key]


def _solve_ffn(config: Any, dims: dict[str, int], target: int, max_ffn: int) -> dict[str, int]:
    """The FFN width (1..max_ffn) whose parameter count is closest to target (params are linear in it)."""
    p1 = _n_params(config, {**dims, "ffn": 1})
    per_unit = _n_params(config, {**dims, "ffn": 2}) - p1
    ffn = min(max_ffn, max(1, 1 + round((target - p1) / per_unit)))
    return {**dims, "ffn": ffn}


def _shrink(config: Any, base: dict[str, int], axes: tuple[str, ...], s: float) -> dict[str, int]:
    d = dict(base)
    if "hidden" in axes:
        d["hidden"] = (
            max(8, int(round(base["hidden"] * s / 8)) * 8) if base["hidden"] >= 16 else base["hidden"]
        )
    if "heads" in axes:
        group = base["heads"] // base["kv_heads"]
        d["kv_heads"] = max(1, round(base["kv_heads"] * s))
        d["heads"] = d["kv_heads"] * group
    if "ffn" in axes:
        d["ffn"] = max(1, round(base["ffn"] * s))
    return d


def d2d_target(dense_model: nn.Module) -> int:
    """The parameter count of the MoE→dense student at K = k that the D2D candidates match.

    For moesweep's tiny dense twin (a dense copy of the MoE teacher's architecture with the FFN
    widened to match the MoE's total parameters; its directory holds tiny_meta.json) this is the dense
    teacher's class at FFN width top_k · moe_intermediate: exactly the MoE→dense student. Any other
    dense teacher needs the number from its MoE counterpart (`d2d_candidates(..., target_params=)`)."""
    path = Path(str(getattr(dense_model.config, "_name_or_path", "") or "")) / "tiny_meta.json"
    if not path.is_file():
        raise ValueError(
            "d2d_candidates: target_params is required (the MoE→dense student's parameter count) "
            "unless the dense teacher is moesweep's tiny twin (a directory with tiny_meta.json)"
        )
    spec = json.loads(path.read_text())["spec"]
    dims = _dims(dense_model.config)
    return _n_params(dense_model.config, {**dims, "ffn": int(spec["top_k"]) * int(spec["moe_intermediate"])})


def d2d_candidates(dense_model: nn.Module, target_params: int | None = None) -> list[dict[str, Any]]:
    """Minitron-style candidate architectures (Appendix M), one per `d2d_candidate_names()`, each sized
    to `target_params` (default `d2d_target`) as closely as its shape allows:

    - width: FFN neurons only; every layer, the hidden size and the heads are kept.
    - width+hidden: the hidden size and the FFN shrink by one common factor.
    - width+hidden+heads: hidden size, FFN and attention heads (whole KV groups) by one common factor.
    - width+depth12 / width+depth25: drop 1/8 (≥ 1) or 1/4 (≥ 2) of the layers (lowest block
      importance), then FFN neurons.
    After the shared factor is found (bisection), the FFN width is solved exactly for the target, so
    "params" (the exact count of the pruned model) is the closest the candidate's shape can get.
    """
    config = dense_model.config
    if config.model_type not in D2D_TYPES:
        raise ValueError(
            f"d2d: dense model_type {config.model_type!r} is not supported; allowed: {', '.join(D2D_TYPES)}"
        )
    target = int(target_params) if target_params is not None else d2d_target(dense_model)
    base = _dims(config)
    out = []
    for name, (strategy, axes, frac, min_drop) in _CANDIDATES.items():
        dims = dict(base)
        if frac:
            dims["layers"] = max(1, base["layers"] - max(min_drop, round(base["layers"] * frac)))
        options = [dims]
        if len(axes) > 1:  # bisection on the common factor s ∈ (0, 1]; then the rounded shape on either side
            lo, hi = 0.0, 1.0
            for _ in range(24):
                mid = (lo + hi) / 2
                if _n_params(config, _shrink(config, dims, axes, mid)) > target:
                    hi = mid
                else:
                    lo = mid
            options = [_shrink(config, dims, axes, max(lo, 1e-6)), _shrink(config, dims, axes, hi)]
        solved = [_solve_ffn(config, d, target, base["ffn"]) for d in options]
        best = min(solved, key=lambda d: abs(_n_params(config, d) - target))
        out.append(
            {
                "name": name,
                "strategy": strategy,
                **best,
                "params": _n_params(config, best),
                "target_params": target,
            }
        )
    return out


# ---- dense-to-dense: importance and pruning -------------------------------------------------------------
def _hidden_of(x: Any) -> torch.Tensor:
    return x[0] if isinstance(x, tuple | list) else x


class _Importance:
    """Minitron activation-based importance (Muralidharan et al. 2024, §2.2), aggregated over the
    sequence by the mean and over the batch by the L2 norm (their best aggregation):

    - FFN neuron j of layer l: |act(gate)·up|_j, the input of down_proj;
    - attention head h of layer l: ‖head output‖₂ over head_dim, the input of o_proj;
    - embedding channel c: |LN(x)|_c over the outputs of every RMSNorm of the network (each layer's two and the
      final one), one L2 over all of them and the batch (NVIDIA Model-Optimizer instead sums a per-norm L2
      over the layers' two input norms only);
    - layer l (depth): block importance 1 − mean_t cos(x_in(t), x_out(t)) (Men et al. 2024, ShortGPT).
    """

    def __init__(self, model: nn.Module):
        self.model = model
        d = _dims(model.config)
        self.d = d
        layers = decoder_layers(model)
        dev = next(model.parameters()).device
        f64 = {"dtype": torch.float64, "device": dev}
        self.ffn = [torch.zeros(d["ffn"], **f64) for _ in layers]
        self.heads = [torch.zeros(d["heads"], **f64) for _ in layers]
        self.channels = torch.zeros(d["hidden"], **f64)
        self.block_cos = torch.zeros(len(layers), **f64)
        self.tokens = 0
        self.hooks = []
        self._inputs: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(layers):
            self.hooks.append(layer.mlp.down_proj.register_forward_pre_hook(self._ffn_hook(i)))
            self.hooks.append(layer.self_attn.o_proj.register_forward_pre_hook(self._head_hook(i)))
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                self.hooks.append(norm.register_forward_hook(self._norm_hook))
            self.hooks.append(layer.register_forward_pre_hook(self._block_in(i), with_kwargs=True))
            self.hooks.append(layer.register_forward_hook(self._block_out(i)))
        self.hooks.append(decoder_of(model).norm.register_forward_hook(self._norm_hook))

    @staticmethod
    def _agg(x: torch.Tensor) -> torch.Tensor:
        """[B, T, ...] → Σ_b (mean_t |x|)², to be square-rooted at the end (L2 over the batch)."""
        return x.abs().double().mean(dim=1).pow(2).sum(dim=0)

    def _ffn_hook(self, i: int):
        def hook(mod: nn.Module, args: tuple) -> None:
            self.ffn[i] += self._agg(args[0])

        return hook

    def _head_hook(self, i: int):
        def hook(mod: nn.Module, args: tuple) -> None:
            x = args[0]
            per_head = x.reshape(*x.shape[:2], self.d["heads"], self.d["head_dim"]).double().norm(dim=-1)
            self.heads[i] += self._agg(per_head)

        return hook

    def _norm_hook(self, mod: nn.Module, args: tuple, out: Any) -> None:
        self.channels += self._agg(_hidden_of(out))

    def _block_in(self, i: int):
        def hook(mod: nn.Module, args: tuple, kwargs: dict) -> None:
            self._inputs[i] = args[0] if args else kwargs["hidden_states"]

        return hook

    def _block_out(self, i: int):
        def hook(mod: nn.Module, args: tuple, out: Any) -> None:
            x_in, x_out = self._inputs.pop(i).double(), _hidden_of(out).double()
            self.block_cos[i] += torch.nn.functional.cosine_similarity(x_in, x_out, dim=-1).sum()

        return hook

    @torch.no_grad()
    def run(self, batches: list[torch.Tensor]) -> dict[str, Any]:
        dev = next(self.model.parameters()).device
        try:
            for ids in batches:
                self.model(input_ids=ids.to(dev), use_cache=False)
                self.tokens += ids.numel()
        finally:
            for h in self.hooks:
                h.remove()
        if self.tokens == 0:
            raise ValueError("prune_dense: batches are empty; activation importance needs calibration tokens")
        return {
            "ffn": [x.sqrt() for x in self.ffn],
            "heads": [x.sqrt() for x in self.heads],
            "channels": self.channels.sqrt(),
            "blocks": 1.0 - self.block_cos / self.tokens,
        }


def _top(scores: torch.Tensor, n: int) -> torch.Tensor:
    """Indices of the n largest scores, in their original order."""
    return torch.topk(scores, n).indices.sort().values


def prune_dense(dense_model: nn.Module, candidate: dict[str, Any], batches: list[torch.Tensor]) -> nn.Module:
    """Prune `dense_model` to `candidate`'s dims by activation importance measured on `batches`
    (LongTensor [B, T] each), keeping the most important layers, KV groups (with their query heads),
    embedding channels and FFN neurons. Returns a new model of the same class (weights copied, the
    original untouched), loadable after save_pretrained."""
    config = dense_model.config
    if config.model_type not in D2D_TYPES:
        raise ValueError(
            f"d2d: dense model_type {config.model_type!r} is not supported; allowed: {', '.join(D2D_TYPES)}"
        )
    base = _dims(config)
    dims = {k: int(candidate[k]) for k in ("layers", "hidden", "ffn", "heads", "kv_heads")}
    dims["head_dim"] = base["head_dim"]
    for k, v in dims.items():
        if not 1 <= v <= base[k]:
            raise ValueError(
                f"candidate {candidate.get('name')!r}: {k}={v} is not allowed; allowed: 1..{base[k]}"
            )
    group = base["heads"] // base["kv_heads"]
    if dims["heads"] != dims["kv_heads"] * group:
        raise ValueError(
            f"candidate {candidate.get('name')!r}: heads={dims['heads']} is not allowed; allowed: "
            f"kv_heads × {group} (whole KV groups are pruned)"
        )
    imp = _Importance(dense_model).run(batches)
    keep_layers = _top(imp["blocks"], dims["layers"]).tolist()
    ch = _top(imp["channels"], dims["hidden"])
    hd = base["head_dim"]
    keep: dict[int, dict[str, torch.Tensor]] = {}
    for new, old in enumerate(keep_layers):
        groups = imp["heads"][old].reshape(base["kv_heads"], group).sum(-1)
        kv = _top(groups, dims["kv_heads"])
        heads = (kv[:, None] * group + torch.arange(group, device=kv.device)).reshape(-1)
        keep[new] = {
            "old": old,
            "q": (heads[:, None] * hd + torch.arange(hd, device=kv.device)).reshape(-1),
            "kv": (kv[:, None] * hd + torch.arange(hd, device=kv.device)).reshape(-1),
            "ffn": _top(imp["ffn"][old], dims["ffn"]),
        }
    cfg = _config_for(config, dims, keep_layers)
    return _assemble_pruned(dense_model, cfg, keep, ch)


def _slice(name: str, t: torch.Tensor, ch: torch.Tensor, k: dict[str, torch.Tensor] | None) -> torch.Tensor:
    """The pruned copy of one parameter, by its (new-model) name."""
    leaf = name.rsplit(".", 2)
    mod, kind = leaf[-2], leaf[-1]
    if k is None:  # outside the decoder layers
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            return t[:, ch]
        if name.endswith("norm.weight"):
            return t[ch]
        raise ValueError(f"prune_dense: no rule for parameter {name}")
    if mod in ("input_layernorm", "post_attention_layernorm"):
        return t[ch]
    if mod in ("q_norm", "k_norm"):
        return t
    rows_cols = {
        "q_proj": (k["q"], ch),
        "k_proj": (k["kv"], ch),
        "v_proj": (k["kv"], ch),
        "o_proj": (ch, k["q"]),
        "gate_proj": (k["ffn"], ch),
        "up_proj": (k["ffn"], ch),
        "down_proj": (ch, k["ffn"]),
    }
    if mod not in rows_cols:
        raise ValueError(f"prune_dense: no rule for parameter {name}")
    rows, cols = rows_cols[mod]
    return t[rows] if kind == "bias" else t[rows][:, cols]


def _assemble_pruned(
    dense: nn.Module, cfg: Any, keep: dict[int, dict[str, torch.Tensor]], ch: torch.Tensor
) -> nn.Module:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    src = dict(dense.named_parameters(remove_duplicate=False))
    src_buffers = dict(dense.named_buffers(remove_duplicate=False))
    memo: dict[int, nn.Parameter] = {}

    def old_name(name: str) -> tuple[str, dict | None]:
        parts = name.split(".")
        if "layers" in parts:
            i = parts.index("layers")
            k = keep[int(parts[i + 1])]
            parts[i + 1] = str(k["old"])
            return ".".join(parts), k
        return name, None

    for name, p in list(model.named_parameters(remove_duplicate=False)):
        oname, k = old_name(name)
        if oname not in src:
            raise ValueError(f"prune_dense: parameter {name} has no counterpart {oname} in the dense model")
        t = src[oname]
        if id(t) not in memo:  # tied tensors stay tied
            memo[id(t)] = nn.Parameter(
                _slice(name, t.detach(), ch.to(t.device), k).clone().contiguous(),
                requires_grad=t.requires_grad,
            )
        new = memo[id(t)]
        if tuple(new.shape) != tuple(p.shape):
            raise ValueError(
                f"prune_dense: {name} pruned to {tuple(new.shape)}, the model needs {tuple(p.shape)}"
            )
        mod_name, _, leaf = name.rpartition(".")
        model.get_submodule(mod_name)._parameters[leaf] = new
    for name, b in list(model.named_buffers(remove_duplicate=False)):
        oname, _ = old_name(name)
        if oname not in src_buffers or tuple(src_buffers[oname].shape) != tuple(b.shape):
            raise ValueError(f"prune_dense: buffer {name} has no counterpart in the dense model")
        mod_name, _, leaf = name.rpartition(".")
        model.get_submodule(mod_name)._buffers[leaf] = src_buffers[oname].detach().clone()
    return model.eval()
