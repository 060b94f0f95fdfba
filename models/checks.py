"""Consistency checks and limits of model configs, each error naming the file and the key.

Limits are checked before anything is sized from them: a 5 MB file declaring 10^8 layers
is refused by counting the blocks its tensor table holds (`check_layer_count`) before a
per-layer table is built; counts llama.cpp bounds (experts) are bounded the same way; a
draft block is bounded so a verify batch stays a batch. The memory a context needs is
checked later, from the graphs (dflash_ir/memory.py).
"""
from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from .metadata import MASK_TOKEN_KEYS, MOE_FIELDS, MetadataReader, ModelConfigError
from .tensors import ROPE_FACTORS

if TYPE_CHECKING:
    from .config import DraftConfig, TargetConfig

MAX_EXPERTS = 512          # llama.cpp's LLAMA_MAX_EXPERTS
MAX_BLOCK_SIZE = 256       # DFlash drafts use 16; a block is one verify batch
MAX_POSITIONS = 2**31 - 1  # positions are int32 on every backend

_BLOCK = re.compile(r"blk\.(\d+)\.")


def check_layer_count(tensor_names: Iterable[str], r: MetadataReader, key: str, n_layers: int) -> None:
    """`n_layers` (from metadata `key`) must not exceed the blocks blk.N the tensor table has:
    checked before anything per layer is built from the count."""
    present = {int(m[1]) for m in map(_BLOCK.match, tensor_names) if m}
    if n_layers > len(present):
        raise r.error(key, f"= {n_layers} declares more layers than the file has tensors for "
                           f"({len(present)} blocks blk.N)")


def check_target(cfg: TargetConfig, source: str) -> None:
    """Raise ModelConfigError naming the key of the first inconsistent hyper-parameter."""
    positive = ["hidden", "n_head", "n_head_kv", "head_dim", "n_rot", "rope_theta", "rms_eps", "context_length"]
    if cfg.is_hybrid:
        positive += ["ssm_conv_kernel", "ssm_d_state", "ssm_n_group", "ssm_dt_rank", "ssm_inner"]
    _check_positive(cfg, source, positive + (list(MOE_FIELDS) if cfg.is_moe else ["ff"]))
    if cfg.vocab_size <= 0:
        raise ModelConfigError(f"{source}: token_embd.weight has no rows")
    if len(cfg.layer_is_recurrent) != cfg.n_layer:
        raise ModelConfigError(
            f"{source}: the layer pattern has {len(cfg.layer_is_recurrent)} entries for {cfg.n_layer} layers"
        )
    _check_heads_and_rope(cfg, source)
    _check_at_most(cfg, source, "context_length", MAX_POSITIONS, "positions are 32-bit")
    if cfg.rope_freq_factors and (cfg.is_hybrid or len(cfg.rope_freq_factors) != cfg.n_rot // 2 or
                                  not all(math.isfinite(x) and x > 0 for x in cfg.rope_freq_factors)):
        shown = ", ".join(f"{x:g}" for x in cfg.rope_freq_factors[:6])
        raise ModelConfigError(f"{source}: tensor {ROPE_FACTORS} must hold n_rot/2 = {cfg.n_rot // 2} positive "
                               f"finite factors (llama and qwen3 targets only); this {cfg.arch} file has "
                               f"{len(cfg.rope_freq_factors)}: {shown}{', ...' if len(cfg.rope_freq_factors) > 6 else ''}")
    if not cfg.is_hybrid:
        if cfg.permuted_qk and cfg.n_rot != cfg.head_dim:
            raise _field_error(cfg, source, "n_rot", f"= {cfg.n_rot} must equal the head size {cfg.head_dim}: "
                                                     "llama's q/k row permutation spans whole heads")
        return
    if cfg.ssm_dt_rank % cfg.ssm_n_group:
        raise _field_error(cfg, source, "ssm_dt_rank", f"= {cfg.ssm_dt_rank} value heads is not a multiple of "
                                                       f"ssm.group_count = {cfg.ssm_n_group} key heads")
    if cfg.ssm_inner != cfg.ssm_dt_rank * cfg.ssm_d_state:
        raise _field_error(cfg, source, "ssm_inner", f"= {cfg.ssm_inner} must equal ssm.time_step_rank * "
                           f"ssm.state_size = {cfg.ssm_dt_rank} * {cfg.ssm_d_state} (value head dim = key head dim)")
    if cfg.is_moe:
        _check_at_most(cfg, source, "n_expert", MAX_EXPERTS, "llama.cpp's LLAMA_MAX_EXPERTS")
        if cfg.n_expert_used > cfg.n_expert:
            raise _field_error(cfg, source, "n_expert_used",
                               f"= {cfg.n_expert_used} exceeds expert_count = {cfg.n_expert}")


