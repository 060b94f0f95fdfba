"""End to end on OpenCL: compiled artifacts give the interpreter's greedy tokens, speculative
or not, on generated pairs and (oracle) on the fixture models."""
import json

import pytest

from dflash_ir.artifact import compile_pair, load_compiled, open_engine

PROMPT = [5, 77, 140, 9, 260, 31, 8]


@pytest.mark.parametrize("arch, dtype", [("qwen35", "f16"), ("qwen35moe", "q8_0")])
def test_speculative_greedy_equals_interpreter(opencl, tiny_pair, arch, dtype, tmp_path):
    target, draft = tiny_pair(arch, dtype)
    engine = load_compiled(compile_pair(target, draft, out=tmp_path / "art", backend="opencl", n_ctx=96),
                           load_tokenizer=False)
    reference = open_engine(target, draft, n_ctx=96)
    want = reference.generate(prompt_ids=PROMPT, max_tokens=24, speculative=False, ignore_eos=True).tokens
    assert engine.generate(prompt_ids=PROMPT, max_tokens=24, speculative=False, ignore_eos=True).tokens == want
    spec = engine.generate(prompt_ids=PROMPT, max_tokens=24, n_max=7, ignore_eos=True)
    assert spec.tokens == want
    assert engine.info["backend"]["name"] == "opencl"


def test_second_load_shares_weights_across_programs(opencl, tiny_pair, tmp_path):
    """Prefill, verify and decode of one model read the same weights: uploaded once."""
    target, _ = tiny_pair("qwen35", "f16")
    out = compile_pair(target, None, out=tmp_path / "art", backend="opencl", n_ctx=32)
    engine = load_compiled(out, load_tokenizer=False)
    programs = engine.target.programs
    buffers = [set(map(id, p._resident.values())) for p in programs.values()]
    assert len(set.intersection(*buffers)) >= len(programs["decode"].graph.weights) // 2


# PoCL on a 2-core CPU spends ~0.3 s per 16-row product with the fixtures' 248k-token
# vocabulary: one prompt and the first 16 of the 32 recorded tokens
_PROMPT, _TOKENS = "code", 16


@pytest.mark.oracle
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_fixture_pair_speculative_matches_transformers(opencl, oracle_gguf, oracle_dir, oracle_prompts, kind, tmp_path):
    out = compile_pair(oracle_gguf(f"{kind}/gguf/{kind}-target-f16.gguf"), oracle_gguf(f"{kind}/gguf/{kind}-dflash-f16.gguf"),
                       out=tmp_path / "art", backend="opencl", n_ctx=96)
    engine = load_compiled(out, load_tokenizer=False)
    hf = json.loads((oracle_dir / kind / "ref" / "hf_greedy.json").read_text())
    tokens = engine.generate(prompt_ids=oracle_prompts[_PROMPT], max_tokens=_TOKENS, ignore_eos=True).tokens
    assert tokens == hf[_PROMPT]["output_ids"][:_TOKENS], kind


@pytest.mark.oracle
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_fixture_q8_0_target_matches_transformers(opencl, oracle_gguf, oracle_dir, oracle_prompts, kind, tmp_path):
    out = compile_pair(oracle_gguf(f"{kind}/gguf/{kind}-target-q8_0.gguf"), out=tmp_path / "art", backend="opencl",
                       n_ctx=96)
    engine = load_compiled(out, load_tokenizer=False)
    hf = json.loads((oracle_dir / kind / "ref" / "hf_q8_0_roundtrip_greedy.json").read_text())
    tokens = engine.generate(prompt_ids=oracle_prompts[_PROMPT], max_tokens=_TOKENS, speculative=False,
                             ignore_eos=True).tokens
    assert tokens == hf[_PROMPT]["output_ids"][:_TOKENS], kind
