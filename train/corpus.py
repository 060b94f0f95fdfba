"""The training corpus: this interpreter's standard-library sources (PSF licence, offline).

Split by file, deterministically: a file is held out when a seeded hash of its path relative
to the stdlib root falls in the held-out fraction, so the split does not depend on listing
order or on which other files exist.
"""
from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

SEED = "dflash-ir-demo-v1"
HELD_OUT = 0.05
# Tests, data tables and vendored copies are not the code we want the model to learn.
EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "pydoc_data", "encodings",
                 "__pycache__"}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _held_out(rel: str) -> bool:
    h = int.from_bytes(hashlib.sha256(f"{SEED}:{rel}".encode()).digest()[:8], "little")
    return h / 2**64 < HELD_OUT


def split(root: Path | None = None) -> dict[str, list[Path]]:
    """{"train": [...], "heldout": [...]}: the stdlib's .py files, sorted by relative path."""
    root = root or stdlib_root()
    files = sorted(p for p in root.rglob("*.py") if not EXCLUDED_DIRS & set(p.relative_to(root).parts[:-1]))
    out: dict[str, list[Path]] = {"train": [], "heldout": []}
    for p in files:
        out["heldout" if _held_out(p.relative_to(root).as_posix()) else "train"].append(p)
    return out


def read(path: Path) -> str:
    """File text (UTF-8; the few Latin-1 files are decoded leniently)."""
    return path.read_bytes().decode("utf-8", errors="replace")
