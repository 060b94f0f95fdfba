"""GGUF metadata keys of the model configs, and typed reading of them.

Every value is checked for its type (and floats for being finite) where it is read, so a
bad file fails with the file and the key named instead of a TypeError in a builder. Key
names are llama.cpp's (QWEN35.md §11, DFLASH.md §7.3); the config field of each key is
what the reader reads, the generator writes and error messages name.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from .gguf_file import GGUFError

HYBRID_ARCHS = ("qwen35", "qwen35moe")  # Gated DeltaNet + attention layers
DENSE_ARCHS = ("llama", "qwen3")        # attention in every layer
TARGET_ARCHS = HYBRID_ARCHS + DENSE_ARCHS
DRAFT_ARCH = "dflash"

# Metadata key (without the "{arch}." prefix) of each config field.
TARGET_KEYS = {
    "hidden": "embedding_length",
    "n_head": "attention.head_count",
    "n_head_kv": "attention.head_count_kv",
    "head_dim": "attention.key_length",
    "rope_theta": "rope.freq_base",
    "n_rot": "rope.dimension_count",
    "rope_sections": "rope.dimension_sections",
    "rms_eps": "attention.layer_norm_rms_epsilon",
    "ssm_conv_kernel": "ssm.conv_kernel",
    "ssm_d_state": "ssm.state_size",
    "ssm_n_group": "ssm.group_count",
    "ssm_dt_rank": "ssm.time_step_rank",
    "ssm_inner": "ssm.inner_size",
    "ff": "feed_forward_length",
    "n_expert": "expert_count",
    "n_expert_used": "expert_used_count",
    "expert_ff": "expert_feed_forward_length",
    "shared_ff": "expert_shared_feed_forward_length",
    "context_length": "context_length",
    "n_nextn": "nextn_predict_layers",
}
DRAFT_KEYS = {
    "n_layer": "block_count",
    "hidden": "embedding_length",
    "ff": "feed_forward_length",
    "n_head": "attention.head_count",
    "n_head_kv": "attention.head_count_kv",
    "head_dim": "attention.key_length",
    "n_rot": "rope.dimension_count",
    "rope_sections": "rope.dimension_sections",
    "rope_theta": "rope.freq_base",
    "rms_eps": "attention.layer_norm_rms_epsilon",
    "block_size": "block_size",
    "target_layers": "target_layers",
    "sliding_window": "attention.sliding_window",
    "swa_layers": "attention.sliding_window_pattern",
    "context_length": "context_length",
}
MASK_TOKEN_KEYS = ("tokenizer.ggml.mask_token_id", "dflash.mask_token_id")  # standard key first
MOE_FIELDS = ("n_expert", "n_expert_used", "expert_ff", "shared_ff")

REQUIRED = object()


class ModelConfigError(GGUFError):
    """A GGUF whose metadata or tensors do not describe a model we can run."""


def is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def is_array(v: Any) -> bool:
    return isinstance(v, (list, tuple, np.ndarray))


class MetadataReader:
    """Typed access to one file's `{arch}.*` metadata; errors name the file and the key."""

    def __init__(self, meta: Mapping[str, Any], source: str, arch: str):
        self.meta, self.source, self.arch = meta, source, arch

    def error(self, key: str, problem: str) -> ModelConfigError:
        return ModelConfigError(f"{self.source}: {self.arch}.{key} {problem}")

    def has(self, key: str) -> bool:
        return f"{self.arch}.{key}" in self.meta

    def _get(self, key: str, default: Any) -> Any:
        full = f"{self.arch}.{key}"
        if full in self.meta:
            return self.meta[full]
        if default is REQUIRED:
            raise ModelConfigError(f"{self.source}: metadata key {full} is missing")
        return default

    def int(self, key: str, default: Any = REQUIRED) -> int:
        v = self._get(key, default)
        if not is_int(v):
            raise self.error(key, f"= {v!r} is not an integer")
        return int(v)

    def float(self, key: str, default: Any = REQUIRED) -> float:
        v = self._get(key, default)
        if not (is_int(v) or isinstance(v, (float, np.floating))):
            raise self.error(key, f"= {v!r} is not a number")
        if not math.isfinite(v):
            raise self.error(key, f"= {v!r} is not a finite number")
        return float(v)

    def ints(self, key: str, default: Any = REQUIRED) -> tuple[int, ...]:
        v = self._get(key, default)
        if not is_array(v) or not all(is_int(x) for x in v):
            raise self.error(key, f"= {_short(v)} is not an integer array")
        return tuple(int(x) for x in v)

    def bools(self, key: str, default: Any = REQUIRED) -> tuple[bool, ...]:
        v = self._get(key, default)
        if not is_array(v) or not all(isinstance(x, (bool, np.bool_)) for x in v):
            raise self.error(key, f"= {_short(v)} is not a bool array")
        return tuple(bool(x) for x in v)


def _short(v: Any) -> str:
    """repr of a value for an error message, cut short (arrays can have a million entries)."""
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


def check_arch(meta: Mapping[str, Any], source: str, *, want_target: bool) -> str:
    """general.architecture of a target (qwen35, qwen35moe) or draft (dflash) file; a model
    given in the other role is named as such."""
    arch = meta.get("general.architecture")
    if want_target and arch == DRAFT_ARCH:
        raise ModelConfigError(
            f"{source}: general.architecture is '{DRAFT_ARCH}': this is a DFlash draft model; "
            "pass it as the draft (-md), not as the target (-m)"
        )
    if not want_target and arch in TARGET_ARCHS:
        raise ModelConfigError(
            f"{source}: general.architecture is '{arch}': this is a target model; "
            f"pass it as the target (-m), not as the draft (-md)"
        )
    supported = TARGET_ARCHS if want_target else (DRAFT_ARCH,)
    if arch not in supported:
        role = "target" if want_target else "draft"
        raise ModelConfigError(
            f"{source}: general.architecture {_short(arch)} is not supported as a {role} "
            f"(supported: {', '.join(supported)})"
        )
    return arch


def read_mask_id(meta: Mapping[str, Any], source: str) -> int:
    """The draft's mask token id, from the standard key or the dflash one."""
    for key in MASK_TOKEN_KEYS:
        if key in meta:
            if not is_int(meta[key]):
                raise ModelConfigError(f"{source}: {key} = {_short(meta[key])} is not an integer")
            return int(meta[key])
    raise ModelConfigError(
        f"{source}: metadata key {MASK_TOKEN_KEYS[0]} (or {MASK_TOKEN_KEYS[1]}) is missing: "
        "a DFlash draft needs its mask token id"
    )
