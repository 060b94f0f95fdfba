"""Drives the draft's programs and owns its context cache.

The cache holds K/V of committed positions 0..ctx_len-1 only: features of rejected rows
are never injected and block K/V are never kept, so the draft needs no rollback.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from dflash_ir.errors import ContextOverflowError

from .state import zero_states


class DraftRunner:
    def __init__(self, programs: Mapping[str, object], n_ctx: int, *, block_size: int, mask_token_id: int):
        self.programs = programs
        self.n_ctx = n_ctx
        self.block_size = block_size
        self.mask_token_id = mask_token_id
        self.reset()

    @property
    def capacity(self) -> int:
        """Cache rows: the context plus room for one block past its last position."""
        return self.n_ctx + self.block_size

    def reset(self) -> None:
        self.states = zero_states(self.programs["inject"].graph, self.capacity)
        self.ctx_len = 0

    def inject(self, features: np.ndarray) -> None:
        """Append the features of the next committed positions (ctx_len, ctx_len+1, ...)."""
        S = len(features)
        if self.ctx_len + S > self.n_ctx:
            raise ContextOverflowError(f"draft context overflow: {self.ctx_len} + {S} rows exceed {self.n_ctx}")
        res = self.programs["inject"].run({
            "features": np.asarray(features, np.float32),
            "positions": np.arange(self.ctx_len, self.ctx_len + S, dtype=np.int32),
            "pos": np.int32(self.ctx_len),
        }, self.states)
        self.states = {**self.states, **res.states}
        self.ctx_len += S

    def propose(self, anchor: int) -> tuple[np.ndarray, dict]:
        """Greedy proposals for positions ctx_len+1 .. ctx_len+B-1 given the anchor at ctx_len."""
        B = self.block_size
        if self.ctx_len + B > self.capacity:
            raise ContextOverflowError(f"draft block at {self.ctx_len} needs {B} rows past the context size {self.n_ctx}")
        tokens = np.full(B, self.mask_token_id, np.int32)
        tokens[0] = anchor
        res = self.programs["block"].run({
            "tokens": tokens,
            "positions": np.arange(self.ctx_len, self.ctx_len + B, dtype=np.int32),
            "pos": np.int32(self.ctx_len),
            "kv_len": np.int32(self.ctx_len + B),
        }, self.states)
        return res.outputs["proposals"], res.outputs
