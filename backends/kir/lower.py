"""Kernel-tree passes that printers run for targets lacking a construct.

- `expand_wg_reduce`: a work-group reduction as a barrier tree over the local array
  (every target but GLSL with subgroup arithmetic, which prints its own form).
- `scalarize`: vector values as lane loops over private arrays, for targets without
  16-wide vector types (CUDA, HIP, GLSL). A vector statement becomes a loop over its lanes;
  a vector sum becomes the pairwise tree of its lanes, halves first, the order OpenCL's
  `.lo + .hi` reduction takes, so every target sums the lanes in the same order.
"""
from __future__ import annotations

from dataclasses import replace

from .build import block, const, var
from .ir import I32, VOID, K, Kernel, transform

LANE = "lane_"


def expand_wg_reduce(kernel: Kernel) -> Kernel:
    def expand(node: K) -> K | None:
        if node.op != "wg_reduce":
            return None
        name, n, how = node.arg
        lid, s = K("special", I32, (), ("lid", 0)), var("s_")
        dtype = next(a.dtype for a in _arrays(kernel.body) if a.arg[0] == name)
        at = lambda i: K("index", dtype, (i,), name)  # noqa: E731
        combined = K("add" if how == "sum" else "max", dtype, (at(lid), at(lid + s)))
        step = K("if", VOID, (lid < s, block([K("assign", VOID, (at(lid), combined))]), block(())))
        loop = K("for", VOID, (const(n // 2), s > 0, s >> 1, block([step, K("barrier")])), "s_")
        return block([K("barrier"), loop])

    return replace(kernel, body=_flatten(transform(kernel.body, expand)))


def _arrays(body: K):
    from .ir import walk

    return [n for n in walk(body) if n.op == "array"]


def _flatten(tree: K) -> K:
    """Blocks directly inside blocks merged into their parent."""
    def merge(node: K) -> K | None:
        if node.op != "block" or not any(s.op == "block" for s in node.src):
            return None
        return block(x for s in node.src for x in (s.src if s.op == "block" else (s,)))
    return transform(tree, merge)


def scalarize(kernel: Kernel) -> Kernel:
    if not any(n.dtype.lanes > 1 for n in _all(kernel.body)):
        return kernel
    vectors = {n.arg: n.dtype.lanes for n in _all(kernel.body) if n.op == "decl" and n.dtype.lanes > 1}
    vectors.update({n.arg[0]: n.dtype.lanes for n in _all(kernel.body) if n.op == "array" and n.dtype.lanes > 1})
    return replace(kernel, body=_Scalarizer(vectors).statement(kernel.body))


def _all(body: K):
    from .ir import walk

    return walk(body)


class _Scalarizer:
    def __init__(self, vectors: dict[str, int]):
        self.vectors = vectors  # vector variable or array name -> lanes

    def statement(self, s: K) -> K:
        op = s.op
        if op == "block":
            return block(self.statement(x) for x in s.src)
        if op == "for":
            start, cond, nxt, body = s.src
            return K("for", VOID, (self.scalar(start), self.scalar(cond), self.scalar(nxt), self.statement(body)),
                     s.arg)
        if op == "unroll":
            return K("unroll", VOID, (self.statement(s.src[0]),), s.arg)
        if op == "if":
            cond, then, other = s.src
            return K("if", VOID, (self.scalar(cond), self.statement(then), self.statement(other)))
        if op == "decl" and s.dtype.lanes > 1:
            array = K("array", s.dtype.base, (), (s.arg, s.dtype.lanes, "private", None))
            if not s.src:
                return array
            target = K("var", s.dtype, (), s.arg)
            return block([array, self._lanes(K("assign", VOID, (target, s.src[0])), s.dtype.lanes)])
        if op == "array" and s.dtype.lanes > 1:
            name, length, scope, init = s.arg
            return K("array", s.dtype.base, (), (name, length * s.dtype.lanes, scope, init))
        if op == "assign" and s.src[0].dtype.lanes > 1:
            return self._lanes(s, s.src[0].dtype.lanes)
        if op == "store" and s.src[1].dtype.lanes > 1:
            return self._lanes(s, s.src[1].dtype.lanes)
        return K(op, s.dtype, tuple(self.scalar(x) for x in s.src), s.arg) if s.src else s

    def _lanes(self, s: K, lanes: int) -> K:
        lane = var(LANE)
        body = K(s.op, s.dtype, tuple(self.lane(x, lane) for x in s.src), s.arg)
        if s.op == "store":
            index, value = s.src
            body = K("store", VOID, (self.scalar(index) + lane, self.lane(value, lane)), s.arg)
        return K("for", VOID, (const(0), lane < lanes, lane + 1, block([body])), LANE)

    def lane(self, x: K, lane: K | int) -> K:
        """Lane `lane` of x (x itself when x is a scalar)."""
        if x.dtype.lanes == 1:
            return self.scalar(x)
        base = x.dtype.base
        if x.op == "var":
            return K("index", base, (lift_int(lane),), x.arg)
        if x.op == "index":
            (i,) = x.src
            if x.arg in self.vectors:  # an element of an array of vectors
                return K("index", base, (self.scalar(i) * x.dtype.lanes + lane,), x.arg)
            return K("index", base, (self.scalar(i) + lane,), x.arg)  # a run of a scalar array
        if x.op == "load":
            return K("load", base, (self.scalar(x.src[0]) + lane,), x.arg)
        return K(x.op, base, tuple(self.lane(s, lane) for s in x.src), x.arg)

    def scalar(self, x: K) -> K:
        """A scalar-valued expression with its vector sums expanded."""
        def expand(node: K) -> K | None:
            if node.op != "vsum":
                return None
            (v,) = node.src
            parts = [self.lane(v, i) for i in range(v.dtype.lanes)]
            while len(parts) > 1:
                half = len(parts) // 2
                parts = [K("add", node.dtype, (parts[i], parts[i + half])) for i in range(half)]
            return parts[0]
        return transform(x, expand) if x.dtype.lanes == 1 else x


def lift_int(lane: K | int) -> K:
    return lane if isinstance(lane, K) else const(lane)
