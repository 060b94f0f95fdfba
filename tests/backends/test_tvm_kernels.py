"""Every TVM-built kernel against the interpreter on single-node graphs (random inputs and
edge shapes, tests/kernel_cases.py): through TVM's LLVM target on this CPU, and through TVM's
OpenCL target run by pyopencl on PoCL, a CPU device, so with the llvm target's loop nests
(backends/tvm/nest_targets.py); and a sample through the OpenCL target with a GPU's
schedules (dlight's), as tvm-cuda and tvm-rocm take them."""
import pytest

from kernel_cases import CASES, compare
from dflash_ir.ops.registry import all_ops
from dflash_ir.dtypes import DType


@pytest.mark.parametrize("name", list(CASES))
def test_llvm_kernel_matches_interpreter(tvm, name, tmp_path):
    compare(tvm, name, tmp_path)


@pytest.mark.parametrize("name", list(CASES))
def test_opencl_kernel_matches_interpreter(tvm_opencl, name, tmp_path):
    compare(tvm_opencl, name, tmp_path)


# every kind of kernel dlight schedules and its numerics: products of each weight kind and of
# symbolic rows, f16 bits (half_to_float), attention's three kernels, the delta rule, experts
GPU_SAMPLE = ("matmul_q8_0_1_rows", "matmul_q8_0_16_rows", "matmul_f16_1_rows", "matmul_q4_k_16_rows",
              "cast_f16_f32", "attention_causalTrue_gqa2_T1_kv150", "gated_delta_rule_tiled",
              "expert_matmul_q8_0", "fused_moe_ragged")


