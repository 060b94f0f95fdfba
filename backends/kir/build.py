"""Building kernels in Python: typed expressions with C's arithmetic, and a statement builder.

    kb = KernelBuilder("add", local=(256,))
    a, b, out = kb.buffer("a", "f32"), kb.buffer("b", "f32"), kb.buffer("out", "f32", writes=True)
    i = kb.let("i", kb.gid(0) * 256 + kb.lid(0))
    kb.return_if(i >= n)
    out[i] = a[i] + b[i]
    kernel = kb.build()

Python numbers take the type of the other operand; mixed operands convert as C does (int
to float, i32 to i64 or u32), with the conversion explicit in the tree so every printer
emits it. `x += y` on a Python variable rebinds the name, it does not add a statement:
use `kb.set(x, x + y)`; on array elements (`acc[r] += y`) it is an assignment.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
from typing import Callable, Iterable, Sequence

from .ir import BINARY, BOOL, BUFFER_TYPES, COMPARE, F32, I16, I32, I64, MATH, U32, VIEW_VALUE, VOID, DT, Function, \
    K, Kernel, Param, walk

Operand = K | int | float | bool

_RANK = {"bool": 0, "i16": 1, "i32": 2, "u32": 3, "i64": 4, "f32": 5}


def const(value: int | float | bool, dtype: DT | None = None) -> K:
    if dtype is None:
        dtype = BOOL if isinstance(value, bool) else I32 if isinstance(value, int) else F32
    if dtype.base == F32:
        value = float(value)
    elif dtype.base == BOOL:
        value = bool(value)
    else:
        value = int(value)
    return K("const", dtype.base, (), value)


def lift(x: Operand, like: DT | None = None) -> K:
    """An operand as a node: Python numbers take `like`'s scalar type (a float with an int
    `like` is a float constant)."""
    if isinstance(x, K):
        return x
    if like is not None and not (isinstance(x, float) and like.base != F32) and \
            not (like.base == BOOL and not isinstance(x, bool)):  # (i < 3) * 5 is an int, as in C
        return const(x, like.base)
    return const(x)


def cast(dtype: DT, x: Operand) -> K:
    x = lift(x)
    dtype = dtype if dtype.lanes > 1 or x.dtype.lanes == 1 else dtype.vec(x.dtype.lanes)
    return x if x.dtype == dtype else K("cast", dtype, (x,))


def bitcast(dtype: DT, x: K) -> K:
    return K("bitcast", dtype.vec(x.dtype.lanes), (x,))


def _lanes(*xs: K) -> int:
    lanes = {x.dtype.lanes for x in xs} - {1}
    if len(lanes) > 1:
        raise TypeError(f"vector operands of different widths: {sorted(lanes)}")
    return lanes.pop() if lanes else 1


def _common(a: K, b: K) -> tuple[K, K]:
    """C's usual conversions, made explicit."""
    sa, sb = a.dtype.scalar, b.dtype.scalar
    if sa == sb:
        return a, b
    top = max(sa, sb, key=_RANK.__getitem__)
    if "bool" in (sa, sb) and top != "bool":
        top = max(top, "i32", key=_RANK.__getitem__)
    return cast(DT(top), a), cast(DT(top), b)


def binary(op: str, a: Operand, b: Operand) -> K:
    if op not in BINARY:
        raise ValueError(f"unknown binary op {op!r}")
    if not isinstance(a, K) and not isinstance(b, K):
        raise TypeError(f"{op} of two Python values: compute it in Python")
    a = lift(a, b.dtype if isinstance(b, K) else None)
    b = lift(b, a.dtype)
    lanes = _lanes(a, b)
    if op in ("shl", "shr"):
        if not (a.dtype.is_int and b.dtype.is_int):
            raise TypeError(f"{op} needs integers, got {a.dtype} and {b.dtype}")
        return K(op, a.dtype, (a, b))
    if op in ("land", "lor"):
        return K(op, BOOL.vec(lanes), (cast(BOOL, a), cast(BOOL, b)))
    a, b = _common(a, b)
    if op in ("mod", "and", "or", "xor") and not a.dtype.is_int:
        raise TypeError(f"{op} needs integers, got {a.dtype}")
    result = BOOL if op in COMPARE else a.dtype.base
    return K(op, result.vec(lanes), (a, b))


