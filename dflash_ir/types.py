"""Tensor types: a dtype plus a shape whose dims are ints or named symbols.

Symbols name sizes known only per call (`T` rows in this call, `C` context capacity)
and are bound to ints by the interpreter or the backend at launch time.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Union

from .dtypes import DType

Dim = Union[int, str]
Shape = tuple[Dim, ...]


@dataclass(frozen=True)
class TensorType:
    dtype: DType
    shape: Shape

    def __post_init__(self):
        for d in self.shape:
            if isinstance(d, bool) or not isinstance(d, (int, str)) or (isinstance(d, int) and d < 0):
                raise TypeError(f"bad dim {d!r} in shape {self.shape}: dims are non-negative ints or symbol names")
        object.__setattr__(self, "shape", tuple(self.shape))

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def symbols(self) -> set[str]:
        return {d for d in self.shape if isinstance(d, str)}

    def concrete(self, bindings: Mapping[str, int]) -> tuple[int, ...]:
        """The shape with every symbol replaced by its bound value."""
        try:
            return tuple(d if isinstance(d, int) else int(bindings[d]) for d in self.shape)
        except KeyError as e:
            raise KeyError(f"symbol {e.args[0]!r} of shape {format_shape(self.shape)} is not bound") from None

    def __str__(self) -> str:
        return f"{self.dtype.value}{format_shape(self.shape)}"


def format_shape(shape: Shape) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]"


def parse_type(text: str) -> TensorType:
    """Inverse of `str(TensorType)`: 'f32[T,64]' -> TensorType(F32, ('T', 64))."""
    head, _, rest = text.partition("[")
    if not rest.endswith("]"):
        raise ValueError(f"bad tensor type {text!r}: expected like 'f32[T,64]'")
    body = rest[:-1].strip()
    dims: list[Dim] = []
    for tok in filter(None, (t.strip() for t in body.split(","))):
        dims.append(int(tok) if tok.lstrip("-").isdigit() else tok)
    return TensorType(DType.parse(head), tuple(dims))


def dims_equal(a: Dim, b: Dim) -> bool:
    """True unless the two dims are provably different (an int never equals another int, a
    symbol only itself; an int against a symbol cannot be decided statically and passes)."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    if isinstance(a, str) and isinstance(b, str):
        return a == b
    return True
