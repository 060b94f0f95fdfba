"""Oracle: the DFlash draft and the speculative loop vs z-lab's reference and llama.cpp."""
import json

import numpy as np
import pytest

from dflash_ir.artifact import open_engine

pytestmark = pytest.mark.oracle
TOL = 3e-4


@pytest.fixture(scope="module", params=["dense", "moe"])
def kind(request):
    return request.param


@pytest.fixture(scope="module")
def engine(oracle_gguf, kind):
    return open_engine(oracle_gguf(f"{kind}/gguf/{kind}-target-f16.gguf"),
                       oracle_gguf(f"{kind}/gguf/{kind}-dflash-f16.gguf"), n_ctx=128)


@pytest.fixture(scope="module")
def prompts(oracle_dir):
    return {p["name"]: p["ids"] for p in json.loads((oracle_dir / "prompts.json").read_text())}


def _lse(x):
    m = x.max(-1, keepdims=True)
    return (m + np.log(np.exp(x - m).sum(-1, keepdims=True)))[..., 0]


def test_first_block_matches_zlab_forward(engine, prompts, oracle_dir, kind):
    """Inject z-lab's recorded context features, draft the block, compare hidden states and logits."""
    z = np.load(oracle_dir / kind / "ref" / "zlab_dflash_first_block.npz")
    draft = engine.draft
    for name in prompts:
        block = z[f"{name}_block_ids"]
        assert list(z[f"{name}_block_positions"]) == list(range(len(prompts[name]), len(prompts[name]) + 16))
        draft.reset()
        draft.inject(z[f"{name}_ctx_features"])
        proposals, out = draft.propose(int(block[0]))
        assert np.abs(out["hidden"] - z[f"{name}_draft_hidden"]).max() <= TOL, name
        logits = out["logits"]
        top = np.take_along_axis(logits, z[f"{name}_draft_top_ids"].astype(np.int64), axis=1)
        assert np.abs(top - z[f"{name}_draft_top_vals"]).max() <= TOL, name
        assert np.abs(_lse(logits) - z[f"{name}_draft_lse"]).max() <= TOL, name
        assert list(proposals) == list(z[f"{name}_draft_top_ids"][:, 0]), name


def test_speculative_rounds_match_zlab(engine, prompts, oracle_dir, kind):
    """Every round's anchor, proposals and acceptance equal z-lab's dflash_generate; tokens equal HF greedy."""
    ref = json.loads((oracle_dir / kind / "ref" / "zlab_dflash.json").read_text())
    hf = json.loads((oracle_dir / kind / "ref" / "hf_greedy.json").read_text())
    for name, ids in prompts.items():
        steps = ref[name]["steps"]
        gen = engine.generate(prompt_ids=ids, max_tokens=1 + sum(ref[name]["acceptance_lengths"]), ignore_eos=True)
        assert gen.tokens[:32] == hf[name]["output_ids"], name
        assert gen.tokens[:32] == ref[name]["output_ids"][:32], name
        assert [r["anchor_pos"] for r in gen.rounds] == [s["anchor_pos"] for s in steps], name
        for ours, theirs in zip(gen.rounds, steps):
            assert (ours["anchor"], ours["proposals"], ours["accepted"]) == \
                   (theirs["anchor"], theirs["proposals"], theirs["accepted"]), f"{name} at {theirs['anchor_pos']}"


@pytest.mark.parametrize("n_max", [1, 3, 7, 15])
def test_speculative_equals_target_only_and_llamacpp(engine, prompts, oracle_dir, kind, n_max):
    lcpp = json.loads((oracle_dir / kind / "ref" / "llamacpp_dflash.json").read_text())["target_f16__draft_f16"]
    for name, ids in prompts.items():
        plain = engine.generate(prompt_ids=ids, max_tokens=32, speculative=False, ignore_eos=True).tokens
        spec = engine.generate(prompt_ids=ids, max_tokens=32, n_max=n_max, ignore_eos=True)
        assert spec.tokens == plain, f"{name} n_max={n_max}"
        assert spec.tokens == lcpp[name]["output_ids"][:32], name
        assert all(len(r["proposals"]) <= n_max for r in spec.rounds)
