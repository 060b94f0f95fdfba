"""The pattern-rewrite engine on tiny hand-built graphs."""
import numpy as np
import pytest

from dflash_ir.builder import GraphBuilder
from dflash_ir.dtypes import DType
from dflash_ir.interpreter import Interpreter
from dflash_ir.rewrite import P, Rule, RewriteError, V, rewrite


def swiglu_rule(seen=None):
    def fn(m, emit):
        if seen is not None:
            seen.append({k: m[k].name for k in ("a", "b")})
        return emit.op("swiglu", m["a"], m["b"])

    return Rule("swiglu", P("mul", P("silu", V("a"), one_use=True), V("b"), commutative=True), fn)


def mlp(swap=False, silu_twice=False):
    b = GraphBuilder("mlp")
    x = b.input("x", DType.F32, ("T", 8))
    y = b.input("y", DType.F32, ("T", 8))
    s = b.silu(x, name="act")
    out = b.mul(y, s, name="out") if swap else b.mul(s, y, name="out")
    b.output("out", out)
    if silu_twice:
        b.output("act", s)
    return b.build()


def run(graph, **inputs):
    return Interpreter(graph, lambda w: None).run(inputs).outputs


@pytest.mark.parametrize("swap", [False, True])
def test_match_captures_and_keeps_the_root_name(swap):
    seen = []
    g = rewrite(mlp(swap), [swiglu_rule(seen)], name="t")
    assert [n.op for n in g.nodes] == ["swiglu"]
    assert seen == [{"a": "x", "b": "y"}]
    assert g.nodes[0].outputs[0].name == "out" and g.outputs == (("out", "out"),)
    x, y = np.random.default_rng(0).standard_normal((2, 3, 8)).astype(np.float32)
    assert np.array_equal(run(g, x=x, y=y)["out"], run(mlp(swap), x=x, y=y)["out"])


def test_one_use_blocks_a_fusion_that_would_duplicate_work():
    g = mlp(silu_twice=True)
    assert rewrite(g, [swiglu_rule()], name="t") is g


def test_a_capture_used_twice_must_bind_one_value():
    b = GraphBuilder("sq")
    x, y = b.input("x", DType.F32, (4,)), b.input("y", DType.F32, (4,))
    b.output("xx", b.mul(x, x, name="xx"))
    b.output("xy", b.mul(x, y, name="xy"))
    square = Rule("square", P("mul", V("v"), V("v")), lambda m, emit: emit.op("sigmoid_gate", m["v"], m["v"]))
    g = rewrite(b.build(), [square], name="t")
    assert g.op_counts() == {"mul": 1, "sigmoid_gate": 1}
    assert next(n for n in g.nodes if n.op == "sigmoid_gate").outputs[0].name == "xx"


def test_attrs_dtype_and_kind_filter_matches():
    b = GraphBuilder("w")
    x = b.input("x", DType.F32, ("T", 32))
    for dtype in (DType.Q8_0, DType.F16):
        w = b.weight(f"w.{dtype}", dtype, (4, 32))
        b.output(str(dtype), b.matmul(x, b.dequantize(w)))
    b.output("soft", b.softmax(x, axis=0))
    g = b.build()
    hits = []
    rules = [Rule("q8", P("matmul", V(), P("dequantize", V("w", kind="weight", dtype=DType.Q8_0))),
                  lambda m, emit: hits.append(m["w"].name)),
             Rule("soft", P("softmax", V(kind="input"), attrs={"axis": lambda a: a == -1}),
                  lambda m, emit: hits.append("softmax"))]
    assert rewrite(g, rules, name="t") is g
    assert hits == ["w.q8_0"]


