"""Text sources (the embedded corpus, a local JSONL file, a Hugging Face dataset) and token windows."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

SOURCES = ("tiny", "jsonl", "hf")


@dataclass
class DataSpec:
    """Where text comes from (orchestrator/spec.py ``Data`` passes its fields through unchanged).

    tiny: ``tiny_dir/corpus/<split>.jsonl`` (split train, valid or test); jsonl: the file ``path``
    (``split`` is not used: the file is the split), field ``text_field``; hf:
    ``datasets.load_dataset(path, name, split=split, streaming=streaming)``, column ``text_field``.
    """

    source: str = "tiny"
    split: str = "train"
    path: str | None = None
    name: str | None = None
    text_field: str = "text"
    streaming: bool = False

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"source={self.source!r}: allowed {', '.join(SOURCES)}")
        if self.source in ("jsonl", "hf") and not self.path:
            raise ValueError(f"path: source {self.source!r} needs a path")


def load_texts(spec: DataSpec, tiny_dir: str | None = None, max_texts: int | None = None,
               max_chars: int | None = None) -> list[str]:
    """The texts of a source, in the source's order, stopping after ``max_texts`` texts or once
    ``max_chars`` characters are read (so a streamed dataset is never read further than needed).

    Empty or whitespace-only rows are dropped, except for WikiText (``"wikitext"`` in the path):
    its rows are the lines of one text, so they are joined as the dataset holds them,
    ``"\\n\\n".join(rows)`` (the usual WikiText-2 perplexity protocol, as in the HF perplexity guide
    and GPTQ), and returned as one text; the limits then apply to the rows read.
    """
    wikitext = spec.source == "hf" and "wikitext" in str(spec.path).lower()
    texts = list(_limit(_rows(spec, tiny_dir), max_texts, max_chars, keep_empty=wikitext))
    return ["\n\n".join(texts)] if wikitext else texts


def stream_texts(spec: DataSpec, tiny_dir: str | None = None) -> Iterator[str]:
    """The non-empty texts of a source, read lazily (a streamed HF dataset is read as it is consumed)."""
    return _limit(_rows(spec, tiny_dir), None, None, keep_empty=False)


def _rows(spec: DataSpec, tiny_dir: str | None) -> Iterable[str]:
    if spec.source == "tiny":
        if tiny_dir is None:
            raise ValueError("tiny_dir: source 'tiny' needs the tiny teacher's directory")
        from workers.tiny.corpus import read_split

        return (r["text"] for r in read_split(Path(tiny_dir) / "corpus", spec.split))
    if spec.source == "jsonl":
        return _jsonl_rows(Path(spec.path), spec.text_field)
    return _hf_rows(spec)


def _limit(rows: Iterable[str], max_texts: int | None, max_chars: int | None, keep_empty: bool) -> Iterator[str]:
    n = chars = 0
    for text in rows:
        if max_texts is not None and n >= max_texts or max_chars is not None and chars >= max_chars:
            return
        if not keep_empty and not text.strip():
            continue
        n += 1
        chars += len(text)
        yield text


def _jsonl_rows(path: Path, field: str) -> Iterator[str]:
    if not path.is_file():
        raise ValueError(f"path={str(path)!r}: no such JSONL file")
    with open(path, encoding="utf-8") as fh:
        for i, line in enumerate(fh, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row, dict) or not isinstance(row.get(field), str):
                raise ValueError(f"{path}:{i}: text_field {field!r} is missing or not a string")
            yield row[field]


def _hf_rows(spec: DataSpec) -> Iterator[str]:
    import datasets

    ds = datasets.load_dataset(spec.path, spec.name, split=spec.split, streaming=spec.streaming)
    columns = ds.column_names if ds.column_names is not None else [spec.text_field]
    if spec.text_field not in columns:
        raise ValueError(f"text_field={spec.text_field!r}: dataset {spec.path} has columns {', '.join(columns)}")
    for row in ds:
        if spec.text_field not in row:
            raise ValueError(f"text_field={spec.text_field!r}: not in dataset {spec.path} rows ({', '.join(row)})")
        yield row[spec.text_field]


def token_windows(tok, texts: list[str], seq_len: int, n: int | None, seed: int,
                  add_bos: bool = False) -> torch.Tensor:
    """``n`` token windows of ``seq_len``, as a LongTensor [n, seq_len].

    The texts are tokenized without special tokens and concatenated, each followed by the
    tokenizer's eos id (no separator if it has none); the stream is cut into non-overlapping
    windows of ``seq_len`` tokens (``seq_len - 1`` plus a leading BOS when ``add_bos``); the tail
    shorter than a window is dropped. ``n=None``: all windows in stream order. Otherwise the
    first ``n`` of a permutation seeded by ``seed``; if ``n`` exceeds the number of windows W, the
    permutation is followed by further permutations from the same generator (epochs), so every
    window is used floor(n/W) or ceil(n/W) times.
    """
    if seq_len < 2:
        raise ValueError(f"seq_len={seq_len}: must be at least 2")
    if n is not None and n < 0:
        raise ValueError(f"n={n}: must be >= 0 or None")
    bos = tok.bos_token_id
    if add_bos and bos is None:
        raise ValueError("add_bos: the tokenizer has no bos token")
    eos = tok.eos_token_id
    stream: list[int] = []
    for ids in tok(list(texts), add_special_tokens=False)["input_ids"] if texts else []:
        stream.extend(ids)
        if eos is not None:
            stream.append(eos)
    width = seq_len - 1 if add_bos else seq_len
    count = len(stream) // width
    if count == 0:
        raise ValueError(f"texts: {len(stream)} tokens give no window of {width} tokens (seq_len={seq_len})")
    wins = torch.tensor(stream[:count * width], dtype=torch.long).view(count, width)
    if add_bos:
        wins = torch.cat([torch.full((count, 1), bos, dtype=torch.long), wins], dim=1)
    if n is None:
        return wins
    gen = torch.Generator().manual_seed(seed)
    epochs = [torch.randperm(count, generator=gen) for _ in range(-(-n // count))]
    order = torch.cat(epochs) if epochs else torch.zeros(0, dtype=torch.long)
    return wins[order[:n]]


def stream_windows(tok, texts: Iterable[str], seq_len: int, add_bos: bool = False,
                   docs_per_call: int = 256) -> Iterator[torch.Tensor]:
    """The windows of ``token_windows(tok, texts, seq_len, None, ...)``, in the same order, made lazily:
    texts are tokenized ``docs_per_call`` at a time and only a window's worth of ids is held, so a
    distillation over a streamed corpus never materialises its token budget."""
    if seq_len < 2:
        raise ValueError(f"seq_len={seq_len}: must be at least 2")
    bos, eos = tok.bos_token_id, tok.eos_token_id
    if add_bos and bos is None:
        raise ValueError("add_bos: the tokenizer has no bos token")
    width = seq_len - 1 if add_bos else seq_len
    buf: list[int] = []
    it = iter(texts)
    while chunk := list(itertools.islice(it, docs_per_call)):
        for ids in tok(chunk, add_special_tokens=False)["input_ids"]:
            buf.extend(ids)
            if eos is not None:
                buf.append(eos)
        full = len(buf) // width
        for i in range(full):
            w = buf[i * width:(i + 1) * width]
            yield torch.tensor([bos, *w] if add_bos else w, dtype=torch.long)
        del buf[:full * width]
