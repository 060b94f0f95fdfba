"""A Vulkan compute device for the launch-plan runner (runner.Device): buffers, SPIR-V
pipelines, batched dispatches replayed from recorded command buffers, timestamp profiling.

Written against the C API through the `vulkan` package (a cffi binding of it) rather than
Kompute (`kp`): the runner needs control of memory placement, descriptor sets and command
buffers (record once, replay every decode step), which Kompute hides behind its own objects.

- Device choice: a discrete GPU, else an integrated one, else any other (a CPU driver such
  as Mesa's lavapipe); $DFLASH_IR_VULKAN_DEVICE (an index or a name substring) overrides.
- Memory: on a discrete GPU buffers are device-local and copied through a host-visible
  staging buffer; where memory is unified (integrated GPUs, lavapipe) they are host-visible
  coherent memory, mapped once and copied into directly.
- Launches (and buffer-to-buffer copies) are batched: `launch()` and `copy()` only append;
  the batch is recorded into a command buffer (a barrier before a dispatch or copy that
  shares a buffer with one since the last barrier), submitted at the next upload, download
  or synchronize, and the command buffer is kept by the batch's signature (kernels, groups,
  buffers, push constants, copy ranges) and submitted again when the same sequence comes
  back, as it does on every step of a decode or verify loop.
- Shader interface (what backends/kir/glsl.py prints): set 0, binding i = i-th buffer argument
  (storage buffer); push constants = the int arguments, int32 each at offset 4*i; entry `main`.
- Lifetimes: every submission is waited for, and Vulkan objects are destroyed only between
  submissions. A garbage-collected buffer (the collector runs at any allocation, in any
  thread) is only queued; it and the descriptor sets and command buffers naming it are
  destroyed at the device's next call. A wait that fails (a timeout: lavapipe compiles each
  new shader with LLVM inside the first submission that runs it; or a device error) leaves
  work in flight that may still read and write its buffers: the device is then marked lost,
  frees nothing more and refuses every call with VulkanDeviceLost, and `open_device` makes a
  fresh one. (Freeing those buffers under the running shaders corrupted the host heap on
  lavapipe: the segfaults in vkWaitForFences after a failed test.)
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import os
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, NamedTuple, Sequence

import numpy as np

from dflash_ir.errors import DflashError

from .base import BackendUnavailable

ENV_DEVICE = "DFLASH_IR_VULKAN_DEVICE"
ENV_TIMEOUT = "DFLASH_IR_VULKAN_TIMEOUT"
INSTALL = ("install a Vulkan loader and driver, e.g. the Debian packages libvulkan1 and mesa-vulkan-drivers "
           "(mesa-vulkan-drivers provides lavapipe, a CPU driver)")
API_VERSION = (1, 2, 0)          # 8/16-bit storage, float16/int8 arithmetic are core from 1.2
_COMMAND_BUFFERS_KEPT = 64       # recorded batches kept for replay
_SETS_PER_POOL = 256
_MAX_BINDINGS = 16               # storage-buffer descriptors budgeted per set in a pool
DEFAULT_TIMEOUT_S = 3600.0       # a first submission on lavapipe compiles its shaders: minutes on a loaded CPU

# VkPhysicalDeviceType names, and the order in which kinds of device are preferred
_TYPE_NAMES = {0: "other", 1: "integrated GPU", 2: "discrete GPU", 3: "virtual GPU", 4: "CPU"}
_KIND_RANK = {"discrete GPU": 0, "integrated GPU": 1, "virtual GPU": 2, "CPU": 3, "other": 4}


@functools.cache
def vk():
    """The `vulkan` module; BackendUnavailable when the package or the loader is missing."""
    try:
        import vulkan
    except ImportError:
        raise BackendUnavailable("the vulkan Python package is not installed (pip install vulkan)") from None
    except OSError:
        raise BackendUnavailable(f"no Vulkan loader (libvulkan.so.1) found: {INSTALL}") from None
    return vulkan


class VulkanDeviceLost(DflashError):
    """A submission did not complete; the device may still use its objects, so it frees none
    of them and refuses further work (open_device() then makes a fresh device)."""


def wait_timeout_s() -> float:
    """How long a submission may run: $DFLASH_IR_VULKAN_TIMEOUT seconds, default one hour."""
    text = os.environ.get(ENV_TIMEOUT, "")
    if not text:
        return DEFAULT_TIMEOUT_S
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < 10**9:
        raise ValueError(f"{ENV_TIMEOUT}={text!r} must be a positive number of seconds")
    return seconds


def _version(v: int) -> str:
    return f"{v >> 22}.{(v >> 12) & 0x3FF}.{v & 0xFFF}"


@dataclass(frozen=True)
class PhysicalDevice:
    index: int
    name: str
    kind: str
    api_version: int
    handle: Any = field(default=None, compare=False, repr=False)

    def describe(self) -> str:
        return f"#{self.index} {self.name} ({self.kind}, Vulkan {_version(self.api_version)})"


@functools.cache
def instance():
    v = vk()
    app = v.VkApplicationInfo(sType=v.VK_STRUCTURE_TYPE_APPLICATION_INFO, pApplicationName="dflash-ir",
                              pEngineName="dflash-ir", apiVersion=v.VK_MAKE_VERSION(*API_VERSION))
    try:
        return v.vkCreateInstance(v.VkInstanceCreateInfo(sType=v.VK_STRUCTURE_TYPE_INSTANCE_CREATE_INFO,
                                                         pApplicationInfo=app), None)
    except v.VkError as e:
        raise BackendUnavailable(f"no Vulkan driver found ({type(e).__name__} creating an instance): "
                                 f"{INSTALL}") from None


@functools.cache
def physical_devices() -> tuple[PhysicalDevice, ...]:
    v = vk()
    found = []
    for i, handle in enumerate(v.vkEnumeratePhysicalDevices(instance())):
        props = v.vkGetPhysicalDeviceProperties(handle)
        found.append(PhysicalDevice(i, props.deviceName, _TYPE_NAMES.get(props.deviceType, "other"),
                                    props.apiVersion, handle))
    if not found:
        raise BackendUnavailable(f"no Vulkan device found: {INSTALL}")
    return tuple(found)


def choose_device(devices: Sequence[PhysicalDevice], wanted: str | None = None) -> PhysicalDevice:
    """`wanted` (default $DFLASH_IR_VULKAN_DEVICE): an index or a case-insensitive name
    substring; without it the most capable kind of device (discrete > integrated > CPU)."""
    wanted = os.environ.get(ENV_DEVICE) if wanted is None else wanted
    if not wanted:
        return min(devices, key=lambda d: (_KIND_RANK[d.kind], d.index))
    matches = [d for d in devices if (wanted.isdigit() and d.index == int(wanted)) or wanted.lower() in d.name.lower()]
    if not matches:
        listing = "; ".join(d.describe() for d in devices)
        raise BackendUnavailable(f"{ENV_DEVICE}={wanted!r} names no Vulkan device; the devices are: {listing}")
    return matches[0]


# -- features -------------------------------------------------------------------------
def _feature_structs(api_version: int) -> list[tuple[str, str]]:
    """(struct, sType constant) of the feature structs chained after VkPhysicalDeviceFeatures2:
    the Vulkan 1.1 and 1.2 ones on a 1.2+ device (the instance asks for 1.2, so no later one)."""
    if api_version < vk().VK_MAKE_VERSION(1, 2, 0):
        return []
    return [("VkPhysicalDeviceVulkan11Features", "VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_1_FEATURES"),
            ("VkPhysicalDeviceVulkan12Features", "VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_2_FEATURES")]


def _feature_chain(api_version: int, enable: Iterable[str] = ()):
    """A VkPhysicalDeviceFeatures2 chain (kept alive by the returned list, [0] is the head)
    with the features in `enable` set; every other flag zero."""
    v = vk()
    enable = set(enable)
    chain = []
    for struct, stype in _feature_structs(api_version):
        fields = {"sType": getattr(v, stype)}
        if chain:
            fields["pNext"] = chain[-1]
        fields.update({f: 1 for f in _flag_names(struct) if f in enable})
        chain.append(v.ffi.new(f"{struct}*", fields))
    core = {f: 1 for f in _flag_names("VkPhysicalDeviceFeatures") if f in enable}
    head = v.ffi.new("VkPhysicalDeviceFeatures2*", {"sType": v.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2,
                                                    "pNext": chain[-1] if chain else v.ffi.NULL, "features": core})
    return [head, *chain]


def _flag_names(struct: str) -> list[str]:
    return [name for name, _ in vk().ffi.typeof(struct).fields if name not in ("sType", "pNext")]


@functools.cache
def supported_features(device: PhysicalDevice) -> frozenset[str]:
    """Every VkPhysicalDevice*Features flag the device reports as supported."""
    v = vk()
    chain = _feature_chain(device.api_version)
    v.vkGetPhysicalDeviceFeatures2(device.handle, chain[0])
    names = {f for f in _flag_names("VkPhysicalDeviceFeatures") if getattr(chain[0].features, f)}
    for (struct, _), item in zip(_feature_structs(device.api_version), chain[1:]):
        names |= {f for f in _flag_names(struct) if getattr(item, f)}
    return frozenset(names)


@functools.cache
def supported_subgroup_operations(device: PhysicalDevice) -> frozenset[str]:
    """The VK_SUBGROUP_FEATURE_*_BIT names the device supports in compute shaders."""
    v = vk()
    if device.api_version < v.VK_MAKE_VERSION(1, 1, 0):
        return frozenset()
    subgroup = v.ffi.new("VkPhysicalDeviceSubgroupProperties*",
                         {"sType": v.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SUBGROUP_PROPERTIES})
    v.vkGetPhysicalDeviceProperties2(device.handle, v.ffi.new("VkPhysicalDeviceProperties2*", {
        "sType": v.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PROPERTIES_2, "pNext": subgroup}))
    if not subgroup.supportedStages & v.VK_SHADER_STAGE_COMPUTE_BIT:
        return frozenset()
    return frozenset(name for name in dir(v) if name.startswith("VK_SUBGROUP_FEATURE_") and name.endswith("_BIT")
                     and subgroup.supportedOperations & getattr(v, name))


def known_features(api_version: int) -> set[str]:
    structs = [s for s, _ in _feature_structs(api_version)] + ["VkPhysicalDeviceFeatures"]
    return {f for s in structs for f in _flag_names(s)}


# -- the device -----------------------------------------------------------------------
def barrier_points(buffer_sets: Sequence[set[int]]) -> list[bool]:
    """Whether each dispatch needs a barrier before it: it does when it shares a buffer with a
    dispatch since the last barrier (read-after-write, write-after-read or write-after-write
    are only possible through a shared buffer); dispatches in between may overlap."""
    points, touched = [], set()
    for buffers in buffer_sets:
        needed = bool(buffers & touched)
        touched = set(buffers) if needed else touched | buffers
        points.append(needed)
    return points


class VulkanBuffer:
    """A storage buffer of at least `nbytes` (padded to 4); `serial` identifies it in caches
    (ids of freed Python objects are reused, serials are not)."""

    def __init__(self, serial: int, nbytes: int, handle, memory, mapped: np.ndarray | None):
        self.serial = serial
        self.nbytes = nbytes
        self.handle = handle
        self.memory = memory
        self.mapped = mapped


class _Dispatch(NamedTuple):
    kernel: str
    groups: tuple[int, ...]
    buffers: tuple[VulkanBuffer, ...]
    ints: tuple[int, ...]

    def signature(self) -> tuple:
        return self.kernel, self.groups, tuple(b.serial for b in self.buffers), self.ints

    def touched(self) -> tuple[VulkanBuffer, ...]:
        return self.buffers

    def name(self) -> str:
        return self.kernel


class _Copy(NamedTuple):
    src: VulkanBuffer
    src_offset: int
    dst: VulkanBuffer
    dst_offset: int
    nbytes: int

    def signature(self) -> tuple:
        return "copy", self.src.serial, self.src_offset, self.dst.serial, self.dst_offset, self.nbytes

    def touched(self) -> tuple[VulkanBuffer, ...]:
        return self.src, self.dst

    def name(self) -> str:
        return "(buffer copy)"


def _describe(batch: Sequence[_Dispatch | _Copy]) -> str:
    """'a batch of 40 launches and 2 copies (kernel names ...)', for error messages."""
    names = sorted({item.kernel for item in batch if isinstance(item, _Dispatch)})
    copies = len(batch) - sum(isinstance(item, _Dispatch) for item in batch)
    counts = [f"{n} {word if n == 1 else plural}" for n, word, plural in
              ((len(batch) - copies, "launch", "launches"), (copies, "copy", "copies")) if n]
    shown = f" ({', '.join(names[:4])}{', ...' if len(names) > 4 else ''})" if names else ""
    return f"a batch of {' and '.join(counts)}{shown}"


@dataclass
class _Recorded:
    command_buffer: Any
    kernels: tuple[str, ...]
    serials: frozenset[int]
    query_pool: Any = None


@dataclass(frozen=True)
class KernelTime:
    launches: int
    seconds: float


def _guarded(method):
    """A public device call: serialised with the device's other calls, refused once the device
    is lost, and run after destroying what the garbage collector handed over since the last."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        with self._lock:
            if self.lost:
                raise VulkanDeviceLost(f"Vulkan device {self.physical.describe()} is unusable: {self.lost}")
            self._destroy_collected()
            return method(self, *args, **kwargs)
    return call