def select(cond: K, a: Operand, b: Operand) -> K:
    a = lift(a, b.dtype if isinstance(b, K) else None)
    b = lift(b, a.dtype)
    a, b = _common(a, b)
    return K("select", a.dtype.vec(_lanes(cond, a, b)), (cond, a, b))


def call(name: str, *args: Operand) -> K:
    """A math intrinsic (ir.MATH), on floats."""
    if MATH.get(name) != len(args):
        raise ValueError(f"{name} is not a math intrinsic of {len(args)} arguments")
    xs = [cast(F32, lift(x, F32)) for x in args]
    lanes = _lanes(*xs)
    return K("call", F32.vec(lanes), tuple(cast(F32.vec(lanes), x) for x in xs), name)


def dot4_i8(a: Operand, b: Operand, acc: Operand) -> K:
    """acc + the dot product of the four signed bytes of ints a and b (__dp4a, sdot4)."""
    return K("call", I32, tuple(cast(I32, lift(x, I32)) for x in (a, b, acc)), "dot4_i8")


def dpbusd_at(acc: Operand, u: Operand, buf: "Buffer", byte: Operand) -> K:
    """acc + per 32-bit lane of 16 the dot product of u's four unsigned bytes with the four
    signed bytes at byte `byte` of `buf` (any alignment), the same word in every lane: x86
    VPDPBUSD (AVX-512 VNNI) in its broadcast-from-memory form, so a word costs no broadcast
    into a register. Only the OpenCL printer has it, and only a device whose lowering ISA
    includes avx512_vnni may be given it."""
    t = I32.vec(16)
    return K("dpbusd_at", t, (cast(t, lift(acc, t)), cast(t, lift(u, t)), lift(byte, I32)), buf.name)


def call_function(fn: Function, *args: Operand) -> K:
    xs = tuple(cast(t, lift(x, t)) for x, (_, t) in zip(args, fn.params))
    return K("call", fn.result.dtype, xs, fn)


def minimum(a: Operand, b: Operand) -> K:
    return binary("min", a, b)


def maximum(a: Operand, b: Operand) -> K:
    return binary("max", a, b)


def vsum(v: K) -> K:
    return K("vsum", v.dtype.base, (v,))


def var(name: str, dtype: DT = I32) -> K:
    return K("var", dtype, (), name)


def block(statements: Iterable[K]) -> K:
    return K("block", VOID, tuple(statements))


class Buffer:
    """A buffer parameter inside a builder: `buf[i]` loads (as the buffer type's view),
    `buf[i] = v` stores; `load`/`store` take another view or a vector width."""

    def __init__(self, kb: "KernelBuilder", name: str, ctype: str):
        self.kb, self.name, self.ctype = kb, name, ctype

    def load(self, index: Operand, view: str | None = None, lanes: int = 1) -> K:
        view = view or self.ctype
        return K("load", VIEW_VALUE[view].vec(lanes), (lift(index, I32),), (self.name, view))

    def store(self, index: Operand, value: Operand, view: str | None = None) -> None:
        view = view or self.ctype
        value = cast(VIEW_VALUE[view], lift(value, VIEW_VALUE[view]))
        self.kb.emit(K("store", VOID, (lift(index, I32), value), (self.name, view)))

    def __getitem__(self, index: Operand) -> K:
        return self.load(index)

    def __setitem__(self, index: Operand, value: Operand) -> None:
        self.store(index, value)


