"""fuse_matmul: products absorb the RMSNorm before them and the SwiGLU after them."""
import pytest

from dflash_ir.builder import GraphBuilder
from dflash_ir.dtypes import DType
from dflash_ir.passes.fuse_matmul import PRODUCTS, fuse_matmul
from dflash_ir.passes.pipeline import run_pipeline


def _norm_fed_products(graph) -> int:
    producers = graph.producers()
    return sum(1 for n in graph.nodes if n.op in ("matmul_group", "fused_matmul", *PRODUCTS)
               and n.inputs[0] in producers and producers[n.inputs[0]].op == "rmsnorm")


@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe"])
def test_norms_and_mlp_swiglus_fold_into_the_products_bit_identically(tiny_models, worst_relative, arch):
    pair = tiny_models(arch, "q8_0")
    cfg = pair.configs["target"]
    for name in ("target.decode", "target.verify", "draft.block"):
        before = run_pipeline(pair.graphs[name], skip=["fuse_matmul"])
        after = fuse_matmul(before)
        fused = [n for n in after.nodes if n.op == "fused_matmul"]
        assert _norm_fed_products(before) > 0 and _norm_fed_products(after) == 0, name
        assert sum(n.attr["norm_eps"] is not None for n in fused) == _norm_fed_products(before), name
        mlp_swiglus = sum(1 for n in fused if n.attr["epilogue"] == "swiglu")
        if name.startswith("target"):
            assert mlp_swiglus == (0 if cfg.n_expert else cfg.n_layer), name  # MoE experts keep theirs
        assert after.op_counts().get("swiglu", 0) == before.op_counts().get("swiglu", 0) - mlp_swiglus, name
        assert worst_relative(before, after, pair.weights) == 0.0, name


def _norm_fed_quantizes(graph) -> int:
    """Quantisations of an rmsnorm's row that nothing else needs as it is (a MoE layer's router
    reads its normalised row in f32, so that rmsnorm stays and its quantize reads it)."""
    producers, users = graph.producers(), graph.users()
    return sum(1 for n in graph.nodes if n.op == "quantize_q8_0" and producers[n.inputs[0]].op == "rmsnorm"
               and all(u.op != "fused_moe" for u in users[n.inputs[0]]))


@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe"])
def test_q8_numerics_fold_the_norm_into_the_quantize(tiny_models, worst_relative, arch):
    """Under q8 the products read quantize_q8_0(rmsnorm(x)): every such quantize takes the norm
    (one kernel, bit-identical), and the products keep their x as the quantize."""
    pair = tiny_models(arch, "q8_0")
    for name in ("target.decode", "draft.block"):
        before = run_pipeline(pair.graphs[name], numerics="q8", skip=["fuse_matmul"])
        after = fuse_matmul(before)
        normed = [n for n in after.nodes if n.op == "quantize_q8_0" and n.attr.get("norm_eps") is not None]
        assert _norm_fed_quantizes(before) > 0 and _norm_fed_quantizes(after) == 0, name
        assert len(normed) == _norm_fed_quantizes(before), name
        assert after.op_counts().get("rmsnorm", 0) == before.op_counts()["rmsnorm"] - len(normed), name
        fused = [n for n in after.nodes if n.op == "fused_matmul"]
        assert all(n.attr["norm_eps"] is None for n in fused), name
        assert worst_relative(before, after, pair.weights) == 0.0, name


def test_q8_numerics_quantise_the_swiglu_in_its_product(tiny_models, worst_relative):
    """Under q8 the down product reads quantize_q8_0(silu(gate) * up): the gate/up product takes
    the quantisation as its epilogue (swiglu_q8), bit-identical, and no quantize reads a product."""
    pair = tiny_models("qwen35", "q8_0")
    for name in ("target.decode", "target.verify", "draft.block"):
        before = run_pipeline(pair.graphs[name], numerics="q8", skip=["fuse_matmul"])
        after = fuse_matmul(before)
        quantised = [n for n in after.nodes if n.op == "fused_matmul" and n.attr["epilogue"] == "swiglu_q8"]
        assert len(quantised) == before.op_counts()["swiglu"] > 0, name
        assert not [n for n in after.nodes if n.op == "fused_matmul" and n.attr["epilogue"] == "swiglu"], name
        producers = after.producers()
        assert all(producers[n.inputs[0]].op != "fused_matmul" for n in after.nodes if n.op == "quantize_q8_0"), name
        assert after.op_counts()["quantize_q8_0"] == before.op_counts()["quantize_q8_0"] - len(quantised), name
        assert worst_relative(before, after, pair.weights) == 0.0, name


def _layer(norm_readers: int = 1, residual: bool = False, dtype=DType.Q8_0, swapped: bool = False, width: int = 64):
    b = GraphBuilder("probe")
    x = b.input("x", DType.F32, ("T", width))
    h = b.rmsnorm(x, b.weight("nw", DType.F32, (width,)), eps=1e-6)
    gate = b.matmul(h, b.dequantize(b.weight("wg", dtype, (width // 2, width))))
    up = b.matmul(h, b.dequantize(b.weight("wu", dtype, (width // 2, width))))
    act = b.swiglu(up, gate) if swapped else b.swiglu(gate, up)
    down = b.matmul(act, b.dequantize(b.weight("wd", dtype, (width, width // 2))))
    b.output("y", b.add(down, x) if residual else down)
    if norm_readers > 1:
        b.output("h", h)
    return run_pipeline(b.build())


def test_an_mlp_becomes_two_products():
    ops = _layer().op_counts()
    assert ops == {"fused_matmul": 1, "matmul_q8_0": 1}


@pytest.mark.parametrize("dtype", [DType.F16, DType.Q4_K, DType.Q6_K, DType.IQ4_XS])
def test_products_of_every_stored_type_fuse(dtype):
    """A Q4_K_M file's MLP (Q4_K gate/up, Q6_K down) fuses as a Q8_0 one does."""
    ops = _layer(dtype=dtype, width=512).op_counts()
    assert ops == {"fused_matmul": 1, f"matmul_{dtype.value}": 1}


def test_declines_what_it_cannot_fuse():
    assert "rmsnorm" in _layer(norm_readers=2).op_counts()  # the normalised row is an output too
    swapped = [n for n in _layer(swapped=True).nodes if n.op == "fused_matmul"]
    assert swapped and swapped[0].attr["epilogue"] == "none"  # silu(up) * gate is not the pair's SwiGLU
