"""workers.evaluation.ppl: the perplexity protocol, checked against a hand computation and lm-eval's rolling loglikelihood."""

from __future__ import annotations

import inspect
import json
import math
import textwrap
from types import SimpleNamespace

import pytest
import torch
from tiny_qwen3 import dense_qwen3, moe_qwen3

from workers.evaluation.ppl import make_windows, perplexity
from workers.tiny.tokenizer import train_tokenizer


def corpus() -> list[str]:
    return [
        inspect.getdoc(m) for m in (json, math, textwrap, inspect, json.dumps, textwrap.wrap, inspect.getdoc)
    ]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return train_tokenizer(corpus(), 512, tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def model(tok):
    return dense_qwen3(len(tok), 0, max_positions=128)


@pytest.fixture(scope="module")
def texts():
    return corpus()[3:6]


def ids_of(tok, texts):
    return tok("\n\n".join(texts), add_special_tokens=False)["input_ids"]


def hand_nll(model, seqs: list[list[int]], n_scored: list[int]) -> float:
    """Σ -log p one window at a time, straight from logits (no batching, no chunking)."""
    total = 0.0
    for seq, n in zip(seqs, n_scored, strict=True):
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([seq])).logits[0].double(), -1)
        pos = torch.arange(len(seq) - n, len(seq))
        total -= float(logp[pos - 1, torch.tensor(seq)[pos]].sum())
    return total


def test_disjoint_without_bos_scores_every_token_after_the_first_of_each_window(tok, model, texts):
    ids = ids_of(tok, texts)
    L = 32
    wins = [ids[s : s + L] for s in range(0, len(ids), L)]
    wins = [w for w in wins if len(w) >= 2]
    assert len(ids) % L >= 2, "the text should end in a partial window (it is kept)"
    r = perplexity(model, tok, texts, seq_len=L, batch_size=3, add_bos=False, device="cpu")
    assert r["n_tokens"] == sum(len(w) - 1 for w in wins) == len(ids) - len(wins)
    assert r["sum_nll"] == pytest.approx(hand_nll(model, wins, [len(w) - 1 for w in wins]), rel=1e-6)
    assert r["ppl"] == pytest.approx(math.exp(r["sum_nll"] / r["n_tokens"]), rel=1e-12)
    assert r["value_kind"] == "finite"
    p = r["protocol"]
    assert (p["seq_len"], p["add_bos"], p["windows"], p["n_windows"]) == (L, False, "disjoint", len(wins))
    assert p["text_tokens"] == len(ids) and len(p["tokenizer_sha"]) == 64 and "first" in p["window_rule"]


def test_disjoint_with_bos_scores_every_text_token_and_never_bos(tok, model, texts):
    ids = ids_of(tok, texts)
    L = 32
    bos = tok.bos_token_id
    wins = [[bos, *ids[s : s + L - 1]] for s in range(0, len(ids), L - 1)]
    r = perplexity(model, tok, texts, seq_len=L, batch_size=4, add_bos=True, device="cpu")
    assert r["n_tokens"] == len(ids)
    assert r["sum_nll"] == pytest.approx(hand_nll(model, wins, [len(w) - 1 for w in wins]), rel=1e-6)
    assert r["protocol"]["prefix_token_id"] == bos and r["protocol"]["n_windows"] == len(wins)


