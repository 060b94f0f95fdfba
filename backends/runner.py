"""Runs a launch plan on a device: the part of the opencl/cuda/rocm backends that is the same
for all of them. A device only has to allocate, copy and launch (tinygrad's Allocator +
Program split); binding, allocating the planned buffers, host checks and launch order live here.

Per call: symbols are bound from the input and state shapes, inputs and states are copied
to the device, the steps launch in order, outputs are copied back. On a device that can copy
between its buffers, states stay there: updated states come back as `DeviceArray`s (a contract
type, dflash_ir/program.py: a DeviceProgram is a `Program`), which the runtime indexes and
passes back in, so a decode or verify round moves no state through the host; `np.asarray`
reads one when asked. Outputs the caller names in `keep` stay on the device the same way
(a verify's logits and tap features: a greedy round reads neither; the rows a commit
replays), and any program whose device shares the memory (`Device.memory`) takes them as
inputs.
Weights are uploaded once (in the layout the kernels read: a packed copy where the plan
asks for one, `plan.packs`), a part at a time, packed on a thread per core (straight into
the device's memory where the host can map it), each part's pages of the mapped GGUF released
once it is on the device, so a load holds one copy of the weights (the device's), not two;
steps that depend on weights only (e.g. dequantising a weight) run once at load; both are
shared by every program of one load through `Resident`.
Every other buffer of a call (inputs, states, activations, temporaries) is in a slot of the
plan's memory plan (`plan.slots`, `plan.buffers`: passes/plan_memory.py, made when the graph
was lowered): the slots are allocated per set of symbol values, exactly as planned (but for
slots sized by the states' symbols alone, such as the states' own: one buffer for every set,
and the KV caches' slots: one buffer for all programs of a load), and kept for the next call
with the same sizes, together with the call's launch list (kernels, grid sizes, arguments all
worked out): a decode or verify call with sizes seen before replays that list without
evaluating a size expression. On a device with buffer views the small int32 inputs instead share
one buffer and go up in one upload (`_InputArena`).
"""
from __future__ import annotations

import functools
import os
import time
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Collection, Iterator, Mapping, Protocol

import numpy as np

from dflash_ir.dtypes import DType
from dflash_ir.errors import ContextOverflowError
from dflash_ir.ir import Graph, Value
from dflash_ir.passes.plan_memory import size_class, slot_bytes
from dflash_ir.program import BindError, DeviceArray, RunResult, WeightLoader, check_weight
from dflash_ir.quant import storage_shape

from .launch_check import check_plan
from .plan import LAYOUTS, Check, Plan, compile_expr, layout_parts, packed_bytes, part_bytes_packed, symbol_param

_PLANS_KEPT = 4  # buffer sets kept for distinct symbol values (prefill chunk sizes, T=1, T=16 ...)


class Device(Protocol):
    def alloc(self, nbytes: int) -> Any: ...
    def upload(self, buf: Any, array: np.ndarray, offset: int = 0) -> None: ...  # into buf from byte `offset`
    def download(self, buf: Any, array: np.ndarray) -> None: ...
    def launch(self, kernel: str, groups: tuple[int, ...], local: tuple[int, ...], args: list) -> None: ...
    # optional: `prepare(launches) -> replay`, a function that launches a resolved launch list
    # (kernel, groups, local, args) faster than one `launch` call per entry
    # optional: `copy(src, src_offset, dst, dst_offset, nbytes)` between buffers, in queue order;
    # a device that has it keeps states on the device between calls
    # optional: `view(buf, offset, nbytes)`, a buffer of `nbytes` from byte `offset` of `buf`
    # that a launch can take, and `view_align`, the bytes such an offset must be a multiple of;
    # a device that has them takes a call's small int32 inputs in one upload (`_InputArena`)
    # optional: `memory`, equal for devices whose buffers one another's `copy` can read
    # (the programs of one load); default: the device itself
    # optional: `map_for_write(buf, nbytes) -> (host array of the buffer's bytes, unmap)`, for
    # a device whose memory the host can write directly (weights are packed into it)


