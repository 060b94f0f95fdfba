"""Every kernel against the interpreter: single-node graphs on random data, edge shapes included
(one row, odd sizes, GQA 1 and >1, kv_len below capacity, T not a multiple of the chunk).

Used by the test suite (PoCL), the GPU checks and by hand on a new device:

    python tests/kernel_cases.py opencl [case-name-substring]

A case passes when every float output is within TOL * max|reference| of the reference
(1e-5: the f32 contract of ARCHITECTURE.md §8) and every integer output is equal.
"""
from __future__ import annotations

import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from dflash_ir.blocks import DECODERS
from dflash_ir.builder import GraphBuilder
from dflash_ir.dtypes import DType
from dflash_ir.interpreter import Interpreter
from dflash_ir.ir import Graph, Value
from dflash_ir.ops.specialised import OPS
from dflash_ir.quant import Q8_X_TYPES, dequantize, quantize
from quant_blocks import random_blocks

F32, F16, BF16, Q8, I32 = DType.F32, DType.F16, DType.BF16, DType.Q8_0, DType.I32
TOL = 1e-5


class CaseBuilder:
    """A GraphBuilder that also makes the random arrays its inputs, weights and states hold."""

    def __init__(self, name: str, bindings: dict[str, int], seed: int):
        self.b = GraphBuilder(name)
        self.bindings = bindings
        self.rng = np.random.default_rng(seed)
        self.weights: dict[str, np.ndarray] = {}
        self.inputs: dict[str, np.ndarray] = {}
        self.states: dict[str, np.ndarray] = {}
        self._outs = 0

    def _shape(self, shape) -> tuple[int, ...]:
        return tuple(self.bindings[d] if isinstance(d, str) else d for d in shape)

    def x(self, name: str, shape, dtype: DType = F32, scale: float = 1.0) -> Value:
        data = self.rng.standard_normal(self._shape(shape)).astype(np.float32) * np.float32(scale)
        self.inputs[name] = data if dtype is F32 else data.astype(dtype.numpy())
        return self.b.input(name, dtype, shape)

    def ints(self, name: str, shape, high: int, low: int = 0) -> Value:
        self.inputs[name] = self.rng.integers(low, high, self._shape(shape)).astype(np.int32)
        return self.b.input(name, I32, shape)

    def scalar(self, name: str, value: int) -> Value:
        self.inputs[name] = np.int32(value)
        return self.b.input(name, I32, ())

    def w(self, name: str, shape, dtype: DType = F32, scale: float = 0.5) -> Value:
        """Random weights rounded to `dtype`; block types other than Q8_0 as random blocks."""
        if dtype in DECODERS:
            self.weights[name] = random_blocks(self.rng, shape, dtype)
        else:
            self.weights[name] = quantize(self.rng.standard_normal(shape).astype(np.float32) * np.float32(scale), dtype)
        return self.b.weight(name, dtype, shape)

    def s(self, name: str, shape, scale: float = 0.5) -> Value:
        self.states[name] = self.rng.standard_normal(self._shape(shape)).astype(np.float32) * np.float32(scale)
        return self.b.state(name, F32, shape)

    def out(self, *values: Value) -> None:
        for v in values:
            self.b.output(f"out{self._outs}", v)
            self._outs += 1


@dataclass(frozen=True)
class Case:
    name: str
    make: Callable[[CaseBuilder], None]
    bindings: tuple[tuple[str, int], ...]

    def build(self, seed: int = 0) -> CaseBuilder:
        c = CaseBuilder(self.name, dict(self.bindings), seed)
        self.make(c)
        return c


CASES: dict[str, Case] = {}


def case(name: str, **bindings: int):
    """Register `fn(CaseBuilder)` as case `name`, with the symbol values of its arrays."""
    def deco(fn):
        CASES[name] = Case(name, fn, tuple(bindings.items()))
        return fn
    return deco


# -- elementwise --------------------------------------------------------------------------
for _op in ("add", "sub", "mul", "div", "swiglu", "sigmoid_gate"):
    case(f"{_op}_broadcast", T=5)(lambda c, op=_op: c.out(c.b.op(op, c.x("a", ("T", 3, 4)), c.x("b", (3, 1)))))
case("add_i32", T=7)(lambda c: c.out(c.b.add(c.ints("a", ("T",), 100, -100), c.ints("b", (1,), 50))))
case("mul_i32_same", T=3)(lambda c: c.out(c.b.mul(c.ints("a", ("T", 5), 100, -100), c.ints("b", ("T", 5), 9))))
case("mul_row_by_column", T=4)(lambda c: c.out(c.b.mul(c.x("a", ("T", 2, 64)), c.x("b", ("T", 2, 1)))))
for _op in ("neg", "exp", "sigmoid", "silu", "softplus"):
    case(f"{_op}_odd", T=7)(lambda c, op=_op: c.out(c.b.op(op, c.x("x", ("T", 13), scale=8.0))))
case("scale")(lambda c: c.out(c.b.scale(c.x("x", (3, 5)), factor=0.125)))
case("cast_f32_f16")(lambda c: c.out(c.b.cast(c.x("x", (5, 7), scale=100.0), dtype="f16")))
case("cast_f16_f32")(lambda c: c.out(c.b.cast(c.x("x", (5, 7), dtype=F16), dtype="f32")))
case("cast_f32_i32")(lambda c: c.out(c.b.cast(c.x("x", (9,), scale=50.0), dtype="i32")))
case("cast_i32_f32")(lambda c: c.out(c.b.cast(c.ints("x", (9,), 1000, -1000), dtype="f32")))

# -- reductions ---------------------------------------------------------------------------
for _dt in (F32, F16, BF16):
    case(f"rmsnorm_w_{_dt}", T=3)(lambda c, dt=_dt: c.out(c.b.rmsnorm(c.x("x", ("T", 2, 37)), c.w("w", (37,), dt), eps=1e-6)))
case("rmsnorm_w_vector_rows", T=3)(  # rows of whole 16-wide vectors: the CPU's work-item per row
    lambda c: c.out(c.b.rmsnorm(c.x("x", ("T", 2, 96)), c.w("w", (96,), F32), eps=1e-6)))
