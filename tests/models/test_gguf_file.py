"""GGUF reader: round trip of files written by gguf-py's GGUFWriter, and a corruption suite."""
from __future__ import annotations

import hashlib
import os
import re
import struct

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as GT
from gguf import GGUFValueType as VT

from dflash_ir.dtypes import DType
from dflash_ir.models.gguf_file import GGUFError, TensorInfo, open_gguf
from dflash_ir.quant import dequantize, quantize

DEADLINE_S = 2.0  # the `deadline` fixture's limit: validation never loops over a bogus count
_RNG = np.random.default_rng(7)
# name -> (dtype, logical numpy shape); names share one length so corruptions can swap them.
_TENSORS = {
    "w.f32": (DType.F32, (3, 5)),
    "w.f16": (DType.F16, (4, 8)),
    "w.b16": (DType.BF16, (2, 6)),
    "w.q80": (DType.Q8_0, (3, 64)),
    "w.q3d": (DType.Q8_0, (2, 3, 32)),
    "w.vec": (DType.F32, (7,)),
}
_GGML = {DType.F32: GT.F32, DType.F16: GT.F16, DType.BF16: GT.BF16, DType.Q8_0: GT.Q8_0}
_STORAGE = {name: quantize(_RNG.standard_normal(shape) * 3, dtype) for name, (dtype, shape) in _TENSORS.items()}

# key -> (GGUF value type, value, element type for arrays, value expected back)
_METADATA = {
    "test.u8": (VT.UINT8, 200, None, 200),
    "test.i8": (VT.INT8, -5, None, -5),
    "test.u16": (VT.UINT16, 60000, None, 60000),
    "test.i16": (VT.INT16, -300, None, -300),
    "test.u32": (VT.UINT32, 4_000_000_000, None, 4_000_000_000),
    "test.i32": (VT.INT32, -2_000_000_000, None, -2_000_000_000),
    "test.f32": (VT.FLOAT32, 0.1, None, float(np.float32(0.1))),
    "test.u64": (VT.UINT64, 2**63 + 5, None, 2**63 + 5),
    "test.i64": (VT.INT64, -(2**62), None, -(2**62)),
    "test.f64": (VT.FLOAT64, 0.1, None, 0.1),
    "test.yes": (VT.BOOL, True, None, True),
    "test.no": (VT.BOOL, False, None, False),
    "test.str": (VT.STRING, "héllo ✓\n", None, "héllo ✓\n"),
    "test.arr_i32": (VT.ARRAY, [1, -2, 3], None, [1, -2, 3]),
    "test.arr_u64": (VT.ARRAY, [2**64 - 1, 0], VT.UINT64, [2**64 - 1, 0]),
    "test.arr_f32": (VT.ARRAY, [0.5, -1.25, 0.1], None, [0.5, -1.25, float(np.float32(0.1))]),
    "test.arr_str": (VT.ARRAY, ["a", "", "ü€"], None, ["a", "", "ü€"]),
    "test.arr_bool": (VT.ARRAY, [True, False, True], None, [True, False, True]),
    "test.arr_u8": (VT.ARRAY, b"\x00\xff\x10", None, [0, 255, 16]),
    "test.dupA": (VT.UINT32, 1, None, 1),
    "test.dupB": (VT.UINT32, 2, None, 2),
}
_TYPE_NAMES = {
    "test.arr_i32": "ARRAY[INT32]",
    "test.arr_u64": "ARRAY[UINT64]",
    "test.arr_f32": "ARRAY[FLOAT32]",
    "test.arr_str": "ARRAY[STRING]",
    "test.arr_bool": "ARRAY[BOOL]",
    "test.arr_u8": "ARRAY[UINT8]",
}


def _write(path, alignment: int | None = None):
    writer = gguf.GGUFWriter(path, arch="testarch")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    for key, (vtype, value, sub_type, _) in _METADATA.items():
        writer.add_key_value(key, value, vtype, sub_type=sub_type)
    for name, (dtype, _) in _TENSORS.items():
        writer.add_tensor(name, _STORAGE[name], raw_dtype=_GGML[dtype])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def valid_gguf(tmp_path_factory):
    return _write(tmp_path_factory.mktemp("gguf") / "valid.gguf")


