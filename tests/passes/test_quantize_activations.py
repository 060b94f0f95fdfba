"""quantize_activations (the q8 numerics mode): Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 products read
quantised activations."""
import numpy as np
import pytest

from dflash_ir.dtypes import DType
from dflash_ir.ops.registry import get_op
from dflash_ir.passes.pipeline import run_pipeline, select
from dflash_ir.passes.quantize_activations import quantize_activations
from dflash_ir.quant import quantize


CORES = ("fused_attention", "fused_gated_deltanet")


def _products(graph):
    return [n for n in graph.nodes if n.op == "matmul_q8_0" or (n.op == "matmul_group" and n.attr["op"] == "matmul_q8_0")]


@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe"])
def test_every_q8_0_product_reads_one_quantisation_of_its_x(tiny_models, arch):
    g = run_pipeline(tiny_models(arch, "q8_0").graphs["target.verify"], level=2)
    out = quantize_activations(g)
    values, producers = out.values(), out.producers()
    products = _products(out)
    assert len(products) == len(_products(g)) > 0
    quantized = {n.inputs[0] for n in products} | {n.inputs[9] for n in out.nodes if n.op == "fused_moe"}
    assert all(values[x].type.dtype is DType.Q8_0 for x in quantized)
    # a layer core quantises its own output (test_a_core_quantises_its_output_for_the_projection)
    quantized = {x for x in quantized if producers[x].op not in CORES}
    assert all(producers[x].op == "quantize_q8_0" for x in quantized)
    # one quantize per distinct f32 x: products of one x share it
    sources = [producers[x].inputs[0] for x in quantized]
    assert len(sources) == len(set(sources)) == out.op_counts()["quantize_q8_0"]
    before = g.values()
    assert not any(before[n.inputs[0]].type.dtype is DType.Q8_0 for n in g.nodes if n.op.startswith("matmul"))


def test_a_core_quantises_its_output_for_the_projection(tmp_path, worst_relative):
    """Where a head's row is whole Q8_0 blocks (value head dims of 32 here), every attention and
    Gated DeltaNet core of the target and the draft writes the blocks its output projection
    reads (`q8_out`), no quantize_q8_0 reads a core, and every output and state is bit-identical
    to the graph that quantises in a node of its own."""
    from dflash_ir.artifact import open_pair
    from dflash_ir.models.generator import tiny_draft_config, tiny_target_config, write_draft, write_target
    from dflash_ir.passes.quantize_activations import RULES
    from dflash_ir.rewrite import rewrite

    cfg = tiny_target_config("qwen35", ssm_d_state=32)
    write_target(tmp_path / "t.gguf", cfg, dtype="q8_0", seed=1)
    write_draft(tmp_path / "d.gguf", tiny_draft_config(cfg), target_cfg=cfg, dtype="q8_0", seed=2)
    pair = open_pair(tmp_path / "t.gguf", tmp_path / "d.gguf", opt_level=0)
    for name in ("target.decode", "target.verify", "draft.block"):
        g = run_pipeline(pair.graphs[name], level=2)
        out, separate = quantize_activations(g), rewrite(g, [r for r in RULES if r.name != "quantizing_core"],
                                                         name="quantize_activations")
        producers = out.producers()
        cores = [n for n in out.nodes if n.op in CORES]
        assert cores and all(n.attr.get("q8_out") for n in cores), name
        assert not any(producers.get(n.inputs[0]) in cores for n in out.nodes if n.op == "quantize_q8_0"), name
        assert sum(separate.op_counts().get(op, 0) for op in CORES) == len(cores)
        assert out.op_counts()["quantize_q8_0"] == separate.op_counts()["quantize_q8_0"] - len(cores)
        assert worst_relative(separate, out, pair.weights) == 0.0, name


def test_a_core_whose_heads_straddle_blocks_keeps_its_output(tiny_models):
    """A value head dim that is not a multiple of 32 (the tiny model's Gated DeltaNet heads of
    16): the quantisation stays a node; its attention heads of 32 quantise in the core."""
    out = quantize_activations(run_pipeline(tiny_models("qwen35", "q8_0").graphs["target.decode"], level=2))
    producers = out.producers()
    recurrent = [n for n in out.nodes if n.op == "fused_gated_deltanet"]
    assert recurrent and not any(n.attr.get("q8_out") for n in recurrent)
    read = [producers[producers[n.inputs[0]].inputs[0]] for n in out.nodes if n.op == "quantize_q8_0"
            and producers[n.inputs[0]].op == "reshape"]
    assert sorted(map(id, read)) == sorted(map(id, recurrent))
    assert all(n.attr["q8_out"] for n in out.nodes if n.op == "fused_attention")