case("rmsnorm_one_row_no_weight")(lambda c: c.out(c.b.rmsnorm(c.x("x", (1, 1000)), eps=1e-5)))
case("l2norm", T=5)(lambda c: c.out(c.b.l2norm(c.x("x", ("T", 3, 16)), eps=1e-6)))
case("softmax_last", T=3)(lambda c: c.out(c.b.softmax(c.x("x", ("T", 300), scale=5.0), axis=-1)))
case("softmax_axis0")(lambda c: c.out(c.b.softmax(c.x("x", (7, 3, 5)), axis=0)))
case("argmax_ties")(lambda c: c.out(c.b.argmax(c.b.cast(c.b.cast(c.x("x", (4, 1000), scale=3.0), dtype="i32"), dtype="f32"))))
case("argmax_one_row")(lambda c: c.out(c.b.argmax(c.x("x", (1, 70000)))))


@case("argmax_lane_ties_and_tail")
def _argmax_lanes(c: CaseBuilder) -> None:
    """Rows of 53 (three whole 16-lane vectors and a tail): a maximum tied in two lanes and
    the tail (the first wins: 5), a row of -inf (0), a maximum in the tail alone (52)."""
    x = np.full((3, 53), -1.0, np.float32)
    x[0, [20, 5, 50]] = 7.0
    x[1] = -np.inf
    x[2, 52] = 9.0
    c.inputs["x"] = x
    c.out(c.b.argmax(c.b.input("x", F32, (3, 53))))
case("topk_ties", T=6)(lambda c: c.out(*c.b.topk(c.b.cast(c.b.cast(c.x("x", ("T", 10), scale=2.0), dtype="i32"),
                                                               dtype="f32"), k=4)))
case("topk_experts", T=3)(lambda c: c.out(*c.b.topk(c.b.softmax(c.x("x", ("T", 64)), axis=-1), k=8)))
case("sum_last_keepdims", T=5)(lambda c: c.out(c.b.sum(c.x("x", ("T", 2)), axis=-1, keepdims=True)))
case("sum_middle", T=5)(lambda c: c.out(c.b.sum(c.x("x", ("T", 3, 64)), axis=1)))
case("sum_i32")(lambda c: c.out(c.b.sum(c.ints("x", (4, 9), 100, -100), axis=0)))

# -- weights: dequantize, embedding, matmul -------------------------------------------------
for _dt in (F16, BF16, Q8):
    case(f"dequantize_{_dt}")(lambda c, dt=_dt: c.out(c.b.dequantize(c.w("w", (3, 4, 64), dt))))
for _dt in (F32, F16, BF16, Q8):
    case(f"embedding_{_dt}", T=6)(lambda c, dt=_dt: c.out(c.b.embedding(c.w("table", (50, 64), dt), c.ints("ids", ("T",), 50))))
for _dt in (F32, F16, BF16, Q8):
    for _rows in (1, 5, 16, 40):
        case(f"matmul_{_dt}_{_rows}_rows", T=_rows)(
            lambda c, dt=_dt: c.out(c.b.matmul(c.x("x", ("T", 96)), c.w("w", (70, 96), dt))))
case("matmul_fixed_one_row")(lambda c: c.out(c.b.matmul(c.x("x", (1, 64)), c.w("w", (33, 64), Q8))))
for _t in (3, 20):  # 6 rows (GEMV) and 40 rows (GEMM), K not a multiple of its tile
    case(f"matmul_rank3_odd_k_T{_t}", T=_t)(lambda c: c.out(c.b.matmul(c.x("x", ("T", 2, 37)), c.w("w", (19, 37)))))
case("matmul_dequantized_weight", T=3)(  # the dequantize runs once, at load (a constant step)
    lambda c: c.out(c.b.matmul(c.x("x", ("T", 64)), c.b.dequantize(c.w("w", (24, 64), Q8)))))
for _rows in (1, 6):  # K = 34 Q8_0 blocks: two runs of 16 scales converted at once, then a tail of two
    case(f"matmul_q8_0_scale_runs_{_rows}_rows", T=_rows)(
        lambda c: c.out(c.b.matmul(c.x("x", ("T", 1088)), c.w("w", (40, 1088), Q8))))
case("matmul_vector")(lambda c: c.out(c.b.matmul(c.x("x", (64,)), c.w("w", (5, 64), F16))))


def _specialised(op: str, dtype: DType, form: str, residual: bool, q8: bool = False, k: int = 128, n: int = 48):
    """q8: x quantised to Q8_0 first (the q8 numerics mode's integer products)."""
    def make(c: CaseBuilder) -> None:
        x = c.x("x", ("T", k))
        extra = [c.x("r", ("T", n))] if residual else []
        c.out(c.b.op(op, c.b.op("quantize_q8_0", x) if q8 else x, c.w("w", (n, k), dtype), *extra, form=form,
                     K=k, N=n, layout=f"{dtype}_rowmajor"))
    return make


for _form, _t in (("gemv", 1), ("gemv", 3), ("gemv", 20), ("gemm", 37), ("gemm", 5)):  # a GEMV serves any rows
    case(f"matmul_q8_0_{_t}_rows", T=_t)(_specialised("matmul_q8_0", Q8, _form, residual=_t == 3))
    case(f"matmul_q8_0_q8_x_{_t}_rows", T=_t)(_specialised("matmul_q8_0", Q8, _form, _t == 20, q8=True))
    case(f"matmul_f16_residual_{_t}_rows", T=_t)(_specialised("matmul_f16", F16, _form, residual=True))
for _t in (1, 6):  # K = 34 blocks: scale runs of 16 and a tail of two, Q8_0 x Q8_0
    case(f"matmul_q8_0_q8_x_scale_runs_{_t}_rows", T=_t)(_specialised("matmul_q8_0", Q8, "gemv", False, True, 1088))
