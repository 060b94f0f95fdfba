"""The `rocm` backend: C-style kernels in the HIP dialect, compiled with HIP clang and the ROCm
device libraries to one HSACO code object per GFX target (toolchain.GFX_ARCHS that the
installed device libraries support), run through CuPy's ROCm build.

Compiling needs only the toolchain (Debian: hipcc, rocm-device-libs, lld); running needs an
AMD GPU whose target was compiled for, and CuPy built for ROCm.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Mapping

from dflash_ir.integrity import artifact_file

from .base import BackendUnavailable, register_backend
from .compiled import CompiledBackend
from .cuda import _cupy_reason
from .cupy_device import CupyDevice
from .toolchain import find_hip, hip_archs, hip_build


@register_backend
class ROCmBackend(CompiledBackend):
    name = "rocm"
    dialect = "hip"

    def unavailable_reason(self) -> str | None:
        reason = _cupy_reason("cupy-rocm-5-0 (CuPy's ROCm build)")
        if reason is None:
            import cupy

            if not cupy.cuda.runtime.is_hip:
                return "cupy is a CUDA build; the rocm backend needs CuPy's ROCm build (pip install cupy-rocm-5-0)"
        return reason and f"no ROCm GPU / {reason}"

    def device_description(self) -> str:
        if self.unavailable_reason():
            return f"ROCm (compiled for {', '.join(hip_archs()) or 'no GFX target'}; no GPU here)"
        return _gfx_arch()

    def build_files(self, source: str, path: Path) -> dict[str, Any]:
        found = find_hip()
        if isinstance(found, str):
            raise BackendUnavailable(f"cannot compile for rocm: {found}")
        archs = hip_archs()
        if not archs:
            raise BackendUnavailable("the installed ROCm device libraries support none of the GFX targets we build for")
        with ThreadPoolExecutor(len(archs)) as pool:
            binaries = list(pool.map(lambda arch: hip_build(source, arch), archs))
        files = {}
        for arch, data in zip(archs, binaries):
            file = path.with_suffix(f".{arch}.hsaco")
            file.write_bytes(data)
            files[arch] = f"kernels/{file.name}"
        return {"hsaco": files}

    def device_for(self, entry: Mapping[str, Any], artifact_dir: Path) -> CupyDevice:
        arch = _gfx_arch()
        if arch not in entry["hsaco"]:
            raise BackendUnavailable(f"this GPU is {arch}; the artifact has code objects for {', '.join(entry['hsaco'])} "
                                     f"only: recompile with a toolchain that supports {arch}")
        return CupyDevice(artifact_file(artifact_dir, entry["hsaco"][arch]))


def _gfx_arch() -> str:
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    return props["gcnArchName"].decode().split(":")[0]
