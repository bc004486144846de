"""Calibration of a teacher larger than one device: the teacher streamed one decoder layer at a time.

The model is built as a skeleton on the meta device (no memory). Its embeddings are read from the
checkpoint's safetensors shards, the calibration batches embedded, and then, layer after layer, only
that decoder layer's tensors are read from the shards onto the device, every batch's hidden states are
run through it, and the layer goes back to the meta device. The hidden states of all batches are carried
from layer to layer (on the device, or on the CPU with `offload`). Peak memory: the embeddings once, then
one decoder layer plus the activations of the calibration set (memory_needed).

Exactness: each layer is called with exactly the arguments the model's own forward gives it. The
model's forward runs once per batch with every decoder layer's `forward` replaced by a recorder, so
the rotary position embeddings, the causal / sliding-window masks (per layer type) and the position ids
come from the model's own code path, computed once per batch. The layer's tensors are read by
transformers' own loader (`convert_and_load_state_dict_in_model` with the model's conversion mapping),
so per-expert checkpoint tensors are fused as `from_pretrained` fuses them, in the same dtype, and
non-persistent buffers (rotary inv_freq) are initialised by the model's `_init_weights`, as
`from_pretrained` does. The statistics go through the same router hooks and LayerAccumulator as
workers.calibration.calibrate.collect_stats, batch by batch in the same order, so they equal the resident pass.

Version assumption (transformers 5.x): a decoder (workers.models.decoder.decoder_of) whose forward embeds the ids,
builds masks and position embeddings, then runs `hidden_states = layer(hidden_states, **kwargs)` over
`decoder.layers` in order (a decoder keeping them elsewhere, DBRX's `transformer.blocks`, is refused in one
line), nothing depending on a layer's output except the next layer's input (a layer that
returns more, GLM-5's DSA top-k, is read through adapter.layer_output / recorded_layer_output); the
checkpoint names a decoder layer's tensors `...layers.<i>....`; unquantized safetensors checkpoints.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from workers.calibration.calibrate import (
    LayerAccumulator,
    attach_gate_sums,
    attach_sample,
    check_batches,
    gate_hook,
    router_hook,
    sample_plan,
    stats_to,
)
from workers.core.types import LayerContext, LayerStats
from workers.models.decoder import decoder_of

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
LAYER_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.")


# ---- the checkpoint ---------------------------------------------------------------------------------
def checkpoint_dir(path: str, revision: str | None = None) -> Path:
    """A local directory holding the teacher's config and safetensors: `path` itself, or the Hub
    snapshot of that id (only its *.json and *.safetensors files are fetched; offline: the cached ones)."""
    if Path(path).is_dir():
        return Path(path)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(path, revision=revision, allow_patterns=["*.json", "*.safetensors"]))


def shard_map(directory: str | Path) -> dict[str, Path]:
    """Checkpoint key → the safetensors file holding it (the shard index, or one model.safetensors)."""
    d = Path(directory)
    if (d / INDEX).is_file():
        index = json.loads((d / INDEX).read_text())
        return {key: d / name for key, name in index["weight_map"].items()}
    if (d / SINGLE).is_file():
        from safetensors import safe_open

        with safe_open(str(d / SINGLE), framework="pt") as fh:
            return dict.fromkeys(fh.keys(), d / SINGLE)
    raise ValueError(f"{d}: neither {INDEX} nor {SINGLE}; streaming needs a safetensors checkpoint")


def layer_of(key: str) -> int | None:
    """The decoder layer a checkpoint key belongs to ('model.layers.3.mlp...' → 3), None outside the layers."""
    m = LAYER_KEY.search(key)
    return int(m.group(1)) if m else None


@contextmanager
def _quiet_loading() -> Iterator[None]:
    """transformers' per-call 'Loading weights' progress bar off while a layer is read."""
    from transformers.utils import logging

    was = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            logging.enable_progress_bar()


