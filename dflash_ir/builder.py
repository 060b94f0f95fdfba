"""A builder that makes model code read like the math.

    b = GraphBuilder("mlp")
    x = b.input("x", DType.F32, ("T", 64))
    w = b.weight("blk.0.ffn_up.weight", DType.Q8_0, (192, 64))
    y = b.matmul(x, b.dequantize(w))
    b.output("y", y)
    graph = b.build()

Every op call infers its output types through the op registry, so shape errors surface
at the line of model code that caused them.
"""
from __future__ import annotations

import contextlib
from typing import Any

from .dtypes import DType
from .ir import Graph, Node, State, Value, Weight, freeze_attr
from .ops.registry import OpError, get_op
from .types import Shape, TensorType


class GraphBuilder:
    def __init__(self, name: str):
        self.name = name
        self._inputs: list[Value] = []
        self._weights: dict[tuple[str, str], Weight] = {}
        self._states: dict[str, Value] = {}
        self._updates: dict[str, str] = {}
        self._nodes: list[Node] = []
        self._outputs: list[tuple[str, str]] = []
        self._names: set[str] = set()
        self._scope: list[str] = []
        self._counter = 0
        self.meta: dict[str, Any] = {}

    # -- naming -------------------------------------------------------------------------
    @contextlib.contextmanager
    def scope(self, prefix: str):
        """Prefix the names of values made inside, e.g. `with b.scope("blk.3"):`."""
        self._scope.append(prefix)
        try:
            yield
        finally:
            self._scope.pop()

    def _fresh(self, hint: str) -> str:
        base = ".".join([*self._scope, hint]) if self._scope else hint
        name = base
        while name in self._names:
            self._counter += 1
            name = f"{base}_{self._counter}"
        self._names.add(name)
        return name

    def _claim(self, name: str) -> str:
        if name in self._names:
            raise ValueError(f"{self.name}: value name {name!r} is already used")
        self._names.add(name)
        return name

    # -- graph interface ----------------------------------------------------------------
    def input(self, name: str, dtype: DType, shape: Shape) -> Value:
        v = Value(self._claim(name), TensorType(dtype, tuple(shape)))
        self._inputs.append(v)
        return v

    def weight(self, tensor: str, dtype: DType, shape: Shape, *, source: str = "model") -> Value:
        """Reference tensor `tensor` of model file `source`; the same tensor is one value."""
        key = (source, tensor)
        if key not in self._weights:
            name = self._claim(f"{source}/{tensor}" if source != "model" else tensor)
            self._weights[key] = Weight(Value(name, TensorType(dtype, tuple(shape))), tensor, source)
        w = self._weights[key]
        if w.value.type != TensorType(dtype, tuple(shape)):
            raise ValueError(f"{self.name}: weight {tensor!r} used as {dtype}{list(shape)} and as {w.value.type}")
        return w.value

    def state(self, name: str, dtype: DType, shape: Shape) -> Value:
        v = Value(self._claim(name), TensorType(dtype, tuple(shape)))
        self._states[name] = v
        return v

    def update_state(self, state: Value, new: Value) -> None:
        if state.name not in self._states:
            raise ValueError(f"{self.name}: {state.name!r} is not a state")
        if state.name in self._updates:
            raise ValueError(f"{self.name}: state {state.name!r} is updated twice")
        if new.type != state.type:
            raise ValueError(f"{self.name}: update of state {state.name!r} has type {new.type}, expected {state.type}")
        self._updates[state.name] = new.name

    def output(self, name: str, value: Value) -> None:
        if any(n == name for n, _ in self._outputs):
            raise ValueError(f"{self.name}: output {name!r} declared twice")
        self._outputs.append((name, value.name))

    def op(self, opname: str, *inputs: Value, name: str | None = None, **attrs: Any):
        """Append one node; returns its Value, or a tuple for multi-output ops."""
        opdef = get_op(opname)
        attrs = {k: freeze_attr(v) for k, v in attrs.items()}
        try:
            types = opdef.output_types([v.type for v in inputs], attrs)
        except OpError as e:
            raise OpError(f"{self.name}: {'.'.join(self._scope) or '<top>'}: {e}") from None
        hint = name or opname
        outs = tuple(Value(self._fresh(hint if len(types) == 1 else f"{hint}.{i}"), t) for i, t in enumerate(types))
        self._nodes.append(Node.make(opname, [v.name for v in inputs], outs, attrs))
        return outs[0] if len(outs) == 1 else outs

    def __getattr__(self, opname: str):
        if opname.startswith("_"):
            raise AttributeError(opname)
        return lambda *inputs, **attrs: self.op(opname, *inputs, **attrs)

    def build(self, *, verify: bool = True) -> Graph:
        g = Graph(
            name=self.name,
            inputs=tuple(self._inputs),
            weights=tuple(self._weights.values()),
            states=tuple(State(v, self._updates.get(n)) for n, v in self._states.items()),
            nodes=tuple(self._nodes),
            outputs=tuple(self._outputs),
            meta=tuple(sorted((k, freeze_attr(v)) for k, v in self.meta.items())),
        )
        if verify:
            from .verifier import verify as check

            check(g)
        return g
