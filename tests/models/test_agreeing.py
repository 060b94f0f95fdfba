"""Agreeing pairs (models/agreeing.py): the target's greedy continuation repeats the prompt's
last L tokens, and a round with n proposals accepts exactly min(agree, n) of them, on the
reference interpreter, for both architectures and every file type."""
import pytest

from dflash_ir.artifact import open_engine
from dflash_ir.models.agreeing import agreeing_plans
from dflash_ir.models.generator import TINY_MASK_ID

PROMPT = [5, 77, 140, 9, 260, 31, 8, 101, 44, 203, 17, 66, 250, 12, 90, 133]  # 16 tokens, no MASK
TOKENS = 40


def _period(agree: int) -> int:
    return agree or 15  # agree=0: the target repeats its last B-1 = 15 tokens


@pytest.mark.parametrize("arch, dtype, agree", [
    ("qwen35", "f32", 0), ("qwen35", "f32", 1), ("qwen35", "f32", 5), ("qwen35", "f32", 15),
    ("qwen35moe", "f32", 0), ("qwen35moe", "f32", 15), ("qwen35", "f16", 5), ("qwen35moe", "q8_0", 5),
])
def test_every_round_accepts_min_of_agree_and_proposals(agreeing_pair, arch, dtype, agree):
    engine = open_engine(*agreeing_pair(arch, agree, dtype), n_ctx=96)
    plain = engine.generate(prompt_ids=PROMPT, max_tokens=TOKENS, speculative=False, ignore_eos=True).tokens
    L = _period(agree)
    assert plain == [PROMPT[-L + i % L] for i in range(TOKENS)]
    for n_max in (3, 7, 15):
        gen = engine.generate(prompt_ids=PROMPT, max_tokens=TOKENS, n_max=n_max, ignore_eos=True)
        assert gen.tokens == plain
        assert [r["accepted"] for r in gen.rounds] == [min(agree, n_max)] * len(gen.rounds), n_max
        rejected = [r["proposals"][r["accepted"]] for r in gen.rounds if r["accepted"] < n_max]
        assert set(rejected) <= {TINY_MASK_ID}  # a wrong proposal is MASK, which the target never emits


def test_agree_is_checked_against_the_block_size():
    with pytest.raises(ValueError, match="agree must be in 0..15"):
        agreeing_plans("qwen35", 16)
