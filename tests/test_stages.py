"""Stage glue that is not covered end to end by the micro sweep."""

from transformers import AutoModelForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from workers.families import get_adapter
from workers.run.distill import _processes
from workers.run.students import moe_student_params


def test_d2d_target_of_a_real_moe_comes_from_its_config_alone(tmp_path):
    cfg = Qwen3MoeConfig(
        vocab_size=256,
        hidden_size=32,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_experts=8,
        num_experts_per_tok=2,
        head_dim=16,
    )
    teacher = Qwen3MoeForCausalLM(cfg)
    teacher.save_pretrained(tmp_path)
    n = moe_student_params({"params": {"moe_teacher": {"source": "hf", "model": str(tmp_path)}}})
    adapter = get_adapter(teacher)
    student = AutoModelForCausalLM.from_config(adapter.student_config(teacher, 2 * 16))  # k * d_expert
    assert n == sum(p.numel() for p in student.parameters())
    assert moe_student_params({"params": {"moe_teacher": {"source": "tiny"}}}) is None


def test_processes_setting(monkeypatch):
    import torch

    assert _processes(1) == 1 and _processes(3) == 3 and _processes("2") == 2
    for gpus, procs in ((0, 1), (1, 1), (4, 4)):  # "gpus": one process per visible GPU, at least one
        monkeypatch.setattr(torch.cuda, "device_count", lambda gpus=gpus: gpus)
        assert _processes("gpus") == procs


def test_streamed_training_data_is_batched_in_stream_order(tmp_path):
    import json

    import torch

    from workers.core.data import token_windows
    from workers.run.common import _train_batches
    from workers.tiny.tokenizer import train_tokenizer
    from workers.training.distill import DistillSpec

    texts = [f"row {i} " + "alpha beta gamma delta " * (1 + i % 5) for i in range(80)]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    tok = train_tokenizer(texts, 300, tmp_path / "tok")
    spec = DistillSpec(steps=3, batch_size=2, seq_len=16)
    payload = {"params": {"data": {"source": "jsonl", "path": str(path), "streaming": True}}, "inputs": {}}
    batches = list(_train_batches(payload, {}, tok, spec, n_train=6))
    assert [b.shape for b in batches] == [(2, 16)] * 3
    assert torch.equal(torch.cat(batches), token_windows(tok, texts, 16, None, 0)[:6])  # exact: token ids
