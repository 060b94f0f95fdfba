"""dflash_ir/activations.py: the elementwise ops' one formula each, against hand-derived values,
and what calls it (the numpy reference, the kernel layer, TVM). Every kernel's agreement with
the interpreter is tests/kernel_cases.py's (the *_odd, *_broadcast, fused and GDN cases)."""
from __future__ import annotations

import math
import re

import numpy as np
import pytest

from dflash_ir import activations
from dflash_ir.activations import NUMPY
from dflash_ir.backends.kernels import elementwise  # the package: every kernel lowering registered
from dflash_ir.backends.lowering import LOWERINGS
from dflash_ir.backends.tvm import ops_elementwise
from dflash_ir.backends.tvm.lowering import TVM_LOWERINGS
from dflash_ir.backends.tvm.tir import TIR, _Text, activation
from dflash_ir.ops.registry import get_op
from written_once import written_out

F32 = np.float32
# a sigmoid or softplus written out (numpy's, the kernel layer's or TensorIR's spelling of
# the formula's first step), a norm's inverse RMS (its square root), or the kernel layer's
# device functions called past its math
WRITTEN_OUT = re.compile(r'np\.exp\(-np\.abs|logaddexp|exp", -call\("fabs|T\.exp\(-T\.fabs|T\.log\(T\.float32\(1\)'
                         r'|np\.sqrt\(|call\("sqrt"|T\.sqrt\(|\bSIGMOID\b|\bSOFTPLUS\b')
SWEEP = np.concatenate([np.linspace(-120, 120, 4801), [0.0, -0.0, 1e-30, -1e-30]]).astype(F32)


def test_the_formulas_give_hand_derived_values_without_overflow():
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        sigmoid = activations.sigmoid(NUMPY, SWEEP)
        softplus = activations.softplus(NUMPY, SWEEP)
    assert sigmoid.dtype == softplus.dtype == F32
    exact = np.exp(-np.logaddexp(0.0, -SWEEP.astype(np.float64)))
    tiny = np.finfo(F32).tiny  # results below it are subnormal: their error is absolute
    np.testing.assert_allclose(sigmoid, exact, rtol=4e-7, atol=tiny)
    np.testing.assert_allclose(softplus, np.logaddexp(0.0, SWEEP.astype(np.float64)), rtol=4e-7, atol=tiny)
    assert activations.sigmoid(NUMPY, F32(0)) == F32(0.5)
    assert activations.softplus(NUMPY, F32(0)) == F32(math.log(2))
    assert activations.softplus(NUMPY, F32(100)) == F32(100)
    assert activations.swiglu(NUMPY, F32(2), F32(3)) == F32(2) * activations.sigmoid(NUMPY, F32(2)) * F32(3)


def test_a_norms_scale_is_one_over_the_root_of_its_mean_square():
    """rmsnorm's scale from the sum of n squares, l2norm's from the sum itself; the reference
    norms are x times it, bit for bit what numpy's mean made of the same squares."""
    assert activations.inverse_rms(NUMPY, F32(12), 3, F32(0)) == F32(0.5)
    assert activations.inverse_rms(NUMPY, F32(16), None, F32(0)) == F32(0.25)
    x = (np.random.default_rng(3).standard_normal((5, 4096)) * 30).astype(F32)
    eps = F32(1e-6)
    mean_square = np.mean(x * x, axis=-1, keepdims=True)
    np.testing.assert_array_equal(get_op("rmsnorm").reference(x, eps=1e-6), x * (1 / np.sqrt(mean_square + eps)))
    np.testing.assert_array_equal(get_op("l2norm").reference(x, eps=1e-6),
                                  x * (1 / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)))
    assert str(activations.inverse_rms(TIR, _Text("s"), _Text("n"), 1e-6)) == \
        "(T.float32(1.0) / T.sqrt(((s / n) + T.float32(9.999999974752427e-07))))"


def test_softplus_is_numpys_logaddexp_to_three_ulps():
    """The formula the kernels always ran; the reference took np.logaddexp(0, x) before."""
    got, before = activations.softplus(NUMPY, SWEEP), np.logaddexp(F32(0), SWEEP)
    assert np.max(np.abs(got - before) / np.spacing(np.abs(before))) <= 3


@pytest.mark.parametrize("op", sorted(activations.UNARY))
def test_a_unary_reference_is_its_formula(op):
    np.testing.assert_array_equal(get_op(op).reference(SWEEP[::7]), activations.UNARY[op](NUMPY, SWEEP[::7]))


@pytest.mark.parametrize("op", sorted(activations.BINARY))
def test_a_binary_reference_is_its_formula(op):
    a, b = SWEEP[::11].reshape(-1, 1)[:40], SWEEP[::13][:30]
    b = np.where(b == 0, F32(1), b) if op == "div" else b
    np.testing.assert_array_equal(get_op(op).reference(a, b), activations.BINARY[op](NUMPY, a, b))


def test_every_backend_lowers_the_shared_table():
    ops = set(activations.UNARY) | set(activations.BINARY)
    assert {op for op, fn in LOWERINGS.items() if fn in (elementwise.binary, elementwise.unary)} == ops
    assert {op for op, fn in TVM_LOWERINGS.items() if fn is ops_elementwise.elementwise} == ops


def test_tvm_text_is_the_formula():
    """TVM's softplus was log(1 + e^-|x|); it is the formula's log1p now, and its sigmoid a
    select (one vector op when vectorised), not an if_then_else."""
    assert activation("softplus", "x") == "(T.max(x, T.float32(0.0)) + T.log1p(T.exp((-T.fabs(x)))))"
    assert activation("sigmoid", "x").startswith("T.Select((x >= T.float32(0.0)), ")
    assert activation("swiglu", "g", "u") == f"((g * {activation('sigmoid', 'g')}) * u)"


def test_no_module_writes_an_activation_out_again():
    """The README's claim: the references, the kernels' epilogues and gates and TVM's text
    call the formulas; only activations.py writes them, and only the kernel layer's math
    (access.py) calls the device functions. Every copy the formulas replaced matched."""
    hits = written_out(WRITTEN_OUT, "dflash_ir/activations.py", "backends/kernels/access.py")
    assert not hits, "\n".join(hits)