class StreamedTeacher:
    """The teacher's skeleton on the meta device and its checkpoint's shards: materialises one part at a
    time (the parts outside the decoder layers, or one decoder layer) on a device, and frees it again.
    `peak` records the largest set of tensors ever materialised at once (names and bytes)."""

    def __init__(self, directory: str | Path, dtype: torch.dtype = torch.float32, **model_kwargs: Any):
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.conversion_mapping import get_model_conversion_mapping

        self.directory = Path(directory)
        config = AutoConfig.from_pretrained(str(self.directory))
        if getattr(config, "quantization_config", None):
            raise ValueError(
                f"{self.directory}: a quantized checkpoint; streaming reads unquantized weights only"
            )
        with torch.device("meta"):
            self.model = AutoModelForCausalLM.from_config(config, dtype=dtype, **model_kwargs).eval()
        self.dtype = dtype
        self.files = shard_map(self.directory)
        self.conversions = get_model_conversion_mapping(self.model)
        self.decoder = decoder_of(self.model)
        self.prefix = next(name for name, mod in self.model.named_modules() if mod is self.decoder)
        self.prefix = f"{self.prefix}." if self.prefix else ""
        if not isinstance(getattr(self.decoder, "layers", None), nn.ModuleList):  # DBRX: transformer.blocks
            found = [
                f"{self.prefix}{n}" for n, m in self.decoder.named_children() if isinstance(m, nn.ModuleList)
            ]
            raise ValueError(
                f"model_type={config.model_type!r}: decoder layers at {', '.join(found) or 'no ModuleList'}"
                f", not {self.prefix}layers; streamed calibration needs model.layers"
            )
        head = self.model.get_output_embeddings()
        self.head = next(
            (f"{name}." for name, mod in self.model.named_modules() if mod is head and name), None
        )
        self.peak: tuple[int, frozenset[str]] = (0, frozenset())

    @property
    def num_layers(self) -> int:
        return len(self.decoder.layers)

    def layer_prefix(self, layer: int) -> str:
        return f"{self.prefix}layers.{layer}."

    def materialised(self) -> dict[str, int]:
        """Name → bytes of every parameter and buffer not on the meta device now."""
        tensors = [
            *self.model.named_parameters(remove_duplicate=False),
            *self.model.named_buffers(remove_duplicate=False),
        ]
        return {name: t.numel() * t.element_size() for name, t in tensors if not t.is_meta}

    def _load(self, keys: list[str], device: torch.device, what: str, scope: str) -> None:
        """Read `keys` from the shards into the skeleton on `device`, through transformers' loader (the
        model's key renaming and expert fusion, its dtype plan), then the owners' non-persistent buffers."""
        from safetensors import safe_open
        from transformers.core_model_loading import convert_and_load_state_dict_in_model
        from transformers.modeling_utils import LoadStateDictConfig

        by_file: dict[Path, list[str]] = {}
        for key in keys:
            by_file.setdefault(self.files[key], []).append(key)
        handles = [safe_open(str(f), framework="pt", device="cpu") for f in by_file]
        try:
            state = {
                key: fh.get_slice(key) for fh, ks in zip(handles, by_file.values(), strict=True) for key in ks
            }
            config = LoadStateDictConfig(
                device_map={"": device},
                dtype=self.dtype,
                dtype_plan=self.model._get_dtype_plan(self.dtype),
                weight_mapping=self.conversions,
            )
            with _quiet_loading():
                info, _ = convert_and_load_state_dict_in_model(self.model, state, config)
        finally:
            for fh in handles:
                fh.__exit__(None, None, None)
        if info.mismatched_keys or info.conversion_errors:
            bad = sorted(k[0] for k in info.mismatched_keys) + sorted(info.conversion_errors)
            raise ValueError(f"{what}: checkpoint tensors do not fit the model: {', '.join(bad[:5])}")
        self._init_buffers(device, scope)
        now = self.materialised()
        if sum(now.values()) > self.peak[0]:
            self.peak = (sum(now.values()), frozenset(now))

    def _init_buffers(self, device: torch.device, scope: str) -> None:
        """Non-persistent buffers of the modules in `scope` (a layer's prefix, or '' for the parts outside
        the layers), e.g. rotary inv_freq, made as from_pretrained makes them: an empty tensor on the
        device, then the model's own `_init_weights` of their module."""
        for name, mod in self.model.named_modules():
            meta = [
                b
                for b in mod._buffers
                if mod._buffers[b] is not None
                and mod._buffers[b].is_meta
                and b in mod._non_persistent_buffers_set
            ]
            if not meta or not self._in_scope(name, scope):
                continue
            if any(True for _ in mod.parameters(recurse=False)):
                raise ValueError(
                    f"{name}: non-persistent buffers beside parameters; cannot initialise them apart"
                )
            for b in meta:
                mod._buffers[b] = torch.empty_like(mod._buffers[b], device=device)
            with torch.no_grad():
                self.model._init_weights(mod)

    def _in_scope(self, module_name: str, scope: str) -> bool:
        """Is a module inside `scope`: under the layer prefix `scope`, or ('') outside the layers and the head?"""
        name = f"{module_name}."
        if scope:
            return name.startswith(scope)
        return not name.startswith(f"{self.prefix}layers.") and not (self.head and name.startswith(self.head))

    def load_outside(self, device: torch.device) -> None:
        """The tensors outside the decoder layers (embeddings, final norm; not the output head: the
        statistics end at the last MoE layer) and the rotary buffers."""
        keys = [k for k in self.files if layer_of(k) is None and not (self.head and k.startswith(self.head))]
        self._load(keys, device, "embeddings", "")
        left = [n for n, t in self.decoder.named_parameters() if t.is_meta and not n.startswith("layers.")]
        if left:
            raise ValueError(f"the checkpoint has no tensors for {', '.join(left[:5])}")

    def free_outside(self) -> None:
        for name, mod in self.decoder.named_children():
            if name != "layers":
                mod.to("meta")

    def load_layer(self, layer: int, device: torch.device) -> nn.Module:
        """Decoder layer `layer` with its tensors from the shards on `device` (every other layer on meta)."""
        keys = [k for k in self.files if layer_of(k) == layer]
        if not keys:
            raise ValueError(f"the checkpoint has no tensors of decoder layer {layer}")
        self._load(keys, device, f"layer {layer}", self.layer_prefix(layer))
        module = self.decoder.layers[layer]
        left = [n for n, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta]
        if left:
            raise ValueError(f"layer {layer}: the checkpoint has no tensors for {', '.join(left[:5])}")
        return module

    def free_layer(self, layer: int) -> None:
        self.decoder.layers[layer].to("meta")


