"""The oracle GGUFs (written by llama.cpp's converter/quantizer) against their `.gguf.txt` descriptions
and gguf-py's dequantisation."""
from __future__ import annotations

import ast
import hashlib
import json
import re
from dataclasses import dataclass, field

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf import quants as ref

from dflash_ir.models.gguf_file import open_gguf, squeeze_shape

pytestmark = pytest.mark.oracle

GGUFS = [
    f"{kind}/gguf/{kind}-{role}-{precision}.gguf"
    for kind in ("dense", "moe")
    for role in ("target", "dflash")
    for precision in ("f16", "q8_0")
]

_SHORT_ARRAY = re.compile(r"^(?P<type>ARRAY\[\w+\]) n=(?P<n>\d+) = (?P<items>\[.*\])$")
_LONG_ARRAY = re.compile(
    r"^(?P<type>ARRAY\[\w+\]) n=(?P<n>\d+) first=(?P<first>\[.*\]) last=(?P<last>\[.*\]) "
    r"sha256\(repr\(list\)\)=(?P<sha>[0-9a-f]{64})$"
)
_SCALAR = re.compile(r"^(?P<type>\w+) = (?P<value>.*)$")


@dataclass
class Description:
    """A parsed `<name>.gguf.txt` (format in the oracle README, 'GGUF description files')."""

    header: dict[str, str] = field(default_factory=dict)  # also the closing "n_tensors: N" line
    metadata: dict[str, str] = field(default_factory=dict)  # key -> text after "key: "
    tensors: list[list[str]] = field(default_factory=list)  # name, type, ne, n_bytes, offset_in_data, sha256


def _parse_description(path) -> Description:
    description = Description()
    section = "header"
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line:
            continue
        if line.startswith("["):
            section = line[1:line.index("]")]
        elif section == "tensors" and " | " in line:
            description.tensors.append(line.split(" | "))
        else:
            key, text = line.split(": ", 1)
            (description.metadata if section == "metadata" else description.header)[key] = text
    return description


@pytest.fixture(scope="module", params=GGUFS)
def case(request, oracle_gguf, oracle_dir):
    path = oracle_gguf(request.param)
    description = _parse_description(oracle_dir / f"{request.param}.txt")
    with open_gguf(path) as f:
        yield f, description


def test_manifest_lists_exactly_these_files(oracle_dir):
    manifest = json.loads((oracle_dir / "gguf_manifest.json").read_text())
    assert sorted(manifest) == sorted(GGUFS)


def test_header(case):
    f, description = case
    header = description.header
    assert f.path.name == header["file"]
    assert f.size_bytes == int(header["size_bytes"])
    assert f.sha256() == header["sha256"]
    assert f.version == int(header["gguf_version"])
    assert f.alignment == int(header["alignment"])
    assert f.data_offset == int(header["data_offset"])
    assert len(f.tensors) == int(header["n_tensors"]) == len(description.tensors)


def test_metadata(case):
    f, description = case
    assert list(f.metadata) == list(description.metadata)
    for key, text in description.metadata.items():
        value = f.metadata[key]
        if m := _LONG_ARRAY.match(text):
            first, last = ast.literal_eval(m["first"]), ast.literal_eval(m["last"])
            assert len(value) == int(m["n"]), key
            assert value[: len(first)] == first and value[-len(last):] == last, key
            assert hashlib.sha256(repr(value).encode("utf-8")).hexdigest() == m["sha"], key
        elif m := _SHORT_ARRAY.match(text):
            assert len(value) == int(m["n"]) and value == ast.literal_eval(m["items"]), key
        else:
            m = _SCALAR.match(text)
            expected = ast.literal_eval(m["value"])
            assert value == expected and type(value) is type(expected), key
        assert f.metadata_types[key] == m["type"], key


def test_tensor_table_and_bytes(case):
    f, description = case
    assert list(f.tensors) == [row[0] for row in description.tensors]
    for name, ggml_type, ne, n_bytes, offset_in_data, sha in description.tensors:
        info = f.tensors[name]
        assert info.dtype.value.upper() == ggml_type, name
        assert list(info.ggml_shape) == ast.literal_eval(ne), name
        assert info.shape == squeeze_shape(tuple(reversed(info.ggml_shape))), name  # ggml_n_dims
        assert info.n_bytes == int(n_bytes), name
        assert info.offset - f.data_offset == int(offset_in_data), name
        assert hashlib.sha256(f.raw(name)).hexdigest() == sha, name


def test_dequantize_bit_exact_vs_gguf(case):
    f, description = case
    data_offset = int(description.header["data_offset"])
    blob = f.path.read_bytes()
    for name, ggml_type, ne, n_bytes, offset_in_data, _ in description.tensors:
        start = data_offset + int(offset_in_data)
        shape = tuple(reversed(ast.literal_eval(ne)))
        raw = np.frombuffer(blob, np.uint8, count=int(n_bytes), offset=start).reshape(*shape[:-1], -1)
        expected = ref.dequantize(raw, GGMLQuantizationType[ggml_type])
        got = f.dequantize(name)
        assert got.dtype == np.float32 and got.shape == squeeze_shape(shape) and shape == expected.shape, name
        assert np.array_equal(got.view(np.uint32), expected.reshape(got.shape).view(np.uint32)), name
