"""The fields of an artifact manifest the loader reads, with their types and bounds.

`check_manifest` walks the parsed manifest against SCHEMA and raises ArtifactError naming
the manifest and the dotted path of the first field that is missing or of the wrong type
(`config.n_ctx must be an integer, got '64'`), so no KeyError or TypeError reaches the user.
Fields the loader does not read are left alone (backends and later versions add their own).
"""
from __future__ import annotations

import re
from typing import Any, Callable

from .errors import ArtifactError
from .models.checks import MAX_BLOCK_SIZE, MAX_POSITIONS
from .passes.quantize_activations import NUMERICS

_SHA256 = re.compile(r"[0-9a-f]{64}\Z")


class _Each:
    """A mapping whose keys are free (strings) and whose values all follow `schema`."""

    def __init__(self, schema: Any):
        self.schema = schema


class _Optional:
    def __init__(self, schema: Any):
        self.schema = schema


def _int(low: int, high: int) -> Callable[[Any], str | None]:
    def check(v: Any) -> str | None:
        if not isinstance(v, int) or isinstance(v, bool):
            return f"must be an integer, got {v!r}"
        return None if low <= v <= high else f"= {v} is outside {low}..{high}"
    return check


def _str(v: Any) -> str | None:
    return None if isinstance(v, str) else f"must be a string, got {v!r}"


def _sha256(v: Any) -> str | None:
    return None if isinstance(v, str) and _SHA256.match(v) else f"must be a sha256 hex digest, got {v!r}"


def _flags(v: Any) -> str | None:
    ok = isinstance(v, list) and all(isinstance(f, bool) for f in v)
    return None if ok else f"must be a list of booleans, got {v!r}"


def _one_of(*choices: str) -> Callable[[Any], str | None]:
    def check(v: Any) -> str | None:
        return None if v in choices else f"must be one of {', '.join(choices)}, got {v!r}"
    return check


def _dict(v: Any) -> str | None:
    return None if isinstance(v, dict) else f"must be a mapping, got {type(v).__name__}"


_COUNT = _int(0, 2**63 - 1)
SCHEMA = {
    "format": _str,
    "format_version": _int(0, 2**31),
    "dflash_ir_version": _str,
    "backend": {"name": _str, "device": _str},
    "sources": _Each({"path": _str, "size": _COUNT, "sha256": _sha256}),
    "config": {
        "n_ctx": _int(1, MAX_POSITIONS),
        "n_max": _int(0, MAX_BLOCK_SIZE - 1),
        "numerics": _one_of(*NUMERICS),
        "target": {"layer_is_recurrent": _flags},
        "draft": _Optional({"block_size": _int(2, MAX_BLOCK_SIZE), "mask_token_id": _int(0, 2**31 - 1)}),
    },
    "programs": _Each({"graph": _str, "backend": _dict}),
    "files": _Each(_sha256),
}


def check_manifest(manifest: Any, where: str) -> None:
    """Raise ArtifactError for the first field of SCHEMA that `manifest` lacks or gets wrong."""
    _check(manifest, SCHEMA, where, "")


def _check(value: Any, schema: Any, where: str, path: str) -> None:
    if callable(schema):
        problem = schema(value)
        if problem:
            raise ArtifactError(f"{where}: {path} {problem}")
        return
    if not isinstance(value, dict):
        raise ArtifactError(f"{where}: {path or 'the manifest'} must be a mapping, got {type(value).__name__}")
    if isinstance(schema, _Each):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ArtifactError(f"{where}: {path} has a non-string key {key!r}")
            _check(item, schema.schema, where, f"{path}.{key}")
        return
    for key, sub in schema.items():
        inner = f"{path}.{key}" if path else key
        if key not in value:
            if isinstance(sub, _Optional):
                continue
            raise ArtifactError(f"{where}: missing field {inner}")
        _check(value[key], sub.schema if isinstance(sub, _Optional) else sub, where, inner)
