"""Text sources (the embedded corpus, a local JSONL file, a Hugging Face dataset) and token windows.

Instruction data (``format="chat"``) is rendered to text by the teacher tokenizer's chat template, so
a post-trained teacher is calibrated on the format it was trained on. torch is imported only where
windows are made: the sweep schema validates data settings with ``chat_field_error`` without it.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

SOURCES = ("tiny", "jsonl", "hf")
FORMATS = ("text", "chat")


@dataclass
class DataSpec:
    """Where text comes from (orchestrator/spec.py ``Data`` passes its fields through unchanged).

    tiny: ``tiny_dir/corpus/<split>.jsonl`` (split train, valid or test; ``<split>:<domain>``, e.g.
    ``train:code``, keeps one of its domains, prose or code); jsonl: the file ``path``
    (``split`` is not used: the file is the split), field ``text_field``; hf:
    ``datasets.load_dataset(path, name, split=split, streaming=streaming)``, column ``text_field``.
    """

    source: str = "tiny"
    split: str = "train"
    path: str | None = None
    name: str | None = None
    text_field: str = "text"
    streaming: bool = False
    format: str = "text"  # "chat": instruction records rendered by a chat template
    messages_field: str | None = None
    prompt_field: str | None = None
    response_field: str | None = None
    chat_template: str | None = None  # a local Jinja file

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"source={self.source!r}: allowed {', '.join(SOURCES)}")
        if self.source in ("jsonl", "hf") and not self.path:
            raise ValueError(f"path: source {self.source!r} needs a path")
        error = tiny_split_error(self.source, self.split)
        if error:
            raise ValueError(error)
        error = chat_field_error(
            self.source,
            self.format,
            self.messages_field,
            self.prompt_field,
            self.response_field,
            self.chat_template,
        )
        if error:
            raise ValueError(error)


def tiny_split_error(source: str, split: str) -> str | None:
    """The one-line problem with a tiny-corpus split (``<split>`` or ``<split>:<domain>``), or None."""
    if source != "tiny":
        return None
    from workers.core.tiny_corpus import DOMAINS, SPLITS

    name, sep, domain = split.partition(":")
    if name not in SPLITS:
        return f"split={split!r}: the tiny corpus has splits {', '.join(SPLITS)}"
    if sep and domain not in DOMAINS:
        return f"split={split!r}: the tiny corpus has domains {', '.join(DOMAINS)} (<split>:<domain>)"
    return None


def chat_field_error(
    source: str,
    fmt: str,
    messages_field: str | None,
    prompt_field: str | None,
    response_field: str | None,
    chat_template: str | None,
) -> str | None:
    """The one-line problem with a source's chat settings, or None (shared by the sweep schema)."""
    if fmt not in FORMATS:
        return f"format={fmt!r}: allowed {', '.join(FORMATS)}"
    if fmt == "text":
        given = [
            n
            for n, v in (
                ("messages_field", messages_field),
                ("prompt_field", prompt_field),
                ("response_field", response_field),
                ("chat_template", chat_template),
            )
            if v
        ]
        return f"{given[0]}: only with format 'chat'" if given else None
    if source == "tiny":
        return "format: 'chat' reads instruction records from a jsonl or hf source; 'tiny' is plain text"
    if not messages_field and not prompt_field:
        return (
            "messages_field: format 'chat' needs messages_field (a list of {role, content}) or prompt_field"
        )
    if messages_field and prompt_field:
        return "messages_field: give messages_field or prompt_field, not both"
    if response_field and not prompt_field:
        return "response_field: only with prompt_field"
    return None


def load_texts(
    spec: DataSpec,
    tiny_dir: str | None = None,
    max_texts: int | None = None,
    max_chars: int | None = None,
    tok=None,
) -> list[str]:
    """The texts of a source, in the source's order, stopping after ``max_texts`` texts or once
    ``max_chars`` characters are read (so a streamed dataset is never read further than needed).
    ``tok``: the tokenizer whose chat template renders a ``format="chat"`` source (required there).

    Empty or whitespace-only rows are dropped, except for WikiText (``"wikitext"`` in the path):
    its rows are the lines of one text, so they are joined as the dataset holds them,
    ``"\\n\\n".join(rows)`` (the usual WikiText-2 perplexity protocol, as in the HF perplexity guide
    and GPTQ), and returned as one text; the limits then apply to the rows read.
    """
    wikitext = spec.source == "hf" and "wikitext" in str(spec.path).lower() and spec.format == "text"
    texts = list(_limit(_rows(spec, tiny_dir, tok), max_texts, max_chars, keep_empty=wikitext))
    return ["\n\n".join(texts)] if wikitext else texts


