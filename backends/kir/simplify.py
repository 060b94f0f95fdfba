"""Algebraic simplification of kernel trees, written as rules in the graph rewrite engine's
pattern language (dflash_ir/rewrite.py) and matched by its matcher over a tree view.

Builders write sizes generically (`row * K + c` with K a constant or a symbol size), so
constant folding and the integer identities below make the printed kernels read like
hand-written ones. The bit-field rules know an index's low zero bits (`i = s << 5 | e` has
none set below bit 5 but e's): a block decoder's byte offsets and shifts, built from such an
index with e a constant, fold to the loop variable's part plus constants, so the device
compiler sees the same load for elements that share a byte. Float identities are only those
exact in IEEE arithmetic (x * 1, x / 1; x + 0 is not: -0 + 0 = +0), so simplification never
changes a result.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from dflash_ir.rewrite import P, Rule, V, match

from .ir import BOOL, K, transform


def _trunc_div(a: int, b: int) -> int:
    """C's integer division (toward zero), exact for any size (a float quotient is not)."""
    q = abs(a) // abs(b)
    return q if (a < 0) == (b < 0) else -q


_INT_OPS = {
    "add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
    "div": lambda a, b: _trunc_div(a, b) if b else None, "mod": lambda a, b: a - b * _trunc_div(a, b) if b else None,
    "shl": lambda a, b: a << b, "shr": lambda a, b: a >> b, "and": lambda a, b: a & b,
    "or": lambda a, b: a | b, "xor": lambda a, b: a ^ b, "min": min, "max": max,
}
_CMP = {"lt": np.less, "le": np.less_equal, "gt": np.greater, "ge": np.greater_equal, "eq": np.equal,
        "ne": np.not_equal}
_F32_OPS = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide}
_INT_LIMITS = {"i16": (-2 ** 15, 2 ** 15 - 1), "i32": (-2 ** 31, 2 ** 31 - 1), "u32": (0, 2 ** 32 - 1), "i64": (-2 ** 63, 2 ** 63 - 1)}


class _TreeView:
    """The matcher's view of a kernel tree: a value is a node, computed by itself."""

    @staticmethod
    def kind_of(node: K) -> str:
        return "node"

    @staticmethod
    def dtype_of(node: K):
        return node.dtype

    @staticmethod
    def single_use(node: K) -> bool:
        return True

    @staticmethod
    def producer_of(node: K) -> tuple[str, tuple, Mapping[str, Any], int]:
        return node.op, node.src, {"arg": node.arg}, 0


def _const(value, like: K) -> K:
    return K("const", like.dtype, (), value)


def _fold(m, emit=None) -> K | None:
    """Two constants: the value C computes (f32 arithmetic rounded as f32, integer results
    kept only when in range)."""
    node = m.value
    a, b = (s.arg for s in node.src)
    op, kind = node.op, node.src[0].dtype.scalar
    with np.errstate(all="ignore"):
        if op in _CMP:  # f32 operands compare as the f32 literals they print as
            a, b = (np.float32(a), np.float32(b)) if kind == "f32" else (a, b)
            return K("const", BOOL, (), bool(_CMP[op](a, b)))
        if kind == "f32" and op in _F32_OPS:
            return _const(float(_F32_OPS[op](np.float32(a), np.float32(b))), node)
    if kind in _INT_LIMITS and op in _INT_OPS:
        value = _INT_OPS[op](a, b)
        lo, hi = _INT_LIMITS[kind]
        return None if value is None or not lo <= value <= hi else _const(value, node)
    return None


def _cast_const(m, emit=None) -> K | None:
    node, (x,) = m.value, m.value.src
    if node.dtype.lanes != 1 or x.dtype.lanes != 1:
        return None
    s = node.dtype.scalar
    if s == "f32":
        return _const(float(np.float32(x.arg)), node)
    if s in _INT_LIMITS and isinstance(x.arg, (bool, int)):
        lo, hi = _INT_LIMITS[s]
        return _const(int(x.arg), node) if lo <= int(x.arg) <= hi else None
    return None


def _c(value) -> P:
    return P("const", attrs={"arg": lambda v: v == value and not isinstance(v, bool)})


_INT = ("i16", "i32", "u32", "i64")


def _is_int(m, name: str) -> bool:
    return m[name].dtype.scalar in _INT


def _keep(name: str, need_int: bool = False):
    def fn(m, emit=None):
        return m[name] if not need_int or _is_int(m, name) else None
    return fn


def _zero(m, emit=None):
    return _const(0, m.value) if _is_int(m, "x") else None


def _reassociate(m, emit=None):
    """(x op c1) op c2 -> x op (c1 op c2) for integer add and mul."""
    node = m.value
    if not _is_int(m, "x") or m["inner"].op != node.op:
        return None
    c = _fold(_Match(K(node.op, node.dtype, (m["c1"], m["c2"]))))
    return None if c is None else K(node.op, node.dtype, (m["x"], c))


def _select_const(m, emit=None):
    cond, a, b = m.value.src
    return a if cond.arg else b


_SIGNED = ("i16", "i32", "i64")  # bit rules assume no wrap-around: signed overflow is undefined in C


