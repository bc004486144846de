"""Layer-streamed calibration (workers/calibration/streamed.py): the statistics of a teacher read from its safetensors
shards one decoder layer at a time equal the resident whole-model pass, on every family; never more than
one decoder layer is materialised at once; the memory it needs, by hand."""

from __future__ import annotations

import json

import pytest
import torch
from families_cases import FAMILIES, make_teacher
from test_calibrate import padded_batches

from workers.calibration.calibrate import STAT_FIELDS, collect_stats, load_stats
from workers.calibration.streamed import StreamedTeacher, layer_parameters, memory_needed, streamed_stats
from workers.families import get_adapter


def saved_teacher(tmp_path, family: str, dtype: torch.dtype, **kw):
    """The family's tiny teacher saved in several small shards, and the resident model read back from them."""
    from transformers import AutoModelForCausalLM

    make_teacher(family, dtype=dtype, **kw).save_pretrained(tmp_path, max_shard_size="20KB")
    shards = set(json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"].values())
    assert len(shards) > 3
    impl = {"experts_implementation": kw["experts_implementation"]} if "experts_implementation" in kw else {}
    return AutoModelForCausalLM.from_pretrained(tmp_path, dtype=dtype, **impl).eval()


def assert_same_stats(got, want, rtol: float) -> None:
    """Every statistic within rtol of its largest entry (float64), the token samples' tokens identical and their
    activations (x, p) within rtol too: the streamed pass computes them on its own path, not bit for bit."""
    assert sorted(got) == sorted(want)
    for layer, w in want.items():
        g = got[layer]
        assert g.n_tokens == w.n_tokens
        for name in STAT_FIELDS:
            a, b = getattr(g, name), getattr(w, name)
            assert a.dtype == torch.float64 and a.shape == b.shape, name
            torch.testing.assert_close(a, b.cpu(), rtol=rtol, atol=rtol * float(b.abs().max()), msg=name)
        assert (g.sample is None) == (w.sample is None)
        for key in w.sample or {}:
            a, b = g.sample[key], w.sample[key].cpu()
            if a.is_floating_point():  # activations of two forward passes: rounding, as the statistics
                torch.testing.assert_close(a, b, rtol=rtol, atol=rtol * float(b.abs().max()), msg=key)
            else:
                assert torch.equal(a, b), key  # exact: token ids, masks, windows and positions (integers)


# DBRX keeps its decoder layers at transformer.blocks: the streamed pass refuses it (test below)
STREAMED = [f for f in FAMILIES if f != "dbrx"]


def test_dbrx_is_refused_in_one_line(tmp_path):
    assert [f for f in FAMILIES if f not in STREAMED] == ["dbrx"]
    make_teacher("dbrx").save_pretrained(tmp_path, max_shard_size="20KB")
    with pytest.raises(ValueError) as e:
        StreamedTeacher(tmp_path, torch.float32)
    assert str(e.value) == (
        "model_type='dbrx': decoder layers at transformer.blocks, not transformer.layers; "
        "streamed calibration needs model.layers"
    )


def layer_bytes(model, layer: int) -> int:
    return sum(
        t.numel() * t.element_size()
        for t in [*model.model.layers[layer].parameters(), *model.model.layers[layer].buffers()]
    )


@pytest.mark.parametrize("family", STREAMED)
def test_streamed_stats_equal_the_whole_model_pass(family, tmp_path):
    full = saved_teacher(tmp_path, family, torch.float64, experts_implementation="eager")
    adapter = get_adapter(full)
    batches = padded_batches()  # padding mid-stream: the masks of the model's own forward matter
    want = collect_stats(full, adapter, batches, chunk_tokens=5, sample_tokens=7, sample_seed=3)
    teacher = StreamedTeacher(tmp_path, torch.float64, experts_implementation="eager")
    assert not teacher.materialised()  # a skeleton: nothing read yet
    seen = []
    got = streamed_stats(
        teacher,
        get_adapter(teacher.model),
        batches,
        chunk_tokens=5,
        sample_tokens=7,
        sample_seed=3,
        progress=lambda i, n: seen.append((i, n)),
    )
    assert_same_stats(got, want, rtol=1e-12)
    n = max(adapter.moe_layers(full)) + 1
    assert seen == [(i, n) for i in range(1, n + 1)]
    # memory: the most ever materialised at once is one decoder layer's tensors, at most the largest layer
    peak_bytes, peak_names = teacher.peak
    owners = {name.split(".")[2] if name.startswith("model.layers.") else "outside" for name in peak_names}
    assert len(owners) == 1 and owners != {"outside"}, owners
    assert peak_bytes <= max(layer_bytes(full, i) for i in range(len(full.model.layers)))
    j = owners.pop()
    assert peak_names == {f"model.layers.{j}.{k}" for k in full.model.layers[int(j)].state_dict()}
    assert not teacher.materialised()  # everything back on the meta device


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_float32_default_implementations_and_offloaded_hidden_states(family, tmp_path):
    """The production path: float32 (bf16 on GPU), the library's default experts and attention, the
    carried hidden states offloaded to the CPU between layers."""
    full = saved_teacher(tmp_path, family, torch.float32)
    batches = padded_batches(seed=5)
    want = collect_stats(full, get_adapter(full), batches, chunk_tokens=8)
    teacher = StreamedTeacher(tmp_path, torch.float32)
    got = streamed_stats(teacher, get_adapter(teacher.model), batches, chunk_tokens=8, offload=True)
    assert_same_stats(got, want, rtol=1e-6)


def without_layer_1(tmp_path) -> StreamedTeacher:
    """OLMoE's tiny teacher saved in shards whose index has lost decoder layer 1's tensors, streamed."""
    saved_teacher(tmp_path, "olmoe", torch.float32)
    index = tmp_path / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"] = {k: v for k, v in data["weight_map"].items() if ".layers.1." not in k}
    index.write_text(json.dumps(data))
    return StreamedTeacher(tmp_path, torch.float32)


def test_a_layer_missing_from_the_checkpoint_is_one_line(tmp_path):
    teacher = without_layer_1(tmp_path)
    with pytest.raises(ValueError, match="no tensors of decoder layer 1") as e:
        streamed_stats(teacher, get_adapter(teacher.model), padded_batches(), chunk_tokens=8)
    assert "\n" not in str(e.value)
    assert not teacher.materialised()
    (tmp_path / "model.safetensors.index.json").unlink()
    with pytest.raises(ValueError, match="safetensors checkpoint"):
        StreamedTeacher(tmp_path, torch.float32)


def test_streamed_calibrate_stage_writes_the_resident_statistics(tmp_path):
    """stage_calibrate with `streamed: true` (and offload_hidden) writes the statistics the resident
    teacher's pass writes."""
    from workers.run.calibrate import stage_calibrate
    from workers.tiny.tokenizer import train_tokenizer

    texts = [f"row {i} " + "alpha beta gamma delta epsilon " * (2 + i % 5) for i in range(60)]
    data = tmp_path / "calib.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    teacher_dir = tmp_path / "teacher"
    make_teacher("qwen3_moe", vocab_size=320).save_pretrained(teacher_dir, max_shard_size="20KB")
    train_tokenizer(texts, 300, teacher_dir)
    params = {
        "teacher": {"source": "tiny", "dtype": "float32"},
        "data": {"source": "jsonl", "path": str(data)},
        "n_samples": 6,
        "seq_len": 12,
        "seed": 1,
        "batch_size": 4,
        "chunk_tokens": 16,
        "sample_tokens": 9,
    }
    out = {}
    for mode, extra in (("resident", {}), ("streamed", {"streamed": True, "offload_hidden": True})):
        payload = {
            "params": {**params, **extra},
            "inputs": {"teacher": {"path": str(teacher_dir)}},
            "workdir": str(tmp_path / mode),
            "home": str(tmp_path),
        }
        (tmp_path / mode).mkdir()
        rec = stage_calibrate(payload, {}, None)
        out[mode] = (rec, load_stats(rec["outputs"]["stats"]))
    assert out["streamed"][0]["outputs"]["n_tokens"] == out["resident"][0]["outputs"]["n_tokens"] == 72
    assert_same_stats(out["streamed"][1], out["resident"][1], rtol=1e-6)


def test_calibration_settings_keep_old_job_keys():
    from orchestrator.stages.calibrate import Calibration

    dumped = Calibration().model_dump()
    assert "streamed" not in dumped and "offload_hidden" not in dumped
    assert Calibration(streamed=True).model_dump()["streamed"] is True
    assert Calibration(streamed=True, offload_hidden=True).model_dump()["offload_hidden"] is True
    with pytest.raises(ValueError, match="offload_hidden applies to a streamed calibration"):
        Calibration(offload_hidden=True)


def qwen3_moe_config(hidden: int, heads: int, moe_intermediate: int):
    """One decoder layer of a Qwen3-MoE checkpoint's published shape (128 experts, 4 KV heads of 128)."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=151936,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=moe_intermediate,
        num_hidden_layers=1,
        tie_word_embeddings=False,
    )


def test_memory_needed_for_qwen3_30b_and_235b_by_hand():
    GiB = 2**30
    # Qwen3-30B-A3B: H 2048, 32 query heads and 4 KV heads of 128, 128 experts of width 768
    attn = 2048 * 32 * 128 + 2 * 2048 * 4 * 128 + 32 * 128 * 2048  # q, k, v, o
    norms = 2 * 128 + 2 * 2048  # q_norm, k_norm; the two layer norms
    experts = 128 * 3 * 2048 * 768  # gate, up, down of 128 experts
    router = 128 * 2048
    assert attn + norms + experts + router == 623_120_640
    assert layer_parameters(qwen3_moe_config(2048, 32, 768)) == (623_120_640, 151936 * 2048)
    # Qwen3-235B-A22B: H 4096, 64 query heads, experts of width 1536
    big = (4096 * 64 * 128 * 2 + 2 * 4096 * 512) + (2 * 128 + 2 * 4096) + 128 * 3 * 4096 * 1536 + 128 * 4096
    assert big == 2_487_755_008
    assert layer_parameters(qwen3_moe_config(4096, 64, 1536)) == (2_487_755_008, 151936 * 4096)
    # bf16, 1,024 windows of 2,048 tokens in batches of 4, chunks of 2,048 tokens (the REAP sweeps' setting)
    n, b, c = 1024 * 2048, 4 * 2048, 2048
    m = memory_needed(623_120_640, 151936 * 2048, 2048, 128, 768, 8, n, b, c)
    assert m["layer_weights"] == 2 * 623_120_640
    assert m["hidden_states"] == (n + b) * 2048 * 2
    assert m["expert_chunk"] == 2048 * (128 * (2 * 768 + 2048) + 8 * 2048) * 2  # + the 8 routed rows
    assert m["stats_float64"] == 8 * (2 * 128 * 128 + 128 * (768 + 2048) + 2048 * 2048)
    assert m["total"] == 2 * 623_120_640 + (n + b) * 4096 + m["expert_chunk"] + m["stats_float64"]
    assert m["total"] == 11_852_587_520 and round(m["total"] / GiB, 1) == 11.0  # docs/scale.md's numbers
    off = memory_needed(623_120_640, 151936 * 2048, 2048, 128, 768, 8, n, b, c, offload=True)
    assert off["hidden_states"] == 2 * b * 2048 * 2
    assert off["total"] == 3_296_207_360 and round(off["total"] / GiB, 1) == 3.1
    m = memory_needed(2_487_755_008, 151936 * 4096, 4096, 128, 1536, 8, n, b, c)
    assert m["layer_weights"] == 4_975_510_016 and round(m["layer_weights"] / GiB, 1) == 4.6
    assert m["total"] == 26_255_049_216 and round(m["total"] / GiB, 1) == 24.5
    off = memory_needed(2_487_755_008, 151936 * 4096, 4096, 128, 1536, 8, n, b, c, offload=True)
    assert off["total"] == 9_142_288_896 and round(off["total"] / GiB, 1) == 8.5
    # the embedding phase is the larger one only when the embeddings outweigh a layer (a tiny model)
    tiny = memory_needed(10, 1000, 4, 2, 2, 1, 8, 4, 4, offload=True)
    assert tiny["total"] == 2 * 1000 + 2 * 4 * 4 * 2


@pytest.mark.parametrize("family", STREAMED)
def test_streamed_contexts_equal_the_resident_ones(family, tmp_path):
    """Conversion's LayerContext per MoE layer read from the shards: the same experts (biases, activation),
    router weight, k and renormalization as the resident teacher's; one layer materialised at a time."""
    from workers.calibration.streamed import StreamedContexts
    from workers.models.convert import layer_contexts

    full = saved_teacher(tmp_path, family, torch.float64, experts_implementation="eager")
    adapter = get_adapter(full)
    stats = collect_stats(full, adapter, padded_batches(), chunk_tokens=8)
    want = layer_contexts(full, adapter, stats)
    teacher = StreamedTeacher(tmp_path, torch.float64, experts_implementation="eager")
    got = StreamedContexts(teacher, get_adapter(teacher.model), stats)
    assert list(got) == sorted(want)
    for layer, w in want.items():
        g = got[layer]
        assert not teacher.materialised()  # the layer is freed; the context holds the experts alone
        assert (g.top_k, g.renormalized, g.stats) == (w.top_k, w.renormalized, w.stats)
        # exact: both read the same checkpoint bytes (views of them, or copies)
        assert torch.equal(g.router_weight, w.router_weight)
        for name, value in vars(w.experts).items():  # exact: the experts, read from the same bytes
            other = getattr(g.experts, name)
            assert torch.equal(other, value) if isinstance(value, torch.Tensor) else other == value, name
    assert len(teacher.peak[1]) == len({n for n in teacher.peak[1] if n.startswith("model.layers.")})


def test_streamed_convert_stage_writes_the_resident_plans(tmp_path):
    """stage_convert of a streamed calibration (its outputs say `streamed`) plans from contexts read from
    the shards: the same pruned-MoE and dense plans as from the resident teacher."""
    from workers.calibration.calibrate import save_stats
    from workers.run.convert import stage_convert

    full = saved_teacher(tmp_path, "qwen3_moe", torch.float32)
    save_stats(
        collect_stats(full, get_adapter(full), padded_batches(), chunk_tokens=8), tmp_path / "s.safetensors"
    )
    teacher = {"source": "tiny", "dtype": "float32"}
    for params in (
        {"output": "moe", "scoring": "REAP", "K": 4},
        {"scoring": "CP", "grouping": "RR", "dp_scaling": "uniform", "K": 3},
    ):
        plans = {}
        for mode, calib in (("resident", {}), ("streamed", {"streamed": True})):
            work = tmp_path / f"{mode}-{params['K']}"
            work.mkdir()
            payload = {
                "params": {"teacher": teacher, **params},
                "workdir": str(work),
                "home": str(tmp_path),
                "inputs": {
                    "teacher": {"path": str(tmp_path)},
                    "calibrate": {"stats": str(tmp_path / "s.safetensors"), **calib},
                },
            }
            rec = stage_convert(payload, {}, None)
            plans[mode] = (rec["outputs"]["plan_key"], json.loads((work / "plan.json").read_text()))
        assert plans["streamed"] == plans["resident"]


@pytest.mark.parametrize("family", STREAMED)
def test_layer_parameters_of_every_family(family):
    """The largest decoder layer and the input embeddings counted from the config alone equal the built model's
    (Llama4ForCausalLM's get_decoder() is the model itself: the layers are reached through decoder_of)."""
    from families_cases import tiny_config

    model = make_teacher(family)
    layers = model.model.layers
    want = (
        max(sum(p.numel() for p in layer.parameters()) for layer in layers),
        model.get_input_embeddings().weight.numel(),
    )
    assert layer_parameters(tiny_config(family)) == want
