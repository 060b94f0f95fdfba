"""canonicalise: the clean-ups every other pass may assume have been done.

- dead-code elimination (the rewrite engine drops nodes nothing uses);
- common-subexpression elimination: a node with the same op, inputs and attrs as an
  earlier one is replaced by it;
- shape folding, all decidable from types alone (no weight data): identity reshape,
  slice, transpose, repeat, scale-by-1 and single-input concat are removed;
  reshape∘reshape, slice∘slice (same axis) and transpose∘transpose collapse into one;
  a reshape's -1 is written out.
"""
from __future__ import annotations

from dflash_ir.ir import Graph
from dflash_ir.ops.registry import OpError
from dflash_ir.rewrite import P, Rule, V, rewrite


def _cse(m, emit):
    twin = emit.twin(m.root)
    return dict(zip(m.root.outputs, twin)) if twin else None


def _identity(m, emit):
    return m["x"] if m["x"].type == m.value.type else None


def _reshape_reshape(m, emit):
    return _try(emit, "reshape", m["x"], shape=m.root.attr["shape"])


def _slice_slice(m, emit):
    inner, outer = m.node("inner").attr, m.root.attr
    rank = m["x"].type.rank
    if inner["axis"] % rank != outer["axis"] % rank:
        return None
    stop = inner.get("stop") if outer.get("stop") is None else inner["start"] + outer["stop"]
    return _try(emit, "slice", m["x"], axis=outer["axis"], start=inner["start"] + outer["start"], stop=stop)


def _transpose_transpose(m, emit):
    inner, outer = m.node("inner").attr["perm"], m.root.attr["perm"]
    return emit.op("transpose", m["x"], perm=tuple(inner[p] for p in outer))


def _reshape_explicit(m, emit):
    shape = m.root.attr["shape"]
    if -1 not in shape:
        return None
    return emit.op("reshape", m["x"], shape=m.value.type.shape)


def _try(emit, op, *inputs, **attrs):
    """The op if its rule accepts it (a fold may produce an unnameable symbolic size)."""
    try:
        return emit.op(op, *inputs, **attrs)
    except OpError:
        return None


def _is_identity_perm(perm) -> bool:
    return tuple(perm) == tuple(range(len(perm)))


RULES = [
    Rule("cse", V(kind="node"), _cse),
    Rule("identity", P({"reshape", "slice", "repeat"}, V("x")), _identity),
    Rule("identity_transpose", P("transpose", V("x"), attrs={"perm": _is_identity_perm}), _identity),
    Rule("identity_scale", P("scale", V("x"), attrs={"factor": lambda f: f == 1}), _identity),
    Rule("single_concat", P("concat", V("x")), _identity),
    Rule("reshape_reshape", P("reshape", P("reshape", V("x"))), _reshape_reshape),
    Rule("slice_slice", P("slice", P("slice", V("x"), name="inner")), _slice_slice),
    Rule("transpose_transpose", P("transpose", P("transpose", V("x"), name="inner")),
         _transpose_transpose),
    Rule("reshape_explicit", P("reshape", V("x")), _reshape_explicit),
]


def canonicalise(graph: Graph) -> Graph:
    return rewrite(graph, RULES, name="canonicalise")
