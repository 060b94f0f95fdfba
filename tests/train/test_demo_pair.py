"""The shipped demo pair (demo/*.gguf): valid files, lossless greedy speculation, real acceptance."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_ir.artifact import open_engine
from dflash_ir.models.tokenizer import Tokenizer

DEMO = Path(__file__).resolve().parents[2] / "demo"
TARGET, DRAFT = DEMO / "coder-target-q8_0.gguf", DEMO / "coder-dflash-q8_0.gguf"
N_NEW = 48


@pytest.fixture(scope="module")
def engine():
    return open_engine(TARGET, DRAFT, n_ctx=256, load_tokenizer=True)  # validates both files and the pair


def test_files_are_small_q8_0_with_own_tokenizer():
    assert TARGET.stat().st_size + DRAFT.stat().st_size < 25e6
    tok = Tokenizer.from_gguf(TARGET)
    assert tok.pre == "qwen35" and tok.mask_id is None
    assert Tokenizer.from_gguf(DRAFT).mask_id == tok.token_to_id("<|MASK|>")
    text = 'def f(x):\n    """Doc."""\n    return x\n'
    assert tok.decode(tok.encode(text)) == text


@pytest.mark.parametrize("index", [0, 1])
def test_speculative_equals_target_only_on_heldout_prompt(engine, index):
    prompt = json.loads((DEMO / "prompts.json").read_text())[index]["text"]
    spec = engine.generate(prompt, max_tokens=N_NEW, ignore_eos=True)
    plain = engine.generate(prompt, max_tokens=N_NEW, ignore_eos=True, speculative=False)
    assert spec.tokens == plain.tokens
    assert spec.stats.tau >= 2.5, spec.stats.summary()