@pytest.mark.parametrize("alignment", [None, 64])
def test_round_trip(tmp_path, alignment):
    path = _write(tmp_path / "model.gguf", alignment)
    with open_gguf(str(path)) as f:
        assert f.architecture == "testarch"
        assert f.version == 3
        assert f.alignment == (alignment or 32)
        assert f.data_offset % f.alignment == 0
        for key, (vtype, _, _, expected) in _METADATA.items():
            assert f.metadata[key] == expected
            assert type(f.metadata[key]) is type(expected)
            assert f.metadata_types[key] == _TYPE_NAMES.get(key, vtype.name)
        assert list(f.tensors) == list(_TENSORS)
        for name, (dtype, shape) in _TENSORS.items():
            info = f.tensors[name]
            storage = _STORAGE[name]
            assert info == TensorInfo(name, dtype, shape, shape[::-1], info.offset, storage.nbytes)
            assert (info.offset - f.data_offset) % f.alignment == 0
            raw = f.raw(name)
            assert raw.dtype == storage.dtype and np.array_equal(raw, storage)
            assert not raw.flags.writeable
            assert np.array_equal(f.dequantize(name), dequantize(storage, dtype))


def test_matches_gguf_reader(valid_gguf):
    reader = gguf.GGUFReader(valid_gguf)
    with open_gguf(valid_gguf) as f:
        assert f.data_offset == reader.data_offset
        fields = {k: v for k, v in reader.fields.items() if not k.startswith("GGUF.")}
        assert list(f.metadata) == list(fields)
        for key, field in fields.items():
            assert f.metadata[key] == field.contents()
        assert list(f.tensors) == [t.name for t in reader.tensors]
        for t in reader.tensors:
            info = f.tensors[t.name]
            assert (info.offset, info.n_bytes, list(info.ggml_shape)) == (t.data_offset, t.n_bytes, t.shape.tolist())
            assert info.dtype.value.upper() == t.tensor_type.name
            assert np.array_equal(f.dequantize(t.name), gguf.quants.dequantize(t.data, t.tensor_type))


def test_rows_of_a_q8_0_table(valid_gguf):
    with open_gguf(valid_gguf) as f:
        rows = f.raw("w.q80")[[2, 0]]
        assert np.array_equal(dequantize(rows, DType.Q8_0), f.dequantize("w.q80")[[2, 0]])


def test_get_sha256_and_close(valid_gguf):
    f = open_gguf(valid_gguf)
    assert f.get("test.u8") == 200
    assert f.get("test.absent", None) is None
    with pytest.raises(GGUFError, match=rf"^{re.escape(str(valid_gguf))}: missing metadata key 'test.absent'"):
        f.get("test.absent")
    with pytest.raises(GGUFError, match="no tensor named 'nope'"):
        f.raw("nope")
    assert f.sha256() == hashlib.sha256(valid_gguf.read_bytes()).hexdigest()
    kept = f.raw("w.f32")
    f.close()
    f.close()
    assert np.array_equal(kept, _STORAGE["w.f32"])  # views outlive close()
    with pytest.raises(GGUFError, match="closed"):
        f.raw("w.f32")


# --- corruption suite -------------------------------------------------------------------------


class _Layout:
    """Byte positions of fields in a valid file, found from the format and gguf-py's reader."""

    def __init__(self, path):
        self.blob = path.read_bytes()
        self.reader = gguf.GGUFReader(path)

    def key(self, key: str) -> int:
        """Offset of the key's u64 length; its type follows the key bytes."""
        return self.blob.index(struct.pack("<Q", len(key)) + key.encode())

    def key_type(self, key: str) -> int:
        return self.key(key) + 8 + len(key)

    def value(self, key: str) -> int:
        return self.key_type(key) + 4

    def tensor_info(self, name: str) -> int:
        """Offset of n_dims, right after the tensor's name."""
        return self.blob.rindex(struct.pack("<Q", len(name)) + name.encode()) + 8 + len(name)

    def tensor_field(self, name: str, field: str) -> int:
        pos = self.tensor_info(name)
        n_dims = struct.unpack_from("<I", self.blob, pos)[0]
        return {"n_dims": pos, "ne0": pos + 4, "type": pos + 4 + 8 * n_dims, "offset": pos + 8 + 8 * n_dims}[field]

    def offset_in_data(self, name: str) -> int:
        return struct.unpack_from("<Q", self.blob, self.tensor_field(name, "offset"))[0]

    def data_end(self, name: str) -> int:
        tensor = next(t for t in self.reader.tensors if t.name == name)
        return tensor.data_offset + tensor.n_bytes


def _patch(blob: bytes, pos: int, fmt: str, value) -> bytes:
    packed = struct.pack(fmt, value)
    return blob[:pos] + packed + blob[pos + len(packed):]


def _put(blob: bytes, pos: int, data: bytes) -> bytes:
    return blob[:pos] + data + blob[pos + len(data):]


