"""Family adapters: one per MoE block class (transformers 5.x). `get_adapter(model)` picks one for a
built model, `adapter_for_config(config)` for a config; `teacher_shape(config)` reads E, k and the rest
of the routed-MoE shape from a config alone."""

from __future__ import annotations

from typing import Any

from torch import nn

from workers.core.shape import TeacherShape
from workers.families.afmoe import AfmoeAdapter
from workers.families.aria import AriaTextAdapter
from workers.families.base import FamilyAdapter
from workers.families.beam import BeamAdapter
from workers.families.cohere2_moe import Cohere2MoeAdapter
from workers.families.dbrx import DbrxAdapter
from workers.families.deepseek_v2 import DeepseekV2Adapter, DeepseekV3Adapter
from workers.families.deepseek_v32 import DeepseekV32Adapter
from workers.families.dots3_note import Dots3NoteAdapter
from workers.families.ernie4_5_moe import Ernie45MoeAdapter
from workers.families.flex_olmo import FlexOlmoAdapter
from workers.families.flint import FlintAdapter
from workers.families.glm4_moe import Dots1Adapter, Glm4MoeAdapter
from workers.families.glm4_moe_lite import ExaoneMoeAdapter, Glm4MoeLiteAdapter
from workers.families.glm_moe_dsa import GlmMoeDsaAdapter
from workers.families.gpt_oss import GptOssAdapter
from workers.families.granitemoe import GraniteMoeAdapter, GraniteMoeSharedAdapter, GraniteMoeSWAAdapter
from workers.families.hunyuan_v1_moe import HunYuanMoeV1Adapter
from workers.families.hy_v3 import HYV3Adapter
from workers.families.laguna import LagunaAdapter
from workers.families.llama4 import Llama4TextAdapter
from workers.families.mellum import MellumAdapter
from workers.families.mimo_v2_flash import MiMoV2FlashAdapter
from workers.families.minimax_m2 import MiniMaxM2Adapter
from workers.families.mixtral import MixtralAdapter
from workers.families.olmoe import OlmoeAdapter
from workers.families.phimoe import PhimoeAdapter
from workers.families.qwen2_moe import Qwen2MoeAdapter
from workers.families.qwen3_moe import Qwen3MoeAdapter
from workers.families.solar_open import SolarOpenAdapter

