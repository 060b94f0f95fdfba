"""The cuda backend on a GPU: every kernel against the interpreter, the PTX fallback, and
greedy speculative generation equal to the interpreter's tokens."""
import json

import pytest

from kernel_cases import CASES, compare

pytestmark = pytest.mark.gpu
PROMPT = [5, 77, 140, 9, 260, 31, 8]


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_interpreter(cuda, name, tmp_path):
    compare(cuda, name, tmp_path)


def test_graph_replay_serves_new_inputs_of_the_same_sizes(cuda, tmp_path):
    """The launch list is captured as a CUDA graph once; later calls replay it with new data."""
    from kernel_cases import case_graph
    from dflash_ir.interpreter import Interpreter

    c = CASES["fused_matmul_norm_swiglu_3_rows"].build()
    graph = case_graph(c)
    program = cuda.load(graph, cuda.compile(graph, tmp_path), tmp_path, lambda w: c.weights[w.tensor])
    reference = Interpreter(graph, lambda w: c.weights[w.tensor])
    for seed in range(3):
        inputs = {k: v * (seed + 1) for k, v in c.inputs.items()}
        got, want = program.run(inputs).outputs, reference.run(inputs).outputs
        for key in want:
            assert abs(got[key] - want[key]).max() <= 1e-5 * abs(want[key]).max()


def test_ptx_fallback_runs(cuda, tmp_path, monkeypatch):
    """A GPU newer than every cubin loads the PTX (JIT-compiled by the driver)."""
    compile_ = type(cuda).compile

    def ptx_only(self, graph, out_dir):
        return {**compile_(self, graph, out_dir), "cubin": {}}

    monkeypatch.setattr(type(cuda), "compile", ptx_only)
    compare(cuda, "matmul_q8_0_q8_x_3_rows", tmp_path)


@pytest.mark.parametrize("arch, dtype", [("qwen35", "f16"), ("qwen35moe", "q8_0")])
def test_speculative_greedy_equals_interpreter(cuda, pair, arch, dtype, tmp_path):
    from dflash_ir.artifact import compile_pair, load_compiled, open_engine

    target, draft = pair(arch, dtype)
    engine = load_compiled(compile_pair(target, draft, out=tmp_path, backend="cuda", n_ctx=128), load_tokenizer=False)
    want = open_engine(target, draft, n_ctx=128).generate(prompt_ids=PROMPT, max_tokens=32, speculative=False,
                                                            ignore_eos=True).tokens
    assert engine.generate(prompt_ids=PROMPT, max_tokens=32, ignore_eos=True).tokens == want


@pytest.mark.oracle
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_fixture_pairs_match_transformers(cuda, oracle_gguf, oracle_dir, oracle_prompts, kind, tmp_path):
    from dflash_ir.artifact import compile_pair, load_compiled

    engine = load_compiled(compile_pair(oracle_gguf(f"{kind}/gguf/{kind}-target-f16.gguf"),
                                        oracle_gguf(f"{kind}/gguf/{kind}-dflash-f16.gguf"),
                                        out=tmp_path, backend="cuda", n_ctx=128), load_tokenizer=False)
    hf = json.loads((oracle_dir / kind / "ref" / "hf_greedy.json").read_text())
    for name, ids in oracle_prompts.items():
        assert engine.generate(prompt_ids=ids, max_tokens=32, ignore_eos=True).tokens == hf[name]["output_ids"], name
