"""The tvm-llvm, tvm-opencl, tvm-cuda and tvm-rocm backends: kernels from TensorIR built by
apache-tvm, the launch plan and runner shared with the native backends.

- tvm-llvm: a shared library per graph, run through the TVM runtime on this CPU.
- tvm-opencl: TVM's OpenCL source, built and run by pyopencl (PoCL on a CPU-only machine).
- tvm-cuda: TVM's CUDA source compiled by nvcc to PTX and cubins, run by CuPy like the
  native cuda backend; loading needs no TVM.
- tvm-rocm: an HSACO per GFX target from TVM's LLVM, linked by an ld.lld >= 18 (rocm_build.py),
  run by the native rocm backend's runtime.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from dflash_ir.ir import Graph
from dflash_ir.program import WeightLoader

from ..base import Backend, BackendUnavailable, host_vnni, register_backend, require_isa
from ..plan import Launch, Plan, Step, compile_expr, contracts_of
from ..runner import DeviceProgram, Resident
from . import version
from .build import TARGETS, DeviceKernel, build_gpu, build_llvm, digest
from .lowering import lower
from .nest_targets import OPENCL_CPU, NestTarget
from .tune import SYMBOL, Tuned, tune


def gpu_plan(plan: Plan, launches: Mapping[str, list[DeviceKernel]]) -> Plan:
    """`plan` with each PrimFunc launch replaced by its device kernels' launches."""
    def expand(launch: Launch):
        for k in launches[launch.kernel]:
            yield Launch(k.name, tuple(launch.buffers[i] for i in k.buffers), k.ints, k.groups, k.local,
                         _both(launch.when, k.when))

    return _replan(plan, expand)


def _both(*conditions: str | None) -> str | None:
    return " and ".join(f"({c})" for c in conditions if c) or None


def tuned_plan(plan: Plan, tuned: Sequence[Tuned]) -> Plan:
    """`plan` launching each tuned specialisation when the call has its token count (a tuned
    kernel without the symbol instead of the kernel), the kernel itself otherwise."""
    by_kernel: dict[str, list[Tuned]] = {}
    for t in tuned:
        by_kernel.setdefault(t.kernel, []).append(t)

    def expand(launch: Launch):
        variants = by_kernel.get(launch.kernel, [])
        for t in variants:
            rows = f"{SYMBOL} == {t.rows}" if t.rows else None
            yield Launch(t.name, launch.buffers, (), launch.groups, launch.local, _both(launch.when, rows))
        if not variants or all(t.rows for t in variants):
            others = [f"{SYMBOL} != {t.rows}" for t in variants]
            yield Launch(launch.kernel, launch.buffers, launch.ints, launch.groups, launch.local, _both(launch.when, *others))

    return _replan(plan, expand)


def _replan(plan: Plan, expand: Callable[[Launch], Iterable[Launch]]) -> Plan:
    """`plan` with every launch replaced by those `expand` makes of it (contracts made anew)."""
    steps = [Step(s.node, tuple(l for launch in s.launches for l in expand(launch)), s.constant, s.temps)
             for s in plan.steps]
    return Plan(plan.graph, {}, steps, dict(plan.aliases), dict(plan.temps), list(plan.checks), dict(plan.packs),
                slots=list(plan.slots), buffers=dict(plan.buffers),
                contracts=contracts_of(steps, plan.extents.__getitem__), extents=dict(plan.extents))