@pytest.mark.parametrize("name", GPU_SAMPLE)
def test_opencl_kernel_with_gpu_schedules_matches_interpreter(tvm_opencl, name, tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_IR_PROFILE", "gpu")
    assert tvm_opencl.nests() is None
    compare(tvm_opencl, name, tmp_path)


def test_every_op_has_a_tvm_lowering():
    from dflash_ir.backends.tvm.lowering import registered_ops

    assert set(all_ops()) - registered_ops() == set()


def _cast_program(tvm, tmp_path, src: str, dst: str, n: int):
    from dflash_ir.builder import GraphBuilder
    from dflash_ir.dtypes import DType

    b = GraphBuilder(f"cast_{src}_{dst}")
    b.output("y", b.cast(b.input("x", DType.parse(src), (n,)), dtype=dst))
    graph = b.build()
    return tvm.load(graph, tvm.compile(graph, tmp_path), tmp_path, lambda w: None)


def test_f16_bits_convert_exactly_both_ways(tvm, tmp_path):
    """f16 travels as its bits (PoCL has no cl_khr_fp16): every f16 value widens exactly, and
    f32 values round to nearest even as numpy does: ties, subnormals, overflow, signed zeros."""
    import numpy as np

    every_half = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    wide = _cast_program(tvm, tmp_path / "up", "f16", "f32", every_half.size).run({"x": every_half}, {}).outputs["y"]
    assert np.array_equal(wide.view(np.uint32), every_half.astype(np.float32).view(np.uint32))

    rng = np.random.default_rng(0)
    ties = (np.arange(-2048, 2048, dtype=np.float32) + np.float32(0.5)) * np.float32(2.0 ** -10)  # halfway points
    edges = np.array([0.0, -0.0, 65504.0, 65519.99, 65520.0, 1e6, -1e6, 2.0 ** -24, 2.0 ** -25, 2.0 ** -25 * 1.0001,
                      3 * 2.0 ** -26, 2.0 ** -14, 2.0 ** -14 * 0.999, np.inf, -np.inf], dtype=np.float32)
    values = np.concatenate([ties, edges, rng.standard_normal(4096).astype(np.float32) * np.float32(2.0 ** -16),
                             rng.standard_normal(4096).astype(np.float32) * np.float32(3000)])
    narrow = _cast_program(tvm, tmp_path / "down", "f32", "f16", values.size).run({"x": values}, {}).outputs["y"]
    with np.errstate(over="ignore"):  # values past 65520 become inf: the point of the check
        want = values.astype(np.float16)
    assert np.array_equal(narrow.view(np.uint16), want.view(np.uint16))


def test_every_product_of_an_f32_x_on_llvm_takes_the_hand_scheduled_nest():
    """Every product of an f32 x, whatever its weights (f32, f16, bf16, Q8_0 or another block
    type; alone, grouped, fused), lowers with its llvm loop nest (backends/tvm/cpu_schedules.py),
    which prefetches the next column group's weights, so the interpreter comparisons above
    check the nest; the cases' row counts select every rows-per-pass variant of it at run
    time; a K that is not a multiple of 32 keeps dlight's."""
    from dflash_ir.backends.tvm.cpu_schedules import PASSES
    from dflash_ir.backends.tvm.lowering import lower
    from dflash_ir.backends.tvm.nest_targets import LLVM
    from kernel_cases import case_graph

    from dflash_ir.blocks import DECODERS

    names = [n for n in CASES if n.startswith(("matmul_", "fused_matmul_")) and "q8_x" not in n]
    weights = {"f32", "f16", "bf16", "q8_0", *DECODERS}
    assert {w for w in weights if any(n.startswith(f"matmul_{w}_") for n in names)} == weights
    chosen = set()
    for name in names:
        products = [k for k in lower(case_graph(CASES[name].build()))[1].values() if k.op == "matmul"]
        assert products, name
        if "odd_k" in name:
            assert not any(k.cpu_body for k in products), name
            continue
        assert all("llvm.prefetch" in LLVM.parse(k.script(cpu=True)).script() for k in products), name
        rows = dict(CASES[name].bindings).get("T", 1)
        chosen.add(max(r for r, _ in PASSES if rows >= r))
    assert chosen == {r for r, _ in PASSES}


@pytest.mark.parametrize("prefix, op", [("attention_", "attention"), ("fused_attention_", "attention"),
                                        ("gated_delta_rule_", "gated_delta_rule"),
                                        ("fused_gated_delta", "gated_delta_rule"),
                                        ("expert_matmul_", "expert_matmul"), ("fused_moe", "expert_matmul")])
def test_llvm_takes_the_loop_nests_of_attention_the_delta_rule_and_experts(prefix, op):
    """On the cpu profile (tvm-llvm) these ops lower to their hand-written nests
    (backends/tvm/cpu_schedules.py), so the interpreter comparisons above check them; the
    GPU targets keep the kernels for dlight (attention's scores, max, sum, values)."""
    from dflash_ir.backends.tvm.lowering import lower
    from kernel_cases import case_graph

    names = [n for n in CASES if n.startswith(prefix) and "q8_x" not in n]
    assert names
    for name in names:
        graph = case_graph(CASES[name].build())
        cpu = [k for k in lower(graph, "cpu")[1].values() if k.op == op]
        gpu = [k for k in lower(graph, "gpu")[1].values() if k.op.startswith(op)]
        assert cpu and all(k.cpu_body for k in cpu), name
        assert gpu and not any(k.cpu_body and k.op != "expert_matmul" for k in gpu), name
    attention = {k.op for k in lower(case_graph(CASES[names[0]].build()), "gpu")[1].values()}
    assert op != "attention" or {"attention_scores", "attention_values"} <= attention


def test_opencl_on_a_cpu_takes_the_loop_nests_one_pass_size_per_row_count(tvm_opencl, tmp_path):
    """On PoCL, a CPU device, tvm-opencl builds the llvm target's loop nests, a task per
    work-group, a Q8_0 half block's quants read as one 16-byte vector (nest_targets.py). A
    product of symbolic rows is one kernel per pass size, each launched under the row counts
    it serves (its host code's branch): exactly one runs for any count."""
    from dflash_ir.backends.kir.c import OPENCL_F16_TO_F32
    from dflash_ir.backends.plan import Plan, compile_expr, symbol_param
    from dflash_ir.backends.tvm.cpu_schedules import PASSES
    from kernel_cases import case_graph

    assert tvm_opencl.nests() is not None
    entry = tvm_opencl.compile(case_graph(CASES["matmul_q8_0_16_rows"].build()), tmp_path)
    assert entry["profile"] == "cpu"
    source = (tmp_path / entry["source"]).read_text()
    assert "vload16(0, ((__global uchar *)w_ptr" in source
    # the block scales decoded by the native kernels' F16C helper, defined ahead of TVM's code
    assert source.startswith(OPENCL_F16_TO_F32) and "f16_to_f32(" in source.split("__kernel", 1)[1]
    assert "prefetch_line(" in source.split("__kernel", 1)[1]  # the one-row pass prefetches
    # 16-lane float loads and stores are plain vector accesses, not PoCL's 128-bit pieces
    prelude = source.split("__kernel", 1)[0]
    assert "*(const __global float16_u*)(p + 16 * o)" in prelude and "#define vstore16 nest_vstore16" in prelude

    launches = [la for step in Plan.from_dict(entry["plan"]).steps for la in step.launches]
    assert len(launches) == len(PASSES) and all(la.when for la in launches)
    for rows in range(1, 40):
        ran = [la for la in launches if compile_expr(la.when)({symbol_param("T"): rows})]
        assert len(ran) == 1, rows


@pytest.mark.parametrize("dtype", [DType.Q8_0, DType.Q4_K, DType.F16])
def test_only_the_nests_passes_of_one_or_two_rows_prefetch(dtype):
    """Prefetches pay in the memory-bound passes (a decode's one row, an expert's pairs) and
    cost the compute-bound ones of more rows (cpu_schedules.PREFETCH_ROWS)."""
    from dflash_ir.backends.tvm.cpu_schedules import PASSES, PREFETCH_ROWS, product_nest

    for rows, _ in PASSES:
        assert ("prefetch(" in product_nest(str(rows), 256, 512, dtype)) == (rows <= PREFETCH_ROWS), rows


def test_opencl_attention_keeps_its_output_slices_a_vector_array(tvm_opencl, tmp_path):
    """The attention nest touches its output slices (out_part) only a vector at a time, so
    TVM's OpenCL C declares them a vector array, which PoCL keeps in registers; copied a
    whole slice (4 vectors) at a time they were a float array, rebuilt from 128-bit pieces
    on every key (cpu_schedules.attention_nest: the 16-row attention 2.0x -> 1.25x)."""
    from dflash_ir.benchmark.kernels import attention_case
    from dflash_ir.passes.pipeline import run_pipeline

    case = attention_case("attention", 2, 64, hq=4, hkv=2, d=64)  # 4 slices of 16 side by side
    entry = tvm_opencl.compile(run_pipeline(case.graph, numerics="exact"), tmp_path)
    source = (tmp_path / entry["source"]).read_text()
    assert "float16 out_part_ptr[" in source


def test_the_delta_rule_nest_unrolls_its_loops_over_a_rows_vectors():
    """As loops, PoCL kept a row's vectors (kv, o_row, the state row) in memory: the 16-row
    rule ran at 2.07x of opencl, unrolled 1.73x (cpu_schedules.delta_rule_nest)."""
    from dflash_ir.backends.tvm.cpu_schedules import delta_rule_nest

    nest = delta_rule_nest("T", 2, 4, 32, 64, False, 0.125)
    assert "for c in range(" not in nest and "for c in T.unroll(4):" in nest


@pytest.mark.parametrize("name", ["fused_moe_ragged", "fused_moe_q4_k_m_q8_x_decode"])
def test_a_fused_moe_on_the_cpu_profile_is_thirteen_launches_at_most(name):
    """On the cpu profile TVM lowers a fused MoE as the router product, one routing kernel
    (softmax, top-k, renormalisation and the shared expert's gate), the expert products
    (three, reading one sort of the (row, slot) pairs by expert, NodeCtxBase.once) and the
    shared expert's, each SwiGLU quantised in its own kernel where down reads Q8_0, and one
    kernel combining the outputs: 12 launches, 13 with x's Q8_0 blocks, where its parts
    took 25 (tvm-opencl's one-row 35B MoE 1.34-1.36x of opencl -> 1.11-1.14x); the GPU
    profile keeps the parts for dlight."""
    from dflash_ir.backends.tvm.lowering import lower
    from kernel_cases import case_graph

    q8 = "q8_x" in name
    graph = case_graph(CASES[name].build())
    plan, kernels = lower(graph, "cpu")
    ops = [kernels[la.kernel].op for step in plan.steps for la in step.launches if la.kernel in kernels]
    assert ops.count("expert_matmul") == 3 and ops.count("expert_order") == 1, ops
    assert ops.count("moe_route") == ops.count("moe_combine") == 1 and "softmax" not in ops and "topk" not in ops, ops
    assert ops.count("swiglu_quantize_q8_0" if q8 else "swiglu") == 2 and len(ops) == 12 + q8, ops
    plan, kernels = lower(graph, "gpu")
    ops = {kernels[la.kernel].op for step in plan.steps for la in step.launches if la.kernel in kernels}
    assert {"softmax", "topk"} <= ops and not {"moe_route", "moe_combine"} & ops, ops


def test_llvm_delta_rule_of_no_rows_keeps_the_state(tvm, tmp_path):
    """The rule's llvm nest walks the rows over the new state's buffer: with none to walk it
    still writes the old state there, as the interpreter's rule returns it."""
    import numpy as np

    from dflash_ir.interpreter import Interpreter
    from kernel_cases import Case, case_graph

    c = Case("gated_delta_rule_no_rows", CASES["gated_delta_rule_tiled"].make, (("T", 0),)).build()
    graph = case_graph(c)
    program = tvm.load(graph, tvm.compile(graph, tmp_path), tmp_path, lambda w: c.weights[w.tensor])
    got = program.run(c.inputs, c.states).outputs
    want = Interpreter(graph, lambda w: c.weights[w.tensor]).run(c.inputs, c.states).outputs
    assert got.keys() == want.keys()
    for name in want:
        assert np.array_equal(got[name], want[name]), name


def test_llvm_launch_views_are_made_once_per_launch_and_sizes(tvm, tmp_path):
    """tvm-llvm keeps each launch's typed views (backends/tvm/host.py): a repeated call makes
    none and computes the same; another token count makes views of its own sizes."""
    import numpy as np

    from kernel_cases import case_graph

    c = CASES["matmul_q8_0_3_rows"].build()
    graph = case_graph(c)
    program = tvm.load(graph, tvm.compile(graph, tmp_path), tmp_path, lambda w: c.weights[w.tensor])
    first = program.run(c.inputs, c.states).outputs
    views = dict(program.device._calls)
    again = program.run(c.inputs, c.states).outputs
    assert program.device._calls == views
    assert all(np.array_equal(first[k], again[k]) for k in first)
    fewer = {k: v[:1] for k, v in c.inputs.items()}
    one_row = program.run(fewer, c.states).outputs
    assert len(program.device._calls) > len(views)
    assert all(np.array_equal(one_row[k], first[k][:1]) for k in first)


VNNI = frozenset({"avx512_vnni"})


# every Q8_X_TYPES weight type under a Q8_0 x: dense, grouped, fused and the experts'
Q8_X_PRODUCTS = [n for n in CASES if "q8_x" in n and n.startswith(("matmul_", "fused_matmul_", "expert_matmul_",
                                                                   "fused_moe"))]


@pytest.mark.parametrize("name", Q8_X_PRODUCTS)
def test_q8_x_products_take_the_integer_nests_over_the_dp4_pack(name):
    """On the cpu profile every product of a Q8_0 x (dense and experts, over Q8_0 and the
    other quant.Q8_X_TYPES) sums each sub-block as an exact integer over the weights' dp4
    pack (cpu_schedules.q8_product_nest; a Q4_K 16 x 4096 x 4096 product on tvm-llvm 3.4 ms
    as x's values over f32 sums, 1.1-1.3 so; opencl's 1.2), by VPDPBUSD where the lowering
    may use avx512_vnni and by 32-bit lanes where not; the GPU profile reads the weights as
    stored."""
    from dflash_ir.backends.tvm.lowering import lower
    from dflash_ir.quant import cols16_layout
    from kernel_cases import case_graph

    graph = case_graph(CASES[name].build())
    packs = {cols16_layout(w.value.type.dtype, dp4=True) for w in graph.weights if w.value.type.dtype.is_block}
    for isa in (VNNI, frozenset()):
        plan, kernels = lower(graph, "cpu", isa)
        products = [k for k in kernels.values() if k.op.startswith(("matmul_q8_0_", "expert_matmul"))]
        assert products and all(k.cpu_body for k in products)
        assert all(("dpbusd(" in k.cpu_body) == bool(isa) for k in products)
        assert {layout for _, layout in plan.packs.values()} == packs
        assert {k.op for k in kernels.values()} & {"dequantize", "matmul_q8_x"} == set()  # x's values, f32 sums
        launches = [la for step in plan.steps for la in step.launches]
        assert all(any(b in plan.packs for la in launches if la.kernel == k.name for b in la.buffers) for k in products)
    plan, kernels = lower(graph, "gpu", VNNI)
    assert not plan.packs and not any("dpbusd(" in k.body for k in kernels.values())


def test_llvm_sums_q8_x_blocks_with_vpdpbusd_its_x_word_from_memory(tvm):
    """With VNNI the nest's dot products are VPDPBUSDs whose x word is the instruction's
    broadcast memory operand (nest_targets: LLVM folds the broadcast), as the native tiles'."""
    import tvm as tvm_module

    from dflash_ir.backends.base import host_vnni
    from dflash_ir.backends.tvm.build import host_llvm
    from dflash_ir.backends.tvm.lowering import lower
    from dflash_ir.backends.tvm.nest_targets import LLVM
    from kernel_cases import case_graph

    if not host_vnni():
        pytest.skip("this CPU has no avx512_vnni (or DFLASH_IR_VNNI=0)")
    _, kernels = lower(case_graph(CASES["matmul_q8_0_q8_x_20_rows"].build()), "cpu", VNNI)
    product = next(k for k in kernels.values() if k.op == "matmul_q8_0_q8_0")
    func = LLVM.parse(product.script(cpu=True)).with_attr("tirx.is_scheduled", True)
    asm = tvm_module.compile(func, target=tvm_module.target.Target(host_llvm())).mod.inspect_source("asm")
    dots = [line for line in asm.splitlines() if "vpdpbusd" in line]
    assert dots and all("{1to16}" in line for line in dots)


def test_opencl_q8_x_nest_calls_the_native_vnni_helper_and_loads_whole_vectors(tvm):
    """tvm-opencl's VNNI nest calls the native kernels' dpbusd_at and reads the pack's words
    and scales as single unaligned vectors (a prelude helper each), not gathered element by
    element; its int vectors, like its floats, are plain vector accesses (the 16-row product
    1.55x -> 1.14x of opencl, the 64-row 2.1x -> 1.0x). TVM's source only: the helper is
    defined where the device compiler targets AVX-512 (any CPU here may lack it)."""
    from dflash_ir.backends.kir.c import OPENCL_DPBUSD_AT
    from dflash_ir.backends.tvm.build import build_gpu
    from dflash_ir.backends.tvm.lowering import lower
    from dflash_ir.backends.tvm.nest_targets import OPENCL_CPU
    from kernel_cases import case_graph

    _, kernels = lower(case_graph(CASES["matmul_q8_0_q8_x_20_rows"].build()), "cpu", VNNI)
    source, _ = build_gpu("opencl", kernels, OPENCL_CPU)
    prelude, kernels = source.split("__kernel", 1)
    assert OPENCL_DPBUSD_AT in prelude and "*(const __private int16_u*)(p + 16 * o)" in prelude
    assert "dpbusd_at(" in kernels and "load_int16(" in kernels and "load_ushort16(" in kernels
    assert "(int*)w_ptr" not in kernels


@pytest.mark.parametrize("name", ["matmul_q8_0_q8_x_20_rows", "matmul_q8_0_q8_x_5_rows", "fused_moe_ragged_q8_x",
                                  "matmul_q5_0_q8_x_20_rows", "matmul_q6_k_q8_x_9_rows", "fused_moe_q4_k_m_q8_x_decode"])
def test_the_q8_x_nests_with_and_without_vnni_agree_bit_for_bit(tvm, name, tmp_path, monkeypatch):
    """VPDPBUSD and the 32-bit lanes sum the same integers, so the outputs are equal bit for
    bit; a tvm-llvm artifact records the extension (`isa`) and a CPU without it refuses it."""
    import numpy as np

    from dflash_ir.backends import base
    from dflash_ir.errors import ArtifactError
    from kernel_cases import case_graph

    if not base.host_vnni():
        pytest.skip("this CPU has no avx512_vnni (or DFLASH_IR_VNNI=0)")
    c = CASES[name].build()
    graph = case_graph(c)
    outputs = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("DFLASH_IR_VNNI", flag)
        entry = tvm.compile(graph, tmp_path / flag)
        assert entry["isa"] == (["avx512_vnni"] if flag == "1" else [])
        outputs[flag] = tvm.load(graph, entry, tmp_path / flag, lambda w: c.weights[w.tensor]).run(c.inputs, c.states).outputs
    for key, want in outputs["0"].items():
        assert np.array_equal(outputs["1"][key], want), key
    monkeypatch.setenv("DFLASH_IR_VNNI", "1")
    entry = tvm.compile(graph, tmp_path / "1")
    monkeypatch.setattr(base, "host_cpu_flags", lambda: frozenset({"avx512f"}))
    with pytest.raises(ArtifactError, match="tvm-llvm kernels were compiled for a CPU with avx512_vnni"):
        tvm.load(graph, entry, tmp_path / "1", lambda w: c.weights[w.tensor])


@pytest.mark.parametrize("dtype", [DType.Q4_0, DType.Q4_K, DType.Q5_K, DType.Q6_K, DType.Q2_K])
def test_the_nests_decode_block_scales_by_f16c_once_per_sub_block(dtype):
    """A block type's f16 fields take the target's F16C primitive, not the bit arithmetic
    (half_to_float, ~30 integer steps), and a sub-block of 32 decodes its scale and offset
    once for both 16-lane halves: tvm-llvm's one-row 4096 x 4096 Q4_K product 2.34 -> 1.46 ->
    0.98 ms (opencl's 0.67)."""
    from dflash_ir.backends.tvm.cpu_schedules import product_nest
    from dflash_ir.blocks import DECODERS

    nest = product_nest("1", 256, 512, dtype)
    assert "f16(" in nest and "T.uint32(31744)" not in nest
    before_halves = nest.split("for h in T.unroll(2):")[0]
    assert ("part[0] = " in before_halves) == (DECODERS[dtype].sub >= 32)


def _opencl_nest_source(dtype: DType) -> str:
    """tvm-opencl's kernel source (after the prelude) of a one-row product over `dtype` weights."""
    from dflash_ir.backends.tvm.build import build_gpu
    from dflash_ir.backends.tvm.lowering import lower
    from dflash_ir.backends.tvm.nest_targets import OPENCL_CPU
    from dflash_ir.builder import GraphBuilder
    from dflash_ir.passes.pipeline import run_pipeline

    b = GraphBuilder(f"product_{dtype.name}")
    b.meta["kind"] = "decode"
    b.output("y", b.matmul(b.input("x", DType.F32, (1, 512)), b.dequantize(b.weight("w", dtype, (32, 512)))))
    _, kernels = lower(run_pipeline(b.build(), numerics="exact"), "cpu")
    assert [k.op for k in kernels.values()] == ["matmul"] and all(k.cpu_body for k in kernels.values())
    return build_gpu("opencl", kernels, OPENCL_CPU)[0].split("__kernel", 1)[1]


@pytest.mark.parametrize("dtype", [DType.Q4_0, DType.Q5_0, DType.Q5_1, DType.Q2_K, DType.Q3_K, DType.Q4_K,
                                   DType.Q5_K, DType.Q6_K, DType.IQ4_NL, DType.IQ4_XS, DType.MXFP4])
def test_opencl_nests_decode_a_block_type_16_lanes_at_a_time(dtype):
    """tvm-opencl's nests read a block's code bytes as 16-byte vectors (vload16 at any offset,
    nest_targets._opencl_byte_vectors) and decode the 16 lanes as vector arithmetic: no loop
    over lanes (it had one, unrolled, per 16 weights: one-row 4096 x 4096 Q6_K 3.23 -> 0.93
    ms, opencl's 0.78), Q5_0's and Q5_1's fifth bits from one broadcast 16-bit word (no byte
    gather, which the rewrite would refuse), the codebooks' lookups a chain of selects (a
    branch per lane: IQ4_NL 88 -> 4.1 ms, opencl's 8.0)."""
    source = _opencl_nest_source(dtype)
    assert "vload16(0, ((__global uchar *)w_ptr" in source
    assert "for (int l" not in source and "0x000000ff" not in source


@pytest.mark.parametrize("dtype", [DType.Q2_K, DType.Q3_K, DType.Q4_K, DType.Q5_K, DType.Q6_K])
def test_the_nests_walk_a_k_quant_block_as_unrolled_runs_with_constant_fields(dtype):
    """A K-quant's 256-element block is walked as its eight runs of 32 unrolled: each run's
    sub-block scale and min, and its field positions, fold to constants, so Q4_K's and
    Q5_K's 6-bit scales are no branch on the sub-block (one-row 4096 x 4096 Q4_K on
    tvm-opencl 1.00 -> 0.70 ms, opencl's 0.65)."""
    from dflash_ir.backends.tvm.cpu_schedules import product_nest

    assert "for run in T.unroll(8):" in product_nest("1", 32, 512, dtype)
    source = _opencl_nest_source(dtype)
    assert "if (" not in source and "condval" not in source


def test_opencl_refuses_a_byte_gather_tvm_cannot_print():
    """TVM's OpenCL C prints a byte vector it cannot load in one piece as shifts of one int,
    garbage past four lanes: the rewrite turns loads of 16 consecutive bytes into vload16 and
    refuses any other byte vector rather than build a kernel that computes garbage."""
    import tvm
    from tvm.script.parser import tirx as T

    from dflash_ir.backends.tvm.nest_targets import OPENCL_CPU

    def module(stride: int):
        @T.prim_func(s_tir=True)
        def gather(w: T.Buffer((64,), "uint8"), out: T.Buffer((16,), "int32")):
            out[T.Ramp(0, 1, 16)] = T.Cast("int32x16", w[T.Ramp(3, stride, 16)])
        return tvm.IRModule({"gather": gather})

    rewritten = OPENCL_CPU.device_rewrite(module(1)).script()
    assert "vload16" in rewritten and "T.Ramp(3, 1, 16)]" not in rewritten
    with pytest.raises(ValueError, match="cannot gather the byte vector"):
        OPENCL_CPU.device_rewrite(module(2))
