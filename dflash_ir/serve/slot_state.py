"""One slot's own copy of a sequence's state, over programs that every slot shares.

On a kernel backend a program's states and kept outputs come back as `DeviceArray`s inside
that program's buffers, valid only until the same program runs again. Two sequences that
take turns on one set of programs would overwrite each other's KV caches, Gated DeltaNet
states and tap features. A slot therefore
  * copies the tap features a target call returns into its own device buffer at once (the
    engine holds them from one round to the next, where nothing else can reach them), and
  * when another slot is about to run, or a batched verify pass (which binds each of its
    slots' states by position in the batch) is (`own_states`), copies its runners' states
    into its own device buffers, from where the runner copies them back in on the slot's
    next call.
Both are device-to-device copies (no host round trip); a single busy slot copies nothing but
the features. The reference interpreter returns fresh host arrays, which need no copy.
"""
from __future__ import annotations

import copy

from dflash_ir.program import DeviceArray
from dflash_ir.runtime.draft_runner import DraftRunner
from dflash_ir.runtime.engine import Engine
from dflash_ir.runtime.target_runner import TargetOutput, TargetRunner


class OwnedBuffers:
    """Device buffers that belong to one slot, one per name, grown on demand."""

    def __init__(self):
        self._buffers: dict[str, tuple[object, int]] = {}
        self.copied_bytes = 0  # for measurements: device bytes copied into these buffers so far

    def own(self, name: str, array, rows: int | None = None):
        """`array` as this slot's: a DeviceArray is copied into the buffer for `name` (unless it
        already lives there); anything else is already private and returned as it is. With
        `rows`, only the first `rows` rows hold data (a KV cache's filled positions; readers
        ignore the rest), so only they are copied."""
        if not isinstance(array, DeviceArray) or array.nbytes == 0:
            return array
        buffer, size = self._buffers.get(name, (None, 0))
        if array.buffer is buffer:
            return array
        if size < array.nbytes:
            buffer, size = array.device.alloc(array.nbytes), array.nbytes
            self._buffers[name] = (buffer, size)
        nbytes = array.nbytes if rows is None else min(rows, len(array)) * (array.nbytes // len(array))
        if nbytes:
            array.device.copy(array.buffer, array.offset, buffer, 0, nbytes)
        self.copied_bytes += nbytes
        return DeviceArray(array.device, buffer, array.shape, array.dtype)


class SlotTargetRunner(TargetRunner):
    """A target runner whose calls hand back tap features in the slot's own buffer."""

    def __init__(self, programs, n_ctx: int):
        self.features_store = OwnedBuffers()
        super().__init__(programs, n_ctx)

    def prefill(self, tokens, **kw) -> TargetOutput:
        return self.own_features(super().prefill(tokens, **kw))

    def verify(self, tokens) -> TargetOutput:
        return self.own_features(super().verify(tokens))

    def own_features(self, out: TargetOutput) -> TargetOutput:
        """`out` with its tap features copied into this slot's buffer (the program's next run,
        or a batched pass's, would overwrite them)."""
        out.device_features = self.features_store.own("features", out.device_features)
        return out


class SlotEngine:
    """An Engine with runners (and so state) of its own over the shared engine's programs,
    plus what it takes to make that state its own before another slot runs.

    The engine is a shallow copy of the shared one, so it keeps everything the shared engine
    was configured with (tokenizer, chat template, n_max, a length controller if any) and
    differs only in its runners and its last generation's stats."""

    def __init__(self, shared: Engine):
        self.engine = copy.copy(shared)
        self.engine.target = SlotTargetRunner(shared.target.programs, shared.n_ctx)
        if shared.draft is not None:
            self.engine.draft = DraftRunner(shared.draft.programs, shared.draft.n_ctx,
                                            block_size=shared.draft.block_size, mask_token_id=shared.draft.mask_token_id,
                                            vocab=shared.draft.vocab)
        self.engine.last_stats, self.engine.last_rounds = None, []
        self._stores = {"target": OwnedBuffers(), "draft": OwnedBuffers()}
        self._by_position = {role: _position_major(runner.programs) for role, runner in
                             (("target", self.engine.target), ("draft", self.engine.draft)) if runner is not None}

    def own_states(self) -> None:
        """Copy the states the last call left in shared program buffers into this slot's own
        (of a KV cache, only the positions filled so far)."""
        target, draft = self.engine.target, self.engine.draft
        for role, runner, filled in (("target", target, target.n_past),
                                     ("draft", draft, draft.ctx_len if draft is not None else 0)):
            if runner is not None:
                store, by_position = self._stores[role], self._by_position[role]
                runner.states = {name: store.own(name, value, filled if name in by_position else None)
                                 for name, value in runner.states.items()}

    @property
    def copied_bytes(self) -> int:
        """Device bytes this slot has copied into its own buffers (states and features)."""
        return sum(s.copied_bytes for s in self._stores.values()) + self.engine.target.features_store.copied_bytes


def _position_major(programs) -> set[str]:
    """The KV caches (State.by_position): row i is position i."""
    return {st.value.name for program in programs.values() for st in program.graph.states if st.by_position}