# case -> (corruption of the valid file's bytes, phrase the error must contain)
_CORRUPTIONS = {
    "bad_magic": (lambda L: _put(L.blob, 0, b"GGUX"), r"bad magic b'GGUX'"),
    "version_99": (lambda L: _patch(L.blob, 4, "<I", 99), r"unsupported GGUF version 99"),
    "big_endian": (lambda L: _patch(L.blob, 4, ">I", 3), r"big-endian"),
    "shorter_than_magic": (lambda L: L.blob[:2], r"truncated or corrupt: magic needs 4 bytes"),
    "truncated_header": (lambda L: L.blob[:14], r"truncated or corrupt: tensor count needs 8 bytes at offset 8"),
    "truncated_metadata": (
        lambda L: L.blob[: L.value("test.str") + 11],
        r"truncated or corrupt: value of metadata key 'test\.str' needs 11 bytes",
    ),
    "truncated_tensor_infos": (
        lambda L: L.blob[: L.tensor_info("w.q80") + 2],
        r"truncated or corrupt: n_dims of tensor 'w\.q80'",
    ),
    "truncated_data": (lambda L: L.blob[: L.data_end("w.vec") - 1], r"tensor 'w\.vec' data .* runs past the end"),
    "string_length_2^62": (
        lambda L: _patch(L.blob, 24, "<Q", 2**62),
        r"metadata key #0 needs 4611686018427387904 bytes at offset 32",
    ),
    "tensor_count_huge": (lambda L: _patch(L.blob, 8, "<Q", 2**60), r"declares 1152921504606846976 tensors"),
    "kv_count_huge": (lambda L: _patch(L.blob, 16, "<Q", 2**61), r"declares 2305843009213693952 metadata entries"),
    "array_length_huge": (
        lambda L: _patch(L.blob, L.value("test.arr_i32") + 4, "<Q", 2**62),
        r"4611686018427387904 elements of metadata array 'test\.arr_i32' needs 18446744073709551616 bytes",
    ),
    "string_array_length_huge": (
        lambda L: _patch(L.blob, L.value("test.arr_str") + 4, "<Q", 2**62),
        r"4611686018427387904 elements of metadata array 'test\.arr_str'",
    ),
    "string_in_array_too_long": (
        lambda L: _patch(L.blob, L.value("test.arr_str") + 12, "<Q", 2**40),
        r"elements of metadata array 'test\.arr_str' needs 1099511627776 bytes",
    ),
    "unknown_value_type": (
        lambda L: _patch(L.blob, L.key_type("test.u16"), "<I", 13),
        r"'test\.u16' has unknown value type 13",
    ),
    "nested_array": (lambda L: _patch(L.blob, L.value("test.arr_i32"), "<I", 9), r"'test\.arr_i32': nested arrays"),
    "bad_array_element_type": (
        lambda L: _patch(L.blob, L.value("test.arr_i32"), "<I", 77),
        r"'test\.arr_i32' has unknown element type 77",
    ),
    "key_not_utf8": (lambda L: _put(L.blob, L.key("test.u8") + 8, b"\xff"), r"metadata key #\d+ is not valid UTF-8"),
    "duplicate_key": (
        lambda L: _put(L.blob, L.key("test.dupB") + 8, b"test.dupA"),
        r"duplicate metadata key 'test\.dupA'",
    ),
    "alignment_not_power_of_two": (
        lambda L: _patch(L.blob, L.value("general.alignment"), "<I", 48),
        r"general\.alignment must be a non-zero power of two, got 48",
    ),
    "alignment_wrong_type": (
        lambda L: _patch(L.blob, L.key_type("general.alignment"), "<I", 5),
        r"general\.alignment must be UINT32, got INT32",
    ),
    "offset_past_eof": (
        lambda L: _patch(L.blob, L.tensor_field("w.f16", "offset"), "<Q", 2**40),
        r"tensor 'w\.f16' data .* runs past the end of the file",
    ),
    "unknown_tensor_type": (
        lambda L: _patch(L.blob, L.tensor_field("w.f16", "type"), "<I", 200),
        r"tensor 'w\.f16': GGML type unknown type id 200 is not supported",
    ),
    "unsupported_tensor_type": (
        lambda L: _patch(L.blob, L.tensor_field("w.f16", "type"), "<I", 16),
        r"tensor 'w\.f16': GGML type IQ2_XXS is not supported \(supported: F32, F16, Q4_0, .*Q4_K, .*MXFP4\)",
    ),
    "duplicate_tensor_name": (
        lambda L: _put(L.blob, L.tensor_info("w.f16") - 5, b"w.f32"),
        r"duplicate tensor name 'w\.f32'",
    ),
    "misaligned_offset": (
        lambda L: _patch(L.blob, L.tensor_field("w.f16", "offset"), "<Q", 4 + L.offset_in_data("w.f16")),
        r"tensor 'w\.f16' data offset \d+ is misaligned \(not a multiple of 32\)",
    ),
    "overlapping_tensors": (
        lambda L: _patch(L.blob, L.tensor_field("w.f16", "offset"), "<Q", 0),
        r"tensor 'w\.f16' data starts at data-section offset 0, but tensor 'w\.f32' before it \(F32 \[3, 5\], "
        r"60 bytes\) ends at 64",
    ),
    "f32_relabelled_f16": (  # llama.cpp refuses the next tensor's offset the same way
        lambda L: _patch(L.blob, L.tensor_field("w.f32", "type"), "<I", 1),
        r"tensor 'w\.f16' data starts at data-section offset 64, but tensor 'w\.f32' before it \(F16 \[3, 5\], "
        r"30 bytes\) ends at 32: .*F32 data labelled F16",
    ),
    "trailing_bytes": (lambda L: L.blob + bytes(64), r"64 bytes follow the data of the last tensor 'w\.vec'"),
    "q8_0_row_not_multiple_of_32": (
        lambda L: _patch(L.blob, L.tensor_field("w.q80", "ne0"), "<q", 48),
        r"tensor 'w\.q80': shape/size mismatch: .*multiple of 32",
    ),
    "negative_dimension": (
        lambda L: _patch(L.blob, L.tensor_field("w.q80", "ne0"), "<q", -64),
        r"tensor 'w\.q80' has a negative dimension",
    ),
    "too_many_dimensions": (
        lambda L: _patch(L.blob, L.tensor_field("w.q80", "n_dims"), "<I", 5),
        r"tensor 'w\.q80' has 5 dimensions",
    ),
}


