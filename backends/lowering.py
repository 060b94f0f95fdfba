"""Graph -> launch plan: each node is lowered by the kernel builder registered for its op.

Builders (`backends/kernels/*.py`) see a `NodeCtx`: the node's value types and attrs, and
`kernel(...)`, a kernel builder (backends/kir) whose `launch` adds the launch. Kernels are
specialised per node: concrete dims and attrs are constants in the tree; symbolic dims are
`dim(d)`, the int parameter `n_<symbol>`, which kernels that use it take automatically.
Besides kernels, lowering decides
- constant steps: nodes computed from weights only run once, when the program loads;
- aliases: a reshape is a view of its input's buffer;
- in-place updates: a builder may write into an input whose buffer nobody reads later
  (a KV cache that is only read through the written copy);
- temporaries: a fused op may be lowered as a sequence of other ops' kernels (`sub`),
  whose intermediate values get buffers that live for that node only;
- memory: with these decisions made, the buffers of a call are assigned to slots
  (passes/plan_memory.py, whose liveness analysis also decides the in-place writes).

A plan is lowered for a device class, `profile`: "gpu" (thousands of threads, coalesced
loads, work-group reductions) or "cpu" (OpenCL on PoCL, Vulkan on lavapipe: a few cores
that vectorise one work-item's loop). Builders whose best schedule differs read
`ctx.profile`; the kernels of either profile are correct on any device. `row_streams` is
4 for PoCL and 1 for lavapipe, whose shader compiler takes seconds per kernel on wide
unrolled loops: the CPU attention kernels (kernels/attention.py) take their wide schedule
only above 1. For the same reason `block_span`, the elements of a quant block that a
one-row CPU tile unrolls with constant positions (kernels/linalg.py), is BLOCK_SPAN for PoCL
and 0 (a loop) for lavapipe, which scalarises the 16-lane vectors (minutes per kernel).
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

from dflash_ir.dtypes import DType
from dflash_ir.ir import Graph, Node, Value

BLOCK_SPAN = 128  # the K-quant layouts' bit fields repeat every 128 elements (Q5_K's every 256)
from dflash_ir.ops.registry import get_op
from dflash_ir.passes.plan_memory import Liveness, size_class
from dflash_ir.types import TensorType

from .kir import K, KernelBuilder, const, var
from .kir.build import Buffer
from .kir.ir import Param
from .kir.size import size_expr
from .plan import Check, Launch, Plan, Step, contracts_of, packed_bytes, packed_type, symbol_param

# the element type a value's buffer holds in kernels
ELEMENT = {DType.F32: "f32", DType.F16: "u16", DType.BF16: "u16", DType.I32: "i32",
           DType.I64: "i64", DType.BOOL: "u8"} | {d: "u8" for d in DType if d.is_block}

LOWERINGS: dict[str, Callable[["NodeCtx"], None]] = {}  # op -> kernel builder
PROFILES = ("gpu", "cpu")
# instruction set extensions a device compiler may not target by itself, which kernels then
# reach through their printer (kir.dpbusd_at); named as in /proc/cpuinfo
ISA_EXTENSIONS = ("avx512_vnni",)


class LoweringError(NotImplementedError):
    """No kernel exists for a node (op, dtype or attribute combination)."""


def registrar(registry: dict[str, Callable]):
    """A `lowers(*ops)` decorator registering a kernel builder for ops in `registry`."""
    def lowers(*ops: str):
        def deco(fn):
            for op in ops:
                registry[op] = fn
            return fn
        return deco
    return lowers


lowers = registrar(LOWERINGS)


class NodeCtxBase:
    """What a kernel builder sees of its node, and the lowering decisions every kind of kernel
    shares (temporaries, parts of fused ops, views, in-place writes, host checks). A subclass
    adds the way it makes kernels and names its builder registry."""

    what = "kernel"  # for error messages: what a node without a builder lacks

    @classmethod
    def builders(cls) -> dict[str, Callable]:
        raise NotImplementedError

    def __init__(self, lowering: "Lowering", index: int, node: Node):
        self._l = lowering
        self.index = index
        self.node = node
        self.attr = node.attr
        self.profile = lowering.profile
        self.isa = lowering.isa
        self.kind = lowering.graph.meta_dict.get("kind")  # the graph's: verify, block, decode, prefill ...
        self.row_streams = lowering.row_streams
        self.block_span = lowering.block_span
        self.ins: list[Value] = [lowering.values[x] for x in node.inputs]
        self.outs: list[Value] = list(node.outputs)
        self.launches: list[Launch] = []
        self.temps: list[str] = []

    def temp(self, t: TensorType) -> Value:
        """A value that lives during this node only (an intermediate of a fused op)."""
        v = Value(f"{self.outs[0].name}#{len(self._l.plan.temps)}", t)
        self._l.values[v.name] = v
        self._l.plan.temps[v.name] = str(t)
        self._l.live.temp(v.name, self.index)
        self.temps.append(v.name)
        return v

    def sub(self, op: str, /, *inputs: Value, outputs: Sequence[Value] | None = None, **attrs):
        """Lower `op` on `inputs` as part of this node, into `outputs` (default: new temporaries);
        returns the output value, or a tuple of them."""
        if outputs is None:
            outputs = [self.temp(t) for t in get_op(op).output_types([v.type for v in inputs], attrs)]
        child = type(self)(self._l, self.index, Node.make(op, [v.name for v in inputs], outputs, attrs))
        child.launches, child.temps = self.launches, self.temps
        self._l.builder(op, self.index)(child)
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    def once(self, key, make: Callable[[], Any]) -> Any:
        """make()'s result, made once per node and key: the parts a fused op lowers as share
        it (a fused MoE's three expert products, one sort of their pairs)."""
        shared = self._l.shared
        if (self.index, key) not in shared:
            shared[self.index, key] = make()
        return shared[self.index, key]

    def alias(self, out: Value, of: Value) -> None:
        """`out` is a view of `of`'s buffer (same bytes, another shape)."""
        self._l.plan.aliases[out.name] = self._l.live.alias(out.name, of.name)

    def can_overwrite(self, v: Value) -> bool:
        """True when no later node, output or state reads `v`'s buffer, and it is not a weight
        (passes/plan_memory.py: the liveness the memory plan is made from)."""
        return self._l.live.dead_after(v.name, self.index)

    def packed(self, weights: Sequence[Value], layout: str) -> Value:
        """The weights' rows one after another (weights, or views of them, of one dtype and
        row length) as the runner stores them in `layout` (plan.LAYOUTS), packed once at
        load: a matmul_group's operand, or one weight in another layout."""
        roots = tuple(self._l.root(w.name) for w in weights)
        for w, root in zip(weights, roots):
            if root not in self._l.weight_names:
                raise LoweringError(f"{self._l.graph.name}: {self.node.op} reads {w.name} in layout {layout}, "
                                    f"but only a graph weight can be packed")
        name = f"{'+'.join(roots)}@{layout}"
        self._l.plan.packs[name] = (roots, layout)
        if name not in self._l.values:
            self._l.values[name] = Value(name, packed_type([self._l.values[r].type for r in roots]))
        return self._l.values[name]

    @property
    def graph(self) -> Graph:
        return self._l.graph

    def is_input(self, v: Value) -> bool:
        return v.name in self._l.input_names

    def check(self, kind: str, v: Value, *, size=0, rows=0, flags: tuple[str, ...] = ()) -> None:
        """Validate a graph input on the host before launching (only inputs can be seen there);
        sizes are kernel-tree expressions or plan text."""
        check = Check(kind, v.name, size_expr(size), size_expr(rows), flags)
        if self.is_input(v) and check not in self._l.plan.checks:
            self._l.plan.checks.append(check)


class KernelSpec(KernelBuilder):
    """The kernel one node launches: a KernelBuilder whose buffers are bound to graph values
    (`bind`) and whose `launch` adds it to the plan with its grid."""

    def __init__(self, ctx: "NodeCtx", op: str, local: Sequence[int]):
        super().__init__(op, local)
        self.ctx = ctx
        self.bound: list[str] = []

    def bind(self, name: str, value: Value, writes: bool = False) -> Buffer:
        self.bound.append(value.name)
        return self.buffer(name, ELEMENT[value.type.dtype], writes)

    def emit_memoised(self, make: Callable[..., None], *key) -> None:
        """The statements `make(kb, buffers, *key)` adds to a fresh KernelBuilder holding this
        kernel's buffers (`buffers`: name -> Buffer), memoised on `make`, the buffers and `key`:
        a model's layers lower the same products over and over, and building a product's tree
        is most of lowering's time. `make` reads nothing but its arguments (a KernelBuilder has
        no node context to read)."""
        self.extend(_memoised_body(make, self.op, self.local, tuple(self._params.values()), key))

    def launch(self, groups: Sequence, when=None) -> None:
        """Add the launch: `groups` work-groups per dimension, and `when` the condition on
        the sizes under which this variant runs (kernel-tree expressions or ints)."""
        lowering = self.ctx._l
        kernel = self.build(lowering.symbol_params)
        lowering.plan.kernels.setdefault(kernel.name, kernel)
        groups = tuple(size_expr(g) for g in groups) + ("1",) * (3 - len(groups))
        self.ctx.launches.append(Launch(kernel.name, tuple(self.bound), kernel.ints, groups, kernel.local,
                                        None if when is None else size_expr(when)))


@functools.lru_cache(maxsize=512)
def _memoised_body(make: Callable[..., None], op: str, local: tuple[int, ...], params: tuple[Param, ...],
                   key: tuple) -> tuple[K, ...]:
    kb = KernelBuilder(op, local)
    make(kb, {p.name: kb.buffer(p.name, p.ctype, p.writes) for p in params}, *key)
    return kb.statements()


def dim(d) -> K:
    """A dim as a kernel-tree int: its value, or the symbol's int parameter."""
    return const(d) if isinstance(d, int) else var(symbol_param(d))


class NodeCtx(NodeCtxBase):
    """Builders of kernels (backends/kernels/*.py, registered with `lowers`)."""

    def kernel(self, op: str, local: Sequence[int] = (256,)) -> KernelSpec:
        return KernelSpec(self, op, local)

    @classmethod
    def builders(cls) -> dict[str, Callable]:
        from . import kernels  # noqa: F401  (registers the builders)

        return LOWERINGS


class Lowering:
    """One graph lowered node by node with the builders of `ctx_class`; the kernels they make
    are collected in plan.kernels (compile time only)."""

    def __init__(self, graph: Graph, profile: str, ctx_class: type[NodeCtxBase], row_streams: int = 4,
                 isa: frozenset[str] = frozenset(), block_span: int = BLOCK_SPAN):
        if profile not in PROFILES:
            raise ValueError(f"unknown device profile {profile!r}; known: {', '.join(PROFILES)}")
        unknown = set(isa) - set(ISA_EXTENSIONS)
        if unknown:
            raise ValueError(f"unknown instruction set extensions {sorted(unknown)}; "
                             f"known: {', '.join(ISA_EXTENSIONS)}")
        self.graph = graph
        self.profile = profile
        self.isa = frozenset(isa)
        self.row_streams = row_streams
        self.block_span = block_span
        self.ctx_class = ctx_class
        self.values = graph.values()
        self.plan = Plan(graph.name)
        self.symbol_params = sorted(symbol_param(s) for s in graph.symbols)
        self.input_names = {v.name for v in graph.inputs} | {s.value.name for s in graph.states}
        self.weight_names = {w.value.name for w in graph.weights}
        self.live = Liveness(graph)
        self.shared: dict[tuple, Any] = {}  # NodeCtxBase.once

    def builder(self, op: str, index: int) -> Callable:
        builders = self.ctx_class.builders()
        if op not in builders:
            raise LoweringError(f"{self.graph.name}: no {self.ctx_class.what} for op {op!r} (node {index})")
        return builders[op]

    def root(self, name: str) -> str:
        return self.live.root(name)

    def extent(self, name: str):
        """The bytes value `name`'s buffer holds (plan.Extent): a pack's as its layout packs it."""
        if name in self.plan.packs:
            roots, layout = self.plan.packs[name]
            return (), packed_bytes([self.values[r].type for r in roots], layout)
        return size_class(self.values[name].type)

    def run(self) -> Plan:
        for i, node in enumerate(self.graph.nodes):
            ctx = self.ctx_class(self, i, node)
            self.builder(node.op, i)(ctx)
            constant = i in self.live.constant_nodes  # runs once, at load
            self.plan.steps.append(Step(i, tuple(ctx.launches), constant, tuple(ctx.temps)))
        self.plan.slots, self.plan.buffers = self.live.assign({n: v.type for n, v in self.values.items()})
        self.plan.extents = {b: self.extent(b) for s in self.plan.steps for l in s.launches for b in l.buffers}
        self.plan.contracts = contracts_of(self.plan.steps, self.plan.extents.__getitem__)
        return self.plan


def lower(graph: Graph, profile: str = "gpu", row_streams: int = 4, isa: frozenset[str] = frozenset(),
          block_span: int = BLOCK_SPAN) -> Plan:
    """The launch plan of `graph` for a device class and the instruction set extensions its
    kernels may use (ISA_EXTENSIONS; raises LoweringError naming the first node without a
    kernel)."""
    return Lowering(graph, profile, NodeCtx, row_streams, isa, block_span).run()
