"""The launch plan of a compiled graph: what the manifest stores and every device runs.

A plan is dialect-neutral plain data: per graph node, the kernels to launch in order with
their buffer bindings (value names), int arguments and grid sizes, plus value aliases
(views that share a buffer) and host-side checks of inputs. Sizes are expressions over the
graph's symbols (named `n_<symbol>` as in the kernels), e.g. "cdiv(n_T*64, 256)", so one
plan serves every call. A launch may carry a `when` condition: variants of a node (GEMV
for few rows, tiled GEMM for many) are chosen per call from the bound sizes. `packs` are
weights a kernel reads otherwise than as the GGUF stores them (LAYOUTS), alone or several
one after another (a matmul group's, each packed on its own): the runner packs them once,
at load, and the packed copy is what the launches bind.

The memory plan is in the plan too (made at the end of lowering by passes/plan_memory.py):
`slots`, each (symbols, bytes per unit of their product), so one plan sizes its buffers for
every call, and `buffers`, the slot of every buffer a call uses; the runner allocates the
slots once per set of symbol values.

`contracts` say, per kernel, what it was built for (backends/launch_check.py checks every
launch against them before anything runs): its work-group size, its int parameters, and
each grid it is launched with together with the bytes each of its buffers must hold then.
"""
from __future__ import annotations

import ast
import functools
import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from dflash_ir.quant import (COLS, DP4_TYPES, TILED_BLOCK_TYPES, cols16_layout, pack_blocks_cols16, pack_blocks_cols16_dp4,
                             pack_q8_0_cols16, storage_shape)
from dflash_ir.types import TensorType

from .kir.ir import Kernel


