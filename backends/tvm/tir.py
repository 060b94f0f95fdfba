"""TensorIR kernel text: one PrimFunc per kernel, written as TVMScript with the node's
concrete dims baked in and symbolic dims as int params `n_<symbol>`.

Every buffer is a flat 1-D view of the value's storage (like the native kernels' pointers),
so the runner's byte buffers map onto PrimFunc params without reshaping. A kernel holds one
sblock: spatial axes (and reduction axes, for dlight's reduction rules) over a body of
TVMScript statements; `sequential` blocks carry serial loops and local scratch in their
body and are scheduled by hand on GPU targets (one thread per spatial point).
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Callable, Sequence

from dflash_ir import activations
from dflash_ir.blocks import DECODERS
from dflash_ir.dtypes import DType
from dflash_ir.ir import Value
from dflash_ir.types import Dim

from ..plan import symbol_param

# f16 is stored and moved as its bits (PoCL has no cl_khr_fp16); half_to_float / float_to_half convert
TVM_DTYPES = {DType.F32: "float32", DType.F16: "uint16", DType.BF16: "uint16", DType.I32: "int32",
              DType.I64: "int64", DType.BOOL: "uint8"} | {d: "uint8" for d in DType if d.is_block}


def dim(d: Dim) -> str:
    return str(d) if isinstance(d, int) else symbol_param(d)


def prod(dims: Sequence[Dim]) -> str:
    """Product of dims as an expression (ints folded; "1" when empty)."""
    const = 1
    names = []
    for d in dims:
        if isinstance(d, int):
            const *= d
        else:
            names.append(dim(d))
    if not names:
        return str(const)
    return "(" + " * ".join(names + ([str(const)] if const != 1 else [])) + ")"


def storage_size(v: Value) -> str:
    """Elements of the value's storage (block types: bytes) as a size expression."""
    shape, dtype = v.type.shape, v.type.dtype
    if dtype.is_block:
        return prod(shape[:-1] + (shape[-1] // dtype.block_size * dtype.block_bytes,))
    return prod(shape)


def flat(coords: Sequence[str], dims: Sequence[Dim]) -> str:
    """Row-major flat index of `coords` in a tensor of `dims`."""
    expr = ""
    for c, d in zip(coords, dims):
        expr = c if not expr else f"({expr}) * {dim(d)} + {c}"
    return expr or "0"


def broadcast(coords: Sequence[str], out: Sequence[Dim], src: Sequence[Dim]) -> str:
    """Flat index into `src` at output coords, numpy broadcasting `src` to `out`."""
    lead = len(out) - len(src)
    return flat([coords[lead + a] if d != 1 else "0" for a, d in enumerate(src)], src)


def f32(x: float) -> str:
    """An exact float32 literal."""
    import numpy as np

    v = np.float32(x)
    if np.isinf(v):
        return "T.float32('inf')" if v > 0 else "T.float32('-inf')"
    return f"T.float32({float(v)!r})"


def activation(name: str, *operands: str) -> str:
    """Elementwise op `name` of dflash_ir/activations.py (sigmoid, swiglu, ...) over text
    operands, as TVMScript text."""
    return str((activations.UNARY | activations.BINARY)[name](TIR, *map(_Text, operands)))


def round_half_away(v: str) -> str:
    """C roundf in f32 arithmetic: v - trunc(v) is exact, so the half test is too."""
    return (f"(T.trunc({v}) + T.if_then_else(T.fabs({v} - T.trunc({v})) >= T.float32(0.5), "
            f"T.if_then_else({v} >= T.float32(0), T.float32(1), T.float32(-1)), T.float32(0)))")


def weight_at(dtype: DType, buf: str, row: str, col: str, k: Dim) -> str:
    """f32 value of element (row, col) of `buf` stored as `dtype` with rows of k elements."""
    if dtype is DType.F32:
        return f"{buf}[({row}) * {dim(k)} + {col}]"
    if dtype is DType.F16:
        return half_to_float(f"{buf}[({row}) * {dim(k)} + {col}]")
    if dtype is DType.BF16:
        return f'T.reinterpret("float32", T.shift_left(T.Cast("uint32", {buf}[({row}) * {dim(k)} + {col}]), T.uint32(16)))'
    if dtype is DType.Q8_0:
        return f"({q8_scale(buf, row, f'({col}) // 32', k)} * {q8_quant(buf, row, col, k)})"
    if dtype in DECODERS:
        within = _Text(f"(({col}) % {dtype.block_size})")
        return str(DECODERS[dtype].value(_block_of(dtype, buf, row, col, k), within))
    raise ValueError(f"{dtype} is not a weight dtype")


def q8_block(row: str, block: str, k: Dim) -> str:
    return f"({row}) * {k // 32 * 34} + ({block}) * 34"


def q8_scale(buf: str, row: str, block: str, k: Dim) -> str:
    return half_to_float(u16_at(buf, q8_block(row, block, k)))


def u16_at(buf: str, at: str) -> str:
    """The little-endian u16 at byte `at` of a uint8 buffer (blocks are not 2-byte aligned here)."""
    return f'T.bitwise_or(T.Cast("uint16", {buf}[{at}]), T.shift_left(T.Cast("uint16", {buf}[{at} + 1]), T.uint16(8)))'


class _Text(str):
    """An int32 or float32 TIR expression as TVMScript text, with the operators the block
    decoders (dflash_ir/blocks.py) use; Python ints are int32 literals."""

    def _bin(self, fmt: str, other, swap: bool = False) -> "_Text":
        other = f32(other) if isinstance(other, float) else str(other)
        a, b = (other, str(self)) if swap else (str(self), other)
        return type(self)(fmt.format(a, b))

    def __add__(self, o): return self._bin("({} + {})", o)
    def __radd__(self, o): return self._bin("({} + {})", o, True)
    def __sub__(self, o): return self._bin("({} - {})", o)
    def __rsub__(self, o): return self._bin("({} - {})", o, True)
    def __mul__(self, o): return self._bin("({} * {})", o)
    def __rmul__(self, o): return self._bin("({} * {})", o, True)
    def __lshift__(self, o): return self._bin("T.shift_left({}, {})", o)
    def __rshift__(self, o): return self._bin("T.shift_right({}, {})", o)
    def __and__(self, o): return self._bin("T.bitwise_and({}, {})", o)
    def __or__(self, o): return self._bin("T.bitwise_or({}, {})", o)
    def __xor__(self, o): return self._bin("T.bitwise_xor({}, {})", o)
    def __truediv__(self, o): return self._bin("({} / {})", o)
    def __rtruediv__(self, o): return self._bin("({} / {})", o, True)
    def __lt__(self, o): return self._bin("({} < {})", o)
    def __gt__(self, o): return self._bin("({} > {})", o)
    def __ge__(self, o): return self._bin("({} >= {})", o)
    def __neg__(self): return _Text(f"(-{self})")


def _binary(form: str) -> staticmethod:
    """A math's operation of two operands as TVMScript text (a float as an f32 literal)."""
    return staticmethod(lambda a, b: _Text(form.format(*(f32(x) if isinstance(x, float) else x for x in (a, b)))))


class _TirMath(activations.Math):
    """dflash_ir/activations.py's math as TVMScript text: one expression (a let is its text
    repeated) and selects, not if_then_else (a select stays one vector op when TVM
    vectorises)."""

    exp, fabs, log1p, sqrt = (staticmethod(lambda x, f=f: _Text(f"T.{f}({x})"))
                              for f in ("exp", "fabs", "log1p", "sqrt"))

    maximum, minimum = _binary("T.max({}, {})"), _binary("T.min({}, {})")
    equal, either, both = _binary("({} == {})"), _binary("T.Or({}, {})"), _binary("T.And({}, {})")

    @staticmethod
    def select(cond, a, b) -> _Text:
        return _Text(f"T.Select({cond}, {a}, {b})")


TIR = _TirMath()


class _IndexText(_Text):
    """A non-negative index: shifts and masks by constants as floor division and modulo, which
    TVM's vectoriser sees through (a run of lanes' bytes stays one contiguous load)."""

    def __rshift__(self, o):
        return type(self)(f"T.floordiv({self}, {1 << o})") if isinstance(o, int) else super().__rshift__(o)

    def __and__(self, o):
        if isinstance(o, int) and o & (o + 1) == 0:
            return type(self)(f"T.floormod({self}, {o + 1})")
        return super().__and__(o)


def _block_of(dtype: DType, buf: str, row: str, col: str, k: Dim,
              half: Callable[[str], str] | None = None) -> "_BlockText":
    """The block decoders' reader over the block holding element (row, col) of `buf`."""
    size, nbytes = dtype.block_size, dtype.block_bytes
    row_bytes = k // size * nbytes if isinstance(k, int) else f"({dim(k)} // {size} * {nbytes})"
    return _BlockText(buf, f"(({row}) * {row_bytes} + ({col}) // {size} * {nbytes})", half)


def sub_block(dtype: DType, buf: str, row: str, first: str, k: int, f16: Callable[[str], str] | None = None):
    """Elements first .. first + 15 of row `row` of `buf` (first a multiple of 16, so one
    sub-block of every block type holds them all: they share a scale and offset): (their
    scale, their offset or None, code(lane) of element first + lane), as expressions.
    `f16`: the text of f32 from f16 bits (a uint16) where not half_to_float's bit arithmetic
    (the loop nests' F16C primitive)."""
    fmt = DECODERS[dtype]
    reader = _block_of(dtype, buf, row, first, k, f16)
    within = _IndexText(f"(({first}) % {dtype.block_size})")
    j = within >> (fmt.sub.bit_length() - 1)
    offset = fmt.offset(reader, j) if fmt.offset else None
    return fmt.scale(reader, j), offset, lambda lane: fmt.code(reader, within + lane)


class _BlockText:
    """The block decoders' reader over the block at byte `block` of uint8 buffer `buf`."""

    def __init__(self, buf: str, block: str, half: Callable[[str], str] | None = None):
        self.buf, self.block = buf, block
        self.half = half or half_to_float  # f16 bits (text) to f32 (text)

    def u8(self, byte) -> _Text:
        return _Text(f'T.Cast("int32", {self.buf}[{self.block} + {byte}])')

    def f16(self, byte: int) -> _Text:
        return _Text(self.half(u16_at(self.buf, f"{self.block} + {byte}")))

    f32_type = "float32"  # of a value read (a vector type where a read is 16 columns')

    def f32(self, x) -> _Text:
        return _Text(f'T.Cast("{self.f32_type}", {x})')

    @staticmethod
    def f32_bits(x) -> _Text:
        return _Text(f'T.reinterpret("float32", {x})')

    # Select, not if_then_else: both sides are loads inside the block or constants, and TVM's
    # vectoriser keeps a Select one vector op where it makes a loop of branches of an
    # if_then_else (tvm-opencl's one-row 4096 x 4096 IQ4_NL product took 88 ms so)
    @staticmethod
    def select(cond, a, b) -> _Text:
        return _Text(f"T.Select({cond}, {a}, {b})")

    @staticmethod
    def table(name: str, values, index) -> _Text:
        """A chain of selects (TIR has no constant arrays in an expression)."""
        text = f"T.float32({float(values[-1])!r})"
        for q in range(len(values) - 2, -1, -1):
            text = f"T.Select({index} == {q}, T.float32({float(values[q])!r}), {text})"
        return _Text(text)


def _u32(v: int) -> str:
    return f"T.uint32({v})"


def half_to_float(bits: str) -> str:
    """f32 value of f16 bits (a uint16 expression), as text: exact for every f16 (subnormals,
    inf and NaN included) and free of branches: the magnitude's bits moved to f32's places
    with the exponent rebased (by 112; inf and NaN to 255; a subnormal as if its exponent
    were 1, then that leading 2^-14 subtracted, exactly), the sign put back: the GPU bodies'
    f16 (a CPU's nests take F16C, nest_targets.py)."""
    def u(v: int) -> _Text:
        return _Text(_u32(v))

    select = _BlockText.select
    h = _Text(f'T.Cast("uint32", {bits})')
    e = h & u(0x7C00)
    subnormal = f"({e} == {u(0)})"
    bias = select(f"({e} == {u(0x7C00)})", u(224 << 23), select(subnormal, u(113 << 23), u(112 << 23)))
    magnitude = (_Text(f'T.reinterpret("float32", {((h & u(0x7FFF)) << u(13)) + bias})')
                 - select(subnormal, f"T.float32({2.0 ** -14!r})", "T.float32(0.0)"))
    signed = _Text(f'T.reinterpret("uint32", {magnitude})') | ((h & u(0x8000)) << u(16))
    return f'T.reinterpret("float32", {signed})'


def float_to_half(x: str) -> str:
    """f16 bits (uint16) of an f32 expression, rounded to nearest even as numpy does."""
    b = f'T.reinterpret("uint32", {x})'
    sign = f"T.bitwise_and(T.shift_right({b}, {_u32(16)}), {_u32(0x8000)})"
    e = f"T.bitwise_and(T.shift_right({b}, {_u32(23)}), {_u32(0xFF)})"
    m = f"T.bitwise_and({b}, {_u32(0x7FFFFF)})"

    def rne(value: str, rem: str, half: str) -> str:
        """value + 1 when the dropped bits `rem` exceed `half`, or equal it and value is odd."""
        odd = f"T.bitwise_and({value}, {_u32(1)})"
        up = f"T.Or({rem} > {half}, T.And({rem} == {half}, {odd} == {_u32(1)}))"
        return f"({value} + T.if_then_else({up}, {_u32(1)}, {_u32(0)}))"

    normal = rne(f"T.bitwise_or(T.shift_left({e} - {_u32(112)}, {_u32(10)}), T.shift_right({m}, {_u32(13)}))",
                 f"T.bitwise_and({m}, {_u32(0x1FFF)})", _u32(0x1000))
    normal = f"T.min({normal}, {_u32(0x7C00)})"
    full = f"T.bitwise_or({m}, {_u32(0x800000)})"
    shift = f"({_u32(126)} - {e})"
    sub = rne(f"T.shift_right({full}, {shift})", f"T.bitwise_and({full}, T.shift_left({_u32(1)}, {shift}) - {_u32(1)})",
              f"T.shift_left({_u32(1)}, {shift} - {_u32(1)})")
    nan = f"T.And({e} == {_u32(255)}, {m} != {_u32(0)})"
    magnitude = (f"T.if_then_else({nan}, {_u32(0x7E00)}, T.if_then_else({e} >= {_u32(143)}, {_u32(0x7C00)}, "
                 f"T.if_then_else({e} >= {_u32(113)}, {normal}, T.if_then_else({e} >= {_u32(102)}, {sub}, {_u32(0)}))))")
    return f'T.Cast("uint16", T.bitwise_or({sign}, {magnitude}))'


def q8_quant(buf: str, row: str, col: str, k: Dim) -> str:
    return f'T.Cast("float32", T.reinterpret("int8", {buf}[{q8_block(row, f"({col}) // 32", k)} + 2 + ({col}) % 32]))'


@dataclass(frozen=True)
class Param:
    name: str
    dtype: str      # TVM dtype of the flat buffer
    size: str       # element count, a size expression over n_<symbol>
    writes: bool


@dataclass(frozen=True)
class PrimKernel:
    """One PrimFunc: flat buffer params, then int params (the symbols its text uses).
    `cpu_body`, when set, is the same computation as a loop nest scheduled by hand for the
    llvm target (cpu_schedules.py); `body` stays the sblock form GPU rules and tuning take
    (a kernel only the cpu profile lowers to, such as its attention, has the nest as both).
    `noalias`: no two of the cpu_body's buffers overlap, so LLVM may keep values in
    registers across stores (false where an output may be written over an input)."""

    op: str
    params: tuple[Param, ...]
    ints: tuple[str, ...]
    body: str
    sequential: bool
    cpu_body: str = ""
    noalias: bool = True

    @property
    def name(self) -> str:
        text = f"{self.params}{self.ints}{self.sequential}{self.body}{self.cpu_body}"
        return f"tvm_{self.op}_{hashlib.sha256(text.encode()).hexdigest()[:12]}"

    def script(self, cpu: bool = False) -> str:
        """TVMScript of the PrimFunc; `cpu`: its hand-scheduled llvm form where it has one."""
        args = ", ".join([f"{p.name}_h: T.handle" for p in self.params] + [f"{n}: T.int32" for n in self.ints])
        lines = ["@T.prim_func(s_tir=True)", f"def {self.name}({args}):",
                 f'    T.func_attr({{"global_symbol": "{self.name}"}})']
        lines += [f'    {p.name} = T.match_buffer({p.name}_h, ({p.size},), "{p.dtype}")' for p in self.params]
        return "\n".join(lines) + "\n" + (self.cpu_body if cpu and self.cpu_body else self.body)


def block(grid: Sequence[tuple[str, str]], body: str, *, reduce: Sequence[tuple[str, str]] = (), init: str = "",
          regions: tuple[Sequence[Param], Sequence[Param]] | None = None, scratch: Sequence[tuple[str, int]] = ()) -> str:
    """An sblock over spatial `grid` then `reduce` axes ((var, extent) pairs); `body` and
    `init` are statements at zero indent. `regions` (reads, writes) are given explicitly
    for bodies with let bindings, where TVM cannot infer them; `scratch` are f32 local arrays."""
    axes = list(grid) or [("z_", "1")]
    axes += list(reduce)
    loops = [f"l{i}" for i in range(len(axes))]
    kinds = "S" * (len(axes) - len(reduce)) + "R" * len(reduce)
    pad = " " * 12
    out = [f"    for {', '.join(loops)} in T.grid({', '.join(e for _, e in axes)}):",
           '        with T.sblock("b"):']
    for (name, extent), loop, kind in zip(axes, loops, kinds):
        out.append(f"{pad}{name} = T.axis.{'spatial' if kind == 'S' else 'reduce'}({extent}, {loop})")
    if regions is not None:
        reads, writes = regions
        out.append(f"{pad}T.reads({', '.join(f'{p.name}[0:{p.size}]' for p in reads)})")
        out.append(f"{pad}T.writes({', '.join(f'{p.name}[0:{p.size}]' for p in writes)})")
    for name, size in scratch:
        out.append(f'{pad}{name} = T.sblock_alloc_buffer(({size},), "float32", scope="local")')
    if init:
        out.append(f"{pad}with T.init():")
        out += [pad + "    " + line for line in init.splitlines()]
    out += [pad + line for line in body.splitlines()]
    return "\n".join(out) + "\n"


def symbols_in(text: str, known: Sequence[str]) -> tuple[str, ...]:
    return tuple(n for n in known if re.search(rf"\b{n}\b", text))
