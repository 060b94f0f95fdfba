import numpy as np
import pytest

from dflash_ir.builder import GraphBuilder
from dflash_ir.dtypes import DType
from dflash_ir.interpreter import Interpreter
from dflash_ir.passes.canonicalise import canonicalise


def outputs(graph, x):
    return Interpreter(graph, lambda w: np.linspace(0.5, 1.5, 8, dtype=np.float32)).run({"x": x}).outputs


def check(build, expected_ops):
    b = GraphBuilder("g")
    x = b.input("x", DType.F32, ("T", 2, 4))
    b.output("y", build(b, x))
    g = b.build()
    out = canonicalise(g)
    assert out.op_counts() == expected_ops
    x = np.random.default_rng(0).standard_normal((3, 2, 4)).astype(np.float32)
    assert np.array_equal(outputs(g, x)["y"], outputs(out, x)["y"])
    assert canonicalise(out) is out  # a fixpoint


@pytest.mark.parametrize("build", [
    lambda b, x: b.reshape(x, shape=("T", 2, 4)),
    lambda b, x: b.slice(x, axis=1, start=0, stop=2),
    lambda b, x: b.slice(x, axis=0, start=0),
    lambda b, x: b.transpose(x, perm=(0, 1, 2)),
    lambda b, x: b.repeat(x, axis=2, repeats=1),
    lambda b, x: b.scale(x, factor=1.0),
    lambda b, x: b.concat(x, axis=1),
], ids=["reshape", "slice", "slice-symbolic", "transpose", "repeat", "scale", "concat"])
def test_identities_disappear(build):
    check(lambda b, x: b.neg(build(b, x)), {"neg": 1})


def test_chains_collapse():
    check(lambda b, x: b.reshape(b.reshape(x, shape=("T", 8)), shape=("T", 4, 2)), {"reshape": 1})
    check(lambda b, x: b.slice(b.slice(x, axis=2, start=1, stop=4), axis=2, start=1, stop=2), {"slice": 1})
    check(lambda b, x: b.slice(b.slice(x, axis=2, start=1), axis=2, start=2), {"slice": 1})
    check(lambda b, x: b.slice(b.slice(x, axis=2, start=1), axis=1, start=1), {"slice": 2})


def test_transposes_compose():
    b = GraphBuilder("t")
    x = b.input("x", DType.F32, ("T", 2, 4))
    b.output("y", b.transpose(b.transpose(x, perm=(1, 2, 0)), perm=(0, 2, 1)))
    g = b.build()
    out = canonicalise(g)
    assert out.op_counts() == {"transpose": 1}
    x = np.random.default_rng(0).standard_normal((3, 2, 4)).astype(np.float32)
    assert np.array_equal(outputs(g, x)["y"], outputs(out, x)["y"])


def test_reshape_minus_one_is_written_out():
    b = GraphBuilder("r")
    x = b.input("x", DType.F32, ("T", 2, 4))
    b.output("y", b.reshape(x, shape=("T", -1)))
    out = canonicalise(b.build())
    assert out.nodes[0].attr["shape"] == ("T", 8)


def test_common_subexpressions_merge():
    b = GraphBuilder("cse")
    x = b.input("x", DType.F32, ("T", 2, 4))
    w = b.weight("norm", DType.F32, (8,))
    flat = [b.reshape(x, shape=("T", 8)) for _ in range(2)]
    normed = [b.rmsnorm(f, w, eps=1e-6) for f in flat]
    b.output("y", b.add(normed[0], normed[1]))
    b.output("z", normed[1])
    g = b.build()
    out = canonicalise(g)
    assert out.op_counts() == {"add": 1, "reshape": 1, "rmsnorm": 1}
    x = np.random.default_rng(0).standard_normal((3, 2, 4)).astype(np.float32)
    assert all(np.array_equal(outputs(g, x)[k], outputs(out, x)[k]) for k in ("y", "z"))


@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe"])
def test_model_graphs_keep_their_outputs(tiny_models, worst_relative, arch):
    pair = tiny_models(arch)
    for name in ("target.verify", "draft.block"):
        g = pair.graphs[name]
        assert worst_relative(g, canonicalise(g), pair.weights) == 0.0
