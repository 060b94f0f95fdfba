"""Graph -> launch plan whose kernels are TensorIR PrimFuncs (tir.PrimKernel).

The native lowering (backends/lowering.py) with TVM's own op registry: the same constant
steps, reshape aliases, in-place cache writes, host checks and fused ops lowered as their
parts. A launch here names a PrimFunc with its buffers in parameter order and the symbols
it takes; GPU targets later replace it by the device kernels TVM made of that PrimFunc
(build.py).
"""
from __future__ import annotations

from typing import Callable, Sequence

from dflash_ir.ir import Graph, Value

from ..lowering import Lowering, NodeCtxBase, registrar
from ..plan import Launch, Plan
from .tir import TVM_DTYPES, Param, PrimKernel, block, storage_size, symbols_in

TVM_LOWERINGS: dict[str, Callable[["TVMNodeCtx"], None]] = {}  # op -> TensorIR kernel builder
lowers = registrar(TVM_LOWERINGS)


class TVMNodeCtx(NodeCtxBase):
    """Builders of TensorIR kernels (ops_*.py, registered with `lowers`)."""

    what = "TVM kernel"

    @classmethod
    def builders(cls) -> dict[str, Callable]:
        from . import ops_attention, ops_elementwise, ops_fused, ops_linalg, ops_movement, ops_recurrent, ops_reduce  # noqa: F401

        return TVM_LOWERINGS

    def param(self, name: str, v: Value, writes: bool = False) -> Param:
        # a pack holds its layout's bytes (rows padded to whole groups)
        size = str(self._l.extent(v.name)[1]) if v.name in self._l.plan.packs else storage_size(v)
        return Param(name, TVM_DTYPES[v.type.dtype], size, writes)

    def kernel(self, op: str, buffers: Sequence[tuple[str, Value, bool]], body: str, *, sequential: bool = False,
               cpu_body: str = "", noalias: bool = True) -> None:
        """Add a launch of the PrimFunc with `body` over `buffers` ((param name, value, written?));
        `cpu_body`: its llvm loop nest, where one is scheduled by hand (PrimKernel.noalias)."""
        params = tuple(self.param(n, v, w) for n, v, w in buffers)
        text = body + cpu_body + "".join(p.size for p in params)
        kernel = PrimKernel(op, params, symbols_in(text, self._l.symbol_params), body, sequential, cpu_body, noalias)
        self._l.plan.kernels.setdefault(kernel.name, kernel)
        self.launches.append(Launch(kernel.name, tuple(v.name for _, v, _ in buffers), kernel.ints,
                                    ("1", "1", "1"), (1, 1, 1)))

    def sequential(self, op: str, buffers: Sequence[tuple[str, Value, bool]], grid, body: str,
                   scratch: Sequence[tuple[str, int]] = ()) -> None:
        """A kernel whose block body loops serially (one thread per grid point on GPUs), with
        local f32 `scratch` arrays and its read/write regions spelled out for TVM."""
        ps = [self.param(n, v, w) for n, v, w in buffers]
        text = block(grid, body, regions=([p for p in ps if not p.writes], [p for p in ps if p.writes]), scratch=scratch)
        self.kernel(op, buffers, text, sequential=True)


def registered_ops() -> set[str]:
    """Every op with a TVM lowering."""
    return set(TVMNodeCtx.builders())


def lower(graph: Graph, profile: str = "gpu", isa: frozenset[str] = frozenset()) -> tuple[Plan, dict[str, PrimKernel]]:
    """The launch plan of `graph` and its PrimFuncs by name (LoweringError names a node without one).
    TVM schedules each PrimFunc per target later; `profile` "cpu" (the llvm target, OpenCL on
    a CPU device) takes the hand-written loop nests where an op has one in place of kernels
    for dlight's rules; `isa`: the extensions those may use (avx512_vnni: the Q8_0 x products)."""
    plan = Lowering(graph, profile, TVMNodeCtx, isa=isa).run()
    return plan, plan.kernels
