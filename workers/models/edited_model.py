"""Edited MoE checkpoints (workers.methods.editing): the teacher's architecture with every MoE block's routed experts
stored as factors, a real transformers model that saves and reloads offline.

Layout. For a family `<model_type>` (every family whose adapter declares its `edited` classes: FAMILIES) the edited
checkpoint has config model_type `<model_type>_edited` (a subclass of the family's config with one extra field, `moesweep_editing`) and architecture `<Family>EditedForCausalLM` (a subclass
of the family's CausalLM). `moesweep_editing = {"method", "layers": {"<layer>": {"<proj>": {"kind",
"shapes", ...}}}}` lists, per MoE layer and projection (gate, up, down), the factor kind (mobe, tucker,
dense) and the shape of each factor. The experts module `model.layers.<l>.mlp.experts` (Granite:
`block_sparse_moe.experts`) is a subclass of the family's experts class holding, instead of the fused
`gate_up_proj` / `down_proj` parameters, one submodule per projection with the factors (`experts.gate.A`, `experts.gate.bases`, `experts.gate.coef`,
`experts.up.U`, `experts.up.core`, `experts.up.V`, `experts.down.weight`, GPT-OSS: `experts.<proj>.bias`),
so the safetensors hold the factors and their size is the edited model's size. `gate_up_proj`,
`down_proj` (and GPT-OSS's biases) are read-only properties that rebuild the family's fused layout from the
factors. The forward (FactoredExpertsMixin's forward modes) applies the factors to the routed tokens, for the
experts that receive tokens only, with the routing, gate and combination of the family's grouped experts
forward: it computes what the teacher's experts module computes with the rebuilt weights (up to rounding)
without forming them (the `rebuild` mode runs the family's own forward on weights rebuilt per call, the
`cache` mode on rebuilt weights kept while the factors do not change). Router, shared experts, attention,
norms and dense layers are the teacher's, unchanged, and the family adapter (`workers.families.get_adapter`)
works on the model as it is.

Loading: `import workers.models.edited_model` registers the config and model classes with transformers'
AutoConfig / AutoModelForCausalLM (and, importing workers.models.merged_model, those of merged MoEs with
summed gates); then `AutoModelForCausalLM.from_pretrained(dir)` loads an edited (or merged) checkpoint
(offline; `workers.run.runtime.load_model` and the DDP worker import this module first).
"""

from __future__ import annotations

import copy
import inspect
import sys
from collections.abc import Sequence
from functools import cache
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from workers.core.types import LayerPlan
from workers.families.fused import fill_from_teacher
from workers.methods.editing import (
    PROJECTIONS,
    ExpertGroups,
    Step,
    factor_steps,
    reconstruct,
    routed_apply,
    split_shared_tail,
)

SUFFIX = "_edited"


def _families() -> dict[str, tuple[str, str, str]]:
    """adapter name -> (transformers config class, CausalLM class, experts layout), from each family adapter's
    own `edited` (workers.families.base.edited_classes): the families that can write an edited MoE."""
    from workers.families import ADAPTERS
    from workers.families.base import edited_classes

    return {a.name: classes for a in ADAPTERS if (classes := edited_classes(a)) is not None}


FAMILIES = _families()


FORWARD_MODES = ("direct", "cache", "rebuild")


class FactoredProjection(nn.Module):
    """One projection's experts as factors (parameters named as workers.methods.editing stores them)."""

    def __init__(self, spec: dict[str, Any]):
        super().__init__()
        self.spec = {k: v for k, v in spec.items() if k != "shapes"}
        for name, shape in spec["shapes"].items():
            setattr(self, name, nn.Parameter(torch.empty(*shape)))

    def factors(self) -> dict[str, torch.Tensor]:
        return {n: p for n, p in self.named_parameters(recurse=False) if n != "bias"}

    def weights(self) -> torch.Tensor:
        """[E, out, in] rebuilt from the factors."""
        return reconstruct(self.spec, self.factors())

    def steps(self) -> list[Step]:
        """The factors as a chain of linear steps, for routed rows (workers.methods.editing.factor_steps)."""
        return factor_steps(self.spec, self.factors())


