"""Beam specifics beyond the per-family fixture: the real config's final logit softcap (30) is refused by the chunked
KD loss in one line (distillation and Router KD need a linear head), and the block's routed factor is what
hook_routing's weights carry (FusedMoeAdapter.block_scale)."""

from __future__ import annotations

import pytest
import torch
from families_cases import ids, make_teacher

from workers.families import get_adapter
from workers.training.distill import lm_head


def test_the_real_final_logit_softcap_is_refused_by_the_kd_head_in_one_line():
    teacher = make_teacher("beam", final_logit_softcapping=30.0)
    with pytest.raises(
        ValueError, match=r"^BeamForCausalLM: config.final_logit_softcapping is set; the chunked KD"
    ) as e:
        lm_head(teacher)
    assert "\n" not in str(e.value)
    assert isinstance(lm_head(make_teacher("beam")), torch.nn.Linear)


def test_reported_weights_carry_the_blocks_factor():
    teacher = make_teacher("beam", routed_scaling_factor=3.0)
    a = get_adapter(teacher)
    layer = a.moe_layers(teacher)[0]
    seen = {}
    handles = a.hook_routing(teacher, layer, lambda x, p, w, idx: seen.update(w=w))
    handles.append(
        a.router_module(teacher, layer).register_forward_hook(lambda m, i, o: seen.update(raw=o[1]))
    )
    with torch.no_grad():
        teacher(ids())
    for h in handles:
        h.remove()
    assert a.routed_scaling(teacher) == 3.0
    # exact: the hook reports w·s, the very same elementwise product as raw·3.0
    torch.testing.assert_close(seen["w"], seen["raw"] * 3.0, rtol=0, atol=0)
    torch.testing.assert_close(seen["raw"].sum(-1), torch.ones_like(seen["raw"][:, 0]))  # norm_topk_prob