def stream_texts(spec: DataSpec, tiny_dir: str | None = None, tok=None) -> Iterator[str]:
    """The non-empty texts of a source, read lazily (a streamed HF dataset is read as it is consumed)."""
    return _limit(_rows(spec, tiny_dir, tok), None, None, keep_empty=False)


def _rows(spec: DataSpec, tiny_dir: str | None, tok=None) -> Iterable[str]:
    if spec.format == "chat":
        render = chat_renderer(spec, tok)
        return (render(row, where) for where, row in _records(spec))
    if spec.source == "tiny":
        if tiny_dir is None:
            raise ValueError("tiny_dir: source 'tiny' needs the tiny teacher's directory")
        from workers.core.tiny_corpus import read_split

        split, _, domain = spec.split.partition(":")
        return (
            r["text"]
            for r in read_split(Path(tiny_dir) / "corpus", split)
            if not domain or r["domain"] == domain
        )
    if spec.source == "jsonl":
        return _jsonl_rows(Path(spec.path), spec.text_field)
    return _hf_rows(spec)


def _limit(
    rows: Iterable[str], max_texts: int | None, max_chars: int | None, keep_empty: bool
) -> Iterator[str]:
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


# ---- instruction records ---------------------------------------------------------------------
def _records(spec: DataSpec) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, record) of a jsonl or hf source, `where` naming the line or row for error messages."""
    if spec.source == "jsonl":
        path = Path(spec.path)
        if not path.is_file():
            raise ValueError(f"path={str(path)!r}: no such JSONL file")
        with open(path, encoding="utf-8") as fh:
            for i, line in enumerate(fh, 1):
                if line.strip():
                    row = json.loads(line)
                    yield f"{path}:{i}", row if isinstance(row, dict) else {}
        return
    import datasets

    ds = datasets.load_dataset(spec.path, spec.name, split=spec.split, streaming=spec.streaming)
    for i, row in enumerate(ds):
        yield f"{spec.path} row {i}", row


def chat_messages(row: dict[str, Any], spec: DataSpec, where: str = "record") -> list[dict[str, str]]:
    """The conversation of one instruction record: its `messages_field`, or a user turn from
    `prompt_field` followed by the assistant's `response_field` when there is one."""
    if spec.messages_field:
        msgs = row.get(spec.messages_field)
        ok = (
            isinstance(msgs, list)
            and msgs
            and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in msgs
            )
        )
        if not ok:
            raise ValueError(
                f"{where}: messages_field {spec.messages_field!r} is missing or not a non-empty "
                "list of {role, content} strings"
            )
        return [{"role": m["role"], "content": m["content"]} for m in msgs]
    fields = [spec.prompt_field] + ([spec.response_field] if spec.response_field else [])
    for name, f in zip(("prompt_field", "response_field"), fields, strict=False):
        if not isinstance(row.get(f), str):
            raise ValueError(f"{where}: {name} {f!r} is missing or not a string")
    msgs = [{"role": "user", "content": row[spec.prompt_field]}]
    if spec.response_field:
        msgs.append({"role": "assistant", "content": row[spec.response_field]})
    return msgs


def chat_renderer(spec: DataSpec, tok) -> Callable[[dict[str, Any], str], str]:
    """record -> text through the chat template of `spec.chat_template` (a file) or else the tokenizer's.

    A conversation that does not end with the assistant gets the generation prompt (what the model
    reads before it answers). No template at all is an error naming `chat_template`.
    """
    if tok is None:
        raise ValueError(
            "format: 'chat' is rendered with the teacher's tokenizer; this data is read without one"
        )
    template = None
    if spec.chat_template:
        path = Path(spec.chat_template)
        if not path.is_file():
            raise ValueError(f"chat_template: no such file {spec.chat_template!r}")
        template = path.read_text(encoding="utf-8")
    elif not getattr(tok, "chat_template", None):
        raise ValueError(
            f"chat_template: tokenizer {tok.name_or_path!r} has no chat template; "
            "set chat_template to a local Jinja file"
        )

    def render(row: dict[str, Any], where: str) -> str:
        msgs = chat_messages(row, spec, where)
        return tok.apply_chat_template(
            msgs,
            chat_template=template,
            tokenize=False,
            add_generation_prompt=msgs[-1]["role"] != "assistant",
        )

    return render


