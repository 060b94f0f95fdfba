"""Drives the draft's programs and owns its context cache.

The cache holds K/V of committed positions 0..ctx_len-1 only: features of rejected rows
are never injected and block K/V are never kept, so the draft needs no rollback.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from dflash_ir.errors import ContextOverflowError
from dflash_ir.program import DeviceArray, Program

from .state import zero_states


class DraftRunner:
    """`vocab`: the target id of each row of a reduced draft head (its d2t), which the block
    program's proposals are rows of; None when the draft proposes with the target's head."""

    def __init__(self, programs: Mapping[str, Program], n_ctx: int, *, block_size: int, mask_token_id: int,
                 vocab: np.ndarray | None = None):
        self.programs = programs
        self.n_ctx = n_ctx
        self.block_size = block_size
        self.mask_token_id = mask_token_id
        self.vocab = vocab
        self.reset()

    @property
    def capacity(self) -> int:
        """Cache rows: the context plus room for one block past its last position."""
        return self.n_ctx + self.block_size

    def reset(self) -> None:
        self.states = zero_states(self.programs["inject"].graph, self.capacity)
        self.ctx_len = 0

    def inject(self, features) -> None:
        """Append the features of the next committed positions (ctx_len, ctx_len+1, ...);
        `features` may be a DeviceArray the target left on the device."""
        S = len(features)
        if self.ctx_len + S > self.n_ctx:
            raise ContextOverflowError(f"draft context overflow: {self.ctx_len} + {S} rows exceed {self.n_ctx}")
        res = self.programs["inject"].run({
            "features": features if isinstance(features, DeviceArray) else np.asarray(features, np.float32),
            "positions": np.arange(self.ctx_len, self.ctx_len + S, dtype=np.int32),
            "pos": np.int32(self.ctx_len),
        }, self.states)
        self.states = {**self.states, **res.states}
        self.ctx_len += S

    def propose(self, anchor: int) -> np.ndarray:
        """Greedy proposals for positions ctx_len+1 .. ctx_len+B-1 given the anchor at ctx_len
        (the draft's hidden states and logits stay on the device)."""
        return self._target_ids(self._block(anchor, keep=("hidden", "logits")).outputs["proposals"])

    def block_outputs(self, anchor: int) -> dict[str, np.ndarray]:
        """Every output of the block pass on the host (proposals as target ids, hidden,
        logits): for checks."""
        outputs = self._block(anchor).outputs
        return {**outputs, "proposals": self._target_ids(outputs["proposals"])}

    def _target_ids(self, proposals: np.ndarray) -> np.ndarray:
        return proposals if self.vocab is None else self.vocab[proposals].astype(np.int32)

    def _block(self, anchor: int, keep=()):
        B = self.block_size
        if self.ctx_len + B > self.capacity:
            raise ContextOverflowError(f"draft block at {self.ctx_len} needs {B} rows past the context size {self.n_ctx}")
        tokens = np.full(B, self.mask_token_id, np.int32)
        tokens[0] = anchor
        return self.programs["block"].run({
            "tokens": tokens,
            "positions": np.arange(self.ctx_len, self.ctx_len + B, dtype=np.int32),
            "pos": np.int32(self.ctx_len),
            "kv_len": np.int32(self.ctx_len + B),
        }, self.states, keep=keep)