# 19 groups of 16 outputs: the CPU tiles' work-groups of 2 leave one work-item without a group,
# which still shares the barriers around the block sums of x (the VNNI tiles')
case("matmul_q8_0_q8_x_idle_work_item", T=20)(_specialised("matmul_q8_0", Q8, "gemv", False, True, 64, 19 * 16))
# 8 groups of 16 outputs: every tile's groups per work-item (4, 2, 1) divide them, so no
# work-item's groups are clamped to the last (linalg.clamp_to_last)
case("matmul_q8_0_q8_x_whole_groups_1_rows", T=1)(_specialised("matmul_q8_0", Q8, "gemv", False, True, 64, 128))
case("quantize_q8_0_block_runs", T=2)(  # 40 blocks a row: on the CPU a run of 32 and one of 8
    lambda c: c.out(c.b.op("quantize_q8_0", c.x("x", ("T", 1280), scale=4.0))))
case("quantize_q8_0", T=5)(lambda c: c.out(c.b.op("quantize_q8_0", c.x("x", ("T", 3, 96), scale=4.0))))


@case("quantize_q8_0_norm", T=5)
def _quantize_normed(c: CaseBuilder) -> None:
    """x on a grid of 1/8 (its squares sum exactly in any order), so the kernel's row RMS has
    the interpreter's bits and the quants compare exactly."""
    x = c.x("x", ("T", 2, 96), scale=2.0)
    c.inputs["x"] = np.round(c.inputs["x"] * 8) / 8
    c.out(c.b.op("quantize_q8_0", x, c.w("norm", (96,), F32), norm_eps=1e-6))


for _dt, _t, _q8 in ((Q8, 1, False), (Q8, 5, False), (F16, 3, False), (Q8, 4, True)):  # q/k/v-like: 24 + 8 + 36
    case(f"matmul_group_{_dt}_{_t}_rows{'_q8_x' if _q8 else ''}", T=_t)(lambda c, dt=_dt, q8=_q8: c.out(
        *c.b.matmul_group(c.b.op("quantize_q8_0", c.x("x", ("T", 64))) if q8 else c.x("x", ("T", 64)),
                          *(c.w(f"w{i}", (n, 64), dt) for i, n in enumerate((24, 8, 36))), op=OPS[dt],
                          form="gemv", K=64, Ns=(24, 8, 36), layout=f"{dt}_rowmajor")))


# every block decoder in the matmul kernels: N ragged (19), K two blocks of 256 or 32 ... 320,
# rows 1, 3, 16 (GEMV) and 37 (GEMM) in turn; a K-quant table through embedding and dequantize
for _i, _dt in enumerate(DECODERS):
    _t = (1, 3, 16, 37)[_i % 4]
    case(f"matmul_{_dt}_{_t}_rows", T=_t)(_specialised(OPS[_dt], _dt, "gemv" if _t <= 16 else "gemm", residual=_i == 1,
                                                       k=2 * _dt.block_size if _dt.block_size > 32 else 320, n=19))
# Q8_0 x (the q8 numerics mode) times every other type of quant.Q8_X_TYPES: integer block sums
for _dt, _t in zip(Q8_X_TYPES[1:], (1, 3, 20, 37, 2, 16, 5, 1, 9)):
    case(f"matmul_{_dt}_q8_x_{_t}_rows", T=_t)(_specialised(OPS[_dt], _dt, "gemv" if _t <= 16 else "gemm",
                                                            residual=_t == 3, q8=True, k=max(96, 2 * _dt.block_size), n=19))
case("matmul_group_q4_1_2_rows_q8_x", T=2)(lambda c: c.out(*c.b.matmul_group(
    c.b.op("quantize_q8_0", c.x("x", ("T", 64))), *(c.w(f"w{i}", (n, 64), DType.Q4_1) for i, n in enumerate((24, 8))),
    op=OPS[DType.Q4_1], form="gemv", K=64, Ns=(24, 8), layout="q4_1_rowmajor")))
case("embedding_q6_k", T=5)(lambda c: c.out(c.b.embedding(c.w("table", (7, 256), DType.Q6_K), c.ints("ids", ("T",), 7))))
case("dequantize_q4_k")(lambda c: c.out(c.b.dequantize(c.w("w", (3, 512), DType.Q4_K))))


def _fused_matmul(dtype: DType, widths: tuple[int, ...], norm: bool, epilogue: str, q8: bool = False, k: int = 96,
                  form: str = "gemv", rows: int | str = "T"):
    """Products with the norm before and the SwiGLU after (ragged widths: groups of 16 padded);
    `rows` a number fixes the row count (a decode's product: one row)."""
    def make(c: CaseBuilder) -> None:
        x = c.x("x", (rows, k))
        operands = ([c.w("norm", (k,), F32)] if norm else []) + [c.w(f"w{i}", (n, k), dtype) for i, n in enumerate(widths)]
        out = c.b.op("fused_matmul", c.b.op("quantize_q8_0", x) if q8 else x, *operands, op=OPS[dtype], form=form,
                     K=k, Ns=widths, layout=f"{dtype}_rowmajor", norm_eps=1e-6 if norm else None, epilogue=epilogue)
        c.out(*(out if isinstance(out, tuple) else (out,)))
    return make


for _t in (1, 3, 9):  # the CPU tiles' row buckets: 1, up to 4, past 8
    case(f"fused_matmul_norm_group_{_t}_rows", T=_t)(_fused_matmul(Q8, (24, 8, 36), True, "none"))
    case(f"fused_matmul_norm_swiglu_{_t}_rows", T=_t)(_fused_matmul(Q8, (40, 40), True, "swiglu"))
case("fused_matmul_norm_one_f16", T=2)(_fused_matmul(F16, (20,), True, "none"))
# block types in the CPU tiles, each in another row bucket (1, up to 4, a walk past 16)
for _dt, _t in ((DType.Q4_K, 1), (DType.Q6_K, 3), (DType.Q3_K, 20)):
    _k = 2 * _dt.block_size if _dt.block_size > 32 else 96
    case(f"fused_matmul_norm_group_{_dt}_{_t}_rows", T=_t)(_fused_matmul(_dt, (24, 8, 36), True, "none", k=_k))
    case(f"fused_matmul_norm_swiglu_{_dt}_{_t}_rows", T=_t)(_fused_matmul(_dt, (40, 40), True, "swiglu", k=_k))
