"""fused_moe and fused_matmul lowered as their parts' kernels: the compositions the native
lowering falls back to (backends/kernels/fused.py), which only need `ctx.sub`, registered for
TVM (the native fused MoE kernels, kernels/moe.py, are kir trees TVM does not build). On the
cpu profile a fused MoE takes fewer, larger kernels (fused_moe): on PoCL each launch costs
~20 µs, and the parts made a one-row MoE 25 launches."""
from __future__ import annotations

from dflash_ir.dtypes import DType
from dflash_ir.types import TensorType

from ..kernels.fused import fused_matmul_parts, fused_moe_parts
from .lowering import TVMNodeCtx, lowers
from .ops_linalg import quantize_rows
from .ops_reduce import topk_lines
from .tir import activation, block, dim, f32

lowers("fused_matmul")(fused_matmul_parts)


@lowers("fused_moe")
def fused_moe(ctx: TVMNodeCtx) -> None:
    """On the cpu profile: the router product, one kernel routing each row (moe_route: the
    softmax, top-k and renormalisation, and the shared expert's sigmoid gate), the expert and
    shared products with SwiGLU (quantised in the same kernel where down reads Q8_0), and
    one kernel combining each output (moe_combine): 12 launches a call where the parts take
    22 (24 where down reads Q8_0). The arithmetic is the parts' in their order, but
    for the gate's dot product, summed in order here (a product nest's lanes there): results
    agree to rounding (tests/kernel_cases.py). Other profiles: the parts."""
    if ctx.profile != "cpu":
        fused_moe_parts(ctx)
        return
    x, router_w, gate_exps, up_exps, down_exps, sh_gate_w, sh_up_w, sh_down_w, sh_gate_inp_w, *xq = ctx.ins
    k = ctx.attr["k"]
    rows, width = x.type.shape
    src = xq[0] if xq else x
    logits = ctx.sub("matmul", x, router_w)
    ids, weights = ctx.temp(TensorType(DType.I32, (rows, k))), ctx.temp(TensorType(DType.F32, (rows, k)))
    gate = ctx.temp(TensorType(DType.F32, (rows,)))
    _route(ctx, logits, x, sh_gate_inp_w, ids, weights, gate, k)

    def act(g, u):  # SwiGLU, quantised where down reads Q8_0
        return _swiglu_q8_0(ctx, g, u) if xq else ctx.sub("swiglu", g, u)
    down = ctx.sub("expert_matmul", act(ctx.sub("expert_matmul", src, gate_exps, ids),
                                        ctx.sub("expert_matmul", src, up_exps, ids)), down_exps, ids)
    shared = ctx.sub("matmul", act(ctx.sub("matmul", src, sh_gate_w), ctx.sub("matmul", src, sh_up_w)), sh_down_w)
    out = ctx.outs[0]
    routed = " + ".join(f"down[(row * {k} + {s}) * {width} + col] * weights[row * {k} + {s}]" for s in range(k))
    ctx.kernel("moe_combine", [("down", down, False), ("weights", weights, False), ("shared", shared, False),
                               ("gate", gate, False), ("out", out, True)],
               block([("row", dim(rows)), ("col", dim(width))],
                     f"out[row * {width} + col] = ({routed}) + shared[row * {width} + col] * gate[row]"))


def _route(ctx: TVMNodeCtx, logits, x, gate_inp, ids, weights, gate, k: int) -> None:
    """Per row: softmax of the router logits as the softmax kernels compute it, the top k of
    those probabilities as topk picks them, the picks renormalised to sum to one (as sum and
    div), and sigmoid(x · gate_inp), the shared expert's gate (its dot product summed in
    order)."""
    rows, experts = logits.type.shape
    width = x.type.shape[-1]
    at = f"logits[row * {experts} + j]"
    body = "\n".join([
        f"st[0] = {f32(float('-inf'))}", f"for j in range({experts}):", f"    st[0] = T.max(st[0], {at})",
        "st[1] = T.float32(0)", f"for j in range({experts}):", f"    st[1] = st[1] + T.exp({at} - st[0])",
        f"for j in range({experts}):", f"    p[j] = T.exp({at} - st[0]) / st[1]",
        topk_lines("p[j]", k, experts, lambda q: [f"top[{q}] = st[2]", f'ids[row * {k} + {q}] = T.Cast("int32", st[3])']),
        "st[0] = T.float32(0)", f"for q in range({k}):", "    st[0] = st[0] + top[q]",
        f"for q in range({k}):", f"    weights[row * {k} + q] = top[q] / st[0]",
        "st[1] = T.float32(0)", f"for c in range({width}):", f"    st[1] = st[1] + x[row * {width} + c] * gate_inp[c]",
        f"gate[row] = {activation('sigmoid', 'st[1]')}"])
    ctx.sequential("moe_route", [("logits", logits, False), ("x", x, False), ("gate_inp", gate_inp, False),
                                 ("ids", ids, True), ("weights", weights, True), ("gate", gate, True)],
                   [("row", dim(rows))], body, [("st", 4), ("p", experts), ("top", k)])


def _swiglu_q8_0(ctx: TVMNodeCtx, g, u):
    """SwiGLU of gate and up products quantised to Q8_0 in one kernel (swiglu's arithmetic)."""
    out = ctx.temp(TensorType(DType.Q8_0, g.type.shape))
    quantize_rows(ctx, "swiglu_quantize_q8_0", [("g", g), ("u", u)],
                  lambda at: activation("swiglu", f"g[{at}]", f"u[{at}]"), out)
    return out
