"""Test pairs whose draft agrees with its target on exactly `agree` proposals of every round.

Random pairs never accept a proposal, so they exercise only `commit(1)`. The pairs written
here are built, not trained, around one mechanism, *copy the token L positions back*:

- Every token embedding holds the same value `BETA` in dimension 0. A projection that
  reads only that dimension gives, after the per-head q/k norm, the same vector at every
  position, whatever the token.
- Target: its (last) attention layer's queries and keys are such vectors, the key being the
  query rotated by L-1 positions, so the RoPE score q·R(j - p)k peaks at j = p - (L-1); a
  small rope θ makes that peak stand out over thousands of positions. Values are the layer
  input and the output projection amplifies them, so the residual stream is dominated by
  the embedding of token p+1-L and the tied head emits it: the greedy continuation of a
  prompt of at least L tokens repeats its last L tokens.
- Every other target weight stays random with its layer's output scaled by `NOISE`: the
  Gated DeltaNet and MLP/MoE layers carry state that rollback must restore, but do not
  decide tokens.
- Draft: `fc` passes the first tap (the residual stream before the copy layer, close to the
  token embedding) into the context, and layer 0 copies from L positions back the same
  way. Block row k (position P+k, anchor at P) reads position P+k-L: for k < L a committed
  token, for k = L the anchor (right as well: the continuation has period L), for k > L a
  MASK row of the block, which makes the row propose MASK, a token the target never emits.
  So a round with n proposals accepts min(L, n) of them.
- `agree=0`: the draft's copy is switched off and every row proposes MASK; the target
  then repeats its last B-1 tokens.

The test prompt must be at least L tokens long and must not contain the MASK token.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from dflash_ir.ops.position import rope

from .config import DraftConfig, TargetConfig
from .generator import GGUFPlan, draft_plan, target_plan, tiny_draft_config, tiny_target_config, write_gguf

BETA = 1.0        # the shared embedding dimension 0
SHARPNESS = 8.0   # q/k norm weight: the score peak is ~40 above any other position's
GAIN = 8.0        # copy amplification: the copied token's logit dominates the residual's own
NOISE = 0.1       # output scale of the layers that carry state but must not decide tokens
ROPE_THETA = 10.0  # high rotary frequencies: one position stands out (gap ~1.9 of 16 pairs)


def agreeing_configs(arch: str = "qwen35") -> tuple[TargetConfig, DraftConfig]:
    """The tiny generator's shapes with full-head RoPE at a small θ (the copy mechanism)."""
    target = tiny_target_config(arch, n_rot=32, rope_theta=ROPE_THETA, rope_sections=(6, 5, 5, 0))
    return target, tiny_draft_config(target, rope_theta=ROPE_THETA)


def agreeing_plans(arch: str, agree: int, *, dtype: str = "f32", seed: int = 0) -> tuple[GGUFPlan, GGUFPlan]:
    """(target, draft) plans of a pair whose draft agrees on `agree` proposals per round."""
    tcfg, dcfg = agreeing_configs(arch)
    if not 0 <= agree < dcfg.block_size:
        raise ValueError(f"agree must be in 0..{dcfg.block_size - 1} (the block size is {dcfg.block_size}), got {agree}")
    period = agree or dcfg.block_size - 1
    target = target_plan(tcfg, dtype=dtype, seed=seed)
    draft = draft_plan(dcfg, target_cfg=tcfg, dtype=dtype, seed=seed + 1)
    _build_target(target.tensors, tcfg, dcfg, period)
    _build_draft(draft.tensors, dcfg, period, copy=agree > 0)
    return target, draft


