"""fuse_moe: one `fused_moe` node per Qwen3.5 MoE block.

Matches the block as models/qwen35.py builds it (weights either f32 or behind a
`dequantize`, so the pass runs before specialise_matmul):

    top_p, ids = topk(softmax(x @ router), k)
    w = top_p / sum(top_p)
    act = silu(expert_matmul(x, gate_exps, ids)) * expert_matmul(x, up_exps, ids)
    routed = sum(expert_matmul(act, down_exps, ids) * reshape(w), axis=1)
    out = routed + swiglu_mlp(x; shexp gate/up/down) * sigmoid(x @ reshape(shexp_gate_inp))

The fused node takes the weights as stored: a kernel reads only the selected experts'
slices of the expert banks.
"""
from __future__ import annotations

from dflash_ir.ir import Graph
from dflash_ir.rewrite import P, Rule, V, rewrite

_WEIGHTS = ("router_w", "gate_exps", "up_exps", "down_exps", "shexp_gate_w", "shexp_up_w", "shexp_down_w",
            "shexp_gate_inp_w")


def _w(name: str) -> P:
    """A weight, used as stored or dequantised on the way."""
    w = V(name, kind="weight")
    return P("dequantize", w, one_use=True) | w


def _one(op: str, *inputs: P, **kw) -> P:
    return P(op, *inputs, one_use=True, **kw)


def _swiglu(gate: P, up: P) -> P:
    return _one("mul", _one("silu", gate), up, commutative=True)


def _experts(x: P, bank: str) -> P:
    return _one("expert_matmul", x, V(bank, kind="weight"), V("ids"))


_X = V("x")
_TOP_P = P("topk", _one("softmax", _one("matmul", _X, _w("router_w")), attrs={"axis": lambda a: a in (-1, 1)}),
           name="top_p")
_ROUTE_W = _one("div", _TOP_P, _one("sum", V("top_p"), attrs={"axis": lambda a: a in (-1, 1), "keepdims": True}))
_ROUTED = _one("sum", _one("mul", _experts(_swiglu(_experts(_X, "gate_exps"), _experts(_X, "up_exps")), "down_exps"),
                           _one("reshape", _ROUTE_W), commutative=True), attrs={"axis": 1, "keepdims": lambda k: not k})
_SHARED = _one("matmul", _swiglu(_one("matmul", _X, _w("shexp_gate_w")), _one("matmul", _X, _w("shexp_up_w"))),
               _w("shexp_down_w"))
_SHARED_GATE = _one("sigmoid", _one("matmul", _X, _one("reshape", V("shexp_gate_inp_w", kind="weight"))
                                    | _w("shexp_gate_inp_w")))
MOE = P("add", _ROUTED, _one("mul", _SHARED, _SHARED_GATE, commutative=True), commutative=True)


def _fuse(m, emit):
    top = m.node("top_p")
    if top.outputs[1] != m["ids"] or emit.uses(m["ids"]) != 3 or emit.uses(m["top_p"]) != 2:
        return None
    return emit.op("fused_moe", m["x"], *(m[w] for w in _WEIGHTS), k=top.attr["k"])


RULES = [Rule("moe", MOE, _fuse)]


def fuse_moe(graph: Graph) -> Graph:
    return rewrite(graph, RULES, name="fuse_moe")
