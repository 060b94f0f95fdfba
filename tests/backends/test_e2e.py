"""End to end on every backend that runs here (OpenCL and Vulkan with the native kernels,
TVM-built kernels on the TVM runtime and on OpenCL): compiled artifacts give the
interpreter's greedy tokens, speculative or not, on generated pairs, and (oracle) the
Transformers tokens on the fixture pairs. Backends that cannot run skip with the reason."""
import json

import numpy as np
import pytest

from dflash_ir.artifact import compile_pair, load_compiled, open_engine
from dflash_ir.backends.base import get_backend

PROMPT = [5, 77, 140, 9, 260, 31, 8]
BACKENDS = ["opencl", "vulkan", "tvm-llvm", "tvm-opencl"]
# PoCL, lavapipe and TVM's untuned kernels on 2 cores, with the fixtures' 248k-token vocabulary
# in every verify: one prompt and the first 16 of the 32 recorded tokens
_PROMPT, _TOKENS = "code", 16


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    reason = get_backend(request.param).unavailable_reason()
    if reason:
        pytest.skip(f"{request.param}: {reason}")
    return request.param


def _engine(backend, target, draft, out, n_ctx=96):
    engine = load_compiled(compile_pair(target, draft, out=out, backend=backend, n_ctx=n_ctx), load_tokenizer=False)
    assert engine.info["backend"]["name"] == backend
    return engine


@pytest.mark.parametrize("arch, dtype", [("qwen35", "f16"), ("qwen35moe", "q8_0")])
def test_speculative_greedy_equals_interpreter(backend, tiny_pair, arch, dtype, tmp_path):
    target, draft = tiny_pair(arch, dtype)
    engine = _engine(backend, target, draft, tmp_path / "art")
    want = open_engine(target, draft, n_ctx=96).generate(prompt_ids=PROMPT, max_tokens=24, speculative=False,
                                                          ignore_eos=True).tokens
    assert engine.generate(prompt_ids=PROMPT, max_tokens=24, speculative=False, ignore_eos=True).tokens == want
    assert engine.generate(prompt_ids=PROMPT, max_tokens=24, n_max=7, ignore_eos=True).tokens == want


def test_greedy_rounds_move_only_token_ids_through_the_host(backend, tiny_pair, tmp_path, monkeypatch):
    """Once the states live on the device (after the first round), a greedy speculative
    round uploads int32 ids and positions and downloads int32 ids (proposals, the target's
    argmax): no logits, no features, no state crosses the host boundary."""
    engine = _engine(backend, *tiny_pair("qwen35", "f16"), tmp_path / "art")
    programs = [*engine.target.programs.values(), *engine.draft.programs.values()]
    crossings = []
    for device in {id(p.device): p.device for p in programs}.values():
        for way in ("upload", "download"):
            def counted(buf, array, inner=getattr(device, way), way=way):
                crossings.append((way, array.dtype, array.nbytes))
                inner(buf, array)
            monkeypatch.setattr(device, way, counted)
    steps = engine.iter_tokens(prompt_ids=PROMPT, max_tokens=40, n_max=7, ignore_eos=True)
    next(steps), next(steps)  # prefill, then a round that uploads the draft's zero states
    crossings.clear()
    rounds = sum(1 for _ in steps)
    assert rounds >= 3
    assert {way for way, _, _ in crossings} == {"upload", "download"}
    assert {dtype for _, dtype, _ in crossings} == {np.dtype(np.int32)}, crossings


def test_programs_of_one_model_share_weight_buffers(backend, tiny_pair, tmp_path):
    """Prefill, verify and decode of one model read the same weights: uploaded once."""
    engine = _engine(backend, tiny_pair("qwen35", "f16")[0], None, tmp_path / "art", n_ctx=32)
    programs = engine.target.programs
    buffers = [set(map(id, p._resident.values())) for p in programs.values()]
    assert len(set.intersection(*buffers)) >= len(programs["decode"].graph.weights) // 2


@pytest.mark.oracle
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_fixture_pair_speculative_matches_transformers(backend, oracle_gguf, oracle_dir, oracle_prompts, kind, tmp_path):
    engine = _engine(backend, oracle_gguf(f"{kind}/gguf/{kind}-target-f16.gguf"),
                     oracle_gguf(f"{kind}/gguf/{kind}-dflash-f16.gguf"), tmp_path / "art")
    hf = json.loads((oracle_dir / kind / "ref" / "hf_greedy.json").read_text())
    tokens = engine.generate(prompt_ids=oracle_prompts[_PROMPT], max_tokens=_TOKENS, ignore_eos=True).tokens
    assert tokens == hf[_PROMPT]["output_ids"][:_TOKENS], kind


@pytest.mark.oracle
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_fixture_q8_0_target_matches_transformers(opencl, oracle_gguf, oracle_dir, oracle_prompts, kind, tmp_path):
    """The Q8_0 kernels on a real layout (native OpenCL; every backend runs them on the generated moe pair)."""
    engine = _engine("opencl", oracle_gguf(f"{kind}/gguf/{kind}-target-q8_0.gguf"), None, tmp_path / "art")
    hf = json.loads((oracle_dir / kind / "ref" / "hf_q8_0_roundtrip_greedy.json").read_text())
    tokens = engine.generate(prompt_ids=oracle_prompts[_PROMPT], max_tokens=_TOKENS, speculative=False,
                             ignore_eos=True).tokens
    assert tokens == hf[_PROMPT]["output_ids"][:_TOKENS], kind
