"""The kernel-tree passes for targets without a construct (backends/kir/lower.py): `scalarize`
(vectors as lane loops, CUDA/HIP/GLSL) computes what the vector kernel computes, bit for bit,
when both are printed as OpenCL and run on PoCL; `expand_wg_reduce` (a barrier tree) gives the
work-group sums and maxima that GLSL's subgroup form gives, on lavapipe and on PoCL. The
structural checks need no device."""
from dataclasses import replace

import numpy as np
import pytest

from dflash_ir.backends.kir import F32, I16, KernelBuilder, call, cast, maximum, select, vsum
from dflash_ir.backends.kir.c import PRINTERS
from dflash_ir.backends.kir.glsl import BASELINE, FULL, render_glsl
from dflash_ir.backends.kir.ir import walk
from dflash_ir.backends.kir.lower import expand_wg_reduce, scalarize
from dflash_ir.backends.kir.simplify import simplify

V16 = F32.vec(16)
GROUPS, LOCAL = 2, 4
ITEMS = GROUPS * LOCAL


def vector_kernel():
    """What the CPU Q8_0 products do with vectors: 16-wide f32, i8 and f16 loads, 16-bit
    integer products, fma, an array of vectors, runs of a scalar array read and written as
    vectors, vector variables, a component-wise select and max, vsum, a vector store."""
    kb = KernelBuilder("vec", (LOCAL,))
    x, q, h = kb.buffer("x", "f32"), kb.buffer("q", "u8"), kb.buffer("h", "u16")
    out = kb.buffer("out", "f32", writes=True)
    t = kb.let("t", kb.gid(0) * LOCAL + kb.lid(0))
    acc = kb.array("acc", V16, 2)
    with kb.loop("a", 0, 2) as a:
        acc[a] = cast(V16, 0.0)
    sc = kb.array("sc", F32, 16)
    kb.set(sc.vec(0, 16), h.load(t * 16, "f16", 16))
    with kb.loop("j", 0, 4) as j:
        base = kb.let("base", (t * 4 + j) * 32)
        qa = kb.let("qa", cast(I16.vec(16), q.load(base, "i8", 16)))
        acc[0] = call("fma", cast(V16, qa * cast(I16.vec(16), q.load(base + 16, "i8", 16))), sc[j], acc[0])
        xv = kb.let("xv", x.load(base, lanes=16))
        kb.set(xv, maximum(select(xv > 0.0, xv, xv * 0.5), -1.0))
        acc[1] = call("fma", xv, sc.vec(0, 16), acc[1])
    kb.set(sc.vec(0, 16), acc[1] * 0.25)
    out[t] = vsum(acc[0]) + vsum(acc[1])
    out.store(ITEMS + t * 16, sc.vec(0, 16))
    return kb.build()