def test_moe_experts_read_a_quantisation_of_the_layer_x_and_the_router_keeps_x(tiny_models):
    g = run_pipeline(tiny_models("qwen35moe", "q8_0").graphs["target.verify"], level=2)
    out = quantize_activations(g)
    producers = out.producers()
    moes = [n for n in out.nodes if n.op == "fused_moe"]
    assert len(moes) == len([n for n in g.nodes if n.op == "fused_moe"]) > 0
    for n in moes:
        assert len(n.inputs) == 10
        assert producers[n.inputs[9]].op == "quantize_q8_0" and producers[n.inputs[9]].inputs[0] == n.inputs[0]


def test_moe_experts_of_a_codebook_type_keep_f32_activations():
    """One bank without products of Q8_0 x (MXFP4 down) keeps the whole layer in f32."""
    from dflash_ir.builder import GraphBuilder

    b = GraphBuilder("moe")
    x = b.input("x", DType.F32, (3, 32))
    w = {name: b.weight(name, dtype, shape) for name, dtype, shape in (
        ("router", DType.F32, (4, 32)), ("gate", DType.Q8_0, (4, 32, 32)), ("up", DType.Q8_0, (4, 32, 32)),
        ("down", DType.MXFP4, (4, 32, 32)), ("sh_gate", DType.Q8_0, (32, 32)), ("sh_up", DType.Q8_0, (32, 32)),
        ("sh_down", DType.Q8_0, (32, 32)), ("sh_inp", DType.F32, (32,)))}
    b.output("out", b.op("fused_moe", x, *w.values(), k=2))
    g = b.build()
    assert quantize_activations(g) == g


def test_q8_moe_is_its_parts_on_quantised_activations():
    """fused_moe with xq computes what its unfused parts compute on Q8_0 activations, bit for bit:
    the expert products (each already checked against gguf-py) on xq, each SwiGLU quantised."""
    from quant_blocks import random_blocks

    rng = np.random.default_rng(4)
    T, H, E, F, k = 5, 64, 4, 32, 2
    x = rng.standard_normal((T, H)).astype(np.float32)
    router = rng.standard_normal((E, H)).astype(np.float32)
    gate, up = (random_blocks(rng, (E, F, H), DType.Q4_1) for _ in range(2))
    down = random_blocks(rng, (E, H, F), DType.Q5_0)
    sh_gate, sh_up, sh_down = (quantize(rng.standard_normal(shape).astype(np.float32) / 8, DType.Q8_0)
                               for shape in ((F, H), (F, H), (H, F)))
    sh_inp = rng.standard_normal(H).astype(np.float32)
    xq = quantize(x, DType.Q8_0)
    got = get_op("fused_moe").run([x, router, gate, up, down, sh_gate, sh_up, sh_down, sh_inp, xq], {"k": k})[0]

    def op(name, *args, **attrs):
        return get_op(name).run(list(args), attrs)[0]
    top_p, ids = get_op("topk").run([op("softmax", op("matmul", x, router), axis=-1)], {"k": k})
    weights = top_p / top_p.sum(axis=-1, keepdims=True)
    act = op("swiglu", op("expert_matmul", xq, gate, ids), op("expert_matmul", xq, up, ids))
    routed = op("sum", op("expert_matmul", quantize(act, DType.Q8_0), down, ids) * weights[..., None], axis=1)
    shared = op("matmul", quantize(op("swiglu", op("matmul", xq, sh_gate), op("matmul", xq, sh_up)), DType.Q8_0),
                sh_down)
    want = op("add", routed, op("mul", shared, op("sigmoid", op("matmul", x, sh_inp.reshape(1, -1)))))
    assert np.array_equal(got, want)
    exact = get_op("fused_moe").run([x, router, gate, up, down, sh_gate, sh_up, sh_down, sh_inp], {"k": k})[0]
    assert 0 < np.abs(got - exact).max() <= 3e-2 * np.abs(exact).max()


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


def test_every_type_but_the_codebooks_is_quantised():
    """Q4_0 .. Q5_1 and the K-quants take Q8_0 x as Q8_0's do (llama.cpp: Q8_0 / Q8_1
    activations, Q8_K for the K-quants); the codebook types (IQ4_NL, IQ4_XS) keep f32 x."""
    from dflash_ir.builder import GraphBuilder
    from dflash_ir.passes.specialise_matmul import specialise_matmul

    b = GraphBuilder("mix")
    x = b.input("x", DType.F32, (3, 256))
    types = (DType.Q8_0, DType.Q4_0, DType.Q4_1, DType.Q5_0, DType.Q5_1, DType.Q4_K, DType.Q5_K, DType.Q6_K,
             DType.Q2_K, DType.Q3_K, DType.IQ4_NL, DType.IQ4_XS)
    for i, dtype in enumerate(types):
        b.output(f"o{i}", b.matmul(x, b.dequantize(b.weight(f"w{i}", dtype, (16, 256)))))
    out = quantize_activations(specialise_matmul(b.build()))
    values = out.values()
    x_dtype = {values[n.inputs[1]].type.dtype: values[n.inputs[0]].type.dtype for n in out.nodes if n.op.startswith("matmul_")}
    assert x_dtype == {d: DType.Q8_0 if i < 10 else DType.F32 for i, d in enumerate(types)}
    assert out.op_counts()["quantize_q8_0"] == 1


