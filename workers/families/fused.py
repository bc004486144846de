"""Shared machinery for the transformers 5.x MoE blocks with fused 3-D experts.

Every supported family stores its routed experts in one `experts` module with fused parameters
(`gate_up_proj`, `down_proj`) and has a router module whose forward returns
`(router_logits [T, E], weights [T, k] applied, indices [T, k] used)`. A family subclass only states
where things live and what its router does, in class fields (the strategy fields of FusedMoeAdapter: scores,
correction_bias, renorm, scale_attr, block_scale_attr, dense_layers, shared_key, config_class,
student_dense_fields); this module does the rest (decision reading, expanded routing, student assembly).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import fields
from typing import Any

import torch
from torch import nn

from workers.core.shape import TeacherShape
from workers.core.types import DenseFFN, ExpertWeights, MergedLayer
from workers.families.base import FamilyAdapter
from workers.methods.merge import concat_blocks

_NOT_SET = object()
# Config fields never carried from the teacher's config into the student's.
_CONFIG_SKIP = {"architectures", "transformers_version", "id2label", "label2id", "problem_type"}


def copy_config(teacher_cfg: Any, cls: type, **overrides: Any) -> Any:
    """A `cls` config with every field it shares with the teacher's config, then `overrides`."""
    names = {f.name for f in fields(cls)} - _CONFIG_SKIP
    src = teacher_cfg.to_dict()
    kw = {k: v for k, v in src.items() if k in names}
    kw.update(overrides)
    cfg = cls(**kw)
    cfg._attn_implementation = teacher_cfg._attn_implementation
    return cfg


def _with_zero_biases(a: DenseFFN, b: DenseFFN) -> tuple[DenseFFN, DenseFFN]:
    """Give both FFNs the same set of biases (a missing bias becomes zeros) so they can be stacked."""
    out = []
    for x in (a, b):
        kw = {}
        for name, n in (("gate_bias", x.width), ("up_bias", x.width), ("down_bias", x.down.shape[0])):
            need = getattr(a, name) is not None or getattr(b, name) is not None
            kw[name] = getattr(x, name) if getattr(x, name) is not None or not need else x.gate.new_zeros(n)
        out.append(
            DenseFFN(
                gate=x.gate,
                up=x.up,
                down=x.down,
                act=x.act,
                act_alpha=x.act_alpha,
                act_limit=x.act_limit,
                **kw,
            )
        )
    return out[0], out[1]


def stack_ffns(a: DenseFFN, b: DenseFFN) -> DenseFFN:
    """[a; b] with scale 1.0 on both (shared experts are added unscaled)."""
    if a.act != b.act:
        raise ValueError(f"cannot stack FFNs with activations {a.act!r} and {b.act!r}")
    a, b = _with_zero_biases(a, b)
    dtype = a.gate.dtype
    b = DenseFFN(**{k: (v.to(dtype) if isinstance(v, torch.Tensor) else v) for k, v in vars(b).items()})
    return concat_blocks([a, b], [1.0, 1.0])


def scale_ffn(ffn: DenseFFN, scale: float) -> DenseFFN:
    """scale · ffn(h): the down projection (and its bias) multiplied by `scale` (new tensors)."""
    return DenseFFN(
        gate=ffn.gate,
        up=ffn.up,
        down=ffn.down * scale,
        gate_bias=ffn.gate_bias,
        up_bias=ffn.up_bias,
        down_bias=None if ffn.down_bias is None else ffn.down_bias * scale,
        act=ffn.act,
        act_alpha=ffn.act_alpha,
        act_limit=ffn.act_limit,
    )


