"""Random raw blocks of the GGUF block-quant types, for tests (there is no quantiser for most
of them here): random code bytes, with the f16 scale fields (ggml-common.h offsets, written out
here independently of dflash_ir/blocks.py) set to values the test chooses."""
from __future__ import annotations

import numpy as np

from dflash_ir.dtypes import DType

# byte offsets of each type's f16 fields (d, and dmin / m where there is one); MXFP4's one
# scale is an E8M0 byte at 0
F16_FIELDS = {
    DType.Q4_0: (0,), DType.Q4_1: (0, 2), DType.Q5_0: (0,), DType.Q5_1: (0, 2), DType.Q2_K: (80, 82),
    DType.Q3_K: (108,), DType.Q4_K: (0, 2), DType.Q5_K: (0, 2), DType.Q6_K: (208,), DType.IQ4_NL: (0,),
    DType.IQ4_XS: (0,), DType.MXFP4: (),
}


def set_scales(raw: np.ndarray, dtype: DType, scales: np.ndarray, exponents: np.ndarray) -> np.ndarray:
    """raw [n, block_bytes] with field k of block b set to scales[(b + k) % len] (so a block's d
    and dmin differ), and MXFP4's E8M0 byte to exponents, cycled."""
    n = len(raw)
    for k, at in enumerate(F16_FIELDS[dtype]):
        raw[:, at:at + 2] = np.resize(np.roll(scales.astype(np.float16), -k), n).view(np.uint8).reshape(-1, 2)
    if dtype is DType.MXFP4:
        raw[:, 0] = np.resize(exponents, n)
    return raw


def random_blocks(rng: np.random.Generator, shape: tuple[int, ...], dtype: DType) -> np.ndarray:
    """Storage (DType.numpy) of a `dtype` tensor of logical `shape` with values of order one."""
    blocks = int(np.prod(shape)) // dtype.block_size
    raw = rng.integers(0, 256, size=(blocks, dtype.block_bytes), dtype=np.uint8)
    raw = set_scales(raw, dtype, rng.standard_normal(blocks) * 0.02, rng.integers(122, 129, blocks))
    return raw.reshape(*shape[:-1], -1).view(dtype.numpy())