# ---- the arguments the model's forward gives each layer ----------------------------------------------
class _Recorded(Exception):
    """Raised by the recorder of the last layer wanted: the rest of the forward is not run."""


@dataclass
class LayerCalls:
    """One batch: the hidden states entering layer 0 and, per layer, the (args, kwargs) the model's
    forward passes besides the hidden states (masks, position embeddings, position ids, ...)."""

    hidden: torch.Tensor
    calls: list[tuple[tuple, dict[str, Any]]]


def record_layer_calls(
    decoder: nn.Module, ids: torch.Tensor, mask: torch.Tensor, last: int, adapter: Any = None
) -> LayerCalls:
    """Run the decoder's forward with the forward of layers 0..last replaced by recorders (identity on
    the hidden states, returned as adapter.recorded_layer_output wraps them); the layers' weights are never
    touched, so they may be on the meta device."""
    layers = decoder.layers
    got: dict[str, Any] = {"calls": []}

    def recorder(i: int) -> Callable:
        def forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            got.setdefault("hidden", hidden_states)
            got["calls"].append((args, kwargs))
            if i == last:
                raise _Recorded
            return hidden_states if adapter is None else adapter.recorded_layer_output(hidden_states)

        return forward

    try:
        for i in range(last + 1):
            layers[i].forward = recorder(i)
        with torch.no_grad():
            decoder(input_ids=ids, attention_mask=mask, use_cache=False)
    except _Recorded:
        pass
    finally:
        for i in range(last + 1):
            layers[i].__dict__.pop("forward", None)
    if len(got["calls"]) != last + 1:
        raise ValueError(f"the decoder's forward called {len(got['calls'])} layers, expected {last + 1}")
    return LayerCalls(hidden=got["hidden"], calls=got["calls"])


