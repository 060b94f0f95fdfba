"""Shared fixtures: where the oracle fixtures live and cached, verified decompressions of their GGUFs."""
from __future__ import annotations

import hashlib
import json
import lzma
import os
import shutil
import tempfile
from pathlib import Path

import pytest

_CHUNK = 1 << 20


def fixtures_root() -> Path:
    """`$DFLASH_IR_FIXTURES`, else `../shared/fixtures` next to the repository."""
    if env := os.environ.get("DFLASH_IR_FIXTURES"):
        return Path(env)
    return Path(__file__).resolve().parent.parent.parent / "shared" / "fixtures"


def _cache_root() -> Path:
    if env := os.environ.get("DFLASH_IR_CACHE"):
        return Path(env)
    return Path.home() / ".cache" / "dflash-ir" / "oracle"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _matches(path: Path, entry: dict) -> bool:
    return path.is_file() and path.stat().st_size == entry["size_bytes"] and _sha256(path) == entry["sha256"]


def _decompress(source: Path, target: Path, entry: dict) -> None:
    """Stream `source` (.xz) into a temporary file next to `target`, verify it, then rename it into place."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as dst, lzma.open(source, "rb") as src:
            shutil.copyfileobj(src, dst, _CHUNK)
        if not _matches(tmp, entry):
            pytest.fail(f"{source}: decompressed file does not match gguf_manifest.json (size/sha256)", pytrace=False)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


@pytest.fixture(scope="session")
def oracle_dir() -> Path:
    """The oracle fixture folder; tests that need it are skipped when it is absent."""
    path = fixtures_root() / "oracle"
    if not path.is_dir():
        pytest.skip(f"oracle fixtures not found at {path}: set DFLASH_IR_FIXTURES")
    return path


@pytest.fixture(scope="session")
def oracle_gguf(oracle_dir: Path):
    """`get(relpath)` -> Path of the decompressed, sha256-verified GGUF (e.g. "dense/gguf/dense-target-f16.gguf")."""
    manifest = json.loads((oracle_dir / "gguf_manifest.json").read_text())
    cache = _cache_root()
    verified: dict[str, Path] = {}

    def get(relpath: str) -> Path:
        if relpath in verified:
            return verified[relpath]
        if relpath not in manifest:
            raise KeyError(f"{relpath!r} is not in {oracle_dir / 'gguf_manifest.json'}")
        entry = manifest[relpath]
        if not entry.get("stored_as") or not (oracle_dir / entry["stored_as"]).is_file():
            pytest.skip(f"{relpath} is not stored in the oracle fixtures (only its sha256 is)")
        target = cache / relpath
        if not _matches(target, entry):
            _decompress(oracle_dir / entry["stored_as"], target, entry)
        verified[relpath] = target
        return target

    return get