# a decode's product (one row, fixed): the CPU tile unrolls the block (lowering.BLOCK_SPAN)
case("fused_matmul_norm_swiglu_q4_k_decode")(_fused_matmul(DType.Q4_K, (40, 40), True, "swiglu", k=512, rows=1))
case("fused_matmul_norm_swiglu_gemm", T=21)(_fused_matmul(Q8, (40, 40), True, "swiglu", form="gemm"))
case("fused_matmul_swiglu_q8_x", T=5)(_fused_matmul(Q8, (48, 48), False, "swiglu", q8=True))
case("fused_matmul_swiglu_q5_0_q8_x", T=9)(_fused_matmul(DType.Q5_0, (40, 40), False, "swiglu", q8=True))
# a decode's q8 products over K-quants: one unit a work-item, the runs unrolled (linalg.BLOCK_ROW_GROUPS)
case("fused_matmul_swiglu_q4_k_q8_x_decode")(_fused_matmul(DType.Q4_K, (40, 40), False, "swiglu", q8=True, k=512,
                                                            rows=1))
# swiglu_q8: the SwiGLU's Q8_0 blocks written by the product (CPU tiles: through work-group memory)
case("fused_matmul_swiglu_quantised_q8_x_decode")(_fused_matmul(Q8, (64, 64), False, "swiglu_q8", q8=True, rows=1))
case("fused_matmul_swiglu_quantised_q8_x_verify", T=5)(_fused_matmul(Q8, (96, 96), False, "swiglu_q8", q8=True))
case("fused_matmul_swiglu_quantised_q8_x_last_group_partial", T=3)(
    _fused_matmul(Q8, (800, 800), False, "swiglu_q8", q8=True))
case("fused_matmul_swiglu_quantised_q4_k_q8_x_decode")(
    _fused_matmul(DType.Q4_K, (160, 160), False, "swiglu_q8", q8=True, k=512, rows=1))
case("fused_matmul_swiglu_quantised_q6_k_q8_x", T=9)(
    _fused_matmul(DType.Q6_K, (96, 96), False, "swiglu_q8", q8=True, k=256))
case("fused_matmul_group_q6_k_q8_x_decode")(_fused_matmul(DType.Q6_K, (24, 8, 36), False, "none", q8=True, k=512,
                                                           rows=1))
case("fused_matmul_group_q5_k_q8_x_decode")(_fused_matmul(DType.Q5_K, (24, 8, 36), False, "none", q8=True, k=512,
                                                           rows=1))
for _dt in (F16, Q8):
    case(f"expert_matmul_{_dt}", T=5)(lambda c, dt=_dt: c.out(c.b.expert_matmul(
        c.x("x", ("T", 64)), c.w("w", (6, 24, 64), dt), c.ints("ids", ("T", 2), 6))))
case("expert_matmul_q4_0", T=5)(lambda c: c.out(c.b.expert_matmul(
    c.x("x", ("T", 64)), c.w("w", (6, 40, 64), DType.Q4_0), c.ints("ids", ("T", 2), 6))))
case("expert_matmul_per_slot", T=3)(lambda c: c.out(c.b.expert_matmul(
    c.x("x", ("T", 2, 32)), c.w("w", (4, 64, 32), Q8), c.ints("ids", ("T", 2), 4))))
for _dt in (Q8, DType.Q4_0):  # Q8_0 x (the q8 numerics), per row and per slot (K-quants: fused_moe's case)
    case(f"expert_matmul_{_dt}_q8_x", T=5)(lambda c, dt=_dt: c.out(c.b.expert_matmul(
        c.b.op("quantize_q8_0", c.x("x", ("T", 256))), c.w("w", (6, 24, 256), dt), c.ints("ids", ("T", 2), 6))))
case("expert_matmul_per_slot_q8_x", T=3)(lambda c: c.out(c.b.expert_matmul(
    c.b.op("quantize_q8_0", c.x("x", ("T", 2, 64))), c.w("w", (4, 40, 64), DType.Q4_1), c.ints("ids", ("T", 2), 4))))
# 37 rows: three chunks of the CPU tiles, each expert chosen by many rows (tiles of 4, 2 and 1 rows)
case("expert_matmul_q8_0_shared_experts", T=37)(lambda c: c.out(c.b.expert_matmul(
    c.x("x", ("T", 64)), c.w("w", (3, 40, 64), Q8), c.ints("ids", ("T", 2), 3))))

# -- rope ---------------------------------------------------------------------------------
case("rope_partial", T=5)(lambda c: c.out(c.b.rope(c.x("x", ("T", 3, 32)), c.ints("pos", ("T",), 20000),
                                                     n_rot=16, theta=1e7)))
case("rope_sections", T=4)(lambda c: c.out(c.b.rope(c.x("x", ("T", 2, 32)), c.ints("pos", ("T", 4), 500),
                                                      n_rot=24, theta=1e4, sections=(6, 3, 3))))
case("rope_adjacent_partial", T=3)(lambda c: c.out(c.b.rope(c.x("x", ("T", 2, 32)), c.ints("pos", ("T",), 9000),
                                                              n_rot=24, theta=1e4, pairs="adjacent")))
case("rope_freq_factors", T=3)(lambda c: c.out(c.b.rope(c.x("x", ("T", 2, 16)), c.ints("pos", ("T",), 5000),
                                                          n_rot=16, theta=5e5, pairs="adjacent",
                                                          freq_factors=(1.0, 1.0, 1.5, 3.25, 8.0, 8.0, 8.0, 8.0))))
case("rope_interleaved", T=4)(lambda c: c.out(c.b.rope(c.x("x", ("T", 2, 32)), c.ints("pos", ("T",), 4000),
                                                         n_rot=8, theta=1e7, sections=(2, 1, 1, 0), interleaved=True)))


# -- attention and caches -------------------------------------------------------------------
def _attention(hq: int, hkv: int, t: int, kv_len: int, cap: int, d: int = 32, dv: int = 32, **attrs):
    def make(c: CaseBuilder) -> None:
        q, k, v = c.x("q", ("T", hq, d)), c.x("k", ("C", hkv, d)), c.x("v", ("C", hkv, dv))
        c.out(c.b.attention(q, k, v, c.scalar("kv_len", kv_len), scale=d ** -0.5, **attrs))
    return case(f"attention_{'_'.join(f'{k}{v}' for k, v in attrs.items())}_gqa{hq // hkv}_T{t}_kv{kv_len}",
                T=t, C=cap)(make)


