"""workers.evaluation.ppl's chunked head and compiled layers: the perplexity from the decoder's final hidden
states, head applied per chunk of tokens, equals the model's own logits path on every family's tiny teacher
and dense student (float64), with padding of short windows, a BOS prefix and scaled or softcapped heads;
never a [B, T, V] tensor; compiled layers equal eager and are reused across students."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch.overrides import TorchFunctionMode

import workers.evaluation.ppl as ppl_mod
from tests.families_cases import DENSE_FAMILIES, FAMILIES, V, make_teacher
from workers.evaluation.ppl import compile_setting, output_head, perplexity

PROTOCOLS = [  # (windows, add_bos, seq_len): 53 text tokens leave a short last window / block in each
    ("disjoint", False, 12),
    ("disjoint", True, 12),
    ("rolling", True, 10),
]
RTOL, ATOL = 1e-6, 1e-9  # float64 models; both paths take float32 log-softmax of the same logits


class Tok:
    """What perplexity() reads of a tokenizer when it is given the token ids."""

    bos_token_id, eos_token_id, name_or_path = 1, 2, "stand-in"

    def get_vocab(self) -> dict[str, int]:
        return {f"t{i}": i for i in range(V)}


def text(n: int = 53, seed: int = 0, vocab: int = V) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def both_paths(model, windows: str, add_bos: bool, seq_len: int, **kw) -> tuple[dict, dict]:
    args = dict(seq_len=seq_len, batch_size=3, add_bos=add_bos, device="cpu", windows=windows, ids=text())
    chunked = perplexity(model, Tok(), [], **args, **kw)
    full = perplexity(model, Tok(), [], **args, full_logits=True)
    return chunked, full


def assert_same(chunked: dict, full: dict) -> None:
    assert chunked["protocol"]["head"] == "chunked from final hidden states"
    assert full["protocol"]["head"] == "model logits"
    assert chunked["window_tokens"] == full["window_tokens"]
    torch.testing.assert_close(
        torch.tensor(chunked["window_nll"]), torch.tensor(full["window_nll"]), rtol=RTOL, atol=ATOL
    )
    assert chunked["sum_nll"] == pytest.approx(full["sum_nll"], rel=RTOL)


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 5 tokens: they cut across windows and leave a remainder."""
    monkeypatch.setattr(ppl_mod, "_CHUNK_ELEMENTS", 5 * V)


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_head_equals_the_models_logits_on_every_family(family, small_chunks):
    model = make_teacher(family, dtype=torch.float64, experts_implementation="eager")
    for windows, add_bos, seq_len in PROTOCOLS:
        chunked, full = both_paths(model, windows, add_bos, seq_len)
        assert_same(chunked, full)
        assert len(set(chunked["window_tokens"])) > 1, "a window scores fewer positions than the others"


@pytest.mark.parametrize("family", DENSE_FAMILIES)
def test_chunked_head_equals_the_models_logits_on_every_dense_student(family, small_chunks):
    from transformers import AutoModelForCausalLM

    from workers.families import get_adapter

    teacher = make_teacher(family)
    torch.manual_seed(0)
    config = get_adapter(teacher).student_config(teacher, 16)
    student = AutoModelForCausalLM.from_config(config, experts_implementation="eager")
    student = student.to(torch.float64).eval()
    chunked, full = both_paths(student, "disjoint", True, 12)
    assert_same(chunked, full)


def hand_nll(model, seq: list[int], n: int) -> float:
    """Σ -log p of a window's last n tokens from the model's logits in float64, one window alone."""
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([seq[:-1]]), use_cache=False).logits[0].double(), -1)
    return -float(logp[-n:].gather(1, torch.tensor(seq[-n:])[:, None]).sum())


@pytest.mark.parametrize(
    "family, field, value, neutral",
    [
        ("cohere2_moe", "logit_scale", 2.0, 1.0),  # logits · scale
        ("granitemoe", "logits_scaling", 0.5, 1.0),  # logits / scaling
        ("beam", "final_logit_softcapping", 0.75, None),  # cap · tanh(logits / cap)
    ],
)
def test_the_head_keeps_the_models_logit_scaling_and_softcap(family, field, value, neutral, small_chunks):
    model = make_teacher(family, dtype=torch.float64, experts_implementation="eager", **{field: value})
    head = output_head(model)
    assert (head.mul, head.div, head.cap) == tuple(
        value if f == field else None for f in ("logit_scale", "logits_scaling", "final_logit_softcapping")
    )
    chunked, full = both_paths(model, "disjoint", True, 12)
    assert_same(chunked, full)
    seq = [1, *text()[:11]]
    assert chunked["window_nll"][0] == pytest.approx(hand_nll(model, seq, 11), rel=RTOL)
    # the factor matters: the same weights without it score otherwise
    plain = make_teacher(family, dtype=torch.float64, experts_implementation="eager", **{field: neutral})
    other = perplexity(plain, Tok(), [], seq_len=12, batch_size=3, add_bos=True, device="cpu", ids=text())
    assert abs(other["sum_nll"] - chunked["sum_nll"]) > 0.01 * chunked["sum_nll"]


