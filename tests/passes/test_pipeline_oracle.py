"""The full pipeline on the fixture models: kernel counts, and greedy tokens still those of the references."""
import json

import pytest

from dflash_ir.artifact import open_engine, open_pair
from dflash_ir.passes.pipeline import run_pipeline

pytestmark = pytest.mark.oracle
MODELS = [(kind, precision) for kind in ("dense", "moe") for precision in ("f16", "q8_0")]
GREEDY_REF = {"f16": "hf_greedy.json", "q8_0": "hf_q8_0_roundtrip_greedy.json"}
TOKENS = 16


def paths(oracle_gguf, kind, precision):
    return (oracle_gguf(f"{kind}/gguf/{kind}-target-{precision}.gguf"),
            oracle_gguf(f"{kind}/gguf/{kind}-dflash-f16.gguf"))


@pytest.mark.parametrize("kind, precision", MODELS)
def test_kernel_counts(oracle_gguf, kind, precision):
    pair = open_pair(*paths(oracle_gguf, kind, precision), opt_level=0)
    target, draft = pair.configs["target"], pair.configs["draft"]
    for name, g in pair.graphs.items():
        counts = run_pipeline(g).op_counts()
        assert "dequantize" not in counts and "matmul" not in counts, name
        assert not {"attention", "expert_matmul", "topk"} & counts.keys(), name
        if name == "target.commit":  # the recurrent layers alone, one kernel each
            assert counts.keys() <= {"fused_gated_deltanet", "reshape"}, name
            assert counts["fused_gated_deltanet"] == sum(target.layer_is_recurrent), name
        elif name.startswith("target"):  # a batched verify: an attention per sequence
            seqs = g.meta_dict.get("slots", 1)
            assert counts["fused_attention"] == seqs * sum(not r for r in target.layer_is_recurrent), name
            assert "rope" not in counts, name
            assert counts.get("fused_moe", 0) == (target.n_layer if target.n_expert else 0), name
        elif name == "draft.block":
            assert counts["fused_attention"] == draft.n_layer and "rope" not in counts


@pytest.mark.parametrize("kind, precision", MODELS)
def test_greedy_tokens_unchanged(oracle_gguf, oracle_dir, kind, precision):
    engine = open_engine(*paths(oracle_gguf, kind, precision), n_ctx=64, opt_level=2)
    assert "fused_attention" in engine.draft.programs["block"].graph.op_counts()
    ref = json.loads((oracle_dir / kind / "ref" / GREEDY_REF[precision]).read_text())
    prompt = json.loads((oracle_dir / "prompts.json").read_text())[0]
    plain = engine.generate(prompt_ids=prompt["ids"], max_tokens=TOKENS, speculative=False, ignore_eos=True).tokens
    assert plain == ref[prompt["name"]]["output_ids"][:TOKENS]
    assert engine.generate(prompt_ids=prompt["ids"], max_tokens=TOKENS, ignore_eos=True).tokens == plain
