"""Token ids -> client text: stop strings, held-back tails, hidden end tokens, the <think> split."""
import random

import pytest

from dflash_ir.models.tokenizer import Tokenizer
from dflash_ir.serve.reasoning import ReasoningSplit
from dflash_ir.serve.text import TextStream

from .conftest import TARGET

TEXT = "def add(a, b):\n    return a + b  # sum: ünïcode ✓ 😀\n"


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_gguf(TARGET)


def pieces_of(stream: TextStream, ids, sizes) -> list[str]:
    out, i = [], 0
    for n in sizes:
        out.append(stream.feed(ids[i:i + n]))
        i += n
    out.append(stream.feed(ids[i:]))
    out.append(stream.finish())
    return out


@pytest.mark.parametrize("seed", range(5))
def test_pieces_join_to_the_decoded_text_in_any_split(tok, seed):
    ids = tok.encode(TEXT)
    rng = random.Random(seed)
    joined = "".join(pieces_of(TextStream(tok), ids, [rng.randint(1, 3) for _ in range(len(ids) // 2)]))
    assert joined == tok.decode(ids) == TEXT


@pytest.mark.parametrize("stop", [["return"], [" a + b", "zzz"], ["😀"], ["\n"], ["b  #", "return a"]])
@pytest.mark.parametrize("seed", range(3))
def test_text_ends_before_the_first_stop_string(tok, stop, seed):
    ids = tok.encode(TEXT)
    rng = random.Random(seed)
    stream = TextStream(tok, stop)
    pieces = pieces_of(stream, ids, [rng.randint(1, 4) for _ in range(len(ids) // 3)])
    first = min(TEXT.find(s) for s in stop if s in TEXT)
    assert "".join(pieces) == TEXT[:first]
    assert stream.stopped
    assert not any(s in piece for piece in pieces for s in stop)


def test_a_possible_stop_string_is_held_back_until_settled(tok):
    stream = TextStream(tok, ["return None"])
    got = stream.feed(tok.encode("x = 1\n    return"))
    assert got == "x = 1\n    "  # "return" could still become "return None"
    assert stream.feed(tok.encode(" a")) == "return a"
    assert stream.finish() == ""


def test_end_of_generation_tokens_are_not_text(tok):
    eos = sorted(tok.eos_ids)[0]
    ids = tok.encode("hello") + [eos]
    assert "".join(pieces_of(TextStream(tok, hidden_ids=tok.eos_ids), ids, [1])) == "hello"
    assert "".join(pieces_of(TextStream(tok), ids, [1])) == tok.decode(ids)


def split_all(reply: str, opens: bool, sizes) -> tuple[str, str]:
    split, reasoning, content, i = ReasoningSplit(opens), "", "", 0
    for n in sizes:
        r, c = split.feed(reply[i:i + n])
        reasoning, content, i = reasoning + r, content + c, i + n
    r, c = split.feed(reply[i:], final=True)
    return reasoning + r, content + c


@pytest.mark.parametrize("reply, opens, want", [
    ("\nLet me think.\n</think>\n\nThe answer is 4.", True, ("Let me think.\n", "The answer is 4.")),
    ("<think>\nhmm</think>\n\nyes", False, ("hmm", "yes")),
    ("  plain reply, no block", False, ("", "  plain reply, no block")),
    ("\nstill thinking when cut off", True, ("still thinking when cut off", "")),
    ("<thin", False, ("", "<thin")),  # not a tag after all
    ("a</thinker> b</think>c", True, ("a</thinker> b", "c")),
])
@pytest.mark.parametrize("seed", range(4))
def test_reasoning_split_in_any_streamed_pieces(reply, opens, want, seed):
    rng = random.Random(seed)
    assert split_all(reply, opens, [rng.randint(1, 3) for _ in range(len(reply) // 2)]) == want


def test_a_prompt_that_opens_the_block_starts_the_reply_in_reasoning():
    assert ReasoningSplit.opens_block("<|im_start|>assistant\n<think>\n")
    assert not ReasoningSplit.opens_block("<|im_start|>assistant\n<think>\n\n</think>\n\n")
