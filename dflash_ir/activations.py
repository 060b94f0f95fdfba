"""The elementwise ops' arithmetic, each written once: activations, gates and binary arithmetic.

As dflash_ir/blocks.py does for the block layouts, every formula here is a function of a
*math* `m` and its operands. The numpy reference calls it with `NUMPY` and arrays; the kernel
layer with its own math and kernel expressions (backends/kernels/access.py: `KERNEL`, and
`inline` for vectors) or TIR text (backends/tvm/tir.py: `TIR`). So the op's arithmetic and
its order live here only: a backend chooses how an intrinsic is spelled, not what is
computed. A formula uses Python's + - * / and unary -, comparisons with >=, float constants,
and the methods of its math (a `Math`, which has let, sigmoid and softplus already):

    m.exp(x), m.fabs(x), m.log1p(x),
    m.sqrt(x)                         the intrinsics, on f32
    m.maximum(a, b), m.minimum(a, b)  the larger, the smaller
    m.select(c, a, b)                 a where c, else b (both evaluated)
    m.equal(a, b)                     a == b
    m.either(a, b), m.both(a, b)      logical or, and
    m.let(x)                          x, computed once where the target has statements
    m.sigmoid(x), m.softplus(x)       `sigmoid(m, x)`, `softplus(m, x)`, or one device
                                      function computing them (a kernel's scalars)
"""
from __future__ import annotations

import numpy as np


def sigmoid(m, x):
    """1/(1+e^-x) without overflow: exp only ever sees -|x|."""
    e = m.let(m.exp(-m.fabs(x)))
    return m.select(x >= 0.0, 1.0 / (1.0 + e), e / (1.0 + e))


def softplus(m, x):
    """log(1+e^x), stable for large |x|: max(x, 0) + log1p(e^-|x|) (numpy's logaddexp(0, x))."""
    return m.maximum(x, 0.0) + m.log1p(m.exp(-m.fabs(x)))


def inverse_rms(m, squares, n, eps):
    """A norm's scale from the sum of its squares: 1/sqrt(squares/n + eps), rmsnorm's mean of
    n squares (n None: the sum itself, l2norm's HF/FLA convention). How the squares are summed
    is each kernel's schedule; what is made of the sum is this."""
    return 1.0 / m.sqrt((squares if n is None else squares / n) + eps)


def silu(m, x):
    return x * m.sigmoid(x)


def swiglu(m, g, u):
    """silu(g) · u: (g · sigmoid(g)) · u, in that order everywhere."""
    return silu(m, g) * u


def sigmoid_gate(m, x, g):
    return x * m.sigmoid(g)


UNARY = {"neg": lambda m, x: -x, "exp": lambda m, x: m.exp(x), "sigmoid": lambda m, x: m.sigmoid(x),
         "silu": silu, "softplus": lambda m, x: m.softplus(x)}
BINARY = {"add": lambda m, a, b: a + b, "sub": lambda m, a, b: a - b, "mul": lambda m, a, b: a * b,
          "div": lambda m, a, b: a / b, "swiglu": swiglu, "sigmoid_gate": sigmoid_gate}


class Math:
    """What every math shares: a let that is its value (an expression language: numpy, text),
    and sigmoid and softplus written out by their formulas. A math adds the intrinsics."""

    @staticmethod
    def let(x):
        return x

    def sigmoid(self, x):
        return sigmoid(self, x)

    def softplus(self, x):
        return softplus(self, x)


class _Numpy(Math):
    """The reference's math: numpy arrays (f32 stays f32: Python floats are weak scalars)."""
    exp, fabs, log1p, sqrt, maximum, minimum = np.exp, np.abs, np.log1p, np.sqrt, np.maximum, np.minimum
    select, equal, either, both = staticmethod(np.where), np.equal, np.logical_or, np.logical_and


NUMPY = _Numpy()
