"""Merged MoE checkpoints with the summed-gate router (workers.methods.moe_merging, `router_rows: summed`):
the teacher's architecture with all E router rows and every routed expert, where each member of a cluster
computes the cluster's merged expert, stored once.

Why. HC-SMoE and M-SMoE merge a cluster C of experts into one expert f_C and "sum the gates" of its members
(the REAP paper's Eq. 3): the router is left as it is, so a token t whose top-k S(t) holds members i ∈ C gets
Σ_{i∈C∩S(t)} g_i(t) · f_C(x). Tying every member to f_C reproduces that exactly through the family's own
forward (its top-k, renormalisation, group limits, biases and scaling factors unchanged): the experts module
computes Σ_{e∈S(t)} g_e f_e(x) with f_e = f_{C(e)}.

Layout. For a family whose config model_type is `<model_type>` the checkpoint has model_type
`<model_type>_merged` (a subclass of the family's config with one extra field, `moesweep_merging`) and
architecture `<Family>MergedForCausalLM` (a subclass of the family's CausalLM). The config keeps the teacher's
expert count E, k and routing fields; `moesweep_merging = {"router_rows": "summed", "method", "layers":
{"<experts module path>": {"tensors": [...], "clusters": [c_0, ..., c_{E-1}]}}}` names, per MoE layer, the
experts module (`model.layers.<l>.mlp.experts`; DBRX `transformer.blocks.<l>.ffn.experts`), its per-expert
tensors (relative to it: `gate_up_proj`, `down_proj`, GPT-OSS's biases, DBRX's `mlp.w1` …) and the cluster
of each expert (clusters numbered 0..K-1 in the plan's cluster order). The module owning such a tensor holds,
instead of the [E·r, ...] parameter, a child `clusters` with a [K·r, ...] parameter of the same name (cluster
j's merged tensor once); reading the tensor's usual attribute (`experts.gate_up_proj`) gives the [E·r, ...]
expansion (row block e = cluster c_e's), rebuilt once per forward of the experts module, so the family's
experts code (any experts implementation) runs unchanged and gradients reach the stored clusters (full KD
keeps the members tied). Router, shared experts, attention, norms and dense layers are the teacher's.

Size. The parameters are the unique ones: each cluster once, the E-row router and everything else, so
`sum(p.numel() for p in model.parameters())` (the `params` metric) and the safetensors count each cluster once.

Loading: importing this module (done by `import workers.models.edited_model`, which
`workers.run.runtime.load_model` and the DDP worker import) registers every supported family's merged config and
CausalLM with AutoConfig / AutoModelForCausalLM; then `AutoModelForCausalLM.from_pretrained(dir)` loads a
merged checkpoint offline. The family adapter (`workers.families.get_adapter`) works on the model as it is.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from workers.core.types import MergedLayer
from workers.families.fused import fill_from_teacher

SUFFIX = "_merged"
FIELD = "moesweep_merging"
STORE = "clusters"  # the child module holding each tied tensor's K cluster rows


# ---- modules whose per-expert tensors are tied by cluster ----------------------------------------------------
class ClusterTiedMixin:
    """Put before a module class: its per-expert parameters named in `_tied_names` are stored once per cluster
    (`self.clusters.<name>`, [K·r, ...]) and read as the [E·r, ...] expansion by `_cluster_of` (expert → cluster).
    Its forward rebuilds each expansion once for every tied module below it (itself included) and frees them
    after, so the wrapped class's forward, however often it reads a tensor, sees one expansion per call."""

    _cluster_base: type = nn.Module  # the class this one subclasses (what pickling rebuilds it from)

    def _tie(self, names: Sequence[str], clusters: Sequence[int]) -> None:
        cluster_of = tuple(int(c) for c in clusters)
        E, K = len(cluster_of), max(cluster_of) + 1
        if sorted(set(cluster_of)) != list(range(K)):
            raise ValueError(f"clusters {list(cluster_of)}: every cluster 0..{K - 1} needs a member")
        if names:
            if STORE in self._modules:
                raise ValueError(f"{type(self).__name__} already has a child named {STORE!r}")
            store = nn.Module()
            for name in names:
                p = self._parameters.get(name)
                if p is None:
                    raise ValueError(f"{type(self).__name__}.{name}: not a parameter to tie by cluster")
                if p.dim() == 0 or p.shape[0] % E:
                    raise ValueError(
                        f"{type(self).__name__}.{name}: shape {tuple(p.shape)} has no leading axis of E={E} "
                        "experts (or E blocks of rows)"
                    )
                rows = p.shape[0] // E * K
                stored = torch.empty((rows, *p.shape[1:]), dtype=p.dtype, device=p.device)
                store.register_parameter(name, nn.Parameter(stored, requires_grad=p.requires_grad))
                del self._parameters[name]
            self.add_module(STORE, store)
        object.__setattr__(self, "_cluster_of", cluster_of)
        object.__setattr__(self, "_tied_names", tuple(names))
        object.__setattr__(self, "_expanded", None)
        object.__setattr__(self, "_cluster_index", {})

    def _expand(self, name: str) -> torch.Tensor:
        stored = self._modules[STORE]._parameters[name]
        index = self.__dict__["_cluster_index"]
        if stored.device not in index:
            index[stored.device] = torch.tensor(self._cluster_of, dtype=torch.long, device=stored.device)
        K = max(self._cluster_of) + 1
        return stored.unflatten(0, (K, -1)).index_select(0, index[stored.device]).flatten(0, 1)

    def __getattr__(self, name: str) -> Any:
        d = self.__dict__
        if name in d.get("_tied_names", ()):
            cache = d.get("_expanded")
            if cache is None:
                return self._expand(name)
            if name not in cache:
                cache[name] = self._expand(name)
            return cache[name]
        return super().__getattr__(name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        opened = [
            m for m in self.modules() if isinstance(m, ClusterTiedMixin) and m.__dict__["_expanded"] is None
        ]
        for m in opened:
            object.__setattr__(m, "_expanded", {})
        try:
            return super().forward(*args, **kwargs)
        finally:
            for m in opened:
                object.__setattr__(m, "_expanded", None)

    def __reduce_ex__(self, protocol: Any) -> Any:
        state = {**self.__dict__, "_expanded": None, "_cluster_index": {}}
        return (_new_tied, (self._cluster_base,), state)


_TIED: dict[type, type] = {}


def tied_class(base: type) -> type:
    """The ClusterTiedMixin subclass of a module class (made once, a module attribute)."""
    if issubclass(base, ClusterTiedMixin):
        return base
    if base not in _TIED:
        name = f"ClusterTied{base.__name__}"
        _TIED[base] = type(name, (ClusterTiedMixin, base), {"_cluster_base": base, "__module__": __name__})
        globals().setdefault(name, _TIED[base])
    return _TIED[base]


def _new_tied(base: type) -> nn.Module:
    """An empty instance of tied_class(base) (unpickling and deep copies fill its state)."""
    cls = tied_class(base)
    return cls.__new__(cls)


def tie_module(module: nn.Module, names: Sequence[str], clusters: Sequence[int]) -> None:
    """Make `module` (in place) store its parameters `names` once per cluster (ClusterTiedMixin)."""
    if isinstance(module, ClusterTiedMixin):
        raise ValueError(f"{type(module).__name__} is already tied by cluster")
    module.__class__ = tied_class(type(module))
    module._tie(names, clusters)


def _tie_all(model: nn.Module) -> None:
    """Tie the experts modules the config's `moesweep_merging` lists (called before the family's post_init)."""
    for path, spec in getattr(model.config, FIELD)["layers"].items():
        experts = model.get_submodule(path)
        if isinstance(experts, ClusterTiedMixin):  # tied already (post_init called again)
            continue
        owners: dict[str, list[str]] = {}
        for rel in spec["tensors"]:
            owner, _, leaf = rel.rpartition(".")
            owners.setdefault(owner, []).append(leaf)
        for owner, leaves in owners.items():
            tie_module(experts.get_submodule(owner) if owner else experts, leaves, spec["clusters"])
        if (
            "" not in owners
        ):  # the experts module rebuilds the expansions of its tied submodules once per call
            tie_module(experts, [], spec["clusters"])


# ---- config and CausalLM classes --------------------------------------------------------------------------
_CLASSES: dict[type, tuple[type, type]] = {}


def family_classes(base_cfg: type, base_lm: type) -> tuple[type, type]:
    """(merged config class, merged CausalLM class) of a family's config and CausalLM, made and registered
    with the Auto classes once. The CausalLM ties the experts modules just before the family's post_init."""
    if base_lm not in _CLASSES:
        stem = base_lm.__name__.removesuffix("ForCausalLM")
        cfg_cls = type(
            f"{stem}MergedConfig",
            (base_cfg,),
            {"model_type": base_cfg.model_type + SUFFIX, "__module__": __name__},
        )

        def post_init(self: nn.Module, _base: type = base_lm) -> None:
            _tie_all(self)
            _base.post_init(self)

        # transformers lets a class switch experts implementations when its module's source uses the experts
        # decorator (read from the class's module): the merged class may exactly when the family's may
        lm_cls = type(
            f"{stem}MergedForCausalLM",
            (base_lm,),
            {
                "config_class": cfg_cls,
                "post_init": post_init,
                "__module__": __name__,
                "_can_set_experts_implementation_cached_value": bool(
                    base_lm._can_set_experts_implementation()
                ),
            },
        )
        globals()[cfg_cls.__name__], globals()[lm_cls.__name__] = cfg_cls, lm_cls
        try:
            AutoConfig.register(cfg_cls.model_type, cfg_cls)
            AutoModelForCausalLM.register(cfg_cls, lm_cls)
        except ValueError:  # already registered (module reloaded)
            pass
        _CLASSES[base_lm] = (cfg_cls, lm_cls)
    return _CLASSES[base_lm]


def register() -> None:
    """Make and register the merged classes of every family adapter's model types (so a merged checkpoint
    loads in a fresh process, and a pickled merged model unpickles)."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from workers.families import ADAPTERS

    for adapter in ADAPTERS:
        for model_type in adapter.model_types:
            cfg_name = CONFIG_MAPPING_NAMES.get(model_type)
            lm_name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
            if cfg_name and lm_name and hasattr(transformers, cfg_name) and hasattr(transformers, lm_name):
                family_classes(getattr(transformers, cfg_name), getattr(transformers, lm_name))


register()


# ---- builder ----------------------------------------------------------------------------------------------
def summed_layers(
    model: nn.Module, adapter: Any, merged: Mapping[int, MergedLayer]
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The config entry `layers` and the stored cluster tensors (by parameter name) of a summed merged MoE:
    per MoE layer each per-expert tensor of its experts module (the adapter's expert tensors under `experts.`;
    the router's rows, biases and correction biases stay the teacher's) merged per cluster exactly as the
    adapter merges it (frequency weights, unit permutations)."""
    bad = sorted({m.router_rows for m in merged.values()} - {"summed"})
    if bad:
        raise ValueError(
            f"router_rows={bad[0]!r}: a summed merged MoE needs router_rows='summed' in every layer"
        )
    # the adapter's own checks (layers, clusters, weights, permutations, M >= k), on its router-row vocabulary
    merged = adapter.check_merged(
        model, {layer: replace(m, router_rows="weighted") for layer, m in merged.items()}
    )
    E = adapter.num_experts(model)
    path = {id(m): n for n, m in model.named_modules()}
    layers: dict[str, Any] = {}
    stored: dict[str, torch.Tensor] = {}
    for layer, m in sorted(merged.items()):
        covered = sorted(e for g in m.groups for e in g)
        if covered != list(range(E)):
            missing = sorted(set(range(E)) - set(covered))
            raise ValueError(
                f"merged[{layer}]: experts {missing} are in no cluster; a summed MoE keeps all {E}"
            )
        clusters = [0] * E
        for j, group in enumerate(m.groups):
            for e in group:
                clusters[e] = j
        experts = adapter.block(model, layer).experts
        prefix = path[id(experts)]
        tensors = []
        for rel in adapter.expert_tensors:
            if not rel.startswith("experts."):
                continue  # routing tensors: kept, all E rows
            if adapter.expert_axis.get(rel, 0) != 0:
                raise ValueError(
                    f"{adapter.name}: expert tensor {rel} has its expert axis elsewhere than first"
                )
            sub = rel.removeprefix("experts.")
            t = experts.get_parameter(sub).detach()
            full = t if t.shape[0] == E else t.unflatten(0, (E, -1))  # DBRX: [E·I, H] rows as [E, I, H]
            owner, _, leaf = sub.rpartition(".")
            name = ".".join(part for part in (prefix, owner, STORE, leaf) if part)
            stored[name] = adapter.merge_tensor(rel, full, m).flatten(0, full.dim() - t.dim())  # [K·r, ...]
            tensors.append(sub)
        layers[prefix] = {"tensors": tensors, "clusters": clusters}
    return layers, stored


def merged_config(model: nn.Module, layers: dict[str, Any], method: str | None) -> Any:
    """The teacher's config as the family's merged config (E experts, routing unchanged) with `moesweep_merging`."""
    cfg_cls = family_classes(type(model.config), type(model))[0]
    src = {
        k: v
        for k, v in model.config.to_dict().items()
        if k not in ("model_type", "architectures", "transformers_version", FIELD)
    }
    cfg = cfg_cls(**src, **{FIELD: {"router_rows": "summed", "method": method, "layers": layers}})
    cfg._attn_implementation = model.config._attn_implementation
    cfg._experts_implementation = getattr(model.config, "_experts_implementation", None)
    return cfg


def summed_moe_student(
    model: nn.Module, adapter: Any, merged: Mapping[int, MergedLayer], method: str | None = None
) -> nn.Module:
    """The summed merged MoE of `merged` (every layer router_rows='summed', every expert in a cluster): the
    family's merged class with E experts per layer tied by cluster, each cluster's tensors new (the adapter's
    merge), everything else a copy of the teacher's tensors (tied tensors stay tied)."""
    layers, stored = summed_layers(model, adapter, merged)
    cfg = merged_config(model, layers, method)
    with torch.device("meta"):
        student = AutoModelForCausalLM.from_config(cfg)
    fill_from_teacher(student, model, stored, "merged model")
    if getattr(model, "generation_config", None) is not None:
        student.generation_config = copy.deepcopy(model.generation_config)
    return student.eval()