class Array:
    """A private or work-group (`local`) array: `arr[i]` reads, `arr[i] = v` assigns."""

    def __init__(self, kb: "KernelBuilder", name: str, dtype: DT):
        self.kb, self.name, self.dtype = kb, name, dtype

    def __getitem__(self, i: Operand) -> K:
        return K("index", self.dtype, (lift(i, I32),), self.name)

    def __setitem__(self, i: Operand, value: Operand) -> None:
        self.kb.set(self[i], value)

    def vec(self, i: Operand, lanes: int) -> K:
        """Elements i .. i + lanes - 1 of a scalar array as one vector (read or assigned)."""
        return K("index", self.dtype.vec(lanes), (lift(i, I32),), self.name)


class KernelBuilder:
    def __init__(self, op: str, local: Sequence[int] = (256,)):
        self.op = op
        self.local = tuple(local) + (1,) * (3 - len(local))
        self._params: dict[str, Param] = {}
        self._blocks: list[list[K]] = [[]]
        self._functions: dict[str, Function] = {}

    # -- parameters and ids ---------------------------------------------------------------
    def buffer(self, name: str, ctype: str, writes: bool = False) -> Buffer:
        if ctype not in BUFFER_TYPES:
            raise ValueError(f"buffer {name!r}: element type {ctype!r} is not one of {BUFFER_TYPES}")
        if name in self._params:
            raise ValueError(f"parameter {name!r} declared twice")
        self._params[name] = Param(name, ctype, writes)
        return Buffer(self, name, ctype)

    @staticmethod
    def gid(axis: int) -> K:
        return K("special", I32, (), ("gid", axis))

    @staticmethod
    def lid(axis: int) -> K:
        return K("special", I32, (), ("lid", axis))

    # -- statements -----------------------------------------------------------------------
    def emit(self, stmt: K) -> None:
        self._blocks[-1].append(stmt)

    def extend(self, stmts: Iterable[K]) -> None:
        self._blocks[-1].extend(stmts)

    def statements(self) -> tuple[K, ...]:
        """The statements emitted so far (outside any open loop or if block)."""
        if len(self._blocks) != 1:
            raise RuntimeError("a kernel's statements taken inside an open loop or if block")
        return tuple(self._blocks[0])

    def let(self, name: str, value: Operand, dtype: DT | None = None) -> K:
        """Declare a variable initialised to `value` (converted to `dtype` if given)."""
        value = lift(value, dtype)
        if dtype is not None:
            value = cast(dtype, value)
        self.emit(K("decl", value.dtype, (value,), name))
        return var(name, value.dtype)

    def declare(self, name: str, dtype: DT) -> K:
        self.emit(K("decl", dtype, (), name))
        return var(name, dtype)

    def array(self, name: str, dtype: DT, length: int, scope: str = "private",
              init: Sequence[float | int] | None = None) -> Array:
        if scope not in ("private", "local"):
            raise ValueError(f"array scope must be private or local, got {scope!r}")
        values = None if init is None else tuple(init)
        self.emit(K("array", dtype, (), (name, int(length), scope, values)))
        return Array(self, name, dtype)

    def set(self, target: K, value: Operand) -> None:
        if target.op not in ("var", "index"):
            raise TypeError(f"cannot assign to a {target.op} node")
        self.emit(K("assign", VOID, (target, cast(target.dtype, lift(value, target.dtype)))))

    def barrier(self) -> None:
        self.emit(K("barrier"))

    def wg_reduce(self, arr: Array, n: int, how: str) -> None:
        if how not in ("sum", "max") or n & (n - 1):
            raise ValueError(f"wg_reduce: {how!r} over {n} (sum or max over a power of two)")
        self.emit(K("wg_reduce", VOID, (), (arr.name, n, how)))

    def return_if(self, cond: K) -> None:
        self.emit(K("if", VOID, (cond, block([K("return")]), block(()))))

    @contextlib.contextmanager
    def _nested(self):
        self._blocks.append([])
        try:
            yield
        finally:
            self._body = block(self._blocks.pop())

    @contextlib.contextmanager
    def loop(self, name: str, start: Operand, stop: Operand | None = None, step: Operand = 1, *,
             cond: K | Callable[[K], K] | None = None, next: K | Callable[[K], K] | None = None,
             unroll: int = 0):
        """for (int name = start; name < stop && cond; name = next or name + step); cond and
        next are expressions, or functions of the loop variable; `unroll` asks the device
        compiler to unroll it that many times (PoCL does not unroll on its own)."""
        i = var(name)
        cond, next = (f(i) if callable(f) else f for f in (cond, next))
        tests = ([] if stop is None else [i < stop]) + ([] if cond is None else [cond])
        if not tests:
            raise ValueError(f"loop {name!r} needs a stop or a condition")
        test = tests[0] if len(tests) == 1 else tests[0] & tests[1]
        with self._nested():
            yield i
        loop = K("for", VOID, (lift(start, I32), test, i + step if next is None else next, self._body), name)
        self.emit(K("unroll", VOID, (loop,), unroll) if unroll else loop)

    @contextlib.contextmanager
    def if_(self, cond: K):
        with self._nested():
            yield
        self.emit(K("if", VOID, (cond, self._body, block(()))))

    @contextlib.contextmanager
    def else_(self):
        """The else branch of the `if_` just closed."""
        last = self._blocks[-1].pop()
        if last.op != "if" or last.src[2].src:
            raise ValueError("else_ must follow an if_ block without an else")
        with self._nested():
            yield
        self.emit(K("if", VOID, (last.src[0], last.src[1], self._body)))

    # -- result ---------------------------------------------------------------------------
    def build(self, int_params: Iterable[str] = ()) -> Kernel:
        """The kernel; variables used but never declared must be among `int_params` (the
        symbol sizes), which become int parameters in the order given."""
        return _kernel(self.op, tuple(self._params.values()), self.local, tuple(int_params), block(self.statements()))


