"""fuse_matmul: a product absorbs the RMSNorm before it and the SwiGLU after it.

A layer normalises its input and projects it (attention q/k/v, a Gated DeltaNet layer's
input projections, the MLP's gate and up, the output head), and the MLP multiplies
silu(gate) by up. As separate kernels the normalised row and the two projections make
round trips through memory and cost a launch each; as one `fused_matmul` the kernel
normalises on the fly (the row's RMS folded into the product, the norm weight into the
weight vectors) and writes silu(gate) * up directly. Two rules, to a fixpoint:
- `norm`: a matmul_group, specialised matmul (without residual) or fused_matmul without a
  prologue, whose f32 x is an rmsnorm read only by such products, takes the norm's input and
  weight (`norm_eps`); with several readers (a Q4_K_M layer's Q6_K v projection beside its
  Q4_K group: products of different types are not grouped) each recomputes the row's RMS.
  Under `q8` numerics the products read quantize_q8_0(rmsnorm(x)): the quantize takes the
  norm the same way, so one kernel writes the normalised row's Q8_0 blocks;
- `swiglu`: swiglu(p0, p1) where p0 and p1 are the two outputs of one matmul_group or
  fused_matmul, read by nothing else, becomes that product with epilogue "swiglu";
- `swiglu_q8`: under `q8` numerics, quantize_q8_0 of such a product's SwiGLU (the down
  product's x), read by nothing else, becomes its epilogue "swiglu_q8": the kernel writes the
  Q8_0 blocks, and no launch of its own quantises them.
Products of every stored weight type fuse (Q8_0, F16 and the block types of a Q4_K_M file):
the GPU GEMV reads any of them; where a schedule has no fused kernel for a type (the CPU
tiles take Q8_0 and the block types without a codebook, not F16 or IQ4_NL / IQ4_XS / MXFP4)
lowering runs the parts (backends/kernels/fused.py).
The fused op's reference is the composition of the ops it replaced, so outputs are
bit-identical (tests/passes/test_fuse_matmul.py).
"""
from __future__ import annotations

from dflash_ir.dtypes import DType
from dflash_ir.ir import Graph
from dflash_ir.ops.specialised import OPS
from dflash_ir.rewrite import P, Rule, V, rewrite

PRODUCTS = tuple(OPS.values())
_SHAPE = ("op", "form", "K", "Ns", "layout")


def _product_attrs(node) -> dict | None:
    """The fused_matmul attrs of a specialised product node (None if it cannot be fused)."""
    a = node.attr
    if node.op == "fused_matmul":
        return {k: a[k] for k in _SHAPE + ("norm_eps", "epilogue")}
    if node.op == "matmul_group" and a["op"] in PRODUCTS:
        return {**{k: a[k] for k in _SHAPE}, "norm_eps": None, "epilogue": "none"}
    if node.op in PRODUCTS and len(node.inputs) == 2:
        return {"op": node.op, "form": a["form"], "K": a["K"], "Ns": (a["N"],), "layout": a["layout"],
                "norm_eps": None, "epilogue": "none"}
    return None


def _takes_norm(node, x) -> bool:
    if node.op == "quantize_q8_0":
        return node.attr.get("norm_eps") is None
    attrs = _product_attrs(node)
    return attrs is not None and attrs["norm_eps"] is None and node.inputs[0] == x.name and x.name not in node.inputs[1:]


def _norm(m, emit):
    node = m.root
    x = emit.value(node.inputs[0])
    if not _takes_norm(node, x) or emit.kind(x) != "node":
        return None
    readers = emit.readers(x)
    if emit.uses(x) != len(readers) or not all(_takes_norm(r, x) for r in readers):
        return None  # the normalised row is needed as it is: it stays one rmsnorm
    norm = m.producer(x)
    if norm.op != "rmsnorm" or len(norm.inputs) != 2 or x.type.dtype is not DType.F32:
        return None
    operands = [emit.value(n) for n in (*norm.inputs, *node.inputs[1:])]
    if node.op == "quantize_q8_0":
        return {node.outputs[0]: emit.op("quantize_q8_0", *operands, norm_eps=norm.attr["eps"])}
    out = emit.op("fused_matmul", *operands, **{**_product_attrs(node), "norm_eps": norm.attr["eps"]})
    return dict(zip(node.outputs, out if isinstance(out, tuple) else (out,)))


def _swiglu(m, emit):
    gate, up = m["gate"], m["up"]
    if emit.kind(gate) != "node" or emit.uses(gate) != 1 or emit.uses(up) != 1:
        return None
    node = m.producer(gate)
    attrs = _product_attrs(node)
    if (attrs is None or attrs["epilogue"] != "none" or len(node.outputs) != 2
            or (node.outputs[0].name, node.outputs[1].name) != (gate.name, up.name)):
        return None
    return emit.op("fused_matmul", *(emit.value(n) for n in node.inputs), **{**attrs, "epilogue": "swiglu"})


def _swiglu_q8(m, emit):
    product = m.node("product")
    inputs = (emit.value(n) for n in product.inputs)
    return emit.op("fused_matmul", *inputs, **{**product.attr, "epilogue": "swiglu_q8"})


RULES = [Rule("norm", P(("matmul_group", *PRODUCTS, "fused_matmul", "quantize_q8_0"), output=None), _norm),
         Rule("swiglu", P("swiglu", V("gate"), V("up")), _swiglu),
         Rule("swiglu_q8", P("quantize_q8_0", P("fused_matmul", name="product", attrs={"epilogue": "swiglu"},
                                                one_use=True)), _swiglu_q8)]


def fuse_matmul(graph: Graph) -> Graph:
    return rewrite(graph, RULES, name="fuse_matmul")