class VulkanDevice:
    """One logical device with exactly the features asked for, its queue and caches."""

    def __init__(self, physical: PhysicalDevice, features: Iterable[str] = (), staging: bool | None = None):
        v = self._vk = vk()
        self.physical = physical
        self.features = frozenset(features)
        unknown = self.features - known_features(physical.api_version)
        if unknown:
            raise ValueError(f"{sorted(unknown)} are not Vulkan feature flags of {physical.describe()}")
        missing = self.features - supported_features(physical)
        if missing:
            raise BackendUnavailable(f"Vulkan device {physical.describe()} lacks the features {sorted(missing)}")
        families = v.vkGetPhysicalDeviceQueueFamilyProperties(physical.handle)
        self.family = next(i for i, f in enumerate(families) if f.queueFlags & v.VK_QUEUE_COMPUTE_BIT)
        self.timestamp_bits = families[self.family].timestampValidBits
        limits = v.vkGetPhysicalDeviceProperties(physical.handle).limits
        self.timestamp_period = limits.timestampPeriod
        self.max_groups = tuple(limits.maxComputeWorkGroupCount)
        self.max_push_ints = limits.maxPushConstantsSize // 4
        self.max_buffer_range = limits.maxStorageBufferRange
        chain = _feature_chain(physical.api_version, self.features)
        queue_info = v.VkDeviceQueueCreateInfo(sType=v.VK_STRUCTURE_TYPE_DEVICE_QUEUE_CREATE_INFO,
                                               queueFamilyIndex=self.family, queueCount=1, pQueuePriorities=[1.0])
        self.device = v.vkCreateDevice(physical.handle, v.VkDeviceCreateInfo(
            sType=v.VK_STRUCTURE_TYPE_DEVICE_CREATE_INFO, pNext=chain[0], queueCreateInfoCount=1,
            pQueueCreateInfos=[queue_info]), None)
        self.queue = v.vkGetDeviceQueue(self.device, self.family, 0)
        self._memory = self._memory_properties(staging)
        self._command_pool = v.vkCreateCommandPool(self.device, v.VkCommandPoolCreateInfo(
            sType=v.VK_STRUCTURE_TYPE_COMMAND_POOL_CREATE_INFO, queueFamilyIndex=self.family,
            flags=v.VK_COMMAND_POOL_CREATE_RESET_COMMAND_BUFFER_BIT), None)
        self._fence = v.vkCreateFence(self.device, v.VkFenceCreateInfo(sType=v.VK_STRUCTURE_TYPE_FENCE_CREATE_INFO),
                                      None)
        self._spirv: dict[str, bytes] = {}
        self._pipelines: dict[str, tuple[Any, tuple[int, int]]] = {}
        self._set_layouts: dict[int, Any] = {}
        self._layouts: dict[tuple[int, int], Any] = {}
        self._pools: list[Any] = []
        self._sets: dict[tuple[int, ...], tuple[Any, Any]] = {}
        self._recorded: OrderedDict[tuple, _Recorded] = OrderedDict()
        self._pending: list[_Dispatch | _Copy] = []
        self._serials = 0
        self._staging: VulkanBuffer | None = None
        self.recordings = 0          # command buffers recorded (a replayed batch records none)
        self.submissions = 0
        self._profiling = False
        self._times: dict[str, list[int]] = {}
        self._lock = threading.RLock()
        self._collected: list[tuple[int, Any, Any]] = []   # (serial, buffer, memory) of collected buffers
        self.lost: str | None = None    # why the device refuses work, once a submission failed

    # -- memory -------------------------------------------------------------------------
    def _memory_properties(self, staging: bool | None) -> dict[str, tuple[int, int]]:
        """(required, preferred) memory property flags: 'device' for buffers, and 'staging'
        when copies go through one. Staging by default on discrete and virtual GPUs (and
        wherever no device-local memory is host-visible); mapped buffers elsewhere."""
        v = self._vk
        local, cached = v.VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT, v.VK_MEMORY_PROPERTY_HOST_CACHED_BIT
        visible = v.VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT | v.VK_MEMORY_PROPERTY_HOST_COHERENT_BIT
        props = v.vkGetPhysicalDeviceMemoryProperties(self.physical.handle)
        self._type_flags = [props.memoryTypes[i].propertyFlags for i in range(props.memoryTypeCount)]
        unified = any(f & (local | visible) == local | visible for f in self._type_flags)
        if staging is None:
            staging = self.physical.kind not in ("integrated GPU", "CPU") or not unified
        self.uses_staging = staging
        if staging:
            return {"device": (local, 0), "staging": (visible, cached)}
        return {"device": (local | visible, cached)}

    def _memory_type(self, allowed_bits: int, what: str) -> int:
        required, preferred = self._memory[what]
        fits = [i for i, f in enumerate(self._type_flags) if allowed_bits >> i & 1 and f & required == required]
        if not fits:
            raise RuntimeError(f"Vulkan device {self.physical.describe()} has no {what} memory type "
                               f"with property flags {required:#x} for a storage buffer")
        return next((i for i in fits if self._type_flags[i] & preferred == preferred), fits[0])

    def _buffer(self, nbytes: int, what: str, mapped: bool) -> VulkanBuffer:
        v = self._vk
        size = max(4, -(-nbytes // 4) * 4)
        usage = (v.VK_BUFFER_USAGE_STORAGE_BUFFER_BIT | v.VK_BUFFER_USAGE_TRANSFER_SRC_BIT
                 | v.VK_BUFFER_USAGE_TRANSFER_DST_BIT)
        handle = v.vkCreateBuffer(self.device, v.VkBufferCreateInfo(
            sType=v.VK_STRUCTURE_TYPE_BUFFER_CREATE_INFO, size=size, usage=usage,
            sharingMode=v.VK_SHARING_MODE_EXCLUSIVE), None)
        need = v.vkGetBufferMemoryRequirements(self.device, handle)
        memory = v.vkAllocateMemory(self.device, v.VkMemoryAllocateInfo(
            sType=v.VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_INFO, allocationSize=need.size,
            memoryTypeIndex=self._memory_type(need.memoryTypeBits, what)), None)
        v.vkBindBufferMemory(self.device, handle, memory, 0)
        view = None
        if mapped:
            view = np.frombuffer(v.vkMapMemory(self.device, memory, 0, size, 0), np.uint8)
        self._serials += 1
        buf = VulkanBuffer(self._serials, size, handle, memory, view)
        # the finalizer only queues (list.append is atomic): it may run in any thread, mid-call
        weakref.finalize(buf, self._collected.append, (buf.serial, handle, memory)).atexit = False
        return buf

    @_guarded
    def alloc(self, nbytes: int) -> VulkanBuffer:
        if nbytes >= 2**31 and "shaderInt64" not in self.features:
            raise ValueError(f"a {nbytes}-byte Vulkan buffer needs 64-bit offsets: shaders compiled without "
                             "shaderInt64 index with 32-bit ints")
        return self._buffer(nbytes, "device", mapped=not self.uses_staging)

    def _destroy_collected(self) -> None:
        """Free the buffers the garbage collector handed over, with the descriptor sets and
        command buffers that name them; only called between submissions."""
        v = self._vk
        while self._collected:
            serial, handle, memory = self._collected.pop()
            for key in [k for k, r in self._recorded.items() if serial in r.serials]:
                self._free_recorded(self._recorded.pop(key))
            for key in [k for k in self._sets if serial in k]:
                pool, dset = self._sets.pop(key)
                v.vkFreeDescriptorSets(self.device, pool, 1, [dset])
            v.vkDestroyBuffer(self.device, handle, None)
            v.vkFreeMemory(self.device, memory, None)

    @property
    def awaiting_destruction(self) -> int:
        """Collected buffers not yet destroyed (all of them, for good, once the device is lost)."""
        return len(self._collected)

    def _staging_for(self, nbytes: int) -> VulkanBuffer:
        if self._staging is None or self._staging.nbytes < nbytes:
            self._staging = self._buffer(nbytes, "staging", mapped=True)
        return self._staging

    def _copy_now(self, src: VulkanBuffer, dst: VulkanBuffer, nbytes: int, dst_offset: int = 0) -> None:
        v = self._vk
        cb = self._begin()
        with self._freed_on_error(cb):
            v.vkCmdCopyBuffer(cb, src.handle, dst.handle, 1,
                              [v.VkBufferCopy(srcOffset=0, dstOffset=dst_offset, size=nbytes)])
            self._barrier(cb, v.VK_PIPELINE_STAGE_TRANSFER_BIT, v.VK_ACCESS_TRANSFER_WRITE_BIT,
                          v.VK_PIPELINE_STAGE_HOST_BIT | v.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT,
                          v.VK_ACCESS_HOST_READ_BIT | v.VK_ACCESS_SHADER_READ_BIT)
            v.vkEndCommandBuffer(cb)
        self._submit(cb, "a staging copy")
        v.vkFreeCommandBuffers(self.device, self._command_pool, 1, [cb])

    @_guarded
    def upload(self, buf: VulkanBuffer, array: np.ndarray, offset: int = 0) -> None:
        """Into `buf` from byte `offset`; a staged copy is rounded up to whole words (within
        the buffer), so parts of one buffer are uploaded in order of their offsets."""
        data = np.require(array, requirements="C").reshape(-1).view(np.uint8)
        self.synchronize()
        if self.uses_staging:
            staging = self._staging_for(data.size)
            staging.mapped[:data.size] = data
            self._copy_now(staging, buf, min(-(-data.size // 4) * 4, buf.nbytes - offset), offset)
        else:
            buf.mapped[offset:offset + data.size] = data

    @_guarded
    def download(self, buf: VulkanBuffer, array: np.ndarray) -> None:
        out = array.reshape(-1).view(np.uint8)
        self.synchronize()
        if self.uses_staging:
            staging = self._staging_for(out.size)
            self._copy_now(buf, staging, -(-out.size // 4) * 4)
            out[:] = staging.mapped[:out.size]
        else:
            out[:] = buf.mapped[:out.size]

    # -- kernels ------------------------------------------------------------------------
    @_guarded
    def add_kernels(self, spirv: Mapping[str, bytes]) -> None:
        """SPIR-V modules by kernel name; pipelines are made at a kernel's first launch. A
        name given new code (an artifact built by another renderer version) drops its pipeline
        and the recorded batches using it."""
        v = self._vk
        for name, code in spirv.items():
            if self._spirv.get(name, code) != code and name in self._pipelines:
                for key in [k for k, r in self._recorded.items() if name in r.kernels]:
                    self._free_recorded(self._recorded.pop(key))
                v.vkDestroyPipeline(self.device, self._pipelines.pop(name)[0], None)
            self._spirv[name] = code

    def _set_layout(self, n_buffers: int):
        if n_buffers not in self._set_layouts:
            v = self._vk
            bindings = [v.VkDescriptorSetLayoutBinding(binding=i, descriptorType=v.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER,
                                                       descriptorCount=1, stageFlags=v.VK_SHADER_STAGE_COMPUTE_BIT)
                        for i in range(n_buffers)]
            self._set_layouts[n_buffers] = v.vkCreateDescriptorSetLayout(self.device, v.VkDescriptorSetLayoutCreateInfo(
                sType=v.VK_STRUCTURE_TYPE_DESCRIPTOR_SET_LAYOUT_CREATE_INFO, bindingCount=n_buffers,
                pBindings=bindings or None), None)
        return self._set_layouts[n_buffers]

    def _layout(self, n_buffers: int, n_ints: int):
        """The pipeline layout of kernels with this interface."""
        key = (n_buffers, n_ints)
        if key not in self._layouts:
            if n_ints > self.max_push_ints:
                raise ValueError(f"a Vulkan kernel with {n_ints} int arguments exceeds the device's "
                                 f"{4 * self.max_push_ints}-byte push constants (maxPushConstantsSize)")
            v = self._vk
            ranges = [v.VkPushConstantRange(stageFlags=v.VK_SHADER_STAGE_COMPUTE_BIT, offset=0, size=4 * n_ints)]
            self._layouts[key] = v.vkCreatePipelineLayout(self.device, v.VkPipelineLayoutCreateInfo(
                sType=v.VK_STRUCTURE_TYPE_PIPELINE_LAYOUT_CREATE_INFO, setLayoutCount=1,
                pSetLayouts=[self._set_layout(n_buffers)], pushConstantRangeCount=1 if n_ints else 0,
                pPushConstantRanges=ranges if n_ints else None), None)
        return self._layouts[key]

    def _pipeline(self, kernel: str, n_buffers: int, n_ints: int):
        if kernel not in self._pipelines:
            v = self._vk
            if kernel not in self._spirv:
                raise KeyError(f"Vulkan kernel {kernel!r} was not added to the device")
            code = self._spirv[kernel]
            module = v.vkCreateShaderModule(self.device, v.VkShaderModuleCreateInfo(
                sType=v.VK_STRUCTURE_TYPE_SHADER_MODULE_CREATE_INFO, codeSize=len(code), pCode=code), None)
            stage = v.VkPipelineShaderStageCreateInfo(sType=v.VK_STRUCTURE_TYPE_PIPELINE_SHADER_STAGE_CREATE_INFO,
                                                      stage=v.VK_SHADER_STAGE_COMPUTE_BIT, module=module, pName="main")
            # dispatch-base: a grid past maxComputeWorkGroupCount runs as several offset dispatches
            info = v.VkComputePipelineCreateInfo(sType=v.VK_STRUCTURE_TYPE_COMPUTE_PIPELINE_CREATE_INFO, stage=stage,
                                                 flags=v.VK_PIPELINE_CREATE_DISPATCH_BASE_KHR,
                                                 layout=self._layout(n_buffers, n_ints))
            pipeline = v.vkCreateComputePipelines(self.device, None, 1, [info], None)[0]
            v.vkDestroyShaderModule(self.device, module, None)
            self._pipelines[kernel] = (pipeline, (n_buffers, n_ints))
        pipeline, interface = self._pipelines[kernel]
        if interface != (n_buffers, n_ints):
            raise ValueError(f"Vulkan kernel {kernel!r} launched with {n_buffers} buffers and {n_ints} ints, "
                             f"first launched with {interface[0]} and {interface[1]}")
        return pipeline

    def _descriptor_set(self, buffers: Sequence[VulkanBuffer]):
        key = tuple(b.serial for b in buffers)
        if key not in self._sets:
            v = self._vk
            too_big = [b.nbytes for b in buffers if b.nbytes > self.max_buffer_range]
            if too_big:
                raise ValueError(f"Vulkan buffers of {too_big} bytes exceed the device's "
                                 f"{self.max_buffer_range}-byte storage-buffer range (maxStorageBufferRange)")
            set_layout = self._set_layout(len(buffers))
            dset = pool = None
            for pool in reversed(self._pools):
                try:
                    dset = self._allocate_set(pool, set_layout)
                    break
                except (v.VkErrorOutOfPoolMemory, v.VkErrorFragmentedPool):
                    continue
            if dset is None:
                pool = self._new_pool()
                dset = self._allocate_set(pool, set_layout)
            writes = [v.VkWriteDescriptorSet(
                sType=v.VK_STRUCTURE_TYPE_WRITE_DESCRIPTOR_SET, dstSet=dset, dstBinding=i, descriptorCount=1,
                descriptorType=v.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER,
                pBufferInfo=[v.VkDescriptorBufferInfo(buffer=b.handle, offset=0, range=b.nbytes)])
                for i, b in enumerate(buffers)]
            if writes:
                v.vkUpdateDescriptorSets(self.device, len(writes), writes, 0, None)
            self._sets[key] = (pool, dset)
        return self._sets[key][1]

    def _new_pool(self):
        v = self._vk
        sizes = [v.VkDescriptorPoolSize(type=v.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER,
                                        descriptorCount=_SETS_PER_POOL * _MAX_BINDINGS)]
        pool = v.vkCreateDescriptorPool(self.device, v.VkDescriptorPoolCreateInfo(
            sType=v.VK_STRUCTURE_TYPE_DESCRIPTOR_POOL_CREATE_INFO,
            flags=v.VK_DESCRIPTOR_POOL_CREATE_FREE_DESCRIPTOR_SET_BIT, maxSets=_SETS_PER_POOL,
            poolSizeCount=1, pPoolSizes=sizes), None)
        self._pools.append(pool)
        return pool

    def _allocate_set(self, pool, set_layout):
        v = self._vk
        return v.vkAllocateDescriptorSets(self.device, v.VkDescriptorSetAllocateInfo(
            sType=v.VK_STRUCTURE_TYPE_DESCRIPTOR_SET_ALLOCATE_INFO, descriptorPool=pool, descriptorSetCount=1,
            pSetLayouts=[set_layout]))[0]

    # -- launches -----------------------------------------------------------------------
    @_guarded
    def launch(self, kernel: str, groups, local, args: list) -> None:
        """Queue a dispatch of `groups` work-groups (the local size is in the shader); args
        are the buffers, then the int32 push constants. A grid larger than the device's
        maxComputeWorkGroupCount is recorded as several dispatches with base offsets, which
        the shaders see in gl_WorkGroupID as one grid."""
        buffers = tuple(a for a in args if isinstance(a, VulkanBuffer))
        ints = tuple(int(a) for a in args[len(buffers):])
        groups = tuple(int(g) for g in groups)
        if kernel not in self._spirv:
            raise KeyError(f"Vulkan kernel {kernel!r} was not added to the device")
        if len(buffers) + len(ints) != len(args):
            raise TypeError(f"Vulkan kernel {kernel!r}: arguments must be buffers, then ints")
        if any(g > 2 ** 31 - 1 for g in groups):
            raise ValueError(f"Vulkan kernel {kernel!r}: {groups} work-groups overflow gl_WorkGroupID")
        self._pending.append(_Dispatch(kernel, groups, buffers, ints))

    @_guarded
    def copy(self, src: VulkanBuffer, src_offset: int, dst: VulkanBuffer, dst_offset: int, nbytes: int) -> None:
        """Queue a copy between buffers, in order with the launches around it."""
        item = _Copy(src, int(src_offset), dst, int(dst_offset), int(nbytes))
        if min(item.src_offset, item.dst_offset, item.nbytes) < 0 or item.src_offset + item.nbytes > src.nbytes \
                or item.dst_offset + item.nbytes > dst.nbytes:
            raise ValueError(f"Vulkan copy of {item.nbytes} bytes from offset {item.src_offset} of a {src.nbytes}-byte "
                             f"buffer to offset {item.dst_offset} of a {dst.nbytes}-byte buffer is out of range")
        self._pending.append(item)

    @_guarded
    def synchronize(self) -> None:
        """Run the queued launches and copies and wait for them."""
        if not self._pending:
            return
        batch, self._pending = self._pending, []
        key = (self._profiling, tuple(item.signature() for item in batch))
        recorded = self._recorded.get(key)
        if recorded is None:
            recorded = self._record(batch)
            self._recorded[key] = recorded
            if len(self._recorded) > _COMMAND_BUFFERS_KEPT:
                self._free_recorded(self._recorded.popitem(last=False)[1])
        else:
            self._recorded.move_to_end(key)
        self._submit(recorded.command_buffer, _describe(batch))
        if recorded.query_pool is not None:
            self._collect_times(recorded)

    def _begin(self):
        v = self._vk
        cb = v.vkAllocateCommandBuffers(self.device, v.VkCommandBufferAllocateInfo(
            sType=v.VK_STRUCTURE_TYPE_COMMAND_BUFFER_ALLOCATE_INFO, commandPool=self._command_pool,
            level=v.VK_COMMAND_BUFFER_LEVEL_PRIMARY, commandBufferCount=1))[0]
        v.vkBeginCommandBuffer(cb, v.VkCommandBufferBeginInfo(sType=v.VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO))
        return cb

    def _barrier(self, cb, src_stage: int, src_access: int, dst_stage: int, dst_access: int) -> None:
        v = self._vk
        barrier = v.VkMemoryBarrier(sType=v.VK_STRUCTURE_TYPE_MEMORY_BARRIER, srcAccessMask=src_access,
                                    dstAccessMask=dst_access)
        v.vkCmdPipelineBarrier(cb, src_stage, dst_stage, 0, 1, [barrier], 0, None, 0, None)

    def _record(self, batch: Sequence[_Dispatch | _Copy]) -> _Recorded:
        """One command buffer for the batch: a barrier before each dispatch or copy that
        touches a buffer one since the last barrier touched (before every one when profiling,
        so each one's timestamps time it alone), and one making the results visible to the host."""
        v = self._vk
        cb = self._begin()
        with self._freed_on_error(cb) as recorded:
            if self._profiling:
                recorded.query_pool = v.vkCreateQueryPool(self.device, v.VkQueryPoolCreateInfo(
                    sType=v.VK_STRUCTURE_TYPE_QUERY_POOL_CREATE_INFO, queryType=v.VK_QUERY_TYPE_TIMESTAMP,
                    queryCount=2 * len(batch)), None)
                v.vkCmdResetQueryPool(cb, recorded.query_pool, 0, 2 * len(batch))
            self._record_items(cb, batch, recorded.query_pool)
        self.recordings += 1
        recorded.kernels = tuple(item.name() for item in batch)
        recorded.serials = frozenset(b.serial for item in batch for b in item.touched())
        return recorded

    @contextlib.contextmanager
    def _freed_on_error(self, cb):
        """A command buffer (with its query pool) under construction, freed if building it fails."""
        recorded = _Recorded(cb, (), frozenset())
        try:
            yield recorded
        except BaseException:
            self._free_recorded(recorded)
            raise

    def _record_items(self, cb, batch: Sequence[_Dispatch | _Copy], pool) -> None:
        v = self._vk
        stages = v.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT | v.VK_PIPELINE_STAGE_TRANSFER_BIT
        writes = v.VK_ACCESS_SHADER_WRITE_BIT | v.VK_ACCESS_TRANSFER_WRITE_BIT
        barriers = barrier_points([{b.serial for b in item.touched()} for item in batch])
        for i, item in enumerate(batch):
            if barriers[i] or (pool is not None and i):
                self._barrier(cb, stages, writes, stages, writes | v.VK_ACCESS_SHADER_READ_BIT
                              | v.VK_ACCESS_TRANSFER_READ_BIT)
            if pool is not None:
                v.vkCmdWriteTimestamp(cb, v.VK_PIPELINE_STAGE_TOP_OF_PIPE_BIT, pool, 2 * i)
            if isinstance(item, _Copy):
                v.vkCmdCopyBuffer(cb, item.src.handle, item.dst.handle, 1, [v.VkBufferCopy(
                    srcOffset=item.src_offset, dstOffset=item.dst_offset, size=item.nbytes)])
            else:
                self._record_dispatch(cb, item)
            if pool is not None:
                v.vkCmdWriteTimestamp(cb, v.VK_PIPELINE_STAGE_BOTTOM_OF_PIPE_BIT, pool, 2 * i + 1)
        self._barrier(cb, stages, writes, v.VK_PIPELINE_STAGE_HOST_BIT | v.VK_PIPELINE_STAGE_TRANSFER_BIT,
                      v.VK_ACCESS_HOST_READ_BIT | v.VK_ACCESS_TRANSFER_READ_BIT)
        v.vkEndCommandBuffer(cb)

    def _record_dispatch(self, cb, d: _Dispatch) -> None:
        v = self._vk
        pipeline = self._pipeline(d.kernel, len(d.buffers), len(d.ints))
        layout = self._layout(len(d.buffers), len(d.ints))
        v.vkCmdBindPipeline(cb, v.VK_PIPELINE_BIND_POINT_COMPUTE, pipeline)
        if d.buffers:
            v.vkCmdBindDescriptorSets(cb, v.VK_PIPELINE_BIND_POINT_COMPUTE, layout, 0, 1,
                                      [self._descriptor_set(d.buffers)], 0, None)
        if d.ints:
            values = v.ffi.new("int32_t[]", list(d.ints))
            v.vkCmdPushConstants(cb, layout, v.VK_SHADER_STAGE_COMPUTE_BIT, 0, 4 * len(d.ints), values)
        spans = [[(base, min(limit, total - base)) for base in range(0, total, limit)]
                 for total, limit in zip(d.groups, self.max_groups)]
        for (bx, nx), (by, ny), (bz, nz) in itertools.product(*spans):
            v.vkCmdDispatchBase(cb, bx, by, bz, nx, ny, nz)

    def _submit(self, cb, what: str) -> None:
        """Run a command buffer and wait for it. If the submission or the wait fails, the
        device may still be running it: the device is marked lost (nothing is freed or
        reused from then on) and VulkanDeviceLost says what did not finish."""
        v = self._vk
        timeout = wait_timeout_s()
        try:
            v.vkQueueSubmit(self.queue, 1, [v.VkSubmitInfo(sType=v.VK_STRUCTURE_TYPE_SUBMIT_INFO,
                                                           commandBufferCount=1, pCommandBuffers=[cb])], self._fence)
            v.vkWaitForFences(self.device, 1, [self._fence], v.VK_TRUE, int(timeout * 1e9))
        except (v.VkError, v.VkException) as e:
            reason = "did not finish within" if isinstance(e, v.VkTimeout) else f"failed ({type(e).__name__}) within"
            self.lost = (f"{what} {reason} {timeout:g} s (${ENV_TIMEOUT} sets the limit); it may still be running, so "
                         "its buffers stay allocated until the process exits")
            raise VulkanDeviceLost(f"Vulkan device {self.physical.describe()}: {self.lost}") from None
        v.vkResetFences(self.device, 1, [self._fence])
        self.submissions += 1

    def _free_recorded(self, recorded: _Recorded) -> None:
        v = self._vk
        v.vkFreeCommandBuffers(self.device, self._command_pool, 1, [recorded.command_buffer])
        if recorded.query_pool is not None:
            v.vkDestroyQueryPool(self.device, recorded.query_pool, None)

    # -- profiling ----------------------------------------------------------------------
    @_guarded
    def start_profiling(self) -> None:
        """Time every dispatch from now on with timestamp queries (dispatches then run one
        at a time); `stop_profiling()` returns the device time per kernel."""
        if not self.timestamp_bits:
            raise BackendUnavailable(f"Vulkan device {self.physical.describe()} has no timestamp queries on its "
                                     "compute queue")
        self.synchronize()
        self._profiling = True
        self._times = {}

    @_guarded
    def stop_profiling(self) -> dict[str, KernelTime]:
        self.synchronize()
        self._profiling = False
        return {k: KernelTime(len(ticks), sum(ticks) * self.timestamp_period * 1e-9)
                for k, ticks in self._times.items()}

    def _collect_times(self, recorded: _Recorded) -> None:
        v = self._vk
        n = 2 * len(recorded.kernels)
        stamps = v.ffi.new("uint64_t[]", n)
        v.vkGetQueryPoolResults(self.device, recorded.query_pool, 0, n, 8 * n, stamps, 8,
                                v.VK_QUERY_RESULT_64_BIT | v.VK_QUERY_RESULT_WAIT_BIT)
        mask = (1 << self.timestamp_bits) - 1 if self.timestamp_bits < 64 else (1 << 64) - 1
        for i, kernel in enumerate(recorded.kernels):
            self._times.setdefault(kernel, []).append((stamps[2 * i + 1] - stamps[2 * i]) & mask)


_OPEN: dict[tuple[PhysicalDevice, frozenset[str]], VulkanDevice] = {}
_OPEN_LOCK = threading.Lock()


def open_device(physical: PhysicalDevice, features: frozenset[str]) -> VulkanDevice:
    """The process's logical device for this physical device and feature set (a fresh one
    when the last one was lost)."""
    with _OPEN_LOCK:
        device = _OPEN.get((physical, features))
        if device is None or device.lost:
            device = _OPEN[physical, features] = VulkanDevice(physical, features)
        return device