def test_rolling_equals_lm_eval_loglikelihood_rolling(tok, model, texts):
    """windows='rolling' reproduces lm-eval's loglikelihood_rolling with max_length = seq_len (same text, model)."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    doc = "\n\n".join(texts)
    for L, bs in ((32, 5), (57, 2)):
        lm = HFLM(pretrained=model, tokenizer=tok, max_length=L, batch_size=bs)
        (ll,) = lm.loglikelihood_rolling(
            [Instance("loglikelihood_rolling", {}, (doc,), 0)], disable_tqdm=True
        )
        r = perplexity(
            model, tok, [doc], seq_len=L, batch_size=3, add_bos=True, device="cpu", windows="rolling"
        )
        assert r["n_tokens"] == len(ids_of(tok, texts))  # every token once, the first from the prefix
        assert r["sum_nll"] == pytest.approx(-ll, rel=1e-6, abs=1e-3)
    # a text shorter than one window: one window, prefix + all tokens
    short = texts[0][:60]
    lm = HFLM(pretrained=model, tokenizer=tok, max_length=128, batch_size=1)
    (ll,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (short,), 0)], disable_tqdm=True)
    r = perplexity(
        model, tok, [short], seq_len=128, batch_size=1, add_bos=True, device="cpu", windows="rolling"
    )
    assert r["protocol"]["n_windows"] == 1 and r["sum_nll"] == pytest.approx(-ll, rel=1e-6)


def test_rolling_windows_cover_each_token_once_with_lm_eval_inputs():
    ids = list(range(100, 123))  # 23 tokens, seq_len 5 -> blocks 5,5,5,5,3
    wins = make_windows(ids, 5, prefix=0, windows="rolling")
    assert [n for _, n in wins] == [5, 5, 5, 5, 3]
    assert (
        wins[0][0] == [0, *ids[:5]] and wins[1][0] == ids[4:10]
    )  # previous block's last token starts the input
    assert wins[-1][0] == ids[-6:]  # the partial block keeps a full-length input
    scored = [t for seq, n in wins for t in seq[-n:]]
    assert scored == ids


def test_batch_size_and_max_windows(tok, model, texts):
    a = perplexity(model, tok, texts, seq_len=24, batch_size=1, add_bos=False, device="cpu")
    b = perplexity(model, tok, texts, seq_len=24, batch_size=16, add_bos=False, device="cpu")
    assert a["n_tokens"] == b["n_tokens"] and a["sum_nll"] == pytest.approx(b["sum_nll"], rel=1e-6)
    c = perplexity(model, tok, texts, seq_len=24, batch_size=2, add_bos=False, device="cpu", max_windows=3)
    assert c["n_tokens"] == 3 * 23 and c["protocol"]["n_windows"] == 3
    assert c["protocol"]["n_windows_total"] == a["protocol"]["n_windows"] > 3


def test_moe_teacher_and_training_flag(tok, texts):
    moe = moe_qwen3(len(tok), 1, max_positions=128)
    moe.train()
    r = perplexity(moe, tok, texts, seq_len=40, batch_size=4, add_bos=True, device="cpu")
    assert moe.training, "the caller's training flag is restored"
    moe.eval()
    ids = ids_of(tok, texts)
    wins = [[tok.bos_token_id, *ids[s : s + 39]] for s in range(0, len(ids), 39)]
    assert r["sum_nll"] == pytest.approx(hand_nll(moe, wins, [len(w) - 1 for w in wins]), rel=1e-6)
    # an untrained model with vocab V sits near ln V nats per token
    assert abs(r["sum_nll"] / r["n_tokens"] - math.log(len(tok))) < 0.5


class Fixed(torch.nn.Module):
    """A 'model' whose logits are given: for inf/nan handling."""

    def __init__(self, fill):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.fill = fill

    def forward(self, input_ids, use_cache=False):
        return SimpleNamespace(logits=self.fill(input_ids))


def test_non_finite_values_are_kept_explicit(tok, texts):
    V = len(tok)

    def fixed_ppl(fill) -> dict:
        return perplexity(Fixed(fill), tok, texts, seq_len=16, batch_size=4, add_bos=False, device="cpu")

    def minus_inf_on_targets(ids):  # the true next token gets probability 0
        logits = torch.zeros(*ids.shape, V)
        logits[:, :-1].scatter_(2, ids[:, 1:, None], -math.inf)
        logits[:, -1] = -math.inf
        logits[:, -1, 0] = 0.0  # keep the unscored last position finite
        return logits

    r = fixed_ppl(minus_inf_on_targets)
    assert r["value_kind"] == "inf" and math.isinf(r["ppl"]) and math.isinf(r["sum_nll"])
    r = fixed_ppl(lambda ids: torch.full((*ids.shape, V), math.nan))
    assert r["value_kind"] == "nan" and math.isnan(r["ppl"])

    def confident_and_wrong(ids):  # NLL ~ 2000 nats per token: exp overflows although Σ NLL is finite
        logits = torch.zeros(*ids.shape, V)
        logits[..., 1] = 2000.0
        return logits

    r = fixed_ppl(confident_and_wrong)
    assert math.isfinite(r["sum_nll"]) and r["value_kind"] == "inf" and r["ppl"] == math.inf
    uniform = fixed_ppl(lambda ids: torch.zeros(*ids.shape, V))
    assert uniform["ppl"] == pytest.approx(V, rel=1e-5)  # uniform prediction: PPL = vocabulary size


def test_bad_input(tok, model, texts):
    with pytest.raises(ValueError, match="seq_len"):
        perplexity(model, tok, texts, seq_len=1, batch_size=1, add_bos=False, device="cpu")
    with pytest.raises(ValueError, match="windows must be one of disjoint, rolling"):
        perplexity(model, tok, texts, seq_len=8, batch_size=1, add_bos=False, device="cpu", windows="sliding")
    with pytest.raises(ValueError, match="add_bos=True"):
        perplexity(model, tok, texts, seq_len=8, batch_size=1, add_bos=False, device="cpu", windows="rolling")
    with pytest.raises(ValueError, match="too few"):
        perplexity(model, tok, ["a"], seq_len=8, batch_size=1, add_bos=False, device="cpu")
