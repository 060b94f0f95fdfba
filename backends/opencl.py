"""The `opencl` backend: C-style kernels in the OpenCL C dialect, built and run with pyopencl.

Runs on any OpenCL 1.2+ device; on a CPU-only machine that is PoCL (Debian package
`pocl-opencl-icd`), which is what CI uses. A GPU device is preferred when there is one.

The artifact keeps one source file per kernel (kernels/opencl/<kernel>.cl, plus the shared
header): kernel names are content hashes, so the prefill, verify and decode programs of a
model share most files. A process builds each kernel once: kernels not built yet are built
together as one OpenCL program on the first launch after a load (PoCL compiles a kernel
again for every program holding it), and PoCL's disk cache (~/.cache/pocl, or
$POCL_CACHE_DIR) lets the next process skip the compile. That cache is keyed by a program's
source, and PoCL also builds a kernel's work-group function on its first launch at each
work-group size (seconds; cached under the program's key too), so the programs a load builds
must not depend on what the process did before: compiling validates its kernels in programs
of its own (`_VALIDATED`), and a process that compiled and then loads builds what a process
that only loads builds, and finds what that one's launches left in the cache.

On a PoCL CPU device whose host has AVX-512 VNNI, Q8_0 products over Q8_0 activations (the
`q8` numerics) sum each block with VPDPBUSD, reached by inline assembly: PoCL compiles for
the CPU model it is told, and a VM that hides the model gets skylake-avx512, without VNNI.
The manifest entry names the extension (`isa`) and a load on a CPU without it is refused;
DFLASH_IR_VNNI=0 compiles without it.

PoCL's worker threads are pinned to cores (POCL_AFFINITY=1, unless the environment says
otherwise): unpinned, the kernel scheduler moves them, and a kernel of a millisecond takes
twice as long or more (a 6144x1024 Q8_0 GEMV on 2 cores: 0.87 ms median unpinned, 0.36 ms
pinned). Other OpenCL drivers ignore the variable.
"""
from __future__ import annotations

import functools
import os
import threading
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from dflash_ir.integrity import artifact_file
from dflash_ir.ir import Graph


from .base import BackendUnavailable, host_vnni, register_backend, require_isa
from .compiled import CompiledBackend
from .kir.build import FUNCTIONS
from .kir.c import PRINTERS
from .lowering import lower
from .plan import Plan

_INSTALL = "install an OpenCL driver, e.g. the Debian package pocl-opencl-icd (PoCL runs kernels on the CPU)"
# the reference divides and takes square roots correctly rounded; OpenCL may not by default
BUILD_OPTIONS = ["-cl-fp32-correctly-rounded-divide-sqrt"]
os.environ.setdefault("POCL_AFFINITY", "1")  # read when PoCL starts, i.e. before any platform query


@functools.cache
def _context():
    """(context, queue, device) on the first GPU, else the first device of any platform."""
    import pyopencl as cl

    devices = [d for p in cl.get_platforms() for d in p.get_devices()]
    if not devices:
        raise BackendUnavailable(f"no OpenCL device found: {_INSTALL}")
    device = next((d for d in devices if d.type & cl.device_type.GPU), devices[0])
    ctx = cl.Context([device])
    return ctx, cl.CommandQueue(ctx), device


def _program(source: str) -> dict[str, Any]:
    """Kernels by name; raises with the build log on a compile error."""
    import pyopencl as cl

    ctx, _, _ = _context()
    program = cl.Program(ctx, source).build(options=BUILD_OPTIONS)
    return {k.function_name: k for k in program.all_kernels()}


class KernelLibrary:
    """Every kernel this process has seen, by name (a content hash); the ones not built yet
    are built together, as one program, when one of them is needed."""

    def __init__(self):
        self.header = ""
        self.sources: dict[str, str] = {}
        self.built: dict[str, Any] = {}
        self._lock = threading.Lock()

    def add(self, header: str, sources: Mapping[str, str]) -> None:
        self.header = header
        self.sources.update(sources)

    def build_pending(self) -> None:
        with self._lock:
            pending = [s for n, s in self.sources.items() if n not in self.built]
            if pending:
                self.built.update(_program(self.header + "\n".join(pending)))

    def kernel(self, name: str):
        if name not in self.built:
            self.build_pending()
        return self.built[name]


_LIBRARY = KernelLibrary()    # what loaded programs launch
_VALIDATED = KernelLibrary()  # what compiling built to validate, never launched