_attention(4, 4, 5, 9, 16, causal=True)
_attention(4, 2, 1, 150, 200, causal=True, d=64, dv=40)
_attention(8, 2, 16, 20, 40, causal=False)
_attention(2, 1, 7, 140, 150, causal=True, window=70)


def _kv_write(c: CaseBuilder, also_read_old: bool) -> None:
    cache = c.s("cache", ("C", 2, 8))
    new = c.b.kv_write(cache, c.x("new", ("T", 2, 8)), c.scalar("pos", 3))
    c.b.update_state(cache, new)
    c.out(c.b.sum(cache, axis=0) if also_read_old else c.b.neg(new))


case("kv_write_in_place", T=4, C=10)(lambda c: _kv_write(c, False))
case("kv_write_copy", T=4, C=10)(lambda c: _kv_write(c, True))

# -- Gated DeltaNet -----------------------------------------------------------------------
for _t, _dt in ((1, F32), (5, F16)):
    case(f"causal_conv1d_T{_t}_{_dt}", T=_t)(
        lambda c, dt=_dt: c.out(*c.b.causal_conv1d(c.x("x", ("T", 37)), c.w("w", (37, 4), dt), c.s("state", (3, 37)))))


def _conv_in_place(c: CaseBuilder) -> None:
    state = c.s("state", (3, 37))
    y, new = c.b.causal_conv1d(c.x("x", (1, 37)), c.w("w", (37, 4)), state)
    c.b.update_state(state, new)
    c.out(y)


case("causal_conv1d_T1_in_place")(_conv_in_place)
case("causal_conv1d_silu", T=3)(lambda c: c.out(*c.b.causal_conv1d(
    c.x("x", ("T", 37)), c.w("w", (37, 4)), c.s("state", (3, 37)), activation="silu")))


def _gdn(hk: int, hv: int, dk: int, dv: int, head_map: str, chunk: int, update: bool = False):
    """update: the new state is the state's update (written in place) rather than an output."""
    def make(c: CaseBuilder) -> None:
        q = c.b.l2norm(c.x("q", ("T", hk, dk)), eps=1e-6)
        k = c.b.l2norm(c.x("k", ("T", hk, dk)), eps=1e-6)
        g = c.b.neg(c.b.softplus(c.x("g", ("T", hv))))
        beta = c.b.sigmoid(c.x("beta", ("T", hv)))
        state = c.s("state", (hv, dk, dv))
        _state_outputs(c, state, update, *c.b.gated_delta_rule(
            q, k, c.x("v", ("T", hv, dv)), g, beta, state, scale=dk ** -0.5, head_map=head_map, chunk_size=chunk))
    return make


def _state_outputs(c: CaseBuilder, state: Value, update: bool, o: Value, new: Value) -> None:
    """A recurrence's outputs: the new state as the state's update (written in place) or as an output."""
    if update:
        c.b.update_state(state, new)
        c.out(o)
    else:
        c.out(o, new)


case("gated_delta_rule_tiled", T=5)(_gdn(2, 4, 16, 16, "tiled", 0))
case("gated_delta_rule_grouped_dv40", T=3)(_gdn(1, 3, 32, 40, "grouped", 0))
case("gated_delta_rule_chunked_tail", T=7)(_gdn(2, 2, 16, 16, "tiled", 4))
case("gated_delta_rule_in_place_dv24", T=4)(_gdn(2, 4, 16, 24, "grouped", 0, update=True))
case("gated_delta_rule_in_place_dv20", T=1)(_gdn(1, 2, 16, 20, "tiled", 0, update=True))


def _fused_gdn(hk: int, hv: int, dk: int, dv: int, head_map: str, update: bool):
    """The fused op from a conv output [T, q | k | v]; update as in _gdn."""
    def make(c: CaseBuilder) -> None:
        state = c.s("state", (hv, dk, dv))
        _state_outputs(c, state, update, *c.b.fused_gated_delta_rule(
            c.x("mixed", ("T", 2 * hk * dk + hv * dv)), c.x("a", ("T", hv)), c.x("b", ("T", hv)),
            c.w("dt_bias", (hv,)), c.b.neg(c.b.exp(c.w("a_log", (hv,)))), state, key_heads=hk, eps=1e-6,
            scale=dk ** -0.5, head_map=head_map))
    return make


case("fused_gated_delta_rule_decode_in_place", T=1)(_fused_gdn(2, 4, 16, 16, "tiled", True))
case("fused_gated_delta_rule_grouped", T=4)(_fused_gdn(1, 2, 32, 24, "grouped", False))


def _gdn_layer(hk: int, hv: int, dk: int, dv: int, head_map: str, update: bool, conv_dtype: DType = F32,
               norm_dtype: DType = F32, q8_out: bool = False):
    """The whole layer's op from the conv input [T, q | k | v]; update as in _gdn, for both states;
    `q8_out`: its output quantised by the kernel (the q8 numerics)."""
    def make(c: CaseBuilder) -> None:
        channels = 2 * hk * dk + hv * dv
        conv_state, state = c.s("conv_state", (3, channels)), c.s("state", (hv, dk, dv))
        y, conv_new, new = c.b.fused_gated_deltanet(
            c.x("x", ("T", channels)), c.w("conv_w", (channels, 4), conv_dtype), conv_state, c.x("a", ("T", hv)),
            c.x("b", ("T", hv)), c.w("dt_bias", (hv,)), c.b.neg(c.b.exp(c.w("a_log", (hv,)))), state,
            c.x("z", ("T", hv, dv)), c.w("norm_w", (dv,), norm_dtype), key_heads=hk, eps=1e-6, norm_eps=1e-6,
            scale=dk ** -0.5, head_map=head_map, q8_out=q8_out)
        if update:
            c.b.update_state(conv_state, conv_new)
            _state_outputs(c, state, True, y, new)
        else:
            c.out(y, conv_new, new)
    return make


