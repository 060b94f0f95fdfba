"""The batched verify (artifact.batched_verify, target_runner.verify_together): the blocks of
2 or 4 sequences in one target pass. A row's logits must not depend on which other rows share
the pass, nor on the padding of its block: each sequence's logits, greedy ids and committed
state equal, bit for bit, those of its own verify; and the recurrent states a commit replays
equal those of decoding the committed rows. On the interpreter, on OpenCL (PoCL) with the
kernels of both device profiles, and on lavapipe and tvm-llvm."""
import collections
from pathlib import Path

import numpy as np
import pytest

from dflash_ir import compile_pair, load_compiled
from dflash_ir.artifact import VERIFY_SLOTS, batched_verify, open_engine
from dflash_ir.errors import ContextOverflowError
from dflash_ir.runtime.target_runner import TargetRunner, verify_together

DEMO = Path(__file__).resolve().parents[2] / "demo"
TARGET, DRAFT = DEMO / "coder-target-q8_0.gguf", DEMO / "coder-dflash-q8_0.gguf"

N_CTX = 96
# sequence j: its prompt (different lengths, so different positions) and its block (1 row up
# to a whole draft block of 16: the short ones are padded in the batched pass)
PROMPTS = ([5, 17, 300, 42, 7], [9, 8], [100, 200, 30, 40, 5, 6, 7, 8, 9, 10, 11], [77])
BLOCKS = ([10, 11, 12, 13], list(range(20, 36)), [5], [240, 241, 242, 243, 244, 245, 246, 247, 248])


def on_host(runner: TargetRunner) -> None:
    """The runner's states copied to the host: a program's buffers (the prefill's, the
    commit's) hold one sequence's states at a time."""
    runner.states = {name: np.array(value) for name, value in runner.states.items()}


def prefilled(programs, prompt) -> TargetRunner:
    """A sequence after its prompt, holding its states on the host."""
    runner = TargetRunner(programs, N_CTX)
    runner.prefill(prompt)
    on_host(runner)
    return runner


def runners(programs, n: int) -> list[TargetRunner]:
    return [prefilled(programs, prompt) for prompt in PROMPTS[:n]]


def kept(block) -> int:
    """Rows a round commits of `block` (some, not all, where it has more than one)."""
    return len(block) // 2 + 1


def recurrent_states(runner: TargetRunner) -> dict[str, np.ndarray]:
    return {name: np.array(value) for name, value in runner.states.items() if not name.endswith("_cache")}


def check_batched_equals_alone(programs) -> None:
    """Per sequence: the recurrent states a commit replays equal, bit for bit, those of
    decoding the committed rows one at a time; logits and greedy ids of its block alone and
    in each batched pass; after committing the same rows, the next decode step's logits (the
    committed states)."""
    alone = []
    for prompt, runner, block in zip(PROMPTS, runners(programs, 4), BLOCKS):
        out = runner.verify(block)
        logits, greedy = np.array(out.logits), np.array(out.greedy)
        runner.commit(kept(block))
        if "commit" in programs:
            decoded = prefilled(programs, prompt)
            for token in block[:kept(block)]:
                decoded.decode(token)
            replayed, stepped = recurrent_states(runner), recurrent_states(decoded)
            assert replayed.keys() == stepped.keys()
            assert all(np.array_equal(replayed[name], stepped[name]) for name in stepped), block
        alone.append((logits, greedy, np.array(runner.decode(3).logits)))
    for slots in VERIFY_SLOTS:
        rs = runners(programs, slots)
        outs = verify_together(rs, BLOCKS[:slots], programs[batched_verify(slots)])
        together = [(np.array(o.logits), np.array(o.greedy)) for o in outs]  # before the next pass reuses them
        for runner, block in zip(rs, BLOCKS):
            runner.commit(kept(block))
            on_host(runner)
        for j, (runner, block) in enumerate(zip(rs, BLOCKS)):
            logits, greedy, after = alone[j]
            assert together[j][0].shape == logits.shape, (slots, j)
            assert np.array_equal(together[j][0], logits), (slots, j, np.abs(together[j][0] - logits).max())
            assert np.array_equal(together[j][1], greedy), (slots, j)
            assert np.array_equal(np.array(runner.decode(3).logits), after), (slots, j)


@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe", "llama"])
def test_interpreter_batched_rows_equal_their_own_verify(tiny_pair, arch):
    engine = open_engine(*tiny_pair(arch), n_ctx=N_CTX)
    check_batched_equals_alone(engine.target.programs)


def test_interpreter_demo_pair(demo_engine):
    check_batched_equals_alone(demo_engine.target.programs)


@pytest.fixture(scope="module")
def demo_engine():
    return open_engine(TARGET, DRAFT, n_ctx=N_CTX)


@pytest.mark.parametrize("backend, profile", [
    ("opencl", "cpu"), ("opencl", "gpu"),
    pytest.param("vulkan", None, marks=pytest.mark.slow), pytest.param("tvm-llvm", None, marks=pytest.mark.slow)])
def test_kernel_backend_batched_rows_equal_their_own_verify(tmp_path, monkeypatch, backend, profile):
    """OpenCL on PoCL with the kernels of each device class; lavapipe and tvm-llvm (slow: a
    minute's compile each)."""
    from dflash_ir.backends.base import get_backend

    reason = get_backend(backend).unavailable_reason()
    if reason:
        pytest.skip(f"{backend} is not available: {reason}")
    if profile:
        monkeypatch.setenv("DFLASH_IR_PROFILE", profile)  # the kernels of this device class, run on PoCL
    out = compile_pair(TARGET, DRAFT, out=tmp_path / "art", backend=backend, n_ctx=N_CTX)
    check_batched_equals_alone(load_compiled(out, measure_costs=False).target.programs)


def test_batched_graph_shares_the_weights_and_keeps_the_sequences_apart(demo_engine):
    """One product per weight for all rows (one weight read); per sequence its own attention
    and recurrence over its own states, named s<j>.<state>."""
    programs = demo_engine.target.programs
    alone, two = programs["verify"].graph, programs[batched_verify(2)].graph
    ops = collections.Counter(n.op for n in two.nodes)
    single = collections.Counter(n.op for n in alone.nodes)
    assert ops["matmul"] == single["matmul"] and ops["embedding"] == 1
    assert ops["attention"] == 2 * single["attention"] and ops["gated_delta_rule"] == 2 * single["gated_delta_rule"]
    assert {s.value.name for s in two.states} == {f"s{j}.{s.value.name}" for j in range(2) for s in alone.states}
    assert two.values()["tokens"].type.shape == (2 * 16,)


def test_a_block_that_does_not_fit_is_refused(demo_engine):
    programs = demo_engine.target.programs
    rs = runners(programs, 2)
    with pytest.raises(ValueError, match="a block of 17 tokens; it takes 1..16"):
        verify_together(rs, [[1] * 17, [2]], programs[batched_verify(2)])
    rs[1].prefill(list(range(N_CTX - 16)))  # 2 + 80 cached: 16 more rows pass the context of 96
    with pytest.raises(ContextOverflowError, match="82 cached \\+ 16 rows of a batched verify"):
        verify_together(rs, [[1], [2]], programs[batched_verify(2)])
