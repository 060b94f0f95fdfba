"""specialise_q8_0: matmul(x, dequantize(W)) -> matmul_q8_0(x, W) (and matmul_f16 for F16 W).

The specialised op reads the weight's stored blocks directly, so no f32 copy of a weight
is ever made. Its attrs fix the kernel: `form` is "gemv" for a few rows (a static row
count <= 16, or symbolic rows in a verify, draft block or decode graph, whose rows are at
most a speculative block) and "gemm" otherwise; K and N are baked in; `layout` names the
weight layout a backend packs; `act_quant` (Q8_0 only, off unless asked for) quantises
activations to Q8_0 as llama.cpp does (see dflash_ir.ops.specialised for its accuracy).
"""
from __future__ import annotations

import math
from functools import partial

from dflash_ir.dtypes import DType
from dflash_ir.ir import Graph
from dflash_ir.ops.specialised import LAYOUTS, OPS
from dflash_ir.rewrite import P, Rule, V, rewrite

GEMV_ROWS = 16
GEMV_KINDS = ("verify", "block", "decode")


def form(x_shape, kind: str | None) -> str:
    rows = x_shape[:-1]
    if all(isinstance(d, int) for d in rows):
        return "gemv" if math.prod(rows) <= GEMV_ROWS else "gemm"
    return "gemv" if kind in GEMV_KINDS else "gemm"


def _specialise(m, emit, *, act_quant: bool):
    w = m["w"]
    dtype = w.type.dtype
    return emit.op(OPS[dtype], m["x"], w, form=form(m["x"].type.shape, emit.meta.get("kind")),
                   K=w.type.shape[1], N=w.type.shape[0], layout=LAYOUTS[dtype],
                   act_quant=act_quant and dtype is DType.Q8_0)


_MATMUL = P("matmul", V("x"), P("dequantize", V("w", kind="weight", dtype=tuple(OPS))))


def rules(act_quant: bool = False) -> list[Rule]:
    return [Rule("specialise", _MATMUL, partial(_specialise, act_quant=act_quant))]


def specialise_q8_0(graph: Graph, *, act_quant: bool = False) -> Graph:
    return rewrite(graph, rules(act_quant), name="specialise_q8_0")
