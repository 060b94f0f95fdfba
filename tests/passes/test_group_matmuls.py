import numpy as np
import pytest

from dflash_ir.builder import GraphBuilder
from dflash_ir.dtypes import DType
from dflash_ir.interpreter import Interpreter
from dflash_ir.passes.pipeline import run_pipeline
from dflash_ir.passes.group_matmuls import group_matmuls
from dflash_ir.quant import quantize


@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe"])
def test_projections_of_one_input_become_one_group(tiny_models, worst_relative, arch):
    """Per target layer: attention q/k/v or GDN qkv/z/β/α, and the dense MLP's gate/up."""
    pair = tiny_models(arch, "q8_0")
    cfg = pair.configs["target"]
    for name in ("target.decode", "target.verify"):
        g = pair.graphs[name]
        before = run_pipeline(g, skip=["group_matmuls", "fuse_matmul"])  # the graph group_matmuls sees
        out = group_matmuls(before)
        groups = [n for n in out.nodes if n.op == "matmul_group"]
        sizes = sorted(len(n.inputs) - 1 for n in groups)
        dense_mlp = 0 if cfg.n_expert else cfg.n_layer
        assert sizes == sorted([4] * sum(cfg.layer_is_recurrent) + [3] * (cfg.n_layer - sum(cfg.layer_is_recurrent))
                               + [2] * dense_mlp), name
        assert out.op_counts().get("matmul_q8_0", 0) == before.op_counts()["matmul_q8_0"] - sum(sizes), name
        assert worst_relative(g, out, pair.weights) == 0.0, name


def _projections(residual: bool = False, k_up: int = 32):
    b = GraphBuilder("proj")
    x = b.input("x", DType.F32, ("T", 32))
    attrs = dict(form="gemv", K=32, layout="q8_0_rowmajor")
    q = b.matmul_q8_0(x, b.weight("wq", DType.Q8_0, (8, 32)), N=8, **attrs)
    k = b.matmul_q8_0(x, b.weight("wk", DType.Q8_0, (4, 32)), N=4, **attrs)
    extra = [b.input("r", DType.F32, ("T", 4))] if residual else []
    v = b.matmul_q8_0(x, b.weight("wv", DType.Q8_0, (4, 32)), *extra, N=4, **attrs)
    b.output("q", q)
    b.output("k", k)
    b.output("v", v)
    return b.build()


def test_group_outputs_equal_the_members_bit_for_bit():
    g = _projections()
    out = group_matmuls(g)
    assert [n.op for n in out.nodes] == ["matmul_group"]
    assert out.nodes[0].attr["Ns"] == (4, 8, 4)  # wk, wq, wv: name order
    rng = np.random.default_rng(0)
    weights = {n: quantize(rng.standard_normal((rows, 32)).astype(np.float32), DType.Q8_0)
               for n, rows in (("wq", 8), ("wk", 4), ("wv", 4))}
    inputs = {"x": rng.standard_normal((3, 32)).astype(np.float32)}
    want = Interpreter(g, lambda w: weights[w.tensor]).run(inputs, {}).outputs
    got = Interpreter(out, lambda w: weights[w.tensor]).run(inputs, {}).outputs
    assert all(np.array_equal(want[k], got[k]) for k in want)


def test_a_member_with_a_residual_stays_alone():
    out = group_matmuls(_projections(residual=True))
    assert sorted(n.op for n in out.nodes) == ["matmul_group", "matmul_q8_0"]
    assert next(n for n in out.nodes if n.op == "matmul_group").attr["Ns"] == (4, 8)


def test_a_group_lists_its_weights_in_one_order_whatever_the_graph_built(tiny_models):
    """A prefill builds a Gated DeltaNet layer's beta before its alpha, a verify after: both
    group the four projections in name order, so the runner packs them once for both."""
    def groups(g):
        return {tuple(g.values()[w].name for w in n.inputs[1:]) for n in g.nodes
                if n.op in ("matmul_group", "fused_matmul")}
    pair = tiny_models("qwen35", "q8_0")
    prefill, verify = (groups(run_pipeline(pair.graphs[name], level=2)) for name in ("target.prefill", "target.verify"))
    recurrent = [ws for ws in verify if any("ssm_alpha" in w for w in ws)]
    assert recurrent and set(recurrent) <= prefill
    products = [[w for w in ws if not w.endswith("norm.weight")] for ws in prefill | verify]  # not a folded norm
    assert all(ws == sorted(ws) for ws in products)


def test_a_single_projection_is_left_alone(tiny_models):
    b = GraphBuilder("one")
    b.output("y", b.matmul_q8_0(b.input("x", DType.F32, ("T", 32)), b.weight("w", DType.Q8_0, (8, 32)), form="gemv",
                                K=32, N=8, layout="q8_0_rowmajor"))
    g = b.build()
    assert group_matmuls(g) is g