def move(obj: Any, device: torch.device | str, memo: dict[int, Any] | None = None) -> Any:
    """`obj` (tensors in tuples, lists, dicts) on `device`; a tensor shared by several layers' calls
    (one mask, one pair of position embeddings) is moved once and stays shared (`memo`)."""
    memo = {} if memo is None else memo
    if isinstance(obj, torch.Tensor):
        if id(obj) not in memo:
            memo[id(obj)] = obj.to(device)
        return memo[id(obj)]
    if isinstance(obj, tuple | list):
        return type(obj)(move(o, device, memo) for o in obj)
    if isinstance(obj, dict):
        return {k: move(v, device, memo) for k, v in obj.items()}
    return obj


# ---- the streamed pass --------------------------------------------------------------------------------
def streamed_stats(
    teacher: StreamedTeacher,
    adapter,
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    chunk_tokens: int,
    progress: Callable[[int, int], None] | None = None,
    sample_tokens: int = 0,
    sample_seed: int = 0,
    offload: bool = False,
) -> dict[int, LayerStats]:
    """workers.calibration.calibrate.collect_stats of the teacher in `teacher`'s checkpoint, read one decoder layer at
    a time onto the batches' device. `offload`: the carried hidden states (and each batch's masks and
    position embeddings) wait on the CPU between layers. Statistics come back on the CPU, layer by layer.
    `progress(layers done, layers to run)`."""
    check_batches(batches, chunk_tokens)
    moe = adapter.moe_layers(teacher.model)
    if not moe:
        raise ValueError("adapter.moe_layers(model) is empty: the model has no MoE layer to calibrate")
    device = batches[0][0].device
    store = torch.device("cpu") if offload else device
    last = max(moe)
    offsets, shared = sample_plan(batches, sample_tokens, sample_seed) if sample_tokens > 0 else ({}, {})
    hidden: list[torch.Tensor] = []
    calls: list[list[tuple[tuple, dict[str, Any]]]] = []
    try:
        teacher.load_outside(device)
        for ids, mask in batches:
            rec = record_layer_calls(teacher.decoder, ids, mask, last, adapter)
            hidden.append(rec.hidden.to(store))
            calls.append(move(rec.calls, store))
    finally:
        teacher.free_outside()
    out: dict[int, LayerStats] = {}
    carried: list[dict[str, Any]] = [{} for _ in batches]  # what each batch's last layer passes to the next
    for i in range(last + 1):
        try:
            layer = teacher.load_layer(i, device)
            out.update(
                _run_layer(
                    teacher,
                    adapter,
                    i,
                    layer,
                    batches,
                    calls,
                    hidden,
                    offsets,
                    shared,
                    chunk_tokens,
                    store,
                    carried,
                )
            )
        finally:
            teacher.free_layer(i)
        if progress is not None:
            progress(i + 1, last + 1)
    return out


