"""The kernel IR: one node type for expressions and statements, as plain frozen data.

A kernel is a tree of `K` nodes (op, dtype, src, arg), tinygrad's UOp idea at the level of
one kernel: expressions are typed values (scalars or short vectors), statements have
dtype VOID. Every transform (simplify, scalarize, expand work-group reductions) and every
printer walks the same node type, so a new target language is a printer of these ops and
nothing else. The ops, with `src` and `arg`:

    const       ()                    the value (int, float or bool)
    var         ()                    name: a local, a loop variable or an int kernel parameter
    special     ()                    ("gid" | "lid", axis): work-group / work-item id
    load        (index,)              (buffer, view): element `index` of a buffer read as `view`
    index       (i,)                  array name: element i of a private or local array
    <binary>    (a, b)                add sub mul div mod shl shr and or xor lt le gt ge eq ne
                                      land lor min max (div and mod as in C: truncating)
    neg not bnot (a,)
    call        args                  function name: a math intrinsic (MATH, dot4_i8) or a device
                                      function; round_f16 rounds to f16 and back, dot4_i8(a, b,
                                      acc) adds the dot product of the four signed bytes of a and b
    dpbusd_at   (acc, u, byte)        buffer: acc + per lane of 16 the dot product of u's four
                                      unsigned bytes with the four signed bytes at `byte` of the
                                      buffer (x86 VNNI's memory-broadcast form; OpenCL on a CPU only)
    select      (cond, a, b)
    cast        (x,)                  value conversion to dtype
    bitcast     (x,)                  reinterpret the bits as dtype (same width)
    vsum        (v,)                  sum of a vector's lanes, pairwise (lo + hi halves)
    decl        (init,) or ()         name: a scalar or vector variable
    array       ()                    (name, length, scope "private" | "local", init values or None)
    assign      (target, value)       target a var or index node
    store       (index, value)        (buffer, view)
    for         (start, cond, next, body)   name of the int loop variable; next its value
                                      for the next iteration (i + 1, s >> 1 ...)
    unroll      (for,)                factor: a hint that the loop be unrolled that many times (a
                                      pragma in C dialects; targets without one ignore it)
    if          (cond, then, else)    else is an empty block when absent
    block       statements
    return barrier ()
    wg_reduce   ()                    (array, n, "sum" | "max"): reduce local array[0..n) (n a power
                                      of two, the work-group size, indexed by lid) into array[0],
                                      ending with a barrier

Buffer views: a buffer holds elements of its parameter type (f32, i32, i64, u8, u16); a
load or store names the view it reads them as, with `index` counted in view elements:
f32 i32 i64 (as stored), u8 i8 u16 (narrow integers, values as i32), f16 and bf16 (16-bit
floats, values as f32). A view may be narrower than the buffer type only on u8/u16
buffers (a u16 or f16 at an even byte of a Q8_0 block).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Callable, Iterator


@dataclass(frozen=True)
class DT:
    """A value type: scalar name and lane count (vectors of 2..16 lanes)."""

    scalar: str
    lanes: int = 1

    def vec(self, lanes: int) -> "DT":
        return DT(self.scalar, lanes)

    @property
    def base(self) -> "DT":
        return self if self.lanes == 1 else DT(self.scalar)

    @property
    def is_float(self) -> bool:
        return self.scalar == "f32"

    @property
    def is_int(self) -> bool:
        return self.scalar in ("i16", "i32", "u32", "i64")

    def __str__(self) -> str:
        return self.scalar if self.lanes == 1 else f"{self.scalar}x{self.lanes}"


F32, I16, I32, U32, I64, BOOL, VOID = DT("f32"), DT("i16"), DT("i32"), DT("u32"), DT("i64"), DT("bool"), DT("void")
# i16 is for vector arithmetic on small integers (products of int8 quants: 16-bit multiplies)
SCALARS = ("f32", "i16", "i32", "u32", "i64", "bool")

# buffer element types (kernel parameters) and the views a load or store may take of them
BUFFER_TYPES = ("f32", "i32", "i64", "u8", "u16")
VIEW_VALUE = {"f32": F32, "i32": I32, "i64": I64, "u8": I32, "i8": I32, "u16": I32, "f16": F32, "bf16": F32}
VIEW_BYTES = {"f32": 4, "i32": 4, "i64": 8, "u8": 1, "i8": 1, "u16": 2, "f16": 2, "bf16": 2}
BUFFER_BYTES = {"f32": 4, "i32": 4, "i64": 8, "u8": 1, "u16": 2}

BINARY = ("add", "sub", "mul", "div", "mod", "shl", "shr", "and", "or", "xor", "lt", "le", "gt", "ge", "eq", "ne",
          "land", "lor", "min", "max")
COMPARE = ("lt", "le", "gt", "ge", "eq", "ne")
UNARY = ("neg", "not", "bnot")
# math intrinsics every printer knows: name -> arity (floats; min/max are binary ops)
MATH = {"exp": 1, "log": 1, "log1p": 1, "sqrt": 1, "sin": 1, "cos": 1, "fabs": 1, "floor": 1, "trunc": 1,
        "round": 1, "fma": 3, "round_f16": 1}


@dataclass(frozen=True, eq=True)
class K:
    """A kernel IR node (see the module docstring for the ops)."""

    op: str
    dtype: DT = VOID
    src: tuple["K", ...] = ()
    arg: Any = None

    # -- expression building: Python operators make binary nodes -------------------------
    def _bin(self, op: str, other, swap: bool = False) -> "K":
        from .build import binary

        return binary(op, other, self) if swap else binary(op, self, other)

    def __add__(self, o): return self._bin("add", o)
    def __radd__(self, o): return self._bin("add", o, True)
    def __sub__(self, o): return self._bin("sub", o)
    def __rsub__(self, o): return self._bin("sub", o, True)
    def __mul__(self, o): return self._bin("mul", o)
    def __rmul__(self, o): return self._bin("mul", o, True)
    def __truediv__(self, o): return self._bin("div", o)
    def __rtruediv__(self, o): return self._bin("div", o, True)
    def __mod__(self, o): return self._bin("mod", o)
    def __rmod__(self, o): return self._bin("mod", o, True)
    def __lshift__(self, o): return self._bin("shl", o)
    def __rshift__(self, o): return self._bin("shr", o)
    def __and__(self, o): return self._bin("land" if self.dtype.base == BOOL else "and", o)
    def __rand__(self, o): return self._bin("land" if self.dtype.base == BOOL else "and", o, True)
    def __or__(self, o): return self._bin("lor" if self.dtype.base == BOOL else "or", o)
    def __ror__(self, o): return self._bin("lor" if self.dtype.base == BOOL else "or", o, True)
    def __xor__(self, o): return self._bin("xor", o)
    def __lt__(self, o): return self._bin("lt", o)
    def __le__(self, o): return self._bin("le", o)
    def __gt__(self, o): return self._bin("gt", o)
    def __ge__(self, o): return self._bin("ge", o)

    def eq(self, o) -> "K":
        return self._bin("eq", o)

    def ne(self, o) -> "K":
        return self._bin("ne", o)

    def __neg__(self) -> "K":
        return K("neg", self.dtype, (self,))

    def __invert__(self) -> "K":
        return K("not" if self.dtype.base == BOOL else "bnot", self.dtype, (self,))

    def __bool__(self) -> bool:
        raise TypeError("a kernel expression has no truth value here; use select(), `&`/`|` or .eq()")

    def __eq__(self, other) -> bool:  # structural identity of trees; a kernel comparison is .eq()
        return self is other or (isinstance(other, K) and hash(self) == hash(other) and
                                 (self.op, self.dtype, self._arg, self.src) == (other.op, other.dtype, other._arg,
                                                                                 other.src))

    def __hash__(self) -> int:
        return self._hash

    def __post_init__(self):
        # trees are hashed often (rewrites, dedup, the memoised builds): once per node, when
        # made; the arg as compared: floats by their bits, so -0.0 is not 0.0 and a NaN
        # equals itself
        arg = _bits(self.arg)
        object.__setattr__(self, "_arg", arg)
        object.__setattr__(self, "_hash", hash((self.op, self.dtype, arg, self.src)))

    def __repr__(self) -> str:
        inner = ", ".join(repr(s) for s in self.src)
        return f"{self.op}<{self.dtype}>({self.arg!r}{'; ' + inner if inner else ''})"


def _bits(arg):
    if isinstance(arg, float):
        return struct.pack("<d", arg)
    return tuple(_bits(a) for a in arg) if isinstance(arg, tuple) else arg


def walk(node: K) -> Iterator[K]:
    """Every node of a tree, parents before children."""
    stack = [node]
    while stack:
        n = stack.pop()
        yield n
        stack.extend(reversed(n.src))


def transform(node: K, fn: Callable[[K], K | None]) -> K:
    """Rebuild a tree bottom-up: each node with its transformed children is passed to `fn`,
    whose result (or the node itself, on None) takes its place. Shared subtrees are
    transformed once."""
    done: dict[int, K] = {}

    def go(n: K) -> K:
        key = id(n)
        if key not in done:
            src = tuple(go(s) for s in n.src)
            rebuilt = n if all(a is b for a, b in zip(src, n.src)) else K(n.op, n.dtype, src, n.arg)
            out = fn(rebuilt)
            done[key] = rebuilt if out is None else out
        return done[key]

    return go(node)


@dataclass(frozen=True)
class Param:
    """A kernel parameter: a buffer (element type in BUFFER_TYPES, written or not) or an int."""

    name: str
    ctype: str               # buffer element type, or "int"
    writes: bool = False

    @property
    def is_buffer(self) -> bool:
        return self.ctype != "int"


@dataclass(frozen=True)
class Function:
    """A device function: scalar f32/i32 parameters, a body ending in one returned expression."""

    name: str
    params: tuple[tuple[str, DT], ...]
    body: K                  # a block; its last statement's value is `result`
    result: K


@dataclass(frozen=True)
class Kernel:
    """One kernel: parameters (buffers, then ints), fixed work-group size, body. `name` is a
    content hash, so identical kernels of different graph nodes are one kernel."""

    name: str
    op: str
    params: tuple[Param, ...]
    local: tuple[int, int, int]
    body: K
    functions: tuple[Function, ...] = ()

    @property
    def buffers(self) -> tuple[Param, ...]:
        return tuple(p for p in self.params if p.is_buffer)

    @property
    def ints(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params if not p.is_buffer)

    @property
    def threads(self) -> int:
        return self.local[0] * self.local[1] * self.local[2]
