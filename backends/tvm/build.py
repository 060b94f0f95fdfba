"""PrimFuncs -> TVM modules per target, cached on disk by (TVM version, target, TIR text).

llvm: one shared library per graph (export_library), called through the TVM runtime.
GPU targets: dlight schedules each PrimFunc (a hand schedule binds the sequential ones:
one thread per spatial point; on a CPU OpenCL device the loop nests take their PrimFuncs,
nest_targets.py), TVM lowers them and splits host from device code; what is
kept is the device source and, per PrimFunc, its device kernels in launch order with
their parameter order and launch extents (size expressions over n_<symbol>), which is all
a plan needs to launch them with the native runtimes."""
from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

from ..toolchain import cached_build
from .nest_targets import LLVM, NestTarget
from .tir import PrimKernel
from .tune import Tuned
from .version import PINNED

TARGETS = {
    "llvm": {"kind": "llvm"},
    "opencl": {"kind": "opencl"},
    "cuda": {"kind": "cuda", "arch": "sm_80", "max_shared_memory_per_block": 49152},
    "rocm": {"kind": "rocm", "mcpu": "gfx90a"},
}
GPU_THREADS = 64  # threads per block of the hand-scheduled sequential kernels
FORMAT = 3        # of the cached build results: bump when what is cached changes


def _key(config: Mapping, kernels: Mapping[str, PrimKernel], what: str) -> str:
    texts = "\n".join(kernels[n].script(cpu=True) + str(kernels[n].sequential) for n in sorted(kernels))
    return f"tvm {PINNED} format {FORMAT} {what} {json.dumps(dict(config), sort_keys=True)}\n{texts}"


@functools.cache
def host_llvm() -> dict:
    """The llvm target for this CPU: LLVM's name for it (e.g. with AVX-512), so the loop nests'
    16-lane vectors become single instructions; a library built here needs that CPU to load."""
    import tvm

    return {**TARGETS["llvm"], "mcpu": str(tvm.target.codegen.llvm_get_system_cpu())}


def build_llvm(kernels: Mapping[str, PrimKernel], tuned: Sequence[Tuned] = ()) -> bytes:
    """The shared library holding every kernel, as bytes (cached): the hand-scheduled loop
    nests (cpu_schedules.py) as written, other products and reductions scheduled by dlight's
    CPU rules, every other block's points spread over the CPU's threads; and the `tuned`
    specialisations (tune.py) beside the kernels they specialise."""
    def build(out: Path) -> None:
        import tvm
        from tvm.s_tir import dlight as dl

        target = tvm.target.Target(host_llvm())
        rules = [dl.cpu.GEMV(), dl.cpu.Reduction()]
        funcs = {}
        with target:
            for name, k in kernels.items():
                if k.cpu_body:
                    func = LLVM.parse(k.script(cpu=True))
                    if k.noalias:  # lets LLVM keep the partial sums in registers
                        func = func.with_attr("tirx.noalias", True)
                    funcs[name] = func.with_attr("tirx.is_scheduled", True)
                    continue
                func = tvm.script.from_source(k.script())
                scheduled = None if k.sequential else _dlight(func, target, rules)
                funcs[name] = (scheduled or _parallel_points(func)).with_attr("tirx.is_scheduled", True)
            for t in tuned:
                func = tvm.script.from_source(t.script).with_attr("global_symbol", t.name)
                funcs[t.name] = func.with_attr("tirx.is_scheduled", True)
        lib = out.with_suffix(".so")
        tvm.compile(tvm.IRModule(funcs), target=target).export_library(str(lib))
        lib.rename(out)

    tuned_text = "".join(f"\n{t.name}\n{t.script}" for t in tuned)
    return cached_build(_key(host_llvm(), kernels, "library") + tuned_text, build)


