"""The contract between backends and the runtime: what a loaded program is and what it hands back.

It lives in neither: backends (backends/, and the reference interpreter that the numpy backend
runs) implement it, the runtime (dflash_ir/runtime, dflash_ir/serve) uses it, and neither
imports the other. A runtime that sees only this module can drive any backend; a backend
can change its insides (launch plans, buffers, devices) without the runtime noticing.

- `Program`: one graph, runnable: `run(inputs, states, keep=()) -> RunResult`. Inputs and
  states are numpy arrays, or `DeviceArray`s a program of the same load returned.
- `RunResult`: its outputs, updated states and the symbol values the call bound.
- `WeightLoader`: how a program gets its weights, `(Weight) -> storage array` as
  quant.storage_shape lays it out (e.g. a view into a memory-mapped GGUF); `check_weight`
  is the check both the interpreter and the device runner apply to what it returns. A loader
  may also have `release(weight, part)`: a backend that has copied `part` (a view of what
  the loader returned) into its own buffer calls it, so a mapped file can drop those pages.
- `BindError`: arrays passed to `run` do not match the graph's inputs or states.
- `DeviceArray`: a state or kept output still in a device buffer. Backends that keep state
  on their device return these; the runtime takes rows of them, copies them between
  buffers of the same device (a server slot's own copy) and passes them back in.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Collection, Mapping, Protocol

import numpy as np

from .ir import Graph, Weight
from .quant import storage_shape

WeightLoader = Callable[[Weight], np.ndarray]


class BindError(ValueError):
    """Arrays passed to a graph do not match its declared inputs or states."""


@dataclass
class RunResult:
    outputs: dict[str, Any]   # numpy arrays, or DeviceArrays for the outputs a program keeps
    states: dict[str, Any]    # updated states, likewise
    bindings: dict[str, int]  # symbol -> value bound by this call


class Program(Protocol):
    """A graph loaded by a backend. States come back as device arrays where the backend keeps
    them on its device; outputs named in `keep` likewise (the interpreter ignores `keep`)."""

    graph: Graph

    def run(self, inputs: Mapping[str, np.ndarray], states: Mapping[str, np.ndarray] | None = None, *,
            keep: Collection[str] = ()) -> RunResult: ...


def check_weight(graph: Graph, w: Weight, arr: np.ndarray) -> None:
    """Raise BindError unless `arr` (what a WeightLoader returned for `w`) is the storage the graph declares."""
    t = w.value.type
    expected = storage_shape(t.concrete({}), t.dtype)
    if tuple(arr.shape) != expected or arr.dtype != t.dtype.numpy():
        raise BindError(f"{graph.name}: weight {w.source}:{w.tensor} loaded as {arr.dtype}{list(arr.shape)}, "
                        f"graph declares {t} (storage {t.dtype.numpy()}{list(expected)})")


class ArrayDevice(Protocol):
    """What a DeviceArray needs of its device (backends/runner.Device has more)."""

    def alloc(self, nbytes: int) -> Any: ...
    def download(self, buf: Any, array: np.ndarray) -> None: ...
    def copy(self, src: Any, src_offset: int, dst: Any, dst_offset: int, nbytes: int) -> None: ...


class DeviceArray:
    """A state or output that stays in a device buffer between calls (bytes from `offset`),
    valid until its program runs again. The runtime only takes rows of it (a step-1 slice of
    the first axis: the accepted rows' features, the rows a commit replays), copies it into
    another buffer of the same device, and passes it back in; any other use reads it to the
    host first (`np.asarray`)."""

    def __init__(self, device: ArrayDevice, buffer, shape: tuple[int, ...], dtype: np.dtype, offset: int = 0):
        self.device, self.buffer, self.offset = device, buffer, offset
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.nbytes = math.prod(self.shape) * self.dtype.itemsize

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, rows: slice) -> "DeviceArray":
        if not isinstance(rows, slice):
            raise IndexError(f"DeviceArray takes a slice of rows of its first axis, got {rows!r}")
        start, stop, step = rows.indices(len(self))
        if step != 1:
            raise IndexError(f"DeviceArray takes contiguous rows only, got step {step}")
        row_bytes = self.nbytes // len(self) if len(self) else 0
        return DeviceArray(self.device, self.buffer, (max(0, stop - start), *self.shape[1:]), self.dtype,
                           self.offset + start * row_bytes)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = np.empty(self.shape, self.dtype)
        if out.size:
            source = self.buffer
            if self.offset:
                source = self.device.alloc(max(4, self.nbytes))
                self.device.copy(self.buffer, self.offset, source, 0, self.nbytes)
            self.device.download(source, out)
        return out if dtype is None else out.astype(dtype)

    def __repr__(self) -> str:
        return f"DeviceArray({self.dtype}{list(self.shape)})"
