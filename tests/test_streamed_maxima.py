"""REAP's max-activation pass on a teacher read one decoder layer at a time
(workers.calibration.expert_maxima.streamed_maxima over workers.calibration.streamed.walk_layers): the
maxima of the resident pass on every family, one decoder layer materialised at a time, and the stage's run
function writing the resident file."""

from __future__ import annotations

import json

import pytest
import torch
from families_cases import make_teacher
from test_calibrate import padded_batches
from test_streamed import STREAMED, layer_bytes, saved_teacher, without_layer_1

from workers.calibration.expert_maxima import collect_maxima, load_maxima, streamed_maxima
from workers.calibration.streamed import StreamedTeacher
from workers.families import get_adapter


def assert_same_maxima(got: dict, want: dict, rtol: float) -> None:
    """Same layers; each layer's [E] float32 maxima within rtol of its largest (two forward passes' rounding)."""
    assert sorted(got) == sorted(want)
    for layer, w in want.items():
        g = got[layer]
        assert g.dtype == torch.float32 and g.shape == w.shape and g.device.type == "cpu", layer
        torch.testing.assert_close(g, w, rtol=rtol, atol=rtol * float(w.abs().max()), msg=str(layer))


@pytest.mark.parametrize("family", STREAMED)
def test_streamed_maxima_equal_the_whole_model_pass(family, tmp_path):
    full = saved_teacher(tmp_path, family, torch.float64, experts_implementation="eager")
    batches = padded_batches()  # padding mid-stream: only real tokens count, by the model's own masks
    want = collect_maxima(full, get_adapter(full), batches, chunk_tokens=5)
    assert any(bool((m > 0).any()) for m in want.values())  # something measured, not the zero start
    teacher = StreamedTeacher(tmp_path, torch.float64, experts_implementation="eager")
    seen = []
    got = streamed_maxima(
        teacher,
        get_adapter(teacher.model),
        batches,
        chunk_tokens=5,
        progress=lambda i, n: seen.append((i, n)),
    )
    assert_same_maxima(got, want, rtol=1e-12)
    n = max(get_adapter(full).moe_layers(full)) + 1
    assert seen == [(i, n) for i in range(1, n + 1)]
    peak_bytes, peak_names = teacher.peak  # never more than one decoder layer's tensors at once
    owners = {name.split(".")[2] if name.startswith("model.layers.") else "outside" for name in peak_names}
    assert len(owners) == 1 and owners != {"outside"}, owners
    assert peak_bytes <= max(layer_bytes(full, i) for i in range(len(full.model.layers)))
    assert not teacher.materialised()


def test_float32_default_implementations_and_offloaded_hidden_states(tmp_path):
    full = saved_teacher(tmp_path, "qwen3_moe", torch.float32)
    batches = padded_batches(seed=5)
    want = collect_maxima(full, get_adapter(full), batches, chunk_tokens=8)
    teacher = StreamedTeacher(tmp_path, torch.float32)
    got = streamed_maxima(teacher, get_adapter(teacher.model), batches, chunk_tokens=8, offload=True)
    assert_same_maxima(got, want, rtol=1e-5)


def test_a_failing_layer_leaves_nothing_materialised(tmp_path):
    teacher = without_layer_1(tmp_path)
    with pytest.raises(ValueError, match="no tensors of decoder layer 1"):
        streamed_maxima(teacher, get_adapter(teacher.model), padded_batches(), chunk_tokens=8)
    assert not teacher.materialised()


def test_the_stage_streamed_writes_the_resident_maxima(tmp_path):
    """stage_expert_maxima with `streamed: true` (and offload_hidden), as its calibration plans it, writes
    the maxima the resident teacher's pass writes, from two calibration sources."""
    from workers.run.expert_maxima import stage_expert_maxima
    from workers.tiny.tokenizer import train_tokenizer

    texts = [f"row {i} " + "alpha beta gamma delta epsilon " * (2 + i % 5) for i in range(60)]
    for name, rows in (("a", texts[:30]), ("b", texts[30:])):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in rows))
    teacher_dir = tmp_path / "teacher"
    make_teacher("qwen3_moe", vocab_size=320).save_pretrained(teacher_dir, max_shard_size="20KB")
    train_tokenizer(texts, 300, teacher_dir)
    sources = {
        name: {
            "data": {"source": "jsonl", "path": str(tmp_path / f"{name}.jsonl")},
            "n_samples": 4,
            "weight": w,
        }
        for name, w in (("a", 0.25), ("b", 0.75))
    }
    params = {
        "teacher": {"source": "tiny", "dtype": "float32"},
        "sources": sources,
        "seq_len": 12,
        "seed": 1,
        "batch_size": 3,
        "chunk_tokens": 16,
    }
    got = {}
    for mode, extra in (("resident", {}), ("streamed", {"streamed": True, "offload_hidden": True})):
        (tmp_path / mode).mkdir()
        payload = {
            "params": {**params, **extra},
            "inputs": {"teacher": {"path": str(teacher_dir)}},
            "workdir": str(tmp_path / mode),
            "home": str(tmp_path),
        }
        rec = stage_expert_maxima(payload, {}, None)
        assert rec["outputs"]["sources"] == ["a", "b"]
        got[mode] = [load_maxima(rec["outputs"]["maxima"], w) for w in ({"a": 1, "b": 0}, {"a": 0, "b": 1})]
    for streamed, want in zip(got["streamed"], got["resident"], strict=True):  # each source's own pass
        assert_same_maxima(streamed, want, rtol=1e-5)
