"""A small evaluator of kir expression trees with C's semantics: the independent reference
the kir tests compare simplified trees and printed kernels against."""
from __future__ import annotations

import numpy as np

from dflash_ir.backends.kir import K

_WIDTH = {"i16": 16, "i32": 32, "u32": 32, "i64": 64}


class Undefined(ArithmeticError):
    """C gives the expression no value (division by zero; with strict=True also signed
    overflow and shifts outside the type's width or of negative values)."""


def wrap(v: int, scalar: str) -> int:
    """v as the two's complement `scalar` holds it."""
    bits = _WIDTH[scalar]
    v &= (1 << bits) - 1
    return v - (1 << bits) if scalar != "u32" and v >> (bits - 1) else v


def evaluate(n: K, env: dict, strict: bool = False):
    """The value of expression `n`: f32 arithmetic rounded per operation (numpy float32),
    integers two's complement (wrapping, or Undefined on signed overflow when strict),
    division truncating toward zero, comparisons as bool; `env` maps variable names, and
    ("load", buffer name) to the buffer's contents."""
    op, t = n.op, n.dtype.scalar
    if op == "const":
        return np.float32(n.arg) if t == "f32" else n.arg
    if op == "var":
        return env[n.arg]
    if op == "load":
        return env["load", n.arg[0]][int(evaluate(n.src[0], env, strict))]
    args = [evaluate(s, env, strict) for s in n.src]

    def integer(v: int) -> int:
        if strict and t != "u32" and wrap(v, t) != v:
            raise Undefined(f"{n.op} overflows {t}")
        return wrap(v, t)

    if op == "select":
        return args[1] if args[0] else args[2]
    if op == "cast":
        (a,) = args
        if t == "f32":
            return np.float32(a)
        if t == "bool":
            return bool(a)
        if isinstance(a, np.floating) and (not np.isfinite(a) or wrap(int(a), t) != int(a)):
            raise Undefined(f"{a} does not fit {t}")
        return wrap(int(a), t)
    if op == "neg":
        return np.negative(args[0]) if t == "f32" else integer(-args[0])
    if op == "bnot":
        return integer(~args[0])
    if op == "not":
        return not args[0]
    a, b = args
    if op in ("lt", "le", "gt", "ge", "eq", "ne"):
        return bool({"lt": a < b, "le": a <= b, "gt": a > b, "ge": a >= b, "eq": a == b, "ne": a != b}[op])
    if op in ("land", "lor"):
        return bool(a and b) if op == "land" else bool(a or b)
    if t == "f32":
        with np.errstate(all="ignore"):
            return {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide, "min": np.fmin,
                    "max": np.fmax}[op](np.float32(a), np.float32(b))
    if op in ("div", "mod"):
        if b == 0:
            raise Undefined("division by zero")
        q = integer(abs(a) // abs(b) * (1 if (a < 0) == (b < 0) else -1))
        return q if op == "div" else integer(a - b * q)
    if op in ("shl", "shr"):
        if strict and not (0 <= b < _WIDTH[t] and (op == "shr" or a >= 0)):
            raise Undefined(f"{a} {op} {b}")
        return integer(a << b) if op == "shl" else wrap(a >> b, t)
    return integer({"add": a + b, "sub": a - b, "mul": a * b, "min": min(a, b), "max": max(a, b), "and": a & b,
                    "or": a | b, "xor": a ^ b}[op])
