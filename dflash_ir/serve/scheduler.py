"""Slots and the scheduler of dflash-serve: `-np N` sequences take turns, one round each.

One thread runs every engine call (`run`), so the device sees one sequence at a time. Each
cycle admits waiting jobs into free slots, then advances every busy slot by one step of its
engine's `iter_tokens` (the prefill for a new job, else one speculative round), in slot
order: with k busy slots each gets every k-th round. Before a slot runs, the slot that ran
last copies its state out of the shared program buffers (`SlotEngine.own_states`). A job
whose client went away is dropped before its slot's next step, so its slot is free within
one round. Jobs beyond the free slots wait in a bounded queue; past the bound `submit`
raises `QueueFull` (the HTTP layer answers 503 with Retry-After).
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterator

from dflash_ir.runtime.engine import Engine
from dflash_ir.runtime.stats import GenerationStats

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
        self.tokens: Iterator[list[int]] | None = None

    @property
    def busy(self) -> bool:
        return self.job is not None


class Scheduler:
    def __init__(self, engine: Engine, n_slots: int, queue_size: int, metrics=None):
        if n_slots < 1:
            raise ValueError(f"the number of slots (-np) must be at least 1, got {n_slots}")
        if queue_size < 0:
            raise ValueError(f"the queue size must be >= 0, got {queue_size}")
        self.slots = [Slot(i, engine) for i in range(n_slots)]
        self.queue_size = queue_size
        self.metrics = metrics
        self._waiting: deque[Job] = deque()
        self._wake = threading.Condition()
        self._last: Slot | None = None  # the slot whose state may sit in the shared program buffers

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
        """One cycle: admit waiting jobs, one step for each busy slot. False when idle."""
        self._admit()
        busy = [s for s in self.slots if s.busy]
        for slot in busy:
            self._advance(slot)
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
                    slot.tokens = slot.state.engine.iter_tokens(prompt_ids=job.prompt_ids, **job.options)

    def _advance(self, slot: Slot) -> None:
        job = slot.job
        if job.cancelled:
            self._release(slot, "cancelled")
            return
        if self._last is not None and self._last is not slot and self._last.busy:
            self._last.state.own_states()
        self._last = slot
        try:
            ids = next(slot.tokens)
        except StopIteration:
            self._finish(slot)
            return
        except Exception as e:  # the engine's own message; the server goes on with the other slots
            job.deliver(Failed(f"{type(e).__name__}: {e}"))
            self._release(slot, "failed")
            return
        job.steps += 1
        if job.steps == 1:
            job.first_token = time.perf_counter()
        if ids:
            job.deliver(Tokens(ids))
        stats = slot.state.engine.last_stats
        if stats is not None and stats.stop_reason:  # the engine has stopped: no need to wait for its return
            self._finish(slot)

    def _finish(self, slot: Slot) -> None:
        ending = self._ending(slot)
        slot.job.deliver(ending)
        self._release(slot, "finished", ending)

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
        slot.tokens.close()
        slot.job, slot.tokens = None, None
        if self._last is slot:
            self._last = None
