"""Graph -> launch plan: each node is lowered by the kernel builder registered for its op.

Builders (`backends/kernels/*.py`) see a `NodeCtx`: the node's value types and attrs, and
`launch(...)` to add a kernel launch. Kernels are specialised per node: concrete dims and
attrs are baked into the body as constants; symbolic dims appear as `n_<symbol>` and
become int parameters automatically. Besides kernels, lowering decides
- constant steps: nodes computed from weights only run once, when the program loads;
- aliases: a reshape is a view of its input's buffer;
- in-place updates: a builder may write into an input whose buffer nobody reads later
  (a KV cache that is only read through the written copy);
- temporaries: a fused op may be lowered as a sequence of other ops' kernels (`sub`),
  whose intermediate values get buffers that live for that node only.
"""
from __future__ import annotations

import re
from typing import Callable, Iterable, Sequence

from dflash_ir.dtypes import DType
from dflash_ir.ir import Graph, Node, Value
from dflash_ir.ops.registry import get_op
from dflash_ir.types import TensorType

from .cstyle import Buffer, Kernel
from .plan import Check, Launch, Plan, Step, compile_expr, symbol_param

CTYPES = {DType.F32: "float", DType.F16: "u16", DType.BF16: "u16", DType.Q8_0: "u8", DType.I32: "int",
          DType.I64: "i64", DType.BOOL: "u8"}

LOWERINGS: dict[str, Callable[["NodeCtx"], None]] = {}


class LoweringError(NotImplementedError):
    """No kernel exists for a node (op, dtype or attribute combination)."""


def lowers(*ops: str):
    def deco(fn):
        for op in ops:
            LOWERINGS[op] = fn
        return fn
    return deco


class NodeCtx:
    def __init__(self, lowering: "_Lowering", index: int, node: Node):
        self._l = lowering
        self.index = index
        self.node = node
        self.attr = node.attr
        self.ins: list[Value] = [lowering.values[x] for x in node.inputs]
        self.outs: list[Value] = list(node.outputs)
        self.launches: list[Launch] = []
        self.temps: list[str] = []

    def launch(self, op: str, body: str, *, buffers: Sequence[tuple[str, Value, bool]], groups: Iterable[str],
               local: Sequence[int] = (256, 1, 1), when: str | None = None) -> None:
        """Add a kernel launch: `buffers` are (param name, value, written?) in parameter order."""
        local = tuple(local) + (1,) * (3 - len(local))
        groups = tuple(_fold(g) for g in groups) + ("1",) * (3 - len(tuple(groups)))
        ints = tuple(p for p in self._l.symbol_params if re.search(rf"\b{p}\b", body))
        params = tuple(Buffer(name, CTYPES[v.type.dtype], writes) for name, v, writes in buffers)
        kernel = Kernel.make(op, params, ints, local, body)
        self._l.plan.kernels.setdefault(kernel.name, kernel)
        self.launches.append(Launch(kernel.name, tuple(v.name for _, v, _ in buffers), ints, groups, local, when))

    def temp(self, t: TensorType) -> Value:
        """A value that lives during this node only (an intermediate of a fused op)."""
        v = Value(f"{self.outs[0].name}#{len(self._l.plan.temps)}", t)
        self._l.values[v.name] = v
        self._l.plan.temps[v.name] = str(t)
        self.temps.append(v.name)
        return v

    def sub(self, op: str, *inputs: Value, outputs: Sequence[Value] | None = None, **attrs):
        """Lower `op` on `inputs` as part of this node, into `outputs` (default: new temporaries);
        returns the output value, or a tuple of them."""
        if outputs is None:
            outputs = [self.temp(t) for t in get_op(op).output_types([v.type for v in inputs], attrs)]
        child = NodeCtx(self._l, self.index, Node.make(op, [v.name for v in inputs], outputs, attrs))
        child.launches, child.temps = self.launches, self.temps
        LOWERINGS[op](child)
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    def alias(self, out: Value, of: Value) -> None:
        """`out` is a view of `of`'s buffer (same bytes, another shape)."""
        self._l.plan.aliases[out.name] = self._l.root(of.name)

    def can_overwrite(self, v: Value) -> bool:
        """True when no later node, output or state reads `v`'s buffer, and it is not a weight."""
        return self._l.dead_after(v.name, self.index)

    def is_input(self, v: Value) -> bool:
        return v.name in self._l.input_names

    def check(self, kind: str, v: Value, *, size: str = "0", rows: str = "0", flags: tuple[str, ...] = ()) -> None:
        """Validate a graph input on the host before launching (only inputs can be seen there)."""
        check = Check(kind, v.name, size, rows, flags)
        if self.is_input(v) and check not in self._l.plan.checks:
            self._l.plan.checks.append(check)


def _fold(expr: str) -> str:
    """A size expression without symbols as its value ("cdiv(64, 256)" -> "1")."""
    return expr if re.search(r"\bn_", expr) else str(compile_expr(expr)({}))


class _Lowering:
    def __init__(self, graph: Graph):
        self.graph = graph
        self.values = graph.values()
        self.plan = Plan(graph.name)
        self.symbol_params = sorted(symbol_param(s) for s in graph.symbols)
        self.input_names = {v.name for v in graph.inputs} | {s.value.name for s in graph.states}
        self.constant = {w.value.name for w in graph.weights}
        # a state without an update must stay as it is: nothing may write into its buffer
        kept = ({v for _, v in graph.outputs} | {s.update for s in graph.states if s.update}
                | {s.value.name for s in graph.states if s.update is None})
        self.last_use = {v: len(graph.nodes) for v in kept}
        for i, n in enumerate(graph.nodes):
            for x in n.inputs:
                self.last_use[x] = max(self.last_use.get(x, -1), i)

    def root(self, name: str) -> str:
        return self.plan.aliases.get(name, name)

    def dead_after(self, name: str, index: int) -> bool:
        root = self.root(name)
        if root in self.constant:
            return False
        group = [v for v, r in self.plan.aliases.items() if r == root] + [root]
        return root not in self.plan.temps and all(self.last_use.get(v, -1) <= index for v in group)

    def run(self) -> Plan:
        from . import kernels  # noqa: F401  (registers the builders)

        for i, node in enumerate(self.graph.nodes):
            if node.op not in LOWERINGS:
                raise LoweringError(f"{self.graph.name}: no kernel for op {node.op!r} (node {i})")
            ctx = NodeCtx(self, i, node)
            LOWERINGS[node.op](ctx)
            constant = bool(node.inputs) and all(x in self.constant for x in node.inputs)
            if constant:
                self.constant.update(v.name for v in node.outputs)
            self.plan.steps.append(Step(i, tuple(ctx.launches), constant, tuple(ctx.temps)))
        return self.plan


def lower(graph: Graph) -> Plan:
    """The launch plan of `graph` (raises LoweringError naming the first node without a kernel)."""
    return _Lowering(graph).run()
