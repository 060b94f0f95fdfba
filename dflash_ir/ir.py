"""The tensor IR: SSA values, immutable nodes, and graphs with explicit state.

A graph is plain, frozen data. Weights are values that *reference* a tensor of a model
file (never copied at build time); states are values the runtime owns between calls
(KV caches, conv and recurrent states) whose new content a graph declares as an
in-place update. Passes build new graphs; nothing mutates one.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

from .types import TensorType


@dataclass(frozen=True)
class Value:
    name: str
    type: TensorType

    def __str__(self) -> str:
        return f"%{self.name}: {self.type}"


def freeze_attr(v: Any) -> Any:
    """Attributes are hashable plain data: lists become tuples, numpy scalars Python ones."""
    if isinstance(v, (list, tuple)):
        return tuple(freeze_attr(x) for x in v)
    if hasattr(v, "item") and not isinstance(v, (str, bytes)):
        return v.item()
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    if hasattr(v, "value") and isinstance(getattr(v, "value"), str):  # enums such as DType
        return v.value
    raise TypeError(f"attribute value {v!r} of type {type(v).__name__} is not plain data")


@dataclass(frozen=True)
class Node:
    op: str
    inputs: tuple[str, ...]
    outputs: tuple[Value, ...]
    attrs: tuple[tuple[str, Any], ...] = ()

    @staticmethod
    def make(op: str, inputs, outputs, attrs: Mapping[str, Any] | None = None) -> "Node":
        frozen = tuple(sorted((k, freeze_attr(v)) for k, v in (attrs or {}).items()))
        return Node(op, tuple(inputs), tuple(outputs), frozen)

    @property
    def attr(self) -> dict[str, Any]:
        return dict(self.attrs)


@dataclass(frozen=True)
class Weight:
    """A constant bound from a model file: `source` names the file role ("target", "draft")."""

    value: Value
    tensor: str
    source: str = "model"


CAPACITY = "C"  # the size symbol of a state's context capacity (a KV cache's rows)


@dataclass(frozen=True)
class State:
    """A runtime-owned buffer: read as `value`, replaced by the value named `update` (if any)."""

    value: Value
    update: str | None = None

    @property
    def by_position(self) -> bool:
        """Row i holds position i (a KV cache): a call writes only the rows of the positions it
        processes and readers stop at the committed length, so the state is rolled back by its
        length alone, and rows past that length may be overwritten by any call."""
        return self.value.type.shape[:1] == (CAPACITY,)


@dataclass(frozen=True)
class Graph:
    name: str
    inputs: tuple[Value, ...] = ()
    weights: tuple[Weight, ...] = ()
    states: tuple[State, ...] = ()
    nodes: tuple[Node, ...] = ()
    outputs: tuple[tuple[str, str], ...] = ()
    meta: tuple[tuple[str, Any], ...] = field(default=())

    def values(self) -> dict[str, Value]:
        """Every value defined in the graph, by name."""
        out: dict[str, Value] = {}
        for v in self.inputs:
            out[v.name] = v
        for w in self.weights:
            out[w.value.name] = w.value
        for s in self.states:
            out[s.value.name] = s.value
        for n in self.nodes:
            for v in n.outputs:
                out[v.name] = v
        return out

    def producers(self) -> dict[str, Node]:
        return {v.name: n for n in self.nodes for v in n.outputs}

    def users(self) -> dict[str, list[Node]]:
        out: dict[str, list[Node]] = {}
        for n in self.nodes:
            for i in n.inputs:
                out.setdefault(i, []).append(n)
        return out

    def output(self, name: str) -> Value:
        for out_name, value_name in self.outputs:
            if out_name == name:
                return self.values()[value_name]
        raise KeyError(f"graph {self.name} has no output {name!r}")

    def op_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for n in self.nodes:
            counts[n.op] = counts.get(n.op, 0) + 1
        return dict(sorted(counts.items()))

    def weight_only(self) -> list[int]:
        """Indices of the nodes computed from weights only (directly or through other such
        nodes): run once per program, when it loads, their outputs kept with the weights."""
        constant = {w.value.name for w in self.weights}
        found = []
        for i, n in enumerate(self.nodes):
            if n.inputs and all(x in constant for x in n.inputs):
                found.append(i)
                constant.update(v.name for v in n.outputs)
        return found

    def walk(self) -> Iterator[Node]:
        return iter(self.nodes)

    @property
    def meta_dict(self) -> dict[str, Any]:
        return dict(self.meta)

    @property
    def symbols(self) -> set[str]:
        return {s for v in self.values().values() for s in v.type.symbols}
