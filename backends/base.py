"""The backend interface, split the way tinygrad and TVM split it.

- compile: graph -> whatever files the backend needs in the artifact (works without the
  device: source, SPIR-V, cubin ...), described by a JSON-able program entry;
- load/run: program entry + artifact folder + weights -> a Program that runs on the device.

What `load` returns, a Program, and the types it shares with the runtime (RunResult,
WeightLoader, BindError, DeviceArray) are the contract in dflash_ir/program.py, which the
runtime imports instead of anything here.
"""
from __future__ import annotations

import importlib
import os
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Mapping

from dflash_ir.ir import Graph
from dflash_ir.program import Program, WeightLoader


def host_cpu_flags() -> frozenset[str]:
    """The host CPU's feature flags as /proc/cpuinfo names them (empty where it has none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    return frozenset(w for line in text.splitlines() if line.startswith("flags") for w in line.split(":", 1)[1].split())


def host_vnni() -> frozenset[str]:
    """{"avx512_vnni"} where the host CPU has it (and AVX-512F, for the registers) and
    DFLASH_IR_VNNI is not 0: what kernels running on this CPU may use beyond a compiler's
    target (lowering.ISA_EXTENSIONS)."""
    if os.environ.get("DFLASH_IR_VNNI") == "0":
        return frozenset()
    return frozenset({"avx512_vnni"}) if {"avx512f", "avx512_vnni"} <= host_cpu_flags() else frozenset()


def require_isa(entry: Mapping[str, Any], artifact_dir: Path, kernels: str) -> None:
    """Refuse a manifest entry whose `kernels` use an extension (`isa`) this CPU lacks."""
    from dflash_ir.errors import ArtifactError

    missing = sorted(set(entry.get("isa", ())) - host_cpu_flags())
    if missing:
        raise ArtifactError(f"{artifact_dir}: the {kernels} were compiled for a CPU with {', '.join(missing)}, "
                            f"which this CPU lacks (/proc/cpuinfo); recompile here (or with DFLASH_IR_VNNI=0)")


class BackendUnavailable(RuntimeError):
    """The backend cannot run here; the message says why and what would fix it."""


class Backend(ABC):
    name: str = ""
    # passes pay off for kernel backends; the interpreter is fastest on graphs as built,
    # where it dequantises each weight once and keeps it
    default_opt_level: int = 2

    def unavailable_reason(self) -> str | None:
        """None when the backend can run here, else a sentence saying why not."""
        return None

    def require(self) -> None:
        reason = self.unavailable_reason()
        if reason:
            raise BackendUnavailable(f"backend {self.name!r} cannot run here: {reason}")

    def device_description(self) -> str:
        return "host CPU"

    def device_is_cpu(self) -> bool:
        """Whether the device kernels run on is a CPU (PoCL, lavapipe) rather than a GPU."""
        return False

    def default_numerics(self) -> str:
        """The numerics mode a compile takes when none is named: $DFLASH_IR_NUMERICS if set,
        else the device's (`device_numerics`)."""
        return os.environ.get("DFLASH_IR_NUMERICS") or self.device_numerics()

    def device_numerics(self) -> str:
        """The faster mode on this device of those that keep greedy tokens equal on the oracle:
        `exact`, except where q8 has been measured faster (README, "Numerics")."""
        return "exact"

    def profile(self) -> str:
        """The device class kernels are scheduled for (lowering.PROFILES): $DFLASH_IR_PROFILE
        if set, else the device's; "gpu" with no device here (an artifact compiled without a
        device is meant for a GPU)."""
        forced = os.environ.get("DFLASH_IR_PROFILE")
        if forced:
            return forced
        return "cpu" if self.unavailable_reason() is None and self.device_is_cpu() else "gpu"

    @abstractmethod
    def compile(self, graph: Graph, out_dir: Path) -> dict[str, Any]:
        """Write the program's files under out_dir; return its manifest entry (paths relative to out_dir)."""

    @abstractmethod
    def load(self, graph: Graph, entry: Mapping[str, Any], artifact_dir: Path, weights: WeightLoader) -> Program:
        """Make a runnable program from its manifest entry."""


_BACKENDS: dict[str, type[Backend]] = {}


def register_backend(cls: type[Backend]) -> type[Backend]:
    _BACKENDS[cls.name] = cls
    return cls


# modules that register a backend when imported
BACKEND_MODULES = ("numpy_backend", "opencl", "cuda", "rocm", "vulkan", "tvm.backend")


def _register_all() -> None:
    for module in BACKEND_MODULES:
        importlib.import_module(f"{__package__}.{module}")


def get_backend(name: str) -> Backend:
    _register_all()

    if name not in _BACKENDS:
        raise ValueError(f"unknown backend {name!r}; known: {', '.join(sorted(_BACKENDS))}")
    return _BACKENDS[name]()


def known_backends() -> list[str]:
    _register_all()

    return sorted(_BACKENDS)