class _WeightCache:
    """The rebuilt weights of the `cache` forward mode and what they were rebuilt from: the factor tensors
    (detached views, which share the parameters' version counters and keep their storage, so a pointer
    cannot be reused by other data while the entry lives) and their versions. Copies and pickles empty."""

    def __init__(self) -> None:
        self.sources: list[torch.Tensor] = []
        self.versions: list[int] = []
        self.weights: dict[str, torch.Tensor] | None = None

    def valid_for(self, params: list[torch.Tensor]) -> bool:
        return (
            self.weights is not None
            and len(params) == len(self.sources)
            and all(
                p.data_ptr() == s.data_ptr()
                and p.shape == s.shape
                and p.dtype == s.dtype
                and p.device == s.device
                and p._version == v
                for p, s, v in zip(params, self.sources, self.versions, strict=True)
            )
        )

    def store(self, params: list[torch.Tensor], weights: dict[str, torch.Tensor]) -> None:
        self.sources = [p.detach() for p in params]
        self.versions = [p._version for p in params]
        self.weights = weights

    def clear(self) -> None:
        self.__init__()

    def __deepcopy__(self, memo: dict) -> _WeightCache:
        return _WeightCache()

    def __reduce__(self) -> tuple:
        return (_WeightCache, ())


@cache
def _routing_parameters(cls: type) -> tuple[str, str, str]:
    """The names of the family experts forward's (hidden states, expert indices, routing weights) parameters
    (GPT-OSS: router_indices, routing_weights; the others: top_k_index, top_k_weights)."""
    names = list(inspect.signature(inspect.unwrap(cls.forward)).parameters)[1:4]
    if len(names) != 3:
        raise ValueError(f"{cls.__name__}.forward takes {names}: not (hidden states, indices, weights)")
    return names[0], names[1], names[2]


def _family_experts_class(cls: type) -> type:
    """The family's experts class a factored class subclasses (the class after the mixin)."""
    mro = cls.__mro__
    return mro[mro.index(FactoredExpertsMixin) + 1]


