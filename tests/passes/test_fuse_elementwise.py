import numpy as np
import pytest

from dflash_ir.builder import GraphBuilder
from dflash_ir.dtypes import DType
from dflash_ir.passes.fuse_elementwise import fuse_elementwise
from dflash_ir.passes.specialise_matmul import specialise_matmul
from dflash_ir.quant import quantize

WEIGHT = np.random.default_rng(3).standard_normal((8, 32)).astype(np.float32)


def graph(build):
    b = GraphBuilder("e")
    x = b.input("x", DType.F32, ("T", 32))
    g = b.input("g", DType.F32, ("T", 8))
    w = b.weight("w", DType.F32, (8, 32))
    b.output("y", build(b, x, g, w))
    return b.build()


def q8_0_matmul(b, x, w):
    return b.matmul_q8_0(x, b.weight("wq", DType.Q8_0, (8, 32)), form="gemv", K=32, N=8, layout="q8_0_rowmajor")


def weights(w):
    return quantize(WEIGHT, w.value.type.dtype)


@pytest.mark.parametrize("build, ops", [
    (lambda b, x, g, w: b.mul(b.silu(g), b.matmul(x, w)), {"swiglu": 1, "matmul": 1}),
    (lambda b, x, g, w: b.mul(b.matmul(x, w), b.silu(g)), {"swiglu": 1, "matmul": 1}),
    (lambda b, x, g, w: b.mul(b.sigmoid(g), b.matmul(x, w)), {"sigmoid_gate": 1, "matmul": 1}),
    (lambda b, x, g, w: b.add(g, q8_0_matmul(b, x, w)), {"matmul_q8_0": 1}),
    (lambda b, x, g, w: b.add(q8_0_matmul(b, x, w), b.silu(g)), {"matmul_q8_0": 1, "silu": 1}),
], ids=["swiglu", "swiglu-swapped", "sigmoid_gate", "residual", "residual-swapped"])
def test_fusions_are_exact(worst_relative, build, ops):
    g = graph(build)
    out = fuse_elementwise(g)
    assert out.op_counts() == ops
    assert out.outputs == g.outputs
    assert worst_relative(g, out, weights) == 0.0


@pytest.mark.parametrize("build", [
    lambda b, x, g, w: b.add(b.reshape(g, shape=("T", 1, 8)), q8_0_matmul(b, x, w)),  # a broadcasting add
    lambda b, x, g, w: b.add(b.matmul(x, w), g),  # a plain matmul takes no residual
], ids=["broadcast", "plain-matmul"])
def test_residuals_that_stay_adds(build):
    g = graph(build)
    assert fuse_elementwise(g) is g


@pytest.mark.parametrize("act", ["silu", "sigmoid"])
def test_shared_intermediates_are_not_fused(act):
    def build(b, x, g, w):
        a = b.op(act, g)
        return b.add(a, b.mul(a, g))

    g = graph(build)
    assert fuse_elementwise(g) is g


def residual_adds(graph):
    """Same-type adds of a matmul_q8_0 result that nothing else reads."""
    producers, values, users = graph.producers(), graph.values(), graph.users()
    return [n for n in graph.nodes if n.op == "add" and len({values[i].type for i in n.inputs}) == 1
            and any(i in producers and producers[i].op == "matmul_q8_0" and len(users[i]) == 1 for i in n.inputs)]


@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe"])
def test_model_graphs(tiny_models, worst_relative, arch):
    pair = tiny_models(arch, "q8_0")
    for name in ("target.verify", "draft.block"):
        g = specialise_matmul(pair.graphs[name])
        out = fuse_elementwise(g)
        producers = out.producers()
        assert not any(n.op == "mul" and any(i in producers and producers[i].op in ("silu", "sigmoid")
                                             for i in n.inputs) for n in out.nodes), name
        folded = [n for n in out.nodes if n.op == "matmul_q8_0" and len(n.inputs) == 3]
        assert len(folded) == len(residual_adds(g)) > 0 and not residual_adds(out), name
        assert worst_relative(g, out, pair.weights) == 0.0, name
