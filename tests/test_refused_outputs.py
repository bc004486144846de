"""A family that cannot write an output (FamilyAdapter.refused_outputs) refuses it in one line: the sweep before
anything runs, and the conversion itself."""

from __future__ import annotations

import pytest
from families_cases import make_teacher

from orchestrator.configs import build_configs, model_shape
from orchestrator.schema import SpecError
from orchestrator.spec import load_spec
from workers.families import adapter_named, get_adapter
from workers.outputs import write_student


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
    assert "\n" not in msg and msg.startswith("grid.output: dense: qwen3_moe cannot write a dense student (test)")
    assert msg.endswith("allowed for qwen3_moe: moe, merged, edited")


def test_the_sweep_without_it_is_accepted():
    spec, path, _ = load_spec("tests/sweeps/micro.yaml")
    grid = [c for c in build_configs(spec, model_shape(spec, str(path))) if c.get("kind") == "moe2dense"]
    assert len(grid) == 8 and {c.get("output", "dense") for c in grid} == {"dense"}


def test_the_conversion_refuses_it_too(no_dense_qwen3):
    teacher = make_teacher("qwen3_moe")
    with pytest.raises(ValueError, match=r"^output='dense': qwen3_moe cannot write a dense student \(test\)$"):
        write_student("dense", teacher, get_adapter(teacher), [], share_weights=True)
    with pytest.raises(ValueError, match="output='dens'; allowed: dense, moe, merged, edited"):
        write_student("dens", teacher, get_adapter(teacher), [], share_weights=True)


def test_families_lists_a_refused_output(no_dense_qwen3):
    from typer.testing import CliRunner

    from orchestrator.cli import app

    out = CliRunner().invoke(app, ["families"])
    assert out.exit_code == 0, out.output
    assert "  refused output dense: cannot write a dense student (test)" in out.output