@dataclass(frozen=True)
class DeviceKernel:
    """One device kernel of a PrimFunc: its buffers as indices into the PrimFunc's buffer
    params, its int arguments and grid sizes as size expressions, its block size, and the
    condition under which the host code launches it (a loop nest choosing its passes by
    the row count), None when always."""

    name: str
    buffers: tuple[int, ...]
    ints: tuple[str, ...]
    groups: tuple[str, str, str]
    local: tuple[int, int, int]
    when: str | None = None


def build_gpu(kind: str, kernels: Mapping[str, PrimKernel], nests: NestTarget | None = None
              ) -> tuple[str, dict[str, list[DeviceKernel]]]:
    """(device source, device kernels per PrimFunc name) for a GPU target (cached); with
    `nests`, the PrimFuncs that have a hand-written loop nest take it (a CPU device)."""
    def build(out: Path) -> None:
        source, launches = _lower_gpu(kind, kernels, nests)
        out.write_text(json.dumps({"source": source, "launches": {
            n: [[k.name, list(k.buffers), list(k.ints), list(k.groups), list(k.local), k.when] for k in ks]
            for n, ks in launches.items()}}))

    what = "device" + (f" nests {nests.name}\n{nests.prelude}" if nests else "")
    data = json.loads(cached_build(_key(TARGETS[kind], kernels, what), build))
    launches = {n: [DeviceKernel(a, tuple(b), tuple(c), tuple(d), tuple(e), f) for a, b, c, d, e, f in ks]
                for n, ks in data["launches"].items()}
    return data["source"], launches


def schedule(config: Mapping, kernels: Mapping[str, PrimKernel], by_hand: frozenset[str] = frozenset(),
             rewrite: Callable[[str], str] = str, nests: NestTarget | None = None):
    """(target, module) with each PrimFunc (its script passed through `rewrite`) scheduled for
    the GPU target `config` by the first dlight rule that takes it; sequential blocks, blocks
    no rule takes (or a rule fails on) and the PrimFuncs named in `by_hand`, by the hand
    schedule; with `nests`, a PrimFunc with a loop nest as written, on `nests`' primitives."""
    import tvm
    from tvm.s_tir import dlight as dl

    target = tvm.target.Target(dict(config))
    rules = [dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(), dl.gpu.Fallback()]
    funcs = {}
    with target:
        for name, k in kernels.items():
            if nests and k.cpu_body:
                funcs[name] = nests.parse(rewrite(k.script(cpu=True))).with_attr("tirx.is_scheduled", True)
                continue
            func = tvm.script.from_source(rewrite(k.script()))
            scheduled = None if k.sequential or name in by_hand else _dlight(func, target, rules)
            funcs[name] = (scheduled or _one_thread_per_point(func)).with_attr("tirx.is_scheduled", True)
    return target, tvm.IRModule(funcs)


def _dlight(func, target, rules):
    """The function as scheduled by the first dlight rule that applies, None when none does."""
    for rule in rules:
        try:
            space = rule.apply(func, target, False)
        except (AssertionError, IndexError, KeyError, RuntimeError, TypeError, ValueError):
            continue  # dlight's pattern analysis fails on some index forms: the next rule decides
        if space is not None:
            return (space[0] if isinstance(space, list) else space).mod["main"]
    return None


def _parallel_points(func):
    """CPU hand schedule: the block's spatial loops fused into one parallel loop."""
    from tvm import s_tir

    sch = s_tir.Schedule(func)
    blk = sch.get_sblock("b")
    loops = sch.get_loops(blk)
    spatial = [loop for loop, iv in zip(loops, sch.get(blk).iter_vars) if int(iv.iter_type) == 0]
    sch.parallel(sch.fuse(*spatial))
    return sch.mod["main"]


def _one_thread_per_point(func):
    """Hand schedule: the block's spatial loops fused and split into blocks of GPU_THREADS
    threads; reduction loops and the body's own loops run serially per thread."""
    from tvm import s_tir

    sch = s_tir.Schedule(func)
    blk = sch.get_sblock("b")
    loops = sch.get_loops(blk)
    spatial = [loop for loop, iv in zip(loops, sch.get(blk).iter_vars) if int(iv.iter_type) == 0]
    bx, tx = sch.split(sch.fuse(*spatial), [None, GPU_THREADS])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    return sch.mod["main"]


