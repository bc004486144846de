"""A byte-level BPE tokenizer trained on the tiny corpus (feasibility.md §3), saved as a HF fast tokenizer."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

EOS = "<|endoftext|>"  # also BOS and UNK
PAD = "<|pad|>"
MODEL_MAX_LENGTH = 2048


def train_tokenizer(texts: Iterable[str], vocab: int, out: Path):
    """Train a byte-level BPE of ``vocab`` entries on ``texts``; save it to ``out``; return the fast tokenizer.

    Byte-level: every string encodes (no unknown token is ever produced) and decodes back exactly.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab < 300:
        raise ValueError(f"vocab={vocab}: must be at least 300 (256 bytes + special tokens + merges)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        min_frequency=2,
        special_tokens=[EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS,
        eos_token=EOS,
        unk_token=EOS,
        pad_token=PAD,
        model_max_length=MODEL_MAX_LENGTH,
    )
    Path(out).mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    return fast


def tokenizer_hash(path: Path) -> str:
    """Content hash of the saved vocabulary and merges (tokenizer.json)."""
    return hashlib.sha256((Path(path) / "tokenizer.json").read_bytes()).hexdigest()