case("fused_gated_deltanet_decode_in_place", T=1)(_gdn_layer(2, 4, 16, 16, "tiled", True))
case("fused_gated_deltanet_verify_in_place", T=5)(_gdn_layer(2, 4, 16, 16, "tiled", True, F16))
# 3 v heads per k head, dv 24 (a run of 3 CPU work-items per v head: reduced by a tree that is not a power of two)
case("fused_gated_deltanet_grouped_dv24", T=4)(_gdn_layer(1, 3, 32, 24, "grouped", False, BF16, BF16))
# dv 20 and dk 12: no 8-wide CPU schedule, scalar q/k norms
case("fused_gated_deltanet_tiled_dv20_dk12", T=3)(_gdn_layer(2, 4, 12, 20, "tiled", True))
case("fused_gated_deltanet_one_v_head_per_k_head_dv40", T=2)(_gdn_layer(2, 2, 16, 40, "tiled", False))
# 16 v heads of 128 per k head: one CPU work-group of 256, but parts' kernels on a GPU (over 1024 threads)
case("fused_gated_deltanet_wide_k_head", T=2)(_gdn_layer(1, 16, 8, 128, "grouped", True))
# q8_out: each head's row quantised where it is made (one work-item, or the work-group's from its memory)
case("fused_gated_deltanet_q8_out_decode", T=1)(_gdn_layer(2, 4, 16, 32, "tiled", True, q8_out=True))
case("fused_gated_deltanet_q8_out_verify_grouped", T=5)(_gdn_layer(2, 6, 16, 64, "grouped", True, q8_out=True))
case("fused_gated_deltanet_q8_out_wide_k_head", T=2)(_gdn_layer(1, 16, 8, 128, "grouped", True, q8_out=True))

# -- data movement ------------------------------------------------------------------------
case("concat_axis1", T=3)(lambda c: c.out(c.b.concat(c.x("a", ("T", 4)), c.x("b", ("T", 7)), c.x("c", ("T", 1)), axis=1)))
case("concat_axis0")(lambda c: c.out(c.b.concat(c.ints("a", (2, 3), 9), c.ints("b", (4, 3), 9), axis=0)))
case("slice_axis1", T=3)(lambda c: c.out(c.b.slice(c.x("x", ("T", 12, 2)), axis=1, start=3, stop=8)))
case("slice_axis0_to_end")(lambda c: c.out(c.b.slice(c.x("x", (16, 5)), axis=0, start=1)))
case("reshape_view", T=3)(lambda c: c.out(c.b.neg(c.b.reshape(c.x("x", ("T", 12)), shape=("T", 3, 4)))))
case("reshape_output_of_input", T=2)(lambda c: c.out(c.b.reshape(c.x("x", ("T", 6)), shape=("T", 2, 3))))
case("transpose_102", T=3)(lambda c: c.out(c.b.transpose(c.x("x", ("T", 4, 5)), perm=(1, 0, 2))))
case("transpose_201")(lambda c: c.out(c.b.transpose(c.x("x", (2, 3, 5)), perm=(2, 0, 1))))
case("gather_rows", T=6, R=3)(lambda c: c.out(c.b.gather(c.x("x", ("T", 8)), c.ints("idx", ("R",), 6), axis=0)))
case("gather_axis1_2d")(lambda c: c.out(c.b.gather(c.x("x", (3, 9, 2)), c.ints("idx", (2, 2), 9), axis=1)))
case("repeat_tile", T=2)(lambda c: c.out(c.b.repeat(c.x("x", ("T", 3, 4)), axis=1, repeats=3, mode="tile")))
case("repeat_interleave", T=2)(lambda c: c.out(c.b.repeat(c.x("x", ("T", 3, 4)), axis=1, repeats=2, mode="interleave")))


# -- fused ops ------------------------------------------------------------------------------
def _fused_attention(gated: bool, persist: bool, *, hq: int = 4, hkv: int = 2, d: int = 16, dv: int = 16,
                     rows: str | int = "T", pos: int = 6, past: int = 0, n_rot: int = 8, sections: tuple = (),
                     interleaved: bool = False, positions_rank: int = 1, causal: bool | None = None, window: int = 0,
                     read_old: bool = False, prefill: bool = False, pairs: str = "halves", normed: bool = True,
                     freq_factors: tuple = (), q8_out: bool = False):
    """The layer over caches filled to `pos`; `rows` "T" (a verify or block: a symbol) or 1
    (a decode: static); kv_len = pos + T + `past` (cache rows past the new ones, read from the
    cache); M-RoPE with `sections` (positions [T, 4] when `positions_rank` is 2); with
    `read_old` the graph also reads the caches as they were (the layer writes a copy); `prefill`:
    the prefill variant (its new rows written to the caches by a launch of their own); without
    `normed` no q/k norm (llama's layers); `q8_out`: the output quantised by the kernel."""
    def make(c: CaseBuilder) -> None:
        t = c.bindings["T"] if rows == "T" else rows
        q = c.x("q", (rows, hq, d + dv if gated else d))
        k, v = c.x("k", (rows, hkv, d)), c.x("v", (rows, hkv, dv))
        k_cache, v_cache = c.s("k_cache", ("C", hkv, d)), c.s("v_cache", ("C", hkv, dv))
        if positions_rank == 2:
            positions = c.ints("positions", (rows, 4), 4 * pos)
        else:
            c.inputs["positions"] = np.arange(pos, pos + t, dtype=np.int32)
            positions = c.b.input("positions", I32, (rows,))
        norms = (c.w("q_norm", (d,)), c.w("k_norm", (d,))) if normed else ()
        res = c.b.fused_attention(q, k, v, *norms, positions, c.scalar("pos", pos),
                                  c.scalar("kv_len", pos + t + past), k_cache, v_cache, eps=1e-6 if normed else None,
                                  n_rot=n_rot,
                                  theta=1e6, sections=sections, interleaved=interleaved, pairs=pairs,
                                  freq_factors=freq_factors, scale=d ** -0.5,
                                  causal=persist if causal is None else causal, window=window, gated=gated,
                                  persist=persist, variant="prefill" if prefill else "decode" if rows == 1 else "block",
                                  q8_out=q8_out)
        if persist:
            o, k_all, v_all = res
            c.b.update_state(k_cache, k_all)
            c.b.update_state(v_cache, v_all)
            c.out(o, *((c.b.sum(k_cache, axis=0), c.b.sum(v_cache, axis=0)) if read_old else ()))
        else:
            c.out(res)
    return make


