"""What a model family must tell the pipeline. One subclass per MoE block class.

Method code (calibration, scoring, conversion, distillation) talks to a model only through this
interface, so it never asks which family it is in.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from workers.core.shape import TeacherShape
from workers.core.types import DenseFFN, ExpertWeights, LayerStats, MergedLayer


class FamilyAdapter(ABC):
    name: str = ""  # e.g. "qwen3_moe"
    model_types: tuple[str, ...] = ()  # config.model_type values this adapter handles
    block_classes: tuple[str, ...] = ()  # MoE block class names (transformers 5.x) this adapter handles
    routing: str = (
        ""  # the router's semantics, shared experts and dense layers in one line (`moesweep families`)
    )
    student: str = ""  # what the dense student is (a dense sibling class, or the same class with one expert)
    # Outputs (workers.models.outputs.OUTPUTS) a family cannot write, each with the one-line reason; a sweep asking for
    # one is refused before anything runs (orchestrator.configs.build_configs) and so is the conversion.
    refused_outputs: Mapping[str, str] = {}
    # The edited MoE's transformers classes: (config class, CausalLM class, experts layout "fused" | "gptoss"),
    # which the edited checkpoint subclasses (workers/models/edited_model.py). Declared on the family's own class,
    # never inherited (edited_classes); None with an "edited" entry in refused_outputs where it cannot be written.
    edited: tuple[str, str, str] | None = None
    student_ffn_attr: str = (
        "mlp"  # decoder-layer attribute of the dense student's FFN (Llama-4: feed_forward)
    )

    # --- structure from the config alone (no model built) ---------------------------------------
    @abstractmethod
    def shape_from_config(self, config: Any) -> TeacherShape:
        """E, k, renormalization, shared experts and the number of MoE layers exactly as the family's
        modeling code builds them from `config` (a transformers config of one of `model_types`).
        Reads attributes only: no weights, no model. Raises ValueError for a config that builds no
        routed MoE layer or an impossible k."""
        ...

    # --- structure -------------------------------------------------------------------------
    @abstractmethod
    def moe_layers(self, model: nn.Module) -> list[int]:
        """Indices of decoder layers whose FFN is a routed MoE block."""
        ...

    @abstractmethod
    def num_experts(self, model: nn.Module) -> int: ...

    @abstractmethod
    def top_k(self, model: nn.Module) -> int:
        """The router's k (the architecture constant, also the student's number of groups)."""
        ...

    @abstractmethod
    def renormalized(self, model: nn.Module) -> bool:
        """Whether the router's top-k weights sum to 1 before any constant factor (see routed_scaling).
        Read by expanded teacher routing (distill's teacher_renormalize default), reconstruction's
        routed_subset target and Router KD's record; the dense student's α rule is the sweep's dp_scaling."""
        ...

    @abstractmethod
    def router_module(self, model: nn.Module, layer: int) -> nn.Module:
        """The module whose forward hook sees (input hidden states, router output)."""
        ...

    @abstractmethod
    def router_decision(self, output: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """From the router module's output: (p [T, E] softmax over all E, weights [T, k] really
        applied, indices [T, k] really used). Never recomputes the choice. GPT-OSS: p is the softmax
        over all E (biased) logits, the weights the softmax over the chosen k. DeepSeek: the weights
        include routed_scaling_factor; V3 (sigmoid router): p = sigmoid scores normalized over E."""
        ...

    # --- reading and replacing a layer's routing (what calibration and reconstruction hook) ----------
    def hook_routing(
        self,
        model: nn.Module,
        layer: int,
        fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None],
    ) -> list[Any]:
        """Call fn(x [T, H] the router's input, p, weights, indices) each time MoE layer `layer` routes
        (p, weights, indices as router_decision gives them). Returns the hook handles (.remove() each).
        Here: a forward hook on router_module reading router_decision(output); a family whose decision is
        not in one module's output (DBRX: the block normalizes the router's logits) overrides this."""

        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            h = args[0] if args else kwargs["hidden_states"]
            fn(h.reshape(-1, h.shape[-1]), *self.router_decision(output))

        return [self.router_module(model, layer).register_forward_hook(hook, with_kwargs=True)]

    def override_routing(
        self,
        model: nn.Module,
        layer: int,
        decide: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
        allowed: Sequence[int],
    ) -> list[Any]:
        """Make MoE layer `layer` apply decide(p, weights, indices) -> (weights′ [T, k′], indices′ [T, k′])
        instead of its own decision (weights′ as the experts multiply them, any constant factor included);
        the router logits it reports are masked to the dtype's minimum outside `allowed`. Returns the hook
        handles. Here: a forward hook replacing the router module's (logits, weights, indices, ...) output."""

        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
            p, w0, i0 = self.router_decision(output)
            w, idx = decide(p, w0, i0)
            logits = output[0]
            dropped = torch.ones(logits.shape[-1], dtype=torch.bool, device=logits.device)
            dropped[torch.as_tensor(list(allowed), dtype=torch.long, device=logits.device)] = False
            logits = logits.masked_fill(dropped, torch.finfo(logits.dtype).min)
            return (logits, w.to(w0.dtype), idx.to(i0.dtype), *tuple(output[3:]))

        return [self.router_module(model, layer).register_forward_hook(hook, with_kwargs=True)]

    @abstractmethod
    def router_weight(self, model: nn.Module, layer: int) -> torch.Tensor:
        """[E, H] router vectors (used by RC/AB grouping)."""
        ...

    @abstractmethod
    def router_parameters(self, model: nn.Module) -> list[nn.Parameter]:
        """The routers' trainable parameters, in layer order: in each MoE block the linear map from the
        hidden size to the block's routed experts (weight [E, H]) and the router's logit bias [E] where
        it has one. Selected by role (the block's router, checked against E and H), never by name."""
        ...

    @abstractmethod
    def expert_weights(self, model: nn.Module, layer: int) -> ExpertWeights:
        """Canonical views of the routed experts of one layer."""
        ...

    def num_shared_experts(self, model: nn.Module) -> int:
        """Shared (always-on) experts per MoE layer of the built model."""
        return 0

    def shared_ffn(self, model: nn.Module, layer: int) -> DenseFFN | None:
        """Shared experts of a layer as one dense FFN (copied into the student with scale 1.0, or the
        layer's `shared_scale` where build_student is given one)."""
        return None

    def shared_gate(self, model: nn.Module, layer: int) -> nn.Module | None:
        """The module whose output gates the layer's shared expert per token (Qwen2-MoE's
        shared_expert_gate); None where the shared experts are ungated or absent. Calibration hooks it
        and records Σ_t shared_gate_values (LayerStats.sum_shared_gate)."""
        return None

    def shared_gate_values(self, output: torch.Tensor) -> torch.Tensor:
        """[T] the factor the gate module's output multiplies into the shared expert (a sigmoid here)."""
        return torch.sigmoid(output.double()).reshape(-1)

    @abstractmethod
    def dense_ffn(self, model: nn.Module, layer: int) -> DenseFFN:
        """The FFN of a dense (non-MoE) teacher layer (zero-padded to the student's width)."""
        ...

    def layer_output(self, output: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        """A decoder layer's output as (hidden states, the keyword arguments the model's forward passes from
        it to the next layer). Most layers return the hidden states alone; GLM-5's also returns the DSA
        indexer's top-k tokens, which the next layer receives as prev_topk_indices."""
        return output, {}

    def recorded_layer_output(self, hidden: torch.Tensor) -> Any:
        """What a stand-in for a decoder layer returns so that the model's forward goes on (the inverse of
        layer_output, with nothing carried)."""
        return hidden

    def routed_scaling(self, model: nn.Module) -> float:
        """Constant factor the router multiplies into its weights (DeepSeek routed_scaling_factor).

        The student's down projections of the routed part are multiplied by it, so that α from a
        scaling rule (on probabilities p) keeps the teacher's scale."""
        return 1.0

    # --- routing override (expanded teacher routing k′ during distillation) ----------------
    @abstractmethod
    def routing_top_k(
        self, model: nn.Module, k: int, renormalize: bool | None = None
    ) -> AbstractContextManager[None]:
        """Within the block, every MoE layer routes each token to its top-k experts (paper §4.3,
        Eq. 6): weights p_e of the chosen k, renormalized over them iff `renormalize` (None: the
        architecture's own rule). Restores the model on exit; never copies it."""
        ...

    # --- pruned MoE student ------------------------------------------------------------------
    @abstractmethod
    def pruned_moe_student(self, model: nn.Module, kept: dict[int, list[int]]) -> nn.Module:
        """A model of the same HF class whose config has E' = len(kept[l]) routed experts in every MoE
        layer l: the router rows (and any per-expert router bias) and the expert tensors sliced to
        kept[l] (new tensors), shared experts and dense layers copied, top-k and renormalization rule
        unchanged. Every MoE layer must be listed with the same E' >= k (one-line ValueError)."""
        ...

    # --- merged MoE student ------------------------------------------------------------------
    @abstractmethod
    def merged_moe_student(self, model: nn.Module, merged: dict[int, MergedLayer]) -> nn.Module:
        """A model of the same HF class whose config has M = len(merged[l].groups) routed experts in every
        MoE layer l: merged expert j's tensors are the weighted average of its cluster's expert tensors
        (each member's intermediate units permuted first), its router row (and any per-expert router
        bias) combined by the layer's router_rows rule (`weighted` or `dominant`; `summed`, which keeps all E
        router rows, is written by workers.models.merged_model from the adapter's expert tensors); new
        tensors, everything else copied, top-k and renormalization unchanged. Every MoE layer must be
        listed with the same M >= k (one-line ValueError)."""
        ...

    # --- student ---------------------------------------------------------------------------
    @abstractmethod
    def student_config(self, teacher: nn.Module, width: int) -> Any:
        """The dense student's HF config with FFN width `width` in every layer."""
        ...

    @abstractmethod
    def build_student(
        self,
        teacher: nn.Module,
        ffns: dict[int, DenseFFN],
        share_weights: bool = False,
        shared_scale: Mapping[int, float] | None = None,
    ) -> nn.Module:
        """A dense HF model: attention, embeddings and norms from the teacher; layer l's FFN
        from ffns[l] (plus shared experts, times shared_scale[l] where given, else 1.0); dense teacher
        layers zero-padded to the same width. share_weights=True reuses the teacher's tensors instead of
        copying them (for fast in-memory evaluation with the teacher resident); the student must then
        not be trained."""
        ...


def check_output(adapter: FamilyAdapter, output: str) -> None:
    """A one-line ValueError where the adapter's family cannot write `output` (refused_outputs)."""
    if output in adapter.refused_outputs:
        raise ValueError(f"output={output!r}: {adapter.name} {adapter.refused_outputs[output]}")


SHARED_GATE_RULES = ("one", "mean")
SHARED_GATE_DEFAULT = "one"


def shared_gate_scales(stats: Mapping[int, LayerStats], rule: str = SHARED_GATE_DEFAULT) -> dict[int, float]:
    """The static scale of each MoE layer's gated shared expert in the dense student (build_student's
    shared_scale). "one" (default; what every student so far was built with): the gate is dropped, its
    upper bound 1. "mean": the calibration mean of the gate, Σ_t σ(w·x_t) / N (§3.4's principle: a
    static scale ≈ the average routing); layers whose statistics hold no gate (ungated or no shared
    expert) get 1.0."""
    if rule not in SHARED_GATE_RULES:
        raise ValueError(f"shared_gate={rule!r}; allowed: {', '.join(SHARED_GATE_RULES)}")
    out: dict[int, float] = {}
    for layer, st in stats.items():
        if rule == "mean" and st.sum_shared_gate is not None:
            if st.n_tokens <= 0:
                raise ValueError(f"layer {layer}: no calibration tokens, no shared-gate mean")
            out[int(layer)] = float(st.sum_shared_gate.sum()) / st.n_tokens
        else:
            out[int(layer)] = 1.0
    return out


def edited_classes(adapter: FamilyAdapter) -> tuple[str, str, str] | None:
    """The family's own `edited` classes (its class's, not a parent family's), or None."""
    return vars(type(adapter)).get("edited")
