"""Memory planning: how long each buffer of a call lives, and which buffers share a slot.

Not a pipeline pass. Which values need a buffer of their own is only known once a graph is
lowered to a launch plan: a reshape is a view of its input, a node may write its output into
an input's buffer (`ctx.alias`), a fused op lowered as parts has temporaries (`ctx.temp`),
weight-only nodes run once at load and keep their results with the weights, and some
kernels read a packed copy of weights. A plan made on the graph could only guess those, and
nothing would read it. So lowering (backends/lowering.py) runs this analysis while it lowers
(`Liveness.dead_after` decides its in-place writes) and `assign`s slots at its end; the slots
are stored in the launch plan (`plan.slots`, `plan.buffers`) and are what the runner
allocates, per set of symbol values. `python -m dflash_ir.passes.report` prints the same
plan's peak (`memory`).

`Liveness` is the one liveness analysis. Positions: BIND (-1), the call's start, where inputs
and states are written (uploaded, or copied from the caller's device arrays); node i runs at
i; END (the node count), after the last node, where the caller reads outputs and state
updates. A buffer is a root value with its views and lives from the position that makes it
to the last position that reads it or any view of it:
- inputs from BIND; states from BIND to END (a caller's device array may point into a
  state's buffer until the next call has copied it in, so it is never reused within a call);
  in a graph marked `replayed` (REPLAYED in its meta: a benchmark launches its kernels again
  and again on inputs uploaded once) inputs to END as well;
- graph outputs and state updates to END (the caller reads them), a state without an update
  too (its buffer comes back in as it is, so nothing may write it);
- a temporary at its node only (unless a node's output is a view of it);
- weights, weight-only values and packed weights are resident: no buffer per call.

`assign` colours the buffers of each symbolic size class greedily, largest first: a slot
holds `bytes * prod(symbols)` (e.g. 1024 bytes per row of T), so one assignment is valid for
every binding of the symbols. Two buffers share a slot only if they are never live at the
same position, and a slot never holds both an input or state and an output or state update:
the caller may pass an output back in (a state update, the rows a commit replays), and
inputs are written at BIND, possibly before that output is copied out of its slot.
"""
from __future__ import annotations

import math
from typing import Mapping, NamedTuple

from dflash_ir.ir import Graph
from dflash_ir.types import TensorType, parse_type

BIND = -1
REPLAYED = "replayed"  # graph meta: inputs keep their buffers to themselves (see the docstring)
Slot = tuple[tuple[str, ...], int]  # (symbols, bytes per unit of their product)


def size_class(t: TensorType) -> Slot:
    """(sorted symbols of the shape, storage bytes per unit of their product)."""
    ints = math.prod(d for d in t.shape if isinstance(d, int))
    return tuple(sorted(d for d in t.shape if isinstance(d, str))), t.dtype.storage_bytes(ints)


def slot_bytes(slot: Slot, bindings: Mapping[str, int]) -> int:
    """Bytes of a slot for these symbol values (at least 4: a device buffer is never empty)."""
    symbols, per_unit = slot
    try:
        return max(4, per_unit * math.prod(int(bindings[s]) for s in symbols))
    except KeyError as e:
        raise KeyError(f"size symbol {e.args[0]!r} is not bound (bindings: {dict(bindings)})") from None


