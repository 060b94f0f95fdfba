"""sha256 of files, read in chunks: how artifacts, fixtures and GGUFs are pinned."""
from __future__ import annotations

import hashlib
import os

CHUNK = 1 << 22


def sha256_file(path: str | os.PathLike[str]) -> str:
    """Hex sha256 of the whole file."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
