"""Held-out code prompts for the demo and the tests: the head of a function from held-out files.

Deterministic: for each held-out file (sorted), the first top-level or method `def` whose
signature and docstring opening fit in a few lines; the prompt ends after the docstring's
first line, where the body is about to start.
"""
from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

from . import corpus

_DEF = re.compile(r"^( *)def \w+\(.*\):\n\1    (\"\"\"|''').*\n", re.M)


def heldout_prompts(limit: int = 8, max_chars: int = 400) -> list[dict]:
    root = corpus.stdlib_root()
    out = []
    for path in corpus.split()["heldout"]:
        m = _DEF.search(corpus.read(path))
        if m and len(m.group(0)) <= max_chars:
            out.append({"file": path.relative_to(root).as_posix(), "text": textwrap.dedent(m.group(0))})
        if len(out) == limit:
            break
    return out


def write(path: Path) -> None:
    path.write_text(json.dumps(heldout_prompts(), indent=1) + "\n")


if __name__ == "__main__":
    write(Path(__file__).resolve().parents[1] / "demo" / "prompts.json")
