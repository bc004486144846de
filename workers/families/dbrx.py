"""DBRX (`DbrxFFN`): every block `transformer.blocks[i]` has the MoE FFN `ffn`.

Router: `ffn.router` (`DbrxRouter`, linear map `router.layer` [E, H], no bias) returns the logits alone; the
block takes p = softmax(logits), its top-k (`ffn.top_k`), and divides the k values by their p-norm,
p = `ffn_config.moe_normalize_expert_weights` (None: the raw p). Only None and 1 (the L1 norm: p renormalized
over the k) are supported; any other norm is refused in one line. No constant factor, no shared experts, no
dense layers.

The decision is not any one module's output: hook_routing keeps the router's logits (p) from a hook on the
router and reads the weights and indices the experts really receive from a pre-hook on `ffn.experts`;
override_routing replaces those arguments. The logits themselves are left unmasked: inside the model only
the block's own top-k (which the override replaces) and output_router_logits (the auxiliary loss) read them.

Experts: `ffn.experts.mlp.w1`, `v1`, `w2`, each [E·I, H]; per expert e, gate = w1.view(E, I, H)[e],
up = v1.view(E, I, H)[e], and the forward computes `inter @ w2.view(E, I, H)[e]`, so the canonical down
projection [H, I] is that block transposed. Activation `ffn_config.ffn_act_fn` (SiLU only).

Students: the same class (no dense sibling in transformers): the dense student has one expert of width
`width`, top-1 (softmax over one logit is 1, and so is its p-norm: exact), a zero [1, H] router and no router
jitter; the pruned and merged MoE slice or average the router rows and the [E, I, H] views of w1/v1/w2.
The edited MoE is refused (refused_outputs). The decoder layers are `transformer.blocks`, not
`model.layers`: the streamed pass, FSDP and the random_ffn / random_init baselines refuse DBRX in one line.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from workers.core.shape import TeacherShape
from workers.core.types import DenseFFN, ExpertWeights, MergedLayer
from workers.families.fused import FusedMoeAdapter, _check_silu, assemble, config_int, rebuild

EXPERT_TENSORS = ("experts.mlp.w1", "experts.mlp.v1", "experts.mlp.w2")  # [E·I, H] each
NORMS = (None, 1)  # supported moe_normalize_expert_weights: raw p, L1 (renormalized over the k)


def check_norm(value: Any) -> bool:
    """Whether moe_normalize_expert_weights renormalizes (1) or not (None); a one-line ValueError otherwise."""
    if value is None:
        return False
    if not isinstance(value, bool) and isinstance(value, int | float) and value == 1:
        return True
    raise ValueError(
        f"dbrx ffn_config.moe_normalize_expert_weights={value!r}; allowed: None (raw p), "
        "1 (renormalized over the k)"
    )


class DbrxAdapter(FusedMoeAdapter):
    name = "dbrx"
    routing = (
        "softmax over E, top-k, divided by the k's L1 norm iff ffn_config.moe_normalize_expert_weights=1 "
        "(None: raw p; other norms refused); router returns logits only; no shared experts, no dense "
        "layers"
    )
    student = "same class, one expert, top-1"
    model_types = ("dbrx",)
    block_classes = ("DbrxFFN",)
    block_attr = "ffn"
    router_attr = "router"
    router_linear = "layer"
    expert_tensors = ("router.layer.weight", *EXPERT_TENSORS)
    # in the [E, I, H] views of w1/v1/w2 the intermediate units are the rows (axis 1)
    unit_layout = {name: (1, "plain") for name in EXPERT_TENSORS}
    experts_key = "ffn_config.moe_num_experts"
    refused_outputs = {
        "edited": "cannot write an edited MoE: its experts keep w1/v1/w2 as [E·I, H] matrices, "
        "not the fused gate_up_proj/down_proj the edited experts rebuild"
    }

    # --- structure from the config alone ----------------------------------------------------------
    def shape_from_config(self, config: Any) -> TeacherShape:
        model_type = getattr(config, "model_type", None)
        if model_type != "dbrx":
            raise ValueError(f"config model_type={model_type!r}: the dbrx adapter handles dbrx")
        ffn = config.ffn_config
        e, k = config_int(ffn, "moe_num_experts"), config_int(ffn, "moe_top_k")
        layers = config_int(config, "num_hidden_layers")
        if e < 1 or layers < 1:
            raise ValueError(
                f"dbrx config: ffn_config.moe_num_experts={e}, n_layers={layers} build no routed MoE layer"
            )
        if not 1 <= k <= e:
            raise ValueError(
                f"dbrx config: ffn_config.moe_top_k={k} must be in 1..{e} (ffn_config.moe_num_experts)"
            )
        return TeacherShape(
            family=self.name,
            model_type=model_type,
            num_experts=e,
            top_k=k,
            renormalize=check_norm(ffn.moe_normalize_expert_weights),
            shared_experts=0,
            moe_layers=layers,
        )

    # --- structure -------------------------------------------------------------------------------
    def layers(self, model: nn.Module) -> nn.ModuleList:
        return model.transformer.blocks

    def layer_experts(self, block: nn.Module) -> int:
        return int(block.experts.num_experts)

    def top_k(self, model: nn.Module) -> int:
        return int(self._first(model).top_k)

    def renormalized(self, model: nn.Module) -> bool:
        flags = {
            check_norm(self.block(model, i).moe_normalize_expert_weights) for i in self.moe_layers(model)
        }
        if len(flags) != 1:
            raise ValueError(
                "dbrx blocks differ in moe_normalize_expert_weights; one rule per model is supported"
            )
        return flags.pop()

    def router_decision(self, output: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raise ValueError(
            "dbrx: the router returns logits alone (the block picks and normalizes the top-k); "
            "read the decision through hook_routing"
        )

    # --- reading and replacing the decision --------------------------------------------------------
    def _routing_hooks(
        self,
        model: nn.Module,
        layer: int,
        on_experts: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], Any],
    ) -> list[Any]:
        """A router hook keeping p = softmax(logits) (float32 at least) and a pre-hook on the experts calling
        on_experts(x [T, H], p, weights, indices) with the arguments the experts receive; its return value,
        where not None, replaces (weights, indices)."""
        block = self.block(model, layer)
        self.renormalized(model)  # refuses an unsupported norm before anything runs
        state: dict[str, torch.Tensor] = {}

        def router_hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            z = output if output.dtype == torch.float64 else output.float()
            state["p"] = torch.softmax(z, dim=-1)

        def experts_hook(module: nn.Module, args: tuple, kwargs: dict) -> Any:
            names = ("hidden_states", "top_k_index", "top_k_weights")
            bound = {**dict(zip(names, args, strict=False)), **kwargs}
            h, idx, w = bound["hidden_states"], bound["top_k_index"], bound["top_k_weights"]
            replaced = on_experts(h.reshape(-1, h.shape[-1]), state.pop("p"), w, idx)
            if replaced is None:
                return None
            w2, idx2 = replaced
            return (h,), {"top_k_index": idx2.to(idx.dtype), "top_k_weights": w2.to(w.dtype)}

        return [
            block.router.register_forward_hook(router_hook),
            block.experts.register_forward_pre_hook(experts_hook, with_kwargs=True),
        ]

    def hook_routing(
        self,
        model: nn.Module,
        layer: int,
        fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None],
    ) -> list[Any]:
        """fn(x, p, weights, indices): p from the router's logits, weights and indices as the experts receive
        them (never recomputed)."""

        def call(x: torch.Tensor, p: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> None:
            fn(x, p, w, idx)

        return self._routing_hooks(model, layer, call)

    def override_routing(
        self,
        model: nn.Module,
        layer: int,
        decide: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
        allowed: Sequence[int],
    ) -> list[Any]:
        """The experts receive decide(p, weights, indices) instead of the block's decision. The router logits are
        not masked to `allowed` (module docstring: nothing else in the model's forward reads them)."""
        return self._routing_hooks(model, layer, lambda x, p, w, idx: decide(p, w, idx))

    # --- experts ---------------------------------------------------------------------------------
    def _views(self, block: nn.Module) -> dict[str, torch.Tensor]:
        """w1, v1, w2 as [E, I, H] views."""
        ex = block.experts
        e, i = int(ex.num_experts), int(ex.ffn_hidden_size)
        return {name: getattr(ex.mlp, name).detach().view(e, i, -1) for name in ("w1", "v1", "w2")}

    def expert_weights(self, model: nn.Module, layer: int) -> ExpertWeights:
        block = self.block(model, layer)
        _check_silu(block.experts.mlp.activation_fn)
        v = self._views(block)
        return ExpertWeights(gate=v["w1"], up=v["v1"], down=v["w2"].transpose(1, 2))

    def dense_ffn(self, model: nn.Module, layer: int) -> DenseFFN:
        raise ValueError(f"layer={layer}: every dbrx block is an MoE layer, none is dense")

    # --- expanded routing ------------------------------------------------------------------------
    @contextmanager
    def routing_top_k(self, model: nn.Module, k: int, renormalize: bool | None = None) -> Iterator[None]:
        """Each block's own top_k and moe_normalize_expert_weights set to k and 1 (renormalize) / None (raw p);
        renormalize=None keeps the block's rule. Restored on exit."""
        n = self.num_experts(model)
        if not 1 <= int(k) <= n:
            raise ValueError(f"k={k}: must be in 1..{n} (the number of experts)")
        self.renormalized(model)
        blocks = [self.block(model, layer) for layer in self.moe_layers(model)]
        saved = [(b, b.top_k, b.moe_normalize_expert_weights) for b in blocks]
        try:
            for b in blocks:
                b.top_k = int(k)
                if renormalize is not None:
                    b.moe_normalize_expert_weights = 1.0 if renormalize else None
            yield
        finally:
            for b, top_k, norm in saved:
                b.top_k, b.moe_normalize_expert_weights = top_k, norm

    # --- pruned and merged MoE students ------------------------------------------------------------
    def _tensor(self, model: nn.Module, layer: int, rel: str) -> torch.Tensor:
        """Expert tensor `rel` of a block with a leading expert axis ([E, I, H] for w1/v1/w2)."""
        block = self.block(model, layer)
        t = block.get_parameter(rel).detach()
        return t if rel not in EXPERT_TENSORS else t.view(self.layer_experts(block), -1, t.shape[-1])

    def _resized(self, model: nn.Module, e: int) -> Any:
        cfg = copy.deepcopy(model.config)
        cfg.ffn_config.moe_num_experts = int(e)
        return cfg

    def _name(self, layer: int, rel: str) -> str:
        return f"transformer.blocks.{layer}.ffn.{rel}"

    def pruned_moe_student(self, model: nn.Module, kept: Mapping[int, Sequence[int]]) -> nn.Module:
        ids = self.check_kept(model, kept)
        sliced: dict[str, torch.Tensor] = {}
        for layer, kept_ids in ids.items():
            for rel in self.expert_tensors:
                t = self._tensor(model, layer, rel)
                out = t.index_select(0, torch.tensor(kept_ids, dtype=torch.long, device=t.device))
                sliced[self._name(layer, rel)] = out.reshape(-1, t.shape[-1])
        return rebuild(self._resized(model, len(next(iter(ids.values())))), model, sliced)

    def merged_moe_student(self, model: nn.Module, merged: Mapping[int, MergedLayer]) -> nn.Module:
        merged = self.check_merged(model, merged)
        new: dict[str, torch.Tensor] = {}
        for layer, m in merged.items():
            for rel in self.expert_tensors:
                t = self._tensor(model, layer, rel)
                new[self._name(layer, rel)] = self.merge_tensor(rel, t, m).reshape(-1, t.shape[-1])
        return rebuild(self._resized(model, next(iter(merged.values())).num_experts), model, new)

    # --- dense student ---------------------------------------------------------------------------
    def student_config(self, teacher: nn.Module, width: int) -> Any:
        cfg = copy.deepcopy(teacher.config)
        ffn = cfg.ffn_config
        ffn.moe_num_experts, ffn.moe_top_k, ffn.ffn_hidden_size = 1, 1, int(width)
        ffn.moe_jitter_eps = None  # the router's jitter rescales the experts' input in place while training
        cfg.output_router_logits = False
        return cfg

    def student_ffn_params(self, layer: int, ffn: DenseFFN) -> dict[str, torch.Tensor]:
        if ffn.gate_bias is not None or ffn.up_bias is not None or ffn.down_bias is not None:
            raise ValueError(f"layer {layer}: dbrx experts have no biases, the FFN has some")
        return {
            self._name(layer, "router.layer.weight"): ffn.gate.new_zeros(1, ffn.gate.shape[1]),
            self._name(layer, "experts.mlp.w1"): ffn.gate,
            self._name(layer, "experts.mlp.v1"): ffn.up,
            self._name(layer, "experts.mlp.w2"): ffn.down.T,
        }

    def build_student(
        self,
        teacher: nn.Module,
        ffns: dict[int, DenseFFN],
        share_weights: bool = False,
        shared_scale: Mapping[int, float] | None = None,
    ) -> nn.Module:
        self.renormalized(teacher)
        per_layer = self.layer_ffns(teacher, ffns, shared_scale)
        cfg = self.student_config(teacher, per_layer[0].width)
        tensors: dict[str, torch.Tensor] = {}
        for layer, f in enumerate(per_layer):
            tensors.update(self.student_ffn_params(layer, f))
        prefixes = tuple(self._name(i, "") for i in range(len(per_layer)))
        return assemble(cfg, teacher, tensors, prefixes, share_weights)
