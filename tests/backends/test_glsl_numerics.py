"""The GLSL renderer's own math (backends/glsl.py GLSL_HELPERS: sinf, cosf, log1pf, roundf, the
f16 conversions, packed 8/16-bit stores) run on a Vulkan device (lavapipe here) against
float64 numpy references, edge cases included; under FULL and BASELINE. Skipped without a
Vulkan device or without glslangValidator."""
import numpy as np
import pytest

from dflash_ir.backends.cstyle import Buffer, Kernel
from dflash_ir.backends.glsl import BASELINE, FULL, compile_spirv, glsl_tools_missing, render_glsl

N = 4096
OUTPUTS = ("sin", "cos", "log1p", "round", "round_half")
BODY = ("  int i = GID(0) * 64 + LID(0);\n  if (i >= n_N) return;\n  float v = x[i];\n"
        "  sin_out[i] = sinf(v);\n  cos_out[i] = cosf(v);\n  log1p_out[i] = log1pf(v);\n"
        "  round_out[i] = roundf(v);\n  round_half_out[i] = ROUND_HALF(v);\n"
        "  STORE_HALF(half_bits, i, v);\n  ST_U8(low_bytes, i, I32(U32(i) * 37u));\n")
READ_BACK = ("  int i = GID(0) * 64 + LID(0);\n  if (i >= n_N) return;\n"
             "  widened[i] = HALF_AT(half_bits, i);\n  bytes[i] = LD_I8(low_bytes, i);\n")


def _probe(name: str, body: str, buffers) -> Kernel:
    return Kernel.make(name, [Buffer(*b) for b in buffers], ("n_N",), (64, 1, 1), body)


PROBE = _probe("probe", BODY, [("x", "float")] + [(f"{o}_out", "float", True) for o in OUTPUTS]
               + [("half_bits", "u16", True), ("low_bytes", "u8", True)])
READ = _probe("read_back", READ_BACK, [("half_bits", "u16"), ("low_bytes", "u8"), ("widened", "float", True),
                                       ("bytes", "int", True)])


@pytest.fixture(scope="module")
def device(vulkan):
    if glsl_tools_missing():
        pytest.skip(glsl_tools_missing())
    from dflash_ir.backends.vulkan_device import choose_device, open_device, physical_devices, supported_features

    physical = choose_device(physical_devices())
    if not set(FULL.required_device_features()) <= supported_features(physical):
        pytest.skip(f"{physical.describe()} lacks a feature of the FULL variant")
    return open_device(physical, frozenset(FULL.required_device_features()))


def _inputs() -> np.ndarray:
    rng = np.random.default_rng(7)
    edge = [0.0, -0.0, 0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 0.49999997, -0.49999997, 8388607.5, 1e-8, -1e-8,
            -0.999, 0.75, 3.0, 12000.0, -12000.0, np.pi / 4, np.pi / 2, np.pi,
            65504.0, 65519.996, 65520.0, -65520.0, 1e6, 6.1035156e-05, 6.097555e-05, 2.9802322e-08,
            2.9802326e-08, 5.9604645e-08, 1.0009765625, 1.00048828125, 1.00146484375]
    values = np.concatenate([edge, rng.uniform(-12000, 12000, 1024), rng.uniform(-4, 4, 1024),
                             rng.uniform(-0.999, 10, 1024), rng.standard_normal(N) * 1e-3])
    return values[:N].astype(np.float32)


def _run(device, features, x: np.ndarray) -> dict[str, np.ndarray]:
    spirv = {k.name: compile_spirv(render_glsl(k, features), name=k.name) for k in (PROBE, READ)}
    device.add_kernels(spirv)
    shapes = {"x": (np.float32, N), **{f"{o}_out": (np.float32, N) for o in OUTPUTS},
              "half_bits": (np.uint16, N), "low_bytes": (np.uint8, N), "widened": (np.float32, N),
              "bytes": (np.int32, N)}
    bufs = {name: device.alloc(-(-np.dtype(t).itemsize * n // 4) * 4) for name, (t, n) in shapes.items()}
    device.upload(bufs["x"], x)
    for k in (PROBE, READ):
        device.launch(k.name, (N // 64, 1, 1), k.local, [bufs[b.name] for b in k.buffers] + [N])
    device.synchronize()
    out = {}
    for name, (t, n) in shapes.items():
        out[name] = np.empty(n, t)
        device.download(bufs[name], out[name])
    return out


@pytest.mark.parametrize("variant", ["full", "baseline"])
def test_helpers_match_float64_references(device, variant):
    x = _inputs()
    got = _run(device, {"full": FULL, "baseline": BASELINE}[variant], x)
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