def write_agreeing_pair(folder: str | os.PathLike[str], arch: str, agree: int, *, dtype: str = "f32",
                        seed: int = 0) -> tuple[Path, Path]:
    """Write target.gguf and draft.gguf of an agreeing pair into `folder`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    target, draft = agreeing_plans(arch, agree, dtype=dtype, seed=seed)
    return write_gguf(folder / "target.gguf", target), write_gguf(folder / "draft.gguf", draft)


def _build_target(t: dict, cfg: TargetConfig, dcfg: DraftConfig, period: int) -> None:
    attention = [i for i, recurrent in enumerate(cfg.layer_is_recurrent) if not recurrent]
    copy_layer = attention[-1]
    if max(dcfg.tap_layers) >= copy_layer:
        raise ValueError(f"the draft taps layers {dcfg.tap_layers}: they must precede the copy layer {copy_layer}")
    t["token_embd.weight"].values[:, 0] = BETA
    t["output_norm.weight"].values[:] = 1.0
    for i in range(cfg.n_layer):
        mixer = "attn_output" if i in attention else "ssm_out"
        if i != copy_layer:
            t[f"blk.{i}.{mixer}.weight"].values *= NOISE
        for name in _ffn_outputs(cfg, i):
            t[name].values *= NOISE
    rope_kw = dict(n_rot=cfg.n_rot, theta=cfg.rope_theta, sections=cfg.rope_sections, interleaved=True)
    _copy_attention(t, f"blk.{copy_layer}", n_head=cfg.n_head, n_head_kv=cfg.n_head_kv, head_dim=cfg.head_dim,
                    hidden=cfg.hidden, lag=period - 1, rope_kw=rope_kw, gated=True, gain=GAIN)


def _build_draft(t: dict, cfg: DraftConfig, period: int, *, copy: bool) -> None:
    fc = t["fc.weight"].values
    fc[:] = 0.0
    fc[:, :cfg.hidden] = np.eye(cfg.hidden)  # the first tap, untouched
    t["enc.output_norm.weight"].values[:] = 1.0
    t["output_norm.weight"].values[:] = 1.0
    for i in range(cfg.n_layer):
        for name in (f"blk.{i}.attn_output.weight", f"blk.{i}.ffn_down.weight"):
            t[name].values *= NOISE
    rope_kw = dict(n_rot=cfg.n_rot, theta=cfg.rope_theta)
    _copy_attention(t, "blk.0", n_head=cfg.n_head, n_head_kv=cfg.n_head_kv, head_dim=cfg.head_dim,
                    hidden=cfg.hidden, lag=period, rope_kw=rope_kw, gated=False, gain=GAIN if copy else 0.0)


def _ffn_outputs(cfg: TargetConfig, i: int) -> list[str]:
    if cfg.is_moe:
        return [f"blk.{i}.ffn_down_exps.weight", f"blk.{i}.ffn_down_shexp.weight"]
    return [f"blk.{i}.ffn_down.weight"]


def _copy_attention(t: dict, prefix: str, *, n_head: int, n_head_kv: int, head_dim: int, hidden: int, lag: int,
                    rope_kw: dict, gated: bool, gain: float) -> None:
    """Attention at `prefix` that copies its input from `lag` positions back (see the module doc)."""
    if n_head_kv * head_dim != hidden:
        raise ValueError(f"a copy layer needs kv heads x head dim = hidden, got {n_head_kv} x {head_dim} != {hidden}")
    query = np.zeros(head_dim, np.float32)
    query[:rope_kw["n_rot"] // 2] = 1.0  # the first component of every rotary pair
    key = rope(query[None, None, :], np.array([lag], np.int32), **rope_kw)[0, 0]
    rows = 2 * head_dim if gated else head_dim  # a gated query projection holds [q_h | gate_h] per head
    wq = np.zeros((n_head, rows, hidden), np.float32)
    wq[:, :head_dim, 0] = query
    t[f"{prefix}.attn_q.weight"].values[:] = wq.reshape(n_head * rows, hidden)
    wk = np.zeros((n_head_kv, head_dim, hidden), np.float32)
    wk[:, :, 0] = key
    t[f"{prefix}.attn_k.weight"].values[:] = wk.reshape(n_head_kv * head_dim, hidden)
    t[f"{prefix}.attn_v.weight"].values[:] = np.eye(hidden)
    for norm in ("attn_q_norm", "attn_k_norm"):
        t[f"{prefix}.{norm}.weight"].values[:] = SHARPNESS
    t[f"{prefix}.attn_norm.weight"].values[:] = 1.0
    group = n_head // n_head_kv  # q head h reads kv head h // group; the output averages a group
    wo = np.zeros((hidden, n_head * head_dim), np.float32)
    for h in range(n_head):
        g = h // group
        wo[g * head_dim:(g + 1) * head_dim, h * head_dim:(h + 1) * head_dim] = np.eye(head_dim) * gain / group
    t[f"{prefix}.attn_output.weight"].values[:] = wo