class CLDevice:
    def __init__(self):
        import pyopencl as cl

        self._cl = cl
        self.ctx, self.queue, _ = _context()
        self.memory = self.ctx  # every program's buffers live in the process's one context
        self.view_align = self.ctx.devices[0].mem_base_addr_align // 8  # a sub-buffer's origin, in bytes

    def alloc(self, nbytes: int):
        return self._cl.Buffer(self.ctx, self._cl.mem_flags.READ_WRITE, nbytes)

    def upload(self, buf, array: np.ndarray, offset: int = 0) -> None:
        self._cl.enqueue_copy(self.queue, buf, array, dst_offset=offset)

    def download(self, buf, array: np.ndarray) -> None:
        self._cl.enqueue_copy(self.queue, array, buf)

    def view(self, buf, offset: int, nbytes: int):
        return buf.get_sub_region(offset, nbytes)

    def map_for_write(self, buf, nbytes: int):
        """(the buffer's bytes as a host array, unmap): on a CPU device its own memory, so a
        load packs weights straight into it, on several threads, with no copy after."""
        host, _ = self._cl.enqueue_map_buffer(self.queue, buf, self._cl.map_flags.WRITE_INVALIDATE_REGION, 0,
                                              (nbytes,), np.uint8)
        return host, host.base.release

    def copy(self, src, src_offset: int, dst, dst_offset: int, nbytes: int) -> None:
        self._cl.enqueue_copy(self.queue, dst, src, byte_count=nbytes, src_offset=src_offset, dst_offset=dst_offset)

    def kernel(self, name: str):
        return _LIBRARY.kernel(name)

    def launch(self, kernel: str, groups, local, args) -> None:
        k = self.kernel(kernel)
        k.set_args(*args)
        self._cl.enqueue_nd_range_kernel(self.queue, k, _global_size(groups, local), tuple(local))

    def prepare(self, launches) -> Callable[[], None]:
        """A replay of `launches` with one kernel object per launch whose arguments are set
        now: setting arguments costs pyopencl about as much host time as the enqueue."""
        enqueue, queue, ready = self._cl.enqueue_nd_range_kernel, self.queue, []
        for name, groups, local, args in launches:
            k = self._cl.Kernel(self.kernel(name).program, name)
            k.set_args(*args)
            ready.append((k, _global_size(groups, local), tuple(local)))

        def replay() -> None:
            for k, size, local in ready:
                enqueue(queue, k, size, local)
        return replay


def _global_size(groups, local) -> tuple[int, ...]:
    return tuple(g * l for g, l in zip(groups, local))


@register_backend
class OpenCLBackend(CompiledBackend):
    name = "opencl"
    dialect = "opencl"

    def unavailable_reason(self) -> str | None:
        try:
            import pyopencl as cl
        except ImportError:
            return "pyopencl is not installed (pip install pyopencl)"
        try:
            if not any(p.get_devices() for p in cl.get_platforms()):
                return f"no OpenCL device found: {_INSTALL}"
        except cl.Error:
            return f"no OpenCL platform found: {_INSTALL}"
        return None

    def device_description(self) -> str:
        if self.unavailable_reason():
            return "OpenCL (no device here)"
        _, _, device = _context()
        return f"{device.name.strip()} ({device.platform.name.strip()}, {device.version.strip()})"

    def device_is_cpu(self) -> bool:
        import pyopencl as cl

        return bool(_context()[2].type & cl.device_type.CPU)

    def isa(self) -> frozenset[str]:
        """The extensions kernels may reach beyond the device compiler's target: avx512_vnni on
        a PoCL CPU device whose host has it (and AVX-512F, for the registers), unless
        DFLASH_IR_VNNI=0."""
        if self.unavailable_reason() or not self.device_is_cpu():
            return frozenset()
        if "Portable Computing Language" not in _context()[2].platform.name:
            return frozenset()
        return host_vnni()

    def device_numerics(self) -> str:
        """q8 on a CPU whose tiles sum Q8_0 activations with VNNI (`isa`): its products do a
        fraction of exact's work, which pays from SmolLM2-135M up (README, "Numerics")."""
        return "q8" if self.profile() == "cpu" and "avx512_vnni" in self.isa() else "exact"

    def compile(self, graph: Graph, out_dir: Path) -> dict[str, Any]:
        """One file per kernel plus the header; the graph's kernels are built when an OpenCL
        device is present, so a kernel the device rejects fails at compile time."""
        profile, isa = self.profile(), self.isa()
        plan = lower(graph, profile, isa=isa)
        dialect = PRINTERS[self.dialect]
        header = dialect.module_header(tuple(FUNCTIONS.values()))
        folder = Path(out_dir) / "kernels" / "opencl"
        folder.mkdir(parents=True, exist_ok=True)
        files = {"header.cl": header, **{f"{name}.cl": dialect.kernel_source(k)
                                                   for name, k in plan.kernels.items()}}
        for name, text in files.items():  # kernel files are named by content; the header is not
            path = folder / name
            if not path.exists() or (name == "header.cl" and path.read_text() != text):
                path.write_text(text)
        if self.unavailable_reason() is None:
            _VALIDATED.add(header, {n: dialect.kernel_source(k) for n, k in plan.kernels.items()})
            _VALIDATED.build_pending()
        return {"dialect": self.dialect, "profile": profile, "isa": sorted(isa), "sources": "kernels/opencl",
                "plan": plan.to_dict()}

    def device_for(self, entry: Mapping[str, Any], artifact_dir: Path) -> CLDevice:
        require_isa(entry, artifact_dir, "OpenCL kernels")
        def source(name: str) -> str:
            return artifact_file(artifact_dir, f"{entry['sources']}/{name}.cl").read_text()

        names = Plan.from_dict(entry["plan"]).kernel_names()
        _LIBRARY.add(source("header"), {n: source(n) for n in names})
        return CLDevice()
