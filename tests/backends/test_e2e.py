"""End to end on every backend that runs here (OpenCL and Vulkan with the native kernels,
TVM-built kernels on the TVM runtime and on OpenCL): compiled artifacts give the
interpreter's greedy tokens, speculative or not, on generated pairs, and (oracle) the
Transformers tokens on the fixture pairs. Backends that cannot run skip with the reason."""
import json

import numpy as np
import pytest

from dflash_ir.artifact import compile_pair, load_compiled, open_engine
from dflash_ir.backends.base import get_backend
from dflash_ir.models.draft_vocab import reduced_draft_plan
from dflash_ir.models.generator import (TINY_MASK_ID, tiny_draft_config, tiny_target_config, write_draft,
                                        write_gguf, write_target)
from dflash_ir.models.gguf_file import open_gguf

PROMPT = [5, 77, 140, 9, 260, 31, 8]
AGREEING_PROMPT = [5, 77, 140, 9, 260, 31, 8, 101, 44, 203, 17, 66, 250, 12, 90, 133]  # >= 15 tokens, no MASK
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


def _engine(backend, target, draft, out, n_ctx=96, measure_costs=False):
    engine = load_compiled(compile_pair(target, draft, out=out, backend=backend, n_ctx=n_ctx), load_tokenizer=False,
                           measure_costs=measure_costs)
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


@pytest.mark.parametrize("backend", ["opencl", "vulkan"])
def test_q8_cores_quantising_their_own_outputs_keep_greedy_output(backend, tmp_path):
    """Value heads of 32 in every layer (the tiny Gated DeltaNet's are 16 wide otherwise): under
    q8 numerics each attention and Gated DeltaNet core writes the Q8_0 blocks its output
    projection reads (q8_out). The engine's tokens, speculative (a random draft: every round
    rolled back, the commit replaying one row) or not, are the q8 interpreter's, whose graph
    quantises in nodes of their own. (The native kernels: TVM lowers q8_out as the core and a
    quantisation, whose kernel cases run on TVM too.)"""
    reason = get_backend(backend).unavailable_reason()
    if reason:
        pytest.skip(f"{backend}: {reason}")
    cfg = tiny_target_config("qwen35", ssm_d_state=32)
    target, draft = tmp_path / "target.gguf", tmp_path / "draft.gguf"
    write_target(target, cfg, dtype="q8_0", seed=1)
    write_draft(draft, tiny_draft_config(cfg), target_cfg=cfg, dtype="q8_0", seed=2)
    engine = load_compiled(compile_pair(target, draft, out=tmp_path / "art", backend=backend, n_ctx=96,
                                        numerics="q8"), load_tokenizer=False)
    want = open_engine(target, draft, n_ctx=96, numerics="q8").generate(
        prompt_ids=PROMPT, max_tokens=16, speculative=False, ignore_eos=True).tokens
    assert engine.generate(prompt_ids=PROMPT, max_tokens=16, speculative=False, ignore_eos=True).tokens == want
    assert engine.generate(prompt_ids=PROMPT, max_tokens=16, n_max=7, ignore_eos=True).tokens == want


@pytest.mark.parametrize("arch, dtype", [("qwen35", "f16"), ("qwen35moe", "q8_0")])
def test_rollback_of_all_some_or_no_proposal_rows_keeps_greedy_output(backend, agreeing_pair, arch, dtype, tmp_path):
    """Drafts agreeing on 0 or 5 proposals per round: rounds of 7 roll back all or 2 proposal
    rows, rounds of 3 keep every row. Tokens equal the interpreter's target-only ones and the
    target's state equals what target-only decoding leaves (25 tokens: the first, then whole rounds)."""
    _check_rollback(backend, agreeing_pair, arch, dtype, tmp_path)


@pytest.mark.parametrize("name", ["opencl", "vulkan"])
def test_rollback_with_the_gpu_schedule_on_a_cpu_device(name, agreeing_pair, tmp_path, monkeypatch):
    """The same on the kernels a GPU runs (work-groups sharing a row), here on PoCL and
    lavapipe: it found PoCL running a head's cache-write loop in idle lanes."""
    reason = get_backend(name).unavailable_reason()
    if reason:
        pytest.skip(f"{name}: {reason}")
    monkeypatch.setenv("DFLASH_IR_PROFILE", "gpu")
    _check_rollback(name, agreeing_pair, "qwen35", "f16", tmp_path)


def _check_rollback(backend, agreeing_pair, arch, dtype, tmp_path):
    for agree in (0, 5):
        target, draft = agreeing_pair(arch, agree, dtype)
        engine = _engine(backend, target, draft, tmp_path / f"art{agree}")
        want = open_engine(target, draft, n_ctx=96).generate(prompt_ids=AGREEING_PROMPT, max_tokens=25,
                                                              speculative=False, ignore_eos=True).tokens
        assert engine.generate(prompt_ids=AGREEING_PROMPT, max_tokens=25, speculative=False,
                               ignore_eos=True).tokens == want
        decoded = _committed_states(engine.target)
        for n_max in (3, 7) if agree else (7,):
            gen = engine.generate(prompt_ids=AGREEING_PROMPT, max_tokens=25, n_max=n_max, ignore_eos=True)
            assert gen.tokens == want
            assert {r["accepted"] for r in gen.rounds} == {min(agree, n_max)}
            for name, state in _committed_states(engine.target).items():
                assert np.abs(state - decoded[name]).max() <= 1e-4 * max(1.0, np.abs(decoded[name]).max()), name


