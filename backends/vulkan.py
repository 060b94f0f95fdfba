"""The `vulkan` backend: kernels printed as GLSL compute shaders (backends/kir/glsl.py), compiled
to SPIR-V with glslangValidator, run through the Vulkan API (vulkan_device.py).

Compiling needs only glslangValidator and spirv-val (no device). Every kernel is compiled
once per feature variant (glsl.FULL, glsl.BASELINE): `full` uses 8/16-bit storage, int8 and
int64 arithmetic and subgroup operations (device features storageBuffer8BitAccess,
storageBuffer16BitAccess, shaderInt8, shaderInt64), `baseline` needs no optional feature. The
files are kernels/vulkan/<variant>/<kernel>.spv; kernel names are content hashes, so the
programs of a model share them. At load the first variant whose features the device has is
taken (a fallback is reported with a VariantFallback warning and in device_description()),
and the logical device is created with exactly that variant's features enabled.

Runs on any Vulkan 1.2 device; on a CPU-only machine that is Mesa's lavapipe (Debian
package mesa-vulkan-drivers, with the loader libvulkan1).

Kernels are scheduled for the chosen device's class (lowering profile "cpu" on lavapipe,
"gpu" elsewhere and when compiling without a device).

Environment: DFLASH_IR_VULKAN_DEVICE picks the device (an index or a name substring);
DFLASH_IR_VULKAN_FEATURES=full|baseline forces a variant (for tests and comparisons);
DFLASH_IR_PROFILE=cpu|gpu forces the lowering profile; DFLASH_IR_VULKAN_CHECKED=1 runs in checked
mode: the device is created with robustBufferAccess where it offers it, so a kernel reading
or writing past a buffer gets zeros or is discarded instead of touching other memory (on a
CPU driver such as lavapipe: the host heap); DFLASH_IR_VULKAN_TIMEOUT bounds a submission.
Per-kernel device times: `program.device.start_profiling()` ... `stop_profiling()`.
"""
from __future__ import annotations

import os
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Mapping

from dflash_ir.integrity import artifact_file
from dflash_ir.ir import Graph
from dflash_ir.program import WeightLoader

from .base import Backend, BackendUnavailable, register_backend
from .lowering import lower
from .plan import Plan
from .runner import DeviceProgram, Resident
from .vulkan_device import (PhysicalDevice, VulkanDevice, choose_device, open_device, physical_devices,
                            supported_features, supported_subgroup_operations)

ENV_VARIANT = "DFLASH_IR_VULKAN_FEATURES"
ENV_CHECKED = "DFLASH_IR_VULKAN_CHECKED"
ROBUST_ACCESS = "robustBufferAccess"
VARIANT_ORDER = ("full", "baseline")   # preferred first
SPIRV_DIR = "kernels/vulkan"


class VariantFallback(UserWarning):
    """The device lacks a feature of the preferred variant; a fallback variant runs instead."""


class UncheckedDevice(UserWarning):
    """Checked mode was asked for on a device without robustBufferAccess."""


