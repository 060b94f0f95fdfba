"""quantize_activations: Q8_0 products take Q8_0 activations (the `q8` numerics mode).

Every `matmul_q8_0` and Q8_0 `matmul_group` whose x is f32 reads `quantize_q8_0(x)`
instead, as llama.cpp's CPU path does: its products become exact integer block sums
scaled by both blocks' scales (dflash_ir/ops/specialised.py). One x is quantised once
however many products read it (identical nodes are shared by the rewrite engine).
Under `exact` numerics (the default) this pass does not run.
"""
from __future__ import annotations

from dflash_ir.dtypes import DType
from dflash_ir.ir import Graph
from dflash_ir.rewrite import P, Rule, rewrite

NUMERICS = ("exact", "q8")


def _quantized(m, emit):
    node = m.root
    x, *rest = (emit.value(name) for name in node.inputs)
    if x.type.dtype is not DType.F32 or node.attr.get("op", "matmul_q8_0") != "matmul_q8_0":
        return None
    outs = emit.op(node.op, emit.op("quantize_q8_0", x), *rest, **node.attr)
    return dict(zip(node.outputs, outs if isinstance(outs, tuple) else (outs,)))


# (any inputs: a product's x is its first, the weights and residual follow)
RULES = [Rule("quantize", P(("matmul_q8_0", "matmul_group"), output=None), _quantized)]


def quantize_activations(graph: Graph) -> Graph:
    return rewrite(graph, RULES, name="quantize_activations")
