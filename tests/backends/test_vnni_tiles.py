"""The CPU tiles' VPDPBUSD path (backends/opencl.py: block sums of Q8_0 x with Q8_0, Q4_0,
Q4_1, Q5_0 or Q5_1 weights by inline assembly on a PoCL CPU device whose host has AVX-512
VNNI): the same integers as the f32 path's, so every output is bit-identical with and without
it; only Q8_0-x products take it and its layouts; other printers refuse such a kernel; an
artifact that needs it is refused on a CPU without it."""
import numpy as np
import pytest

from dflash_ir.backends.kir.c import PRINTERS
from dflash_ir.backends.kir.glsl import BASELINE, UnsupportedKernel, render_glsl
from dflash_ir.backends.lowering import lower
from dflash_ir.dtypes import DType
from dflash_ir.errors import ArtifactError
from kernel_cases import CASES

VNNI = frozenset({"avx512_vnni"})
Q8_X = [n for n in CASES if "q8_x" in n]


def _graph(name):
    return CASES[name].build().b.build()


def test_only_products_over_q8_0_x_take_the_dp4_layout_and_vpdpbusd():
    q8 = lower(_graph("matmul_q8_0_q8_x_20_rows"), "cpu", isa=VNNI)
    assert [layout for _, layout in q8.packs.values()] == ["q8_0_cols16_dp4"]
    source = "".join(PRINTERS["opencl"].kernel_source(k) for k in q8.kernels.values())
    assert "dpbusd_at(" in source and "dpbusd(" not in source  # x's words broadcast by the instruction
    f32 = lower(_graph("matmul_q8_0_16_rows"), "cpu", isa=VNNI)
    assert [layout for _, layout in f32.packs.values()] == ["q8_0_cols16"]
    assert "dpbusd(" not in "".join(PRINTERS["opencl"].kernel_source(k) for k in f32.kernels.values())
    assert [layout for _, layout in lower(_graph("matmul_q8_0_q8_x_20_rows"), "cpu").packs.values()] == ["q8_0_cols16"]
    for name, dtype in (("matmul_q4_1_q8_x_3_rows", "q4_1"), ("matmul_q5_0_q8_x_20_rows", "q5_0")):
        assert [layout for _, layout in lower(_graph(name), "cpu", isa=VNNI).packs.values()] == [f"{dtype}_cols16_dp4"]
        assert [layout for _, layout in lower(_graph(name), "cpu").packs.values()] == [f"{dtype}_cols16"]
    f32_x = lower(_graph("matmul_q4_1_3_rows"), "cpu", isa=VNNI)
    assert [layout for _, layout in f32_x.packs.values()] == ["q4_1_cols16"]
    with pytest.raises(ValueError, match="unknown instruction set extensions"):
        lower(_graph("matmul_q8_0_q8_x_20_rows"), "cpu", isa=frozenset({"amx_int8"}))


def _tile_sources(name: str) -> dict[str, str]:
    kernels = lower(_graph(name), "cpu", isa=VNNI).kernels.values()
    return {k.op: PRINTERS["opencl"].kernel_source(k) for k in kernels if k.op in ("matmul_tiles", "moe_up")}


@pytest.mark.parametrize("name", ["matmul_q4_1_q8_x_3_rows", "matmul_q6_k_q8_x_9_rows", "matmul_q8_0_q8_x_20_rows"])
def test_dense_dp4_tiles_take_x_sums_from_the_work_group(name):
    """A dense product's rows are the work-group's, so x's sub-block sums (a bias's or a
    min's Σq, Q8_0's -128 Σq) are taken once into local memory, not by VPDPBUSD on bytes of
    1 (ONES) per row and word in every work-item; the expert tiles, whose rows differ per
    expert, keep the instruction."""
    from dflash_ir.backends.kernels.linalg import ONES

    source = _tile_sources(name)["matmul_tiles"]
    assert "__local int x_sums" in source and str(ONES) not in source
    assert str(ONES) in _tile_sources("fused_moe_q8_x")["moe_up"]