def pad_ffn(ffn: DenseFFN, width: int) -> DenseFFN:
    """Zero-pad an FFN to `width` intermediate units (a zero unit contributes act(0, 0)·0 = 0)."""
    extra = width - ffn.width
    if extra < 0:
        raise ValueError(f"width={width} is smaller than an FFN of width {ffn.width}")
    if extra == 0:
        return ffn

    def rows(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else torch.cat([t, t.new_zeros(extra, *t.shape[1:])], dim=0)

    down = torch.cat([ffn.down, ffn.down.new_zeros(ffn.down.shape[0], extra)], dim=1)
    return DenseFFN(
        gate=rows(ffn.gate),
        up=rows(ffn.up),
        down=down,
        gate_bias=rows(ffn.gate_bias),
        up_bias=rows(ffn.up_bias),
        down_bias=ffn.down_bias,
        act=ffn.act,
        act_alpha=ffn.act_alpha,
        act_limit=ffn.act_limit,
    )


def linear_ffn(mlp: nn.Module) -> DenseFFN:
    """A gate_proj/up_proj/down_proj SiLU MLP module (activation at act_fn, or activation_fn as Llama-4's) as a
    DenseFFN (views, not copies)."""
    _check_silu(mlp.act_fn if hasattr(mlp, "act_fn") else mlp.activation_fn)

    def bias(lin: nn.Linear) -> torch.Tensor | None:
        return None if lin.bias is None else lin.bias.detach()

    return DenseFFN(
        gate=mlp.gate_proj.weight.detach(),
        up=mlp.up_proj.weight.detach(),
        down=mlp.down_proj.weight.detach(),
        gate_bias=bias(mlp.gate_proj),
        up_bias=bias(mlp.up_proj),
        down_bias=bias(mlp.down_proj),
    )


def config_int(config: Any, key: str) -> int:
    """An integer field of a model config (ValueError naming the field otherwise, e.g. a None default)."""
    value = getattr(config, key, None)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(
            f"{getattr(config, 'model_type', type(config).__name__)} config: {key}={value!r}, "
            "expected an integer"
        )
    return value


def sparse_step_moe_layers(config: Any) -> list[int]:
    """Qwen2-MoE / Qwen3-MoE decoder layers built as MoE blocks: not in mlp_only_layers, and every
    decoder_sparse_step-th layer (when the config has experts at all)."""
    n = config_int(config, "num_hidden_layers")
    step = config_int(config, "decoder_sparse_step")
    dense = set(getattr(config, "mlp_only_layers", None) or [])
    if int(config.num_experts) <= 0:
        return []
    return [i for i in range(n) if i not in dense and (i + 1) % step == 0]


def layer_types_moe_layers(config: Any) -> list[int]:
    """The "sparse" entries of the config's mlp_layer_types (one "sparse" / "dense" entry per layer)."""
    n = config_int(config, "num_hidden_layers")
    types = list(getattr(config, "mlp_layer_types", None) or [])
    if len(types) != n or not set(types) <= {"sparse", "dense"}:
        raise ValueError(
            f"{config.model_type} config: mlp_layer_types={types!r}, expected {n} entries of "
            "'sparse' / 'dense'"
        )
    return [i for i, t in enumerate(types) if t == "sparse"]


def _check_silu(act_fn: Any) -> None:
    if type(act_fn).__name__ not in ("SiLU", "SiLUActivation"):  # ACT2FN["silu"] / ACT2FN["swish"]
        raise ValueError(f"hidden_act={type(act_fn).__name__}: only silu experts are supported")


# unit_layout of experts stored transposed: gate_up_proj [E, H, 2I] (units on axis 2), down_proj [E, I, H] (axis 1)
TRANSPOSED_UNIT_LAYOUT = {"experts.gate_up_proj": (2, "halves"), "experts.down_proj": (1, "plain")}


def transposed_expert_weights(experts: nn.Module, input_scaled: bool = False) -> ExpertWeights:
    """Canonical views of fused experts stored transposed (Llama-4, Aria): `gate_up_proj` [E, H, 2I] applied as
    x @ W (gate columns first, then up) and `down_proj` [E, I, H]."""
    _check_silu(experts.act_fn)
    gu = experts.gate_up_proj.detach()
    i = gu.shape[2] // 2
    return ExpertWeights(
        gate=gu[:, :, :i].transpose(1, 2),
        up=gu[:, :, i:].transpose(1, 2),
        down=experts.down_proj.detach().transpose(1, 2),
        input_scaled=input_scaled,
    )


class FusedMoeAdapter(FamilyAdapter):
    """Adapter for an MoE block `layer.<block_attr>` with `experts` (fused) and a top-k router."""

    block_attr: str = "mlp"  # decoder-layer attribute holding the FFN (the MoE block in MoE layers)
    router_attr: str = "gate"
    router_linear: str = ""  # submodule of the router holding its [E, H] linear map ("": the router itself)
    # Per expert tensor (not the router's): the axis of its intermediate units in the full [E, ...] tensor
    # and their layout ("halves": gate units then up units, "interleaved": gate 0::2 / up 1::2, "plain":
    # one entry per unit); None for a tensor without an intermediate axis. Used to permute units.
    unit_layout: Mapping[str, tuple[int, str] | None] = {
        "experts.gate_up_proj": (1, "halves"),
        "experts.down_proj": (2, "plain"),
    }
    # Expert tensors whose expert axis is not 0 (relative name → axis), e.g. ERNIE-4.5's [1, E] correction bias:
    # sliced (pruned MoE) and combined (merged MoE) along that axis.
    expert_axis: Mapping[str, int] = {}
    shared_attr: str | None = None  # attribute of the block holding ungated shared experts
    student_act: str = "silu"
    experts_key: str = "num_experts"  # config field with the routed experts per MoE layer

    # --- strategy fields: what the router does and how the layers are laid out ------------------
    scores: str = "softmax"  # the router's per-expert gate values: "softmax" over E or "sigmoid" per expert
    correction_bias: str | None = None  # block-relative [E] bias added to the scores for the choice only
    renorm: bool | None = None  # the top-k weights' renormalization: None reads norm_topk_prob, else fixed
    scale_attr: str = "routed_scaling_factor"  # the router's constant factor on its weights (absent: 1)
    block_scale_attr: str | None = None  # the block's factor applied AFTER the experts (block_scale)
    dense_layers: str = ""  # config field marking dense layers ("": every layer MoE; config_moe_layers)
    shared_key: str | None = None  # config field counting the shared experts, stored as one MLP (None: none)
    config_class: str = ""  # the family's transformers config class (a same-class student's)
    student_dense_fields: tuple[str, ...] = ()  # config fields making a same-class student all dense

    @property
    def expert_tensors(self) -> tuple[str, ...]:
        """Tensors of the block with a leading expert axis, relative to the block: sliced by the pruned MoE and
        combined by the merged one. Here the router's linear map, the correction bias where there is one and
        the fused experts; a family with more (expert biases) lists them as a class attribute."""
        linear = f"{self.router_attr}.{self.router_linear}" if self.router_linear else self.router_attr
        bias = () if self.correction_bias is None else (self.correction_bias,)
        return (f"{linear}.weight", *bias, "experts.gate_up_proj", "experts.down_proj")

    # --- structure from the config alone -------------------------------------------------------
    def config_moe_layers(self, config: Any) -> list[int]:
        """Decoder layers the family's modeling code makes MoE blocks, by dense_layers: "" every layer,
        "mlp_layer_types" its "sparse" entries, "mlp_only_layers" the layers neither in it nor off
        decoder_sparse_step, any other field a count of leading dense layers ("first_k_dense_replace",
        "num_dense_layers")."""
        n = config_int(config, "num_hidden_layers")
        if not self.dense_layers:
            return list(range(n))
        if self.dense_layers == "mlp_layer_types":
            return layer_types_moe_layers(config)
        if self.dense_layers == "mlp_only_layers":
            return sparse_step_moe_layers(config)
        return list(range(min(config_int(config, self.dense_layers), n), n))

    def config_renorm(self, config: Any) -> bool:
        """native_renorm as the router takes it from the config (its norm_topk_prob, unless renorm fixes it)."""
        return bool(getattr(config, "norm_topk_prob", False)) if self.renorm is None else self.renorm

    def config_shared_experts(self, config: Any) -> int:
        return 0 if self.shared_key is None else config_int(config, self.shared_key)

    def shape_from_config(self, config: Any) -> TeacherShape:
        model_type = getattr(config, "model_type", None)
        if model_type not in self.model_types:
            raise ValueError(
                f"config model_type={model_type!r}: the {self.name} adapter handles "
                f"{', '.join(self.model_types)}"
            )
        e = config_int(config, self.experts_key)
        k = config_int(config, "num_experts_per_tok")
        layers = self.config_moe_layers(config)
        if e < 1 or not layers:
            raise ValueError(
                f"{model_type} config: {self.experts_key}={e} builds no routed MoE layer "
                f"(of {config_int(config, 'num_hidden_layers')} layers)"
            )
        if not 1 <= k <= e:
            raise ValueError(
                f"{model_type} config: num_experts_per_tok={k} must be in 1..{e} ({self.experts_key})"
            )
        return TeacherShape(
            family=self.name,
            model_type=model_type,
            num_experts=e,
            top_k=k,
            renormalize=self.config_renorm(config),
            shared_experts=self.config_shared_experts(config),
            moe_layers=len(layers),
        )

    # --- structure -------------------------------------------------------------------------
    def layers(self, model: nn.Module) -> nn.ModuleList:
        return model.model.layers

    def block(self, model: nn.Module, layer: int) -> nn.Module:
        return getattr(self.layers(model)[layer], self.block_attr)

    def is_moe_block(self, mlp: nn.Module) -> bool:
        return type(mlp).__name__ in self.block_classes

    def moe_layers(self, model: nn.Module) -> list[int]:
        return [
            i
            for i, layer in enumerate(self.layers(model))
            if self.is_moe_block(getattr(layer, self.block_attr))
        ]

    def _first(self, model: nn.Module) -> nn.Module:
        moe = self.moe_layers(model)
        if not moe:
            raise ValueError(f"model has no {'/'.join(self.block_classes)} layer")
        return self.block(model, moe[0])

    def layer_experts(self, block: nn.Module) -> int:
        """Routed experts of one MoE block (the leading axis of its fused experts)."""
        return int(block.experts.gate_up_proj.shape[0])

    def num_experts(self, model: nn.Module) -> int:
        return self.layer_experts(self._first(model))

    def top_k(self, model: nn.Module) -> int:
        return int(getattr(self._first(model), self.router_attr).top_k)

    def renormalized(self, model: nn.Module) -> bool:
        return self.native_renorm(getattr(self._first(model), self.router_attr))

    def router_module(self, model: nn.Module, layer: int) -> nn.Module:
        return getattr(self.block(model, layer), self.router_attr)

    def router_linear_of(self, router: nn.Module) -> nn.Module:
        """The module holding the router's [E, H] weight: the router itself, or its `router_linear` submodule
        (AFMoE: `router.gate`, HunYuan: `gate.wg`)."""
        return router.get_submodule(self.router_linear) if self.router_linear else router

    def router_weight(self, model: nn.Module, layer: int) -> torch.Tensor:
        return self.router_linear_of(self.router_module(model, layer)).weight.detach()

    def router_parameters(self, model: nn.Module) -> list[nn.Parameter]:
        """Each MoE block's router weight [E, H] and, where the router's linear map owns one, its logit bias
        [E] (GPT-OSS). Buffers are not parameters: DeepSeek-V3's e_score_correction_bias is moved by its
        load-balancing rule, not by gradients, and enters only the (non-differentiable) top-k choice, so it
        is left out. Any other parameter on a router module is refused (an adapter must say what it is);
        where the linear map is a submodule (`router_linear`), so is any parameter of the router outside it."""
        hidden = config_int(model.config, "hidden_size")
        out: list[nn.Parameter] = []
        for layer in self.moe_layers(model):
            router = self.router_module(model, layer)
            linear = self.router_linear_of(router)
            e = self.layer_experts(self.block(model, layer))
            weight = linear.weight
            if not isinstance(weight, nn.Parameter) or tuple(weight.shape) != (e, hidden):
                raise ValueError(
                    f"layer {layer}: router weight {tuple(weight.shape)} is not the linear map from "
                    f"the hidden size to the routed experts ({e}, {hidden})"
                )
            out.append(weight)
            own = [p for p in linear.parameters(recurse=False) if p is not weight]
            for p in own:
                if tuple(p.shape) != (e,):
                    raise ValueError(
                        f"layer {layer}: router parameter of shape {tuple(p.shape)} is neither "
                        f"the [E, H] weight nor an [E] logit bias (E={e})"
                    )
                out.append(p)
            if linear is not router:
                for p in router.parameters():
                    if p is not weight and not any(p is q for q in own):
                        raise ValueError(
                            f"layer {layer}: router parameter of shape {tuple(p.shape)} is outside "
                            f"its linear map {self.router_linear} (E={e})"
                        )
        if not out:
            raise ValueError(f"model has no {'/'.join(self.block_classes)} layer")
        return out

    # --- router semantics (by the strategy fields) ------------------------------------------
    def native_renorm(self, router: nn.Module) -> bool:
        """Does the router divide its top-k weights by their sum (before any constant factor)?"""
        return bool(getattr(router, "norm_topk_prob", False)) if self.renorm is None else self.renorm

    def gate_values(self, logits: torch.Tensor) -> torch.Tensor:
        """[T, E] per-expert values the router multiplies into the chosen experts (by `scores`)."""
        if self.scores == "sigmoid":
            return torch.sigmoid(logits.float())
        if self.scores != "softmax":
            raise ValueError(f"{self.name}: scores={self.scores!r}; allowed: softmax, sigmoid")
        return torch.softmax(logits.float(), dim=-1)

    def choice_scores(
        self, router: nn.Module, logits: torch.Tensor, gate: torch.Tensor, *router_args: Any
    ) -> torch.Tensor:
        """What the router takes its top-k of: the gate values, plus the correction bias where there is one.
        correction_bias names it relative to the block: under `router_attr`, a tensor of the router
        ("gate.e_score_correction_bias", ERNIE's "gate.moe_statics.e_score_correction_bias"); otherwise the
        block's own tensor, which the block passes to the router's forward after the hidden states
        (`router_args`: MiniMax-M2, Hy-V3, AFMoE)."""
        if self.correction_bias is None:
            return gate
        if self.correction_bias.startswith(
            self.router_attr + "."
        ):  # a tensor of the router (or its submodule)
            owner, _, leaf = self.correction_bias[len(self.router_attr) + 1 :].rpartition(".")
            bias = getattr(router.get_submodule(owner), leaf)
        else:  # the block's tensor, passed to the router's forward
            (bias,) = router_args
        return gate + bias.float().reshape(-1)

    def scale(self, router: nn.Module) -> float:
        return float(getattr(router, self.scale_attr, 1.0))

    def block_scale(self, model: nn.Module, layer: int) -> float:
        """The factor s the block multiplies into its routed experts' sum after the experts (block_scale_attr).
        Since s·Σ_j w_j f_j = Σ_j (s·w_j) f_j, the weights really applied per expert are s·w: the decision
        hook_routing reports carries s (as DeepSeek's weights carry routed_scaling_factor), override_routing
        divides it out before the weights go back to the router, and routed_scaling returns s, so the dense
        student's routed part carries it. The router's own output lacks s (router_decision alone does not see
        it), and expanded routing (routing_top_k) leaves it to the block."""
        return float(getattr(self.block(model, layer), self.block_scale_attr))

    def routed_scaling(self, model: nn.Module) -> float:
        if self.block_scale_attr is not None:
            return self.block_scale(model, self.moe_layers(model)[0])
        return self.scale(getattr(self._first(model), self.router_attr))

    def hook_routing(
        self,
        model: nn.Module,
        layer: int,
        fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None],
    ) -> list[Any]:
        """FamilyAdapter.hook_routing, the weights × the block's factor where it has one (block_scale)."""
        if self.block_scale_attr is None:
            return super().hook_routing(model, layer, fn)
        f = self.block_scale(model, layer)
        return super().hook_routing(model, layer, lambda x, p, w, idx: fn(x, p, w * f, idx))

    def override_routing(
        self,
        model: nn.Module,
        layer: int,
        decide: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
        allowed: Sequence[int],
    ) -> list[Any]:
        """FamilyAdapter.override_routing; where the block has a factor (block_scale), decide sees the weights
        × it and what it returns is divided by it before it goes back to the router."""
        if self.block_scale_attr is None:
            return super().override_routing(model, layer, decide, allowed)
        f = self.block_scale(model, layer)

        def unscaled(
            p: torch.Tensor, w0: torch.Tensor, i0: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor]:
            w, idx = decide(p, w0 * f, i0)
            return w / f, idx

        return super().override_routing(model, layer, unscaled, allowed)

    def router_decision(self, output: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits, weights, indices = output[0], output[1], output[2]
        gate = self.gate_values(logits)
        p = gate / gate.sum(dim=-1, keepdim=True)
        return p, weights, indices

    # --- experts --------------------------------------------------------------------------------
    def expert_weights(self, model: nn.Module, layer: int) -> ExpertWeights:
        experts = self.block(model, layer).experts
        _check_silu(experts.act_fn)
        gu = experts.gate_up_proj.detach()  # [E, 2I, H]: gate rows first, then up rows
        i = gu.shape[1] // 2
        return ExpertWeights(gate=gu[:, :i], up=gu[:, i:], down=experts.down_proj.detach())

    def shared_ffn(self, model: nn.Module, layer: int) -> DenseFFN | None:
        if self.shared_attr is None or layer not in self.moe_layers(model):
            return None
        return linear_ffn(getattr(self.block(model, layer), self.shared_attr))

    def num_shared_experts(self, model: nn.Module) -> int:
        """Where the config counts shared experts (shared_key): the shared MLP's width in routed-expert widths."""
        return 0 if self.shared_key is None else self.shared_units(model)

    def shared_units(self, model: nn.Module) -> int:
        """The shared MLP's width in units of one routed expert's width (the shared-expert count of families that
        store their shared experts as one MLP)."""
        layer = self.moe_layers(model)[0]
        width, unit = self.shared_ffn(model, layer).width, self.expert_weights(model, layer).intermediate
        if width % unit:
            raise ValueError(f"shared experts of width {width} are not a multiple of the expert width {unit}")
        return width // unit

    def dense_ffn(self, model: nn.Module, layer: int) -> DenseFFN:
        mlp = self.block(model, layer)
        if self.is_moe_block(mlp):
            raise ValueError(f"layer={layer} is an MoE layer, not a dense one")
        return linear_ffn(mlp)

    # --- expanded routing (paper §4.3, Eq. 6) ------------------------------------------------
    @contextmanager
    def routing_top_k(self, model: nn.Module, k: int, renormalize: bool | None = None) -> Iterator[None]:
        """Every MoE router picks its top-k experts by the router's own choice scores, weights
        = the router's gate values of those k (softmax probabilities p_e for softmax routers),
        renormalized over the k if `renormalize` (None: the architecture's own rule), times the
        router's constant factor. k equal to the router's k with the native rule leaves the
        native output untouched. The routers' forwards are patched in place and restored."""
        n = self.num_experts(model)
        if not 1 <= int(k) <= n:
            raise ValueError(f"k={k}: must be in 1..{n} (the number of experts)")
        routers = [self.router_module(model, layer) for layer in self.moe_layers(model)]
        saved: list[tuple[nn.Module, Any]] = []
        try:
            for r in routers:
                saved.append((r, r.__dict__.get("forward", _NOT_SET)))
                r.forward = self._expanded_forward(r, int(k), renormalize)
            yield
        finally:
            for r, prev in saved:
                if prev is _NOT_SET:
                    r.__dict__.pop("forward", None)
                else:
                    r.forward = prev

    def _expanded_forward(self, router: nn.Module, k: int, renormalize: bool | None) -> Callable:
        native = router.forward
        native_renorm = self.native_renorm(router)
        renorm = native_renorm if renormalize is None else bool(renormalize)
        untouched = k == int(router.top_k) and renorm == native_renorm

        def forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            out = native(hidden_states, *args, **kwargs)
            if untouched:
                return out
            logits, native_w = out[0], out[1]
            gate = self.gate_values(logits)
            idx = torch.topk(self.choice_scores(router, logits, gate, *args), k, dim=-1).indices
            w = gate.gather(1, idx)
            if renorm:
                w = w / w.sum(dim=-1, keepdim=True)
            w = (w * self.scale(router)).to(native_w.dtype)
            return (logits, w, idx, *tuple(out[3:]))

        return forward

    # --- pruned MoE student (REAP paper, Sec. 4: drop experts, keep the router rows of the rest) ---
    def check_kept(self, model: nn.Module, kept: Mapping[int, Sequence[int]]) -> dict[int, list[int]]:
        """`kept` validated: every MoE layer listed once, distinct expert ids in 0..E-1, the same count
        E' >= k in every layer (an HF config has one expert count). Returns the ids sorted ascending:
        expert j of the pruned layer is its j-th smallest kept id."""
        layers, E, k = self.moe_layers(model), self.num_experts(model), self.top_k(model)
        kept = {int(layer): ids for layer, ids in kept.items()}  # JSON keys are strings
        if sorted(kept) != layers:
            raise ValueError(f"kept lists layers {sorted(kept)}; the model's MoE layers are {layers}")
        out: dict[int, list[int]] = {}
        for layer in layers:
            ids = [int(e) for e in kept[layer]]
            if len(set(ids)) != len(ids) or not all(0 <= e < E for e in ids):
                raise ValueError(f"kept[{layer}]={ids}: expert ids must be distinct and in 0..{E - 1}")
            out[layer] = sorted(ids)
        sizes = {layer: len(ids) for layer, ids in out.items()}
        if len(set(sizes.values())) != 1:
            raise ValueError(
                f"kept lists differ in length across layers ({sizes}): the HF config has one "
                "expert count, keep the same E' in every MoE layer"
            )
        e_new = next(iter(sizes.values()))
        if e_new < k:
            raise ValueError(f"kept {e_new} experts per layer but the router picks k={k}: need E' >= k")
        return out

    def pruned_config(self, model: nn.Module, kept: dict[int, list[int]]) -> Any:
        """The teacher's config with E' routed experts; everything else (k, renormalization) unchanged."""
        cfg = copy.deepcopy(model.config)
        setattr(cfg, self.experts_key, len(next(iter(kept.values()))))
        return cfg

    def pruned_moe_student(self, model: nn.Module, kept: Mapping[int, Sequence[int]]) -> nn.Module:
        """A model of the teacher's class with E' experts per MoE layer: the router rows (and router or
        score-correction biases) and the expert tensors sliced to `kept[layer]` (new, smaller tensors),
        everything else (attention, norms, shared experts, dense layers) copied. See check_kept."""
        ids = self.check_kept(model, kept)
        cfg = self.pruned_config(model, ids)
        named = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        sliced: dict[str, torch.Tensor] = {}
        for layer, kept_ids in ids.items():
            idx = torch.tensor(kept_ids, dtype=torch.long)
            for rel in self.expert_tensors:
                name = f"model.layers.{layer}.{self.block_attr}.{rel}"
                if name not in named:
                    raise ValueError(f"{name}: no such tensor in the {self.name} model")
                t = named[name].detach()
                sliced[name] = t.index_select(self.expert_axis.get(rel, 0), idx.to(t.device))
        return rebuild(cfg, model, sliced)

    # --- merged MoE student (HC-SMoE / M-SMoE: average clusters of experts) ----------------------
    def check_merged(self, model: nn.Module, merged: Mapping[int, MergedLayer]) -> dict[int, MergedLayer]:
        """`merged` validated: every MoE layer listed once; per layer non-empty disjoint clusters of expert
        ids in 0..E-1, weights of the same shape (finite, >= 0, summing to 1), a known router-row rule, each
        dominant expert in its cluster, each permutation one of 0..I-1 for a clustered expert; the same
        M >= k in every layer (an HF config has one expert count)."""
        layers, E, k = self.moe_layers(model), self.num_experts(model), self.top_k(model)
        merged = {int(layer): m for layer, m in merged.items()}  # JSON keys are strings
        if sorted(merged) != layers:
            raise ValueError(f"merged lists layers {sorted(merged)}; the model's MoE layers are {layers}")
        for layer, m in merged.items():
            ids = [e for g in m.groups for e in g]
            if not all(m.groups) or len(set(ids)) != len(ids) or not all(0 <= e < E for e in ids):
                raise ValueError(
                    f"merged[{layer}].groups={m.groups}: non-empty clusters of distinct expert "
                    f"ids in 0..{E - 1}"
                )
            if (
                [len(w) for w in m.weights] != [len(g) for g in m.groups]
                or not all(math.isfinite(x) and x >= 0 for w in m.weights for x in w)
                or not all(abs(sum(w) - 1) < 1e-6 for w in m.weights)
            ):
                raise ValueError(
                    f"merged[{layer}].weights={m.weights}: one weight >= 0 per member, summing "
                    "to 1 per cluster"
                )
            if m.router_rows not in ("weighted", "dominant"):
                raise ValueError(
                    f"merged[{layer}].router_rows={m.router_rows!r}; allowed: weighted, dominant"
                )
            if len(m.dominant) != len(m.groups) or not all(
                d in g for d, g in zip(m.dominant, m.groups, strict=True)
            ):
                raise ValueError(f"merged[{layer}].dominant={m.dominant}: one member of each cluster")
            units = self.expert_weights(model, layer).intermediate
            for e, perm in m.perms.items():
                if e not in ids or sorted(perm.tolist()) != list(range(units)):
                    raise ValueError(
                        f"merged[{layer}].perms[{e}]: a permutation of 0..{units - 1} for a clustered expert"
                    )
        sizes = {layer: m.num_experts for layer, m in merged.items()}
        if len(set(sizes.values())) != 1:
            raise ValueError(
                f"merged layers differ in expert count ({sizes}): the HF config has one expert "
                "count, merge to the same M in every MoE layer"
            )
        if next(iter(sizes.values())) < k:
            raise ValueError(
                f"merged to {next(iter(sizes.values()))} experts per layer but the router picks "
                f"k={k}: need M >= k"
            )
        return merged

    def merged_config(self, model: nn.Module, merged: dict[int, MergedLayer]) -> Any:
        """The teacher's config with M routed experts; everything else (k, renormalization) unchanged."""
        cfg = copy.deepcopy(model.config)
        setattr(cfg, self.experts_key, next(iter(merged.values())).num_experts)
        return cfg

    def is_router_tensor(self, rel: str) -> bool:
        return rel.startswith(self.router_attr + ".") or rel == self.correction_bias

    def permute_units(self, rel: str, t: torch.Tensor, perm: torch.Tensor | None) -> torch.Tensor:
        """One expert's slice `t` of expert tensor `rel` with its intermediate units reordered by perm."""
        if rel not in self.unit_layout:
            raise ValueError(f"{self.name}: expert tensor {rel} has no declared unit layout")
        layout = self.unit_layout[rel]
        if perm is None or layout is None:
            return t
        axis, kind = layout[0] - 1, layout[1]  # the slice has no expert axis
        perm = perm.to(t.device)
        if kind == "halves":
            idx = torch.cat([perm, perm + t.shape[axis] // 2])
        elif kind == "interleaved":
            idx = torch.stack([2 * perm, 2 * perm + 1], dim=-1).reshape(-1)
        else:
            idx = perm
        return t.index_select(axis, idx)

    def merge_tensor(self, rel: str, t: torch.Tensor, m: MergedLayer) -> torch.Tensor:
        """[M, ...]: per cluster Σ_i w_i perm_i(t[i]) (router tensors: by m.router_rows, never permuted),
        accumulated in at least float32, returned in t's dtype."""
        axis = self.expert_axis.get(rel, 0)
        if axis != 0:  # merge along the expert axis, put it back in place
            return self.merge_tensor_axis0(rel, t.movedim(axis, 0), m).movedim(0, axis).contiguous()
        return self.merge_tensor_axis0(rel, t, m)

    def merge_tensor_axis0(self, rel: str, t: torch.Tensor, m: MergedLayer) -> torch.Tensor:
        router = self.is_router_tensor(rel)
        acc_dtype = torch.float64 if t.dtype == torch.float64 else torch.float32
        out = []
        for group, weights, dom in zip(m.groups, m.weights, m.dominant, strict=True):
            if router and m.router_rows == "dominant":
                group, weights = [dom], [1.0]
            acc = torch.zeros(t.shape[1:], dtype=acc_dtype, device=t.device)
            for e, w in zip(group, weights, strict=True):
                piece = t[e] if router else self.permute_units(rel, t[e], m.perms.get(e))
                acc += float(w) * piece.to(acc_dtype)
            out.append(acc.to(t.dtype))
        return torch.stack(out)

    def merged_moe_student(self, model: nn.Module, merged: Mapping[int, MergedLayer]) -> nn.Module:
        """A model of the teacher's class with M merged experts per MoE layer, expert j = cluster
        merged[layer].groups[j] (see FamilyAdapter.merged_moe_student and check_merged)."""
        merged = self.check_merged(model, merged)
        cfg = self.merged_config(model, merged)
        named = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        new: dict[str, torch.Tensor] = {}
        for layer, m in merged.items():
            for rel in self.expert_tensors:
                name = f"model.layers.{layer}.{self.block_attr}.{rel}"
                if name not in named:
                    raise ValueError(f"{name}: no such tensor in the {self.name} model")
                new[name] = self.merge_tensor(rel, named[name].detach(), m)
        return rebuild(cfg, model, new)

    # --- student ---------------------------------------------------------------------------
    def student_config(self, teacher: nn.Module, width: int) -> Any:
        """The same-class dense student: the teacher's config (config_class) with every layer a dense MLP of
        width `width`, each of student_dense_fields set to its all-dense value (mlp_layer_types all "dense",
        mlp_only_layers every layer, a count of leading dense layers n). A family whose student is another
        class (a dense sibling, one expert, none) overrides this."""
        if not self.config_class or not self.student_dense_fields:
            raise ValueError(f"{self.name}: no same-class dense student (config_class, student_dense_fields)")
        import transformers

        n = config_int(teacher.config, "num_hidden_layers")
        dense: dict[str, Any] = {}
        for field in self.student_dense_fields:
            if field == "mlp_layer_types":
                dense[field] = ["dense"] * n
            elif field == "mlp_only_layers":
                dense[field] = list(range(n))
            else:  # a count of leading dense layers
                dense[field] = n
        return copy_config(
            teacher.config,
            getattr(transformers, self.config_class),
            intermediate_size=int(width),
            output_router_logits=False,
            **dense,
        )

    def student_ffn_params(self, layer: int, ffn: DenseFFN) -> dict[str, torch.Tensor]:
        """Student parameter name → tensor for one layer's FFN (a plain gate/up/down MLP here)."""
        pre = f"model.layers.{layer}.{self.student_ffn_attr}."
        out = {
            pre + "gate_proj.weight": ffn.gate,
            pre + "up_proj.weight": ffn.up,
            pre + "down_proj.weight": ffn.down,
        }
        for name, t in (("gate_proj", ffn.gate_bias), ("up_proj", ffn.up_bias), ("down_proj", ffn.down_bias)):
            if t is not None:
                out[pre + name + ".bias"] = t
        return out

    def layer_ffns(
        self, teacher: nn.Module, ffns: dict[int, DenseFFN], shared_scale: Mapping[int, float] | None = None
    ) -> list[DenseFFN]:
        """One FFN per layer, all of one width: ffns[l] (+ shared experts × shared_scale[l], default 1.0)
        or the teacher's dense FFN."""
        moe = set(self.moe_layers(teacher))
        scales = {int(k): float(v) for k, v in (shared_scale or {}).items()}
        out: list[DenseFFN] = []
        for layer in range(len(self.layers(teacher))):
            if layer in ffns:
                f = ffns[layer]
                shared = self.shared_ffn(teacher, layer) if layer in moe else None
                if shared is not None and scales.get(layer, 1.0) != 1.0:
                    shared = scale_ffn(shared, scales[layer])
                f = f if shared is None else stack_ffns(f, shared)
            elif layer in moe:
                raise ValueError(f"ffns: MoE layer {layer} has no FFN; given layers {sorted(ffns)}")
            else:
                f = self.dense_ffn(teacher, layer)
            if f.act != self.student_act:
                raise ValueError(
                    f"ffn act={f.act!r} for layer {layer}; this student needs {self.student_act!r}"
                )
            out.append(f)
        width = max(f.width for f in out)
        return [pad_ffn(f, width) for f in out]

    def build_student(
        self,
        teacher: nn.Module,
        ffns: dict[int, DenseFFN],
        share_weights: bool = False,
        shared_scale: Mapping[int, float] | None = None,
    ) -> nn.Module:
        per_layer = self.layer_ffns(teacher, ffns, shared_scale)
        cfg = self.student_config(teacher, per_layer[0].width)
        tensors: dict[str, torch.Tensor] = {}
        for layer, f in enumerate(per_layer):
            tensors.update(self.student_ffn_params(layer, f))
        ffn_prefixes = tuple(f"model.layers.{i}.{self.student_ffn_attr}." for i in range(len(per_layer)))
        return assemble(cfg, teacher, tensors, ffn_prefixes, share_weights)


def assemble(
    cfg: Any,
    teacher: nn.Module,
    ffn_tensors: dict[str, torch.Tensor],
    ffn_prefixes: tuple[str, ...],
    share_weights: bool,
) -> nn.Module:
    """Build the student on the meta device, then fill it: FFN parameters (and FFN buffers) from `ffn_tensors`,
    everything else from the teacher's tensor of the same name (the same object when sharing,
    a copy otherwise). A student bias the teacher lacks (e.g. Qwen2's qkv bias) becomes zeros."""
    from transformers import AutoModelForCausalLM

    ref = next(teacher.parameters())
    with torch.device("meta"):
        student = AutoModelForCausalLM.from_config(cfg)
    t_params = dict(teacher.named_parameters(remove_duplicate=False))
    t_buffers = dict(teacher.named_buffers(remove_duplicate=False))
    memo: dict[int, Any] = {}
    teacher_storage = {q.untyped_storage().data_ptr() for q in teacher.parameters()}

    def from_teacher(t: torch.Tensor, is_param: bool) -> Any:
        if share_weights:
            return t
        if id(t) not in memo:
            c = t.detach().clone()
            memo[id(t)] = nn.Parameter(c, requires_grad=t.requires_grad) if is_param else c
        return memo[id(t)]

    for name, p in list(student.named_parameters(remove_duplicate=False)):
        if name.startswith(ffn_prefixes):
            if name in ffn_tensors:
                t = ffn_tensors[name].detach().to(device=ref.device, dtype=ref.dtype).contiguous()
                # FFN tensors are always new: never alias a teacher tensor (e.g. an unpadded dense layer)
                new = nn.Parameter(t.clone() if t.untyped_storage().data_ptr() in teacher_storage else t)
            elif name.endswith("bias"):
                new = nn.Parameter(torch.zeros(p.shape, device=ref.device, dtype=ref.dtype))
            else:
                raise ValueError(f"student FFN parameter {name} has no tensor")
        elif name in t_params:
            new = from_teacher(t_params[name], True)
        elif name.endswith("bias"):
            new = nn.Parameter(torch.zeros(p.shape, device=ref.device, dtype=ref.dtype))
        else:
            raise ValueError(f"student parameter {name} has no teacher counterpart")
        if tuple(new.shape) != tuple(p.shape):
            raise ValueError(f"{name}: shape {tuple(new.shape)} but the student needs {tuple(p.shape)}")
        mod_name, _, leaf = name.rpartition(".")
        student.get_submodule(mod_name)._parameters[leaf] = new
    for name, b in list(student.named_buffers(remove_duplicate=False)):
        mod_name, _, leaf = name.rpartition(".")
        if name.startswith(ffn_prefixes) and name in ffn_tensors:  # an FFN buffer (MiniMax-M2's router bias)
            t = ffn_tensors[name].detach().to(device=ref.device, dtype=b.dtype).contiguous()
            if tuple(t.shape) != tuple(b.shape):
                raise ValueError(f"{name}: shape {tuple(t.shape)} but the student needs {tuple(b.shape)}")
            student.get_submodule(mod_name)._buffers[leaf] = t
            continue
        if name not in t_buffers or tuple(t_buffers[name].shape) != tuple(b.shape):
            raise ValueError(f"student buffer {name} has no teacher counterpart")
        student.get_submodule(mod_name)._buffers[leaf] = from_teacher(t_buffers[name], False)
    for mod_name, mod in student.named_modules():
        for key, v in vars(mod).items():
            if isinstance(v, torch.Tensor) and v.is_meta and key not in ("_parameters", "_buffers"):
                raise ValueError(f"student tensor attribute {mod_name}.{key} left on the meta device")
    return student.eval()


def rebuild(cfg: Any, teacher: nn.Module, replaced: dict[str, torch.Tensor]) -> nn.Module:
    """A model of `cfg` (built on the meta device) whose parameters and buffers are `replaced[name]`
    where given, else a copy of the teacher's tensor of the same name (tied tensors stay tied). Every
    shape must match what `cfg` builds; nothing is shared with the teacher."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        student = AutoModelForCausalLM.from_config(cfg)
    if type(student) is not type(teacher):
        raise ValueError(f"config builds {type(student).__name__}, the teacher is {type(teacher).__name__}")
    fill_from_teacher(student, teacher, replaced, "pruned model")
    if getattr(teacher, "generation_config", None) is not None:
        student.generation_config = copy.deepcopy(teacher.generation_config)
    return student.eval()


def fill_from_teacher(
    student: nn.Module, teacher: nn.Module, replaced: dict[str, torch.Tensor], what: str
) -> None:
    """Give every (meta) parameter and buffer of `student` its tensor: `replaced[name]` where given, else a
    copy of the teacher's tensor of that name — one new tensor (and one Parameter) per source object, so
    the teacher's tied names stay tied. Every shape must match; every replaced tensor must be used; no
    tensor attribute may stay on the meta device. `what` names the model in errors."""
    source = {
        **dict(teacher.named_parameters(remove_duplicate=False)),
        **dict(teacher.named_buffers(remove_duplicate=False)),
    }
    memo: dict[tuple, torch.Tensor] = {}
    params: dict[tuple, nn.Parameter] = {}

    def tensor(name: str, like: torch.Tensor) -> tuple[tuple, torch.Tensor]:
        if name in replaced:
            key = ("replaced", name)
            if key not in memo:
                memo[key] = replaced[name].detach().contiguous()
        elif name in source:
            key = ("teacher", id(source[name]))
            if key not in memo:
                memo[key] = source[name].detach().clone()
        else:
            raise ValueError(f"{name}: the {what} needs it, the teacher has no such tensor")
        t = memo[key]
        if tuple(t.shape) != tuple(like.shape):
            raise ValueError(
                f"{name}: shape {tuple(t.shape)} but the {what}'s config builds {tuple(like.shape)}"
            )
        return key, t

    used = set()
    for name, p in list(student.named_parameters(remove_duplicate=False)):
        key, t = tensor(name, p)
        used.add(name)
        if key not in params:
            params[key] = nn.Parameter(t, requires_grad=p.requires_grad)
        mod_name, _, leaf = name.rpartition(".")
        student.get_submodule(mod_name)._parameters[leaf] = params[key]
    for name, b in list(student.named_buffers(remove_duplicate=False)):
        used.add(name)
        mod_name, _, leaf = name.rpartition(".")
        student.get_submodule(mod_name)._buffers[leaf] = tensor(name, b)[1]
    unused = sorted(set(replaced) - used)
    if unused:
        raise ValueError(f"tensors not used by the {what}: {', '.join(unused[:3])}")
    for mod_name, mod in student.named_modules():
        for key, v in vars(mod).items():
            if isinstance(v, torch.Tensor) and v.is_meta and key not in ("_parameters", "_buffers"):
                raise ValueError(f"{what} tensor attribute {mod_name}.{key} left on the meta device")