case("fused_attention_gated_persist", T=5, C=16)(_fused_attention(True, True))
case("fused_attention_q8_out_decode_gated", C=40)(_fused_attention(True, True, dv=32, rows=1, pos=23, q8_out=True))
case("fused_attention_q8_out_block", T=5, C=16)(_fused_attention(False, False, hq=4, hkv=1, dv=64, q8_out=True))
case("fused_attention_q8_out_prefill_gated", T=18, C=24)(
    _fused_attention(True, True, d=32, dv=32, pos=2, prefill=True, q8_out=True))
case("fused_attention_block", T=4, C=12)(_fused_attention(False, False))
case("fused_attention_decode_gqa2", C=40)(_fused_attention(True, True, rows=1, pos=23))
case("fused_attention_decode_gqa1_full_rotary", C=12)(_fused_attention(False, True, hq=2, hkv=2, rows=1, n_rot=16))
case("fused_attention_two_tiles_gqa4_dv24", T=20, C=48)(  # more rows than a CPU tile holds
    _fused_attention(True, True, hq=8, hkv=2, dv=24, pos=9, sections=(2, 1, 1, 0), interleaved=True))
case("fused_attention_window_sections_d40", T=6, C=40)(
    _fused_attention(False, True, d=40, dv=40, pos=30, n_rot=12, sections=(2, 2, 2), positions_rank=2, window=9))
case("fused_attention_block_cache_past_new_rows", T=4, C=20)(  # keys on both sides of the new rows
    _fused_attention(True, False, hq=6, hkv=3, pos=5, past=7))
case("fused_attention_adjacent_pairs", T=3, C=16)(_fused_attention(False, True, pos=4, n_rot=12, pairs="adjacent"))
case("fused_attention_decode_adjacent_pairs", C=16)(_fused_attention(True, True, rows=1, pos=9, pairs="adjacent"))
# llama's layer: no q/k norms, adjacent pairs, RoPE over the whole head
case("fused_attention_no_norms", T=5, C=16)(_fused_attention(False, True, hq=6, hkv=2, n_rot=16, pairs="adjacent",
                                                             normed=False))
case("fused_attention_decode_no_norms", C=16)(_fused_attention(False, True, rows=1, pos=9, n_rot=16, pairs="adjacent",
                                                               normed=False))
case("fused_attention_prefill_no_norms", T=18, C=24)(_fused_attention(False, True, pos=2, n_rot=16, pairs="adjacent",
                                                                      normed=False, prefill=True))
case("fused_attention_llama3_rope", T=4, C=16)(_fused_attention(  # Llama 3.1's layer: rope_freqs.weight
    False, True, hq=4, hkv=1, n_rot=16, pairs="adjacent", normed=False, freq_factors=(1.0, 1.25, 2.0, 4.0, 8.0, 8.0, 8.0, 8.0)))
case("fused_attention_block_no_norms", T=4, C=12)(_fused_attention(False, False, n_rot=16, pairs="adjacent",
                                                                   normed=False))
case("fused_attention_persist_copy", T=3, C=12)(_fused_attention(False, True, read_old=True))
case("fused_attention_prefill_gated_gqa4", T=21, C=40)(_fused_attention(True, True, hq=8, hkv=2, pos=3, prefill=True))
case("fused_attention_prefill_window_copy", T=9, C=24)(
    _fused_attention(False, True, pos=4, window=5, read_old=True, prefill=True))


