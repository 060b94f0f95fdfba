"""Matmuls specialised to their weight's storage type: `matmul_q8_0`, `matmul_f16`, and
`matmul_<type>` for every other block type (`matmul_q4_k`, `matmul_iq4_xs`, ...).

They read the weight as stored (Q8_0: rows of 34-byte blocks, fp16 scale then 32 int8;
F16: halves; other block types: rows of their blocks, decoded by dflash_ir/blocks.py) and
dequantise inside, never materialising the f32 matrix. Attributes carry
what a kernel generator needs without looking at shapes: `form` (gemv for a few rows,
gemm for many), the constants K and N, the weight `layout` a backend packs, an optional
fused `residual` input (out = x @ wᵀ + residual).

A product over a weight of quant.Q8_X_TYPES (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, the K-quants)
whose x is itself Q8_0 (made by `quantize_q8_0`, llama.cpp's quantize_row_q8_0: per 32-element
block an fp16 scale and 32 int8) is llama.cpp's product of such a weight with quantised
activations: per sub-block (32 elements, or 16), the integer dot of the weight's codes and
x's quants, times the sub-block's scale * d_x, plus, for the types with a min (Q4_1, Q5_1, the K-quants'
-dmin * m), that times d_x * (the sum of x's quants) (llama.cpp keeps that as Q8_1's `s`,
rounded to f16, and gives the K-quants Q8_K x, one scale per 256; here it stays f32). The
integer parts do not depend on how a kernel orders them, so a row's result does not depend
on how many rows share the pass. One matmul stays within 1e-2 of the f32 path relative to
the output's max |value| (about 6e-3 on random data, K = 64..4096); the `q8` numerics mode
(passes/quantize_activations.py) uses it for every weight of those types.
"""
from __future__ import annotations

import numpy as np

from ..dtypes import DType
from ..quant import Q8_X_TYPES, quantize_q8_0
from ..types import TensorType
from .linalg import matmul
from .registry import get_op
from .rules import check, choice_attr, defop, expect_dtype, int_attr

F32 = np.float32
FORMS = ("gemv", "gemm")
# one specialised op per stored weight type: F16 and every block type (dflash_ir/blocks.py decoders)
_STORED = (DType.F16, *(d for d in DType if d.is_block))
LAYOUTS = {d: f"{d.value}_rowmajor" for d in _STORED}
OPS = {d: f"matmul_{d.value}" for d in _STORED}
_BLOCK = DType.Q8_0.block_size


def _specialised(dtype: DType) -> None:
    def rule(x: TensorType, w: TensorType, residual: TensorType | None = None, *, form, K, N, layout) -> TensorType:
        expect_dtype("w", w, dtype)
        check(x.dtype is DType.F32 or (x.dtype is DType.Q8_0 and dtype in Q8_X_TYPES),
              f"x must be f32{' or q8_0' if dtype in Q8_X_TYPES else ''}, got {x}")
        (out,) = get_op("matmul").output_types([TensorType(DType.F32, x.shape), w], {})
        choice_attr("form", form, FORMS)
        check(int_attr("K", K) == w.shape[1] and int_attr("N", N) == w.shape[0],
              f"K={K}, N={N} do not match the weight {w} (N rows of K)")
        choice_attr("layout", layout, [LAYOUTS[dtype]])
        if residual is not None:
            check(residual == out, f"residual {residual} must have the output's type {out}")
        return out

    def reference(x, w, residual=None, *, form, K, N, layout):
        out = matmul(x, w)
        return out if residual is None else np.asarray(out + residual)

    reference.__doc__ = (f"x @ wᵀ [+ residual] for a weight w[N, K] stored as {dtype}, read as stored and "
                         f"dequantised in row chunks (never the whole matrix); `form`, `layout` choose the kernel.")
    defop(OPS[dtype], rule)(reference)


for _dtype in OPS:
    _specialised(_dtype)


def _group_rule(x: TensorType, *weights: TensorType, op, form, K, Ns, layout) -> tuple[TensorType, ...]:
    choice_attr("op", op, list(OPS.values()))
    check(len(weights) >= 2, f"a group needs two weights or more, got {len(weights)}")
    check(isinstance(Ns, tuple) and len(Ns) == len(weights), f"Ns={Ns!r} must give one N per weight")
    return tuple(get_op(op).output_types([x, w], dict(form=form, K=K, N=n, layout=layout))[0]
                 for w, n in zip(weights, Ns))


