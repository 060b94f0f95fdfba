"""plan_memory: assign activations to reusable buffer slots (analysis only; numerics untouched).

Activations are node outputs except state updates (they are written into their state's
buffer) and weight-only values (constants, computed once per program). Each lives from
the node that makes it to its last reader in schedule order, or to the end for a graph
output. Two activations whose lifetimes overlap interfere; slots are a colouring of that
interference graph (networkx greedy colouring, largest buffer first), done separately for
each symbolic size class: a buffer of `c * T` bytes only shares with other `* T` buffers,
so one plan is valid for every binding of the symbols (sizes are kept as bytes per row).

The plan goes into graph meta:
    memory_slots: ((symbols, bytes), ...)   slot i holds bytes * prod(symbols)
    memory_plan:  ((value, slot), ...)
`report(graph, bindings)` gives (bytes with every activation in its own buffer, bytes of
the slots) for concrete sizes.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Mapping

import networkx as nx

from dflash_ir.ir import Graph, Value


def size_class(v: Value) -> tuple[tuple[str, ...], int]:
    """(sorted symbols, bytes per unit of their product)."""
    t = v.type
    ints = math.prod(d for d in t.shape if isinstance(d, int))
    return tuple(sorted(d for d in t.shape if isinstance(d, str))), t.dtype.storage_bytes(ints)


def lifetimes(graph: Graph) -> dict[str, tuple[int, int]]:
    """Activation -> (index of the node making it, index of its last reader; len(nodes) for outputs)."""
    constant = {w.value.name for w in graph.weights}
    updates = {s.update for s in graph.states if s.update}
    outputs = {v for _, v in graph.outputs}
    live: dict[str, tuple[int, int]] = {}
    for i, n in enumerate(graph.nodes):
        if n.inputs and all(x in constant for x in n.inputs):
            constant.update(v.name for v in n.outputs)
            continue
        for x in n.inputs:
            if x in live:
                live[x] = (live[x][0], max(live[x][1], i))
        for v in n.outputs:
            if v.name not in updates:
                live[v.name] = (i, len(graph.nodes) if v.name in outputs else i)
    return live


def interference(live: Mapping[str, tuple[int, int]]) -> nx.Graph:
    g = nx.Graph()
    g.add_nodes_from(live)
    active: list[str] = []
    for name in sorted(live, key=lambda n: live[n]):
        start = live[name][0]
        active = [a for a in active if live[a][1] >= start]
        g.add_edges_from((name, a) for a in active)
        active.append(name)
    return g


def plan(graph: Graph) -> tuple[list[tuple[tuple[str, ...], int]], dict[str, int]]:
    """(slots as (symbols, bytes), activation -> slot)."""
    live = lifetimes(graph)
    values = graph.values()
    classes: dict[tuple[str, ...], list[str]] = {}
    for name in live:
        classes.setdefault(size_class(values[name])[0], []).append(name)
    slots: list[tuple[tuple[str, ...], int]] = []
    assign: dict[str, int] = {}
    for symbols, names in sorted(classes.items()):
        size = {n: size_class(values[n])[1] for n in names}
        colours = _colour({n: live[n] for n in names}, size)
        base = len(slots)
        for c in range(max(colours.values(), default=-1) + 1):
            slots.append((symbols, max(size[n] for n, k in colours.items() if k == c)))
        assign.update({n: base + c for n, c in colours.items()})
    return slots, assign


def _colour(live: Mapping[str, tuple[int, int]], size: Mapping[str, int]) -> dict[str, int]:
    """Greedy colouring of the interference graph, largest buffer first."""
    order = sorted(live, key=lambda n: (-size[n], live[n]))
    return nx.greedy_color(interference(live), strategy=lambda graph, colours: iter(order))


def plan_memory(graph: Graph) -> Graph:
    slots, assign = plan(graph)
    meta = {**graph.meta_dict, "memory_slots": tuple(slots), "memory_plan": tuple(sorted(assign.items()))}
    return replace(graph, meta=tuple(sorted(meta.items())))


def _bytes(symbols, per_unit: int, bindings: Mapping[str, int]) -> int:
    try:
        return per_unit * math.prod(int(bindings[s]) for s in symbols)
    except KeyError as e:
        raise KeyError(f"size symbol {e.args[0]!r} is not bound (bindings: {dict(bindings)})") from None


def report(graph: Graph, bindings: Mapping[str, int]) -> tuple[int, int]:
    """(peak bytes with every activation its own buffer, peak bytes with the slots of the plan)."""
    meta = graph.meta_dict
    slots = meta["memory_slots"] if "memory_slots" in meta else plan(graph)[0]
    values = graph.values()
    before = sum(_bytes(*size_class(values[n]), bindings) for n in lifetimes(graph))
    return before, sum(_bytes(symbols, b, bindings) for symbols, b in slots)


def check_plan(graph: Graph) -> None:
    """Raise ValueError unless the stored plan covers every activation, slot sizes fit, and
    no two activations that are live together share a slot."""
    meta = graph.meta_dict
    slots, assign = meta["memory_slots"], dict(meta["memory_plan"])
    live, values = lifetimes(graph), graph.values()
    if set(assign) != set(live):
        raise ValueError(f"plan covers {sorted(set(assign) ^ set(live))[:5]} wrongly")
    for name, slot in assign.items():
        symbols, per_unit = size_class(values[name])
        if tuple(slots[slot][0]) != symbols or slots[slot][1] < per_unit:
            raise ValueError(f"%{name} ({values[name].type}) does not fit slot {slot} {slots[slot]}")
    for a, b in interference(live).edges:
        if assign[a] == assign[b]:
            raise ValueError(f"%{a} and %{b} are live together but share slot {assign[a]}")