def as_stored(storage: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """`storage` itself (into `out`'s bytes when given)."""
    if out is None:
        return np.ascontiguousarray(storage)
    np.copyto(out.view(storage.dtype).reshape(storage.shape), storage)
    return out


# weight layouts a kernel may ask for: name -> (storage, out=None) -> storage bytes in that
# layout, into `out` when given
LAYOUTS = {"q8_0_cols16": pack_q8_0_cols16, "q8_0_cols16_dp4": functools.partial(pack_q8_0_cols16, dp4=True),
           "as_stored": as_stored} | {
    cols16_layout(d): functools.partial(pack_blocks_cols16, dtype=d) for d in TILED_BLOCK_TYPES} | {
    cols16_layout(d, dp4=True): functools.partial(pack_blocks_cols16_dp4, dtype=d) for d in DP4_TYPES}
# rows of a matrix each layout packs together: a run of whole units packs on its own
_ROW_UNIT = {name: 1 if name == "as_stored" else COLS for name in LAYOUTS}
PART_BYTES = 8 << 20  # the most of a weight the runner reads and packs at once


def layout_parts(storage: np.ndarray, layout: str, part_bytes: int = PART_BYTES):
    """Views of `storage`, runs of whole row units of each of its matrices, in order: the parts
    packed (LAYOUTS[layout]) one after another are the whole weight in `layout`. Loading a
    weight part by part keeps what it costs the host to a few parts at a time, however large
    the weight (a 1 GB embedding); an `as_stored` part packs to itself, not a copy."""
    matrices = storage.reshape(-1, *storage.shape[-2:]) if storage.ndim >= 2 else storage.reshape(1, 1, -1)
    unit = _ROW_UNIT[layout]
    step = max(1, part_bytes // (unit * matrices.shape[-1] * storage.itemsize)) * unit
    for matrix in matrices:
        for start in range(0, len(matrix), step):
            yield matrix[start:start + step]


def part_bytes_packed(part: np.ndarray, layout: str) -> int:
    """Bytes a part of layout_parts is in `layout`: its rows padded to whole units."""
    unit = _ROW_UNIT[layout]
    return -(-len(part) // unit) * unit * part[0].nbytes


def packed_bytes(types: Sequence[TensorType], layout: str) -> int:
    """Bytes of weights of `types` packed one after another in `layout` (what the runner
    makes of them with LAYOUTS): the q8_0_cols16 layouts pad each matrix's rows to whole groups."""
    total = 0
    for t in types:
        shape = storage_shape(t.shape, t.dtype)
        if _ROW_UNIT[layout] > 1:
            matrices, rows = math.prod(shape[:-2]), (shape[-2] if len(shape) > 1 else 1)
            total += matrices * -(-rows // COLS) * COLS * shape[-1]
        else:
            total += math.prod(shape) * t.dtype.numpy().itemsize
    return total


def packed_type(types: Sequence[TensorType]) -> TensorType:
    """The type of a pack: its weights' rows one after another."""
    return TensorType(types[0].dtype, (sum(t.shape[0] for t in types), *types[0].shape[1:]))

_FUNCS = {"cdiv": lambda a, b: -(-a // b), "min": min, "max": max}
_NODES = (ast.Expression, ast.BinOp, ast.Compare, ast.BoolOp, ast.UnaryOp, ast.Call, ast.Name, ast.Load,
          ast.Constant, ast.Add, ast.Sub, ast.Mult, ast.FloorDiv, ast.Mod, ast.USub, ast.And, ast.Or,
          ast.Lt, ast.LtE, ast.Gt, ast.GtE, ast.Eq, ast.NotEq, ast.Not)


def symbol_param(symbol: str) -> str:
    """The C / expression name of a graph symbol."""
    return "n_" + re.sub(r"\W", "_", symbol)


def compile_expr(text: str) -> Callable[[Mapping[str, int]], int]:
    """A size expression as a function of the symbol values (integer arithmetic only)."""
    tree = ast.parse(text, mode="eval")
    for node in ast.walk(tree):
        if not isinstance(node, _NODES) or (isinstance(node, ast.Call) and
                                            not (isinstance(node.func, ast.Name) and node.func.id in _FUNCS)):
            raise ValueError(f"size expression {text!r}: {type(node).__name__} is not allowed")
        if isinstance(node, ast.Constant) and not isinstance(node.value, int):
            raise ValueError(f"size expression {text!r}: only int constants are allowed")
    code = compile(tree, f"<size {text}>", "eval")
    return lambda env: int(eval(code, {"__builtins__": {}, **_FUNCS}, dict(env)))


@dataclass(frozen=True)
class Launch:
    kernel: str
    buffers: tuple[str, ...]          # value names bound to the kernel's buffer params
    ints: tuple[str, ...]             # size expressions for its int params
    groups: tuple[str, str, str]      # work-groups per dimension
    local: tuple[int, int, int]
    when: str | None = None


@dataclass(frozen=True)
class Step:
    """The launches of one graph node; `constant` nodes (weights only) run once at load."""

    node: int
    launches: tuple[Launch, ...]
    constant: bool = False
    temps: tuple[str, ...] = ()     # intermediates of a fused op, live during this step only


@dataclass(frozen=True)
class Check:
    """A host-side check of a graph input that a kernel could not report (out-of-range ids,
    cache positions): kind in `index` (values of `value` in [0, size)), `kv_write`, `attention`."""

    kind: str
    value: str
    size: str = "0"
    rows: str = "0"
    flags: tuple[str, ...] = ()


Extent = tuple[tuple[str, ...], int]  # (symbols, bytes per unit of their product), as a memory slot


@dataclass(frozen=True)
class Contract:
    """What a kernel was built for: `local` work-items per group, `ints` (the size
    expressions its int parameters take), and `uses`: each grid it is launched with, with the bytes
    each buffer parameter must hold then: those of the value lowering bound to it, which
    the kernel stays within on that grid."""

    local: tuple[int, int, int]
    ints: tuple[str, ...]
    uses: tuple[tuple[tuple[str, str, str], tuple[Extent, ...]], ...]


def contracts_of(steps: Sequence[Step], extent: Callable[[str], Extent]) -> dict[str, Contract]:
    """The contract of every kernel the steps launch; `extent(value)` the bytes a value's
    buffer holds. A kernel shared by several nodes has a use per distinct grid and extents."""
    found: dict[str, tuple[tuple, tuple, dict]] = {}
    for launch in (l for s in steps for l in s.launches):
        local, ints, uses = found.setdefault(launch.kernel, (launch.local, launch.ints, {}))
        uses[(launch.groups, tuple(extent(b) for b in launch.buffers))] = None
    return {k: Contract(local, ints, tuple(uses)) for k, (local, ints, uses) in found.items()}


@dataclass
class Plan:
    graph: str
    kernels: dict[str, Kernel] = field(default_factory=dict)   # at compile time only: bodies to render
    steps: list[Step] = field(default_factory=list)
    aliases: dict[str, str] = field(default_factory=dict)   # value -> value whose buffer it shares
    temps: dict[str, str] = field(default_factory=dict)     # temporary value -> its type ("f32[T,64]")
    checks: list[Check] = field(default_factory=list)
    packs: dict[str, tuple[tuple[str, ...], str]] = field(default_factory=dict)  # value -> (weights, layout)
    # the memory plan (passes/plan_memory.py): per slot (symbols, bytes per unit of their
    # product), and the slot of every buffer made per call (inputs, states, activations and
    # temporaries; views by their root in `aliases`, weights and weight-only values resident)
    slots: list[tuple[tuple[str, ...], int]] = field(default_factory=list)
    buffers: dict[str, int] = field(default_factory=dict)
    contracts: dict[str, Contract] = field(default_factory=dict)
    extents: dict[str, Extent] = field(default_factory=dict)  # at compile time only: each bound value's bytes

    def to_dict(self) -> dict[str, Any]:
        """JSON/YAML-able manifest form, defaults left out: kernels appear by name (their sources
        are the backend's files); steps without launches (views) only as aliases."""
        def launch(l: Launch) -> dict[str, Any]:
            d = {"kernel": l.kernel, "buffers": list(l.buffers), "groups": list(l.groups), "local": list(l.local)}
            return {**d, **({"ints": list(l.ints)} if l.ints else {}), **({"when": l.when} if l.when else {})}

        def step(s: Step) -> dict[str, Any]:
            return {"node": s.node, "launches": [launch(l) for l in s.launches],
                    **({"constant": True} if s.constant else {}), **({"temps": list(s.temps)} if s.temps else {})}

        return {"graph": self.graph, "steps": [step(s) for s in self.steps if s.launches],
                "aliases": dict(self.aliases), "temps": dict(self.temps), "checks": [asdict(c) for c in self.checks],
                **({"packs": {k: [list(w), layout] for k, (w, layout) in self.packs.items()}} if self.packs else {}),
                "slots": [[list(symbols), per_unit] for symbols, per_unit in self.slots], "buffers": dict(self.buffers),
                "contracts": {k: {"local": list(c.local), "ints": list(c.ints),
                                  "uses": [{"groups": list(g), "extents": [[list(sy), n] for sy, n in ext]}
                                           for g, ext in c.uses]}
                              for k, c in self.contracts.items()}}

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> "Plan":
        steps = [Step(s["node"], tuple(Launch(l["kernel"], tuple(l["buffers"]), tuple(l.get("ints", ())),
                                              tuple(l["groups"]), tuple(l["local"]), l.get("when"))
                                       for l in s["launches"]), s.get("constant", False), tuple(s.get("temps", ())))
                 for s in d["steps"]]
        checks = [Check(c["kind"], c["value"], c["size"], c["rows"], tuple(c["flags"])) for c in d["checks"]]
        packs = {k: (tuple(w), layout) for k, (w, layout) in d.get("packs", {}).items()}
        slots = [(tuple(symbols), per_unit) for symbols, per_unit in d["slots"]]
        contracts = {k: Contract(tuple(c["local"]), tuple(c["ints"]),
                                 tuple((tuple(u["groups"]), tuple((tuple(sy), n) for sy, n in u["extents"]))
                                       for u in c["uses"]))
                     for k, c in d["contracts"].items()}
        return Plan(d["graph"], {}, steps, dict(d["aliases"]), dict(d["temps"]), checks, packs, slots, dict(d["buffers"]),
                    contracts)

    def kernel_names(self) -> list[str]:
        """Every kernel the plan launches, in first-launch order."""
        return list(dict.fromkeys(l.kernel for s in self.steps for l in s.launches))