class Liveness:
    """Buffer lifetimes over a graph's nodes, as lowering decides views (`alias`) and
    temporaries (`temp`)."""

    def __init__(self, graph: Graph):
        nodes = graph.nodes
        self.end = len(nodes)
        self.constant_nodes = set(graph.weight_only())
        self.resident = {w.value.name for w in graph.weights} | {v.name for i in self.constant_nodes
                                                                 for v in nodes[i].outputs}
        self.states = {s.value.name for s in graph.states}
        self.bound = {v.name for v in graph.inputs} | self.states
        self.kept = {v for _, v in graph.outputs} | {s.update for s in graph.states if s.update}
        self.made = dict.fromkeys(self.bound, BIND)
        self.read: dict[str, int] = {}
        for i, n in enumerate(nodes):
            self.made.update((v.name, i) for v in n.outputs)
            self.read.update((x, i) for x in n.inputs)
        for v in self.kept | {s.value.name for s in graph.states if s.update is None}:
            self.read[v] = self.end
        if graph.meta_dict.get(REPLAYED):
            self.read.update((v.name, self.end) for v in graph.inputs)
        self.aliases: dict[str, str] = {}       # view -> root
        self.views: dict[str, list[str]] = {}   # root -> its views
        self.temps: set[str] = set()

    def root(self, name: str) -> str:
        return self.aliases.get(name, name)

    def alias(self, view: str, of: str) -> str:
        """`view` shares `of`'s buffer; returns the buffer's root."""
        root = self.root(of)
        self.aliases[view] = root
        self.views.setdefault(root, []).append(view)
        return root

    def temp(self, name: str, index: int) -> None:
        """A temporary of node `index`: made and read by that node's launches."""
        self.temps.add(name)
        self.made[name] = self.read[name] = index
        if index in self.constant_nodes:
            self.resident.add(name)

    def group(self, root: str) -> list[str]:
        return [root, *self.views.get(root, ())]

    def dead_after(self, name: str, index: int) -> bool:
        """True when node `index` may write into `name`'s buffer: no later node and not the
        caller reads it or a view of it, and it is no weight, weight-only value or temporary."""
        root = self.root(name)
        return (root not in self.resident and root not in self.temps
                and all(self.read.get(v, BIND) <= index for v in self.group(root)))

    def lifetimes(self) -> dict[str, tuple[int, int]]:
        """Buffer (root value) -> (first, last position it is live), for every buffer made per call."""
        live = {}
        for root, made in self.made.items():
            if root in self.aliases or root in self.resident:
                continue
            end = self.end if root in self.states else max(max(self.made[v], self.read.get(v, BIND))
                                                           for v in self.group(root))
            live[root] = (made, end)
        return live

    def assign(self, types: Mapping[str, TensorType]) -> tuple[list[Slot], dict[str, int]]:
        """The slots and buffer -> slot of these lifetimes (`types`: every value's type)."""
        live = self.lifetimes()
        kept = {self.root(v) for v in self.kept} | self.states
        return assign(live, {n: size_class(types[n]) for n in live}, self.bound, kept)


def assign(lifetimes: Mapping[str, tuple[int, int]], classes: Mapping[str, Slot], bound: set[str],
           kept: set[str]) -> tuple[list[Slot], dict[str, int]]:
    """(slots, buffer -> slot): per size class, largest buffer first, the first slot where it
    overlaps nobody's lifetime (and a bound buffer meets no kept one, or the reverse)."""
    slots: list[Slot] = []
    held: list[list[tuple[int, int, bool, bool]]] = []  # per slot: (start, end, bound, kept) of its buffers
    where: dict[str, int] = {}
    for name in sorted(lifetimes, key=lambda n: (classes[n][0], -classes[n][1], lifetimes[n], n)):
        symbols, per_unit = classes[name]
        start, end = lifetimes[name]
        is_bound, is_kept = name in bound, name in kept
        for s, (slot_symbols, _) in enumerate(slots):
            if slot_symbols == symbols and all(
                    (e < start or end < b) and not (is_bound and k or is_kept and bd) for b, e, bd, k in held[s]):
                slots[s] = (symbols, max(slots[s][1], per_unit))
                break
        else:
            s = len(slots)
            slots.append((symbols, per_unit))
            held.append([])
        held[s].append((start, end, is_bound, is_kept))
        where[name] = s
    return slots, where


class Memory(NamedTuple):
    """Bytes of one call's buffers for some symbol values."""

    own: int      # every buffer but the states on its own (no reuse)
    planned: int  # the slots of the plan that hold no state
    states: int   # the states' slots

    @property
    def allocated(self) -> int:
        """What the runner allocates for these symbol values."""
        return self.planned + self.states


def memory(graph: Graph, plan, bindings: Mapping[str, int]) -> Memory:
    """The memory of a call of `graph` lowered to `plan` (backends/plan.py), for `bindings`."""
    types = {**{n: v.type for n, v in graph.values().items()}, **{n: parse_type(t) for n, t in plan.temps.items()}}
    states = {s.value.name for s in graph.states}
    state_slots = {plan.buffers[n] for n in states}
    sizes = [slot_bytes(slot, bindings) for slot in plan.slots]
    return Memory(sum(slot_bytes(size_class(types[n]), bindings) for n in plan.buffers if n not in states),
                  sum(b for s, b in enumerate(sizes) if s not in state_slots),
                  sum(sizes[s] for s in state_slots))
