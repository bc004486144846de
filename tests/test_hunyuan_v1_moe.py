"""HunYuan-MoE-V1 specifics beyond the shared family fixture: k given as a per-layer `moe_topk` list (one k per
model: equal entries accepted, different ones refused with a one-line error naming the field), the float32 router
kept by a save / reload, and `moesweep families` listing the family."""

from __future__ import annotations

import pytest
import torch
from families_cases import make_teacher, tiny_config

from workers.families import get_adapter, teacher_shape

FAMILY = "hunyuan_v1_moe"


def test_equal_per_layer_k_list_is_that_k():
    cfg = tiny_config(FAMILY, moe_topk=[2, 2])
    shape = teacher_shape(cfg)
    assert (shape.num_experts, shape.top_k, shape.renormalize, shape.shared_experts, shape.moe_layers) == (
        6,
        2,
        True,
        1,
        2,
    )
    assert cfg.moe_topk == [2, 2]  # the config is not changed
    model = make_teacher(FAMILY, moe_topk=[2, 2])
    assert get_adapter(model).top_k(model) == 2


@pytest.mark.parametrize("topk", [[2, 1], [2]])
def test_differing_or_short_per_layer_k_list_is_refused(topk):
    with pytest.raises(
        ValueError, match=r"^hunyuan_v1_moe config: moe_topk=\[.*only one k per model is supported$"
    ):
        teacher_shape(tiny_config(FAMILY, moe_topk=topk))


def test_built_model_with_different_layer_k_is_refused():
    model = make_teacher(FAMILY, moe_topk=[2, 1])
    with pytest.raises(ValueError, match=r"moe_topk=\[2, 1\] gives the layers different k \(\[1, 2\]\)"):
        get_adapter(model).top_k(model)


def test_router_stays_float32_in_a_float64_teacher():
    model = make_teacher(FAMILY, dtype=torch.float64)
    a = get_adapter(model)
    for p in a.router_parameters(model):
        assert p.dtype == torch.float32
    pruned = a.pruned_moe_student(model, {layer: [0, 2, 3, 5] for layer in a.moe_layers(model)})
    assert all(p.dtype == torch.float32 for p in a.router_parameters(pruned))


def test_families_command_lists_it():
    from typer.testing import CliRunner

    from orchestrator.cli import app

    out = CliRunner().invoke(app, ["families"])
    assert out.exit_code == 0 and FAMILY in out.output
