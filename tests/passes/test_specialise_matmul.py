import numpy as np
import pytest

from dflash_ir.blocks import DECODERS
from dflash_ir.builder import GraphBuilder
from dflash_ir.dtypes import DType
from dflash_ir.interpreter import Interpreter
from dflash_ir.passes.specialise_matmul import form, specialise_matmul
from quant_blocks import random_blocks

FORMS = {"target.prefill": "gemm", "target.verify": "gemv", "target.decode": "gemv", "draft.block": "gemv",
         "draft.inject": "gemm"}


def dequantized_matmuls(graph):
    producers = graph.producers()
    return [n for n in graph.nodes if n.op == "matmul" and producers.get(n.inputs[1]) is not None
            and producers[n.inputs[1]].op == "dequantize"]


@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe"])
@pytest.mark.parametrize("dtype, op", [("q8_0", "matmul_q8_0"), ("f16", "matmul_f16")])
def test_every_dequantized_matmul_is_specialised(tiny_models, worst_relative, arch, dtype, op):
    pair = tiny_models(arch, dtype)
    for name, expected_form in FORMS.items():
        g = pair.graphs[name]
        n_before = len(dequantized_matmuls(g))
        out = specialise_matmul(g)
        assert not dequantized_matmuls(out) and "dequantize" not in out.op_counts(), name
        values = out.values()
        specialised = [n for n in out.nodes if n.op.startswith("matmul_")]
        assert len(specialised) == n_before > 0, name
        for n in specialised:
            w = values[n.inputs[1]].type
            want_op = {DType.Q8_0: "matmul_q8_0", DType.F16: "matmul_f16"}[w.dtype]
            assert n.op == want_op and (n.attr["N"], n.attr["K"]) == w.shape
            assert n.attr["layout"] == {"matmul_q8_0": "q8_0_rowmajor", "matmul_f16": "f16_rowmajor"}[n.op]
            assert n.attr["form"] == expected_form, (name, n)
        assert op in out.op_counts()
        assert worst_relative(g, out, pair.weights) == 0.0, name


def test_form_follows_rows_and_graph_kind():
    assert form((1, 64), None) == form((16, 64), None) == form((4, 4, 64), None) == "gemv"
    assert form((17, 64), None) == "gemm"
    assert form(("T", 64), "verify") == form(("T", 64), "block") == "gemv"
    assert form(("T", 64), "prefill") == form(("S", 64), "inject") == "gemm"


@pytest.mark.parametrize("dtype", list(DECODERS), ids=str)
def test_block_type_weights_get_their_own_op(dtype):
    b = GraphBuilder("mm")
    w = b.weight("w", dtype, (5, 256))
    b.output("y", b.matmul(b.input("x", DType.F32, ("T", 256)), b.dequantize(w)))
    g = b.build()
    out = specialise_matmul(g)
    (node,) = out.nodes[-1:]
    assert (node.op, node.attr["layout"], node.attr["form"]) == (f"matmul_{dtype}", f"{dtype}_rowmajor", "gemm")
    rng = np.random.default_rng(0)
    weights = {"w": random_blocks(rng, (5, 256), dtype)}
    x = {"x": rng.standard_normal((3, 256)).astype(np.float32)}
    before, after = (Interpreter(graph, lambda v: weights[v.tensor]).run(x, {}).outputs["y"] for graph in (g, out))
    assert np.array_equal(before, after)