def _inputs(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    halves = rng.standard_normal(ITEMS * 16).astype(np.float16)
    return {"x": rng.standard_normal(ITEMS * 128).astype(np.float32) * np.float32(3),
            "q": rng.integers(0, 256, ITEMS * 128).astype(np.uint8), "h": halves.view(np.uint16),
            "out": np.zeros(ITEMS * 17, np.float32)}


def _reference(a: dict[str, np.ndarray]) -> np.ndarray:
    """The kernel in float64 numpy (its roundings aside)."""
    q = a["q"].view(np.int8).astype(np.float64).reshape(ITEMS, 4, 2, 16)
    x = a["x"].astype(np.float64).reshape(ITEMS, 4, 2, 16)[:, :, 0]
    sc = a["h"].view(np.float16).astype(np.float64).reshape(ITEMS, 16)
    acc0 = ((q[:, :, 0] * q[:, :, 1]) * sc[:, :4, None]).sum(axis=1)
    acc1 = (np.maximum(np.where(x > 0, x, x * 0.5), -1.0) * sc[:, None, :]).sum(axis=1)
    return np.concatenate([acc0.sum(axis=1) + acc1.sum(axis=1), (acc1 * 0.25).reshape(-1)])


def test_scalarized_kernel_computes_what_the_vector_kernel_computes(run_opencl):
    kernel = vector_kernel()
    lanes = scalarize(kernel)
    vector_source, lanes_source = (PRINTERS["opencl"].kernel_source(k) for k in (kernel, lanes))
    assert "float16" in vector_source and "vsum16" in vector_source
    assert "float16" not in lanes_source and "vsum" not in lanes_source and "lane_" in lanes_source
    inputs = _inputs()
    got = run_opencl(kernel, (GROUPS,), inputs)["out"]
    again = run_opencl(replace(lanes, name=lanes.name + "_lanes"), (GROUPS,), inputs)["out"]
    np.testing.assert_allclose(got, _reference(inputs), rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(again.view(np.uint32), got.view(np.uint32))


def test_scalarize_leaves_no_vector_and_keeps_scalar_kernels():
    lanes = scalarize(vector_kernel())
    assert all(n.dtype.lanes == 1 for n in walk(lanes.body)) and not any(n.op == "vsum" for n in walk(lanes.body))
    arrays = {n.arg[0]: n.arg[1] for n in walk(lanes.body) if n.op == "array"}
    assert arrays["acc"] == 32 and arrays["sc"] == 16 and arrays["xv"] == 16 and arrays["qa"] == 16
    scalar = _reduce_kernel()
    assert scalarize(scalar) is scalar


def test_vector_sums_add_halves_first():
    """vsum of 4 lanes is (l0 + l2) + (l1 + l3): halves first, the order of OpenCL's .lo + .hi."""
    kb = KernelBuilder("sum4", (1,))
    x, out = kb.buffer("x", "f32"), kb.buffer("out", "f32", writes=True)
    out[0] = vsum(x.load(0, lanes=4))
    (store,) = [n for n in walk(scalarize(kb.build()).body) if n.op == "store"]
    total = store.src[1]

    def lane(load):
        assert load.op == "load"
        return simplify(load.src[0]).arg

    assert total.op == "add" and [[lane(s) for s in half.src] for half in total.src] == [[0, 2], [1, 3]]


# -- work-group reductions ----------------------------------------------------------------
L = 256


def _reduce_kernel():
    kb = KernelBuilder("wg", (L,))
    x, sums, maxima = kb.buffer("x", "f32"), kb.buffer("sums", "f32", True), kb.buffer("maxima", "f32", True)
    g, lid = kb.let("g", kb.gid(0)), kb.let("lid", kb.lid(0))
    red = kb.array("red", F32, L, "local")
    red[lid] = x[g * L + lid]
    kb.wg_reduce(red, L, "sum")
    with kb.if_(lid.eq(0)):
        sums[g] = red[0]
    kb.barrier()
    red[lid] = x[g * L + lid]
    kb.wg_reduce(red, L, "max")
    with kb.if_(lid.eq(0)):
        maxima[g] = red[0]
    return kb.build()


def _reduce_inputs():
    """Integers as floats, so every summation order gives the exact sum; a group of negative
    values only (a max seeded with 0 would be wrong there) and one holding -inf and +inf."""
    rng = np.random.default_rng(3)
    x = rng.integers(-1000, 1000, (4, L)).astype(np.float32)
    x[1] = -rng.integers(1, 1000, L)
    x[2, 17], x[3, 200] = -np.inf, np.inf
    return x


def test_expanded_reductions_are_barrier_trees():
    k = expand_wg_reduce(_reduce_kernel())
    assert not any(n.op == "wg_reduce" for n in walk(k.body))
    loops = [n for n in walk(k.body) if n.op == "for" and n.arg == "s_"]
    assert len(loops) == 2 and all(loop.src[0].arg == L // 2 for loop in loops)
    assert sum(n.op == "barrier" for n in walk(k.body)) == 1 + 2 * 2  # before each tree, one per level
    assert "subgroupAdd" in render_glsl(_reduce_kernel(), FULL) and "subgroup" not in render_glsl(_reduce_kernel(),
                                                                                                  BASELINE)


@pytest.mark.parametrize("target", ["full", "baseline", "opencl"])
def test_work_group_reductions_agree(request, target):
    """The subgroup form (GLSL FULL), the barrier tree in GLSL (BASELINE) and in OpenCL."""
    x = _reduce_inputs()
    arrays = {"x": x.reshape(-1), "sums": np.zeros(4, np.float32), "maxima": np.zeros(4, np.float32)}
    if target == "opencl":
        got = request.getfixturevalue("run_opencl")(_reduce_kernel(), (4,), arrays)
    else:
        got = request.getfixturevalue("run_vulkan")(_reduce_kernel(), {"full": FULL, "baseline": BASELINE}[target],
                                                    (4,), arrays)
    np.testing.assert_array_equal(got["sums"], x.astype(np.float64).sum(axis=1).astype(np.float32))
    np.testing.assert_array_equal(got["maxima"], x.max(axis=1))