def checked_features(physical: PhysicalDevice) -> frozenset[str]:
    """The features checked mode ($DFLASH_IR_VULKAN_CHECKED=1) adds: robustBufferAccess where
    the device offers it (a warning where it does not); none outside checked mode."""
    value = os.environ.get(ENV_CHECKED, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{ENV_CHECKED}={value!r} must be 0 or 1")
    if value != "1":
        return frozenset()
    if ROBUST_ACCESS not in supported_features(physical):
        warnings.warn(f"{ENV_CHECKED}=1: Vulkan device {physical.describe()} has no {ROBUST_ACCESS}; kernels run "
                      "unchecked", UncheckedDevice, stacklevel=3)
        return frozenset()
    return frozenset({ROBUST_ACCESS})


def _variants() -> dict[str, Any]:
    from .kir.glsl import BASELINE, FULL

    return {"full": FULL, "baseline": BASELINE}


def _requirements(features) -> dict[str, list[str]]:
    """A variant's manifest entry: device features to enable, subgroup operations to have."""
    return {"features": list(features.required_device_features()),
            "subgroup_operations": list(features.required_subgroup_operations())}


def device_capabilities(physical: PhysicalDevice) -> frozenset[str]:
    """Feature flags and compute-stage subgroup operations the device supports, by name."""
    return supported_features(physical) | supported_subgroup_operations(physical)


def choose_variant(variants: Mapping[str, Mapping[str, list[str]]], capabilities: frozenset[str],
                   forced: str | None = None) -> tuple[str, str | None]:
    """(variant, note): the first variant in VARIANT_ORDER (or the `forced` one) whose required
    features and subgroup operations are all in `capabilities`; `note` says why a preferred
    variant was passed over."""
    if forced and forced not in variants:
        raise ValueError(f"{ENV_VARIANT}={forced!r}: the artifact has the variants {sorted(variants)}")
    order = [forced] if forced else [v for v in VARIANT_ORDER if v in variants]
    passed = []
    for variant in order:
        missing = [f for need in variants[variant].values() for f in need if f not in capabilities]
        if not missing:
            return variant, ("; ".join(passed) + f"; using variant {variant!r}") if passed else None
        passed.append(f"variant {variant!r} needs {missing}, which the device lacks")
    raise BackendUnavailable("no SPIR-V variant runs on this Vulkan device: " + "; ".join(passed))


@register_backend
class VulkanBackend(Backend):
    name = "vulkan"

    def __init__(self):
        self._resident: dict[VulkanDevice, Resident] = {}

    def unavailable_reason(self) -> str | None:
        try:
            choose_device(physical_devices())
        except BackendUnavailable as e:
            return str(e)
        return None

    def _physical(self) -> PhysicalDevice:
        return choose_device(physical_devices())

    def device_description(self) -> str:
        if self.unavailable_reason():
            return "Vulkan (no device here)"
        physical = self._physical()
        variants = {name: _requirements(v) for name, v in _variants().items()}
        try:
            variant, note = choose_variant(variants, device_capabilities(physical), os.environ.get(ENV_VARIANT))
        except BackendUnavailable as e:
            return f"{physical.describe()}: {e}"
        return f"{physical.describe()}, SPIR-V variant {variant}" + (f" ({note})" if note else "")

    def device_is_cpu(self) -> bool:
        return self._physical().kind == "CPU"

    def compile(self, graph: Graph, out_dir: Path) -> dict[str, Any]:
        """SPIR-V for every kernel and variant (needs glslangValidator, not a device)."""
        from .kir.glsl import render_glsl
        from .spirv import compile_spirv

        profile = self.profile()
        plan = lower(graph, profile, row_streams=1, block_span=0)
        variants = _variants()
        todo = []
        for variant, features in variants.items():
            folder = Path(out_dir) / SPIRV_DIR / variant
            folder.mkdir(parents=True, exist_ok=True)
            todo += [(folder / f"{name}.spv", kernel, features) for name, kernel in plan.kernels.items()
                     if not (folder / f"{name}.spv").exists()]

        def build(job) -> None:
            path, kernel, features = job
            path.write_bytes(compile_spirv(render_glsl(kernel, features), name=kernel.name))

        with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
            list(pool.map(build, todo))
        return {"spirv": SPIRV_DIR, "profile": profile,
                "variants": {name: _requirements(v) for name, v in variants.items()}, "plan": plan.to_dict()}

    def load(self, graph: Graph, entry: Mapping[str, Any], artifact_dir: Path, weights: WeightLoader) -> DeviceProgram:
        self.require()
        physical = self._physical()
        variant, note = choose_variant(entry["variants"], device_capabilities(physical), os.environ.get(ENV_VARIANT))
        if note:
            warnings.warn(f"Vulkan device {physical.describe()}: {note}", VariantFallback, stacklevel=2)
        device = open_device(physical, frozenset(entry["variants"][variant]["features"]) | checked_features(physical))
        plan = Plan.from_dict(entry["plan"])
        folder = f"{entry['spirv']}/{variant}"
        device.add_kernels({name: artifact_file(artifact_dir, f"{folder}/{name}.spv").read_bytes()
                            for name in plan.kernel_names()})
        return DeviceProgram(graph, plan, device, weights, self._resident.setdefault(device, Resident()))
