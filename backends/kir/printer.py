"""What every kernel printer shares: expressions with C's operator precedence (GLSL has the
same), statements, identifiers. A target language subclasses `Printer` and says how to
write types, literals, buffer loads and stores, ids, barriers and intrinsics."""
from __future__ import annotations

import numpy as np

from .ir import DT, K, Function, Kernel, Param, walk

PRECEDENCE = {"lor": 4, "land": 5, "or": 6, "xor": 7, "and": 8, "eq": 9, "ne": 9, "lt": 10, "le": 10, "gt": 10,
              "ge": 10, "shl": 11, "shr": 11, "add": 12, "sub": 12, "mul": 13, "div": 13, "mod": 13}
SYMBOL = {"lor": "||", "land": "&&", "or": "|", "xor": "^", "and": "&", "eq": "==", "ne": "!=", "lt": "<", "le": "<=",
          "gt": ">", "ge": ">=", "shl": "<<", "shr": ">>", "add": "+", "sub": "-", "mul": "*", "div": "/", "mod": "%"}
UNARY_SYMBOL = {"neg": "-", "not": "!", "bnot": "~"}
_UNARY, _SELECT, _PRIMARY = 14, 3, 16


class Printer:
    """Prints one kernel's body; `params` maps buffer names to their parameters."""

    indent = "  "

    def __init__(self, kernel: Kernel | None = None):
        self.kernel = kernel
        self.params: dict[str, Param] = {p.name: p for p in kernel.params} if kernel else {}
        self.arrays: dict[str, DT] = {n.arg[0]: n.dtype for n in walk(kernel.body) if n.op == "array"} if kernel else {}

    # -- target vocabulary (subclasses) -----------------------------------------------------
    def type_name(self, t: DT) -> str:
        raise NotImplementedError

    def ident(self, name: str) -> str:
        return name

    def float_literal(self, v: float) -> str:
        raise NotImplementedError

    def int_literal(self, v: int, t: DT) -> str:
        return str(v) if t.scalar == "i32" else f"{v}u" if t.scalar == "u32" else f"{v}"

    def special(self, kind: str, axis: int) -> str:
        raise NotImplementedError

    def load(self, p: Param, view: str, index: str, lanes: int) -> str:
        raise NotImplementedError

    def store(self, p: Param, view: str, index: str, value: str, lanes: int) -> str:
        raise NotImplementedError

    def cast(self, t: DT, x: K) -> tuple[str, int]:
        """The conversion of x to t, and its precedence."""
        raise NotImplementedError

    def bitcast(self, t: DT, x: str, src: DT) -> str:
        raise NotImplementedError

    def intrinsic(self, name: str, t: DT) -> str:
        raise NotImplementedError

    def minmax(self, op: str, t: DT) -> str:
        raise NotImplementedError

    def array_run(self, name: str, index: str, lanes: int) -> str:
        raise NotImplementedError(f"{type(self).__name__} has no vector view of an array: scalarize first")

    def array_run_store(self, name: str, index: str, value: str, lanes: int) -> str:
        raise NotImplementedError(f"{type(self).__name__} has no vector view of an array: scalarize first")

    def vsum(self, x: str, t: DT) -> str:
        raise NotImplementedError(f"{type(self).__name__} has no vector sum: scalarize first")

    def barrier(self) -> str:
        raise NotImplementedError

    def unroll_hint(self, factor: int) -> str:
        """The line before a loop asking to unroll it (none where the language has no such hint)."""
        return ""

    def array_decl(self, name: str, t: DT, length: int, scope: str, init) -> str:
        raise NotImplementedError

    def wg_reduce(self, node: K) -> list[str]:
        raise NotImplementedError(f"{type(self).__name__}: expand work-group reductions first")

    # -- expressions ----------------------------------------------------------------------
    def expr(self, n: K) -> str:
        return self._expr(n)[0]

    def _wrap(self, n: K, outer: int, right: bool = False) -> str:
        text, prec = self._expr(n)
        return f"({text})" if prec < outer or (right and prec == outer) else text

    def _expr(self, n: K) -> tuple[str, int]:
        op = n.op
        if op == "const":
            return self.literal(n.arg, n.dtype)
        if op == "var":
            return self.ident(n.arg), _PRIMARY
        if op == "special":
            return self.special(*n.arg), _PRIMARY
        if op == "load":
            buffer, view = n.arg
            return self.load(self.params[buffer], view, self.expr(n.src[0]), n.dtype.lanes), _PRIMARY
        if op == "index":
            if n.dtype.lanes > self.arrays.get(n.arg, n.dtype).lanes:
                return self.array_run(self.ident(n.arg), self.expr(n.src[0]), n.dtype.lanes), _PRIMARY
            return f"{self.ident(n.arg)}[{self.index(n.src[0])}]", _PRIMARY
        if op in ("min", "max"):
            a, b = n.src
            return f"{self.minmax(op, a.dtype)}({self.expr(a)}, {self.expr(b)})", _PRIMARY
        if op in PRECEDENCE:
            p = PRECEDENCE[op]
            a, b = n.src
            return f"{self._wrap(a, p)} {SYMBOL[op]} {self._wrap(b, p, right=True)}", p
        if op in UNARY_SYMBOL:
            return f"{UNARY_SYMBOL[op]}{self._wrap(n.src[0], _UNARY + 1)}", _UNARY
        if op == "select":
            c, a, b = n.src
            return f"{self._wrap(c, _SELECT + 1)} ? {self._wrap(a, _SELECT + 1)} : {self._wrap(b, _SELECT)}", _SELECT
        if op == "cast":
            return self.cast(n.dtype, n.src[0])
        if op == "bitcast":
            return self.bitcast(n.dtype, self.expr(n.src[0]), n.src[0].dtype), _PRIMARY
        if op == "call":
            name = self.ident(n.arg.name) if isinstance(n.arg, Function) else self.intrinsic(n.arg, n.dtype)
            return f"{name}({', '.join(self.expr(s) for s in n.src)})", _PRIMARY
        if op == "vsum":
            return self.vsum(self.expr(n.src[0]), n.src[0].dtype), _PRIMARY
        raise ValueError(f"{type(self).__name__}: {op} is not an expression")

    def index(self, n: K) -> str:
        """An array or buffer subscript."""
        return self.expr(n)

    def literal(self, v, t: DT) -> tuple[str, int]:
        if t.scalar == "bool":
            return ("true" if v else "false"), _PRIMARY
        if t.scalar == "f32":
            text = self.float_literal(v)
        else:
            text = self.int_literal(v, t)
        return text, _UNARY if text.startswith("-") else _PRIMARY

    @staticmethod
    def shortest_f32(v: float) -> str:
        """The shortest decimal that parses back to the same f32 (with a decimal point)."""
        text = np.format_float_positional(np.float32(v), unique=True, trim="0") if abs(v) < 1e16 and (
            v == 0 or abs(v) >= 1e-5) else np.format_float_scientific(np.float32(v), unique=True, trim="0")
        return text + "0" if text.endswith(".") else text

    # -- statements -----------------------------------------------------------------------
    def statements(self, n: K, depth: int = 1) -> list[str]:
        pad = self.indent * depth
        op = n.op
        if op == "block":
            return [line for s in n.src for line in self.statements(s, depth)]
        if op == "decl":
            init = f" = {self.expr(n.src[0])}" if n.src else ""
            return [f"{pad}{self.type_name(n.dtype)} {self.ident(n.arg)}{init};"]
        if op == "array":
            name, length, scope, init = n.arg
            text = self.array_decl(self.ident(name), n.dtype, length, scope, init)
            return [f"{pad}{text}"] if text else []
        if op == "assign":
            return [f"{pad}{self.assignment(*n.src)};"]
        if op == "store":
            buffer, view = n.arg
            index, value = n.src
            return [f"{pad}{self.store(self.params[buffer], view, self.expr(index), self.expr(value), value.dtype.lanes)};"]
        if op == "for":
            start, cond, nxt, body = n.src
            i = self.ident(n.arg)
            head = f"for (int {i} = {self.expr(start)}; {self.expr(cond)}; {self.step(n.arg, nxt)})"
            return [f"{pad}{head} {{", *self.statements(body, depth + 1), f"{pad}}}"]
        if op == "unroll":
            return [line for line in (self.unroll_hint(n.arg),) if line] + self.statements(n.src[0], depth)
        if op == "if":
            cond, then, other = n.src
            if then.src == (K("return"),) and not other.src:
                return [f"{pad}if ({self.expr(cond)}) return;"]
            lines = [f"{pad}if ({self.expr(cond)}) {{", *self.statements(then, depth + 1)]
            if other.src:
                lines += [f"{pad}}} else {{", *self.statements(other, depth + 1)]
            return lines + [f"{pad}}}"]
        if op == "return":
            return [f"{pad}return;"]
        if op == "barrier":
            return [f"{pad}{self.barrier()};"]
        if op == "wg_reduce":
            return [f"{pad}{line}" for line in self.wg_reduce(n)]
        raise ValueError(f"{type(self).__name__}: {op} is not a statement")

    def assignment(self, target: K, value: K) -> str:
        if target.op == "index" and target.dtype.lanes > self.arrays.get(target.arg, target.dtype).lanes:
            return self.array_run_store(self.ident(target.arg), self.expr(target.src[0]), self.expr(value),
                                        target.dtype.lanes)
        t = self.expr(target)
        if value.op in ("add", "sub", "mul") and value.src[0] == target and value.dtype.lanes == target.dtype.lanes:
            return f"{t} {SYMBOL[value.op]}= {self._wrap(value.src[1], 0)}"
        return f"{t} = {self.expr(value)}"

    def step(self, name: str, nxt: K) -> str:
        i = self.ident(name)
        if nxt.op == "add" and nxt.src[0] == K("var", nxt.dtype, (), name) and nxt.src[1].op == "const":
            return f"++{i}" if nxt.src[1].arg == 1 else f"{i} += {self.expr(nxt.src[1])}"
        if nxt.op == "shr" and nxt.src[0] == K("var", nxt.dtype, (), name):
            return f"{i} >>= {self.expr(nxt.src[1])}"
        return f"{i} = {self.expr(nxt)}"

    def function_source(self, fn: Function, qualifier: str) -> str:
        params = ", ".join(f"{self.type_name(t)} {self.ident(p)}" for p, t in fn.params)
        body = self.statements(fn.body)
        return "\n".join([f"{qualifier}{self.type_name(fn.result.dtype)} {self.ident(fn.name)}({params}) {{", *body,
                          f"{self.indent}return {self.expr(fn.result)};", "}"])