@pytest.mark.parametrize("isa", [frozenset(), VNNI])
def test_tile_groups_are_clamped_only_where_a_work_item_can_run_past_the_last(isa):
    """A work-item's groups u0 .. u0+P-1 take min(u, last) only where P does not divide the
    product's groups (48 outputs: 3 groups; P 4 and 2 run past, P 1 does not), or where the
    experts' widths differ (ragged: the shared one's); with 128 outputs (8 groups), or experts
    all of one width in whole units, none is clamped, so the groups' addresses are constant
    strides apart."""
    def clamps(name, op):
        kernels = lower(_graph(name), "cpu", isa=isa).kernels.values()
        return sum(PRINTERS["opencl"].kernel_source(k).count("min(u0") for k in kernels if k.op == op)

    assert clamps("matmul_q8_0_q8_x_whole_groups_1_rows", "matmul_tiles") == 0
    assert clamps("matmul_q8_0_q8_x_3_rows", "matmul_tiles") > 0
    for op in ("moe_up", "moe_down"):
        assert clamps("fused_moe_q8_x", op) == 0
        assert clamps("fused_moe_ragged_q8_x", op) > 0


@pytest.mark.parametrize("isa", [frozenset(), VNNI])
def test_tile_rows_are_clamped_only_where_a_tile_can_run_past_the_last_row(isa):
    """A verify's product (a fixed row count) walks its rows R at a time: 16 rows in tiles of
    8 never pass the last, so each row's x sits a constant stride from the first; 20 rows do,
    and the tile's rows past the last read the last (not stored)."""
    from dflash_ir.builder import GraphBuilder
    from dflash_ir.passes.pipeline import run_pipeline

    def row_clamps(rows):
        b = GraphBuilder(f"verify_{rows}")
        b.meta["kind"] = "verify"
        x = b.input("x", DType.F32, (rows, 64))
        b.output("y", b.matmul(x, b.dequantize(b.weight("w", DType.Q8_0, (32, 64)))))
        kernels = lower(run_pipeline(b.build(), level=2, numerics="q8"), "cpu", isa=isa).kernels.values()
        return sum(PRINTERS["opencl"].kernel_source(k).count("xr1 = (long)min(") for k in kernels
                   if k.op == "matmul_tiles")

    assert row_clamps(16) == 0
    assert row_clamps(20) > 0


def test_a_verify_tile_sums_eight_rows_of_two_groups():
    """linalg.TILES: Q8_0 x's tile for 5 or more rows keeps 8 rows x 2 groups of sums (16-row
    products 4-31% faster than with one group, measured there)."""
    source = _tile_sources("matmul_q8_0_q8_x_20_rows")["matmul_tiles"]
    assert "acc7_1" in source and "acc8_0" not in source and "acc0_2" not in source


def test_other_printers_refuse_the_vnni_tiles():
    """They read the dp4 words as the OpenCL printer alone does (a CPU-only layout)."""
    kernel = next(k for k in lower(_graph("matmul_q8_0_q8_x_20_rows"), "cpu", isa=VNNI).kernels.values()
                  if k.op == "matmul_tiles")
    for dialect in ("cuda", "hip"):
        with pytest.raises(ValueError, match="no i32 view of a u8 buffer"):
            PRINTERS[dialect].kernel_source(kernel)
    with pytest.raises(UnsupportedKernel, match="no i32 view of a u8 buffer 'w'"):
        render_glsl(kernel, BASELINE)


def test_an_artifact_needing_vnni_is_refused_on_a_cpu_without_it(monkeypatch, tmp_path):
    from dflash_ir.backends import base, opencl

    monkeypatch.setattr(base, "host_cpu_flags", lambda: frozenset({"avx512f"}))
    with pytest.raises(ArtifactError, match="avx512_vnni, which this CPU lacks"):
        opencl.OpenCLBackend().device_for({"isa": ["avx512_vnni"]}, tmp_path)


@pytest.fixture
def vnni(opencl, monkeypatch):
    monkeypatch.setenv("DFLASH_IR_PROFILE", "cpu")
    if "avx512_vnni" not in opencl.isa():
        pytest.skip("the VPDPBUSD tiles need PoCL on a CPU device whose host has avx512f and avx512_vnni")
    return opencl


@pytest.mark.parametrize("name", Q8_X)
def test_vnni_tiles_equal_the_f32_tiles_bit_for_bit(vnni, name, tmp_path, monkeypatch):
    c = CASES[name].build()
    graph = c.b.build()
    outputs = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("DFLASH_IR_VNNI", flag)
        entry = vnni.compile(graph, tmp_path / flag)
        assert entry["isa"] == (["avx512_vnni"] if flag == "1" else [])
        program = vnni.load(graph, entry, tmp_path / flag, lambda w: c.weights[w.tensor])
        outputs[flag] = program.run(c.inputs, c.states).outputs
    for key, want in outputs["0"].items():
        assert np.array_equal(np.asarray(outputs["1"][key]), np.asarray(want)), f"{name}: {key}"

