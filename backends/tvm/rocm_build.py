"""tvm-rocm: AMDGPU code objects through TVM's LLVM with Debian's ROCm device libraries.

TVM lowers every kernel for the GFX targets the device libraries cover (toolchain.hip_archs:
gfx90a, gfx1030) and its LLVM (22) emits an AMDGPU relocatable object with the device
bitcode (ocml, ockl, oclc_*) linked in. That object is code object v6 (ELF ABI version 4),
which only an ld.lld from LLVM 18 or newer links: Debian's default lld (14/15) rejects it
("unknown abi version"), and TVM 0.27's rocm target takes no option to ask LLVM for v5.
scripts/setup.sh installs Debian's lld-19 beside the default one; `linker` finds it. A v6
HSACO loads on a ROCm 6.2 or newer runtime.
"""
from __future__ import annotations

import contextlib
import functools
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from ..base import BackendUnavailable
from ..toolchain import find_hip


def ocml_f64(script: str) -> str:
    """A kernel script with its f64 cos / sin / pow (rope's, the only f64 math in the kernels)
    called from the device library: TVM maps only the f32 forms to ocml, and LLVM cannot
    select AMDGPU code for the f64 intrinsics (it aborts the process)."""
    return re.sub(r"T\.(cos|sin|pow)\(", lambda m: f'T.call_pure_extern("float64", "__ocml_{m[1]}_f64", ', script)


@contextlib.contextmanager
def _callbacks(bitcode_dir: str, objects: list[bytes]):
    """TVM's ROCm hooks for this build: device bitcode from `bitcode_dir`; the link step
    keeps the relocatable object (returned unlinked) so the build completes."""
    import tvm_ffi
    from tvm.support import rocm

    names = ("tvm_callback_rocm_bitcode_path", "tvm_callback_rocm_link")
    previous = {n: tvm_ffi.get_global_func(n, allow_missing=True) for n in names}

    def keep(obj):
        objects.append(bytes(obj))
        return obj

    tvm_ffi.register_global_func(names[0], lambda rocdl_dir=None: rocm.callback_rocm_bitcode_path(bitcode_dir),
                                 override=True)
    tvm_ffi.register_global_func(names[1], keep, override=True)
    try:
        yield
    finally:
        for n, f in previous.items():
            if f is not None:
                tvm_ffi.register_global_func(n, f, override=True)


def amdgpu_object(mod, arch: str) -> bytes:
    """The AMDGPU relocatable object (ELF) TVM's LLVM makes of a scheduled module for `arch`."""
    import tvm

    from .build import TARGETS

    found = find_hip()
    if isinstance(found, str):
        raise BackendUnavailable(found)
    objects: list[bytes] = []
    target = tvm.target.Target({**TARGETS["rocm"], "mcpu": arch})
    with _callbacks(found[1], objects):
        tvm.compile(mod, target=target)
    (obj,), = [objects]
    return obj


LINKERS = tuple(f"ld.lld-{v}" for v in range(22, 17, -1)) + ("ld.lld",)
MIN_LLD = 18  # the first LLD that links AMDGPU code object v6


def _lld_major(tool: str) -> int:
    out = subprocess.run([tool, "--version"], capture_output=True, text=True).stdout
    found = re.search(r"LLD (\d+)", out)
    return int(found[1]) if found else 0


@functools.cache
def linker() -> str:
    """The first ld.lld on PATH new enough for TVM's code objects; BackendUnavailable says
    which were found when none is."""
    found = {tool: _lld_major(tool) for tool in LINKERS if shutil.which(tool)}
    for tool, major in found.items():
        if major >= MIN_LLD:
            return tool
    have = ", ".join(f"{t} (LLD {m})" for t, m in found.items()) or "none"
    raise BackendUnavailable(f"TVM's LLVM emits AMDGPU code object v6, which needs an ld.lld from LLVM {MIN_LLD} or "
                             f"newer to link (found: {have}); on Debian 12: apt-get install lld-19")


def link(obj: bytes) -> bytes:
    """An HSACO from an AMDGPU object, linked by `linker()`."""
    tool = linker()
    with tempfile.TemporaryDirectory(prefix="dflash-ir-rocm-") as tmp:
        src, out = Path(tmp, "kernels.o"), Path(tmp, "kernels.hsaco")
        src.write_bytes(obj)
        done = subprocess.run([tool, "-shared", str(src), "-o", str(out)], capture_output=True, text=True)
        if done.returncode:
            raise BackendUnavailable(f"{tool} could not link the AMDGPU code object TVM's LLVM emits "
                                     f"(ELF ABI version {obj[8]}): {done.stderr.strip()}")
        return out.read_bytes()
