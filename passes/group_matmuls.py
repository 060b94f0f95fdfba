"""group_matmuls: the specialised matmuls that read the same x become one `matmul_group`.

A layer projects one normalised input several ways: attention q, k, v; the MLP's gate and
up; a Gated DeltaNet layer's qkv, z, β and α (four products, two of them 16 rows wide).
Grouped, they are one kernel over all their weight rows side by side, so a decode token
launches ~60 kernels fewer on a 16-layer model, and the narrow products stop being
launches of their own. Members must be weights of one storage type with the same K, form
and layout, and no fused residual; the outputs are exactly the members' (the group's
reference runs them one by one). A group lists its weights in name order, whatever order
the graph built them in: a prefill and a verify that group the same weights share one
packed copy at load (built in two orders, a 9B target's Gated DeltaNet projections were
packed twice: 1.2 GB).
"""
from __future__ import annotations

from dflash_ir.ir import Graph
from dflash_ir.ops.specialised import OPS
from dflash_ir.rewrite import P, Rule, V, rewrite

_SHARED = ("form", "K", "layout")


def _members(emit, mm):
    x = emit.value(mm.inputs[0])
    return [n for n in emit.readers(x)
            if n.op == mm.op and len(n.inputs) == 2 and n.inputs[0] == x.name
            and emit.kind(emit.value(n.inputs[1])) == "weight"
            and all(n.attr.get(a) == mm.attr.get(a) for a in _SHARED)]


def _group(m, emit):
    mm = m.node("mm")
    members = _members(emit, mm)
    if len(members) < 2 or members[0] != mm:  # the first member in schedule order builds the group
        return None
    members.sort(key=lambda n: n.inputs[1])
    outs = emit.op("matmul_group", m["x"], *(emit.value(n.inputs[1]) for n in members), op=mm.op,
                   Ns=tuple(n.attr["N"] for n in members), **{a: mm.attr.get(a) for a in _SHARED})
    return {n.outputs[0]: out for n, out in zip(members, outs)}


RULES = [Rule("group", P(frozenset(OPS.values()), V("x"), V("w", kind="weight"), name="mm"), _group)]


def group_matmuls(graph: Graph) -> Graph:
    return rewrite(graph, RULES, name="group_matmuls")
