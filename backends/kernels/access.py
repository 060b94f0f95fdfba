"""Reading and writing values in kernels: raw elements of any dtype's buffer, weights as f32
in their storage type (f32, f16, bf16, Q8_0 blocks as the GGUF stores them), and the
device functions the ops share."""
from __future__ import annotations

from dflash_ir.dtypes import DType
from dflash_ir.ir import Value
from dflash_ir.types import Dim

from ..kir import F32, I64, K, call, cast, function, maximum, select
from ..kir.build import Buffer
from ..lowering import dim

# the view a raw element of each dtype is read and written as (copies keep the bits)
RAW = {DType.F32: "f32", DType.I32: "i32", DType.I64: "i64", DType.F16: "u16", DType.BF16: "u16",
       DType.Q8_0: "u8", DType.BOOL: "u8"}
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
    raise ValueError(f"{dtype} is not a weight dtype")


def _sigmoid(kb, x: K) -> K:
    """Without overflow on either side: e^-|x| is at most 1."""
    e = kb.let("e", call("exp", -call("fabs", x)))
    return select(x >= 0.0, 1.0 / (1.0 + e), e / (1.0 + e))


SIGMOID = function("sigmoid", [("x", F32)], _sigmoid)
SOFTPLUS = function("softplus", [("x", F32)],
                    lambda kb, x: maximum(x, 0.0) + call("log1p", call("exp", -call("fabs", x))))