class FactoredExpertsMixin:
    """Put before the family's experts class: factors instead of fused weights.

    Forward modes (`forward_mode`, set with set_forward_mode):
    - `direct` (default): the factors are applied to the routed tokens, only for the experts that receive
      tokens (workers.methods.editing.routed_apply): no expert's full weights are formed, no memory beyond
      the factors, and gradients reach the factors. The routing, gate and combination are the family's
      grouped experts forward's (transformers' batched_mm / grouped_mm: the family's `_apply_gate`, biases,
      the weighted sum over a token's experts), which every experts implementation computes alike.
    - `cache`: without factor gradients (no_grad, or factors frozen as Router KD has them) the rebuilt
      weights are kept and the family's own experts forward runs on them; they are rebuilt when any factor
      parameter changes: another tensor (a move to another device or dtype, an assignment) or a new version
      (optimizer steps, load_state_dict, in-place copies; a write through `.data` is not seen: call
      clear_weight_cache then). Costs the full experts' memory (the teacher's, for the gate/up it rebuilds;
      a dense projection is not copied); with factor gradients it runs `direct`.
    - `rebuild`: every forward rebuilds every expert's weights and runs the family's forward (the reference).
    """

    layout: str = "fused"
    forward_mode: str = "direct"

    def _setup(self, template: nn.Module, layer_spec: dict[str, Any]) -> None:
        """Copy the template's non-tensor attributes (config, sizes, activation module, implementation flags)
        and add one FactoredProjection per projection."""
        nn.Module.__init__(self)
        module_internals = set(vars(self))
        for key, value in vars(template).items():
            if key not in module_internals:
                object.__setattr__(self, key, value)
        for name, mod in template.named_children():
            if any(True for _ in mod.parameters()):
                raise ValueError(f"experts submodule {name} has parameters: not supported by editing")
            self.add_module(name, mod)
        for p in PROJECTIONS:
            self.add_module(p, FactoredProjection(layer_spec[p]))
        object.__setattr__(self, "_rebuilt", None)

    def _factor_parameters(self) -> list[torch.Tensor]:
        return [t for p in PROJECTIONS for t in getattr(self, p).factors().values()]

    def _needs_factor_grads(self) -> bool:
        return torch.is_grad_enabled() and any(t.requires_grad for t in self._factor_parameters())

    def _rebuild(self) -> dict[str, torch.Tensor]:
        """The family's `gate_up_proj` and `down_proj` rebuilt from the factors."""
        w = {p: getattr(self, p).weights() for p in PROJECTIONS}
        if self.layout == "gptoss":  # [E, H, 2I], gate = columns 0::2, up = 1::2; down [E, I, H]
            e, i, h = w["gate"].shape
            gate_up = torch.stack([w["gate"].transpose(1, 2), w["up"].transpose(1, 2)], dim=-1)
            return {"gate_up_proj": gate_up.reshape(e, h, 2 * i), "down_proj": w["down"].transpose(1, 2)}
        # [E, 2I, H], gate rows first; down [E, H, I]
        return {"gate_up_proj": torch.cat([w["gate"], w["up"]], dim=1), "down_proj": w["down"]}

    def _weight_cache(self) -> _WeightCache:
        found = vars(self).get("_cache")
        if found is None:
            found = _WeightCache()
            object.__setattr__(self, "_cache", found)
        return found

    def _cached(self) -> dict[str, torch.Tensor]:
        """The rebuilt weights, rebuilt only when a factor parameter changed (callers need no factor grads)."""
        entry, params = self._weight_cache(), self._factor_parameters()
        if not entry.valid_for(params):
            entry.clear()  # frees the stale weights before the new ones are made
            with torch.no_grad():
                entry.store(params, self._rebuild())
        return entry.weights

    def _fused(self) -> dict[str, torch.Tensor]:
        """The weights the family's forward reads: made once per forward (`_rebuilt`), else cached or rebuilt."""
        if self._rebuilt is not None:
            return self._rebuilt
        if self.forward_mode == "cache" and not self._needs_factor_grads():
            return self._cached()
        return self._rebuild()

    def _direct_supported(self) -> bool:
        """The direct forward covers gated experts without a post-expert norm or expert parallelism (every
        family editing supports); anything else runs the family's forward on rebuilt weights."""
        return (
            getattr(self, "has_gate", False)
            and not getattr(self, "has_post_expert_norm", False)
            and not getattr(self, "_is_expert_parallel", False)
            and hasattr(self, "_apply_gate")
        )

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        mode = self.forward_mode
        if mode not in FORWARD_MODES:
            raise ValueError(f"forward_mode={mode!r}; allowed: {', '.join(FORWARD_MODES)}")
        cached = mode == "cache" and not self._needs_factor_grads()
        if mode != "rebuild" and not cached and self._direct_supported():
            names = _routing_parameters(_family_experts_class(type(self)))
            routing = {**dict(zip(names, args, strict=False)), **kwargs}
            if len(args) <= 3 and sorted(routing) == sorted(names):
                return self._direct_forward(*(routing[n] for n in names))
        object.__setattr__(self, "_rebuilt", self._cached() if cached else self._rebuild())
        try:
            return super().forward(*args, **kwargs)
        finally:
            object.__setattr__(self, "_rebuilt", None)

    def _direct_forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """transformers' grouped experts forward (pairs sorted by expert, gate, `_apply_gate`, down, routing
        weights, the sum over each token's k experts) with each projection applied from its factors."""
        num_tokens, k = top_k_index.shape
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        sorted_ids = flat[order]
        groups = ExpertGroups(sorted_ids, self.num_experts)
        rows = torch.div(order, k, rounding_mode="floor")
        gate = routed_apply(self.gate.steps(), hidden_states, groups, rows)
        up = routed_apply(self.up.steps(), hidden_states, groups, rows)
        biased = getattr(self, "has_bias", False)
        if biased:
            gate, up = gate + self.gate.bias[sorted_ids], up + self.up.bias[sorted_ids]
        if self.layout == "gptoss":  # gate and up columns interleaved
            gate_up = torch.stack([gate, up], dim=-1).reshape(gate.shape[0], -1)
        else:
            gate_up = torch.cat([gate, up], dim=-1)
        body, tail = split_shared_tail(self.down.steps())
        out = routed_apply(body, self._apply_gate(gate_up), groups)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        out = (out[inverse].view(num_tokens, k, -1) * top_k_weights.unsqueeze(-1)).sum(dim=1)
        for step in tail:  # the shared output factor once per token, after the weighted sum
            out = out @ step.shared.T.to(out.dtype)
        if biased:
            out = out + (top_k_weights.unsqueeze(-1) * self.down.bias[top_k_index]).sum(dim=1)
        return out.to(hidden_states.dtype)

    @property
    def gate_up_proj(self) -> torch.Tensor:
        return self._fused()["gate_up_proj"]

    @property
    def down_proj(self) -> torch.Tensor:
        return self._fused()["down_proj"]

    @property
    def gate_up_proj_bias(self) -> torch.Tensor:
        g, u = self.gate.bias, self.up.bias
        return torch.stack([g, u], dim=-1).reshape(g.shape[0], 2 * g.shape[1])

    @property
    def down_proj_bias(self) -> torch.Tensor:
        return self.down.bias