class TVMBackend(Backend):
    target = ""
    native = ""  # the native backend whose runtime runs these kernels (none: tvm-llvm)

    def __init__(self):
        self._resident = Resident()
        self.tune_s: float | None = None   # --tune's budget in seconds (tvm-llvm); None: no tuning
        self._tune_until = 0.0
        self.tuning_runs = 0               # MetaSchedule runs the compiles made (cached records are not runs)
        self.progress: Callable[[str], None] = lambda msg: None

    def unavailable_reason(self) -> str | None:
        from ..base import get_backend

        return get_backend(self.native).unavailable_reason() if self.native else version.unavailable_reason()

    def device_description(self) -> str:
        from ..base import get_backend

        return f"{get_backend(self.native).device_description()}, kernels by TVM {version.PINNED}"

    def device_is_cpu(self) -> bool:
        from ..base import get_backend

        return get_backend(self.native).device_is_cpu() if self.native else True

    def pin(self) -> dict[str, Any]:
        return {"version": version.PINNED, "target": TARGETS[self.target]}

    def require_tvm(self) -> None:
        reason = version.unavailable_reason()
        if reason:
            raise BackendUnavailable(f"backend {self.name!r} cannot compile here: {reason}")

    def check_entry(self, entry: Mapping[str, Any]) -> None:
        """Refuse an entry this installation cannot load (device source needs no TVM: nothing to check)."""

    def isa(self) -> frozenset[str]:
        """The extensions the loop nests may use (the Q8_0 x products' VPDPBUSD): none on a GPU."""
        return frozenset()

    def device_numerics(self) -> str:
        """q8 where the nests sum Q8_0 activations with VNNI (`isa`), as opencl's default on
        the same CPU: the synthetic Q8_0 target's prefill about 2x exact's (README, "TVM")."""
        return "q8" if "avx512_vnni" in self.isa() else "exact"

    def load(self, graph: Graph, entry: Mapping[str, Any], artifact_dir: Path, weights: WeightLoader) -> DeviceProgram:
        self.check_entry(entry)
        require_isa(entry, artifact_dir, f"{self.name} kernels")
        self.require()
        device = self.device_for(entry, Path(artifact_dir))
        return DeviceProgram(graph, Plan.from_dict(entry["plan"]), device, weights, self._resident)

    def device_for(self, entry: Mapping[str, Any], artifact_dir: Path):
        raise NotImplementedError


@register_backend
class TVMLLVMBackend(TVMBackend):
    name = "tvm-llvm"
    target = "llvm"

    def device_description(self) -> str:
        return f"host CPU through the TVM {version.PINNED} runtime (LLVM)"

    def compile(self, graph: Graph, out_dir: Path) -> dict[str, Any]:
        from .build import host_llvm

        self.require_tvm()
        isa = self.isa()
        plan, kernels = lower(graph, "cpu", isa)
        tuned = []
        if self.tune_s is not None:  # one budget for every program this backend compiles
            self._tune_until = self._tune_until or time.monotonic() + self.tune_s
            tuned, runs = tune(host_llvm(), kernels, self._tune_until, self.progress)
            self.tuning_runs += runs
            plan = tuned_plan(plan, tuned)
        library = build_llvm(kernels, tuned)
        out_dir = Path(out_dir)
        path = _write(out_dir / "kernels" / f"tvm-llvm-{digest(library)}.so", library)
        table = {n: {"params": [[p.dtype, p.size] for p in k.params], "ints": list(k.ints)} for n, k in kernels.items()}
        for t in tuned:  # the token count is fixed: buffer sizes are numbers
            env = {SYMBOL: t.rows}
            table[t.name] = {"params": [[p.dtype, str(compile_expr(p.size)(env))] for p in kernels[t.kernel].params],
                             "ints": []}
        entry = {"tvm": self.pin(), "library": str(path.relative_to(out_dir)), "kernels": table, "isa": sorted(isa),
                 "plan": plan.to_dict()}
        if tuned:
            records = json.dumps([t.record for t in tuned], sort_keys=True)
            entry["tuning"] = str(_write(out_dir / "kernels" / f"tvm-llvm-tuning-{digest(records)}.json",
                                         records.encode()).relative_to(out_dir))
        return entry

    def pin(self) -> dict[str, Any]:
        from .build import host_llvm

        return {"version": version.PINNED, "target": dict(host_llvm())}

    def isa(self) -> frozenset[str]:
        return host_vnni()

    def check_entry(self, entry: Mapping[str, Any]) -> None:
        """The same TVM, and this CPU: the library's vector code is for the CPU it was built on."""
        from dflash_ir.errors import ArtifactError

        from .build import host_llvm

        version.check_artifact(entry)
        built, here = entry["tvm"]["target"].get("mcpu"), host_llvm()["mcpu"]
        if built != here:
            raise ArtifactError(f"this artifact's tvm-llvm kernels were built for the CPU {built!r} and this one is "
                                f"{here!r}: recompile the artifact here")

    def device_for(self, entry: Mapping[str, Any], artifact_dir: Path):
        from .host import HostDevice

        return HostDevice(artifact_dir / entry["library"], entry["kernels"])


def _write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        path.write_bytes(data)
    return path


