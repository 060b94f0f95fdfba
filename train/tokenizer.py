"""A small byte-level BPE trained on the corpus, stored as Qwen's `tokenizer.ggml.*` metadata.

Same pre-tokenisation as Qwen3.5 (NFC, the `qwen35` split regex, ByteLevel without prefix
space), so `models/tokenizer.py Tokenizer.from_metadata` rebuilds it from the GGUF alone.
Ids: the trained vocabulary (256 bytes, then merges in order), then the special tokens.
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from dflash_ir.models.generator import CHATML_TEMPLATE as CHAT_TEMPLATE
from dflash_ir.models.generator import SPECIAL_TOKENS as SPECIALS
from dflash_ir.models.tokenizer import TokenType, byte_level_pre_tokenizer

MASK = "<|MASK|>"


def train_bpe(texts: Iterable[str], vocab_size: int) -> dict[str, Any]:
    """Train on `texts`; returns the GGUF tokenizer metadata (vocab_size rows in all)."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = byte_level_pre_tokenizer("qwen35")
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(SPECIALS), min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    model = json.loads(tok.model.__getstate__())
    vocab: dict[str, int] = model["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    if [vocab[t] for t in tokens] != list(range(len(tokens))):
        raise ValueError("trained vocabulary ids are not contiguous")
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [TokenType.NORMAL] * len(tokens) + list(SPECIALS.values())
    tokens += list(SPECIALS)
    ids = {t: i for i, t in enumerate(tokens)}
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen35",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [int(t) for t in types],
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.eos_token_id": ids["<|im_end|>"],
        "tokenizer.ggml.padding_token_id": ids["<|endoftext|>"],
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": CHAT_TEMPLATE,
    }
