"""A family that cannot write an output (FamilyAdapter.refused_outputs) refuses it in one line: the sweep before
anything runs, and the conversion itself."""

from __future__ import annotations

import pytest
from families_cases import FAMILIES, make_teacher

from orchestrator.configs import build_configs, model_shape
from orchestrator.schema import SpecError
from orchestrator.spec import load_spec
from workers.families import adapter_named, get_adapter
from workers.models.outputs import write_student


@pytest.fixture
def no_dense_qwen3(monkeypatch):
    cls = type(adapter_named("qwen3_moe"))
    monkeypatch.setattr(cls, "refused_outputs", {"dense": "cannot write a dense student (test)"})


def test_a_sweep_asking_a_refused_output_is_a_one_line_error(no_dense_qwen3):
    spec, path, _ = load_spec("tests/sweeps/micro.yaml")
    shape = model_shape(spec, str(path))
    with pytest.raises(SpecError) as e:
        build_configs(spec, shape)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(
        "grid.output: dense: qwen3_moe cannot write a dense student (test)"
    )
    assert msg.endswith("allowed for qwen3_moe: moe, merged, edited")


def test_the_sweep_without_it_is_accepted():
    spec, path, _ = load_spec("tests/sweeps/micro.yaml")
    grid = [
        c
        for c in build_configs(spec, model_shape(spec, str(path)))
        if c.get("kind") in ("moe2dense", "moe2moe")
    ]
    assert len(grid) == 8 and {c.get("output", "dense") for c in grid} == {"dense"}


def test_the_conversion_refuses_it_too(no_dense_qwen3):
    teacher = make_teacher("qwen3_moe")
    with pytest.raises(
        ValueError, match=r"^output='dense': qwen3_moe cannot write a dense student \(test\)$"
    ):
        write_student("dense", teacher, get_adapter(teacher), [], share_weights=True)
    with pytest.raises(ValueError, match="output='dens'; allowed: dense, moe, merged, edited"):
        write_student("dens", teacher, get_adapter(teacher), [], share_weights=True)


def test_families_lists_a_refused_output(no_dense_qwen3):
    from typer.testing import CliRunner

    from orchestrator.cli import app

    out = CliRunner().invoke(app, ["families"])
    assert out.exit_code == 0, out.output
    assert "  refused output dense: cannot write a dense student (test)" in out.output


GRIDS = {
    "dense": {"scoring": ["SF"], "grouping": ["RR"]},
    "moe": {"output": ["moe"], "scoring": ["REAP"]},
    "merged": {"output": ["merged"], "merging": ["HC-SMoE"]},
    "edited": {"output": ["edited"], "editing": ["TD-MoE"]},
}
REFUSED = [(f, out) for f in FAMILIES for out in adapter_named(f).refused_outputs]


def test_the_families_that_refuse_an_output():
    assert REFUSED == [
        ("phimoe", "dense"),
        ("dbrx", "edited"),
        ("llama4_text", "edited"),
        ("aria_text", "edited"),
    ]


@pytest.mark.parametrize("family,output", REFUSED)
def test_every_refused_output_is_refused_in_one_line_by_the_sweep_and_the_conversion(
    family, output, tmp_path
):
    import yaml
    from families_cases import CASES, tiny_config

    reason = adapter_named(family).refused_outputs[output]
    tiny_config(family).save_pretrained(tmp_path / family)
    f = tmp_path / "sweep.yaml"
    f.write_text(
        yaml.safe_dump(
            {
                "name": "refused",
                "teacher": {"source": "hf", "model": str(tmp_path / family)},
                "calibration": {"n_samples": 4, "seq_len": 8},
                "grid": [{**GRIDS[output], "K": [CASES[family].experts]}],
            }
        )
    )
    spec, path, _ = load_spec(str(f))
    with pytest.raises(SpecError) as e:
        build_configs(spec, model_shape(spec, str(path)))
    allowed = ", ".join(o for o in GRIDS if o not in adapter_named(family).refused_outputs)
    assert str(e.value) == f"grid.output: {output}: {family} {reason}; allowed for {family}: {allowed}"
    teacher = make_teacher(family)
    with pytest.raises(ValueError) as e:
        write_student(output, teacher, get_adapter(teacher), [], share_weights=True)
    assert str(e.value) == f"output={output!r}: {family} {reason}" and "\n" not in reason


def test_every_family_declares_its_edited_classes_or_refuses_the_edited_output():
    """The edited MoE's facts live on each family's own adapter class: (config class, CausalLM class, experts
    layout) naming real transformers classes, or an `edited` entry in refused_outputs; never both, never a
    parent family's classes inherited by a child."""
    import transformers

    from workers.families import ADAPTERS
    from workers.families.base import edited_classes
    from workers.models.edited_model import FAMILIES as EDITED

    assert len(ADAPTERS) == len(FAMILIES)
    for a in ADAPTERS:
        own = edited_classes(a)
        assert (own is None) == ("edited" in a.refused_outputs), a.name
        if own is not None:
            config, lm, layout = own
            assert layout in ("fused", "gptoss") and EDITED[a.name] == own
            assert getattr(transformers, lm).config_class is getattr(transformers, config), a.name
    # a subclass family names its own classes: Dots1Adapter shares DeepseekStyleAdapter with Glm4MoeAdapter and names classes of its own
    assert edited_classes(adapter_named("dots1"))[0] == "Dots1Config"
    assert sorted(EDITED) == sorted(a.name for a in ADAPTERS if edited_classes(a) is not None)
