"""Element types of the IR, including GGUF block-quantised types.

A block type stores `block_size` logical elements in `block_bytes` bytes along the
innermost dimension; its storage in numpy is bytes with the innermost dim replaced by
`K // block_size * block_bytes`: uint8 for Q8_0, and for every other block type a one-byte
structured dtype named after it, so a storage array says which layout its bytes are in
(the op references see only arrays). How each layout decodes is dflash_ir/blocks.py.
"""
from __future__ import annotations

import enum

import numpy as np


class DType(enum.Enum):
    F32 = "f32"
    F16 = "f16"
    BF16 = "bf16"
    Q8_0 = "q8_0"
    Q4_0 = "q4_0"
    Q4_1 = "q4_1"
    Q5_0 = "q5_0"
    Q5_1 = "q5_1"
    Q2_K = "q2_k"
    Q3_K = "q3_k"
    Q4_K = "q4_k"
    Q5_K = "q5_k"
    Q6_K = "q6_k"
    IQ4_NL = "iq4_nl"
    IQ4_XS = "iq4_xs"
    MXFP4 = "mxfp4"
    I32 = "i32"
    I64 = "i64"
    BOOL = "bool"

    @property
    def is_block(self) -> bool:
        return self in _BLOCKS

    @property
    def block_size(self) -> int:
        return _BLOCKS[self][0] if self.is_block else 1

    @property
    def block_bytes(self) -> int:
        return _BLOCKS[self][1] if self.is_block else self.itemsize

    @property
    def itemsize(self) -> int:
        if self.is_block:
            raise ValueError(f"{self.value} is a block type: use block_bytes / block_size")
        return _ITEMSIZE[self]

    @property
    def is_float(self) -> bool:
        return self in (DType.F32, DType.F16, DType.BF16) or self.is_block

    def storage_bytes(self, n_elements: int) -> int:
        """Bytes needed to store `n_elements` logical elements."""
        if self.is_block:
            if n_elements % self.block_size:
                raise ValueError(f"{self.value} needs a multiple of {self.block_size} elements, got {n_elements}")
            return n_elements // self.block_size * self.block_bytes
        return n_elements * self.itemsize

    def numpy(self) -> np.dtype:
        """numpy dtype holding values of this type (uint16 bits for bf16; bytes for block types:
        uint8 for Q8_0, a one-byte structured dtype named after the type for the others)."""
        return _NUMPY[self]

    @classmethod
    def parse(cls, text: str) -> "DType":
        try:
            return cls(text)
        except ValueError:
            raise ValueError(f"unknown dtype {text!r}; known: {', '.join(d.value for d in cls)}") from None

    def __repr__(self) -> str:
        return self.value

    __str__ = __repr__


# (elements, bytes) of a block: ggml's QK and sizeof(block_*)
_BLOCKS = {
    DType.Q8_0: (32, 34), DType.Q4_0: (32, 18), DType.Q4_1: (32, 20), DType.Q5_0: (32, 22),
    DType.Q5_1: (32, 24), DType.Q2_K: (256, 84), DType.Q3_K: (256, 110), DType.Q4_K: (256, 144),
    DType.Q5_K: (256, 176), DType.Q6_K: (256, 210), DType.IQ4_NL: (32, 18), DType.IQ4_XS: (256, 136),
    DType.MXFP4: (32, 17),
}
_ITEMSIZE = {DType.F32: 4, DType.F16: 2, DType.BF16: 2, DType.I32: 4, DType.I64: 8, DType.BOOL: 1}
_NUMPY = {
    DType.F32: np.dtype(np.float32),
    DType.F16: np.dtype(np.float16),
    DType.BF16: np.dtype(np.uint16),
    DType.Q8_0: np.dtype(np.uint8),
    DType.I32: np.dtype(np.int32),
    DType.I64: np.dtype(np.int64),
    DType.BOOL: np.dtype(np.bool_),
} | {d: np.dtype([(d.value, np.uint8)]) for d in _BLOCKS if d is not DType.Q8_0}

# GGML type ids (ggml.h `enum ggml_type`) of the types we support.
GGML_TYPE_IDS = {
    0: DType.F32, 1: DType.F16, 2: DType.Q4_0, 3: DType.Q4_1, 6: DType.Q5_0, 7: DType.Q5_1, 8: DType.Q8_0,
    10: DType.Q2_K, 11: DType.Q3_K, 12: DType.Q4_K, 13: DType.Q5_K, 14: DType.Q6_K, 20: DType.IQ4_NL,
    23: DType.IQ4_XS, 26: DType.I32, 27: DType.I64, 30: DType.BF16, 39: DType.MXFP4,
}


def from_ggml_type(type_id: int, *, what: str = "tensor") -> DType:
    """Map a GGML type id to a DType, or raise naming the unsupported type."""
    if type_id in GGML_TYPE_IDS:
        return GGML_TYPE_IDS[type_id]
    try:
        import gguf

        name = gguf.GGMLQuantizationType(type_id).name
    except Exception:  # unknown even to gguf
        name = f"unknown type id {type_id}"
    supported = ", ".join(d.value.upper() for d in GGML_TYPE_IDS.values())
    raise ValueError(f"{what}: GGML type {name} is not supported (supported: {supported})")
