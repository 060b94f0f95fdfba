"""Reading and writing values in kernels: raw elements of any dtype's buffer, weights as f32
in their storage type (f32, f16, bf16, Q8_0 and the other block types as the GGUF stores
them: a block type's value is its decoder from dflash_ir/blocks.py, read through
`_BlockLoads`), and the device functions the ops share."""
from __future__ import annotations

from dflash_ir import activations
from dflash_ir.blocks import DECODERS
from dflash_ir.dtypes import DType
from dflash_ir.quant import COLS, Dp4Words
from dflash_ir.ir import Value
from dflash_ir.types import Dim

from ..kir import F32, I32, I64, K, bitcast, call, call_function, cast, function, maximum, minimum, select
from ..kir.build import Buffer
from ..kir.ir import Function
from ..lowering import dim

# the view a raw element of each dtype is read and written as (copies keep the bits)
RAW = {DType.F32: "f32", DType.I32: "i32", DType.I64: "i64", DType.F16: "u16", DType.BF16: "u16",
       DType.BOOL: "u8"} | {d: "u8" for d in DType if d.is_block}
_WEIGHT_VIEW = {DType.F32: "f32", DType.F16: "f16", DType.BF16: "bf16"}
Q8_BLOCK = 34  # a Q8_0 block: f16 scale d, then 32 int8 quants


def read(v: Value, buf: Buffer, index: K) -> K:
    """Element `index` of `v`'s buffer, as stored (narrow elements as ints)."""
    return buf.load(index, RAW[v.type.dtype])


def write(v: Value, buf: Buffer, index: K, value: K) -> None:
    buf.store(index, value, RAW[v.type.dtype])


def q8_row_bytes(k: Dim) -> K:
    return dim(k) / 32 * Q8_BLOCK


def weight_at(dtype: DType, buf: Buffer, row: K, col: K, k: Dim) -> K:
    """f32 value of element (row, col) of a weight stored as `dtype` with rows of k."""
    if dtype in _WEIGHT_VIEW:
        return buf.load(cast(I64, row) * dim(k) + col, _WEIGHT_VIEW[dtype])
    if dtype is DType.Q8_0:
        block = cast(I64, row) * q8_row_bytes(k) + (col >> 5) * Q8_BLOCK
        return buf.load(block / 2, "f16") * cast(F32, buf.load(block + 2 + (col & 31), "i8"))
    if dtype in DECODERS:
        return DECODERS[dtype].value(_BlockLoads(buf, _block_byte(dtype, row, col, k)), col & (dtype.block_size - 1))
    raise ValueError(f"{dtype} is not a weight dtype")


