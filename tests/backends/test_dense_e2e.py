"""`llama` and `qwen3` targets with a DFlash draft, end to end on every backend that runs here:
the compiled pair gives the interpreter's greedy tokens, target-only and speculative (backends
that cannot run skip with the reason)."""
import os

import pytest

from dflash_ir.artifact import compile_pair, load_compiled, open_engine
from dflash_ir.backends.base import get_backend

PROMPT = [5, 77, 140, 9, 260, 31, 8, 101, 44, 203]


# llama on lavapipe and TVM-llvm passes too but compiles ~4 min each on 2 cores (its attention
# is unfused: rope, transpose, attention kernels per layer); run them with DFLASH_IR_ALL_DENSE=1.
CASES = [("opencl", "llama", "f32"), ("opencl", "qwen3", "q8_0"), ("vulkan", "qwen3", "q8_0"),
         ("tvm-llvm", "qwen3", "q8_0")]
ALL = [(b, a, d) for b in ("opencl", "vulkan", "tvm-llvm") for a, d in (("llama", "f32"), ("qwen3", "q8_0"))]


@pytest.mark.slow
@pytest.mark.parametrize("backend, arch, dtype", ALL if os.environ.get("DFLASH_IR_ALL_DENSE") else CASES)
def test_dense_target_pairs_equal_the_interpreter(tiny_pair, backend, arch, dtype, tmp_path):
    reason = get_backend(backend).unavailable_reason()
    if reason:
        pytest.skip(f"{backend}: {reason}")
    target, draft = tiny_pair(arch, dtype)
    want = open_engine(target, draft, n_ctx=96).generate(prompt_ids=PROMPT, max_tokens=20, speculative=False,
                                                          ignore_eos=True).tokens
    engine = load_compiled(compile_pair(target, draft, out=tmp_path / "art", backend=backend, n_ctx=96),
                           load_tokenizer=False, measure_costs=False)
    assert engine.generate(prompt_ids=PROMPT, max_tokens=20, speculative=False, ignore_eos=True).tokens == want
    assert engine.generate(prompt_ids=PROMPT, max_tokens=20, n_max=7, ignore_eos=True).tokens == want
