"""The memory a compiled pair will need, worked out from its graphs before anything is
allocated, and refused when the machine does not have it.

States (KV caches, conv and recurrent states) are sized exactly: the target's with
capacity C = n_ctx, the draft's with C = n_ctx + block size (runtime/draft_runner.py).
Weights count as stored in the GGUFs (kernel backends upload them) or as float32 (the numpy
interpreter dequantises them). Activations count every program's outputs at its largest
call: a prefill chunk of PREFILL_CHUNK rows, a verify or draft block of block-size rows.
Intermediate values come on top, so the total is a lower bound: a context it refuses
cannot run, and a context it accepts gets this far before allocating. It is one sequence's
need: a batched verify (graph meta "slots", dflash-serve's) takes other sequences' states,
so its states are not counted as this sequence's (its outputs are activations).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np

from .errors import DflashError
from .ir import Graph, Weight
from .quant import storage_shape

PREFILL_CHUNK = 512   # TargetRunner.prefill's chunk
GIB = 1 << 30


class MemoryLimitError(DflashError):
    """A model and context that need more memory than the machine has."""


@dataclass(frozen=True)
class MemoryNeed:
    weights: int
    kv: int           # attention K/V caches (sized by the context)
    recurrent: int    # conv and Gated DeltaNet states (fixed per layer)
    activations: int  # every other output of every program at its largest call
    n_ctx: int

    @property
    def states(self) -> int:
        return self.kv + self.recurrent

    @property
    def total(self) -> int:
        return self.weights + self.states + self.activations

    def describe(self) -> str:
        return (f"{_gib(self.total)} (weights {_gib(self.weights)}, states {_gib(self.states)} for a context of "
                f"{self.n_ctx} tokens: KV caches {_gib(self.kv)}, recurrent states {_gib(self.recurrent)}; "
                f"activations {_gib(self.activations)})")


def memory_need(graphs: Mapping[str, Graph], weight_bytes: Callable[[Weight], int], n_ctx: int,
                block_size: int) -> MemoryNeed:
    """What the programs `graphs` ('target.*', 'draft.*') need with this context and block.
    States count once per model: the programs of one load share its KV caches
    (State.by_position, backends/runner.py); the recurrent states, a small part at real
    context sizes, are held once per program that runs."""
    rows = {"prefill": min(PREFILL_CHUNK, n_ctx), "verify": block_size, "commit": block_size, "decode": 1,
            "inject": min(PREFILL_CHUNK, n_ctx), "block": block_size}
    weights = {(w.source, w.tensor): weight_bytes(w) for g in graphs.values() for w in g.weights}
    kv, recurrent = {}, {}
    for role, capacity in (("target", n_ctx), ("draft", n_ctx + block_size)):
        for name, g in graphs.items():
            for s in g.states if name.startswith(f"{role}.") and not g.meta_dict.get("slots") else ():
                kind = kv if s.by_position else recurrent
                kind[role, s.value.name] = _nbytes(s.value, {"C": capacity})
    activations = 0
    for name, g in graphs.items():
        t = rows[g.meta_dict.get("kind", name.split(".", 1)[1])]  # a batched verify's rows are static
        bindings = {"C": n_ctx + block_size, "T": t, "R": t, "S": t}
        values = g.values()
        activations += sum(_nbytes(values[v], bindings) for _, v in g.outputs)
    return MemoryNeed(sum(weights.values()), sum(kv.values()), sum(recurrent.values()), activations, n_ctx)


def machine_memory() -> int:
    """Physical memory of this machine in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_memory(need: MemoryNeed, where: str, available: int | None = None) -> None:
    """Refuse a need above the machine's memory (or `available` bytes), saying what to change."""
    available = machine_memory() if available is None else available
    if need.total > available:
        raise MemoryLimitError(f"{where}: needs at least {need.describe()}, more than the {_gib(available)} of memory "
                               "this machine has; compile with a smaller context (-c N)")


def _nbytes(v, bindings: Mapping[str, int]) -> int:
    shape = storage_shape(v.type.concrete(bindings), v.type.dtype)
    return int(np.prod(shape, dtype=np.float64)) * v.type.dtype.numpy().itemsize


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"
