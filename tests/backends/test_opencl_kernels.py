"""Every kernel on OpenCL (PoCL here) against the interpreter, on single-node graphs, in both
device profiles: PoCL gets the CPU schedules by default, and the GPU schedules (what CUDA
and HIP compile) are run here too, so neither goes untested on a machine without a GPU."""
import pytest

from kernel_cases import CASES, compare


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_interpreter(opencl, name, profile, tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_IR_PROFILE", profile)
    compare(opencl, name, tmp_path)


def test_profile_follows_the_device_unless_forced(opencl, monkeypatch):
    import pyopencl as cl

    from dflash_ir.backends.opencl import _context

    monkeypatch.delenv("DFLASH_IR_PROFILE", raising=False)
    assert opencl.profile() == ("cpu" if _context()[2].type & cl.device_type.CPU else "gpu")
    monkeypatch.setenv("DFLASH_IR_PROFILE", "gpu")
    assert opencl.profile() == "gpu"


def test_cpu_profile_schedules_block_type_matmuls_as_register_tiles(monkeypatch, tmp_path):
    """Q8_0 and every block type whose decoder is arithmetic (quant.TILED_BLOCK_TYPES) go
    through the tiles over their packs; a codebook type and F16 through the rowwise kernel."""
    from dflash_ir.backends.lowering import lower

    graph = CASES["matmul_q8_0_16_rows"].build().b.build()
    plan = lower(graph, "cpu")
    assert {k.op for k in plan.kernels.values()} == {"matmul_tiles"}
    assert [p for p in plan.packs.values()] == [(("w",), "q8_0_cols16")]
    for name, layout in (("matmul_q4_k_16_rows", "q4_k_cols16"), ("matmul_q6_k_1_rows", "q6_k_cols16"),
                         ("fused_matmul_norm_swiglu_q3_k_20_rows", "q3_k_cols16")):
        plan = lower(CASES[name].build().b.build(), "cpu")
        assert {k.op for k in plan.kernels.values()} == {"matmul_tiles"}, name
        assert {layout for _, layout in plan.packs.values()} == {layout}, name
    codebook = next(n for n in CASES if n.startswith("matmul_iq4_nl_"))
    assert {k.op for k in lower(CASES[codebook].build().b.build(), "cpu").kernels.values()} == {"matmul_rows"}
    assert {k.op for k in lower(CASES["matmul_f16_5_rows"].build().b.build(), "cpu").kernels.values()} == {"matmul_rows"}
    assert {k.op for k in lower(graph, "gpu").kernels.values()} == {"matmul_gemv", "matmul_gemm"}
    with pytest.raises(ValueError, match="unknown device profile 'tpu'"):
        lower(graph, "tpu")


def test_one_row_block_tiles_read_each_word_of_a_block_once_per_step():
    """A decode's tile unrolls a block's elements with constant positions (lowering.BLOCK_SPAN)
    so that elements sharing a u16 word of the pack share one load: after simplification each
    group (the block at `at<j>`) of the one-row Q4_K tile is read by at most its 72 words'
    loads, where an index left per element gives one load per element (142 per group)."""
    from dflash_ir.backends.kir.ir import walk
    from dflash_ir.backends.lowering import BLOCK_SPAN, lower

    plan = lower(CASES["fused_matmul_norm_swiglu_q4_k_decode"].build().b.build(), "cpu")
    tiles = [k for k in plan.kernels.values() if k.op == "matmul_tiles"]
    assert BLOCK_SPAN == 128 and len(tiles) == 1
    per_group: dict[str, set] = {}
    for node in walk(tiles[0].body):
        if node.op == "load" and node.arg[0] == "w" and node.dtype.lanes == 16:
            group = {n.arg for n in walk(node.src[0]) if n.op == "var" and n.arg.startswith("at")}
            per_group.setdefault(min(group), set()).add(node)
    assert len(per_group) == 2 and all(len(words) <= 72 for words in per_group.values()), \
        {g: len(w) for g, w in per_group.items()}


def test_only_a_decode_product_unrolls_its_block_tile():
    """The unrolled tile costs seconds of device compile: a prefill's one-row bucket (rows not
    fixed at one) and lavapipe's lowering (block_span=0) keep the element loop."""
    from dflash_ir.backends.kir.ir import walk
    from dflash_ir.backends.lowering import lower

    def element_loops(plan):
        return [any(n.op == "unroll" and n.src[0].arg == "e" for n in walk(k.body)) for k in plan.kernels.values()
                if k.op == "matmul_tiles"]

    decode = CASES["fused_matmul_norm_swiglu_q4_k_decode"].build().b.build()
    assert element_loops(lower(decode, "cpu")) == [False]
    assert element_loops(lower(decode, "cpu", row_streams=1, block_span=0)) == [True]
    assert all(element_loops(lower(CASES["matmul_q4_k_16_rows"].build().b.build(), "cpu")))


@pytest.mark.parametrize("isa", [frozenset(), frozenset({"avx512_vnni"})])
def test_a_decode_block_type_tile_takes_one_unit_a_work_item_with_its_runs_unrolled(isa):
    """linalg.BLOCK_ROW_GROUPS: a decode's product over a K-quant pack takes one unit (a group,
    or a gate and up pair) per work-item, where four units' sub-block state spilled; Q8_0's
    one-row tile keeps four groups. Over Q8_0 x the runs of 32 of RUNS_UNROLLED's types are
    unrolled for a decode (Q5_K's, slower so, are not), and stay a loop in a prefill's one-row
    bucket (rows not fixed) and in the expert tiles."""
    from dflash_ir.backends.kir.c import PRINTERS
    from dflash_ir.backends.kir.ir import walk
    from dflash_ir.backends.lowering import lower

    def tiles(name, ops=("matmul_tiles",)):
        return [k for k in lower(CASES[name].build().b.build(), "cpu", isa=isa).kernels.values() if k.op in ops]

    def groups(kernel):
        return PRINTERS["opencl"].kernel_source(kernel).count("long wg")

    def runs_unrolled(kernel):
        return any(n.op == "unroll" and n.src[0].arg == "s" for n in walk(kernel.body))

    for name, units, unrolled in (("fused_matmul_swiglu_q4_k_q8_x_decode", 2, True),
                                  ("fused_matmul_group_q6_k_q8_x_decode", 1, True),
                                  ("fused_matmul_group_q5_k_q8_x_decode", 1, False),
                                  ("fused_matmul_norm_swiglu_q4_k_decode", 2, False)):  # f32 x: elements unrolled
        (tile,) = tiles(name)
        assert (groups(tile), runs_unrolled(tile)) == (units, unrolled), name
    prefill = tiles("matmul_q4_k_q8_x_5_rows")  # rows not fixed: a tile per bucket, one row's first
    assert groups(prefill[0]) == 1 and not any(runs_unrolled(t) for t in prefill)
    experts = tiles("fused_moe_q4_k_m_q8_x_decode", ("moe_up", "moe_down"))
    assert len(experts) == 2 and not any(runs_unrolled(t) for t in experts)
    assert groups(tiles("fused_matmul_norm_swiglu_1_rows")[0]) == 4  # Q8_0: two gate and up pairs


def test_every_op_has_a_case():
    """A new op (or fused op) without a kernel case here would be untested on every device."""
    from dflash_ir.ops.registry import all_ops

    covered = {n.op for c in CASES.values() for n in c.build().b.build().nodes}
    assert set(all_ops()) - covered == set()


def test_half_conversion_is_exact_for_every_bit_pattern(run_opencl):
    """f16 loads, 16-wide (the CPU products read 16 scales at once) and one value at a time
    (scalarized, as CUDA and HIP read them), go through the OpenCL printer's own conversions
    (F16C's vcvtph2ps on x86, not PoCL's integer-step vload_half): every f16 (zeros,
    subnormals, infinities) must come out as numpy converts it, bit for bit, and a NaN as a
    NaN (the instruction quiets a signalling NaN's payload, as PoCL's vload_half did)."""
    import numpy as np

    from dflash_ir.backends.kir import KernelBuilder
    from dflash_ir.backends.kir.lower import scalarize

    kb = KernelBuilder("widen16", local=(64,))
    h, out = kb.buffer("h", "u16"), kb.buffer("out", "f32", writes=True)
    i = kb.let("i", (kb.gid(0) * 64 + kb.lid(0)) * 16)
    out.store(i, h.load(i, "f16", 16))
    kernel = kb.build()
    bits = np.arange(1 << 16, dtype=np.uint16)
    want = bits.view(np.float16).astype(np.float32)
    nan = np.isnan(want)
    assert nan.sum() == 2 * 1023
    for k in (kernel, scalarize(kernel)):
        got = run_opencl(k, (bits.size // 16 // 64,), {"h": bits, "out": np.zeros(bits.size, np.float32)})["out"]
        assert np.isnan(got[nan]).all()
        np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


@pytest.mark.parametrize("numerics", ["exact", "q8"])
def test_cpu_profile_reads_q8_0_weights_packed_once(opencl, tmp_path, numerics):
    """A Q8_0 weight read by the CPU matmul and the embedding (a tied head) is uploaded once,
    in the tiles' 16-row interleaved layout (the dp4 one where the q8 numerics' tiles sum with
    VPDPBUSD: the embedding reads what the head reads), never in the GGUF's block layout."""
    import numpy as np

    from dflash_ir.backends.lowering import lower
    from dflash_ir.builder import GraphBuilder
    from dflash_ir.dtypes import DType
    from dflash_ir.interpreter import Interpreter
    from dflash_ir.passes.pipeline import run_pipeline
    from dflash_ir.quant import quantize

    b = GraphBuilder("tied")
    table = b.weight("table", DType.Q8_0, (40, 64))
    h = b.embedding(table, b.input("ids", DType.I32, ("T",)))
    b.output("logits", b.matmul(h, b.dequantize(table)))
    graph = run_pipeline(b.build(), numerics=numerics)
    layout = "q8_0_cols16_dp4" if numerics == "q8" and "avx512_vnni" in opencl.isa() else "q8_0_cols16"
    plan = lower(graph, "cpu", isa=opencl.isa())
    assert plan.packs == {f"table@{layout}": (("table",), layout)}
    bound = {v for s in plan.steps for launch in s.launches for v in launch.buffers}
    assert "table" not in bound and f"table@{layout}" in bound
    weights = {"table": quantize(np.random.default_rng(0).standard_normal((40, 64)).astype(np.float32), DType.Q8_0)}
    program = opencl.load(graph, opencl.compile(graph, tmp_path), tmp_path, lambda w: weights[w.tensor])
    ids = np.array([3, 39, 0], np.int32)
    got = program.run({"ids": ids}).outputs["logits"]
    want = Interpreter(graph, lambda w: weights[w.tensor]).run({"ids": ids}).outputs["logits"]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    assert list(program._resident) == [f"table@{layout}"]


@pytest.mark.parametrize("name", ["quantize_q8_0_norm", "quantize_q8_0_block_runs", "rmsnorm_w_vector_rows"])
@pytest.mark.parametrize("row_streams", [4, 1])
def test_cpu_row_kernels_take_a_work_item_per_row_where_vectors_are_kept(name, row_streams):
    """PoCL (row_streams > 1): the norms and the quantisation of x run a work-item per row (a
    run of blocks, without a norm) taking 16 lanes at a time, no barrier; lavapipe keeps the
    work-groups (a tree per row where there is a norm)."""
    from dflash_ir.backends.kir.ir import walk
    from dflash_ir.backends.lowering import lower

    plan = lower(CASES[name].build().b.build(), "cpu", row_streams=row_streams)
    (kernel,) = plan.kernels.values()
    assert (kernel.local == (1, 1, 1)) == (row_streams > 1)
    assert not any(n.op in ("barrier", "wg_reduce") for n in walk(kernel.body)) or row_streams == 1


@pytest.mark.parametrize("row_streams, local", [(4, (1, 1, 1)), (1, (64, 1, 1))])
def test_cpu_argmax_takes_a_row_per_work_item_where_vectors_are_kept(row_streams, local):
    """PoCL (row_streams > 1): a work-item per row comparing 16 lanes at a time, no barrier;
    lavapipe, which scalarises vectors: a work-group per row and a barrier tree."""
    from dflash_ir.backends.kir.ir import walk
    from dflash_ir.backends.lowering import lower

    plan = lower(CASES["argmax_lane_ties_and_tail"].build().b.build(), "cpu", row_streams=row_streams)
    (kernel,) = plan.kernels.values()
    assert kernel.local == local
    assert any(n.op == "barrier" for n in walk(kernel.body)) == (row_streams == 1)
