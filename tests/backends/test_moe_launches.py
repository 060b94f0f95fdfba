"""A MoE layer (fused_moe: routing, top-k, the selected experts' gate/up/down and the shared
expert) launches three kernels on the CPU profile and four on the GPU profile (the router
product first), per decode token and per verify or prefill, and reads the expert banks only
in the tiles' packed layout."""
import pytest

from dflash_ir.artifact import open_pair
from dflash_ir.backends.lowering import lower
from dflash_ir.backends.plan import compile_expr
from kernel_cases import CASES

LAUNCHES = {"cpu": ["moe_route", "moe_up", "moe_down"], "gpu": ["matmul_gemv", "moe_route", "moe_up", "moe_down"]}


@pytest.fixture(scope="module")
def pair(tiny_pair):
    """The generated qwen35moe target (every layer's FFN a MoE block) at -O2."""
    return open_pair(*tiny_pair("qwen35moe", "q8_0"), opt_level=2)


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
@pytest.mark.parametrize("name, rows", [("target.decode", 1), ("target.verify", 16), ("target.prefill", 5)])
def test_a_moe_layer_is_three_kernels_on_cpu_and_four_on_gpu(pair, profile, name, rows):
    graph = pair.graphs[name]
    plan = lower(graph, profile)
    env = {"n_T": rows, "n_R": rows, "n_C": 64, "n_P": 64}
    layers = [s for s in plan.steps if graph.nodes[s.node].op == "fused_moe"]
    assert len(layers) == 4
    for step in layers:
        ran = [la.kernel.rsplit("_", 1)[0] for la in step.launches if not la.when or compile_expr(la.when)(env)]
        assert ran == LAUNCHES[profile], ran
        node = graph.nodes[step.node]
        banks = {node.inputs[i] for i in range(2, 8)}  # gate/up/down experts, shared gate/up/down
        bound = {v for la in step.launches for v in la.buffers}
        assert not banks & bound  # read packed, never as the GGUF stores them
        packed = {w for v in bound if v in plan.packs for w in plan.packs[v][0]}
        assert packed == banks and {plan.packs[v][1] for v in bound if v in plan.packs} == {"q8_0_cols16"}


@pytest.mark.parametrize("name, layout", [("expert_matmul_q8_0", "q8_0_cols16"), ("expert_matmul_q4_0", "q4_0_cols16")])
def test_cpu_expert_matmul_is_the_expert_tiles(name, layout):
    plan = lower(CASES[name].build().b.build(), "cpu")
    assert {k.op for k in plan.kernels.values()} == {"expert_matmul_tiles"}
    assert list(plan.packs.values()) == [(("w",), layout)]
    assert {k.op for k in lower(CASES["expert_matmul_f16"].build().b.build(), "cpu").kernels.values()} == \
        {"expert_matmul_rows"}


def test_a_q4_k_m_moe_layer_is_the_three_cpu_kernels_on_each_banks_own_type():
    """llama-quantize's Q4_K_M banks (Q4_K gate/up, Q6_K down) take the fused CPU kernels, each
    bank packed in its type's tile layout; the GPU profile's expert kernels read Q8_0 only,
    so there the layer is its parts."""
    graph = CASES["fused_moe_q4_k_m"].build().b.build()
    plan = lower(graph, "cpu")
    assert [k.op for k in plan.kernels.values()] == LAUNCHES["cpu"]
    assert sorted(plan.packs.values()) == [(("down_exps", "sh_down"), "q6_k_cols16"),
                                           (("gate_exps", "sh_gate"), "q4_k_cols16"),
                                           (("up_exps", "sh_up"), "q4_k_cols16")]
    assert "moe_up" not in {k.op for k in lower(graph, "gpu").kernels.values()}


def test_a_decode_moe_layer_unrolls_its_one_row_expert_tiles():
    """As a decode's dense product (lowering.BLOCK_SPAN): a fixed single row's expert tiles
    unroll their block type's elements, the 2- and 4-row tiles (which one row never takes)
    and every tile of a call with more rows keep the element loop."""
    from dflash_ir.backends.kir.ir import walk

    def element_loops(name: str) -> dict[str, int]:
        plan = lower(CASES[name].build().b.build(), "cpu")
        return {k.op: sum(n.op == "unroll" and n.src[0].arg == "e" for n in walk(k.body))
                for k in plan.kernels.values() if k.op in ("moe_up", "moe_down")}

    assert element_loops("fused_moe_q4_k_m") == {"moe_up": 3, "moe_down": 3}
    assert element_loops("fused_moe_q4_k_m_decode") == {"moe_up": 2, "moe_down": 2}


@pytest.mark.parametrize("isa, suffix", [(frozenset(), ""), (frozenset({"avx512_vnni"}), "_dp4")])
def test_a_q8_moe_layer_reads_quantised_x_and_hands_down_a_q8_0_swiglu(isa, suffix):
    """With xq (the q8 numerics) the CPU layer stays three kernels: the router reads x,
    moe_up reads xq, not x, from the banks' packs (the dp4 ones where VPDPBUSD sums them) and
    writes the SwiGLU in Q8_0 blocks, which moe_down reads; the GPU profile takes the parts."""
    from dflash_ir.dtypes import DType
    from dflash_ir.types import parse_type

    graph = CASES["fused_moe_q4_k_m_q8_x_decode"].build().b.build()
    node = next(n for n in graph.nodes if n.op == "fused_moe")
    x, xq = node.inputs[0], node.inputs[9]
    plan = lower(graph, "cpu", isa=isa)
    route, up, down = plan.steps[-1].launches
    assert [la.kernel.rsplit("_", 1)[0] for la in (route, up, down)] == LAUNCHES["cpu"]
    assert x in route.buffers and xq not in route.buffers
    assert xq in up.buffers and x not in up.buffers
    assert sorted(layout for _, layout in plan.packs.values()) == [f"q4_k_cols16{suffix}"] * 2 + [f"q6_k_cols16{suffix}"]
    handed = {v: parse_type(plan.temps[v]).dtype for v in set(up.buffers) & set(down.buffers) if v in plan.temps}
    assert sorted(handed.values(), key=str) == sorted([DType.F32, DType.I32, DType.Q8_0], key=str)  # weights, ids, act
    assert "moe_up" not in {k.op for k in lower(graph, "gpu").kernels.values()}
