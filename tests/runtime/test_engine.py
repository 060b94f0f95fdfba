"""The speculative loop: lossless greedy, exact rollback every round, sampling, stops, streaming."""
import numpy as np
import pytest

from dflash_ir.artifact import open_engine
from dflash_ir.errors import ContextOverflowError
from dflash_ir.runtime.engine import _sample_and_match
from dflash_ir.runtime.sampling import Sampler, SamplingParams
from dflash_ir.runtime.target_runner import TargetOutput

ARCHS = ["qwen35", "qwen35moe"]
PROMPT = [5, 77, 123, 9, 250, 31, 8]
AGREEING_PROMPT = [5, 77, 140, 9, 260, 31, 8, 101, 44, 203, 17, 66, 250, 12, 90, 133]  # >= 15 tokens, no MASK


@pytest.fixture(scope="module")
def engines(tiny_pair):
    made = {}

    def get(arch, **kw):
        key = (arch, tuple(sorted(kw.items())))
        if key not in made:
            made[key] = open_engine(*tiny_pair(arch), **{"n_ctx": 96, **kw})
        return made[key]

    return get


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("n_max", [1, 3, 7, 15])
def test_greedy_speculative_equals_target_only(engines, arch, n_max):
    e = engines(arch)
    plain = e.generate(prompt_ids=PROMPT, max_tokens=24, speculative=False).tokens
    spec = e.generate(prompt_ids=PROMPT, max_tokens=24, n_max=n_max)
    assert spec.tokens == plain
    assert all(len(r["proposals"]) == n_max for r in spec.rounds[:-1])
    assert spec.stats.rounds == len(spec.rounds) and spec.stats.generated_tokens == 24


@pytest.mark.parametrize("arch", ARCHS)
def test_target_state_after_every_round_equals_fresh_run(engines, arch):
    reference = engines(arch, load_tokenizer=False, n_max=15)  # same files, independent runner state
    accepted = _check_state_after_every_round(engines(arch), reference, PROMPT, n_max=7, max_tokens=30)
    assert set(accepted) == {0}  # a random draft: every round rolls back all its proposal rows


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("n_max, kept", [(3, 3), (7, 5)])
def test_state_after_rounds_that_keep_all_or_some_rows_equals_fresh_run(agreeing_pair, arch, n_max, kept):
    """A draft agreeing on 5 proposals: rounds of 3 keep every row, rounds of 7 roll back 2.
    25 tokens = the first + whole rounds of 4 or of 6 (a cut round would commit more than it emits)."""
    pair = agreeing_pair(arch, 5)
    reference = open_engine(*pair, n_ctx=96)
    accepted = _check_state_after_every_round(open_engine(*pair, n_ctx=96), reference, AGREEING_PROMPT, n_max=n_max,
                                              max_tokens=25)
    assert set(accepted) == {kept}


def _check_state_after_every_round(e, reference, prompt, *, n_max, max_tokens) -> list[int]:
    """After every speculative round, e's target state equals a fresh prefill + decode of the
    committed tokens on `reference`; returns each round's accepted count."""
    committed = list(prompt)
    for step, new in enumerate(e.iter_tokens(prompt_ids=prompt, max_tokens=max_tokens, n_max=n_max)):
        committed += new
        if step == 0:
            continue
        t = e.target
        assert t.n_past == len(committed) - 1  # the last committed token is the next anchor
        r = reference.target
        r.reset()
        r.prefill(committed[:len(prompt)])
        for tok in committed[len(prompt):-1]:
            r.decode(tok)
        for k, v in r.states.items():
            got, want = (t.states[k][:t.n_past], v[:t.n_past]) if k.endswith("_cache") else (t.states[k], v)
            assert np.abs(got - want).max() <= 1e-5 * max(1.0, np.abs(want).max()), (step, k)
    return [r["accepted"] for r in e.last_rounds]


def test_sample_and_match_keeps_the_target_distribution():
    """Emitted (accepted..., bonus) prefixes are distributed exactly like row-by-row target samples."""
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 1.5, (3, 4)).astype(np.float32)
    proposals = [int(np.argmax(logits[0])), int(np.argmax(logits[1]))]
    params = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    p = [Sampler(SamplingParams(**params)).probs(row) for row in logits]
    out = TargetOutput(logits, logits.argmax(-1))
    counts = {}
    n = 20000
    for seed in range(n):
        a, bonus = _sample_and_match(Sampler(SamplingParams(**params, seed=seed)), out, proposals)
        key = (*proposals[:a], bonus)
        counts[key] = counts.get(key, 0) + 1
    for key, c in counts.items():  # probability of emitting exactly this prefix under the target alone
        prob = np.prod([p[i][t] for i, t in enumerate(key)])
        assert abs(c / n - prob) <= 4 * np.sqrt(prob * (1 - prob) / n) + 1e-3, (key, c / n, prob)
    assert abs(sum(counts.values()) - n) == 0


