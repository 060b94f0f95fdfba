from dataclasses import replace

import numpy as np
import pytest

from dflash_ir.builder import GraphBuilder
from dflash_ir.dtypes import DType
from dflash_ir.interpreter import Interpreter
from dflash_ir.passes.pipeline import run_pipeline
from dflash_ir.passes.plan_memory import check_plan, lifetimes, plan_memory, report
from dflash_ir.printer import format_graph, parse_graph
from dflash_ir.serialize import dump_yaml, load_yaml

BINDINGS = {"target.verify": {"T": 16, "R": 16, "C": 64}, "target.prefill": {"T": 64, "R": 1, "C": 64}}


def chain():
    """x -> 4 unary ops in a row, plus a weight-only value and a state update."""
    b = GraphBuilder("chain")
    x = b.input("x", DType.F32, ("T", 8))
    acc = b.state("acc", DType.F32, ("T", 8))
    w = b.dequantize(b.weight("w", DType.F16, (8,)))
    v = x
    for op in ("neg", "exp", "silu", "sigmoid"):
        v = b.op(op, v, name=op)
    b.update_state(acc, b.add(acc, b.mul(v, w, name="scaled"), name="acc.new"))
    b.output("y", v)
    return b.build()


def test_a_chain_ping_pongs_between_two_slots():
    """neg, exp, silu, sigmoid (an output: live to the end), then scaled = sigmoid * w."""
    g = plan_memory(chain())
    check_plan(g)
    assert set(lifetimes(g)) == {"neg", "exp", "silu", "sigmoid", "scaled"}  # not the constant, not the update
    plan = dict(g.meta_dict["memory_plan"])
    assert plan["neg"] == plan["silu"] == plan["scaled"] != plan["exp"] == plan["sigmoid"]
    assert g.meta_dict["memory_slots"] == ((("T",), 32), (("T",), 32))
    assert report(g, {"T": 10}) == (5 * 320, 2 * 320)


def test_the_plan_round_trips_through_text_and_yaml():
    g = plan_memory(chain())
    for back in (parse_graph(format_graph(g)), load_yaml(dump_yaml(g))):
        assert back.meta_dict == g.meta_dict
        check_plan(back)


@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe"])
def test_peak_memory_drops_on_verify_and_prefill_with_identical_outputs(tiny_models, model_call, arch):
    pair = tiny_models(arch, "q8_0")
    for name, bindings in BINDINGS.items():
        unplanned = run_pipeline(pair.graphs[name], skip=("plan_memory",))
        planned = plan_memory(unplanned)
        check_plan(planned)
        assert planned.nodes == unplanned.nodes and "memory_plan" not in unplanned.meta_dict
        before, after = report(planned, bindings)
        assert after < before, (name, before, after)
        assert report(pair.graphs[name], bindings)[1] < report(pair.graphs[name], bindings)[0]
        inputs, states = model_call(planned, 5)
        a, b = (Interpreter(h, pair.weights).run(inputs, states) for h in (unplanned, planned))
        assert all(np.array_equal(a.outputs[k], b.outputs[k]) for k in a.outputs)


def test_a_stale_plan_is_caught():
    g = plan_memory(chain())
    meta = {**g.meta_dict, "memory_plan": tuple((v, 0) for v, _ in g.meta_dict["memory_plan"])}
    with pytest.raises(ValueError, match="live together"):
        check_plan(replace(g, meta=tuple(sorted(meta.items()))))
