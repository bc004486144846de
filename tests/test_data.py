"""Text sources and token windows (workers/core/data.py)."""

from __future__ import annotations

import json

import pytest
import torch

from workers.core.data import DataSpec, load_texts, token_windows
from workers.tiny.tokenizer import train_tokenizer

DOCS = [
    f"Document {i}: the quick brown fox jumps over the lazy dog {i} times.\n" * (1 + i % 3) for i in range(40)
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return train_tokenizer(DOCS, 300, tmp_path_factory.mktemp("tok"))


def _stream(tok, texts):
    out = []
    for t in texts:
        out += tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return out


def test_windows_all_in_order(tok):
    stream = _stream(tok, DOCS)
    w = token_windows(tok, DOCS, 16, None, seed=0)
    assert w.dtype == torch.long and w.shape == (len(stream) // 16, 16)
    assert w.flatten().tolist() == stream[: w.numel()]  # docs separated by eos, tail dropped
    assert (w == tok.eos_token_id).sum() >= len(DOCS) - 2


def test_windows_seeded_subset(tok):
    allw = token_windows(tok, DOCS, 16, None, seed=0)
    a = token_windows(tok, DOCS, 16, 10, seed=3)
    # exact: token ids (integers), drawn by the same seed
    assert a.shape == (10, 16) and torch.equal(a, token_windows(tok, DOCS, 16, 10, seed=3))
    assert not torch.equal(a, token_windows(tok, DOCS, 16, 10, seed=4))
    rows = {tuple(r) for r in allw.tolist()}
    assert all(tuple(r) in rows for r in a.tolist())
    assert len({tuple(r) for r in a.tolist()}) == 10  # no repeats while n <= W
    assert token_windows(tok, DOCS, 16, 0, seed=0).shape == (0, 16)


def test_windows_repeat_rule(tok):
    allw = token_windows(tok, DOCS, 16, None, seed=0)
    W = len(allw)
    n = 2 * W + 3
    w = token_windows(tok, DOCS, 16, n, seed=1)
    assert w.shape == (n, 16)
    from collections import Counter

    have, base = Counter(map(tuple, w.tolist())), Counter(map(tuple, allw.tolist()))
    assert set(have) == set(base)  # every window is used ...
    assert all(2 * m <= have[r] <= 3 * m for r, m in base.items())  # ... floor(n/W) or ceil(n/W) times


def test_windows_add_bos(tok):
    w = token_windows(tok, DOCS, 16, 5, seed=0, add_bos=True)
    assert w.shape == (5, 16) and (w[:, 0] == tok.bos_token_id).all()
    stream = _stream(tok, DOCS)
    allw = token_windows(tok, DOCS, 16, None, seed=0, add_bos=True)
    assert allw[1, 1:].tolist() == stream[15:30]  # seq_len - 1 text tokens per window


def test_windows_errors(tok):
    with pytest.raises(ValueError, match="no window"):
        token_windows(tok, ["short"], 512, 4, seed=0)
    with pytest.raises(ValueError, match="seq_len"):
        token_windows(tok, DOCS, 1, 4, seed=0)


def test_load_tiny(tmp_path):
    (tmp_path / "corpus").mkdir()
    for split in ("train", "valid", "test"):
        rows = [{"text": f"{split} {i}", "domain": "prose"} for i in range(3)]
        (tmp_path / "corpus" / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert load_texts(DataSpec(source="tiny", split="valid"), tiny_dir=str(tmp_path)) == [
        "valid 0",
        "valid 1",
        "valid 2",
    ]
    assert load_texts(DataSpec(split="test"), tiny_dir=str(tmp_path), max_texts=2) == ["test 0", "test 1"]
    with pytest.raises(ValueError, match="split"):
        load_texts(DataSpec(split="validation"), tiny_dir=str(tmp_path))
    with pytest.raises(ValueError, match="tiny_dir"):
        load_texts(DataSpec())


def test_load_jsonl(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(
        "".join(json.dumps({"body": t, "id": i}) + "\n" for i, t in enumerate(["aaa", "", "bbbb", "cc"]))
    )
    spec = DataSpec(source="jsonl", path=str(path), text_field="body")
    assert load_texts(spec) == ["aaa", "bbbb", "cc"]  # empty rows dropped
    assert load_texts(spec, max_chars=5) == ["aaa", "bbbb"]  # stops once 5 chars are read
    with pytest.raises(ValueError, match="text_field 'text'"):
        load_texts(DataSpec(source="jsonl", path=str(path)))
    with pytest.raises(ValueError, match="path"):
        DataSpec(source="jsonl")
    with pytest.raises(ValueError, match="source"):
        DataSpec(source="web")


@pytest.mark.parametrize("streaming", [False, True])
def test_load_hf_local(tmp_path, streaming):
    d = tmp_path / "mydata"
    d.mkdir()
    (d / "train.jsonl").write_text(
        "".join(json.dumps({"text": t}) + "\n" for t in ["one", " ", "two", "three"])
    )
    spec = DataSpec(source="hf", path=str(d), split="train", streaming=streaming)
    assert load_texts(spec) == ["one", "two", "three"]
    assert load_texts(spec, max_texts=2) == ["one", "two"]
    with pytest.raises(ValueError, match="text_field"):
        load_texts(DataSpec(source="hf", path=str(d), split="train", streaming=streaming, text_field="body"))


def test_load_hf_wikitext_protocol(tmp_path):
    d = tmp_path / "wikitext_local"
    d.mkdir()
    lines = ["", " = Title = \n", "", " First paragraph . \n", " Second paragraph . \n"]
    (d / "test.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
    texts = load_texts(DataSpec(source="hf", path=str(d), split="test"))
    assert texts == ["\n\n".join(lines)]  # rows joined as the dataset holds them, empty lines included


def test_stream_windows_equal_token_windows_in_order(tmp_path):
    """The lazy windows a streamed distillation uses are exactly token_windows(..., n=None), in order."""
    from workers.core.data import stream_windows

    texts = [f"document {i}: " + " ".join(f"word{j * i % 17}" for j in range(5 + i % 13)) for i in range(60)]
    tok = train_tokenizer(texts, 320, tmp_path / "tok")
    for add_bos in (False, True):
        ref = token_windows(tok, texts, 16, None, 0, add_bos=add_bos)
        lazy = list(stream_windows(tok, iter(texts), 16, add_bos=add_bos, docs_per_call=7))
        assert len(lazy) == len(ref) and torch.equal(torch.stack(lazy), ref)  # exact: token ids (integers)


class _CharTok:
    """One token per character (its code point), no special tokens unless asked."""

    bos_token_id, eos_token_id, pad_token_id = 1, 2, None

    def __call__(self, texts, add_special_tokens=False):
        assert add_special_tokens is False
        return {"input_ids": [[ord(c) for c in t] for t in texts]}


def test_truncated_sequences_are_one_document_each_cut_and_right_padded():
    from workers.core.data import truncated_sequences

    texts = ["abcdefgh", "xy", "q", "hello"]  # "q" has one token: dropped
    ids, mask = truncated_sequences(_CharTok(), texts, max_len=5, n=3, seed=0)
    assert ids.shape == mask.shape == (3, 5)
    rows = {
        "".join(chr(t) for t, m in zip(r.tolist(), k.tolist(), strict=True) if m)
        for r, k in zip(ids, mask, strict=True)
    }
    assert rows == {"abcde", "xy", "hello"}  # each its own document, the long one truncated
    for r, k in zip(ids.tolist(), mask.tolist(), strict=True):
        n_real = sum(k)
        assert k == [1] * n_real + [0] * (5 - n_real)  # right padding
        assert r[n_real:] == [2] * (5 - n_real)  # padded with eos where there is no pad id
    again, _ = truncated_sequences(_CharTok(), texts, max_len=5, n=3, seed=0)
    assert torch.equal(again, ids)  # exact: integer token ids, the same seeded permutation
    more, more_mask = truncated_sequences(
        _CharTok(), texts, max_len=5, n=7, seed=1
    )  # 7 > 3 documents: epochs
    counts = sorted(int(k.sum()) for k in more_mask)
    assert counts.count(5) >= 2 and counts.count(2) >= 2
    with_bos, _ = truncated_sequences(_CharTok(), ["ab"], max_len=4, n=1, seed=0, add_bos=True)
    assert with_bos.tolist() == [[1, ord("a"), ord("b"), 2]]
    with pytest.raises(ValueError, match="no document has 2 tokens"):
        truncated_sequences(_CharTok(), ["a", "b"], max_len=4, n=1, seed=0)
