"""Vulkan object lifetimes: nothing the device may still be running is freed or reused.

The crash this guards against (a segfault in vkWaitForFences after a failed test): a wait
timed out while lavapipe was still compiling and running a batch, the failed test's buffers
were garbage-collected and freed under the running shaders, and the next submission reused
the pending fence. Now a failed wait marks the device lost (it frees nothing more and
refuses work), collected buffers are destroyed only between submissions, and a batch that
cannot be recorded frees its command buffer and leaves the device usable."""
import gc
import os
import subprocess
import sys
import threading
import warnings

import numpy as np
import pytest
from test_vulkan_device import AFFINE, _groups, _spirv

from dflash_ir.backends import vulkan_device as vd
from dflash_ir.backends.vulkan import ENV_CHECKED, ROBUST_ACCESS, UncheckedDevice, checked_features

# dst[(i*7 + k) % n] = running sum over src, `iters` times per invocation: long enough to
# outlive a 1 ms wait, touching both buffers until the end
SLOW = """
#version 450
layout(local_size_x = 64) in;
layout(set = 0, binding = 0) buffer In { float src[]; };
layout(set = 0, binding = 1) buffer Out { float dst[]; };
layout(push_constant) uniform Ints { int n; int iters; } p;
void main() {
    uint i = gl_GlobalInvocationID.x;
    if (i >= uint(p.n)) return;
    float acc = 0.0;
    for (int k = 0; k < p.iters; ++k) {
        acc = acc * 0.5 + src[(i + uint(k)) % uint(p.n)];
        dst[(i * 7u + uint(k)) % uint(p.n)] = acc;
    }
}
"""
# writes p.n ints into dst whatever its size: past its end when p.n is larger
OVERRUN = """
#version 450
layout(local_size_x = 64) in;
layout(set = 0, binding = 0) buffer Out { int dst[]; };
layout(push_constant) uniform Ints { int n; } p;
void main() {
    uint i = gl_GlobalInvocationID.x;
    if (i < uint(p.n)) dst[i] = 7;
}
"""


@pytest.fixture(scope="module")
def physical():
    from dflash_ir.backends.base import get_backend

    reason = get_backend("vulkan").unavailable_reason()
    if reason:
        pytest.skip(f"vulkan: {reason}")
    return vd.choose_device(vd.physical_devices())


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("spirv")
    return {"affine": _spirv(AFFINE, tmp, "affine"), "slow": _spirv(SLOW, tmp, "slow"),
            "overrun": _spirv(OVERRUN, tmp, "overrun")}


@pytest.fixture
def device(physical, kernels):
    dev = vd.VulkanDevice(physical)
    dev.add_kernels(kernels)
    return dev


def _affine(device, n: int, scale: int):
    """src = 0..n-1 and dst = src * scale + 1 queued on fresh buffers; (src, dst)."""
    src, dst = device.alloc(4 * n), device.alloc(4 * n)
    device.upload(src, np.arange(n, dtype=np.int32))
    device.launch("affine", _groups(n), (64, 1, 1), [src, dst, np.int32(n), np.int32(scale), np.int32(1)])
    return src, dst


def _read(device, buf, n: int) -> np.ndarray:
    out = np.empty(n, np.int32)
    device.download(buf, out)
    return out


def _start_slow(device, n: int = 4096):
    a, b = device.alloc(4 * n), device.alloc(4 * n)
    device.upload(a, np.ones(n, np.float32))
    device.launch("slow", _groups(n), (64, 1, 1), [a, b, np.int32(n), np.int32(20000)])
    return a, b


def test_a_wait_that_times_out_loses_the_device_and_frees_nothing(device, monkeypatch):
    monkeypatch.setenv(vd.ENV_TIMEOUT, "0.001")
    a, b = _start_slow(device)
    with pytest.raises(vd.VulkanDeviceLost, match=r"1 launch \(slow\) did not finish within 0.001 s "
                                                  r"\(\$DFLASH_IR_VULKAN_TIMEOUT sets the limit\)"):
        device.synchronize()
    assert "slow" in device.lost
    del a, b
    gc.collect()
    assert device.awaiting_destruction == 2      # still in use by the running shader: kept
    for call in (lambda: device.alloc(4), device.synchronize, lambda: device.launch("affine", (1, 1, 1), (64, 1, 1), [])):
        with pytest.raises(vd.VulkanDeviceLost, match="is unusable: a batch"):
            call()
    assert device.awaiting_destruction == 2