@pytest.fixture(scope="module")
def layout(tmp_path_factory):
    return _Layout(_write(tmp_path_factory.mktemp("base") / "base.gguf", alignment=32))


@pytest.mark.parametrize("case", list(_CORRUPTIONS))
def test_corrupt_file_raises_one_clear_error(case, layout, tmp_path, deadline):
    corrupt, phrase = _CORRUPTIONS[case]
    path = tmp_path / f"{case}.gguf"
    path.write_bytes(corrupt(layout))
    with pytest.raises(GGUFError, match=rf"^{re.escape(str(path))}: .*(?:{phrase})"):
        open_gguf(path)


def test_empty_missing_and_directory(tmp_path, deadline):
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(GGUFError, match=rf"^{re.escape(str(empty))}: empty file"):
        open_gguf(empty)
    missing = tmp_path / "missing.gguf"
    with pytest.raises(GGUFError, match=rf"^{re.escape(str(missing))}: file not found"):
        open_gguf(str(missing))
    with pytest.raises(GGUFError, match=rf"^{re.escape(str(tmp_path))}: a directory, not a GGUF file"):
        open_gguf(tmp_path)


def test_a_named_pipe_is_refused_without_waiting_for_a_writer(tmp_path, deadline):
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    with pytest.raises(GGUFError, match=rf"^{re.escape(str(fifo))}: a named pipe, not a GGUF file"):
        open_gguf(fifo)


def _one_tensor_file(path, data: np.ndarray):
    writer = gguf.GGUFWriter(path, arch="testarch")
    writer.add_tensor("w", data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_last_tensor_relabelled_leaves_its_surplus_bytes_named(tmp_path):
    path = _one_tensor_file(tmp_path / "last.gguf", np.ones((64, 64), np.float32))
    layout = _Layout(path)
    path.write_bytes(_patch(layout.blob, layout.tensor_field("w", "type"), "<I", 30))  # F32 -> BF16
    with pytest.raises(GGUFError, match=r"8192 bytes follow the data of the last tensor 'w' \(BF16 \[64, 64\], "
                                        r"8192 bytes\): .*F32 data labelled F16"):
        open_gguf(path)


def test_trailing_unit_dims_are_dropped_as_ggml_n_dims_does(tmp_path):
    """ne = [192, 64, 1, 1] is a 64 x 192 matrix; ggml_shape keeps what the file says."""
    data = _RNG.standard_normal((1, 1, 64, 192)).astype(np.float32)
    with open_gguf(_one_tensor_file(tmp_path / "unit.gguf", data)) as f:
        info = f.tensors["w"]
        assert (info.shape, info.ggml_shape) == ((64, 192), (192, 64, 1, 1))
        np.testing.assert_array_equal(f.raw("w"), data[0, 0])