def set_forward_mode(model: nn.Module, mode: str) -> int:
    """Set every factored experts module's forward mode (FactoredExpertsMixin: direct, cache, rebuild);
    returns how many were set. Leaving `cache` drops the cached weights."""
    if mode not in FORWARD_MODES:
        raise ValueError(f"mode={mode!r}; allowed: {', '.join(FORWARD_MODES)}")
    found = [m for m in model.modules() if isinstance(m, FactoredExpertsMixin)]
    for m in found:
        object.__setattr__(m, "forward_mode", mode)
        if mode != "cache":
            m._weight_cache().clear()
    return len(found)


def clear_weight_cache(model: nn.Module) -> None:
    """Drop every cached rebuilt weight (after writing factors through `.data`, which the cache cannot see)."""
    for m in model.modules():
        if isinstance(m, FactoredExpertsMixin):
            m._weight_cache().clear()


def _transformers_class(name: str) -> type:
    import transformers

    return getattr(transformers, name)


def _family_of(model_type: str) -> str:
    family = model_type.removesuffix(SUFFIX)
    if family not in FAMILIES:
        raise ValueError(f"editing supports model types {', '.join(FAMILIES)}; got {model_type!r}")
    return family


def _block_attr(family: str) -> str:
    """The decoder-layer attribute of the family's MoE block, as its adapter states it (`mlp`; Granite:
    `block_sparse_moe`)."""
    from workers.families import ADAPTERS

    return next(getattr(a, "block_attr", "mlp") for a in ADAPTERS if a.name == family)


def _experts_class(base: type, layout: str) -> type:
    """The factored subclass of a family's experts class (a module attribute, so it pickles)."""
    name = f"Factored{base.__name__}"
    if name not in globals():
        globals()[name] = type(name, (FactoredExpertsMixin, base), {"layout": layout, "__module__": __name__})
    return globals()[name]


def _swap_experts(model: nn.Module) -> None:
    """Replace the experts module of every edited layer by its factored twin (factor shapes from the config)."""
    family = _family_of(model.config.model_type)
    layout, block_attr = FAMILIES[family][2], _block_attr(family)
    for key, spec in model.config.moesweep_editing["layers"].items():
        mlp = getattr(model.model.layers[int(key)], block_attr)
        template = getattr(mlp, "experts", None)
        if template is None:
            raise ValueError(f"edited layer {key} has no experts module in {type(model).__name__}")
        if isinstance(template, FactoredExpertsMixin):
            continue
        cls = _experts_class(type(template), layout)
        factored = cls.__new__(cls)
        factored._setup(template, spec)
        mlp.experts = factored


_CLASSES: dict[str, tuple[type, type]] = {}


def _family_classes(family: str) -> tuple[type, type]:
    """(edited config class, edited CausalLM class) of a family, made once. The CausalLM swaps the experts
    modules for factored ones just before the family's post_init (which gathers tied keys and plans)."""
    if family not in _CLASSES:
        cfg_name, lm_name, _ = FAMILIES[family]
        base_cfg, base_lm = _transformers_class(cfg_name), _transformers_class(lm_name)
        stem = lm_name.removesuffix("ForCausalLM")
        cfg_cls = type(
            f"{stem}EditedConfig",
            (base_cfg,),
            {"model_type": base_cfg.model_type + SUFFIX, "__module__": __name__},
        )

        def post_init(self: nn.Module, _base: type = base_lm) -> None:
            _swap_experts(self)
            _base.post_init(self)

        # transformers decides whether a class may switch experts implementations (eager, batched_mm,
        # grouped_mm) by looking for the experts decorator in the class's module source: the factored
        # experts subclass the family's decorated class, so they may.
        lm_cls = type(
            f"{stem}EditedForCausalLM",
            (base_lm,),
            {
                "config_class": cfg_cls,
                "post_init": post_init,
                "__module__": __name__,
                "_can_set_experts_implementation_cached_value": True,
            },
        )
        # made now, not when first needed, so that a pickled edited model unpickles in a fresh process
        _experts_class(getattr(sys.modules[base_lm.__module__], f"{stem}Experts"), FAMILIES[family][2])
        globals()[cfg_cls.__name__], globals()[lm_cls.__name__] = cfg_cls, lm_cls
        _CLASSES[family] = (cfg_cls, lm_cls)
    return _CLASSES[family]


