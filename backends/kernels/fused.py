"""Fused ops lowered as their parts' kernels (the same composition as their references in
dflash_ir/ops/fused.py), where no fused kernel exists for their dtypes or device profile.
Written against `ctx.sub` alone, so the TVM lowering registers the same compositions."""
from __future__ import annotations

from dflash_ir.ir import Value

from ..lowering import NodeCtx


def fused_moe_parts(ctx: NodeCtx) -> None:
    """fused_moe as its parts: router product, softmax, top-k, renormalisation, expert and
    shared-expert products, SwiGLU, the gate (kernels/moe.py has the fused kernels); with
    `xq` the products read it and each SwiGLU is quantised for down."""
    x, router_w, gate_exps, up_exps, down_exps, sh_gate_w, sh_up_w, sh_down_w, sh_gate_inp_w, *xq = ctx.ins
    k = ctx.attr["k"]
    rows, width = x.type.shape
    src = xq[0] if xq else x

    def down_input(act: Value) -> Value:
        return ctx.sub("quantize_q8_0", act) if xq else act
    top_p, ids = ctx.sub("topk", ctx.sub("softmax", ctx.sub("matmul", x, router_w), axis=-1), k=k)
    weights = ctx.sub("div", top_p, ctx.sub("sum", top_p, axis=-1, keepdims=True))
    act = ctx.sub("swiglu", ctx.sub("expert_matmul", src, gate_exps, ids), ctx.sub("expert_matmul", src, up_exps, ids))
    down = ctx.sub("expert_matmul", down_input(act), down_exps, ids)
    routed = ctx.sub("sum", ctx.sub("mul", down, ctx.sub("reshape", weights, shape=(rows, k, 1))), axis=1)
    shared = ctx.sub("matmul", down_input(ctx.sub("swiglu", ctx.sub("matmul", src, sh_gate_w),
                                                  ctx.sub("matmul", src, sh_up_w))), sh_down_w)
    gate_w = sh_gate_inp_w if sh_gate_inp_w.type.rank == 2 else ctx.sub("reshape", sh_gate_inp_w, shape=(1, width))
    gate = ctx.sub("sigmoid", ctx.sub("matmul", x, gate_w))
    ctx.sub("add", routed, ctx.sub("mul", shared, gate), outputs=[ctx.outs[0]])


def fused_matmul_parts(ctx: NodeCtx) -> None:
    """fused_matmul as rmsnorm, the product(s), then swiglu (quantised with `swiglu_q8`), where
    no fused kernel exists."""
    a = ctx.attr
    x, *operands = ctx.ins
    if a["norm_eps"] is not None:
        x = ctx.sub("rmsnorm", x, operands[0], eps=a["norm_eps"])
        operands = operands[1:]
    shape = dict(form=a["form"], K=a["K"], layout=a["layout"])
    swiglu = a["epilogue"] != "none"
    into = None if swiglu else list(ctx.outs)
    if len(operands) == 1:
        products = (ctx.sub(a["op"], x, operands[0], outputs=into, N=a["Ns"][0], **shape),)
    else:
        products = ctx.sub("matmul_group", x, *operands, outputs=into, op=a["op"], Ns=a["Ns"], **shape)
    if a["epilogue"] == "swiglu":
        ctx.sub("swiglu", *products, outputs=[ctx.outs[0]])
    elif swiglu:
        ctx.sub("quantize_q8_0", ctx.sub("swiglu", *products), outputs=[ctx.outs[0]])