def _q8_x_product(dtype: DType, seed: int, rows: int, k: int, n: int):
    """(x, its Q8_0 quantisation, a random `dtype` weight [n, k], the reference's x_q8 @ wᵀ)."""
    from quant_blocks import random_blocks

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    w = random_blocks(rng, (n, k), dtype)
    xq = quantize(x, DType.Q8_0)
    attrs = dict(form="gemv", K=k, N=n, layout=f"{dtype.value}_rowmajor")
    return x, xq, w, get_op(f"matmul_{dtype.value}").run([xq, w], attrs)[0]


@pytest.mark.parametrize("dtype", [DType.Q4_0, DType.Q4_1, DType.Q5_0, DType.Q5_1])
def test_q8_0_x_times_a_4_or_5_bit_weight_is_integer_sums_times_scales_plus_the_min_term(dtype):
    """The reference against Python ints per block: Σ code·q_x · d_w·d_x [+ m_w · d_x·Σ q_x],
    codes and scales from gguf-py's dequantisation (value = d·code + m)."""
    from gguf import GGMLQuantizationType as GT
    from gguf import quants

    k, n = 96, 4
    x, xq, w, got = _q8_x_product(dtype, 5, 2, k, n)
    raw = w.view(np.uint8).reshape(n, k // 32, dtype.block_bytes)
    d = raw[..., :2].copy().view(np.float16)[..., 0].astype(np.float64)
    m = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64) if dtype in (DType.Q4_1, DType.Q5_1) else 0 * d
    values = quants.dequantize(raw.reshape(n, -1), GT[dtype.name]).reshape(n, k // 32, 32).astype(np.float64)
    codes = np.rint((values - m[..., None]) / d[..., None]).astype(int)
    xb = xq.reshape(2, k // 32, 34)
    dx = xb[..., :2].copy().view(np.float16)[..., 0].astype(np.float64)
    qx = xb[..., 2:].view(np.int8).astype(int)
    for r in range(2):
        for c in range(n):
            want = sum(float((codes[c, b] * qx[r, b]).sum()) * d[c, b] * dx[r, b] + m[c, b] * dx[r, b] * float(qx[r, b].sum())
                       for b in range(k // 32))
            assert got[r, c] == pytest.approx(want, rel=1e-5, abs=1e-6)
    exact = get_op(f"matmul_{dtype.value}").run([x, w], dict(form="gemv", K=k, N=n, layout=f"{dtype.value}_rowmajor"))[0]
    assert np.abs(got - exact).max() <= 2e-2 * np.abs(exact).max()


@pytest.mark.parametrize("dtype", [DType.Q2_K, DType.Q3_K, DType.Q4_K, DType.Q5_K, DType.Q6_K])
def test_q8_0_x_times_a_k_quant_is_the_product_of_both_dequantised(dtype):
    """Per sub-block (32 or 16 elements), integer sums times d·sc_j·d_x [minus
    dmin·m_j·d_x·Σq_x]: in exact arithmetic the product of gguf-py's dequantised weight with
    the dequantised x."""
    from gguf import GGMLQuantizationType as GT
    from gguf import quants

    k, n = 512, 5
    _, xq, w, got = _q8_x_product(dtype, 6, 3, k, n)
    wf = quants.dequantize(w.view(np.uint8).reshape(n, -1), GT[dtype.name]).astype(np.float64)
    xf = quants.dequantize(xq.reshape(3, -1), GT.Q8_0).astype(np.float64)
    want = xf @ wf.T
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_numerics_mode_adds_the_pass_and_rejects_unknown_modes():
    names = [p.__name__ for p in select(2, numerics="q8")]
    assert names.index("quantize_activations") == names.index("group_matmuls") + 1
    assert "quantize_activations" not in [p.__name__ for p in select(2)]
    assert [p.__name__ for p in select(0, numerics="q8")] == ["specialise_matmul", "quantize_activations"]
    with pytest.raises(ValueError, match="numerics must be one of exact, q8"):
        select(2, numerics="int4")
