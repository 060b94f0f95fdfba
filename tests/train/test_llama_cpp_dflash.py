"""Reading llama.cpp's output (train/llama_cpp_dflash.py), on lines in the formats its
llama-speculative-simple and performance printer write; where two greedy continuations part."""
import numpy as np
import pytest

from dflash_ir.artifact import open_engine
from train.llama_cpp_dflash import eval_tps, first_difference, generated_text, speculative_stats

SPECULATIVE_STDERR = """main: adding speculative implementation 'draft-dflash'
encoded   41 tokens in    0.120 seconds, speed:  341.667 t/s
decoded  129 tokens in    4.500 seconds, speed:   28.667 t/s

n_draft   = 15
n_predict = 129
n_drafted = 1650
n_accept  = 17
accept    = 1.030%
"""


def test_speculative_statistics():
    assert speculative_stats(SPECULATIVE_STDERR) == {"tokens": 129, "decode_tps": 28.667, "drafted": 1650,
                                                     "accepted": 17}


def test_missing_statistics_say_what_was_printed():
    with pytest.raises(ValueError, match="printed no statistics"):
        speculative_stats("error: failed to load the draft model\n")


def test_eval_speed_is_the_generation_line_not_the_prompt_line():
    log = ("llama_perf_context_print: prompt eval time =      50.00 ms /    41 tokens (    1.22 ms per token,   820.00 "
           "tokens per second)\n"
           "llama_perf_context_print:        eval time =    1500.00 ms /   127 runs   (   11.81 ms per token,    84.67 "
           "tokens per second)\n")
    assert eval_tps(log) == 84.67


def test_generated_text_follows_the_echoed_prompt_without_colours():
    prompt = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    stdout = f"\n\n{prompt}\x1b[36mHello\x1b[37m there!\n\n"
    assert generated_text(stdout, prompt) == "Hello there!"


def test_first_difference_is_where_the_continuations_part_and_how_far_our_logits_put_them(tiny_pair):
    engine = open_engine(tiny_pair("llama")[0])
    prompt = [5, 17, 300, 42]
    ours = engine.generate(prompt_ids=prompt, max_tokens=6, speculative=False, ignore_eos=True).tokens
    theirs = [*ours[:3], (ours[3] + 1) % 64, 9]
    found = first_difference(engine, prompt, ours, theirs)
    engine.target.reset()
    logits = np.asarray(engine.target.prefill(prompt + ours[:3]).logits)[-1]
    assert found["first_difference"] == 3
    assert found["logit_margin"] == round(float(logits[ours[3]] - logits[theirs[3]]), 4) >= 0  # ours is the argmax
    assert first_difference(engine, prompt, ours, ours[:4]) == {}