def _low_zeros(node: K) -> int:
    """How many low bits of `node` are known to be zero."""
    op, src = node.op, node.src
    if op == "const":
        v = int(node.arg)
        return 64 if v == 0 else (v & -v).bit_length() - 1
    if op in ("shl", "shr") and src[1].op == "const":
        return max(_low_zeros(src[0]) + (src[1].arg if op == "shl" else -src[1].arg), 0)
    if op == "mul":
        return _low_zeros(src[0]) + _low_zeros(src[1])
    if op in ("add", "sub", "or", "xor"):
        return min(_low_zeros(src[0]), _low_zeros(src[1]))
    if op == "and":
        return max(_low_zeros(src[0]), _low_zeros(src[1]))
    if op == "cast" and node.dtype.is_int and src[0].dtype.is_int:
        return _low_zeros(src[0])
    return 0


def _signed(node: K) -> bool:
    return node.dtype.scalar in _SIGNED


def _shift_of_sum(m, emit=None):
    """(a | c) >> k as (a >> k) | (c >> k) (bitwise, always), and (a + c) >> k as (a >> k) +
    (c >> k) where a is a multiple of 2^k (exact unless a + c overflows), c a constant."""
    node, (inner, k) = m.value, m.value.src
    a, c = inner.src if inner.src[1].op == "const" else inner.src[::-1]
    if not _signed(node) or c.op != "const" or not isinstance(k.arg, int) or \
            (inner.op == "add" and _low_zeros(a) < k.arg):
        return None
    return K(inner.op, node.dtype, (K("shr", node.dtype, (a, k)), K("shr", node.dtype, (c, k))))


def _mask_of_sum(m, emit=None):
    """x & (2^c - 1) with x's low c bits zero is 0; (a + b) & (2^c - 1) and (a | b) & (2^c -
    1) with a's low c bits zero are b & (2^c - 1), taken where b is a constant (so the mask
    folds: a term left in would stop the device compiler sharing the sum with its other uses)."""
    node, (x, mask) = m.value, m.value.src
    if not _signed(node) or mask.arg < 0 or mask.arg & (mask.arg + 1):
        return None
    bits = mask.arg.bit_length()
    if _low_zeros(x) >= bits:
        return _const(0, node)
    if x.op in ("add", "or"):
        for a, b in (x.src, x.src[::-1]):
            if b.op == "const" and _low_zeros(a) >= bits:
                return K("and", node.dtype, (b, mask))
    return None


_CONST = P("const")
_INT_CONST = P("const", attrs={"arg": lambda v: isinstance(v, int) and not isinstance(v, bool)})
RULES = [
    Rule("fold", P(tuple(_INT_OPS) + tuple(_CMP), _CONST, _CONST), _fold),
    Rule("cast_const", P("cast", _CONST), _cast_const),
    Rule("add_zero", P(("add", "or", "xor"), V("x"), _c(0), commutative=True), _keep("x", need_int=True)),
    Rule("sub_zero", P(("sub", "shl", "shr"), V("x"), _c(0)), _keep("x", need_int=True)),
    Rule("mul_one", P("mul", V("x"), _c(1), commutative=True), _keep("x")),
    Rule("mul_zero", P(("mul", "and"), V("x"), _c(0), commutative=True), _zero),
    Rule("div_one", P("div", V("x"), _c(1)), _keep("x")),
    Rule("mod_one", P("mod", V("x"), _c(1)), _zero),
    Rule("min_same", P(("min", "max"), V("x"), V("x")), _keep("x", need_int=True)),
    Rule("reassociate", P(("add", "mul"), P(("add", "mul"), V("x"), P("const", name="c1"), name="inner",
                                            commutative=True), P("const", name="c2"), commutative=True),
         _reassociate),
    Rule("select_const", P("select", P("const", dtype=BOOL), V(), V()), _select_const),
    Rule("shift_of_sum", P("shr", P(("add", "or")), _INT_CONST), _shift_of_sum),
    Rule("mask_of_sum", P("and", V(), _INT_CONST), _mask_of_sum),
]
_BY_OP: dict[str, list[Rule]] = {}
for _rule in RULES:
    for _op in _rule.pattern.ops:
        _BY_OP.setdefault(_op, []).append(_rule)


class _Match:
    """What a rule function reads: the matched node and its captures."""

    def __init__(self, value: K, caps: Mapping[str, K] | None = None):
        self.value, self._caps = value, dict(caps or {})

    def __getitem__(self, name: str) -> K:
        return self._caps[name]


def _rewrite_node(node: K) -> K | None:
    changed, out = False, node
    for _ in range(16):  # each rule makes the tree smaller: a few steps settle it
        for rule in _BY_OP.get(out.op, ()):
            result = next((r for caps in match(_TreeView, rule.pattern, out)
                           if (r := rule.fn(_Match(out, caps))) is not None), None)
            if result is not None and result != out:
                out, changed = (transform(result, _rewrite_node) if result.src else result), True
                break
        else:
            break
    return out if changed else None


_SIMPLER: dict[K, K] = {}  # node -> its simplest form, shared by every kernel built in the process
_SIMPLER_LIMIT = 1 << 20


def simplify(tree: K) -> K:
    """Equal subtrees (an unrolled loop's repeated index arithmetic, the same decoder in the
    kernels of each row bucket) are simplified once and come out as one shared node."""
    if len(_SIMPLER) > _SIMPLER_LIMIT:
        _SIMPLER.clear()

    def once(node: K) -> K:
        if node not in _SIMPLER:
            simpler = _rewrite_node(node)
            _SIMPLER[node] = node if simpler is None else simpler
        return _SIMPLER[node]

    return transform(tree, once)
