"""GLSL -> SPIR-V for the Vulkan backend: glslangValidator, then spirv-val, cached on disk by
source and tool versions (the shaders come from backends/kir/glsl.py)."""
from __future__ import annotations

import functools
import shutil
import subprocess
from pathlib import Path

from .toolchain import CompileError, cached_build

TARGET_ENV = "vulkan1.1"  # SPIR-V 1.3: 16-bit storage is core there, 8-bit storage an extension


class GLSLToolMissing(CompileError):
    """glslangValidator or spirv-val is not installed."""


_TOOLS = {"glslangValidator": "glslang-tools", "spirv-val": "spirv-tools"}


@functools.cache
def _tool(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        raise GLSLToolMissing(f"{name} not found: install the Debian package {_TOOLS[name]} "
                              f"(apt-get install {_TOOLS[name]})")
    return found


def spirv_tools_missing() -> str | None:
    """Why SPIR-V cannot be built here, or None when both tools are installed."""
    try:
        for name in _TOOLS:
            _tool(name)
    except GLSLToolMissing as e:
        return str(e)
    return None


@functools.cache
def _tool_versions() -> str:
    return "\n".join(subprocess.run([_tool(name), "--version"], capture_output=True, text=True).stdout.strip()
                     for name in _TOOLS)


def compile_spirv(source: str, *, name: str = "kernel") -> bytes:
    """SPIR-V of a compute shader (glslangValidator, then spirv-val), cached on disk by
    source and tool versions; CompileError naming the kernel and quoting the tool output."""
    compiler = [_tool("glslangValidator"), "-V", "--target-env", TARGET_ENV]
    validator = [_tool("spirv-val"), "--target-env", TARGET_ENV]

    def build(out: Path) -> None:
        src = out.with_name("kernel.comp")
        src.write_text(source)
        for cmd in (compiler + ["-o", str(out), str(src)], validator + [str(out)]):
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:
                raise CompileError(f"{name}: {Path(cmd[0]).name} failed:\n{done.stdout}{done.stderr}")

    return cached_build(f"spirv {TARGET_ENV}\n{_tool_versions()}\n{source}", build)
