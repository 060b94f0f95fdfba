"""The compiler's sources, scanned for a formula written out where one function should be
called instead (the "one source of truth" tests of activations, RoPE, the delta rule,
attention's mask and the selection order)."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMPILER = ("dflash_ir", "backends", "models", "passes")


def written_out(pattern: re.Pattern, *allowed: str) -> list[str]:
    """'path:line: text' of every line of the compiler matching `pattern`, outside the
    `allowed` files (paths relative to the repository: the formula's own module)."""
    skip = {REPO / a for a in allowed}
    return [f"{path.relative_to(REPO)}:{n}: {line.strip()}"
            for folder in COMPILER for path in sorted((REPO / folder).rglob("*.py")) if path not in skip
            for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
