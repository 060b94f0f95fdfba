"""The Vulkan runtime on its own, with small handwritten compute shaders: memory, push
constants, barriers, command-buffer replay, profiling, device choice and its error messages."""
import gc
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from dflash_ir.backends.base import BackendUnavailable
from dflash_ir.backends.vulkan import choose_variant
from dflash_ir.backends.vulkan_device import (ENV_DEVICE, PhysicalDevice, VulkanDevice, barrier_points, choose_device,
                                              physical_devices, supported_features)

# out[i] = in[i] * p.scale + p.offset for i < p.n (ints: n, scale, offset)
AFFINE = """
#version 450
layout(local_size_x = 64) in;
layout(set = 0, binding = 0) buffer In { int src[]; };
layout(set = 0, binding = 1) buffer Out { int dst[]; };
layout(push_constant) uniform Ints { int n; int scale; int offset; } p;
void main() {
    uint i = gl_GlobalInvocationID.x;
    if (i < uint(p.n)) dst[i] = src[i] * p.scale + p.offset;
}
"""
# dst[i] = src[n-1-i] + 1: every invocation reads what another work-group wrote before
REVERSE_INC = """
#version 450
layout(local_size_x = 64) in;
layout(set = 0, binding = 0) buffer In { int src[]; };
layout(set = 0, binding = 1) buffer Out { int dst[]; };
layout(push_constant) uniform Ints { int n; } p;
void main() {
    uint i = gl_GlobalInvocationID.x;
    if (i < uint(p.n)) dst[i] = src[uint(p.n) - 1u - i] + 1;
}
"""


def _spirv(source: str, tmp_path, name: str) -> bytes:
    tool = shutil.which("glslangValidator")
    if tool is None:
        pytest.skip("glslangValidator not found (Debian package glslang-tools)")
    src, out = tmp_path / f"{name}.comp", tmp_path / f"{name}.spv"
    src.write_text(source)
    subprocess.run([tool, "-V", str(src), "-o", str(out)], check=True, capture_output=True)
    return out.read_bytes()


@pytest.fixture(scope="module", params=["mapped", "staging"])
def device(request, tmp_path_factory):
    """A device per memory mode: lavapipe's memory is unified, so both paths run here."""
    from dflash_ir.backends.base import get_backend

    reason = get_backend("vulkan").unavailable_reason()
    if reason:
        pytest.skip(f"vulkan: {reason}")
    dev = VulkanDevice(choose_device(physical_devices()), staging=request.param == "staging")
    tmp = tmp_path_factory.mktemp("spirv")
    dev.add_kernels({"affine": _spirv(AFFINE, tmp, "affine"), "reverse_inc": _spirv(REVERSE_INC, tmp, "reverse_inc")})
    return dev


