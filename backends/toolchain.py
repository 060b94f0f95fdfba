"""Device compilers (nvcc, HIP clang) run as subprocesses, a disk cache of their output, and
a tiny ELF symbol reader to check which kernels a cubin or HSACO code object holds.

None of this needs a GPU: binaries for every supported architecture are built on any
machine that has the compiler, and a GPU machine with only CuPy loads them.
"""
from __future__ import annotations

import functools
import glob
import hashlib
import os
import re
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path
from typing import Callable

from dflash_ir import cache

# Ampere, Ada, Hopper (H100/H200); $DFLASH_IR_CUDA_ARCHS (e.g. "sm_90") narrows it for a known GPU
CUBIN_ARCHS = tuple(os.environ.get("DFLASH_IR_CUDA_ARCHS", "sm_80,sm_89,sm_90").split(","))
PTX_ARCH = "compute_80"                     # JIT-compiled by the driver on any newer GPU
# CDNA2 (MI200) and RDNA2: the newest targets Debian's ROCm 5.2 device libraries cover
# that differ in wave size (64 vs 32); gfx11xx and gfx942 need a newer toolchain.
GFX_ARCHS = ("gfx90a", "gfx1030")


class CompileError(RuntimeError):
    """A device compiler rejected a source; the message carries its output."""


def cache_dir() -> Path:
    return cache.cache_dir("kernels", "DFLASH_IR_KERNEL_CACHE")


def cached_build(key: str, build: Callable[[Path], None]) -> bytes:
    """Bytes that `build(out_path)` writes, cached on disk under the hash of `key` (which must
    name everything the output depends on: source, flags, compiler version)."""
    path = cache_dir() / hashlib.sha256(key.encode()).hexdigest()
    if path.is_file():
        return path.read_bytes()
    with tempfile.TemporaryDirectory(prefix="dflash-ir-build-") as tmp:
        out = Path(tmp) / "out"
        build(out)
        data = out.read_bytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    partial.write_bytes(data)
    os.replace(partial, path)
    return data


def _run(cmd: list[str], what: str, env: dict | None = None) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode:
        raise CompileError(f"{what} failed ({' '.join(cmd)}):\n{done.stderr or done.stdout}")
    return done.stdout


def _compile_source(tool: list[str], source: str, suffix: str, key: str, what: str) -> bytes:
    def build(out: Path) -> None:
        src = out.with_name("kernels" + suffix)
        src.write_text(source)
        _run(tool + ["-o", str(out), str(src)], what)

    return cached_build(f"{key}\n{' '.join(tool)}\n{source}", build)


# -- CUDA -------------------------------------------------------------------------------
@functools.cache
def find_nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and Path(home, "bin", "nvcc").is_file():
            return str(Path(home, "bin", "nvcc"))
    return None


@functools.cache
def nvcc_version() -> str:
    return _run([find_nvcc(), "--version"], "nvcc --version").strip().splitlines()[-1]


def nvcc_ptx(source: str) -> bytes:
    """PTX for PTX_ARCH: what the driver JIT-compiles on GPUs newer than every cubin."""
    tool = [find_nvcc(), "-ptx", f"-arch={PTX_ARCH}", "-O3", "-std=c++17"]
    return _compile_source(tool, source, ".cu", nvcc_version(), "nvcc -ptx")


def ptxas_cubin(ptx: bytes, arch: str) -> bytes:
    """A cubin for `arch` (sm_XY) assembled from the PTX: the C++ front end runs once for
    every architecture (the kernels use nothing newer than PTX_ARCH has)."""
    tool = [str(Path(find_nvcc()).with_name("ptxas")), f"-arch={arch}", "-O3"]
    return _compile_source(tool, ptx.decode(), ".ptx", nvcc_version(), f"ptxas {arch}")


# -- HIP --------------------------------------------------------------------------------
@functools.cache
def find_hip() -> tuple[list[str], str] | str:
    """(clang command with ROCm paths, device-library folder), or the reason there is none."""
    clangs = [os.path.join(os.environ.get("HIP_CLANG_PATH", ""), "clang++"), "/opt/rocm/llvm/bin/clang++",
              *(f"clang++-{v}" for v in range(20, 13, -1)), "clang++"]
    clang = next((c for c in map(shutil.which, clangs) if c), None)
    libs = [os.environ.get("HIP_DEVICE_LIB_PATH", ""), "/usr/lib/x86_64-linux-gnu/amdgcn/bitcode",
            "/opt/rocm/amdgcn/bitcode", *glob.glob("/opt/rocm/lib/llvm/lib/clang/*/lib/amdgcn/bitcode")]
    lib = next((d for d in libs if d and Path(d, "ocml.bc").is_file()), None)
    rocm = next((r for r in ("/opt/rocm", "/usr") if Path(r, "include", "hip", "hip_runtime.h").is_file()), None)
    missing = [what for what, found in (("a clang with the AMDGPU target (Debian: clang via hipcc)", clang),
                                         ("the ROCm device libraries (Debian: rocm-device-libs)", lib),
                                         ("the HIP headers (Debian: hipcc / libamdhip64-dev)", rocm)) if not found]
    if missing:
        return "HIP toolchain incomplete, missing " + "; ".join(missing) + \
               " (on Debian: apt-get install hipcc rocm-device-libs lld)"
    return [clang, "-x", "hip", f"--rocm-path={rocm}", f"--hip-device-lib-path={lib}", "--cuda-device-only",
            "--no-gpu-bundle-output", "-O3", "-std=c++17", "-mllvm", "-amdgpu-early-inline-all=true",
            "-mllvm", "-amdgpu-function-calls=false"], lib


def hip_archs() -> tuple[str, ...]:
    """The GFX_ARCHS the installed device libraries support."""
    found = find_hip()
    if isinstance(found, str):
        return ()
    _, lib = found
    return tuple(a for a in GFX_ARCHS if Path(lib, f"oclc_isa_version_{a[3:]}.bc").is_file())


@functools.cache
def _hip_version(clang: str) -> str:
    return _run([clang, "--version"], "clang --version").splitlines()[0]


def hip_build(source: str, arch: str) -> bytes:
    """An HSACO code object (ELF) for one gfx target."""
    found = find_hip()
    if isinstance(found, str):
        raise CompileError(found)
    tool, _ = found
    return _compile_source(tool + [f"--offload-arch={arch}"], source, ".hip", _hip_version(tool[0]), f"HIP clang {arch}")


# -- ELF --------------------------------------------------------------------------------
_SHT_SYMTAB, _STT_FUNC, _STB_GLOBAL = 2, 2, 1


def elf_functions(data: bytes) -> set[str]:
    """Names of the global function symbols of a 64-bit little-endian ELF (cubin or HSACO):
    the kernels a module loader can find by name."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names = set()
    for _, kind, _, _, offset, size, link, _, _, entsize in sections:
        if kind != _SHT_SYMTAB:
            continue
        strtab = sections[link]
        for at in range(offset, offset + size, entsize):
            name, info, _, _, _, _ = struct.unpack_from("<IBBHQQ", data, at)
            if info & 0xF == _STT_FUNC and info >> 4 == _STB_GLOBAL:
                start = strtab[4] + name
                names.add(data[start:data.index(b"\0", start)].decode())
    return names


def ptx_entries(text: str) -> set[str]:
    return set(re.findall(r"\.entry\s+([A-Za-z_]\w*)\s*\(", text))
