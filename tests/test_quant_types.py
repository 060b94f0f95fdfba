"""The block-quant types (dflash_ir/blocks.py decoders, quant.dequantize) against gguf-py's
independent dequantisation, bit for bit, and the GGUF reader on files holding them."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as GT
from gguf import quants as ref

from dflash_ir.blocks import DECODERS
from dflash_ir.dtypes import GGML_TYPE_IDS, DType
from dflash_ir.models.gguf_file import open_gguf
from dflash_ir.ops.linalg import as_f32, storage_dtype
from dflash_ir.quant import dequantize, quantize, storage_shape
from quant_blocks import set_scales

TYPES = list(DECODERS)
# finite f16 scales worth hitting: zero, negative zero, subnormals, the extremes, ordinary values
SCALES = np.array([0.0, -0.0, 2.0**-24, -(2.0**-24), 2.0**-15 * 3, 2.0**-14, 65504.0, -65504.0, 1.0, -0.0123,
                   0.5, 7.25], np.float16)
E8M0 = np.array([0, 1, 2, 3, 126, 127, 128, 200, 254], np.uint8)


def _blocks(dtype: DType, seed: int = 0) -> np.ndarray:
    """Raw blocks [n, block_bytes]: random bytes, all-zero and all-one code bytes (min and max
    codes and sub-block scales), with every scale field set to each of SCALES (E8M0 values)."""
    rng = np.random.default_rng(seed)
    n = 3 * len(SCALES)
    raw = rng.integers(0, 256, size=(n, dtype.block_bytes), dtype=np.uint8)
    raw[n // 3: 2 * n // 3] = 0x00
    raw[2 * n // 3:] = 0xFF
    return set_scales(raw, dtype, SCALES, E8M0)


def _gguf_values(raw: np.ndarray, dtype: DType) -> np.ndarray:
    with np.errstate(over="ignore"):  # MXFP4's largest exponent times 12 is inf in gguf-py as in ggml
        return ref.dequantize(raw, GT[dtype.name])


def test_every_type_has_its_ggml_id_and_size():
    for type_id, dtype in GGML_TYPE_IDS.items():
        assert GT(type_id).name == dtype.name
        if dtype.is_block:
            assert gguf.GGML_QUANT_SIZES[GT(type_id)] == (dtype.block_size, dtype.block_bytes)
    assert set(TYPES) == {d for d in GGML_TYPE_IDS.values() if d.is_block} - {DType.Q8_0}


@pytest.mark.parametrize("dtype", TYPES, ids=str)
def test_dequantize_equals_gguf_bit_for_bit(dtype):
    raw = _blocks(dtype)
    expected = _gguf_values(raw, dtype)
    assert not np.isnan(expected).any()
    got = dequantize(raw.reshape(-1).view(dtype.numpy()), dtype)
    assert got.dtype == np.float32 and got.flags.writeable and got.shape == (raw.size // dtype.block_bytes * dtype.block_size,)
    assert np.array_equal(got.view(np.uint32), expected.reshape(-1).view(np.uint32))
    negative_zero = np.signbit(expected) & (expected == 0)
    # E8M0 scales are positive; d * q + m is -0 only where m is -0 as well
    assert negative_zero.any() == (dtype not in (DType.MXFP4, DType.Q4_1, DType.Q5_1))


@pytest.mark.parametrize("dtype", TYPES, ids=str)
def test_rows_of_blocks_keep_their_layout(dtype):
    """Storage [rows, K / block * bytes]: any row selection decodes as those rows."""
    raw = _blocks(dtype, seed=1)[:6].reshape(3, 2 * dtype.block_bytes)
    storage = raw.view(dtype.numpy())
    assert storage.shape == storage_shape((3, 2 * dtype.block_size), dtype)
    assert storage_dtype(storage) is dtype
    rows = as_f32(storage[[2, 0]])
    assert np.array_equal(rows.view(np.uint32), _gguf_values(raw[[2, 0]], dtype).view(np.uint32))


def test_quantising_to_a_block_type_names_the_tool_that_does():
    with pytest.raises(ValueError, match=r"cannot quantize to q4_k here: llama.cpp's llama-quantize makes such files"):
        quantize(np.zeros((2, 256), np.float32), DType.Q4_K)


def test_a_storage_array_of_the_wrong_type_is_refused():
    raw = _blocks(DType.Q4_K)[:1]
    with pytest.raises(ValueError, match=r"q4_1 storage must have numpy dtype"):
        dequantize(raw.view(DType.Q4_K.numpy()), DType.Q4_1)
    with pytest.raises(ValueError, match=r"q4_k storage needs a last dimension that is a multiple of 144 bytes"):
        dequantize(raw[:, :100].view(DType.Q4_K.numpy()), DType.Q4_K)


def test_gguf_file_of_every_type_reads_as_gguf_reads_it(tmp_path):
    path = tmp_path / "types.gguf"
    writer = gguf.GGUFWriter(path, arch="testarch")
    raws = {}
    for dtype in TYPES:
        raws[dtype] = _blocks(dtype)[:4].reshape(2, 2 * dtype.block_bytes)
        writer.add_tensor(f"w.{dtype}", raws[dtype], raw_dtype=GT[dtype.name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with open_gguf(str(path)) as f:
        for dtype, raw in raws.items():
            info = f.tensors[f"w.{dtype}"]
            assert (info.dtype, info.shape) == (dtype, (2, 2 * dtype.block_size))
            assert np.array_equal(f.raw(info.name).view(np.uint8), raw)
            assert np.array_equal(f.dequantize(info.name).view(np.uint32), _gguf_values(raw, dtype).view(np.uint32))


def test_a_tensor_of_an_unsupported_type_names_file_tensor_type_and_the_supported_list(tmp_path):
    path = tmp_path / "iq2.gguf"
    writer = gguf.GGUFWriter(path, arch="testarch")
    writer.add_tensor("blk.0.ffn_down.weight", np.zeros((2, 66), np.uint8), raw_dtype=GT.IQ2_XXS)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    supported = ", ".join(d.name for d in GGML_TYPE_IDS.values())
    with pytest.raises(ValueError) as e:
        open_gguf(str(path))
    assert str(e.value) == (f"{path}: tensor 'blk.0.ffn_down.weight': GGML type IQ2_XXS is not supported "
                            f"(supported: {supported})")
