"""IR core: builder, verifier, text form, YAML form, pictures, interpreter."""
import shutil
import subprocess
import sys

import numpy as np
import pytest

from dflash_ir.builder import GraphBuilder
from dflash_ir.dtypes import DType
from dflash_ir.interpreter import Interpreter
from dflash_ir.ir import Graph, Node, State, Value
from dflash_ir.ops.registry import OpError
from dflash_ir.printer import ParseError, format_graph, parse_graph
from dflash_ir.program import BindError
from dflash_ir.quant import quantize
from dflash_ir.serialize import dump_yaml, load_yaml
from dflash_ir.types import TensorType, parse_type
from dflash_ir.verifier import VerifyError, verify
from dflash_ir.visualize import render, to_dot, to_networkx


def small_graph() -> Graph:
    """A SwiGLU MLP with a Q8_0 weight, a state that accumulates rows, and two outputs."""
    b = GraphBuilder("mlp")
    b.meta["arch"] = "test"
    x = b.input("x", DType.F32, ("T", 64))
    acc = b.state("acc", DType.F32, ("T", 32))
    with b.scope("blk.0"):
        wg = b.weight("blk.0.ffn_gate.weight", DType.Q8_0, (32, 64))
        wu = b.weight("blk.0.ffn_up.weight", DType.F16, (32, 64))
        h = b.mul(b.silu(b.matmul(x, b.dequantize(wg))), b.matmul(x, wu))
        vals, idx = b.topk(h, k=3)
    b.update_state(acc, b.add(acc, h))
    b.output("h", h)
    b.output("top", vals)
    b.output("top_idx", idx)
    return b.build()


def weights_for(g: Graph, seed=0):
    rng = np.random.default_rng(seed)
    dense = {w.tensor: rng.standard_normal(w.value.type.shape).astype(np.float32) for w in g.weights}
    stored = {w.tensor: quantize(dense[w.tensor], w.value.type.dtype) for w in g.weights}
    return dense, stored


def test_builder_infers_types_and_names():
    g = small_graph()
    vals = g.values()
    assert vals[g.outputs[0][1]].type == TensorType(DType.F32, ("T", 32))
    assert g.output("top_idx").type == parse_type("i32[T,3]")
    assert all(v.startswith("blk.0.") for v in (n.outputs[0].name for n in g.nodes[:-1]))
    assert g.op_counts()["matmul"] == 2


def test_builder_reports_shape_errors_where_they_happen():
    b = GraphBuilder("bad")
    x = b.input("x", DType.F32, ("T", 64))
    w = b.weight("w", DType.F32, (32, 48))
    with b.scope("blk.7"), pytest.raises(OpError, match=r"bad: blk\.7: .*matmul"):
        b.matmul(x, w)


