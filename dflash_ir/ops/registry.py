"""The op registry: every op has a shape/dtype rule and a numpy reference.

The reference is the definition of the op: the interpreter runs it, and every backend
kernel is tested against it. Register with::

    @register("add", infer=same_as_first)
    def add(a, b):
        return a + b

`infer(input_types, attrs)` returns the output TensorTypes (one or a tuple); it raises
`OpError` with a message naming the op and what is wrong. The reference takes the input
arrays positionally and the attributes as keyword arguments, and returns an array or a
tuple of arrays (one per output).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ..types import TensorType

InferFn = Callable[[Sequence[TensorType], Mapping[str, Any]], "TensorType | tuple[TensorType, ...]"]


class OpError(ValueError):
    """An op was used with inputs or attributes its rule rejects."""


@dataclass(frozen=True)
class OpDef:
    name: str
    infer: InferFn
    reference: Callable[..., Any]
    doc: str = ""

    def output_types(self, inputs: Sequence[TensorType], attrs: Mapping[str, Any]) -> tuple[TensorType, ...]:
        out = self.infer(list(inputs), dict(attrs))
        return out if isinstance(out, tuple) else (out,)

    def run(self, arrays: Sequence[np.ndarray], attrs: Mapping[str, Any]) -> tuple[np.ndarray, ...]:
        out = self.reference(*arrays, **attrs)
        return out if isinstance(out, tuple) else (out,)


REGISTRY: dict[str, OpDef] = {}


def register(name: str, *, infer: InferFn):
    def deco(fn):
        if name in REGISTRY:
            raise ValueError(f"op {name!r} registered twice")
        REGISTRY[name] = OpDef(name, infer, fn, (fn.__doc__ or "").strip())
        return fn

    return deco


def get_op(name: str) -> OpDef:
    _load_all()
    try:
        return REGISTRY[name]
    except KeyError:
        raise OpError(f"unknown op {name!r}") from None


def all_ops() -> dict[str, OpDef]:
    _load_all()
    return dict(REGISTRY)


def _load_all() -> None:
    """Import the op modules so their @register calls run."""
    from . import _modules  # noqa: F401