def check_draft(cfg: DraftConfig, source: str) -> None:
    """Raise ModelConfigError naming the key of the first inconsistent draft hyper-parameter."""
    _check_positive(cfg, source, ["n_layer", "hidden", "ff", "n_head", "n_head_kv", "head_dim", "n_rot", "rope_theta",
                                  "rms_eps", "context_length"])
    _check_heads_and_rope(cfg, source)
    _check_at_most(cfg, source, "context_length", MAX_POSITIONS, "positions are 32-bit")
    if cfg.block_size < 2:
        raise _field_error(cfg, source, "block_size",
                           f"= {cfg.block_size} must be at least 2 (anchor + one drafted token)")
    _check_at_most(cfg, source, "block_size", MAX_BLOCK_SIZE, "a block is verified in one batch")
    if not cfg.target_layers or min(cfg.target_layers) < 1:
        raise _field_error(cfg, source, "target_layers", f"= {list(cfg.target_layers)} must be a non-empty list of "
                                                         "ids >= 1 (stored ids are HF layer ids + 1)")
    if cfg.mask_token_id < 0:
        raise ModelConfigError(f"{source}: {MASK_TOKEN_KEYS[0]} = {cfg.mask_token_id} is negative")
    if cfg.sliding_window < 0:
        raise _field_error(cfg, source, "sliding_window", "is negative")
    if cfg.swa_layers and len(cfg.swa_layers) != cfg.n_layer:
        raise _field_error(cfg, source, "swa_layers",
                           f"has {len(cfg.swa_layers)} entries for block_count = {cfg.n_layer}")


def check_pair(draft_cfg: DraftConfig, target_cfg: TargetConfig, *, draft_path: Any, target_path: Any) -> None:
    """Raise ModelConfigError if the draft cannot run on this target (it borrows its embeddings and lm_head)."""
    where = f"draft {draft_path} / target {target_path}"
    if draft_cfg.hidden != target_cfg.hidden:
        raise ModelConfigError(
            f"{where}: hidden size mismatch: {draft_cfg.key('hidden')} = {draft_cfg.hidden} but "
            f"{target_cfg.key('hidden')} = {target_cfg.hidden} (the draft reads the target's embeddings)"
        )
    if not 0 <= draft_cfg.mask_token_id < target_cfg.vocab_size:
        raise ModelConfigError(
            f"{where}: {MASK_TOKEN_KEYS[0]} = {draft_cfg.mask_token_id} is outside the target vocabulary "
            f"(token_embd.weight has {target_cfg.vocab_size} rows)"
        )
    bad = [i for i in draft_cfg.target_layers if not 1 <= i <= target_cfg.n_layer]
    if bad:
        raise ModelConfigError(
            f"{where}: {draft_cfg.key('target_layers')} = {list(draft_cfg.target_layers)}: ids {bad} are outside "
            f"1..{target_cfg.n_layer} (stored ids are HF layer ids + 1; the target has {target_cfg.n_layer} layers)"
        )
    want = draft_cfg.n_taps * target_cfg.hidden
    if draft_cfg.fc_in != want:
        raise ModelConfigError(
            f"{where}: fc.weight input width {draft_cfg.fc_in} != {draft_cfg.n_taps} taps * target hidden "
            f"{target_cfg.hidden} = {want}"
        )


def _field_error(cfg: TargetConfig | DraftConfig, source: str, field: str, problem: str) -> ModelConfigError:
    return ModelConfigError(f"{source}: {cfg.key(field)} {problem}")


def _check_positive(cfg: TargetConfig | DraftConfig, source: str, fields: list[str]) -> None:
    for field in fields:
        value = getattr(cfg, field)
        if not (math.isfinite(value) and value > 0):
            raise _field_error(cfg, source, field, f"= {value} must be positive")


def _check_at_most(cfg: TargetConfig | DraftConfig, source: str, field: str, limit: int, why: str) -> None:
    if getattr(cfg, field) > limit:
        raise _field_error(cfg, source, field, f"= {getattr(cfg, field)} exceeds {limit} ({why})")


def _check_heads_and_rope(cfg: TargetConfig | DraftConfig, source: str) -> None:
    if cfg.n_head % cfg.n_head_kv:
        raise _field_error(cfg, source, "n_head_kv",
                           f"= {cfg.n_head_kv} does not divide attention.head_count = {cfg.n_head}")
    if cfg.n_rot > cfg.head_dim or cfg.n_rot % 2:
        raise _field_error(cfg, source, "n_rot",
                           f"= {cfg.n_rot} must be even and at most attention.key_length = {cfg.head_dim}")
    sections = cfg.rope_sections
    if sections and (len(sections) > 4 or min(sections) < 0 or sum(sections) != cfg.n_rot // 2):
        raise _field_error(cfg, source, "rope_sections", f"= {list(sections)} must be at most 4 non-negative entries "
                                                         f"summing to rope.dimension_count / 2 = {cfg.n_rot // 2}")