def _groups(n: int) -> tuple[int, int, int]:
    return (-(-n // 64), 1, 1)


@pytest.mark.parametrize("dtype, shape", [(np.uint8, (102,)), (np.uint8, (1,)), (np.int32, ()), (np.float16, (3, 5)),
                                          (np.float32, (257,))])
def test_upload_download_round_trip(device, dtype, shape):
    data = (np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape) * 7 + 3).astype(dtype)
    buf = device.alloc(data.nbytes)
    assert buf.nbytes % 4 == 0 and buf.nbytes >= data.nbytes
    device.upload(buf, data)
    back = np.empty_like(data)
    device.download(buf, back)
    np.testing.assert_array_equal(back, data)


def test_download_of_a_prefix_of_a_larger_buffer(device):
    data = np.arange(100, dtype=np.int32)
    buf = device.alloc(data.nbytes)
    device.upload(buf, data)
    part = np.empty(9, np.int32)
    device.download(buf, part)
    np.testing.assert_array_equal(part, data[:9])


def test_push_constants_reach_the_shader(device):
    n = 200
    src, dst = device.alloc(4 * n), device.alloc(4 * n)
    device.upload(src, np.arange(n, dtype=np.int32))
    device.upload(dst, np.full(n, -1, np.int32))
    device.launch("affine", _groups(150), (64, 1, 1), [src, dst, np.int32(150), np.int32(3), np.int32(-5)])
    out = np.empty(n, np.int32)
    device.download(dst, out)
    np.testing.assert_array_equal(out[:150], np.arange(150) * 3 - 5)
    np.testing.assert_array_equal(out[150:], -1)  # p.n bounds the write


def test_dependent_dispatches_see_each_others_writes(device):
    """40 dispatches in one batch, each reading (reversed) what the one before wrote."""
    n = 1000
    a, b = device.alloc(4 * n), device.alloc(4 * n)
    x = np.arange(n, dtype=np.int32)
    device.upload(a, x)
    for i in range(40):
        src, dst = (a, b) if i % 2 == 0 else (b, a)
        device.launch("reverse_inc", _groups(n), (64, 1, 1), [src, dst, np.int32(n)])
    out = np.empty(n, np.int32)
    device.download(a, out)
    np.testing.assert_array_equal(out, x + 40)  # an even number of reversals


def test_copies_run_in_order_with_dispatches(device):
    """upload -> dispatch -> copy a byte range -> dispatch reading the copy, in one batch."""
    n = 128
    a, b, c = device.alloc(4 * n), device.alloc(4 * n), device.alloc(4 * n)
    device.upload(a, np.arange(n, dtype=np.int32))
    device.upload(c, np.zeros(n, np.int32))
    device.launch("affine", _groups(n), (64, 1, 1), [a, b, np.int32(n), np.int32(10), np.int32(0)])
    device.copy(b, 4 * 5, c, 4 * 100, 4 * 20)          # c[100:120] = b[5:25]
    device.launch("affine", _groups(n), (64, 1, 1), [c, a, np.int32(n), np.int32(1), np.int32(1)])
    out = np.empty(n, np.int32)
    device.download(a, out)
    want = np.ones(n, np.int32)
    want[100:120] = np.arange(5, 25) * 10 + 1
    np.testing.assert_array_equal(out, want)


def test_barriers_only_between_dispatches_sharing_a_buffer():
    assert barrier_points([{1, 2}, {3, 4}, {2, 5}, {6}, {7}, {6, 8}, {9}]) == \
        [False, False, True, False, False, True, False]
    assert barrier_points([{1}, {1}, {1}]) == [False, True, True]


def test_a_repeated_batch_replays_its_command_buffer(device):
    n = 300
    src, dst = device.alloc(4 * n), device.alloc(4 * n)
    x = np.arange(n, dtype=np.int32)
    out = np.empty(n, np.int32)

    def step(scale: int) -> np.ndarray:
        device.upload(src, x)
        device.launch("affine", _groups(n), (64, 1, 1), [src, dst, np.int32(n), np.int32(scale), np.int32(1)])
        device.launch("reverse_inc", _groups(n), (64, 1, 1), [dst, src, np.int32(n)])
        device.download(src, out)
        return out.copy()

    recorded, submitted = device.recordings, device.submissions
    first = step(2)
    assert device.recordings == recorded + 1
    for _ in range(5):
        np.testing.assert_array_equal(step(2), first)
    assert device.recordings == recorded + 1                   # replayed, not recorded again
    assert device.submissions >= submitted + 6
    np.testing.assert_array_equal(first, (x * 2 + 1)[::-1] + 1)
    np.testing.assert_array_equal(step(4), (x * 4 + 1)[::-1] + 1)  # other push constants: a new recording
    assert device.recordings == recorded + 2


def test_new_code_for_a_kernel_name_replaces_its_pipeline(device, tmp_path):
    n = 64
    src, dst = device.alloc(4 * n), device.alloc(4 * n)
    out = np.empty(n, np.int32)
    device.upload(src, np.arange(n, dtype=np.int32))
    device.add_kernels({"renamed": _spirv(REVERSE_INC, tmp_path, "a")})
    device.launch("renamed", _groups(n), (64, 1, 1), [src, dst, np.int32(n)])
    device.download(dst, out)
    np.testing.assert_array_equal(out, np.arange(n)[::-1] + 1)
    device.add_kernels({"renamed": _spirv(REVERSE_INC.replace("+ 1;", "+ 2;"), tmp_path, "b")})
    device.launch("renamed", _groups(n), (64, 1, 1), [src, dst, np.int32(n)])
    device.download(dst, out)
    np.testing.assert_array_equal(out, np.arange(n)[::-1] + 2)


def test_a_freed_buffer_leaves_no_stale_command_buffer(device):
    """Serials, not Python ids, key the caches: a new buffer never replays an old one's batch."""
    n = 64
    out = np.empty(n, np.int32)
    for k in range(3):
        src, dst = device.alloc(4 * n), device.alloc(4 * n)
        device.upload(src, np.full(n, k, np.int32))
        device.launch("affine", _groups(n), (64, 1, 1), [src, dst, np.int32(n), np.int32(1), np.int32(10)])
        device.download(dst, out)
        np.testing.assert_array_equal(out, k + 10)
        del src, dst
        gc.collect()


def test_a_grid_past_the_device_limit_runs_as_offset_dispatches(device, monkeypatch):
    """maxComputeWorkGroupCount is 65535 on most devices (a flat kernel over 16M floats needs
    more); a lowered limit shows the split without allocating that much."""
    n = 64 * 10
    src, dst = device.alloc(4 * n), device.alloc(4 * n)
    device.upload(src, np.arange(n, dtype=np.int32))
    monkeypatch.setattr(device, "max_groups", (3, 3, 3))
    out = np.empty(n, np.int32)
    device.launch("affine", (10, 1, 1), (64, 1, 1), [src, dst, np.int32(n), np.int32(3), np.int32(1)])
    device.download(dst, out)
    np.testing.assert_array_equal(out, np.arange(n) * 3 + 1)


def test_profiling_times_every_kernel(device):
    n = 4096
    a, b = device.alloc(4 * n), device.alloc(4 * n)
    device.start_profiling()
    for _ in range(3):
        device.launch("affine", _groups(n), (64, 1, 1), [a, b, np.int32(n), np.int32(1), np.int32(1)])
        device.launch("reverse_inc", _groups(n), (64, 1, 1), [b, a, np.int32(n)])
    times = device.stop_profiling()
    assert {k: t.launches for k, t in times.items()} == {"affine": 3, "reverse_inc": 3}
    assert all(0 < t.seconds < 1 for t in times.values())


def test_missing_device_feature_is_named(device):
    physical = device.physical
    if "sparseBinding" in supported_features(physical):
        pytest.skip("needs a device without sparseBinding, such as lavapipe")
    with pytest.raises(BackendUnavailable, match=r"lacks the features \['sparseBinding'\]"):
        VulkanDevice(physical, ["sparseBinding"])
    with pytest.raises(ValueError, match="not Vulkan feature flags"):
        VulkanDevice(physical, ["shaderFloat17"])


# -- choices and errors -----------------------------------------------------------------
DEVICES = (PhysicalDevice(0, "llvmpipe (LLVM 15)", "CPU", 1 << 22 | 3 << 12),
           PhysicalDevice(1, "Intel(R) UHD Graphics 770", "integrated GPU", 1 << 22 | 3 << 12),
           PhysicalDevice(2, "NVIDIA H200", "discrete GPU", 1 << 22 | 3 << 12))


def test_device_choice_prefers_discrete_then_integrated_then_cpu():
    assert choose_device(DEVICES, "").name == "NVIDIA H200"
    assert choose_device(DEVICES[:2], "").kind == "integrated GPU"
    assert choose_device(DEVICES[:1], "").kind == "CPU"


def test_device_choice_by_index_or_name(monkeypatch):
    assert choose_device(DEVICES, "0").name.startswith("llvmpipe")
    assert choose_device(DEVICES, "uhd").index == 1
    monkeypatch.setenv(ENV_DEVICE, "llvm")
    assert choose_device(DEVICES).index == 0


def test_device_naming_nothing_lists_the_devices(monkeypatch):
    with pytest.raises(BackendUnavailable) as e:
        choose_device(DEVICES, "radeon")
    assert f"{ENV_DEVICE}='radeon'" in str(e.value)
    assert all(d.name in str(e.value) for d in DEVICES)


def test_env_var_naming_no_real_device_makes_the_backend_unavailable(device, monkeypatch):
    from dflash_ir.backends.base import get_backend

    monkeypatch.setenv(ENV_DEVICE, "no-such-gpu")
    reason = get_backend("vulkan").unavailable_reason()
    assert "names no Vulkan device" in reason and device.physical.name in reason


def test_variant_fallback_names_feature_and_variant():
    variants = {"full": {"features": ["storageBuffer8BitAccess", "shaderInt8"],
                         "subgroup_operations": ["VK_SUBGROUP_FEATURE_ARITHMETIC_BIT"]},
                "baseline": {"features": [], "subgroup_operations": []}}
    everything = frozenset({"storageBuffer8BitAccess", "shaderInt8", "VK_SUBGROUP_FEATURE_ARITHMETIC_BIT"})
    assert choose_variant(variants, everything) == ("full", None)
    variant, note = choose_variant(variants, everything - {"shaderInt8"})
    assert variant == "baseline" and "'full'" in note and "shaderInt8" in note
    variant, note = choose_variant(variants, everything - {"VK_SUBGROUP_FEATURE_ARITHMETIC_BIT"})
    assert variant == "baseline" and "VK_SUBGROUP_FEATURE_ARITHMETIC_BIT" in note
    with pytest.raises(BackendUnavailable, match=r"variant 'full' needs \['shaderInt8'\]"):
        choose_variant(variants, everything - {"shaderInt8"}, forced="full")
    assert choose_variant(variants, frozenset(), forced="baseline") == ("baseline", None)
    with pytest.raises(ValueError, match=r"DFLASH_IR_VULKAN_FEATURES='fast'.*\['baseline', 'full'\]"):
        choose_variant(variants, everything, forced="fast")
    with pytest.raises(BackendUnavailable, match=r"variant 'baseline' needs \['shaderInt64'\]"):
        choose_variant({"baseline": {"features": ["shaderInt64"]}}, frozenset())


def test_no_vulkan_driver_says_what_to_install(tmp_path):
    """The loader pointed at no driver at all, in a fresh process."""
    nothing = str(tmp_path / "none.json")
    env = {**os.environ, "VK_DRIVER_FILES": nothing, "VK_ICD_FILENAMES": nothing}
    code = ("from dflash_ir.backends.base import get_backend\n"
            "b = get_backend('vulkan')\n"
            "print(b.unavailable_reason())\n"
            "print(b.device_description())\n")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    reason, description = done.stdout.strip().splitlines()
    assert "libvulkan1" in reason and "mesa-vulkan-drivers" in reason and "lavapipe" in reason, reason
    assert description == "Vulkan (no device here)"