class WidestVocabTensor(TorchFunctionMode):
    """The most rows any tensor of vocabulary width (last dim V) that a torch function returns has."""

    def __init__(self):
        super().__init__()
        self.rows = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.dim() >= 2 and out.shape[-1] == V:
            self.rows = max(self.rows, out.numel() // V)
        return out


def test_no_tensor_of_every_position_times_the_vocabulary(small_chunks):
    model = make_teacher("qwen3_moe", dtype=torch.float64, experts_implementation="eager")
    args = dict(seq_len=12, batch_size=4, add_bos=False, device="cpu", ids=text())
    calls = []
    model.get_output_embeddings().register_forward_hook(lambda *a: calls.append("lm_head"))
    with WidestVocabTensor() as chunked:
        perplexity(model, Tok(), [], **args)
    assert calls == [] and chunked.rows == 5  # no lm_head call; the widest: one chunk of 5 tokens
    with WidestVocabTensor() as full:
        perplexity(model, Tok(), [], **args, full_logits=True)
    assert calls and full.rows == 4 * 11  # the check sees the logits path's [B, T, V]


def test_a_model_without_a_linear_head_is_scored_from_its_logits():
    class Logits(torch.nn.Module):  # no decoder, no output embedding: only logits
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def forward(self, input_ids, use_cache=False):
            return SimpleNamespace(logits=torch.zeros(*input_ids.shape, V))

    r = perplexity(Logits(), Tok(), [], seq_len=12, batch_size=2, add_bos=False, device="cpu", ids=text())
    assert r["protocol"]["head"] == "model logits" and r["ppl"] == pytest.approx(V, rel=1e-6)
    assert output_head(Logits()) is None


def test_compile_setting():
    assert compile_setting("auto", "cpu") is False and compile_setting("auto", "cuda") is True
    assert compile_setting(True, "cpu") is True and compile_setting(False, "cuda") is False
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="ppl.compile must be 'auto', true or false, got"):
            compile_setting(bad, "cpu")


def test_a_bad_compile_setting_in_a_sweep_is_one_line(tmp_path):
    import yaml

    from orchestrator.schema import SpecError
    from orchestrator.spec import load_spec
    from tests.test_orchestrator import fake_sweep
    from tests.test_sweep_errors import BASE

    for value, ok in (("auto", True), (True, True), (False, True), ("yes", False), (1, False)):
        raw = {**BASE, "ppl": {"compile": value}}
        sweep = fake_sweep(tmp_path, yaml.safe_dump(raw, sort_keys=False))
        if ok:
            assert load_spec(str(sweep))[0].ppl.compile == value
            continue
        with pytest.raises(SpecError) as e:
            load_spec(str(sweep))
        line = str(e.value)
        assert "\n" not in line and line.endswith(
            f"ppl.compile: must be 'auto', true or false, got {value!r}"
        )


def test_compiled_layers_equal_eager_and_are_reused_by_the_next_student():
    """Inductor on this CPU: one compile of the layer class (and of the head chunk) serves every layer of
    the first student and all of a second, new instance of the same architecture."""
    from torch._dynamo.utils import counters
    from transformers import Qwen3Config, Qwen3ForCausalLM

    def student(seed: int):
        torch.manual_seed(seed)
        return Qwen3ForCausalLM(
            Qwen3Config(
                vocab_size=V,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=3,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=8,
                max_position_embeddings=64,
                tie_word_embeddings=False,
            )
        ).eval()

    args = dict(seq_len=16, batch_size=2, add_bos=True, device="cpu", ids=text(60), max_windows=4)
    results = []
    for seed in (0, 1):
        model = student(seed)
        eager = perplexity(model, Tok(), [], **args)
        graphs = counters["stats"]["unique_graphs"]
        compiled = perplexity(model, Tok(), [], **args, compile_layers=True)
        results.append(counters["stats"]["unique_graphs"] - graphs)
        assert compiled["protocol"]["compiled_layers"] == 3 and eager["protocol"]["compiled_layers"] == 0
        assert not any("forward" in vars(layer) for layer in model.model.layers), "eager forward restored"
        torch.testing.assert_close(
            torch.tensor(compiled["window_nll"]), torch.tensor(eager["window_nll"]), rtol=1e-5, atol=1e-5
        )
        assert math.isfinite(compiled["ppl"])
    assert results[0] >= 2, "the first student's layers and head chunk were compiled (not run eagerly)"
    assert results[1] == 0, f"the second student compiled {results[1]} new graphs"
