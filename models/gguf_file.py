"""Validated, memory-mapped access to GGUF files.

The whole header is checked against the file before anything is trusted, so a malformed or
hostile file fails fast with one `GGUFError` that names the file and the problem, instead of a
numpy/struct traceback, a huge allocation or a loop over a bogus count. Only regular files are
opened (a named pipe would block the reader). Tensor data must be laid out as llama.cpp's
gguf.cpp requires, each tensor at the padded end of the one declared before it, and end
where the file ends: a tensor whose type or shape does not match its bytes (F32 data
labelled F16) is refused. Shapes drop trailing ggml dims of 1 (ne [192, 4096, 1, 1] is a
192 x 4096 matrix, as ggml_n_dims counts it). Tensor data is never copied: `raw` returns
read-only views of the mapping.

gguf-py's `GGUFReader` is not used here: it builds numpy views per string and takes ~20 s on
the header of a file with a 248k-token vocabulary, and it trusts declared lengths and counts.
It remains the oracle in the tests.
"""
from __future__ import annotations

import math
import mmap
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dflash_ir import quant
from dflash_ir.hashing import sha256_file
from dflash_ir.dtypes import DType, from_ggml_type

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS

_STRING, _ARRAY, _BOOL = 8, 9, 7
# GGUF metadata value types with a fixed size: id -> (name, little-endian numpy dtype).
_SCALAR_TYPES = {
    0: ("UINT8", np.dtype("<u1")),
    1: ("INT8", np.dtype("<i1")),
    2: ("UINT16", np.dtype("<u2")),
    3: ("INT16", np.dtype("<i2")),
    4: ("UINT32", np.dtype("<u4")),
    5: ("INT32", np.dtype("<i4")),
    6: ("FLOAT32", np.dtype("<f4")),
    7: ("BOOL", np.dtype("<u1")),
    10: ("UINT64", np.dtype("<u8")),
    11: ("INT64", np.dtype("<i8")),
    12: ("FLOAT64", np.dtype("<f8")),
}
_LEN_BYTES = 8  # every string starts with a u64 length
# Smallest possible encodings, used to reject absurd counts before looping over them.
_MIN_KV_BYTES = _LEN_BYTES + 4 + 1
_MIN_TENSOR_INFO_BYTES = _LEN_BYTES + 4 + 4 + 8
_U64 = struct.Struct("<Q")

_REQUIRED = object()


class GGUFError(ValueError):
    """A GGUF file is missing, malformed or unsupported; the message starts with its path."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF file. `shape` is numpy/PyTorch order, `ggml_shape` is ggml `ne` order."""

    name: str
    dtype: DType
    shape: tuple[int, ...]
    ggml_shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    n_bytes: int

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)

    @property
    def storage_shape(self) -> tuple[int, ...]:
        return quant.storage_shape(self.shape, self.dtype)


