"""tvm-rocm: AMDGPU code objects through TVM's LLVM with Debian's ROCm device libraries.

What works: TVM lowers every kernel for the GFX targets the device libraries cover
(toolchain.hip_archs: gfx90a, gfx1030) and its LLVM (22) emits an AMDGPU relocatable
object with the device bitcode (ocml, ockl, oclc_*) linked in.
What does not: linking that object into a loadable HSACO. LLVM 22 emits code object v6
(ELF ABI version 4), which Debian's ld.lld rejects ("unknown abi version"); TVM 0.27's
rocm target takes no LLVM option to ask for v5, and LLVM 15's assembler cannot read LLVM
22's AMDGPU assembly either (checked with Debian's ld.lld 14 and 15, llvm-mc 15). An ld.lld
from LLVM 18 or newer (ROCm 6) links it.
"""
from __future__ import annotations

import contextlib
import re
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


def link(obj: bytes) -> bytes:
    """An HSACO from an AMDGPU object, linked by ld.lld; BackendUnavailable says why not."""
    with tempfile.TemporaryDirectory(prefix="dflash-ir-rocm-") as tmp:
        src, out = Path(tmp, "kernels.o"), Path(tmp, "kernels.hsaco")
        src.write_bytes(obj)
        try:
            done = subprocess.run(["ld.lld", "-shared", str(src), "-o", str(out)], capture_output=True, text=True)
        except FileNotFoundError:
            raise BackendUnavailable("ld.lld not found: install lld (Debian package lld) to link AMDGPU code objects")
        if done.returncode:
            version = subprocess.run(["ld.lld", "--version"], capture_output=True, text=True).stdout.strip()
            abi = obj[8]
            raise BackendUnavailable(
                f"{version} cannot link the AMDGPU code object TVM's LLVM emits (ELF ABI version {abi}, code object "
                f"v{abi + 2}): {done.stderr.strip()}; an ld.lld from LLVM 18 or newer (ROCm 6) links it")
        return out.read_bytes()