@functools.cache
def _opencl_log1p() -> None:
    """TVM's OpenCL C spells log1p as C's `log1pf`, which OpenCL C does not have; its name
    there is `log1p` (softplus uses it: dflash_ir/activations.py)."""
    from tvm import tirx
    from tvm.tirx.op import register_intrin_lowering

    register_intrin_lowering("tirx.log1p", target="opencl", level=99,
                             f=lambda call: tirx.call_pure_extern(str(call.ty), "log1p", *call.args))


def _lower_gpu(kind: str, kernels: Mapping[str, PrimKernel], nests: NestTarget | None
               ) -> tuple[str, dict[str, list[DeviceKernel]]]:
    from tvm.tirx.build import codegen_build

    if not kernels:  # a graph of views only
        return "", {}
    if kind == "opencl":
        _opencl_log1p()
    _, device_target, device_mod, launches = scheduled_device(TARGETS[kind], kernels, nests=nests)
    if nests and nests.device_rewrite:
        device_mod = nests.device_rewrite(device_mod)
    return (nests.prelude if nests else "") + codegen_build(device_mod, device_target).inspect_source(), launches


def scheduled_device(config: Mapping, kernels: Mapping[str, PrimKernel], rewrite: Callable[[str], str] = str,
                     nests: NestTarget | None = None):
    """(scheduled module, device target, device module, device kernels per PrimFunc). A dlight
    schedule TVM then fails to lower (e.g. an int32 overflow in its index arithmetic for a
    one-column product with symbolic rows on CUDA) is replaced by the hand schedule."""
    target, mod = schedule(config, kernels, rewrite=rewrite, nests=nests)
    try:
        return (mod, *lower_device(target, mod, kernels))
    except (RuntimeError, ValueError):
        failing = frozenset(n for n in kernels if not _lowers(target, mod[n], {n: kernels[n]}))
        target, mod = schedule(config, kernels, by_hand=failing, rewrite=rewrite, nests=nests)
        return (mod, *lower_device(target, mod, kernels))


def _lowers(target, func, kernels) -> bool:
    import tvm

    try:
        lower_device(target, tvm.IRModule({next(iter(kernels)): func}), kernels)
    except (RuntimeError, ValueError):
        return False
    return True


def lower_device(target, mod, kernels: Mapping[str, PrimKernel]):
    """(device target, device module, device kernels per PrimFunc) of a scheduled module."""
    import tvm
    from tvm.tirx.build import split_host_device_mods

    target = target.with_host(tvm.target.Target(TARGETS["llvm"]))
    mod = tvm.tirx.transform.BindTarget(target)(mod)
    pipeline, _, finalize_device = tvm.tirx.get_default_tir_pipeline(target)
    host, devices = split_host_device_mods(pipeline(mod))
    (device_target, device_mod), = devices.items()
    device_mod = finalize_device()(device_mod)
    device_funcs = {gv.name_hint: f for gv, f in device_mod.functions_items()}
    launches = {gv.name_hint: _device_calls(f, kernels[gv.name_hint], device_funcs)
                for gv, f in host.functions_items() if gv.name_hint in kernels}
    return device_target, device_mod, launches