def test_interpreter_matches_numpy():
    g = small_graph()
    dense, stored = weights_for(g)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 64)).astype(np.float32)
    acc = rng.standard_normal((5, 32)).astype(np.float32)
    res = Interpreter(g, lambda w: stored[w.tensor]).run({"x": x}, {"acc": acc})

    def q8(w):  # independent Q8_0 round trip: per-32 absmax scale, fp16-rounded scale
        blocks = w.reshape(-1, 32)
        d = np.abs(blocks).max(1, keepdims=True) / 127
        q = np.round(blocks / np.where(d == 0, 1, d))
        return (q * d.astype(np.float16).astype(np.float32)).reshape(w.shape)

    gate = x @ q8(dense["blk.0.ffn_gate.weight"]).T
    up = x @ dense["blk.0.ffn_up.weight"].astype(np.float16).astype(np.float32).T
    h = gate / (1 + np.exp(-gate)) * up
    np.testing.assert_allclose(res.outputs["h"], h, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(res.outputs["top"], -np.sort(-h, axis=1)[:, :3], rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(res.states["acc"], acc + h, rtol=2e-5, atol=2e-5)
    assert res.bindings == {"T": 5}


def test_interpreter_folds_weight_only_nodes_once():
    g = small_graph()
    _, stored = weights_for(g)
    loads = []
    interp = Interpreter(g, lambda w: loads.append(w.tensor) or stored[w.tensor])
    x = np.ones((2, 64), np.float32)
    acc = np.zeros((2, 32), np.float32)
    a = interp.run({"x": x}, {"acc": acc}).outputs["h"]
    b = interp.run({"x": x}, {"acc": acc}).outputs["h"]
    np.testing.assert_array_equal(a, b)
    assert sorted(loads) == sorted(w.tensor for w in g.weights)


def test_interpreter_rejects_bad_bindings():
    g = small_graph()
    _, stored = weights_for(g)
    interp = Interpreter(g, lambda w: stored[w.tensor])
    with pytest.raises(BindError, match="missing state 'acc'"):
        interp.run({"x": np.ones((2, 64), np.float32)})
    with pytest.raises(BindError, match="binds T=3, but T=2"):
        interp.run({"x": np.ones((2, 64), np.float32)}, {"acc": np.zeros((3, 32), np.float32)})
    with pytest.raises(BindError, match=r"expected f32\[T,64\]"):
        interp.run({"x": np.ones((2, 63), np.float32)}, {"acc": np.zeros((2, 32), np.float32)})


def test_text_form_round_trips_exactly():
    g = small_graph()
    text = format_graph(g)
    assert parse_graph(text) == g
    assert format_graph(parse_graph(text)) == text
    assert 'weight %blk.0.ffn_gate.weight: q8_0[32,64] = model["blk.0.ffn_gate.weight"]' in text
    assert "state %acc: f32[T,32] <- %" in text


def test_yaml_form_round_trips_exactly():
    g = small_graph()
    assert load_yaml(dump_yaml(g)) == g


def test_parse_errors_name_the_line():
    text = format_graph(small_graph()).replace("= matmul(", "= matmul[", 1)
    with pytest.raises(ParseError, match="line"):
        parse_graph(text)


def _node(op, inputs, outputs, **attrs):
    return Node.make(op, inputs, outputs, attrs)


F32T = TensorType(DType.F32, ("T", 4))


@pytest.mark.parametrize(
    "graph, message",
    [
        (Graph("g", inputs=(Value("x", F32T),), nodes=(_node("exp", ["y"], [Value("z", F32T)]),), outputs=(("z", "z"),)),
         "uses undefined value"),
        (Graph("g", inputs=(Value("x", F32T), Value("x", F32T)), outputs=(("x", "x"),)), "defined twice"),
        (Graph("g", inputs=(Value("x", F32T),), nodes=(_node("frobnicate", ["x"], [Value("z", F32T)]),),
               outputs=(("z", "z"),)), "unknown op 'frobnicate'"),
        (Graph("g", inputs=(Value("x", F32T),), nodes=(_node("exp", ["x"], [Value("z", TensorType(DType.F32, ("T", 5)))]),),
               outputs=(("z", "z"),)), "declared output types"),
        (Graph("g", inputs=(Value("x", F32T),), outputs=(("y", "nope"),)), "undefined value %nope"),
        (Graph("g", inputs=(Value("x", F32T),), states=(State(Value("s", F32T), "x"),)), "which no node computes"),
        (Graph("g", inputs=(Value("x", F32T),), states=(State(Value("s", TensorType(DType.F32, (4,))), "z"),),
               nodes=(_node("exp", ["x"], [Value("z", F32T)]),)), "update %z has type"),
        (Graph("g", inputs=(Value("x", TensorType(DType.Q8_0, ("T", 32))),), outputs=(("x", "x"),)), "block dtype"),
        (Graph("g", inputs=(Value("x", F32T),)), "no outputs"),
    ],
)
def test_verifier_rejects_malformed_graphs(graph, message):
    with pytest.raises(VerifyError, match=message):
        verify(graph)


def test_networkx_view_and_dot():
    g = small_graph()
    nxg = to_networkx(g)
    ops = [d["op"] for _, d in nxg.nodes(data=True) if d["kind"] == "op"]
    assert sorted(ops) == sorted(n.op for n in g.nodes)
    import networkx as nx

    assert nx.is_directed_acyclic_graph(nxg.subgraph([n for n in nxg if not n.startswith("st:")]))
    dot = to_dot(g)
    assert dot.startswith('digraph "mlp"') and "matmul" in dot


def test_picture_command(tmp_path):
    path = tmp_path / "g.txt"
    path.write_text(format_graph(small_graph()))
    out = tmp_path / "g.dot"
    subprocess.run([sys.executable, "-m", "dflash_ir.visualize", str(path), "-o", str(out)], check=True)
    assert out.read_text().startswith("digraph")
    if shutil.which("dot"):
        png = render(small_graph(), tmp_path / "g.png")
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
