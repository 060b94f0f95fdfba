"""The graph builder of each target architecture (general.architecture)."""
from __future__ import annotations

from .config import TargetConfig
from .gguf_file import GGUFFile
from .qwen35 import Qwen35Builder
from .transformer import TargetBuilder

BUILDERS: dict[str, type[TargetBuilder]] = {
    "qwen35": Qwen35Builder,
    "qwen35moe": Qwen35Builder,
    "llama": TargetBuilder,
    "qwen3": TargetBuilder,
}


def target_builder(gguf: GGUFFile, cfg: TargetConfig) -> TargetBuilder:
    """The builder for `cfg.arch` (configs are only made for the architectures listed here)."""
    return BUILDERS[cfg.arch](gguf, cfg)
