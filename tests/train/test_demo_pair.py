"""The shipped demo pair (demo/*.gguf): valid files, lossless greedy speculation, real acceptance."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_ir.artifact import open_engine
from dflash_ir.demo import SMOLLM2_REQUESTS
from dflash_ir.models.gguf_file import open_gguf
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


# -- the SmolLM2 pair: the package's target, the draft trained here (train/smollm2.py) ------
SMOLLM2_DRAFT = DEMO / "smollm2-dflash-q8_0.gguf"
SMOLLM2_TAU = 1.02  # above 1 (the draft is right sometimes); tau is ~1.3-1.5 (train/README.md)


@pytest.fixture(scope="module")
def smollm2_engine(smollm2):
    return open_engine(smollm2, SMOLLM2_DRAFT, n_ctx=512, load_tokenizer=True)


def test_smollm2_draft_is_small_q8_0_with_the_targets_tokenizer(smollm2):
    assert SMOLLM2_DRAFT.stat().st_size < 20e6
    draft, target = open_gguf(SMOLLM2_DRAFT), open_gguf(smollm2)
    assert draft.metadata["general.architecture"] == "dflash"
    assert {t.dtype.value for t in draft.tensors.values() if len(t.shape) == 2} == {"q8_0"}
    assert draft.metadata["tokenizer.ggml.tokens"] == target.metadata["tokenizer.ggml.tokens"]
    assert Tokenizer.from_gguf(SMOLLM2_DRAFT).mask_id == Tokenizer.from_gguf(smollm2).token_to_id("<empty_output>")
    # its own head of the 8192 tokens its training answers use most (train/smollm2.py, d2t)
    assert draft.tensor("d2t").dtype.value == "i64" and draft.tensor("output.weight").shape == (8192, 576)


@pytest.mark.parametrize("request_", SMOLLM2_REQUESTS, ids=lambda r: r.label)
def test_smollm2_speculative_equals_target_only_on_the_demo_requests(smollm2_engine, request_):
    spec = smollm2_engine.generate(max_tokens=24, **request_.kwargs())  # the interpreter: ~1 s a round
    plain = smollm2_engine.generate(max_tokens=24, speculative=False, **request_.kwargs())
    assert spec.tokens == plain.tokens
    assert spec.stats.tau >= SMOLLM2_TAU, spec.stats.summary()