class Resident:
    """Device buffers that outlive a call, keyed by what they hold (not by program), so the
    programs of one model share them: weights and weight-only results, and each load's KV
    caches (`DeviceProgram._shared_states`)."""

    def __init__(self):
        self.buffers: dict[tuple, Any] = {}
        self.nbytes: dict[tuple, int] = {}


class DeviceProgram:
    def __init__(self, graph: Graph, plan: Plan, device: Device, weights: WeightLoader, resident: Resident):
        self.graph = graph
        self.plan = plan
        self.device = device
        self.values = graph.values()
        self._exprs: dict[str, Callable] = {}
        self._memory: OrderedDict[tuple, _Sized] = OrderedDict()
        # symbols the states' shapes bind (the capacity C): the same in every call of a load
        self._load_symbols = {d for s in graph.states for d in s.value.type.shape if isinstance(d, str)}
        self._load_sized: dict[tuple[int, int], Any] = {}  # (slot, bytes) -> buffer, for every set of sizes
        self._shared_states = self._state_keys(weights)
        self._resident_store = resident
        self._root = lambda name: plan.aliases.get(name, name)
        self._keys = self._constant_keys(weights)
        self._resident_keys: dict[str, tuple] = {}
        self._unfilled: list[tuple[Any, tuple, str, int]] = []  # (buffer, weights, layout, bytes) for _fill
        bound = {self._root(b) for step in plan.steps for launch in step.launches for b in launch.buffers}
        by_name = {w.value.name: w for w in graph.weights}
        self._resident = {w.value.name: self._weight(w, weights, resident) for w in graph.weights
                          if w.value.name in bound}  # a weight only read packed is not uploaded as it is
        self._resident.update({name: self._packed(name, tuple(by_name[w] for w in ws), weights, resident, layout)
                               for name, (ws, layout) in plan.packs.items()})
        self._fill(weights)
        self._symbols = graph.symbols  # walks every value: once, not per call
        self._resident_bytes = {name: resident.nbytes[key] for name, key in self._resident_keys.items()}
        self._resident_bytes.update(self._constant_bytes())
        self._check_plan({s: 1 for s in self._symbols})
        self._run_constant_steps(resident)
        self._keeps_states = callable(getattr(device, "copy", None))

    # -- load time ----------------------------------------------------------------------
    def _state_keys(self, weights: WeightLoader) -> dict[int, tuple]:
        """The Resident key of each KV cache's slot (State.by_position), the same in every
        program of one load (its weight loader) and model: prefill, decode, verify and
        commit, or the draft's inject and block, update one buffer in place, with no copy
        when the runtime passes a state from one program to the next. A program writes only
        the rows of its positions and reads up to its kv_len, so a verify's rows past the
        committed length are harmless to the others (the rollback is the length). The
        recurrent states are not shared: a commit replays from the states the verify
        started from."""
        model = self.graph.meta_dict.get("arch", self.graph.name)
        return {self.plan.buffers[s.value.name]: ("state", _memory(self.device), weights, model, s.value.name)
                for s in self.graph.states if s.by_position and s.value.name in self.plan.buffers}

    def _constant_keys(self, weights: WeightLoader) -> dict[str, tuple]:
        """A content key per weight-derived value: equal keys hold equal bytes in any program
        loaded with the same weight loader."""
        keys = {w.value.name: ("weight", weights, w.source, w.tensor) for w in self.graph.weights}
        for step in self.plan.steps:
            node = self.graph.nodes[step.node]
            if step.constant:
                for n, v in enumerate(node.outputs):
                    keys[v.name] = (node.op, node.attrs, tuple(keys[x] for x in node.inputs), n)
        return keys

    def _weight(self, w, weights: WeightLoader, resident: Resident):
        """The device buffer of weight `w`, as the GGUF stores it."""
        key = self._resident_keys[w.value.name] = self._keys[w.value.name]
        return self._upload(resident, key, (w,), weights, "as_stored")

    def _packed(self, name: str, ws: tuple, weights: WeightLoader, resident: Resident, layout: str):
        """The device buffer `name` of weights `ws` in `layout`, one after another (each
        packed on its own: a layout may pad a weight's rows)."""
        key = self._resident_keys[name] = (tuple(self._keys[w.value.name] for w in ws), layout)
        return self._upload(resident, key, ws, weights, layout)

    def _upload(self, resident: Resident, key: tuple, ws: tuple, weights: WeightLoader, layout: str):
        """The device buffer of weights `ws` in `layout`, one after another, made once per
        `resident` (filled by _fill)."""
        if key not in resident.buffers:
            nbytes = packed_bytes([w.value.type for w in ws], layout)
            resident.buffers[key], resident.nbytes[key] = self.device.alloc(nbytes), nbytes
            self._unfilled.append((resident.buffers[key], ws, layout, nbytes))
        return resident.buffers[key]

    def _fill(self, weights: WeightLoader) -> None:
        """Read, pack and upload the weights of the buffers _upload made, a part at a time:
        each part the loader can release (a mapped file's pages, `release`:
        dflash_ir/program.py) is released once it is on the device, so loading holds about
        one copy of the weights, not the file and the device's copy. Parts are packed on a
        thread per core (numpy's copies run outside the GIL), a few parts ahead of the
        upload; on a device whose buffers the host can map, straight into the buffer."""
        release, mapper = getattr(weights, "release", None), getattr(self.device, "map_for_write", None)
        maps = [mapper(buf, nbytes) if mapper else (None, None) for buf, _, _, nbytes in self._unfilled]
        offsets = [0] * len(self._unfilled)

        def parts():
            for i, (_, ws, layout, _) in enumerate(self._unfilled):
                for w in ws:
                    for part in layout_parts(self._storage(w, weights), layout):
                        start, offsets[i] = offsets[i], offsets[i] + part_bytes_packed(part, layout)
                        yield i, w, part, layout, start, offsets[i]

        def pack(i, w, part, layout, start, end):
            host = maps[i][0]
            return LAYOUTS[layout](part, out=None if host is None else host[start:end])

        for (i, w, part, _, start, _), packed in _ahead(parts(), pack):
            if maps[i][0] is None:
                self.device.upload(self._unfilled[i][0], packed, start)
            if release is not None:
                release(w, part)
        for _, unmap in maps:
            if unmap is not None:
                unmap()
        for (_, ws, layout, nbytes), offset in zip(self._unfilled, offsets):
            if offset != nbytes:
                raise AssertionError(f"{self.graph.name}: {layout} packed {offset} bytes of "
                                     f"{[w.value.name for w in ws]}, planned {nbytes}")
        self._unfilled.clear()

    def _storage(self, w, weights: WeightLoader) -> np.ndarray:
        arr = np.ascontiguousarray(weights(w))
        check_weight(self.graph, w, arr)
        return arr

    def _constant_bytes(self) -> dict[str, int]:
        """Bytes of the buffers that weight-only steps fill at load (sized by their values)."""
        return {v.name: _nbytes(v, {}) for step in self.plan.steps if step.constant
                for v in self.graph.nodes[step.node].outputs if self._root(v.name) == v.name}

    def _check_plan(self, bindings: Mapping[str, int]) -> None:
        """Every launch against its kernel's contract and its buffers' sizes (launch_check.py)."""
        check_plan(self.plan, self._resident_bytes, bindings)

    def _run_constant_steps(self, resident: Resident) -> None:
        for step in self.plan.steps:
            if not step.constant:
                continue
            outs = [v for v in self.graph.nodes[step.node].outputs if self._root(v.name) == v.name]
            missing = [v for v in outs if self._keys[v.name] not in resident.buffers]
            for v in missing:
                resident.buffers[self._keys[v.name]] = self.device.alloc(_nbytes(v, {}))
            for v in outs:
                self._resident[v.name] = resident.buffers[self._keys[v.name]]
            if missing:
                self._launch_step(step, self._resident, {})

    # -- per call -----------------------------------------------------------------------
    def _expr(self, text: str) -> Callable:
        if text not in self._exprs:
            self._exprs[text] = compile_expr(text)
        return self._exprs[text]

    def _bind(self, inputs: Mapping[str, np.ndarray], states: Mapping[str, np.ndarray]):
        bindings: dict[str, int] = {}
        arrays: dict[str, np.ndarray] = {}
        for what, values, given in (("input", self.graph.inputs, inputs),
                                    ("state", [s.value for s in self.graph.states], states)):
            for v in values:
                if v.name not in given:
                    raise BindError(f"{self.graph.name}: missing {what} {v.name!r} ({v.type})")
                arr = given[v.name]
                if not (isinstance(arr, DeviceArray) and _memory(arr.device) == _memory(self.device)):
                    arr = np.asarray(arr)
                if arr.dtype != v.type.dtype.numpy():
                    want = v.type.dtype.numpy()
                    if arr.dtype.kind != want.kind and not (arr.dtype.kind in "iu" and want.kind in "iu"):
                        raise BindError(f"{self.graph.name}: {what} {v.name!r} has dtype {arr.dtype}, expected {v.type}")
                    arr = np.asarray(arr).astype(want)
                if arr.ndim != v.type.rank:
                    raise BindError(f"{self.graph.name}: {what} {v.name!r} has shape {list(arr.shape)}, expected {v.type}")
                for d, n in zip(v.type.shape, arr.shape):
                    if isinstance(d, int) and d != n:
                        raise BindError(f"{self.graph.name}: {what} {v.name!r} has shape {list(arr.shape)}, expected {v.type}")
                    if isinstance(d, str) and bindings.setdefault(d, n) != n:
                        raise BindError(f"{self.graph.name}: {what} {v.name!r} binds {d}={n}, but {d}={bindings[d]} elsewhere")
                # (ascontiguousarray would make 0-d arrays 1-d)
                arrays[v.name] = arr if isinstance(arr, DeviceArray) else np.require(arr, requirements="C")
        missing = self._symbols - set(bindings)
        if missing:
            raise BindError(f"{self.graph.name}: symbols {sorted(missing)} are not bound by any input or state shape")
        return bindings, arrays

    def _check(self, c: Check, arr: np.ndarray, env: dict[str, int]) -> None:
        size, rows = self._expr(c.size)(env), self._expr(c.rows)(env)
        name = f"{self.graph.name}: input {c.value!r}"
        if c.kind == "index":
            bad = np.flatnonzero((arr < 0) | (arr >= size))
            if bad.size:
                raise ValueError(f"{name}: index {int(arr.flat[bad[0]])} is out of range [0, {size})")
        elif c.kind == "kv_write":
            pos = int(arr)
            if pos < 0:
                raise ValueError(f"{name}: kv_write: negative position {pos}")
            if pos + rows > size:
                raise ContextOverflowError(f"context overflow: writing {rows} rows at position {pos} needs rows up to "
                                           f"{pos + rows} but the cache holds {size}")
        elif c.kind == "attention":
            n = int(arr)
            if not 0 < n <= size:
                raise ValueError(f"{name}: attention: kv_len {n} is outside (0, {size}] (the cache capacity)")
            if "ordered" in c.flags and n < rows:
                raise ValueError(f"{name}: attention: {rows} queries cannot be the last rows of kv_len {n}")

    def _buffers(self, bindings: dict[str, int]) -> "_Sized":
        """Device buffers of every value for these symbol values: the plan's slots."""
        key = tuple(sorted(bindings.items()))
        if key in self._memory:
            self._memory.move_to_end(key)
            return self._memory[key]
        slots = [self._slot_buffer(i, slot, bindings) for i, slot in enumerate(self.plan.slots)]
        arena = _InputArena.make(self.device, {v.name: slot_bytes(size_class(v.type), bindings)
                                               for v in self.graph.inputs if v.type.dtype is DType.I32})
        sized = _Sized({**{name: slots[s] for name, s in self.plan.buffers.items()},
                        **(arena.views if arena else {}), **self._resident}, arena)
        self._memory[key] = sized
        if len(self._memory) > _PLANS_KEPT:
            self._memory.popitem(last=False)
        return sized

    def _slot_buffer(self, i: int, slot, bindings: Mapping[str, int]):
        """A slot sized by the load's symbols alone (a state's, any slot of a fixed size) has
        one buffer for every set of sizes: a program holds its states once, not once per
        prefill chunk length and verify length it has run (each a full copy of the KV cache
        and recurrent states). Sharing it across sizes keeps the contract: a program's
        outputs and states are valid until the program runs again, whatever the sizes. A KV
        cache's slot is the load's one buffer (_state_keys): valid until any program of the
        load runs again."""
        nbytes = slot_bytes(slot, bindings)
        if not set(slot[0]) <= self._load_symbols:
            return self.device.alloc(nbytes)
        if i in self._shared_states:
            key, store = (*self._shared_states[i], nbytes), self._resident_store
            if key not in store.buffers:
                store.buffers[key], store.nbytes[key] = self.device.alloc(nbytes), nbytes
            return store.buffers[key]
        if (i, nbytes) not in self._load_sized:
            self._load_sized[i, nbytes] = self.device.alloc(nbytes)
        return self._load_sized[i, nbytes]

    def _resolve(self, steps, buffers: Mapping[str, Any], env: dict[str, int]) -> list[tuple]:
        """(kernel, groups, local, args) of every launch `steps` make for these sizes."""
        resolved = []
        for step in steps:
            for launch in step.launches:
                if launch.when and not self._expr(launch.when)(env):
                    continue
                groups = tuple(self._expr(g)(env) for g in launch.groups)
                if 0 in groups:
                    continue
                args = [buffers[self._root(v)] for v in launch.buffers]
                args += [np.int32(self._expr(e)(env)) for e in launch.ints]
                resolved.append((launch.kernel, groups, launch.local, args))
        return resolved

    def _launch_step(self, step, buffers: Mapping[str, Any], env: dict[str, int]) -> None:
        for launch in self._resolve([step], buffers, env):
            self.device.launch(*launch)

    def _prepare(self, inputs, states) -> tuple[dict[str, int], dict[str, int], "_Sized"]:
        """Bind, check and upload: (bindings, size-expression env, buffers and launches)."""
        bindings, arrays = self._bind(inputs, states or {})
        env = {symbol_param(s): n for s, n in bindings.items()}
        for c in self.plan.checks:
            self._check(c, arrays[c.value], env)
        sized = self._buffers(bindings)
        staged = sized.arena.upload(self.device, arrays) if sized.arena else set()
        for name, arr in arrays.items():
            dst = sized.buffers[name]
            if isinstance(arr, DeviceArray):
                if arr.nbytes and not (arr.buffer is dst and arr.offset == 0):
                    self.device.copy(arr.buffer, arr.offset, dst, 0, arr.nbytes)
            elif arr.size and name not in staged:
                self.device.upload(dst, arr)
        return bindings, env, sized

    def _launch_all(self, sized: "_Sized", env: dict[str, int], bindings: Mapping[str, int]) -> None:
        if sized.replay is None:
            self._check_plan(bindings)
            launches = self._resolve([s for s in self.plan.steps if not s.constant], sized.buffers, env)
            prepare = getattr(self.device, "prepare", None)
            sized.replay = prepare(launches) if callable(prepare) else functools.partial(_launch_each, self.device,
                                                                                         launches)
        sized.replay()

    def run(self, inputs: Mapping[str, np.ndarray], states: Mapping[str, np.ndarray] | None = None, *,
            keep: Collection[str] = ()) -> RunResult:
        """Outputs named in `keep` come back as DeviceArrays where the device can hold them."""
        bindings, env, sized = self._prepare(inputs, states)
        self._launch_all(sized, env, bindings)

        buffers = sized.buffers

        def read(name: str, keep: bool = False):
            v = self.values[name]
            shape, dtype = storage_shape(v.type.concrete(bindings), v.type.dtype), v.type.dtype.numpy()
            if keep and self._keeps_states:
                return DeviceArray(self.device, buffers[self._root(name)], shape, dtype)
            out = np.empty(shape, dtype=dtype)
            if out.size:
                self.device.download(buffers[self._root(name)], out)
            return out

        outputs = {name: read(value, name in keep) for name, value in self.graph.outputs}
        new_states = {s.value.name: read(s.update, True) for s in self.graph.states if s.update is not None}
        return RunResult(outputs, new_states, bindings)

    def launcher(self, inputs: Mapping[str, np.ndarray],
                 states: Mapping[str, np.ndarray] | None = None) -> Callable[[], None]:
        """A function that runs the kernels alone (inputs uploaded once, now) and waits for
        the device: what a benchmark compares with the bytes the kernels move. Only for a
        graph whose inputs keep their buffers to themselves: where the memory plan reuses an
        input's slot, a second launch would read what the first wrote there."""
        slot_of = self.plan.buffers
        for x in self.graph.inputs:
            shared = sorted(n for n, s in slot_of.items() if n != x.name and s == slot_of.get(x.name))
            if shared:
                raise ValueError(f"{self.graph.name}: input {x.name!r} shares its buffer with {', '.join(shared)} "
                                 f"(the memory plan reuses it): a launcher cannot replay this graph; time run()")
        bindings, env, sized = self._prepare(inputs, states)
        wait = self._waiter(sized)

        def launch() -> None:
            self._launch_all(sized, env, bindings)
            wait()
        return launch

    def _waiter(self, sized: "_Sized") -> Callable[[], None]:
        """Waits for the device: a byte of the first output read back (in-order queue: after
        everything launched before it)."""
        first = sized.buffers[self._root(self.graph.outputs[0][1])]
        return lambda: self.device.download(first, np.empty(1, np.uint8))

    def launch_times(self, inputs: Mapping[str, np.ndarray], states: Mapping[str, np.ndarray] | None = None,
                     repeats: int = 3) -> list[tuple[str, tuple[int, ...], float]]:
        """(kernel, work-groups, seconds) of each launch of a call with these inputs, in plan
        order: each launched alone once its predecessors have finished and timed to the
        device's finish, less what a wait with nothing pending takes (the fastest of such
        waits timed just before each launch: timed once a replay instead, all its samples
        came out slow on a busy CI machine, and every small launch's price negative); the
        fastest of `repeats` replays on freshly bound inputs. A launch is so priced where
        the call runs it, with the caches its predecessors leave and its own launch
        overhead, and no price holds another launch's time (differences of whole-prefix
        timings did: their jitter moved milliseconds between neighbours). In-place updates
        (KV caches, recurrent states) are applied once per replay: what the calls leave is
        not for keeping."""
        bindings, env, sized = self._prepare(inputs, states)
        self._check_plan(bindings)
        launches = self._resolve([s for s in self.plan.steps if not s.constant], sized.buffers, env)
        wait = self._waiter(sized)
        idle, best = float("inf"), [float("inf")] * len(launches)
        for attempt in range(repeats + 1):  # the first replay builds what a first launch builds
            self._prepare(inputs, states)  # a replay may have overwritten an input's slot
            wait()
            for i, launch in enumerate(launches):
                t0 = time.perf_counter()
                wait()
                idle = min(idle, time.perf_counter() - t0)
                t0 = time.perf_counter()
                _launch_each(self.device, [launch])
                wait()
                if attempt:
                    best[i] = min(best[i], time.perf_counter() - t0)
        return [(kernel, groups, seconds - idle) for (kernel, groups, _, _), seconds in zip(launches, best)]


