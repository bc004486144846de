"""dots.3 note (`dots3_note_text`, `Dots3NoteTextMoE`; the text decoder Dots3NoteForCausalLM): GLM-4.7-Flash's
DeepSeek-V3 MoE block again: the DeepSeek-V3-style base with the MoE layers by `mlp_layer_types`.

Router (`block.gate`): sigmoid scores; the choice is the group-limited top-k of scores + e_score_correction_bias
(n_group contiguous groups ranked by the sum of their top-2 biased scores, topk_group kept); the weights are the
unbiased scores of the chosen k, renormalized iff norm_topk_prob (by their sum + 1e-20), × routed_scaling_factor.
Shared experts (shared_experts_intermediate_size × n_shared_experts wide) are ungated; "dense" layers are plain
MLPs of intermediate_size. Attention is MLA with an output gate, per layer type: DeepSeek's sparse-attention
indexer on "indexed_attention" layers (plain torch, an additive mask under eager / SDPA: runs on CPU), a sliding
window with its own head shapes (`per_layer_config`) on "sliding_attention" layers; a decoder layer returns its
hidden states alone. The multimodal Dots3NoteForConditionalGeneration (`dots3_note`) is out of scope.

Student: the same class with every entry of mlp_layer_types "dense" (every layer a dense MLP of width `width`;
attention, indexer and norms copied from the teacher): no dense class has this attention. The student's config
is a copy of the teacher's (not rebuilt from its fields: the sliding layers' head shapes live in
`per_layer_config`, which a rebuilt config would reset to the released defaults).
"""

from __future__ import annotations

import copy
from typing import Any

from torch import nn

from workers.families.deepseek_v2 import DeepseekStyleAdapter


class Dots3NoteAdapter(DeepseekStyleAdapter):
    name = "dots3_note_text"
    edited = ("Dots3NoteTextConfig", "Dots3NoteForCausalLM", "fused")
    routing = (
        "as glm4_moe_lite (V3 sigmoid router, group-limited, renormalized iff norm_topk_prob, "
        "× routed_scaling_factor; ungated shared experts; dense layers by mlp_layer_types); MLA attention "
        "with a DSA indexer or a sliding window per layer"
    )
    model_types = ("dots3_note_text",)
    block_classes = ("Dots3NoteTextMoE",)
    student = "same class, every layer dense (mlp_layer_types all 'dense')"
    config_class = "Dots3NoteTextConfig"
    dense_layers = "mlp_layer_types"

    def student_config(self, teacher: nn.Module, width: int) -> Any:
        cfg = copy.deepcopy(teacher.config)
        cfg.intermediate_size = int(width)
        cfg.mlp_layer_types = ["dense"] * cfg.num_hidden_layers
        cfg.output_router_logits = False
        return cfg