def _fused_moe(e: int, k: int, f: int, fs: int, w: int = 64, router: DType = F16, gate_2d: bool = False,
               ties: bool = False, dt: DType = Q8, down_dt: DType | None = None, tokens: int | str = "T",
               q8: bool = False):
    """A MoE block: e experts of width f (shared expert fs), top-k, expert weights `dt` (the
    down projections `down_dt`, default the same), x of `tokens` rows (1: a decode's). `ties`:
    integer x and router rows, each repeated (expert i + e/2 = expert i), so logits tie exactly
    and top-k keeps the lower index first; `gate_2d`: the shared expert's gate weight as [1, H];
    `q8`: the products take x in Q8_0 (the q8 numerics' `xq`)."""
    def make(c: CaseBuilder) -> None:
        x, router_w = c.x("x", (tokens, w)), c.w("router", (e, w), router)
        if ties:
            c.inputs["x"] = c.rng.integers(-2, 3, c.inputs["x"].shape).astype(np.float32)
            rows = c.rng.integers(-1, 2, (e // 2, w)).astype(np.float32)
            c.weights["router"] = quantize(np.concatenate([rows, rows]), router)
        c.out(c.b.fused_moe(x, router_w, c.w("gate_exps", (e, f, w), dt), c.w("up_exps", (e, f, w), dt),
                            c.w("down_exps", (e, w, f), down_dt or dt), c.w("sh_gate", (fs, w), dt),
                            c.w("sh_up", (fs, w), dt), c.w("sh_down", (w, fs), down_dt or dt),
                            c.w("sh_gate_inp", (1, w) if gate_2d else (w,)),
                            *([c.b.op("quantize_q8_0", x)] if q8 else []), k=k))
    return make


case("fused_moe", T=5)(_fused_moe(8, 3, 32, 32))
case("fused_moe_ties", T=6)(_fused_moe(8, 3, 32, 64, router=F32, gate_2d=True, ties=True))
case("fused_moe_k1", T=5)(_fused_moe(4, 1, 32, 32, gate_2d=True))
for _t in (1, 16):  # the 35B-A3B's routing: top-8 of many experts
    case(f"fused_moe_top8_of_64_T{_t}", T=_t)(_fused_moe(64, 8, 32, 64, router=F32))
# ragged: expert and shared widths differ, 6 groups of outputs (not a multiple of a work-item's units)
case("fused_moe_ragged", T=5)(_fused_moe(6, 2, 96, 32, w=96, router=BF16))
# 37 rows of 4 experts, top-2: three chunks, every expert chosen by many rows
case("fused_moe_many_rows", T=37)(_fused_moe(4, 2, 32, 32))
case("fused_moe_mxfp4", T=5)(_fused_moe(4, 2, 32, 32, dt=DType.MXFP4))  # MXFP4 experts, as MoE uploads ship them
case("fused_moe_f16_experts", T=5)(_fused_moe(8, 3, 32, 32, dt=F16))  # no fused kernel: the parts' kernels
# llama-quantize's Q4_K_M banks: Q4_K gate/up, Q6_K down (the CPU tiles decode each); a 32-block type, ragged
case("fused_moe_q4_k_m", T=6)(_fused_moe(4, 2, 256, 256, w=256, router=F32, dt=DType.Q4_K, down_dt=DType.Q6_K))
# a decode's (one row, fixed): the one-row expert tiles unroll the block (lowering.BLOCK_SPAN)
case("fused_moe_q4_k_m_decode")(_fused_moe(4, 2, 256, 256, w=256, router=F32, dt=DType.Q4_K, down_dt=DType.Q6_K,
                                           tokens=1))
case("fused_moe_q5_1_ragged", T=9)(_fused_moe(6, 2, 96, 32, w=96, dt=DType.Q5_1))
# the q8 numerics: Q8_0 x for gate/up, each SwiGLU block quantised for down
# (a few cases: lavapipe takes a minute or more to build each of these kernels on a cold cache)
case("fused_moe_q8_x", T=5)(_fused_moe(8, 3, 32, 32, q8=True))
case("fused_moe_ragged_q8_x", T=5)(_fused_moe(6, 2, 96, 32, w=96, router=BF16, q8=True))
case("fused_moe_q4_k_m_q8_x_decode")(_fused_moe(4, 2, 256, 256, w=256, router=F32, dt=DType.Q4_K,
                                                down_dt=DType.Q6_K, tokens=1, q8=True))


# -- running ------------------------------------------------------------------------------
def case_graph(c: CaseBuilder) -> Graph:
    return c.b.build()


def compare(backend, name: str, work_dir: Path, seed: int = 0, tol: float = TOL) -> float:
    """Run case `name` on `backend` and the interpreter; returns the worst relative error
    (max |diff| / max |reference| over float outputs and states), raising AssertionError
    past `tol` or on any mismatch of integers or f16 casts."""
    spec = CASES[name]
    c = spec.build(seed)
    graph = case_graph(c)

    def loader(w):
        return c.weights[w.tensor]

    entry = backend.compile(graph, work_dir)
    program = backend.load(graph, entry, work_dir, loader)
    got = program.run(c.inputs, c.states)
    want = Interpreter(graph, loader).run(c.inputs, c.states)
    types = {v.name: v.type for n in graph.nodes for v in n.outputs}
    q8 = {out for out, value in graph.outputs if value in types and types[value].dtype is Q8}
    worst = 0.0
    for kind, ours, ref in (("output", got.outputs, want.outputs), ("state", got.states, want.states)):
        assert ours.keys() == ref.keys(), f"{name}: {kind}s {sorted(ours)} != {sorted(ref)}"
        for key in ref:
            a, b = np.asarray(ours[key]), np.asarray(ref[key])
            assert a.shape == b.shape and a.dtype == b.dtype, f"{name}: {kind} {key} is {a.dtype}{a.shape}, want {b.dtype}{b.shape}"
            if key in q8:
                _assert_q8_blocks(name, key, a, b)
                continue
            if b.dtype.kind in "iub" or b.dtype == np.float16:  # indices, casts: exact
                assert np.array_equal(a, b), f"{name}: {kind} {key} differs: {a} vs {b}"
                continue
            scale = float(np.abs(b).max()) if b.size else 0.0
            err = float(np.abs(a.astype(np.float64) - b).max()) / scale if scale else float(np.abs(a).max(initial=0))
            assert err <= tol, f"{name}: {kind} {key}: max error {err:.3g} x max|ref| > {tol}"
            worst = max(worst, err)
    return worst


def _assert_q8_blocks(name: str, key: str, ours: np.ndarray, ref: np.ndarray) -> None:
    """Q8_0 blocks that a kernel made of values it computed in its own order (equal to the
    reference's within the f32 contract): each value within one quant step of the reference's,
    and no more than 1% of the quants a step off (rounding ties the f32 differences tip)."""
    a, b = (dequantize(x, Q8).astype(np.float64) for x in (ours, ref))
    scales = ref.reshape(-1, Q8.block_bytes)[:, :2].copy().view(np.float16).astype(np.float64)
    step = np.repeat(scales, Q8.block_size, axis=1).reshape(b.shape)
    off = np.abs(a - b) > step * 1e-3
    assert np.all(np.abs(a - b) <= step * (1 + 2 ** -10) + 1e-30), f"{name}: output {key} is more than a quant step off"
    assert off.mean() <= 0.01, f"{name}: output {key}: {off.mean():.1%} of its quants are a step off"


def main(argv: list[str]) -> int:
    from dflash_ir.backends.base import get_backend

    if not argv:
        print("usage: python tests/kernel_cases.py BACKEND [NAME-SUBSTRING]", file=sys.stderr)
        return 2
    backend = get_backend(argv[0])
    backend.require()
    print(f"{argv[0]} on {backend.device_description()}")
    names = [n for n in CASES if len(argv) < 2 or argv[1] in n]
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(os.cpu_count()) as pool:
        # compile every case up front, in parallel: device compilers cache what they built
        list(pool.map(lambda n: backend.compile(case_graph(CASES[n].build()), Path(tmp) / n), names))
    failed = 0
    for name in names:
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            try:
                err = compare(backend, name, Path(tmp))
                print(f"  ok    {name:48s} max err {err:.1e}  ({time.perf_counter() - t0:.2f}s)")
            except Exception as e:  # report every case, then fail
                failed += 1
                print(f"  FAIL  {name:48s} {type(e).__name__}: {e}")
    print(f"{failed} failed" if failed else "all passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