class _Sized:
    """What calls with one set of symbol values share: every value's buffer, the input arena,
    and a replay of the launch list resolved on the first such call."""

    def __init__(self, buffers: dict[str, Any], arena: "_InputArena | None" = None):
        self.buffers = buffers
        self.arena = arena
        self.replay: Callable[[], None] | None = None


class _InputArena:
    """One device buffer holding a call's small int32 inputs side by side (token ids,
    positions, pos, kv_len, logit rows: a few bytes each), so that they go up in one upload:
    a copy command costs a device a fixed overhead whatever its size (PoCL: ~45 us, about
    what a decode step's small launches cost together). Each input is a view of its part;
    one a caller passes as a DeviceArray is copied into its view after the upload."""

    LARGEST = 64 << 10  # bytes: larger inputs (a long prefill's ids) take their slots

    def __init__(self, device: Device, offsets: dict[str, int], nbytes: dict[str, int]):
        self.staging = np.zeros(max(offsets[name] + n for name, n in nbytes.items()) // 4, np.int32)
        self.buffer = device.alloc(self.staging.nbytes)
        self.offsets = offsets
        self.views = {name: device.view(self.buffer, offsets[name], n) for name, n in nbytes.items()}

    @classmethod
    def make(cls, device: Device, nbytes: dict[str, int]) -> "_InputArena | None":
        """The arena of int32 inputs of these sizes, or None on a device without views or
        with fewer than two small inputs."""
        small = {name: n for name, n in nbytes.items() if n <= cls.LARGEST}
        if len(small) < 2 or not callable(getattr(device, "view", None)):
            return None
        offsets, end, align = {}, 0, max(4, device.view_align)
        for name, n in small.items():
            offsets[name] = end
            end += -(-n // align) * align
        return cls(device, offsets, small)

    def upload(self, device: Device, arrays: Mapping[str, Any]) -> set[str]:
        """Uploads the host arrays of the arena's inputs in one copy; returns their names."""
        staged = {name for name in self.offsets
                  if name in arrays and not isinstance(arrays[name], DeviceArray) and arrays[name].size}
        if staged:
            for name in staged:
                at = self.offsets[name] // 4
                self.staging[at:at + arrays[name].size] = arrays[name].reshape(-1)
            first = min(self.offsets[name] for name in staged)
            end = max(self.offsets[name] + arrays[name].nbytes for name in staged)
            device.upload(self.buffer, self.staging[first // 4:end // 4], first)
        return staged


def _memory(device: Device) -> Any:
    return getattr(device, "memory", device)


def _launch_each(device: Device, launches: list[tuple]) -> None:
    launch = device.launch
    for kernel, groups, local, args in launches:
        launch(kernel, groups, local, args)


def _nbytes(v: Value, bindings: Mapping[str, int]) -> int:
    shape = storage_shape(v.type.concrete(bindings), v.type.dtype)
    return max(4, int(np.prod(shape, dtype=np.int64)) * v.type.dtype.numpy().itemsize)


def pack_workers() -> int:
    """Threads a load packs weights on: one per usable core, at most 8, each holding a part
    (and its packed copy, where the device is not mapped) beyond the device's copy of the
    weights: up to 2 x PART_BYTES a thread."""
    return min(8, len(os.sched_getaffinity(0)))


def _ahead(jobs: Iterator[tuple], work: Callable):
    """(job, work(*job)) for each job, in order, worked on pack_workers() threads, at most
    that many jobs ahead of the one the caller takes."""
    workers = pack_workers()
    with ThreadPoolExecutor(workers) as pool:
        ahead: deque = deque()
        for job in jobs:
            ahead.append((job, pool.submit(work, *job)))
            if len(ahead) > workers:
                done, result = ahead.popleft()
                yield done, result.result()
        while ahead:
            done, result = ahead.popleft()
            yield done, result.result()
