"""fuse_elementwise: a small, fixed set of elementwise fusions, each exact.

- mul(silu(a), b)           -> swiglu(a, b)            (MLP / shared expert, GDN output gate)
- mul(x, sigmoid(g))        -> sigmoid_gate(x, g)      (gates no bigger fusion took)
- add(r, matmul_*(x, W))    -> matmul_*(x, W, r)       (residual adds into the Q8_0 / F16
                                                        matmul that produced the summand;
                                                        same-shape operands only)

The intermediate (silu, sigmoid, matmul result) must have no other use, so every fusion
removes a kernel and a buffer. Operands commute; float add and multiply are commutative,
so the fused references compute exactly what the unfused ops did. rmsnorm and the rest
stay as they are.
"""
from __future__ import annotations

from dflash_ir.ir import Graph
from dflash_ir.ops.specialised import OPS
from dflash_ir.rewrite import P, Rule, V, rewrite

_MATMULS = frozenset(OPS.values())


def _swiglu(m, emit):
    return emit.op("swiglu", m["a"], m["b"])


def _sigmoid_gate(m, emit):
    return emit.op("sigmoid_gate", m["x"], m["g"])


def _residual(m, emit):
    if m["r"].type != m["mm"].type:
        return None
    mm = m.node("mm")
    return emit.op(mm.op, m["x"], m["w"], m["r"], **mm.attr)


RULES = [
    Rule("swiglu", P("mul", P("silu", V("a"), one_use=True), V("b"), commutative=True), _swiglu),
    Rule("sigmoid_gate", P("mul", V("x"), P("sigmoid", V("g"), one_use=True), commutative=True), _sigmoid_gate),
    Rule("residual", P("add", V("r"), P(_MATMULS, V("x"), V("w"), name="mm", one_use=True), commutative=True),
         _residual),
]


def fuse_elementwise(graph: Graph) -> Graph:
    return rewrite(graph, RULES, name="fuse_elementwise")
