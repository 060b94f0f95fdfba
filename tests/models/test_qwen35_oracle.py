"""Oracle: the interpreter on the fixture targets vs Transformers and llama.cpp references."""
import json

import numpy as np
import pytest

from dflash_ir.artifact import open_engine
from dflash_ir.runtime.sampling import logsumexp

pytestmark = pytest.mark.oracle
TOL = 3e-4  # ARCHITECTURE.md §8: f32-compute logits vs Transformers (logits up to ~27)


@pytest.fixture(scope="module")
def engines(oracle_gguf):
    cache = {}

    def get(kind, precision):
        key = (kind, precision)
        if key not in cache:
            cache[key] = open_engine(oracle_gguf(f"{kind}/gguf/{kind}-target-{precision}.gguf"), n_ctx=128)
        return cache[key]

    return get


def _prefill_logits(engine, ids):
    engine.target.reset()
    return engine.target.prefill(ids, all_logits=True)


@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("precision, ref", [("f16", "hf_logits.npz"), ("q8_0", "hf_q8_0_roundtrip_topk.npz")])
def test_prompt_logits_match_transformers(engines, oracle_prompts, oracle_dir, kind, precision, ref):
    z = np.load(oracle_dir / kind / "ref" / ref)
    worst = 0.0
    for name, ids in oracle_prompts.items():
        logits = _prefill_logits(engines(kind, precision), ids).logits
        top = np.take_along_axis(logits, z[f"{name}_top_ids"].astype(np.int64), axis=1)
        worst = max(worst, np.abs(top - z[f"{name}_top_vals"]).max(), np.abs(logsumexp(logits) - z[f"{name}_lse"]).max())
        if f"{name}_logits" in z.files:  # the full row at the last prompt position
            worst = max(worst, np.abs(logits[z[f"{name}_rows"]] - z[f"{name}_logits"]).max())
    assert worst <= TOL, f"{kind} {precision}: max |logit - reference| = {worst:.2e} > {TOL}"


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_tap_features_match_transformers(oracle_gguf, oracle_prompts, oracle_dir, kind):
    """Features = raw residual outputs of the tap layers (HF hidden_states[id + 1]), in tap order."""
    z = np.load(oracle_dir / kind / "ref" / "zlab_dflash_first_block.npz")
    taps = json.loads((oracle_dir / kind / "ref" / "zlab_dflash.json").read_text())["_meta"]["target_layer_ids"]
    engine = open_engine(oracle_gguf(f"{kind}/gguf/{kind}-target-f16.gguf"), n_ctx=64, taps=tuple(taps))
    for name, ids in oracle_prompts.items():
        engine.target.reset()
        feats = engine.target.prefill(ids).features
        ref = z[f"{name}_ctx_features"]
        assert feats.shape == ref.shape
        assert np.abs(feats - ref).max() <= TOL, name


@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("precision", ["f16", "q8_0"])
def test_greedy_continuations_match_transformers_and_llamacpp(engines, oracle_prompts, oracle_dir, kind, precision):
    hf = json.loads((oracle_dir / kind / "ref" / ("hf_greedy.json" if precision == "f16"
                                                  else "hf_q8_0_roundtrip_greedy.json")).read_text())
    lcpp = json.loads((oracle_dir / kind / "ref" / "llamacpp_target_greedy.json").read_text())[precision]
    engine = engines(kind, precision)
    for name, ids in oracle_prompts.items():
        out = engine.generate(prompt_ids=ids, max_tokens=32, speculative=False, ignore_eos=True).tokens
        assert out == hf[name]["output_ids"], f"{kind} {precision} {name}: differs from Transformers"
        assert out == lcpp[name]["output_ids"][:32], f"{kind} {precision} {name}: differs from llama.cpp"
