"""quantize_activations: products over weights of quant.Q8_X_TYPES (Q8_0, Q4_0, Q4_1, Q5_0,
Q5_1 and the K-quants: integer codes in sub-blocks that fit a 32-element activation block)
take Q8_0 activations (the `q8` numerics mode).

Every such `matmul_<type>` and `matmul_group` whose x is f32 reads `quantize_q8_0(x)`
instead, as llama.cpp's CPU path does for the first five: its products become exact integer
sums per sub-block scaled by both scales (dflash_ir/ops/specialised.py). llama.cpp quantises
the K-quants' activations to Q8_K (one scale per 256); Q8_0 is the finer choice. The codebook
types (IQ4_NL, IQ4_XS, MXFP4) keep f32 activations. A `fused_moe` whose six expert and
shared-expert weights all have Q8_0-x products takes quantize_q8_0(x) as its `xq` (they then
quantise each SwiGLU for down too; the router and the shared gate keep x). One x is quantised
once however many products read it (identical nodes are shared by the rewrite engine).
A layer core's output that is quantised for its output projection is quantised by the core
(`q8_out`): fused_attention's, and fused_gated_deltanet's (its rows flattened), where every
head's row is whole Q8_0 blocks, so the kernel that makes a head's row also writes its blocks
and no launch of its own quantises them. Under `exact` numerics (the default) this pass does
not run.
"""
from __future__ import annotations

import math

from dflash_ir.dtypes import DType
from dflash_ir.ir import Graph
from dflash_ir.ops.specialised import OPS
from dflash_ir.quant import Q8_X_TYPES
from dflash_ir.rewrite import P, Rule, rewrite

NUMERICS = ("exact", "q8")
PRODUCTS = tuple(OPS[d] for d in Q8_X_TYPES)


def _quantized(m, emit):
    node = m.root
    x, *rest = (emit.value(name) for name in node.inputs)
    if x.type.dtype is not DType.F32 or node.attr.get("op", node.op) not in PRODUCTS:
        return None
    outs = emit.op(node.op, emit.op("quantize_q8_0", x), *rest, **node.attr)
    return dict(zip(node.outputs, outs if isinstance(outs, tuple) else (outs,)))


EXPERT_WEIGHTS = slice(2, 8)  # fused_moe's inputs read by its expert and shared-expert products
XQ = 9                        # fused_moe's input index of xq


def _quantized_experts(m, emit):
    node = m.root
    inputs = [emit.value(name) for name in node.inputs]
    if len(inputs) > XQ or any(w.type.dtype not in Q8_X_TYPES for w in inputs[EXPERT_WEIGHTS]):
        return None
    out = emit.op("fused_moe", *inputs, emit.op("quantize_q8_0", inputs[0]), **node.attr)
    return {node.outputs[0]: out}


def _quantizing_core(m, emit):
    core, rows = m.node("core"), m.value.type.shape[0]
    head_dim = emit.value(core.inputs[2]).type.shape[2] if core.op == "fused_attention" else \
        core.outputs[0].type.shape[2]
    if not isinstance(head_dim, int) or head_dim % DType.Q8_0.block_size:
        return None
    if core.op == "fused_gated_deltanet" and m["flat"].type.shape != (rows, math.prod(core.outputs[0].type.shape[1:])):
        return None
    outs = emit.op(core.op, *(emit.value(name) for name in core.inputs), **{**core.attr, "q8_out": True})
    outs = outs if isinstance(outs, tuple) else (outs,)
    return {m.value: outs[0], **dict(zip(core.outputs[1:], outs[1:]))}


_CORE_OUTPUT = P("fused_attention", name="core", one_use=True) | \
    P("reshape", P("fused_gated_deltanet", name="core", one_use=True), name="flat", one_use=True)

# (any inputs: a product's x is its first, the weights and residual follow)
RULES = [Rule("quantize", P((*PRODUCTS, "matmul_group"), output=None), _quantized),
         Rule("quantize_experts", P("fused_moe", output=None), _quantized_experts),
         Rule("quantizing_core", P("quantize_q8_0", _CORE_OUTPUT), _quantizing_core)]


def quantize_activations(graph: Graph) -> Graph:
    return rewrite(graph, RULES, name="quantize_activations")
