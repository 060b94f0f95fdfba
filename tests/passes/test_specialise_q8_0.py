import numpy as np
import pytest

from dflash_ir.dtypes import DType
from dflash_ir.ops.registry import get_op
from dflash_ir.passes.specialise_q8_0 import form, specialise_q8_0
from dflash_ir.quant import quantize

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
        out = specialise_q8_0(g)
        assert not dequantized_matmuls(out) and "dequantize" not in out.op_counts(), name
        values = out.values()
        specialised = [n for n in out.nodes if n.op.startswith("matmul_")]
        assert len(specialised) == n_before > 0, name
        for n in specialised:
            w = values[n.inputs[1]].type
            want_op = {DType.Q8_0: "matmul_q8_0", DType.F16: "matmul_f16"}[w.dtype]
            assert n.op == want_op and (n.attr["N"], n.attr["K"]) == w.shape
            assert n.attr["layout"] == {"matmul_q8_0": "q8_0_rowmajor", "matmul_f16": "f16_rowmajor"}[n.op]
            assert n.attr["form"] == expected_form and not n.attr["act_quant"], (name, n)
        assert op in out.op_counts()
        assert worst_relative(g, out, pair.weights) <= 1e-5, name


def test_form_follows_rows_and_graph_kind():
    assert form((1, 64), None) == form((16, 64), None) == form((4, 4, 64), None) == "gemv"
    assert form((17, 64), None) == "gemm"
    assert form(("T", 64), "verify") == form(("T", 64), "block") == "gemv"
    assert form(("T", 64), "prefill") == form(("S", 64), "inject") == "gemm"


def test_act_quant_is_opt_in_and_within_1e_2(tiny_models):
    g = tiny_models("qwen35", "q8_0").graphs["target.verify"]
    out = specialise_q8_0(g, act_quant=True)
    assert all(n.attr["act_quant"] == (n.op == "matmul_q8_0") for n in out.nodes if n.op.startswith("matmul_"))
    rng = np.random.default_rng(0)
    op = get_op("matmul_q8_0")
    for rows, k in ((1, 64), (16, 256), (7, 1024)):
        x = rng.standard_normal((rows, k)).astype(np.float32)
        w = quantize(rng.standard_normal((96, k)).astype(np.float32) / np.sqrt(k), DType.Q8_0)
        attrs = dict(form="gemv", K=k, N=96, layout="q8_0_rowmajor")
        exact = op.run([x, w], {**attrs, "act_quant": False})[0]
        approx = op.run([x, w], {**attrs, "act_quant": True})[0]
        assert np.abs(approx - exact).max() <= 1e-2 * np.abs(exact).max()
        assert np.array_equal(exact, get_op("matmul").run([x, w], {})[0])