def _run_layer(
    teacher: StreamedTeacher,
    adapter,
    i: int,
    layer: nn.Module,
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    calls: list[list[tuple[tuple, dict]]],
    hidden: list[torch.Tensor],
    offsets: dict[int, torch.Tensor],
    shared: dict[str, torch.Tensor],
    chunk_tokens: int,
    store: torch.device,
    carried: list[dict[str, Any]],
) -> dict[int, LayerStats]:
    """Every batch's hidden states through decoder layer i (replaced in `hidden`, and what the layer passes
    to the next one in `carried`); its statistics, on the CPU, when it is an MoE layer."""
    is_moe = i in adapter.moe_layers(teacher.model)
    acc = LayerAccumulator(adapter.expert_weights(teacher.model, i), chunk_tokens) if is_moe else None
    current: dict[str, torch.Tensor] = {}
    samples: list[tuple[torch.Tensor, torch.Tensor]] = []
    handles = []
    gate_sums: dict[int, torch.Tensor] = {}
    if acc is not None:
        handles += adapter.hook_routing(teacher.model, i, router_hook(acc, current, samples))
        gate = adapter.shared_gate(teacher.model, i)
        if gate is not None:
            handles.append(gate.register_forward_hook(gate_hook(adapter, gate_sums, i, current)))
    try:
        with torch.no_grad():
            for b, ((_, mask), c) in enumerate(zip(batches, calls, strict=True)):
                current["mask"] = mask.reshape(-1).bool()
                current["rows"] = offsets.get(b)
                args, kwargs = move(c[i], layer_device(layer))
                kwargs = {**kwargs, **move(carried[b], layer_device(layer))}
                h, carried[b] = adapter.layer_output(
                    layer(hidden[b].to(layer_device(layer)), *args, **kwargs)
                )
                hidden[b], carried[b] = h.to(store), move(carried[b], store)
    finally:
        for handle in handles:
            handle.remove()
    if acc is None:
        return {}
    return stats_to(attach_gate_sums({i: attach_sample(acc.finish(), samples, shared)}, gate_sums), "cpu")


def walk_layers(
    teacher: StreamedTeacher,
    adapter,
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    watch: Callable[[int], list[Any]],
    current: dict[str, Any],
    progress: Callable[[int, int], None] | None = None,
    offload: bool = False,
) -> None:
    """Every batch's hidden states through the teacher's decoder layers 0..its last MoE layer, one layer read
    onto the batches' device at a time, as streamed_stats walks them (its statistics keep that walk's own
    code, so no calibration's key moves). Before layer i runs, `watch(i)` hooks what it observes (the hooks
    it returns are removed after the layer); before each batch, current["mask"] is that batch's flat mask.
    `offload` and `progress` as in streamed_stats."""
    moe = adapter.moe_layers(teacher.model)
    if not moe:
        raise ValueError("adapter.moe_layers(model) is empty: the model has no MoE layer")
    device = batches[0][0].device
    store = torch.device("cpu") if offload else device
    last = max(moe)
    hidden: list[torch.Tensor] = []
    calls: list[list[tuple[tuple, dict[str, Any]]]] = []
    try:
        teacher.load_outside(device)
        for ids, mask in batches:
            rec = record_layer_calls(teacher.decoder, ids, mask, last, adapter)
            hidden.append(rec.hidden.to(store))
            calls.append(move(rec.calls, store))
    finally:
        teacher.free_outside()
    carried: list[dict[str, Any]] = [{} for _ in batches]  # what each batch's last layer passes to the next
    for i in range(last + 1):
        handles: list[Any] = []
        try:
            layer = teacher.load_layer(i, device)
            on = layer_device(layer)
            handles = watch(i)
            with torch.no_grad():
                for b, ((_, mask), c) in enumerate(zip(batches, calls, strict=True)):
                    current["mask"] = mask.reshape(-1).bool()
                    args, kwargs = move(c[i], on)
                    kwargs = {**kwargs, **move(carried[b], on)}
                    h, carried[b] = adapter.layer_output(layer(hidden[b].to(on), *args, **kwargs))
                    hidden[b], carried[b] = h.to(store), move(carried[b], store)
        finally:
            for handle in handles:
                handle.remove()
            teacher.free_layer(i)
        if progress is not None:
            progress(i + 1, last + 1)


def layer_device(layer: nn.Module) -> torch.device:
    return next(layer.parameters()).device


