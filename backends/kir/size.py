"""Kernel-tree integer expressions as the launch plan's size expressions (plan.compile_expr):
grid sizes, `when` conditions and host checks are written with the same nodes as kernel
bodies, over the symbol sizes (`n_T` ...), and stored in the manifest as text."""
from __future__ import annotations

from .build import lift
from .ir import I32, K

_INFIX = {"add": "+", "sub": "-", "mul": "*", "div": "//", "mod": "%", "lt": "<", "le": "<=", "gt": ">", "ge": ">=",
          "eq": "==", "ne": "!=", "land": "and", "lor": "or"}


def size_expr(x: K | int | str) -> str:
    """`x` as plan text; strings pass through (builders that write size text directly)."""
    if isinstance(x, str):
        return x
    from .simplify import simplify

    return _text(simplify(lift(x, I32)))


def _text(n: K) -> str:
    if n.op == "const":
        return str(int(n.arg)) if n.dtype.scalar != "bool" else str(bool(n.arg))
    if n.op == "var":
        return n.arg
    if n.op in _INFIX:
        a, b = n.src
        return f"({_text(a)} {_INFIX[n.op]} {_text(b)})"
    if n.op in ("min", "max"):
        return f"{n.op}({_text(n.src[0])}, {_text(n.src[1])})"
    if n.op == "cast" and n.dtype.is_int:
        return _text(n.src[0])
    raise ValueError(f"{n.op} cannot appear in a size expression (integer arithmetic over symbols only)")