@defop("matmul_group", _group_rule)
def matmul_group(x, *weights, op, form, K, Ns, layout):
    """x @ wᵢᵀ for several weights of one storage type and K that read the same x (a layer's
    q/k/v, gate/up or Gated DeltaNet input projections): one kernel over their rows side by
    side. Output i is exactly matmul `op` of weight i."""
    return tuple(get_op(op).run([x, w], dict(form=form, K=K, N=n, layout=layout))[0]
                 for w, n in zip(weights, Ns))


def _quantize_rule(x: TensorType, *norm_weight: TensorType, norm_eps=None) -> TensorType:
    expect_dtype("x", x, DType.F32)
    check(x.rank >= 1 and isinstance(x.shape[-1], int) and x.shape[-1] % _BLOCK == 0,
          f"quantize_q8_0 needs a static last dim that is a multiple of {_BLOCK}, got {x}")
    check(len(norm_weight) == (norm_eps is not None),
          f"quantize_q8_0 takes a norm weight exactly when norm_eps is given, got {len(norm_weight)} and {norm_eps!r}")
    if norm_eps is not None:
        get_op("rmsnorm").output_types([x, *norm_weight], {"eps": norm_eps})
    return TensorType(DType.Q8_0, x.shape)


@defop("quantize_q8_0", _quantize_rule)
def quantize_q8_0_op(x, *norm_weight, norm_eps=None):
    """x quantised to Q8_0 blocks along its last dim, as llama.cpp's quantize_row_q8_0
    (the activations of a Q8_0 x Q8_0 product). With `norm_eps`, x is first RMS-normalised
    with the weight (rmsnorm's reference): the quantised products' prologue, one kernel
    where the norm and the quantisation would be two (passes/fuse_matmul.py)."""
    if norm_eps is not None:
        x = get_op("rmsnorm").run([x, *norm_weight], {"eps": norm_eps})[0]
    return quantize_q8_0(x)


EPILOGUES = ("none", "swiglu", "swiglu_q8")


def _fused_matmul_rule(x: TensorType, *operands: TensorType, op, form, K, Ns, layout, norm_eps, epilogue):
    choice_attr("epilogue", epilogue, EPILOGUES)
    weights = operands[1:] if norm_eps is not None else operands
    check(len(weights) >= 1 and len(Ns) == len(weights), f"Ns={Ns!r} must give one N per weight ({len(weights)})")
    if norm_eps is not None:
        expect_dtype("x", x, DType.F32)
        check(operands[0].rank == 1 and operands[0].shape[0] == x.shape[-1],
              f"norm weight {operands[0]} must be [{x.shape[-1]}]")
    outs = [get_op(op).output_types([x, w], dict(form=form, K=K, N=n, layout=layout))[0] for w, n in zip(weights, Ns)]
    if epilogue != "none":
        check(len(outs) == 2 and outs[0] == outs[1], f"swiglu needs two products of one shape, got {outs}")
        return outs[0] if epilogue == "swiglu" else _quantize_rule(outs[0])
    return outs[0] if len(outs) == 1 else tuple(outs)


@defop("fused_matmul", _fused_matmul_rule)
def fused_matmul(x, *operands, op, form, K, Ns, layout, norm_eps=None, epilogue="none"):
    """Products of one x with their prologue and epilogue in one kernel: with `norm_eps`, x is
    first RMS-normalised with operands[0] (rmsnorm's reference); then x @ wᵢᵀ for each weight
    (`op`'s reference); `swiglu` returns silu(product 0) * product 1 instead of the products,
    `swiglu_q8` that quantised to Q8_0 (the q8 numerics' x of the down product)."""
    weights = operands
    if norm_eps is not None:
        x = get_op("rmsnorm").run([x, operands[0]], {"eps": norm_eps})[0]
        weights = operands[1:]
    outs = [get_op(op).run([x, w], dict(form=form, K=K, N=n, layout=layout))[0] for w, n in zip(weights, Ns)]
    if epilogue != "none":
        act = get_op("swiglu").run(outs, {})[0]
        return act if epilogue == "swiglu" else quantize_q8_0(act)
    return outs[0] if len(outs) == 1 else tuple(outs)