def test_open_device_replaces_a_lost_device(physical, kernels, monkeypatch):
    features = frozenset({"shaderInt8"}) & vd.supported_features(physical)
    first = vd.open_device(physical, features)
    assert vd.open_device(physical, features) is first
    first.add_kernels(kernels)
    monkeypatch.setenv(vd.ENV_TIMEOUT, "0.001")
    keep = _start_slow(first)
    with pytest.raises(vd.VulkanDeviceLost):
        first.synchronize()
    monkeypatch.delenv(vd.ENV_TIMEOUT)
    fresh = vd.open_device(physical, features)
    assert fresh is not first and not fresh.lost
    fresh.add_kernels(kernels)
    _, dst = _affine(fresh, 100, 3)
    np.testing.assert_array_equal(_read(fresh, dst, 100), np.arange(100) * 3 + 1)
    del keep


# the failing pattern of the original crash, in a child process so that a regression fails
# this test instead of killing pytest: a wait gives up, the buffers it ran on are freed, and
# work goes on (here on a fresh device), five times over
_FAILING_PATTERN = """
import gc, os, sys
import numpy as np
from dflash_ir.backends import vulkan_device as vd
kernels = {name: open(os.path.join(sys.argv[1], name + ".spv"), "rb").read() for name in ("slow", "affine")}
physical = vd.choose_device(vd.physical_devices())
for attempt in range(5):
    device = vd.open_device(physical, frozenset())
    device.add_kernels(kernels)
    n = 4096
    a, b = device.alloc(4 * n), device.alloc(4 * n)
    device.upload(a, np.ones(n, np.float32))
    device.launch("slow", (n // 64, 1, 1), (64, 1, 1), [a, b, np.int32(n), np.int32(20000)])
    os.environ[vd.ENV_TIMEOUT] = "0.001"
    try:
        device.synchronize()
    except vd.VulkanDeviceLost:
        pass
    del os.environ[vd.ENV_TIMEOUT]
    del a, b
    gc.collect()
    fresh = vd.open_device(physical, frozenset())
    fresh.add_kernels(kernels)
    x, y = fresh.alloc(4 * 1000), fresh.alloc(4 * 1000)
    fresh.upload(x, np.arange(1000, dtype=np.int32))
    fresh.launch("affine", (16, 1, 1), (64, 1, 1), [x, y, np.int32(1000), np.int32(2), np.int32(5)])
    out = np.empty(1000, np.int32)
    fresh.download(y, out)
    assert (out == np.arange(1000) * 2 + 5).all()
print("survived", attempt + 1)
"""


def test_the_failing_pattern_repeated_does_not_corrupt_the_process(physical, kernels, tmp_path):
    for name, code in kernels.items():
        (tmp_path / f"{name}.spv").write_bytes(code)
    done = subprocess.run([sys.executable, "-c", _FAILING_PATTERN, str(tmp_path)], capture_output=True, text=True,
                          timeout=300, env={k: v for k, v in os.environ.items() if k != vd.ENV_TIMEOUT})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "survived 5"


def test_a_buffer_collected_mid_batch_is_destroyed_at_the_next_call(device):
    class Cycle:  # only the cyclic collector frees it, at whatever allocation triggers it
        def __init__(self, buf):
            self.buf, self.me = buf, self

    Cycle(device.alloc(64))
    src, dst = _affine(device, 64, 2)
    gc.collect()
    assert device.awaiting_destruction == 1      # queued, not destroyed under the queued batch
    np.testing.assert_array_equal(_read(device, dst, 64), np.arange(64) * 2 + 1)
    assert device.awaiting_destruction == 0


def test_buffers_collected_in_another_thread_and_under_gc_pressure(device):
    """The collector runs at any allocation, in any thread: a second thread drops cyclic
    buffers while the main one runs batches with gc thresholds at their lowest. The heap the
    suite has built by then is frozen out of the collector's sweeps (gc.freeze): it was what
    each collection walked (9 minutes in one `make test`, seconds alone), and none of it is
    the test's."""
    stop = threading.Event()

    def churn():
        while not stop.is_set():
            box = [device.alloc(256)]
            box.append(box)
            gc.collect()

    thresholds = gc.get_threshold()
    worker = threading.Thread(target=churn)
    gc.collect()
    gc.freeze()
    gc.set_threshold(1, 1, 1)
    worker.start()
    try:
        for i in range(150):
            n = 1 + 37 * (i % 9)
            _, dst = _affine(device, n, i)
            np.testing.assert_array_equal(_read(device, dst, n), np.arange(n) * i + 1)
    finally:
        stop.set()
        worker.join()
        gc.set_threshold(*thresholds)
        gc.unfreeze()
    gc.collect()
    device.synchronize()
    assert device.awaiting_destruction == 0


