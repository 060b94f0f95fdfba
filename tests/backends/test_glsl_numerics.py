"""The GLSL printer's own math (backends/kir/glsl.py GLSL_HELPERS: sinf, cosf, log1pf, roundf,
the f16 conversions, packed 8/16-bit stores and sign-extending byte loads) run on a Vulkan
device (lavapipe here) against float64 numpy references, edge cases included; under FULL and
BASELINE. Skipped without a Vulkan device or without glslangValidator."""
import numpy as np
import pytest

from dflash_ir.backends.kir import I32, U32, KernelBuilder, call, cast, var
from dflash_ir.backends.kir.glsl import BASELINE, FULL

N = 4096
OUTPUTS = ("sin", "cos", "log1p", "round", "round_half")


def _probe():
    """Each math helper on x, x to f16 bits, and bytes i * 37 stored one byte per invocation
    (neighbours share a 32-bit word in BASELINE)."""
    kb = KernelBuilder("probe", local=(64,))
    x = kb.buffer("x", "f32")
    outs = {o: kb.buffer(f"{o}_out", "f32", writes=True) for o in OUTPUTS}
    half_bits, low_bytes = kb.buffer("half_bits", "u16", writes=True), kb.buffer("low_bytes", "u8", writes=True)
    i = kb.let("i", kb.gid(0) * 64 + kb.lid(0))
    kb.return_if(i >= var("n_N"))
    v = kb.let("v", x[i])
    for name, fn in (("sin", "sin"), ("cos", "cos"), ("log1p", "log1p"), ("round", "round"),
                     ("round_half", "round_f16")):
        outs[name][i] = call(fn, v)
    half_bits.store(i, v, "f16")
    low_bytes[i] = cast(I32, cast(U32, i) * 37)
    return kb.build(["n_N"])


def _read_back():
    """The f16 bits widened back to f32, and the bytes read as signed int8."""
    kb = KernelBuilder("read_back", local=(64,))
    half_bits, low_bytes = kb.buffer("half_bits", "u16"), kb.buffer("low_bytes", "u8")
    widened, signed = kb.buffer("widened", "f32", writes=True), kb.buffer("bytes", "i32", writes=True)
    i = kb.let("i", kb.gid(0) * 64 + kb.lid(0))
    kb.return_if(i >= var("n_N"))
    widened[i] = half_bits.load(i, "f16")
    signed[i] = low_bytes.load(i, "i8")
    return kb.build(["n_N"])


def _inputs() -> np.ndarray:
    rng = np.random.default_rng(7)
    edge = [0.0, -0.0, 0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 0.49999997, -0.49999997, 8388607.5, 1e-8, -1e-8,
            -0.999, 0.75, 3.0, 12000.0, -12000.0, np.pi / 4, np.pi / 2, np.pi,
            65504.0, 65519.996, 65520.0, -65520.0, 1e6, 6.1035156e-05, 6.097555e-05, 2.9802322e-08,
            2.9802326e-08, 5.9604645e-08, 1.0009765625, 1.00048828125, 1.00146484375]
    values = np.concatenate([edge, rng.uniform(-12000, 12000, 1024), rng.uniform(-4, 4, 1024),
                             rng.uniform(-0.999, 10, 1024), rng.standard_normal(N) * 1e-3])
    return values[:N].astype(np.float32)


def _run(run_vulkan, features, x: np.ndarray) -> dict[str, np.ndarray]:
    groups, ints = (N // 64,), {"n_N": N}
    arrays = {"x": x, **{f"{o}_out": np.zeros(N, np.float32) for o in OUTPUTS},
              "half_bits": np.zeros(N, np.uint16), "low_bytes": np.zeros(N, np.uint8)}
    out = run_vulkan(_probe(), features, groups, arrays, ints)
    back = run_vulkan(_read_back(), features, groups, {"half_bits": out["half_bits"], "low_bytes": out["low_bytes"],
                                                       "widened": np.zeros(N, np.float32),
                                                       "bytes": np.zeros(N, np.int32)}, ints)
    return {**out, **back}


@pytest.mark.parametrize("variant", ["full", "baseline"])
def test_helpers_match_float64_references(run_vulkan, variant):
    x = _inputs()
    got = _run(run_vulkan, {"full": FULL, "baseline": BASELINE}[variant], x)
    wide = x.astype(np.float64)
    trig = np.abs(wide) < 12867  # where the three-part reduction is exact
    np.testing.assert_allclose(got["sin_out"][trig], np.sin(wide[trig]), rtol=0, atol=2.5e-7)
    np.testing.assert_allclose(got["cos_out"][trig], np.cos(wide[trig]), rtol=0, atol=2.5e-7)
    live = wide > -1
    np.testing.assert_allclose(got["log1p_out"][live], np.log1p(wide[live]), rtol=6e-7, atol=0)
    away = np.where(wide >= 0, np.floor(wide + 0.5), np.ceil(wide - 0.5))
    np.testing.assert_array_equal(got["round_out"], away.astype(np.float32))
    with np.errstate(over="ignore"):  # 65520 and beyond round to infinity, as intended
        halves = x.astype(np.float16)  # numpy rounds f32 -> f16 to nearest even
    np.testing.assert_array_equal(got["half_bits"], halves.view(np.uint16))
    np.testing.assert_array_equal(got["round_half_out"], halves.astype(np.float32))
    np.testing.assert_array_equal(got["widened"], halves.astype(np.float32))
    low = (np.arange(N, dtype=np.uint32) * 37).astype(np.uint8)
    np.testing.assert_array_equal(got["low_bytes"], low)
    np.testing.assert_array_equal(got["bytes"], low.view(np.int8).astype(np.int32))