def test_rules_apply_to_a_fixpoint_and_dead_nodes_go():
    b = GraphBuilder("negs")
    x = b.input("x", DType.F32, (4,))
    v = x
    for _ in range(5):
        v = b.neg(v)
    b.exp(x, name="dead")
    b.output("y", b.sigmoid(v, name="y"))
    g = b.build()
    twice = Rule("neg_neg", P("neg", P("neg", V("x"))), lambda m, emit: m["x"])
    out = rewrite(g, [twice], name="t")
    assert out.op_counts() == {"neg": 1, "sigmoid": 1}
    xs = np.arange(4, dtype=np.float32)
    assert np.array_equal(run(out, x=xs)["y"], run(g, x=xs)["y"])


def stateful():
    """acc <- acc + silu(x) * y, also an output; unused weight `w` only feeds dead code."""
    b = GraphBuilder("acc")
    b.meta.update(kind="verify")
    x, y = b.input("x", DType.F32, (2, 8)), b.input("y", DType.F32, (2, 8))
    acc = b.state("acc", DType.F32, (2, 8))
    b.matmul(x, b.weight("w", DType.F32, (8, 8)))
    new = b.mul(b.silu(x), y, name="gated")
    b.update_state(acc, b.add(acc, new, name="acc.new"))
    b.output("gated", new)
    return b.build()


def test_outputs_and_state_updates_are_rewired():
    g = stateful()
    fold = Rule("fold", P("add", V("acc", kind="state"), P("mul", P("silu", V("a")), V("b"), one_use=False)),
                lambda m, emit: emit.op("add", m["acc"], emit.op("swiglu", m["a"], m["b"])))
    out = rewrite(g, [fold], name="t")
    assert out.states[0].update == "acc.new" and dict(out.outputs)["gated"] == "gated"
    assert [w.tensor for w in out.weights] == [] and "matmul" not in out.op_counts()
    assert out.meta_dict == {"kind": "verify"}
    rng = np.random.default_rng(1)
    inputs = {"x": rng.standard_normal((2, 8)), "y": rng.standard_normal((2, 8))}
    states = {"acc": rng.standard_normal((2, 8))}
    a, b = (Interpreter(h, lambda w: np.eye(8, dtype=np.float32)).run(inputs, states) for h in (g, out))
    assert np.allclose(a.states["acc"], b.states["acc"], rtol=1e-6) and np.array_equal(a.outputs["gated"],
                                                                                        b.outputs["gated"])


def test_a_state_update_is_never_replaced_by_an_uncomputed_value():
    g = stateful()
    drop = Rule("drop_add", P("add", V("acc", kind="state"), V()), lambda m, emit: m["acc"])
    assert rewrite(g, [drop], name="t").states[0].update == "acc.new"


def test_mapping_replaces_several_values_and_new_nodes_are_shared():
    b = GraphBuilder("two")
    x = b.input("x", DType.F32, (4,))
    b.output("a", b.sigmoid(x, name="a"))
    b.output("b", b.neg(b.sigmoid(x, name="a2"), name="b"))
    g = b.build()

    def fn(m, emit):
        shared = emit.op("sigmoid", m["x"])  # the same node as the root: hash-consed
        return {m.value: shared, "b": emit.op("neg", emit.op("sigmoid", m["x"]))}

    out = rewrite(g, [Rule("both", P("sigmoid", V("x")), fn)], name="t")
    assert out.op_counts() == {"neg": 1, "sigmoid": 1}


def test_a_rule_returning_the_wrong_type_is_an_error():
    bad = Rule("bad", P("silu", V("x")), lambda m, emit: emit.op("sum", m["x"], axis=1))
    with pytest.raises(RewriteError, match="rule 'bad'.*f32\\[T,8\\].*f32\\[T\\]"):
        rewrite(mlp(), [bad], name="t")


def test_rules_that_never_settle_are_an_error():
    grow = Rule("grow", P("silu", V("x")), lambda m, emit: emit.op("silu", emit.op("scale", m["x"], factor=2.0)))
    with pytest.raises(RewriteError, match="still firing"):
        rewrite(mlp(), [grow], name="t")
