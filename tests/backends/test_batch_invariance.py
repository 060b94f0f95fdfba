"""Batch invariance: a row's logits do not depend on how many rows share the target call.

A verify of 16 rows and the decode of its first token must give that token the same
logits bit for bit, or speculative decoding is not exactly the target's output (a greedy
near-tie flips). Every row is checked at 1, 2, 7 and 16 rows, from the same committed
state, in both numerics modes, on the native kernels (PoCL in both profiles, lavapipe) and
tvm-llvm. tvm-opencl is not invariant yet: its dlight GEMV and GEMM schedules sum a row in
different orders (issue: the TVM path's schedules)."""
import numpy as np
import pytest

from dflash_ir.artifact import compile_pair, load_compiled
from dflash_ir.backends.base import get_backend
from dflash_ir.models.generator import tiny_target_config, write_target

PROMPT = [5, 77, 140, 9, 260, 31, 8]
BLOCK = [12, 301, 44, 7, 99, 150, 3, 18, 250, 61, 72, 5, 33, 200, 9, 140]
ROWS = (1, 2, 7, 16)
# K of 17 and 18 Q8_0 blocks: the CPU products' 16-block scale runs and their tails both run
WIDE = dict(hidden=544, ff=576, expert_ff=576, shared_ff=544)


@pytest.fixture(scope="module")
def wide_target(tmp_path_factory):
    """`get(arch)` -> a generated Q8_0 target whose products span more than 16 blocks."""
    made = {}

    def get(arch: str):
        if arch not in made:
            fields = {k: v for k, v in WIDE.items() if arch == "qwen35moe" or k not in ("expert_ff", "shared_ff")}
            if arch == "qwen35moe":
                fields.pop("ff")
            made[arch] = tmp_path_factory.mktemp(arch) / "target.gguf"
            write_target(made[arch], tiny_target_config(arch, **fields), dtype="q8_0", seed=1)
        return made[arch]
    return get


DEVICES = [("opencl", "cpu"), ("opencl", "gpu"), ("vulkan", None), ("tvm-llvm", None), ("cuda", None)]


@pytest.fixture(params=DEVICES, ids=lambda p: "-".join(filter(None, p)))
def device(request, monkeypatch):
    return _device(request.param, monkeypatch)


# lavapipe takes ~10 minutes to build the K-quant mix's CPU tiles (scalarized, every row bucket);
# its kernels are the OpenCL ones, checked kernel by kernel on lavapipe in test_vulkan_kernels
@pytest.fixture(params=[d for d in DEVICES if d[0] != "vulkan"], ids=lambda p: "-".join(filter(None, p)))
def k_quant_device(request, monkeypatch):
    return _device(request.param, monkeypatch)


def _device(param, monkeypatch) -> str:
    name, profile = param
    reason = get_backend(name).unavailable_reason()
    if reason:
        pytest.skip(f"{name}: {reason}")
    if profile:
        monkeypatch.setenv("DFLASH_IR_PROFILE", profile)
    return name


@pytest.fixture(scope="module")
def q4_k_m_target(tmp_path_factory):
    """A generated qwen35 target in llama-quantize's Q4_K_M mix (K of 512 and 768: whole K-quant blocks)."""
    from dflash_ir.benchmark.peer import PeerCrashed, peer_unavailable, quantize

    if reason := peer_unavailable():
        pytest.skip(reason)
    d = tmp_path_factory.mktemp("q4_k_m")
    write_target(d / "f16.gguf", tiny_target_config("qwen35", hidden=512, ff=768), dtype="f16", seed=2)
    try:
        return quantize(d / "f16.gguf", d / "target.gguf", "Q4_K_M")
    except PeerCrashed as e:
        pytest.skip(str(e))


@pytest.mark.parametrize("numerics", ["exact", "q8"])
@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe"])
def test_a_rows_logits_do_not_depend_on_the_rows_beside_it(device, wide_target, arch, numerics, tmp_path):
    _check_rows(wide_target(arch), device, numerics, tmp_path)


def test_a_q4_k_m_rows_logits_do_not_depend_on_the_rows_beside_it(k_quant_device, q4_k_m_target, tmp_path):
    """The K-quant products (the CPU tiles decode their blocks 16 outputs at a time) too."""
    _check_rows(q4_k_m_target, k_quant_device, "exact", tmp_path)


def _check_rows(target, device: str, numerics: str, tmp_path) -> None:
    engine = load_compiled(compile_pair(target, None, out=tmp_path / "art", backend=device, n_ctx=64,
                                        numerics=numerics), load_tokenizer=False)
    runner = engine.target
    runner.prefill(PROMPT)
    logits = {t: runner.verify(BLOCK[:t]).logits.copy() for t in ROWS}
    for t in ROWS[1:]:
        np.testing.assert_array_equal(logits[t][:ROWS[0]], logits[ROWS[0]], err_msg=f"{t} rows vs 1")
        shared = min(t, 7)
        np.testing.assert_array_equal(logits[t][:shared], logits[16][:shared], err_msg=f"{t} rows vs 16")
    decoded = runner.decode(BLOCK[0]).logits
    np.testing.assert_array_equal(decoded[0], logits[16][0], err_msg="decode vs the first verify row")
