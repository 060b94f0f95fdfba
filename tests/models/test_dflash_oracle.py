"""Oracle: the DFlash draft and the speculative loop vs z-lab's reference and llama.cpp."""
import json

import numpy as np
import pytest

from dflash_ir.artifact import open_engine
from dflash_ir.runtime.sampling import logsumexp

pytestmark = pytest.mark.oracle
TOL = 3e-4


@pytest.fixture(scope="module", params=["dense", "moe"])
def kind(request):
    return request.param


@pytest.fixture(scope="module")
def engine(oracle_gguf, kind):
    return open_engine(oracle_gguf(f"{kind}/gguf/{kind}-target-f16.gguf"),
                       oracle_gguf(f"{kind}/gguf/{kind}-dflash-f16.gguf"), n_ctx=128)


def test_first_block_matches_zlab_forward(engine, oracle_prompts, oracle_dir, kind):
    """Inject z-lab's recorded context features, draft the block, compare hidden states and logits."""
    z = np.load(oracle_dir / kind / "ref" / "zlab_dflash_first_block.npz")
    draft = engine.draft
    for name in oracle_prompts:
        block = z[f"{name}_block_ids"]
        assert list(z[f"{name}_block_positions"]) == list(range(len(oracle_prompts[name]), len(oracle_prompts[name]) + 16))
        draft.reset()
        draft.inject(z[f"{name}_ctx_features"])
        out = draft.block_outputs(int(block[0]))
        proposals = out["proposals"]
        assert np.abs(out["hidden"] - z[f"{name}_draft_hidden"]).max() <= TOL, name
        logits = out["logits"]
        top = np.take_along_axis(logits, z[f"{name}_draft_top_ids"].astype(np.int64), axis=1)
        assert np.abs(top - z[f"{name}_draft_top_vals"]).max() <= TOL, name
        assert np.abs(logsumexp(logits) - z[f"{name}_draft_lse"]).max() <= TOL, name
        assert list(proposals) == list(z[f"{name}_draft_top_ids"][:, 0]), name


def test_speculative_rounds_match_zlab(engine, oracle_prompts, oracle_dir, kind):
    """Every round's anchor, proposals and acceptance equal z-lab's dflash_generate; tokens equal HF greedy."""
    ref = json.loads((oracle_dir / kind / "ref" / "zlab_dflash.json").read_text())
    hf = json.loads((oracle_dir / kind / "ref" / "hf_greedy.json").read_text())
    for name, ids in oracle_prompts.items():
        steps = ref[name]["steps"]
        gen = engine.generate(prompt_ids=ids, max_tokens=1 + sum(ref[name]["acceptance_lengths"]), ignore_eos=True)
        assert gen.tokens[:32] == hf[name]["output_ids"], name
        assert gen.tokens[:32] == ref[name]["output_ids"][:32], name
        assert [r["anchor_pos"] for r in gen.rounds] == [s["anchor_pos"] for s in steps], name
        for ours, theirs in zip(gen.rounds, steps):
            assert (ours["anchor"], ours["proposals"], ours["accepted"]) == \
                   (theirs["anchor"], theirs["proposals"], theirs["accepted"]), f"{name} at {theirs['anchor_pos']}"


@pytest.fixture(scope="module")
def target_only(engine, oracle_prompts):
    return {name: engine.generate(prompt_ids=ids, max_tokens=32, speculative=False, ignore_eos=True).tokens
            for name, ids in oracle_prompts.items()}


def test_target_only_equals_llamacpp_speculative(target_only, oracle_dir, kind):
    lcpp = json.loads((oracle_dir / kind / "ref" / "llamacpp_dflash.json").read_text())["target_f16__draft_f16"]
    for name, tokens in target_only.items():
        assert tokens == lcpp[name]["output_ids"][:32], name


@pytest.mark.parametrize("n_max", [1, 3, 7, 15])
def test_speculative_equals_target_only(engine, oracle_prompts, target_only, n_max):
    for name, ids in oracle_prompts.items():
        spec = engine.generate(prompt_ids=ids, max_tokens=32, n_max=n_max, ignore_eos=True)
        assert spec.tokens == target_only[name], f"{name} n_max={n_max}"
        assert all(len(r["proposals"]) <= n_max for r in spec.rounds)


def test_sampled_speculative_output_has_the_target_distribution(engine, oracle_prompts, kind):
    """Joint law of the first three tokens (the prefill sample and the first speculative round)
    under sampling equals the target-only law, computed exactly from the target's logits."""
    if kind != "moe":
        pytest.skip("one model is enough: the moe pair's draft is accepted often on the chat prompt")
    from dflash_ir.runtime.sampling import Sampler, SamplingParams

    params = dict(temperature=0.7, top_k=3, top_p=1.0, min_p=0.0)
    probs = Sampler(SamplingParams(**params)).probs
    ids = oracle_prompts["chat"]

    def next_probs(prefix):
        engine.target.reset()
        return probs(engine.target.prefill(prefix).logits[-1])

    exact = {}
    p0 = next_probs(ids)
    for t0 in np.flatnonzero(p0):
        p1 = next_probs(ids + [int(t0)])
        for t1 in np.flatnonzero(p1):
            p2 = next_probs(ids + [int(t0), int(t1)])
            for t2 in np.flatnonzero(p2):
                exact[int(t0), int(t1), int(t2)] = p0[t0] * p1[t1] * p2[t2]
    n, counts, accepted = 250, {}, 0
    for seed in range(n):
        gen = engine.generate(prompt_ids=ids, max_tokens=3, ignore_eos=True,
                              sampling=SamplingParams(**params, seed=seed))
        key = tuple(gen.tokens)
        counts[key] = counts.get(key, 0) + 1
        accepted += gen.rounds[0]["accepted"] > 0
    assert accepted > n // 10, "the draft must be accepted sometimes for this test to mean anything"
    assert set(counts) <= set(exact)
    for key, prob in exact.items():
        freq = counts.get(key, 0) / n
        assert abs(freq - prob) <= 4 * np.sqrt(prob * (1 - prob) / n) + 2 / n, (key, freq, prob)