class _Unread:
    """Logits that fail the test when read to the host."""

    def __array__(self, dtype=None, copy=None):
        raise AssertionError("a greedy round read the logits")


def test_greedy_match_reads_the_argmax_ids_not_the_logits():
    greedy = np.array([4, 9, 2, 7], np.int32)
    out = TargetOutput(_Unread(), greedy)
    sampler = Sampler(SamplingParams())
    assert _sample_and_match(sampler, out, [4, 9, 2]) == (3, 7)
    assert _sample_and_match(sampler, out, [4, 1, 2]) == (1, 9)
    assert _sample_and_match(sampler, out, [5]) == (0, 4)


def test_sampling_filters():
    logits = np.array([3.0, 2.0, 1.0, 0.0, -5.0], np.float32)
    s = Sampler(SamplingParams(temperature=1.0, top_k=2, top_p=1.0, min_p=0.0))
    p = s.probs(logits)
    assert p[2:].sum() == 0 and np.isclose(p[0], 1 / (1 + np.exp(-1)))
    p = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=0.5, min_p=0.0)).probs(logits)
    assert (p > 0).sum() == 1  # the top token alone already covers 0.5
    p = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.3)).probs(logits)
    assert (p > 0).sum() == 2  # exp(-1) >= 0.3 > exp(-2)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)


@pytest.mark.parametrize("arch", ARCHS)
def test_sampled_runs_are_reproducible_and_lossless_in_form(engines, arch):
    e = engines(arch)
    params = SamplingParams(temperature=0.8, top_k=20, seed=7)
    a = e.generate(prompt_ids=PROMPT, max_tokens=12, sampling=params).tokens
    b = e.generate(prompt_ids=PROMPT, max_tokens=12, sampling=params).tokens
    assert a == b and len(a) == 12


def test_context_limits(engines):
    e = engines("qwen35", n_ctx=24)
    gen = e.generate(prompt_ids=PROMPT, max_tokens=100)
    assert gen.stats.stop_reason == "context full (24 tokens)"
    assert len(PROMPT) + len(gen.tokens) == 24 + 1  # the last token is emitted but needs no cache row
    plain = e.generate(prompt_ids=PROMPT, max_tokens=100, speculative=False).tokens
    assert gen.tokens == plain
    with pytest.raises(ContextOverflowError, match="prompt has 30 tokens but the context size is 24"):
        e.generate(prompt_ids=list(range(30)))


def test_n_max_is_validated(engines):
    with pytest.raises(ValueError, match="n_max must be in 1..15"):
        engines("qwen35").generate(prompt_ids=PROMPT, n_max=16)


def test_streaming_text_equals_generated_text(engines):
    e = engines("qwen35", load_tokenizer=True)
    gen = e.generate("hello world", max_tokens=16, ignore_eos=True)
    streamed = "".join(e.stream("hello world", max_tokens=16, ignore_eos=True))
    assert streamed == gen.text and gen.text == e.tokenizer.decode(gen.tokens)
    assert e.last_stats.generated_tokens == 16 and "tau" in e.last_stats.summary()


def test_stop_on_eos_and_stop_strings(engines):
    e = engines("qwen35", load_tokenizer=True)
    full = e.generate("hello world", max_tokens=16, ignore_eos=True)
    eos = full.tokens[5]
    saved, e.tokenizer.eos_ids = e.tokenizer.eos_ids, {eos}
    try:
        stopped = e.generate("hello world", max_tokens=16)
    finally:
        e.tokenizer.eos_ids = saved
    assert stopped.tokens == full.tokens[:full.tokens.index(eos) + 1] and stopped.stats.stop_reason == "eos"
    piece = e.tokenizer.decode(full.tokens[8:10])
    if piece.strip():
        cut = e.generate("hello world", max_tokens=16, ignore_eos=True, stop=[piece])
        assert cut.stats.stop_reason == "stop string" and len(cut.tokens) <= 10
