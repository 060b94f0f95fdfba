"""specialise_matmul: matmul(x, dequantize(W)) -> matmul_<type>(x, W) for a weight stored as
F16 or any block type (matmul_q8_0, matmul_q4_k, ...: ops/specialised.py OPS).

The specialised op reads the weight as stored (block types through their decoder,
dflash_ir/blocks.py), so no f32 copy of a weight is ever made. Its attrs fix the kernel: `form` is "gemv" for a few rows (a static row
count <= 16, or any rows of a verify, draft block or decode graph, whose rows are at most a
speculative block per sequence: a batched verify's stacked blocks take the GEMV too, so a
row's sums are the ones it gets in a lone verify) and "gemm" otherwise; K and N are baked in; `layout` names the
weight layout a backend packs. Quantised activations are a separate pass
(quantize_activations, the `q8` numerics mode).
"""
from __future__ import annotations

import math
from dflash_ir.ir import Graph
from dflash_ir.ops.specialised import LAYOUTS, OPS
from dflash_ir.rewrite import P, Rule, V, rewrite

GEMV_ROWS = 16
GEMV_KINDS = ("verify", "block", "decode")


def form(x_shape, kind: str | None) -> str:
    if kind in GEMV_KINDS:  # a batched verify's stacked blocks too: a row sums as it would alone
        return "gemv"
    rows = x_shape[:-1]
    return "gemv" if all(isinstance(d, int) for d in rows) and math.prod(rows) <= GEMV_ROWS else "gemm"


def _specialise(m, emit):
    w = m["w"]
    dtype = w.type.dtype
    return emit.op(OPS[dtype], m["x"], w, form=form(m["x"].type.shape, emit.meta.get("kind")),
                   K=w.type.shape[1], N=w.type.shape[0], layout=LAYOUTS[dtype])


_MATMUL = P("matmul", V("x"), P("dequantize", V("w", kind="weight", dtype=tuple(OPS))))
RULES = [Rule("specialise", _MATMUL, _specialise)]


def specialise_matmul(graph: Graph) -> Graph:
    return rewrite(graph, RULES, name="specialise_matmul")
