"""The shared oracle fixtures (../shared/fixtures beside the clone): locating them and
decompressing their xz-stored GGUFs once into a cache, verified against their sha256.

Test machinery, not part of the installed package: tests/conftest.py's `oracle_*` fixtures
are the way tests reach it."""
from __future__ import annotations

import json
import lzma
import os
import shutil
import tempfile
from pathlib import Path

from dflash_ir.cache import cache_dir
from dflash_ir.hashing import sha256_file

_CHUNK = 1 << 20


class FixtureError(RuntimeError):
    pass


def fixtures_root() -> Path:
    """`$DFLASH_IR_FIXTURES`, else `../shared/fixtures` next to the repository."""
    if env := os.environ.get("DFLASH_IR_FIXTURES"):
        return Path(env)
    return Path(__file__).resolve().parent.parent.parent / "shared" / "fixtures"


def cache_root() -> Path:
    """`$DFLASH_IR_CACHE`, else the dflash-ir cache's `oracle/` folder."""
    return cache_dir("oracle", "DFLASH_IR_CACHE")


def _matches(path: Path, entry: dict) -> bool:
    return path.is_file() and path.stat().st_size == entry["size_bytes"] and sha256_file(path) == entry["sha256"]


def _decompress(source: Path, target: Path, entry: dict) -> None:
    """Stream `source` (.xz) into a temporary file next to `target`, verify it, then rename it into place."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as dst, lzma.open(source, "rb") as src:
            shutil.copyfileobj(src, dst, _CHUNK)
        if not _matches(tmp, entry):
            raise FixtureError(f"{source}: decompressed file does not match gguf_manifest.json (size/sha256)")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


class OracleFixtures:
    """Access to `<fixtures>/oracle`: `gguf("dense/gguf/dense-target-f16.gguf") -> Path`."""

    def __init__(self, root: Path | None = None):
        self.dir = (root or fixtures_root()) / "oracle"
        if not self.dir.is_dir():
            raise FixtureError(f"oracle fixtures not found at {self.dir}: set DFLASH_IR_FIXTURES")
        self.manifest = json.loads((self.dir / "gguf_manifest.json").read_text())
        self._verified: dict[str, Path] = {}

    def is_stored(self, relpath: str) -> bool:
        entry = self.manifest.get(relpath, {})
        return bool(entry.get("stored_as")) and (self.dir / entry["stored_as"]).is_file()

    def gguf(self, relpath: str) -> Path:
        if relpath in self._verified:
            return self._verified[relpath]
        if relpath not in self.manifest:
            raise KeyError(f"{relpath!r} is not in {self.dir / 'gguf_manifest.json'}")
        if not self.is_stored(relpath):
            raise FixtureError(f"{relpath} is not stored in the oracle fixtures (only its sha256 is)")
        entry = self.manifest[relpath]
        target = cache_root() / relpath
        if not _matches(target, entry):
            _decompress(self.dir / entry["stored_as"], target, entry)
        self._verified[relpath] = target
        return target