class GGUFFile:
    """An open GGUF file: metadata as plain Python values, tensors as memory-mapped views."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self._sha256: str | None = None
        self._mm: mmap.mmap | None = _map(self.path)
        try:
            header = _Parser(self._mm, self.path).parse()
        except GGUFError:
            self.close()
            raise
        except (struct.error, ValueError, IndexError, OverflowError, TypeError) as e:  # safety net: a parser bug
            self.close()
            raise _error(self.path, f"malformed GGUF ({type(e).__name__}: {e})") from e
        self.version: int = header.version
        self.alignment: int = header.alignment
        self.data_offset: int = header.data_offset
        self.size_bytes: int = len(self._mm)
        self.metadata: dict[str, Any] = header.metadata
        self.metadata_types: dict[str, str] = header.metadata_types
        self.tensors: dict[str, TensorInfo] = header.tensors

    @property
    def architecture(self) -> str:
        return self.get("general.architecture")

    def get(self, key: str, default: Any = _REQUIRED) -> Any:
        """Metadata value of `key`; without a default a missing key is an error naming it."""
        if key in self.metadata:
            return self.metadata[key]
        if default is _REQUIRED:
            raise _error(self.path, f"missing metadata key {key!r}")
        return default

    def tensor(self, name: str) -> TensorInfo:
        """Info of tensor `name`; an unknown name is an error naming it."""
        if name not in self.tensors:
            raise _error(self.path, f"no tensor named {name!r}")
        return self.tensors[name]

    def raw(self, name: str) -> np.ndarray:
        """Read-only storage view of tensor `name` (conventions in `dflash_ir.quant`)."""
        info = self.tensor(name)
        if self._mm is None:
            raise _error(self.path, f"cannot read tensor {name!r}: the file is closed")
        shape = info.storage_shape
        dtype = info.dtype.numpy().newbyteorder("<")
        return np.frombuffer(self._mm, dtype=dtype, count=math.prod(shape), offset=info.offset).reshape(shape)

    def release(self, view: np.ndarray) -> None:
        """Drop the pages under `view` (an array `raw` returned, or a part of one) from this
        process's memory. A backend that has copied them to its device calls this so a model
        is not held twice, as the mapped file and as the device's copy: the pages stay in the
        kernel's page cache (reclaimable, not the process's) and are read from the file again
        if the view is used again."""
        if self._mm is None or view.nbytes == 0:
            return
        base = np.frombuffer(self._mm, np.uint8, count=1).ctypes.data
        start = view.ctypes.data - base
        if not 0 <= start <= start + view.nbytes <= len(self._mm):
            raise ValueError(f"{self.path}: release() was given an array that is not a view of this file")
        page = mmap.PAGESIZE  # whole pages: the ones shared with a neighbour are read again if needed
        first, end = start // page * page, min(-(-(start + view.nbytes) // page) * page, len(self._mm))
        self._mm.madvise(mmap.MADV_DONTNEED, first, end - first)

    def dequantize(self, name: str) -> np.ndarray:
        """Float32 values of tensor `name` in its numpy shape."""
        return quant.dequantize(self.raw(name), self.tensor(name).dtype)

    def sha256(self) -> str:
        """Hex sha256 of the whole file, read in chunks once and cached."""
        if self._sha256 is None:
            self._sha256 = sha256_file(self.path)
        return self._sha256

    def close(self) -> None:
        """Release the mapping; arrays already returned by `raw` keep it alive until freed."""
        mm, self._mm = self._mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:  # views from raw() still exist: they now own the mapping
                pass

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"GGUFFile({str(self.path)!r}, {len(self.tensors)} tensors)"


def open_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Open and validate a GGUF file."""
    return GGUFFile(path)


def _error(path: Path, message: str) -> GGUFError:
    return GGUFError(f"{path}: {message}")