def _device_calls(host_func, kernel: PrimKernel, device_funcs) -> list[DeviceKernel]:
    """The device kernels a host function launches, in order."""
    import tvm

    calls, lets = [], {}

    def visit(node, conditions):
        if isinstance(node, tvm.ir.Call) and getattr(node.op, "name", "") == "tirx.call_ffi_kernel":
            calls.append((node, conditions))
        elif isinstance(getattr(node, "var", None), tvm.tirx.Var) and hasattr(node, "value"):
            if node.var.name not in kernel.ints:  # the symbols stay names; CSE'd values are inlined
                lets[node.var.name] = node.value

    _walk(host_func.body, visit)
    buffer_names = [p.name for p in kernel.params]
    out = []
    for call, conditions in calls:
        name = call.args[0].value
        params = device_funcs[name].params
        buffers, ints = [], []
        for p, arg in zip(params, call.args[1:]):
            if isinstance(p.ty, tvm.ir.PointerType):
                if ints:
                    raise RuntimeError(f"{name}: a buffer param follows an int param; the runner passes buffers first")
                buffers.append(buffer_names.index(p.name.removesuffix("_ptr")))
            else:
                ints.append(size_expr(arg, lets))
        tags = [str(t) for t in device_funcs[name].attrs["tirx.kernel_launch_params"]]
        extents = call.args[1 + len(params):]
        groups, local = ["1", "1", "1"], [1, 1, 1]
        for tag, extent in zip(tags, extents):
            axis = "xyz".index(tag[-1])
            if tag.startswith("blockIdx"):
                groups[axis] = size_expr(extent, lets)
            else:
                if not isinstance(extent, tvm.tirx.IntImm):
                    raise RuntimeError(f"{name}: {tag} extent {extent} is not a constant")
                local[axis] = int(extent)
        when = " and ".join(f"({size_expr(c, lets)})" for c in conditions) or None
        out.append(DeviceKernel(name, tuple(buffers), tuple(ints), tuple(groups), tuple(local), when))
    return out


def _walk(node, visit, conditions: tuple = ()) -> None:
    """Call `visit(node, conditions)` on every statement and expression under `node`, with
    the conditions of the branches it lies in (TVM's Python API has no TIR visitor any
    more; the FFI type info lists each node's fields)."""
    import tvm

    visit(node, conditions)
    if isinstance(node, tvm.tirx.IfThenElse):
        _walk(node.condition, visit, conditions)
        _walk(node.then_case, visit, conditions + (node.condition,))
        if node.else_case is not None:
            _walk(node.else_case, visit, conditions + (tvm.tirx.Not(node.condition),))
        return
    info = getattr(type(node), "__tvm_ffi_type_info__", None)
    while info is not None:
        for field in info.fields:
            value = getattr(node, field.name)
            for child in (value if isinstance(value, (list, tuple)) or type(value).__name__ == "Array" else [value]):
                if isinstance(child, (tvm.tirx.Stmt, tvm.ir.Expr)):
                    _walk(child, visit, conditions)
        info = info.parent_type_info


def size_expr(e, lets=None) -> str:
    """A TIR integer expression (or a launch condition) as a plan size expression (`lets`:
    values of bound vars)."""
    lets = lets or {}
    import tvm
    from tvm import tirx

    if isinstance(e, tirx.IntImm):
        return str(int(e))
    if isinstance(e, tirx.Var):
        return size_expr(lets[e.name], lets) if e.name in lets else e.name
    if isinstance(e, tirx.Cast):
        return size_expr(e.value, lets)
    binary = {tirx.Add: "+", tirx.Sub: "-", tirx.Mul: "*", tirx.FloorDiv: "//", tirx.FloorMod: "%",
              tirx.LT: "<", tirx.LE: "<=", tirx.GT: ">", tirx.GE: ">=", tirx.EQ: "==", tirx.NE: "!=",
              tirx.And: "and", tirx.Or: "or"}
    for cls, sym in binary.items():
        if isinstance(e, cls):
            return f"({size_expr(e.a, lets)} {sym} {size_expr(e.b, lets)})"
    if isinstance(e, (tirx.Min, tirx.Max)):
        return f"{'min' if isinstance(e, tirx.Min) else 'max'}({size_expr(e.a, lets)}, {size_expr(e.b, lets)})"
    if isinstance(e, tirx.Not):
        return f"(not {size_expr(e.a, lets)})"
    if isinstance(e, tvm.ir.Call) and e.op.name == "tirx.shift_right":
        return f"({size_expr(e.args[0], lets)} // {2 ** int(e.args[1])})"
    raise RuntimeError(f"launch extent {e} ({type(e).__name__}) has no size-expression form")


def digest(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()[:16]
