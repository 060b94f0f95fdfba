"""Vulkan end to end beyond what every backend shows (tests/backends/test_e2e.py): decode and
verify steps replay recorded command buffers instead of recording them again."""
from dflash_ir.artifact import compile_pair, load_compiled

PROMPT = [5, 77, 140, 9, 260, 31, 8]


def test_repeated_generation_records_no_command_buffer(vulkan, tiny_pair, tmp_path):
    target, draft = tiny_pair("qwen35", "f16")
    engine = load_compiled(compile_pair(target, draft, out=tmp_path / "art", backend="vulkan", n_ctx=96),
                           load_tokenizer=False)
    # fixed round lengths: cost-aware ones follow measured times, and a length (or an accepted
    # count the draft injects) not met before needs buffers of its size, hence new recordings
    kw = dict(prompt_ids=PROMPT, max_tokens=24, n_max=7, ignore_eos=True, adaptive=False)
    first = engine.generate(**kw).tokens
    # the last commit of a generation waits on the device queue and goes alone when the next one
    # starts: a batch the first generation never made (its commits went with the next round's calls)
    assert engine.generate(**kw).tokens == first
    device = engine.target.programs["decode"].device
    recorded, submitted = device.recordings, device.submissions
    assert engine.generate(**kw).tokens == first
    assert device.recordings == recorded and device.submissions > submitted