@functools.lru_cache(maxsize=1024)
def _kernel(op: str, buffers: tuple[Param, ...], local: tuple[int, ...], int_params: tuple[str, ...],
            body: K) -> Kernel:
    """The kernel of a built tree. Memoised on the tree (structural equality): the layers of
    a model build the same trees many times over (1437 builds, 125 kernels, in a 16-layer
    model's programs) and simplifying a tree is most of a build's cost."""
    from .simplify import simplify

    body = simplify(body)
    free = free_vars(body)
    unknown = free - set(int_params)
    if unknown:
        raise ValueError(f"kernel {op}: variables {sorted(unknown)} are used but never declared")
    params = buffers + tuple(Param(n, "int") for n in int_params if n in free)
    functions = tuple(dict.fromkeys(n.arg for n in walk(body) if n.op == "call" and isinstance(n.arg, Function)))
    key = repr((params, local, body)).encode()
    name = f"{op}_{hashlib.sha1(key).hexdigest()[:10]}"
    return Kernel(name, op, params, local, body, functions)


def free_vars(body: K) -> set[str]:
    """Names read as variables that no decl, array or loop of the tree introduces."""
    declared, used = set(), set()
    for n in walk(body):
        if n.op in ("decl", "for"):
            declared.add(n.arg)
        elif n.op == "array":
            declared.add(n.arg[0])
        elif n.op == "var":
            used.add(n.arg)
    return used - declared


FUNCTIONS: dict[str, Function] = {}  # every device function, by name: a module header holds them all


def function(name: str, params: Sequence[tuple[str, DT]], make) -> Function:
    """A device function: `make(kb, *param_vars)` adds statements to kb and returns the
    result expression."""
    kb = KernelBuilder(name)
    args = [var(p, t) for p, t in params]
    result = lift(make(kb, *args))
    fn = Function(name, tuple(params), block(kb._blocks[0]), result)
    if FUNCTIONS.setdefault(name, fn) != fn:
        raise ValueError(f"device function {name!r} defined twice, differently")
    return fn


__all__ = ["KernelBuilder", "Buffer", "Array", "const", "lift", "cast", "bitcast", "binary", "select", "call",
           "dot4_i8", "dpbusd_at", "call_function", "minimum", "maximum", "vsum", "var", "block", "function",
           "free_vars", "F32", "I16", "I32", "U32", "I64", "BOOL", "VOID", "DT"]