def test_cost_aware_length_and_decode_steps_keep_greedy_output(backend, agreeing_pair, scripted_lengths, tmp_path):
    """Measured costs drive the length; then decode steps between rounds leave a verify's
    accepted features waiting on the device, and they still reach the draft in order: every
    round of a draft agreeing on 5 proposals accepts min(5, k)."""
    target, draft = agreeing_pair("qwen35", 5, "f16")
    engine = _engine(backend, target, draft, tmp_path / "art", measure_costs=True)
    costs = engine.costs
    assert len(costs.verify) == 16 and min(costs.verify) > 0 and costs.decode > 0 and costs.draft > 0
    want = open_engine(target, draft, n_ctx=96).generate(prompt_ids=AGREEING_PROMPT, max_tokens=30,
                                                          speculative=False, ignore_eos=True).tokens
    gen = engine.generate(prompt_ids=AGREEING_PROMPT, max_tokens=30, ignore_eos=True)
    assert gen.tokens == want and gen.stats.policy == "cost-aware"
    script = [0, 0, 7, 0, 3, 0, 0, 7, 7, 0, 2]
    engine.controller = scripted_lengths(script + [6] * 30)
    gen = engine.generate(prompt_ids=AGREEING_PROMPT, max_tokens=30, ignore_eos=True)
    assert gen.tokens == want and gen.stats.lengths[:len(script)] == script
    assert [r["accepted"] for r in gen.rounds] == [min(5, len(r["proposals"])) for r in gen.rounds]


def test_a_reduced_draft_head_keeps_acceptance_and_greedy_output(backend, agreeing_pair, tmp_path):
    """A draft agreeing on 5 proposals, given a reduced head (d2t) of 59 of the 320 ids that
    holds the text's tokens and MASK: its proposals, mapped to target ids, are accepted as the
    whole head's are (min(5, n) a round), and the tokens are the interpreter's target-only ones."""
    target, draft = agreeing_pair("qwen35", 5, "f16")
    ids = np.array(sorted(set(AGREEING_PROMPT) | {TINY_MASK_ID} | set(range(0, 320, 7))), np.int64)
    assert len(ids) == 59
    reduced = write_gguf(tmp_path / "reduced.gguf", reduced_draft_plan(open_gguf(draft), open_gguf(target), ids))
    engine = _engine(backend, target, reduced, tmp_path / "art")
    want = open_engine(target, draft, n_ctx=96).generate(prompt_ids=AGREEING_PROMPT, max_tokens=25,
                                                          speculative=False, ignore_eos=True).tokens
    gen = engine.generate(prompt_ids=AGREEING_PROMPT, max_tokens=25, n_max=7, ignore_eos=True)
    assert gen.tokens == want
    assert {r["accepted"] for r in gen.rounds} == {5}
    assert set().union(*(r["proposals"] for r in gen.rounds)) <= set(ids.tolist())


def _committed_states(target) -> dict[str, np.ndarray]:
    """The target's states on the host: KV rows of committed positions, all recurrent state."""
    return {k: np.asarray(v)[:target.n_past] if k.endswith("_cache") else np.asarray(v) for k, v in target.states.items()}


def test_greedy_rounds_move_only_token_ids_through_the_host(backend, tiny_pair, tmp_path, monkeypatch):
    """Once the states live on the device (after the first round), a greedy speculative
    round uploads int32 ids and positions and downloads int32 ids (proposals, the target's
    argmax): no logits, no features, no state crosses the host boundary."""
    engine = _engine(backend, *tiny_pair("qwen35", "f16"), tmp_path / "art")
    programs = [*engine.target.programs.values(), *engine.draft.programs.values()]
    crossings = []
    for device in {id(p.device): p.device for p in programs}.values():
        for way in ("upload", "download"):
            def counted(buf, array, *offset, inner=getattr(device, way), way=way):
                crossings.append((way, array.dtype, array.nbytes))
                inner(buf, array, *offset)
            monkeypatch.setattr(device, way, counted)
    steps = engine.iter_tokens(prompt_ids=PROMPT, max_tokens=40, n_max=7, ignore_eos=True)
    next(steps), next(steps)  # prefill, then a round that uploads the draft's zero states
    crossings.clear()
    rounds = sum(1 for _ in steps)
    assert rounds >= 3
    assert {way for way, _, _ in crossings} == {"upload", "download"}
    assert {dtype for _, dtype, _ in crossings} == {np.dtype(np.int32)}, crossings


def test_programs_of_one_model_share_weight_buffers(backend, tiny_pair, tmp_path):
    """Prefill, verify and decode of one model read the same weights, and the commit those of
    the recurrent layers: uploaded once."""
    engine = _engine(backend, tiny_pair("qwen35", "f16")[0], None, tmp_path / "art", n_ctx=32)
    programs = engine.target.programs
    buffers = {name: set(map(id, p._resident.values())) for name, p in programs.items()}
    shared = set.intersection(*(buffers[name] for name in ("prefill", "verify", "decode")))
    assert len(shared) >= len(programs["decode"].graph.weights) // 2
    assert buffers["commit"] and buffers["commit"] <= shared


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