# ---- conversion: one layer's context at a time --------------------------------------------------------
class StreamedContexts(Mapping):
    """{MoE layer: LayerContext} of a streamed teacher, each read from the shards when it is asked for:
    the layer is read onto `device`, its experts and router weight kept (views of what was read) and the
    rest of the layer freed. Nothing is kept between look-ups, so a caller going through the layers in
    order holds one layer's experts at a time (and reads the shards again on every look-up)."""

    def __init__(
        self,
        teacher: StreamedTeacher,
        adapter,
        stats: dict[int, LayerStats],
        device: torch.device | str = "cpu",
    ):
        moe = adapter.moe_layers(teacher.model)
        extra = sorted(set(stats) - set(moe))
        if extra:
            raise ValueError(f"stats: layers {extra} are not MoE layers; MoE layers are {moe}")
        self.teacher, self.adapter, self.stats, self.device = teacher, adapter, stats, torch.device(device)
        self.layers = [layer for layer in moe if layer in stats]
        self.top_k, self.renormalized = adapter.top_k(teacher.model), adapter.renormalized(teacher.model)

    def __getitem__(self, layer: int) -> LayerContext:
        if layer not in self.layers:
            raise KeyError(layer)
        try:
            self.teacher.load_layer(layer, self.device)
            experts = self.adapter.expert_weights(self.teacher.model, layer)
            router = self.adapter.router_weight(self.teacher.model, layer)
        finally:
            self.teacher.free_layer(layer)  # the views above keep the experts' and router's storage alone
        if self.stats[layer].num_experts != experts.num_experts:
            raise ValueError(
                f"stats[{layer}]: {self.stats[layer].num_experts} experts, the model has "
                f"{experts.num_experts}"
            )
        return LayerContext(
            stats=self.stats[layer],
            experts=experts,
            router_weight=router,
            top_k=self.top_k,
            renormalized=self.renormalized,
        )

    def __iter__(self) -> Iterator[int]:
        return iter(self.layers)

    def __len__(self) -> int:
        return len(self.layers)


# ---- what it needs ----------------------------------------------------------------------------------
def layer_parameters(config: Any) -> tuple[int, int]:
    """(parameters of the largest decoder layer, parameters of the input embeddings) of a model config,
    counted on a meta-device skeleton (no memory, exact for any family)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    layers = decoder_of(model).layers
    biggest = max(sum(p.numel() for p in layer.parameters()) for layer in layers)
    return biggest, model.get_input_embeddings().weight.numel()


def memory_needed(
    layer_params: int,
    embed_params: int,
    hidden: int,
    experts: int,
    intermediate: int,
    top_k: int,
    n_tokens: int,
    batch_tokens: int,
    chunk_tokens: int,
    dtype_bytes: int = 2,
    offload: bool = False,
) -> dict[str, int]:
    """Device bytes of a streamed calibration, by term, and `total` (the larger of its two phases).

    Embedding phase: the input embeddings and the embedded hidden states. Layer phase: one decoder layer's
    weights; the carried hidden states of all `n_tokens` calibration tokens (with `offload`, only the
    running batch's input and output); the all-experts pass of LayerAccumulator on one chunk (gate and up
    [E, chunk, 2I], the outputs [E, chunk, H] and their top_k routed rows [top_k, chunk, H]); the float64
    sums (two [E, E] Grams, [E, I] activations, [E, H] outputs, [H, H]).
    Not counted: the layer's own forward on one batch (attention, router, routed experts: a few
    [batch_tokens, H]-sized tensors for SDPA attention), each batch's mask and position embeddings (kept for
    the whole pass: no mask for SDPA on unpadded windows, [B, 1, S, S] per batch for eager attention)."""
    carried = (2 * batch_tokens if offload else n_tokens + batch_tokens) * hidden * dtype_bytes
    terms = {
        "embeddings": embed_params * dtype_bytes,
        "layer_weights": layer_params * dtype_bytes,
        "hidden_states": carried,
        "expert_chunk": chunk_tokens * (experts * (2 * intermediate + hidden) + top_k * hidden) * dtype_bytes,
        "stats_float64": 8 * (2 * experts * experts + experts * (intermediate + hidden) + hidden * hidden),
    }
    embedding_phase = terms["embeddings"] + (2 * batch_tokens if offload else n_tokens) * hidden * dtype_bytes
    layer_phase = sum(v for k, v in terms.items() if k != "embeddings")
    return {**terms, "total": max(embedding_phase, layer_phase)}