def register() -> None:
    """Register every family's edited config and CausalLM with AutoConfig / AutoModelForCausalLM."""
    for family in FAMILIES:
        cfg_cls, lm_cls = _family_classes(family)
        try:
            AutoConfig.register(cfg_cls.model_type, cfg_cls)
            AutoModelForCausalLM.register(cfg_cls, lm_cls)
        except ValueError:  # already registered (module reloaded)
            pass


register()


# ---- builder ------------------------------------------------------------------------------------------
def _layer_spec(plan: LayerPlan, factors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The config entry of one layer: per projection its kind, settings and factor shapes."""
    student = plan.extras.get("student")
    if not student or "projections" not in student:
        raise ValueError(
            f"layer {plan.layer}: the plan has no extras['student'] from workers.methods.editing.edit_layer"
        )
    out: dict[str, Any] = {}
    for p in PROJECTIONS:
        pre = f"layer.{plan.layer}.{p}."
        shapes = {k[len(pre) :]: list(t.shape) for k, t in factors.items() if k.startswith(pre)}
        if not shapes:
            raise ValueError(f"factors lack layer.{plan.layer}.{p}.* tensors")
        out[p] = {**student["projections"][p], "shapes": shapes}
    return out


def edited_config(
    model: nn.Module, family: str, plans: Sequence[LayerPlan], factors: dict[str, torch.Tensor]
) -> Any:
    """The teacher's config as the family's edited config, with `moesweep_editing` describing the factors."""
    cfg_cls = _family_classes(family)[0]
    methods = sorted({p.extras["student"]["method"] for p in plans})
    editing = {
        "method": methods[0] if len(methods) == 1 else methods,
        "layers": {str(p.layer): _layer_spec(p, factors) for p in plans},
    }
    src = {
        k: v
        for k, v in model.config.to_dict().items()
        if k not in ("model_type", "architectures", "transformers_version", "moesweep_editing")
    }
    cfg = cfg_cls(**src, moesweep_editing=editing)
    cfg._attn_implementation = model.config._attn_implementation
    cfg._experts_implementation = getattr(model.config, "_experts_implementation", None)
    return cfg


def edited_moe_student(
    model: nn.Module, adapter: Any, plans: Sequence[LayerPlan], factors: dict[str, torch.Tensor]
) -> nn.Module:
    """The edited model: the teacher's class's edited twin, every MoE layer's experts from `factors`
    (workers.methods.editing.edit_layer's tensors, cast to the teacher's dtype and device), everything else a copy
    of the teacher's tensors (tied tensors stay tied). Every MoE layer must have exactly one plan."""
    family = adapter.name
    if family not in FAMILIES:
        raise ValueError(f"editing supports {', '.join(FAMILIES)}; the model is {family}")
    layers = adapter.moe_layers(model)
    if sorted(p.layer for p in plans) != layers:
        raise ValueError(f"plans cover layers {sorted(p.layer for p in plans)}; the MoE layers are {layers}")
    cfg = edited_config(model, family, plans, factors)
    with torch.device("meta"):
        student = AutoModelForCausalLM.from_config(cfg)
    ref = next(model.parameters())
    replaced, block_attr = {}, _block_attr(family)
    for key, t in factors.items():
        _, layer, proj, name = key.split(".", 3)
        replaced[f"model.layers.{layer}.{block_attr}.experts.{proj}.{name}"] = (
            t.detach().to(ref.device, ref.dtype).clone()
        )
    fill_from_teacher(student, model, replaced, "edited model")
    if getattr(model, "generation_config", None) is not None:
        student.generation_config = copy.deepcopy(model.generation_config)
    return student.eval()


# merged MoEs with the summed-gate router are a registered class too: importing this module registers both kinds
import workers.models.merged_model  # noqa: E402, F401
