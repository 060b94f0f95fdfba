"""Slots and the scheduler of dflash-serve: `-np N` sequences advance together, one round each.

One thread runs every engine call (`run`). Each cycle admits waiting jobs into free slots,
then advances every busy slot by one step of its engine's `steps` (the prefill for a new
job, else a decode step or a speculative round). A round stops at its verify: the slot's
draft has run and its block waits. With `batch` (the default) the waiting blocks are then
verified together, in passes of the batched verify programs the artifact holds (2 and 4
sequences: artifact.VERIFY_SLOTS; the most blocks per pass first, a lone block left over on
the single verify), one target pass and one product launch per weight for all of them
(whose kernels still read a weight once per 16-row group: kernels/linalg.py), and each slot takes
its rows' result to accept, commit and deliver its tokens. Blocks shorter than the draft's
block are padded (target_runner.verify_together), so slots at any positions and any round
lengths share a pass; a block whose padding would run past the context is verified alone.
Without `batch` (or batched programs, or a second slot) each round runs through at once,
its block verified alone: slots take turns round by round.

Programs' states and outputs live in their buffers until the same program runs again, so
before a slot runs a program of its own (its prefill, decode, draft or lone verify) every
other slot whose states may sit in shared buffers copies them into buffers of its own
(`SlotEngine.own_states`); so does every such slot before a batched pass, which then leaves
its slots' states in its buffers, and each slot of that pass once it has committed, before
the next slot's commit runs the target's commit program (whose buffers hold the recurrent
states it replayed). A job whose client went away is dropped before its slot's
next step, so its slot is free within one round. Jobs beyond the free slots wait in a
bounded queue; past the bound `submit` raises `QueueFull` (the HTTP layer answers 503 with
Retry-After).
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Generator

from dflash_ir.artifact import VERIFY_SLOTS, batched_verify
from dflash_ir.runtime.engine import Engine, VerifyBlock
from dflash_ir.runtime.stats import GenerationStats
from dflash_ir.runtime.target_runner import verify_together

from .slot_state import SlotEngine


def speculates(engine: Engine, wanted: bool) -> bool:
    """Whether requests run speculatively: wanted (no --no-spec), a draft, and proposals to verify
    (--spec-draft-n-max 0 drafts nothing)."""
    return wanted and engine.draft is not None and engine.n_max > 0


class QueueFull(Exception):
    """Every slot is busy and the waiting queue is at its bound."""


@dataclass
class Tokens:
    """Token ids one step committed."""
    ids: list[int]


@dataclass
class Finished:
    """The job ended: its stats, the wall time of its prompt and of its generation, and the
    engine steps it ran (the prefill, then one per round or decode step)."""
    stats: GenerationStats
    prompt_seconds: float
    predicted_seconds: float
    steps: int


@dataclass
class Failed:
    """The engine raised; the message says what happened."""
    message: str


@dataclass
class Job:
    """One request's generation. `deliver` is called from the scheduler thread with Tokens,
    then one Finished or Failed; a cancelled job gets neither end (a Tokens event may still
    cross the cancel)."""
    prompt_ids: list[int]
    options: dict  # keyword arguments of Engine.iter_tokens (max_tokens, sampling, stop, ...)
    deliver: Callable[[object], None]
    cancelled: bool = False
    first_token: float = 0.0
    steps: int = 0  # engine steps run for this job (prefill, rounds)


class Slot:
    def __init__(self, index: int, shared: Engine):
        self.index = index
        self.state = SlotEngine(shared)
        self.job: Job | None = None
        self.steps: Generator | None = None  # the job's Engine.steps

    @property
    def target(self):
        return self.state.engine.target

    @property
    def busy(self) -> bool:
        return self.job is not None


class Scheduler:
    def __init__(self, engine: Engine, n_slots: int, queue_size: int, metrics=None, batch: bool = True):
        if n_slots < 1:
            raise ValueError(f"the number of slots (-np) must be at least 1, got {n_slots}")
        if queue_size < 0:
            raise ValueError(f"the queue size must be >= 0, got {queue_size}")
        self.slots = [Slot(i, engine) for i in range(n_slots)]
        self.queue_size = queue_size
        self.metrics = metrics
        # batched verify programs by blocks per pass, most first (none without batching)
        self._batched = {s: engine.target.programs[batched_verify(s)] for s in sorted(VERIFY_SLOTS, reverse=True)
                         if batch and batched_verify(s) in engine.target.programs and s <= n_slots}
        self._rows = engine.draft.block_size if self._batched else 0  # rows per block of a batched pass
        self._run_batched_once()
        self._waiting: deque[Job] = deque()
        self._wake = threading.Condition()
        self._exposed: set[Slot] = set()  # slots whose states may sit in shared program buffers
        self.verify_passes = 0  # target verify passes run, batched or alone
        self.verified_blocks = 0  # blocks they verified

    def _run_batched_once(self) -> None:
        """One pass of each batched verify on the idle slots, its results dropped: a device that
        builds a kernel on its first launch (PoCL: seconds) does it before the first request, as
        the load does for the other programs (runtime/costs.run_every_size)."""
        for size, program in self._batched.items():
            targets = [slot.target for slot in self.slots[:size]]
            verify_together(targets, [[0]] * size, program)
            for target in targets:
                target.reset()

    @property
    def queued(self) -> int:
        return len(self._waiting)

    @property
    def busy_slots(self) -> int:
        return sum(s.busy for s in self.slots)

    def submit(self, job: Job) -> None:
        with self._wake:
            free = sum(not s.busy for s in self.slots)
            if len(self._waiting) >= free + self.queue_size:
                raise QueueFull(f"all {len(self.slots)} slots are busy and {self.queue_size} requests are waiting")
            self._waiting.append(job)
            self._wake.notify()

    def cancel(self, job: Job) -> None:
        """The client is gone: drop the job before its next step (or from the queue)."""
        with self._wake:
            job.cancelled = True
            if job in self._waiting:
                self._waiting.remove(job)
            self._wake.notify()

    def step(self) -> bool:
        """One cycle: admit waiting jobs, one step for each busy slot (its verify batched with
        the others'). False when idle."""
        self._admit()
        busy = [s for s in self.slots if s.busy]
        blocks = []  # (slot, block) of the rounds waiting for their verify
        for slot in busy:
            block = self._advance(slot)
            if block is not None and self._batched:
                blocks.append((slot, block))
            elif block is not None:  # without batched programs a round runs through at once
                self._verify([(slot, block)])
        for group in self._groups(blocks):
            self._verify(group)
        return bool(busy)

    def run(self, stop: threading.Event) -> None:
        """The scheduler thread: cycles while there is work, sleeps until a submit otherwise."""
        while not stop.is_set():
            if not self.step():
                with self._wake:
                    if not self._waiting:
                        self._wake.wait(timeout=0.5)

    def _admit(self) -> None:
        with self._wake:
            for slot in self.slots:
                if not slot.busy and self._waiting:
                    job = self._waiting.popleft()
                    slot.job = job
                    slot.steps = slot.state.engine.steps(prompt_ids=job.prompt_ids, **job.options)

    def _own_others(self, running: set[Slot]) -> None:
        """Every slot not in `running` copies its states out of shared program buffers."""
        for other in self._exposed - running:
            if other.busy:
                other.state.own_states()
        self._exposed &= running

    def _advance(self, slot: Slot, verified=None) -> VerifyBlock | None:
        """Run the slot's job to its next step's end (deliver its tokens) or to its round's
        verify (return the block); `verified` answers the block it returned last time."""
        job = slot.job
        if job.cancelled:
            self._release(slot, "cancelled")
            return None
        if verified is None:
            self._own_others({slot})
        self._exposed.add(slot)
        try:
            item = slot.steps.send(verified) if verified is not None else next(slot.steps)
        except StopIteration:
            self._finish(slot)
            return None
        except Exception as e:  # the engine's own message; the server goes on with the other slots
            self._fail(slot, f"{type(e).__name__}: {e}")
            return None
        if isinstance(item, VerifyBlock):
            return item
        job.steps += 1
        if job.steps == 1:
            job.first_token = time.perf_counter()
        if item:
            job.deliver(Tokens(item))
        stats = slot.state.engine.last_stats
        if stats is not None and stats.stop_reason:  # the engine has stopped: no need to wait for its return
            self._finish(slot)
        return None

    def _groups(self, blocks: list[tuple[Slot, VerifyBlock]]) -> list[list[tuple[Slot, VerifyBlock]]]:
        """Blocks in passes: as many as the largest batched program takes while enough fit
        one (its rows and the context), the rest alone."""
        fits, alone = [], []
        for slot, block in blocks:
            room = len(block.tokens) <= self._rows and slot.target.n_past + self._rows <= slot.target.n_ctx
            (fits if self._batched and room else alone).append((slot, block))
        groups = []
        for size in self._batched:
            while len(fits) >= size:
                groups.append(fits[:size])
                fits = fits[size:]
        return groups + [[b] for b in fits + alone]

    def _verify(self, group: list[tuple[Slot, VerifyBlock]]) -> None:
        """One target pass for the group's blocks, then each slot's round goes on from it."""
        slots = [slot for slot, _ in group]
        # a batched pass binds its slots' states by position: none may still sit in its buffers
        self._own_others(set(slots) if len(group) == 1 else set())
        try:
            if len(group) == 1:
                outs = [slots[0].target.verify(group[0][1].tokens)]
            else:
                outs = verify_together([s.target for s in slots], [b.tokens for _, b in group],
                                       self._batched[len(group)])
                outs = [s.target.own_features(out) for s, out in zip(slots, outs)]
        except Exception as e:
            for slot in slots:
                self._fail(slot, f"{type(e).__name__}: {e}")
            return
        self._exposed |= set(slots)
        self.verify_passes += 1
        self.verified_blocks += len(group)
        if self.metrics is not None:
            self.metrics.verified(len(group))
        for i, (slot, out) in enumerate(zip(slots, outs)):
            self._own_others(set(slots[i:]))  # the slots before this one have committed
            self._advance(slot, out)

    # a job's answer is delivered after its slot is released: a client that has it finds the
    # slot free and the request counted (metrics, /slots)
    def _fail(self, slot: Slot, message: str) -> None:
        job = slot.job
        self._release(slot, "failed")
        job.deliver(Failed(message))

    def _finish(self, slot: Slot) -> None:
        job, ending = slot.job, self._ending(slot)
        self._release(slot, "finished", ending)
        job.deliver(ending)

    @staticmethod
    def _ending(slot: Slot) -> Finished:
        """The job's stats and wall times: the prompt's (prefill), and the generation's, from the
        first token to now, which includes the other slots' turns in between (as llama-server)."""
        job, stats = slot.job, slot.state.engine.last_stats
        generating = time.perf_counter() - job.first_token if job.steps else 0.0
        return Finished(stats, stats.seconds["prefill"], generating, job.steps)

    def _release(self, slot: Slot, outcome: str, ending: Finished | None = None) -> None:
        if self.metrics is not None:
            self.metrics.job_ended(ending or (self._ending(slot) if slot.job.steps else None), outcome)
        slot.steps.close()
        slot.job, slot.steps = None, None
        self._exposed.discard(slot)