def test_a_batch_that_cannot_be_recorded_frees_its_command_buffer(device, monkeypatch):
    n = 64
    src, dst = _affine(device, n, 2)
    device.synchronize()
    freed = []
    monkeypatch.setattr(device, "_free_recorded", lambda recorded, inner=device._free_recorded: (
        freed.append(recorded), inner(recorded)))
    recordings = device.recordings
    device.launch("affine", _groups(n), (64, 1, 1), [src, dst, np.int32(n)])  # 1 int where the pipeline has 3
    with pytest.raises(ValueError, match="launched with 2 buffers and 1 ints, first launched with 2 and 3"):
        device.synchronize()
    assert len(freed) == 1 and device.recordings == recordings and not device.lost
    device.launch("affine", _groups(n), (64, 1, 1), [src, dst, np.int32(n), np.int32(5), np.int32(0)])
    np.testing.assert_array_equal(_read(device, dst, n), np.arange(n) * 5)


def test_unknown_kernels_and_out_of_range_copies_are_refused_when_queued(device):
    a, b = device.alloc(64), device.alloc(32)
    submissions = device.submissions
    with pytest.raises(KeyError, match="'nope' was not added"):
        device.launch("nope", (1, 1, 1), (64, 1, 1), [a])
    with pytest.raises(ValueError, match="copy of 48 bytes from offset 0 of a 64-byte buffer to offset 0 of a "
                                         "32-byte buffer is out of range"):
        device.copy(a, 0, b, 0, 48)
    with pytest.raises(ValueError, match="out of range"):
        device.copy(a, 40, b, 0, 32)
    device.synchronize()
    assert device.submissions == submissions     # nothing was queued


@pytest.mark.parametrize("value, problem", [("abc", "must be a positive number"), ("-1", "must be a positive number"),
                                            ("nan", "must be a positive number")])
def test_a_bad_timeout_setting_is_named(monkeypatch, value, problem):
    monkeypatch.setenv(vd.ENV_TIMEOUT, value)
    with pytest.raises(ValueError, match=f"DFLASH_IR_VULKAN_TIMEOUT='{value}' {problem}"):
        vd.wait_timeout_s()


def test_checked_mode_adds_robust_buffer_access_where_offered(physical, monkeypatch):
    monkeypatch.delenv(ENV_CHECKED, raising=False)
    assert checked_features(physical) == frozenset()
    monkeypatch.setenv(ENV_CHECKED, "1")
    if ROBUST_ACCESS in vd.supported_features(physical):
        assert checked_features(physical) == {ROBUST_ACCESS}
    lacking = vd.PhysicalDevice(physical.index, physical.name, physical.kind, physical.api_version, physical.handle)
    monkeypatch.setattr(vd, "supported_features", lambda device: frozenset())
    monkeypatch.setattr("dflash_ir.backends.vulkan.supported_features", lambda device: frozenset())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert checked_features(lacking) == frozenset()
    assert [w.category for w in caught] == [UncheckedDevice] and ROBUST_ACCESS in str(caught[0].message)
    monkeypatch.setenv(ENV_CHECKED, "yes")
    with pytest.raises(ValueError, match="DFLASH_IR_VULKAN_CHECKED='yes' must be 0 or 1"):
        checked_features(physical)


def test_checked_mode_keeps_an_overrunning_kernel_inside_its_buffer(physical, kernels):
    """With robustBufferAccess, 64 work-groups writing 16x past a 64-int buffer leave the
    buffers around it as they were (without it, on lavapipe, they write the host heap)."""
    if ROBUST_ACCESS not in vd.supported_features(physical):
        pytest.skip(f"{physical.describe()} has no {ROBUST_ACCESS}")
    device = vd.VulkanDevice(physical, [ROBUST_ACCESS])
    device.add_kernels(kernels)
    around = [device.alloc(4 * 64) for _ in range(8)]
    for buf in around:
        device.upload(buf, np.full(64, -1, np.int32))
    small = around.pop(4)
    device.launch("overrun", (16, 1, 1), (64, 1, 1), [small, np.int32(64 * 16)])
    assert (_read(device, small, 64) == 7).all()
    for buf in around:
        np.testing.assert_array_equal(_read(device, buf, 64), -1)
