"""The `cuda` backend: C-style kernels in the CUDA dialect, compiled with nvcc to PTX and with
ptxas to a cubin per architecture (CUBIN_ARCHS), run through CuPy.

Compiling needs only nvcc (no GPU); running needs CuPy and an NVIDIA GPU. At load the cubin
of the device's architecture is used (a cubin runs on GPUs of the same major version and an
equal or newer minor), else the PTX, which the driver JIT-compiles.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Mapping

from dflash_ir.integrity import artifact_file

from .base import BackendUnavailable, register_backend
from .compiled import CompiledBackend
from .cupy_device import CupyDevice
from .toolchain import CUBIN_ARCHS, PTX_ARCH, find_nvcc, nvcc_ptx, ptxas_cubin


def _cupy_reason(build: str) -> str | None:
    try:
        import cupy
    except ImportError:
        return f"cupy is not installed (pip install {build})"
    try:
        if cupy.cuda.runtime.getDeviceCount() == 0:
            return "no GPU visible to cupy"
    except Exception as e:  # no driver / no device
        return f"no GPU visible to cupy ({type(e).__name__}: {e})"
    return None


@register_backend
class CUDABackend(CompiledBackend):
    name = "cuda"
    dialect = "cuda"

    def unavailable_reason(self) -> str | None:
        reason = _cupy_reason("cupy-cuda13x")
        if reason is None:
            import cupy

            if cupy.cuda.runtime.is_hip:
                return "cupy is a ROCm build: use the rocm backend"
        return reason and f"no CUDA GPU / {reason}"

    def device_description(self) -> str:
        if self.unavailable_reason():
            return f"CUDA (compiled for {', '.join(CUBIN_ARCHS)} + PTX {PTX_ARCH}; no GPU here)"
        import cupy

        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        return f"{props['name'].decode()} (sm_{props['major']}{props['minor']})"

    def build_files(self, source: str, path: Path) -> dict[str, Any]:
        if find_nvcc() is None:
            raise BackendUnavailable("nvcc not found: install the CUDA toolkit (or put nvcc on PATH, or set CUDA_HOME) "
                                     "to compile for the cuda backend")
        ptx = nvcc_ptx(source)
        path.with_suffix(".ptx").write_bytes(ptx)
        with ThreadPoolExecutor(len(CUBIN_ARCHS)) as pool:
            for arch, data in zip(CUBIN_ARCHS, pool.map(lambda arch: ptxas_cubin(ptx, arch), CUBIN_ARCHS)):
                path.with_suffix(f".{arch}.cubin").write_bytes(data)
        return {"cubin": {arch: f"kernels/{path.stem}.{arch}.cubin" for arch in CUBIN_ARCHS},
                "ptx": f"kernels/{path.stem}.ptx"}

    def device_for(self, entry: Mapping[str, Any], artifact_dir: Path) -> CupyDevice:
        import cupy

        cc = cupy.cuda.Device().compute_capability  # "90", "86", "100"
        usable = [a for a in entry["cubin"] if a[3:-1] == cc[:-1] and a[-1] <= cc[-1]]
        chosen = entry["cubin"][max(usable)] if usable else entry["ptx"]
        return CupyDevice(artifact_file(artifact_dir, chosen))