ADAPTERS: list[FamilyAdapter] = [
    Qwen3MoeAdapter(),
    Qwen2MoeAdapter(),
    MixtralAdapter(),
    OlmoeAdapter(),
    DeepseekV2Adapter(),
    DeepseekV3Adapter(),
    GptOssAdapter(),
    Glm4MoeAdapter(),
    Dots1Adapter(),
    MiniMaxM2Adapter(),
    FlexOlmoAdapter(),
]
# Cohere2-MoE and the Granite MoE families
ADAPTERS += [Cohere2MoeAdapter()]
ADAPTERS += [GraniteMoeAdapter(), GraniteMoeSharedAdapter(), GraniteMoeSWAAdapter()]
# V3-style routers with mlp_layer_types, block-held biases, softmax with a corrected choice
ADAPTERS += [Glm4MoeLiteAdapter(), ExaoneMoeAdapter(), AfmoeAdapter()]
# GLM-5 (the glm4_moe_lite block under DSA-indexer attention)
ADAPTERS += [GlmMoeDsaAdapter()]
# HunYuan-MoE-V1 (softmax router at gate.wg, ungated shared MLP)
ADAPTERS += [HunYuanMoeV1Adapter()]
# ERNIE-4.5-MoE (softmax router, top-k corrected by a [1, E] bias)
ADAPTERS += [Ernie45MoeAdapter()]
# PhiMoE (SparseMixer: always two experts; no dense student)
ADAPTERS += [PhimoeAdapter()]
# DBRX: the router returns logits alone, the block normalizes the top-k; layers at transformer.blocks
ADAPTERS += [DbrxAdapter()]
# Solar Open (GLM-4.5's block in Llama layers), MiMo-V2-Flash (the V3 router, no shared experts),
# Hy-V3 (MiniMax-M2's router × router_scaling_factor, shared MLP, dense layers by mlp_layer_types)
ADAPTERS += [SolarOpenAdapter(), MiMoV2FlashAdapter(), HYV3Adapter()]
# Llama-4's text decoder (sigmoid top-k scores multiplying the expert's input, a shared expert)
ADAPTERS += [Llama4TextAdapter()]
# Mellum: Qwen3-MoE's block, MoE layers by mlp_layer_types
ADAPTERS += [MellumAdapter()]
# dots.3 note's text decoder: the glm4_moe_lite block under MLA with a DSA indexer or a sliding window
ADAPTERS += [Dots3NoteAdapter()]
# Flint: Qwen3-MoE's layer layout, a sigmoid router without correction bias, an ungated shared expert
ADAPTERS += [FlintAdapter()]
# Aria's text decoder: softmax over the top-k logits, transposed experts, a shared MLP
ADAPTERS += [AriaTextAdapter()]
# DeepSeek-V3.2-Exp: the V3 block with mlp_layer_types under DSA-indexer attention
ADAPTERS += [DeepseekV32Adapter()]
# Laguna: sigmoid router with a frozen correction-bias parameter and softcapping, block-level routed factor
ADAPTERS += [LagunaAdapter()]
# Beam: the V3 router without shared experts, the routed factor applied by the block
ADAPTERS += [BeamAdapter()]
# model types left out on purpose, with what to do instead (checked before any adapter is picked)
LEFT_OUT = {
    "aria": "is the multimodal AriaForConditionalGeneration: convert its text model (model_type aria_text, "
    "AriaTextForCausalLM built from config.text_config) instead",
    "llama4": "is the multimodal Llama4ForConditionalGeneration: convert its text model (model_type "
    "llama4_text, Llama4ForCausalLM built from config.text_config) instead",
}


def check_left_out(model_type: Any) -> None:
    """A one-line ValueError for a model type left out on purpose (LEFT_OUT)."""
    if model_type in LEFT_OUT:
        raise ValueError(f"model_type={model_type!r} {LEFT_OUT[model_type]}")


def supported() -> list[str]:
    """'model_type (BlockClass)' for every supported architecture."""
    return [f"{mt} ({'/'.join(a.block_classes)})" for a in ADAPTERS for mt in a.model_types]


def get_adapter(model: nn.Module) -> FamilyAdapter:
    """The adapter whose MoE block class appears in the model (else the one for its model_type)."""
    check_left_out(getattr(getattr(model, "config", None), "model_type", None))
    blocks = {type(m).__name__ for m in model.modules()}
    for a in ADAPTERS:
        if blocks & set(a.block_classes):
            return a
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    for a in ADAPTERS:
        if model_type in a.model_types:
            return a
    raise ValueError(
        f"unsupported architecture model_type={model_type!r} ({type(model).__name__}); "
        f"supported: {', '.join(supported())}"
    )


def adapter_named(name: str) -> FamilyAdapter:
    """The adapter called `name` (its `name`, as configurations.family stores it)."""
    for a in ADAPTERS:
        if a.name == name:
            return a
    raise ValueError(f"family={name!r}; known families: {', '.join(a.name for a in ADAPTERS)}")


def adapter_for_config(config: Any) -> FamilyAdapter:
    """The adapter for `config.model_type` (a transformers config; no model is built)."""
    model_type = getattr(config, "model_type", None)
    check_left_out(model_type)
    for a in ADAPTERS:
        if model_type in a.model_types:
            return a
    types = [mt for a in ADAPTERS for mt in a.model_types]
    raise ValueError(f"unsupported model_type={model_type!r}; supported model types: {', '.join(types)}")


def teacher_shape(config: Any) -> TeacherShape:
    """The teacher's routed-MoE shape from its config alone, as its family's modeling code builds it."""
    return adapter_for_config(config).shape_from_config(config)
