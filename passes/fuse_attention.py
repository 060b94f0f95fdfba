"""fuse_attention: one `fused_attention` node per attention layer.

Two rules, each for layers with and without q/k norms, applied in this order:
1. `attention` whose q and k are rope(rmsnorm(·, norm weight)) at the same positions (or
   rope(·) alone, llama's layers: a fused_attention without norm inputs, eps None), whose
   K/V come from kv_write into state caches at the same `pos`, and whose output is
   flattened to [T, H*Dv] -> fused_attention. The caches' new contents become outputs of
   the fused node when anything besides the attention reads them (the target's state
   updates: `persist`); the draft block's K/V, written past the cache length for one call,
   stay inside the kernel.
2. the Qwen3.5 output gate: fused_attention(slice(qg, :D)) * sigmoid(flatten(slice(qg, D:)))
   -> fused_attention(qg, gated=True), so the kernel reads q and gate from the projection.

The draft's inject graph (kv_write without attention) is left as is.
`variant`: decode for one row, block for verify / draft block graphs (or up to 64 static
rows), prefill otherwise.
"""
from __future__ import annotations

import functools

from dflash_ir.ir import Graph
from dflash_ir.ops.fused import attention_input_names
from dflash_ir.ops.position import ROPE_DEFAULTS
from dflash_ir.rewrite import P, Rule, V, rewrite

BLOCK_ROWS = 64


def _roped(x: str, normed: bool) -> P:
    inner = P("rmsnorm", V(x), V(f"{x}_norm"), name=f"{x}_normed", one_use=True) if normed else V(x)
    return P("rope", inner, V("positions"), name=f"{x}_rot", one_use=True)


def _attention(normed: bool) -> P:
    return P("attention",
             _roped("q", normed),
             P("kv_write", V("k_cache", kind="state"), _roped("k", normed), V("pos"), name="k_all"),
             P("kv_write", V("v_cache", kind="state"), V("v"), V("pos"), name="v_all"),
             V("kv_len"), name="attn", one_use=True)


def variant(rows, kind: str | None) -> str:
    if rows == 1:
        return "decode"
    if kind in ("verify", "block") or (isinstance(rows, int) and rows <= BLOCK_ROWS):
        return "block"
    return "prefill"


def _fuse(m, emit, normed: bool):
    rope = {**ROPE_DEFAULTS, **m.node("q_rot").attr}
    eps = m.node("q_normed").attr["eps"] if normed else None
    if rope != {**ROPE_DEFAULTS, **m.node("k_rot").attr} or (normed and m.node("k_normed").attr["eps"] != eps):
        return None
    rows, heads, dv = m["attn"].type.shape
    if not (isinstance(heads, int) and isinstance(dv, int)) or m.value.type.shape != (rows, heads * dv):
        return None
    persist = emit.uses(m["k_all"]) > 1 or emit.uses(m["v_all"]) > 1
    attn = m.node("attn").attr
    fused = emit.op("fused_attention", *(m[n] for n in attention_input_names(normed)), eps=eps, **rope,
                    scale=attn["scale"], causal=attn.get("causal", True), window=attn.get("window", 0), gated=False,
                    persist=persist, variant=variant(rows, emit.meta.get("kind")))
    return {m.value: fused[0], m["k_all"]: fused[1], m["v_all"]: fused[2]} if persist else fused


_GATE = P("sigmoid", P("reshape", P("slice", V("qg"), name="gate", one_use=True), one_use=True), one_use=True)


def _ungated(normed: bool) -> P:
    rest = (V(n) for n in attention_input_names(normed)[1:])
    return P("fused_attention", P("slice", V("qg"), name="q", one_use=True), *rest, name="fa", attrs={"gated": False},
             one_use=True)


def _absorb_gate(m, emit, normed: bool):
    fa = m.node("fa")
    q, gate = m.node("q").attr, m.node("gate").attr
    qg = m["qg"].type
    d, dv = m["k"].type.shape[2], m["v"].type.shape[2]
    if qg.rank != 3 or not (q["axis"] % 3 == gate["axis"] % 3 == 2) or qg.shape[2] != d + dv:
        return None
    if (q["start"], q.get("stop"), gate["start"], gate.get("stop")) not in ((0, d, d, d + dv), (0, d, d, None)):
        return None
    if m["fa"].type != m.value.type:
        return None
    inputs = (m["qg"], *(m[n] for n in attention_input_names(normed)[1:]))
    fused = emit.op("fused_attention", *inputs, **{**fa.attr, "gated": True})
    if not fa.attr["persist"]:
        return fused
    return {m.value: fused[0], fa.outputs[1]: fused[1], fa.outputs[2]: fused[2]}


RULES = [
    *(Rule(f"attention{'' if normed else '_without_norms'}", P("reshape", _attention(normed)),
           functools.partial(_fuse, normed=normed)) for normed in (True, False)),
    *(Rule(f"output_gate{'' if normed else '_without_norms'}", P("mul", _ungated(normed), _GATE, commutative=True),
           functools.partial(_absorb_gate, normed=normed)) for normed in (True, False)),
]


def fuse_attention(graph: Graph) -> Graph:
    return rewrite(graph, RULES, name="fuse_attention")
