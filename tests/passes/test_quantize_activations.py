"""quantize_activations (the q8 numerics mode): Q8_0 products read quantised activations."""
import numpy as np
import pytest

from dflash_ir.dtypes import DType
from dflash_ir.ops.registry import get_op
from dflash_ir.passes.pipeline import run_pipeline, select
from dflash_ir.passes.quantize_activations import quantize_activations
from dflash_ir.quant import quantize


def _products(graph):
    return [n for n in graph.nodes if n.op == "matmul_q8_0" or (n.op == "matmul_group" and n.attr["op"] == "matmul_q8_0")]


@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe"])
def test_every_q8_0_product_reads_one_quantisation_of_its_x(tiny_models, arch):
    g = run_pipeline(tiny_models(arch, "q8_0").graphs["target.verify"], level=2)
    out = quantize_activations(g)
    values, producers = out.values(), out.producers()
    products = _products(out)
    assert len(products) == len(_products(g)) > 0
    quantized = {n.inputs[0] for n in products}
    assert all(values[x].type.dtype is DType.Q8_0 and producers[x].op == "quantize_q8_0" for x in quantized)
    # one quantize per distinct f32 x: products of one x share it
    sources = [producers[x].inputs[0] for x in quantized]
    assert len(sources) == len(set(sources)) == out.op_counts()["quantize_q8_0"]
    assert not any(values[n.inputs[0]].type.dtype is DType.Q8_0 for n in g.nodes if n.op.startswith("matmul"))


def test_f16_products_keep_f32_activations(tiny_models):
    g = run_pipeline(tiny_models("qwen35", "f16").graphs["target.decode"], level=2)
    assert quantize_activations(g) == g


def test_q8_0_times_q8_0_is_integer_block_sums_times_both_scales():
    """The reference against a hand-written one: Python ints per block, then the scales."""
    rng = np.random.default_rng(3)
    k, n = 96, 5
    x = rng.standard_normal((2, k)).astype(np.float32)
    w = quantize(rng.standard_normal((n, k)).astype(np.float32) / 8, DType.Q8_0)
    xq = get_op("quantize_q8_0").run([x], {})[0]
    assert np.array_equal(xq, quantize(x, DType.Q8_0))
    got = get_op("matmul_q8_0").run([xq, w], dict(form="gemv", K=k, N=n, layout="q8_0_rowmajor"))[0]

    def blocks(storage):
        b = storage.reshape(-1, 34)
        return b[:, :2].copy().view(np.float16)[:, 0].astype(np.float32), b[:, 2:].view(np.int8).astype(int)

    for r in range(2):
        dx, qx = blocks(xq[r])
        for c in range(n):
            dw, qw = blocks(w[c])
            want = sum(float(int((qx[b] * qw[b]).sum())) * float(dx[b]) * float(dw[b]) for b in range(k // 32))
            assert got[r, c] == pytest.approx(want, rel=1e-6)
    exact = get_op("matmul_q8_0").run([x, w], dict(form="gemv", K=k, N=n, layout="q8_0_rowmajor"))[0]
    assert np.abs(got - exact).max() <= 1e-2 * np.abs(exact).max()


def test_numerics_mode_adds_the_pass_and_rejects_unknown_modes():
    names = [p.__name__ for p in select(2, numerics="q8")]
    assert names.index("quantize_activations") == names.index("group_matmuls") + 1
    assert "quantize_activations" not in [p.__name__ for p in select(2)]
    assert [p.__name__ for p in select(0, numerics="q8")] == ["specialise_matmul", "quantize_activations"]
    with pytest.raises(ValueError, match="numerics must be one of exact, q8"):
        select(2, numerics="int4")
