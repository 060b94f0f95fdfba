"""The reference interpreter: runs any graph with the ops' numpy references.

It is the living definition of a graph's meaning and the oracle every backend is tested
against. Weights are bound lazily through a loader (`(Weight) -> storage array`, e.g. a
view into a memory-mapped GGUF); nodes that depend on weights only (such as dequantising
a weight) are computed once per interpreter and reused across calls. An Interpreter is a
`dflash_ir.program.Program` (what the numpy backend loads).
"""
from __future__ import annotations

from typing import Collection, Mapping

import numpy as np

from .ir import Graph, Value
from .ops.registry import get_op
from .program import BindError, RunResult, WeightLoader, check_weight
from .quant import storage_shape


class Interpreter:
    def __init__(self, graph: Graph, load_weight: WeightLoader):
        self.graph = graph
        self._load_weight = load_weight
        self._weights = {w.value.name: w for w in graph.weights}
        self._ops = {n.op: get_op(n.op) for n in graph.nodes}
        self._folded = set(graph.weight_only())
        self._cache: dict[str, np.ndarray] = {}

    def _weight(self, name: str) -> np.ndarray:
        if name not in self._cache:
            w = self._weights[name]
            arr = self._load_weight(w)
            check_weight(self.graph, w, arr)
            self._cache[name] = arr
        return self._cache[name]

    def _bind(self, values, arrays: Mapping[str, np.ndarray], what: str, bindings: dict[str, int]) -> dict[str, np.ndarray]:
        out = {}
        for v in values:
            if v.name not in arrays:
                raise BindError(f"{self.graph.name}: missing {what} {v.name!r} ({v.type})")
            arr = np.asarray(arrays[v.name])
            want = v.type.dtype.numpy()
            if arr.dtype != want:
                if arr.dtype.kind != np.dtype(want).kind and not (arr.dtype.kind in "iu" and want.kind in "iu"):
                    raise BindError(f"{self.graph.name}: {what} {v.name!r} has dtype {arr.dtype}, expected {v.type}")
                arr = arr.astype(want)
            if arr.ndim != v.type.rank:
                raise BindError(f"{self.graph.name}: {what} {v.name!r} has shape {list(arr.shape)}, expected {v.type}")
            for dim, n in zip(v.type.shape, arr.shape):
                if isinstance(dim, int):
                    if dim != n:
                        raise BindError(f"{self.graph.name}: {what} {v.name!r} has shape {list(arr.shape)}, expected {v.type}")
                elif bindings.setdefault(dim, n) != n:
                    raise BindError(f"{self.graph.name}: {what} {v.name!r} binds {dim}={n}, but {dim}={bindings[dim]} elsewhere")
            out[v.name] = arr
        return out

    def run(self, inputs: Mapping[str, np.ndarray], states: Mapping[str, np.ndarray] | None = None, *,
            keep: Collection[str] = ()) -> RunResult:
        """`keep` (outputs a device backend leaves on its device) changes nothing here."""
        g = self.graph
        bindings: dict[str, int] = {}
        env: dict[str, np.ndarray] = {}
        env.update(self._bind(g.inputs, inputs, "input", bindings))
        env.update(self._bind([s.value for s in g.states], states or {}, "state", bindings))
        for i, node in enumerate(g.nodes):
            if i in self._folded and node.outputs[0].name in self._cache:
                for v in node.outputs:
                    env[v.name] = self._cache[v.name]
                continue
            args = [env[x] if x in env else self._weight(x) for x in node.inputs]
            results = self._ops[node.op].run(args, node.attr)
            if len(results) != len(node.outputs):
                raise RuntimeError(f"{g.name}: op {node.op} returned {len(results)} arrays for {len(node.outputs)} outputs")
            for v, arr in zip(node.outputs, results):
                shape = v.type.concrete({**bindings, **_fresh_symbols(v, arr, bindings)})
                expected = storage_shape(shape, v.type.dtype)
                if tuple(arr.shape) != expected:
                    raise RuntimeError(f"{g.name}: op {node.op} produced %{v.name} with shape {list(arr.shape)}, "
                                       f"declared {v.type} = {list(expected)}")
                env[v.name] = arr
                if i in self._folded:
                    self._cache[v.name] = arr
        outputs = {name: env[value] if value in env else self._weight(value) for name, value in g.outputs}
        new_states = {s.value.name: env[s.update] for s in g.states if s.update is not None}
        return RunResult(outputs, new_states, bindings)


def _fresh_symbols(v: Value, arr: np.ndarray, bindings: Mapping[str, int]) -> dict[str, int]:
    """Symbols first seen on an op output (e.g. a data-dependent size) bind to what the op produced."""
    return {d: n for d, n in zip(v.type.shape, arr.shape) if isinstance(d, str) and d not in bindings}