def weight_chunk(kb, dtype: DType, buf: Buffer, row: K, c: K, k: Dim, out, name: str) -> None:
    """Elements c .. c+31 (c a multiple of 32) of row `row` of a weight of block type `dtype`
    into out[0..32): each sub-block's scale and offset decoded once, then only the codes per
    element (`name` prefixes the variables, unique per call in a scope)."""
    fmt = DECODERS[dtype]
    r = _BlockLoads(buf, kb.let(f"{name}blk", _block_byte(dtype, row, c, k)))
    first = kb.let(f"{name}i0", c & (dtype.block_size - 1))
    for s in range(32 // fmt.sub):
        sub = kb.let(f"{name}j{s}", (first >> (fmt.sub.bit_length() - 1)) + s)
        scale = kb.let(f"{name}sc{s}", fmt.scale(r, sub))
        offset = kb.let(f"{name}of{s}", fmt.offset(r, sub)) if fmt.offset else None
        with kb.loop("e", 0, fmt.sub) as e:
            value = scale * fmt.code(r, first + s * fmt.sub + e)
            out[s * fmt.sub + e] = value if offset is None else value + offset


def _block_byte(dtype: DType, row: K, col: K, k: Dim) -> K:
    """Byte offset of the block holding element (row, col) of a weight with rows of k."""
    size, nbytes = dtype.block_size, dtype.block_bytes
    return cast(I64, row) * (dim(k) / size * nbytes) + (col >> (size.bit_length() - 1)) * nbytes


class _BlockLoads:
    """The block decoders' reader (dflash_ir/blocks.py) in a kernel: loads from the block at
    byte `block` of a u8 buffer. Block types with f16 fields have an even block size, so an
    f16 is a u16-aligned load."""

    def __init__(self, buf: Buffer, block: K):
        self.buf, self.block = buf, block

    def u8(self, byte) -> K:
        return self.buf.load(self.block + byte, "u8")

    def f16(self, byte: int) -> K:
        return self.buf.load((self.block + byte) / 2, "f16")

    @staticmethod
    def f32(x) -> K:
        return cast(F32, x)

    @staticmethod
    def f32_bits(x: K) -> K:
        return bitcast(F32, cast(I32, x))

    @staticmethod
    def select(cond: K, a, b) -> K:
        return select(cond, a, b)

    @staticmethod
    def table(name: str, values, index: K) -> K:
        return call_function(_table(name, tuple(values)), index)


class Cols16Loads(_BlockLoads):
    """The block decoders' reader over 16 outputs at once: block `word` (a u16 index) of a
    quant.pack_blocks_cols16 pack, where each 16-bit word of the block is 16 rows' words side
    by side. Every read is a 16-wide vector (one lane per output), every byte index a scalar
    (the decoders address bytes by element and sub-block only), so the decoder's arithmetic
    runs lane-wise, unchanged."""

    def _word(self, byte) -> K:
        return self.block + (byte >> 1) * COLS

    def u8(self, byte) -> K:
        word = self.buf.load(self._word(byte), "u16", COLS)
        return (word >> ((byte & 1) * 8)) & 255

    def f16(self, byte: int) -> K:
        return self.buf.load(self._word(byte), "f16", COLS)

    @staticmethod
    def f32(x) -> K:
        return cast(F32.vec(COLS), x)

    @staticmethod
    def f32_bits(x: K) -> K:
        return bitcast(F32.vec(COLS), cast(I32.vec(COLS), x))

    @staticmethod
    def table(name: str, values, index: K) -> K:
        raise NotImplementedError("codebook types have no 16-lane table lookup: they take the rowwise kernel")


class Dp4Loads(Cols16Loads):
    """Cols16Loads over a quant.pack_blocks_cols16_dp4 pack of a block of `nbytes` whose words
    `words` (quant.Dp4Words) describes: the block's fields as there, every other byte from the
    32-bit words side by side after the fields. The decoders of those types read bytes of
    the fields and of the words in the block's order; with an `order` (the tail packed first),
    bytes of the fields only."""

    def __init__(self, buf, block: K, words: Dp4Words, nbytes: int):
        super().__init__(buf, block)
        self.layout, self.nbytes, self.tail_at = words, nbytes, nbytes - words.tail

    def word(self, i) -> K:
        """The pack block's 32-bit word i, 16 lanes."""
        return self.buf.load(self.block / 2 + self.layout.fields_first * COLS // 4 + i * COLS, "i32", COLS)

    def f16(self, byte: int) -> K:
        assert byte < self.layout.head or byte >= self.tail_at, f"byte {byte} is not in an f16 field"
        return super().f16(self.layout.field_byte(byte, self.nbytes))

    def u8(self, byte) -> K:
        if self.layout.order:
            assert not isinstance(byte, int) or byte >= self.tail_at, f"byte {byte} is not in the tail's fields"
            return super().u8(self.layout.field_byte(byte, self.nbytes))
        assert not isinstance(byte, int) or byte >= self.layout.head, f"byte {byte} is in the f16 head"
        return self.layout.word_byte(self.word, byte)


def _table(name: str, values: tuple) -> Function:
    """A device function returning entry q of a constant table (one per codebook)."""
    return function(f"{name}_value", [("q", I32)],
                    lambda kb, q: kb.array("values", F32, len(values), init=[float(v) for v in values])[q])


class _KernelMath(activations.Math):
    """dflash_ir/activations.py's math in a kernel. Without a builder (`KERNEL`) an expression
    of scalars: sigmoid and softplus are calls of their one device function each (every
    module's header holds them all, CUDA's too). With one (`inline`), written out with its
    temporaries as statements: device functions take scalars, so vectors take this form."""

    def __init__(self, kb=None, name: str = "e"):
        self.kb, self.name = kb, name

    exp, fabs, log1p, sqrt = (staticmethod(lambda x, f=f: call(f, x)) for f in ("exp", "fabs", "log1p", "sqrt"))
    maximum, minimum, select = staticmethod(maximum), staticmethod(minimum), staticmethod(select)

    @staticmethod
    def equal(a: K, b: K) -> K:
        return a.eq(b)

    @staticmethod
    def either(a: K, b: K) -> K:
        return a | b

    @staticmethod
    def both(a: K, b: K) -> K:
        return a & b

    def let(self, x: K) -> K:
        return self.kb.let(self.name, x) if self.kb is not None else x

    def sigmoid(self, x: K) -> K:
        return super().sigmoid(x) if self.kb is not None else call_function(SIGMOID, x)

    def softplus(self, x: K) -> K:
        return super().softplus(x) if self.kb is not None else call_function(SOFTPLUS, x)


KERNEL = _KernelMath()


def inline(kb, name: str) -> _KernelMath:
    """The math written out in kb, its temporaries named `name` (unique per use in a scope)."""
    return _KernelMath(kb, name)


SIGMOID = function("sigmoid", [("x", F32)], lambda kb, x: activations.sigmoid(inline(kb, "e"), x))
SOFTPLUS = function("softplus", [("x", F32)], lambda kb, x: activations.softplus(inline(kb, "e"), x))