def _hf_rows(spec: DataSpec) -> Iterator[str]:
    import datasets

    ds = datasets.load_dataset(spec.path, spec.name, split=spec.split, streaming=spec.streaming)
    columns = ds.column_names if ds.column_names is not None else [spec.text_field]
    if spec.text_field not in columns:
        raise ValueError(
            f"text_field={spec.text_field!r}: dataset {spec.path} has columns {', '.join(columns)}"
        )
    for row in ds:
        if spec.text_field not in row:
            raise ValueError(
                f"text_field={spec.text_field!r}: not in dataset {spec.path} rows ({', '.join(row)})"
            )
        yield row[spec.text_field]


def token_windows(
    tok, texts: list[str], seq_len: int, n: int | None, seed: int, add_bos: bool = False
) -> torch.Tensor:
    """``n`` token windows of ``seq_len``, as a LongTensor [n, seq_len].

    The texts are tokenized without special tokens and concatenated, each followed by the
    tokenizer's eos id (no separator if it has none); the stream is cut into non-overlapping
    windows of ``seq_len`` tokens (``seq_len - 1`` plus a leading BOS when ``add_bos``); the tail
    shorter than a window is dropped. ``n=None``: all windows in stream order. Otherwise the
    first ``n`` of a permutation seeded by ``seed``; if ``n`` exceeds the number of windows W, the
    permutation is followed by further permutations from the same generator (epochs), so every
    window is used floor(n/W) or ceil(n/W) times.
    """
    import torch

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
    wins = torch.tensor(stream[: count * width], dtype=torch.long).view(count, width)
    if add_bos:
        wins = torch.cat([torch.full((count, 1), bos, dtype=torch.long), wins], dim=1)
    if n is None:
        return wins
    gen = torch.Generator().manual_seed(seed)
    epochs = [torch.randperm(count, generator=gen) for _ in range(-(-n // count))]
    order = torch.cat(epochs) if epochs else torch.zeros(0, dtype=torch.long)
    return wins[order[:n]]


def truncated_sequences(
    tok, texts: list[str], max_len: int, n: int, seed: int, add_bos: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` documents, one per sequence, each truncated to ``max_len`` tokens and right-padded: (ids, mask),
    LongTensors [n, max_len] (the Router KD paper's data: truncation, no packing). Texts are tokenized without
    special tokens (a leading BOS when ``add_bos``); documents of fewer than 2 tokens are dropped; the first
    ``n`` of a permutation seeded by ``seed`` (further permutations when ``n`` exceeds the documents). Padding
    is the tokenizer's pad id, else its eos id, else 0 (the mask marks it)."""
    import torch

    if max_len < 2:
        raise ValueError(f"max_len={max_len}: must be at least 2")
    if n < 1:
        raise ValueError(f"n={n}: must be >= 1")
    bos = tok.bos_token_id
    if add_bos and bos is None:
        raise ValueError("add_bos: the tokenizer has no bos token")
    docs = []
    for ids in tok(list(texts), add_special_tokens=False)["input_ids"] if texts else []:
        ids = ([bos] if add_bos else []) + list(ids)
        if len(ids) >= 2:
            docs.append(ids[:max_len])
    if not docs:
        raise ValueError("texts: no document has 2 tokens or more")
    gen = torch.Generator().manual_seed(seed)
    order = torch.cat([torch.randperm(len(docs), generator=gen) for _ in range(-(-n // len(docs)))])[:n]
    pad = next((t for t in (tok.pad_token_id, tok.eos_token_id) if t is not None), 0)
    ids = torch.full((n, max_len), pad, dtype=torch.long)
    mask = torch.zeros((n, max_len), dtype=torch.long)
    for row, d in enumerate(order.tolist()):
        ids[row, : len(docs[d])] = torch.tensor(docs[d], dtype=torch.long)
        mask[row, : len(docs[d])] = 1
    return ids, mask


def stream_windows(
    tok, texts: Iterable[str], seq_len: int, add_bos: bool = False, docs_per_call: int = 256
) -> Iterator[torch.Tensor]:
    """The windows of ``token_windows(tok, texts, seq_len, None, ...)``, in the same order, made lazily:
    texts are tokenized ``docs_per_call`` at a time and only a window's worth of ids is held, so a
    distillation over a streamed corpus never materialises its token budget."""
    import torch

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
            w = buf[i * width : (i + 1) * width]
            yield torch.tensor([bos, *w] if add_bos else w, dtype=torch.long)
        del buf[: full * width]