_FILE_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket"),
               (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def file_kind(mode: int) -> str:
    """What a non-regular file is, for error messages."""
    return next((name for test, name in _FILE_KINDS if test(mode)), "not a regular file")


def _map(path: Path) -> mmap.mmap:
    try:  # O_NONBLOCK: opening a named pipe must not wait for a writer
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError as e:
        raise _error(path, "file not found") from e
    except OSError as e:
        raise _error(path, f"cannot open: {e.strerror or e}") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _error(path, f"{file_kind(st.st_mode)}, not a GGUF file")
        if st.st_size == 0:
            raise _error(path, "empty file (0 bytes): not a GGUF file")
        return mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise _error(path, f"cannot map: {e.strerror or e}") from e
    finally:
        os.close(fd)


def squeeze_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Drop leading numpy (= trailing ggml) dims of 1, as ggml_n_dims does (llama-quantize writes that many)."""
    shape = tuple(int(d) for d in shape)
    while len(shape) > 1 and shape[0] == 1:
        shape = shape[1:]
    return shape


@dataclass
class _Header:
    version: int
    alignment: int
    data_offset: int
    metadata: dict[str, Any]
    metadata_types: dict[str, str]
    tensors: dict[str, TensorInfo]


class _Parser:
    """Bounds-checked little-endian walk over the header: every read is checked against the file size."""

    def __init__(self, buf: mmap.mmap, path: Path):
        self.buf = buf
        self.path = path
        self.size = len(buf)
        self.pos = 0

    def parse(self) -> _Header:
        magic = self._take(len(GGUF_MAGIC), "magic")
        if magic != GGUF_MAGIC:
            raise self._error(f"bad magic {magic!r} (expected {GGUF_MAGIC!r}): not a GGUF file")
        version = self._u32("version")
        if version and version & 0xFFFF == 0:
            raise self._error("big-endian GGUF files are not supported")
        if version not in SUPPORTED_VERSIONS:
            supported = ", ".join(map(str, SUPPORTED_VERSIONS))
            raise self._error(f"unsupported GGUF version {version} (supported: {supported})")
        n_tensors = self._u64("tensor count")
        n_kv = self._u64("metadata count")
        self._check_count(n_kv, _MIN_KV_BYTES, "metadata entries")
        self._check_count(n_tensors, _MIN_TENSOR_INFO_BYTES, "tensors")
        metadata, types = self._metadata(n_kv)
        infos = [self._tensor_info(i) for i in range(n_tensors)]
        alignment = self._alignment(metadata, types)
        data_offset = -(-self.pos // alignment) * alignment
        tensors = self._tensors(infos, alignment, data_offset)
        return _Header(version, alignment, data_offset, metadata, types, tensors)

    def _error(self, message: str) -> GGUFError:
        return _error(self.path, message)

    def _need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise self._error(
                f"truncated or corrupt: {what} needs {n} bytes at offset {self.pos}, "
                f"but the file is only {self.size} bytes"
            )

    def _take(self, n: int, what: str) -> bytes:
        self._need(n, what)
        start = self.pos
        self.pos += n
        return self.buf[start:self.pos]

    def _unpack(self, fmt: str, what: str) -> int:
        return struct.unpack(fmt, self._take(struct.calcsize(fmt), what))[0]

    def _u32(self, what: str) -> int:
        return self._unpack("<I", what)

    def _u64(self, what: str) -> int:
        return self._unpack("<Q", what)

    def _i64(self, what: str) -> int:
        return self._unpack("<q", what)

    def _string(self, what: str) -> str:
        length = self._u64(f"length of {what}")
        data = self._take(length, what)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self._error(f"{what} is not valid UTF-8 ({e.reason} at byte {e.start})") from e

    def _strings(self, count: int, what: str) -> list[str]:
        """`count` strings; a tight loop because vocabularies hold hundreds of thousands."""
        self._need(count * _LEN_BYTES, f"{count} {what}")
        buf, size, pos = self.buf, self.size, self.pos
        raw = []
        for _ in range(count):
            end = pos + _LEN_BYTES
            if end <= size:
                end += _U64.unpack_from(buf, pos)[0]
            if end > size:
                self.pos = pos
                self._string(what)  # raises, saying which part of this element overruns
            raw.append(buf[pos + _LEN_BYTES:end])
            pos = end
        self.pos = pos
        try:
            return [b.decode("utf-8") for b in raw]
        except UnicodeDecodeError as e:
            raise self._error(f"{what}: a string is not valid UTF-8 ({e.reason})") from e

    def _check_count(self, count: int, min_bytes: int, what: str) -> None:
        if count * min_bytes > self.size - self.pos:
            raise self._error(f"header declares {count} {what}: more than the {self.size}-byte file can hold")

    def _metadata(self, n_kv: int) -> tuple[dict[str, Any], dict[str, str]]:
        values: dict[str, Any] = {}
        types: dict[str, str] = {}
        for i in range(n_kv):
            key = self._string(f"metadata key #{i}")
            if key in values:
                raise self._error(f"duplicate metadata key {key!r}")
            type_id = self._u32(f"value type of metadata key {key!r}")
            values[key], types[key] = self._value(type_id, key)
        return values, types

    def _value(self, type_id: int, key: str) -> tuple[Any, str]:
        what = f"value of metadata key {key!r}"
        if type_id == _STRING:
            return self._string(what), "STRING"
        if type_id in _SCALAR_TYPES:
            return self._scalars(type_id, 1, what)[0], _SCALAR_TYPES[type_id][0]
        if type_id != _ARRAY:
            raise self._error(f"metadata key {key!r} has unknown value type {type_id}")
        elem_type = self._u32(f"element type of metadata array {key!r}")
        count = self._u64(f"length of metadata array {key!r}")
        what = f"elements of metadata array {key!r}"
        if elem_type == _STRING:
            return self._strings(count, what), "ARRAY[STRING]"
        if elem_type in _SCALAR_TYPES:
            return self._scalars(elem_type, count, what), f"ARRAY[{_SCALAR_TYPES[elem_type][0]}]"
        if elem_type == _ARRAY:
            raise self._error(f"metadata key {key!r}: nested arrays are not supported")
        raise self._error(f"metadata array {key!r} has unknown element type {elem_type}")

    def _scalars(self, type_id: int, count: int, what: str) -> list[Any]:
        dtype = _SCALAR_TYPES[type_id][1]
        self._need(count * dtype.itemsize, f"{count} {what}")
        values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
        self.pos += values.nbytes
        if type_id == _BOOL:
            return [bool(v) for v in values.tolist()]
        return values.tolist()

    def _tensor_info(self, index: int) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string(f"name of tensor info #{index}")
        n_dims = self._u32(f"n_dims of tensor {name!r}")
        if n_dims > MAX_DIMS:
            raise self._error(f"tensor {name!r} has {n_dims} dimensions (at most {MAX_DIMS} supported)")
        ne = tuple(self._i64(f"dimensions of tensor {name!r}") for _ in range(n_dims))
        if any(d < 0 for d in ne):
            raise self._error(f"tensor {name!r} has a negative dimension: ne={list(ne)}")
        type_id = self._u32(f"type of tensor {name!r}")
        offset = self._u64(f"data offset of tensor {name!r}")
        return name, ne, type_id, offset

    def _alignment(self, metadata: dict[str, Any], types: dict[str, str]) -> int:
        if "general.alignment" not in metadata:
            return DEFAULT_ALIGNMENT
        value = metadata["general.alignment"]
        if types["general.alignment"] != "UINT32":
            raise self._error(f"general.alignment must be UINT32, got {types['general.alignment']}")
        if value == 0 or value & (value - 1):
            raise self._error(f"general.alignment must be a non-zero power of two, got {value}")
        return value

    def _tensors(
        self, infos: list[tuple[str, tuple[int, ...], int, int]], alignment: int, data_offset: int
    ) -> dict[str, TensorInfo]:
        tensors: dict[str, TensorInfo] = {}
        for name, ne, type_id, rel_offset in infos:
            if name in tensors:
                raise self._error(f"duplicate tensor name {name!r}")
            try:
                dtype = from_ggml_type(type_id, what=f"tensor {name!r}")
            except ValueError as e:
                raise self._error(str(e)) from e
            shape = squeeze_shape(tuple(reversed(ne)))
            try:
                n_bytes = math.prod(quant.storage_shape(shape, dtype)) * dtype.numpy().itemsize
            except ValueError as e:
                raise self._error(f"tensor {name!r}: shape/size mismatch: {e}") from e
            if rel_offset % alignment:
                raise self._error(
                    f"tensor {name!r} data offset {rel_offset} is misaligned (not a multiple of {alignment})"
                )
            start = data_offset + rel_offset
            if start + n_bytes > self.size:
                raise self._error(
                    f"tensor {name!r} data (bytes {start}..{start + n_bytes}) runs past the end of the file "
                    f"({self.size} bytes): truncated or corrupt"
                )
            tensors[name] = TensorInfo(name, dtype, shape, ne, start, n_bytes)
        self._check_layout(list(tensors.values()), alignment, data_offset)
        return tensors

    def _check_layout(self, infos: list[TensorInfo], alignment: int, data_offset: int) -> None:
        """llama.cpp's rule: each tensor starts at the padded end of the one declared before it;
        and the file ends with the last one's data (or its padding)."""
        end = 0
        for before, t in zip([None, *infos], infos):
            if t.offset - data_offset != end:
                after = f"tensor {before.name!r} before it ({_describe(before)}) ends" if before else "the data starts"
                raise self._error(f"tensor {t.name!r} data starts at data-section offset {t.offset - data_offset}, "
                                  f"but {after} at {end}: a wrong offset, or a type or shape that does not match "
                                  "the data (e.g. F32 data labelled F16)")
            end += -(-t.n_bytes // alignment) * alignment
        trailing = self.size - data_offset - end
        if infos and trailing > 0:
            last = infos[-1]
            raise self._error(f"{trailing} bytes follow the data of the last tensor {last.name!r} ({_describe(last)}): "
                              "its type or shape does not match its data (e.g. F32 data labelled F16), or the file "
                              "has trailing bytes")


def _describe(t: TensorInfo) -> str:
    return f"{t.dtype.value.upper()} {list(t.shape)}, {t.n_bytes} bytes"
