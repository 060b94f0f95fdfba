"""A Gated DeltaNet layer launches one kernel between its input projections and its out
projection (conv, its state, the recurrence, the norms and gates, the output norm and
gate: fused_gated_deltanet), per decode token and per verify, in both device profiles."""
import pytest

from dflash_ir.artifact import open_pair
from dflash_ir.backends.kir.ir import walk
from dflash_ir.backends.lowering import lower
from dflash_ir.backends.plan import compile_expr
from dflash_ir.models.generator import tiny_target_config


@pytest.fixture(scope="module")
def target(tiny_pair):
    """The generated 4-layer qwen35 target (three Gated DeltaNet layers) at -O2."""
    return tiny_target_config("qwen35"), open_pair(*tiny_pair("qwen35", "q8_0"), opt_level=2)


def launches(plan, index: int, env: dict[str, int]) -> int:
    """Kernels node `index` launches per call at these sizes (a constant step: none)."""
    (step,) = [s for s in plan.steps if s.node == index]
    return 0 if step.constant else sum(1 for la in step.launches if not la.when or compile_expr(la.when)(env))


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
@pytest.mark.parametrize("name, rows", [("target.decode", 1), ("target.verify", 16)])
def test_gated_deltanet_layer_is_one_launch_between_its_projections(target, profile, name, rows):
    cfg, pair = target
    graph = pair.graphs[name]
    plan = lower(graph, profile)
    env = {"n_T": rows, "n_R": rows, "n_C": 64}
    producer = {v.name: i for i, n in enumerate(graph.nodes) for v in n.outputs}
    readers = {}
    for i, n in enumerate(graph.nodes):
        for x in n.inputs:
            readers.setdefault(x, []).append(i)
    layers = [i for i, n in enumerate(graph.nodes) if n.op == "fused_gated_deltanet"]
    assert len(layers) == sum(cfg.layer_is_recurrent) == 3
    for i in layers:
        node = graph.nodes[i]
        x, _, _, a, b, _, _, _, z, _ = node.inputs
        def made_by(v: str) -> int:  # the node computing v, through reshapes (views)
            while graph.nodes[producer[v]].op == "reshape":
                v = graph.nodes[producer[v]].inputs[0]
            return producer[v]
        projections = max(made_by(v) for v in (x, a, b, z))
        out = i
        while graph.nodes[out].op in ("fused_gated_deltanet", "reshape"):  # to the product reading the output
            (out,) = readers[graph.nodes[out].outputs[0].name]
        assert graph.nodes[projections].op in ("fused_matmul", "matmul_group", "matmul_q8_0"), name
        assert graph.nodes[out].op in ("fused_matmul", "matmul_q8_0"), name
        between = range(projections + 1, out)
        assert sum(launches(plan, j, env) for j in between) == 1, [graph.nodes[j].op for j in between]


@pytest.mark.parametrize("row_streams, local, barriers", [(4, (1, 1, 1), False), (1, (4, 1, 1), True)])
def test_a_cpu_that_keeps_vectors_runs_each_k_head_in_one_work_item(target, row_streams, local, barriers):
    """PoCL (row_streams > 1): a one-item work-group per k head holding its v heads' state
    columns in vectors, so no token waits at a barrier; lavapipe, which scalarises vectors:
    the head's columns CPU_COLS to a work-item, sharing q, k and the output norm through
    work-group memory (the tiny target's k head holds 2 v heads of 16 columns: 4 items)."""
    _, pair = target
    plan = lower(pair.graphs["target.verify"], "cpu", row_streams=row_streams)
    kernels = [k for k in plan.kernels.values() if k.op == "fused_gated_deltanet"]
    assert kernels and {k.local for k in kernels} == {local}
    assert {any(n.op == "barrier" for n in walk(k.body)) for k in kernels} == {barriers}