class TVMGPUBackend(TVMBackend):
    """Device source from TVM; compile = write it (and what the device compiler makes of it)."""

    extension = ""

    def compile(self, graph: Graph, out_dir: Path) -> dict[str, Any]:
        self.require_tvm()
        nests, isa = self.nests(), self.isa()
        plan, kernels = lower(graph, "cpu" if nests else "gpu", isa)
        source, launches = build_gpu(self.target, kernels, nests)
        path = Path(out_dir) / "kernels" / f"tvm-{self.target}-{digest(source)}.{self.extension}"
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            path.write_text(source)
        files = self.build_files(source, path)
        return {"tvm": self.pin(), "source": str(path.relative_to(out_dir)), **files, "isa": sorted(isa),
                "profile": "cpu" if nests else "gpu", "plan": gpu_plan(plan, launches).to_dict()}

    def nests(self) -> NestTarget | None:
        """The loop nests' target where this device takes them (a CPU), None for dlight's
        schedules (a GPU)."""
        return None

    def build_files(self, source: str, path: Path) -> dict[str, Any]:
        return {}


@register_backend
class TVMOpenCLBackend(TVMGPUBackend):
    name = "tvm-opencl"
    target = "opencl"
    extension = "cl"

    native = "opencl"

    def nests(self) -> NestTarget | None:
        """On a CPU device (PoCL) the products, attention, the delta rule and the experts run
        the llvm target's loop nests, a task per work-group: dlight's GPU schedules ran 12-141x
        behind the native kernels there."""
        return OPENCL_CPU if self.profile() == "cpu" else None

    def isa(self) -> frozenset[str]:
        """The native backend's on a CPU device (PoCL on a host with VNNI), where the nests run."""
        from ..base import get_backend

        return get_backend(self.native).isa() if self.nests() else frozenset()

    def build_files(self, source: str, path: Path) -> dict[str, Any]:
        if source and self.unavailable_reason() is None:
            from .cl_device import program

            program(source)
        return {}

    def device_for(self, entry: Mapping[str, Any], artifact_dir: Path):
        from .cl_device import TVMCLDevice

        return TVMCLDevice((artifact_dir / entry["source"]).read_text())


@register_backend
class TVMCUDABackend(TVMGPUBackend):
    name = "tvm-cuda"
    target = "cuda"
    extension = "cu"

    native = "cuda"

    def build_files(self, source: str, path: Path) -> dict[str, Any]:
        from ..cuda import CUDABackend

        return CUDABackend().build_files(source, path)

    def device_for(self, entry: Mapping[str, Any], artifact_dir: Path):
        from ..cuda import CUDABackend

        return CUDABackend().device_for(entry, artifact_dir)


@register_backend
class TVMROCmBackend(TVMBackend):
    """One linked HSACO per GFX target (rocm_build.py: TVM's LLVM emits code object v6, which
    needs an ld.lld >= 18); runs on the native rocm backend's runtime."""

    name = "tvm-rocm"
    target = "rocm"

    native = "rocm"

    def compile(self, graph: Graph, out_dir: Path) -> dict[str, Any]:
        from ..toolchain import hip_archs
        from .build import scheduled_device
        from .rocm_build import amdgpu_object, link, ocml_f64

        self.require_tvm()
        archs = hip_archs()
        if not archs:
            raise BackendUnavailable("no ROCm device libraries for gfx90a or gfx1030 found (Debian package "
                                     "rocm-device-libs)")
        plan, kernels = lower(graph)
        if not kernels:
            raise BackendUnavailable(f"{graph.name} launches no kernel: tvm-rocm makes no code object for it")
        mod, _, _, launches = scheduled_device({**TARGETS["rocm"], "mcpu": archs[0]}, kernels, ocml_f64)
        files = {}
        for arch in archs:
            hsaco = link(amdgpu_object(mod, arch))
            path = Path(out_dir) / "kernels" / f"tvm-rocm-{digest(hsaco)}.{arch}.hsaco"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(hsaco)
            files[arch] = str(path.relative_to(out_dir))
        return {"tvm": self.pin(), "hsaco": files, "plan": gpu_plan(plan, launches).to_dict()}

    def device_for(self, entry: Mapping[str, Any], artifact_dir: Path):
        from ..rocm import ROCmBackend

        return ROCmBackend().device_for(entry, artifact_dir)
