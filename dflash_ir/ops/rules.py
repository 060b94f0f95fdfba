"""Shared pieces of the ops' shape/dtype rules.

A rule is written as `rule(*input_types, **attrs)` with the parameter names of the op's
reference. `defop` binds a node's inputs and attrs against the *reference's* signature, so
attribute defaults live in one place, and a wrong input count or an unknown or missing
attribute is reported like any other rule violation. Rules raise `OpError` with just what
is wrong; `defop` prefixes the op name.
"""
from __future__ import annotations

import inspect
from numbers import Real
from typing import Callable, Iterable, Sequence

from ..dtypes import DType
from ..types import Dim, Shape, TensorType, dims_equal, format_shape
from .registry import OpError, register

# dtypes a weight may be stored in; references see them through `linalg.as_f32`
WEIGHT_DTYPES = (DType.F32, DType.F16, DType.BF16) + tuple(d for d in DType if d.is_block)


def defop(name: str, rule: Callable[..., TensorType | tuple[TensorType, ...]]):
    """Register the decorated reference as op `name`, with `rule` as its shape/dtype rule."""

    def deco(reference):
        signature = inspect.signature(reference)

        def infer(input_types, attrs):
            try:
                bound = signature.bind(*input_types, **attrs)
            except TypeError as e:
                raise OpError(f"{name}: {e}") from None
            bound.apply_defaults()
            try:
                return rule(*bound.args, **bound.kwargs)
            except OpError as e:
                raise OpError(f"{name}: {e}") from None

        return register(name, infer=infer)(reference)

    return deco


def check(condition: bool, message: str) -> None:
    if not condition:
        raise OpError(message)


def expect_dtype(what: str, t: TensorType, *dtypes: DType) -> None:
    allowed = "/".join(d.value for d in dtypes)
    check(t.dtype in dtypes, f"{what} must be {allowed}, got {t}")


def expect_rank(what: str, t: TensorType, *ranks: int) -> None:
    allowed = " or ".join(str(r) for r in ranks)
    check(t.rank in ranks, f"{what} must have rank {allowed}, got {t}")


def expect_min_rank(what: str, t: TensorType, rank: int) -> None:
    check(t.rank >= rank, f"{what} must have rank >= {rank}, got {t}")


def expect_same(what_a: str, a: Dim, what_b: str, b: Dim, context: Iterable[TensorType] = ()) -> None:
    """The two dims must be equal (as far as can be decided with symbols)."""
    shown = ", ".join(str(t) for t in context)
    check(dims_equal(a, b), f"{what_a} ({a}) != {what_b} ({b})" + (f" in {shown}" if shown else ""))


def expect_block_aligned(what: str, t: TensorType) -> None:
    """A block-quantised tensor's innermost logical dim must be a whole number of blocks."""
    if t.dtype.is_block and t.rank and isinstance(t.shape[-1], int):
        check(t.shape[-1] % t.dtype.block_size == 0,
              f"{what} {t}: last dim must be a multiple of {t.dtype.block_size} for {t.dtype}")


def int_attr(name: str, value, minimum: int | None = None) -> int:
    check(isinstance(value, int) and not isinstance(value, bool), f"{name} must be an int, got {value!r}")
    if minimum is not None:
        check(value >= minimum, f"{name} must be >= {minimum}, got {value}")
    return value


def bool_attr(name: str, value) -> bool:
    check(isinstance(value, bool), f"{name} must be a bool, got {value!r}")
    return value


def number_attr(name: str, value) -> float:
    check(isinstance(value, Real) and not isinstance(value, bool), f"{name} must be a number, got {value!r}")
    return float(value)


def ints_attr(name: str, value) -> tuple[int, ...]:
    """A tuple-of-ints attribute (a list is accepted: serialisers may produce one)."""
    check(isinstance(value, (tuple, list)), f"{name} must be a tuple of ints, got {value!r}")
    return tuple(int_attr(f"{name}[{i}]", v) for i, v in enumerate(value))


def choice_attr(name: str, value, choices: Sequence[str]) -> str:
    check(value in choices, f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")
    return value


def normalize_axis(axis, rank: int) -> int:
    """`axis` in [-rank, rank) as a non-negative index."""
    int_attr("axis", axis)
    check(-rank <= axis < rank, f"axis {axis} is out of range for rank {rank}")
    return axis % rank


def broadcast_shapes(*shapes: Shape) -> Shape:
    """numpy broadcasting over dims that may be symbols. A symbol against an int other than 1
    is assumed to equal it (the int is the result); two different symbols are an error."""
    rank = max(len(s) for s in shapes)
    padded = [(1,) * (rank - len(s)) + tuple(s) for s in shapes]
    result = []
    for axis, dims in enumerate(zip(*padded)):
        sized = [d for d in dims if d != 1]
        for d in sized[1:]:
            check(dims_equal(sized[0], d),
                  f"shapes {', '.join(format_shape(s) for s in shapes)} do not broadcast (axis {axis})")
        ints = [d for d in sized if isinstance(d, int)]
        result.append(ints[0] if ints else (sized[0] if sized else 1))
    return tuple(result)


def f32(shape: Shape) -> TensorType:
    return TensorType(DType.F32, tuple(shape))


def i32(shape: Shape) -> TensorType:
    return TensorType(DType.I32, tuple(shape))
