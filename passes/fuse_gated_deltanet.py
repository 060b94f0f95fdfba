"""fuse_gated_deltanet: a Gated DeltaNet layer between its projections as one kernel.

Three rules, each exact (the fused references compose the unfused ones):
1. silu(causal_conv1d(x, w, state)) -> causal_conv1d(x, w, state, activation="silu")
   (the conv's states hold its input rows, so they are unchanged);
2. gated_delta_rule(l2norm(slice q of m), l2norm(slice k of m), slice v of m,
                    softplus(a + dt_bias) * ssm_a, sigmoid(b), state)
   -> fused_gated_delta_rule(m, a, b, dt_bias, ssm_a, state): the kernel reads q, k and v
   out of the conv output, normalises q and k and computes the decay and β itself;
3. rmsnorm(fused_gated_delta_rule(causal_conv1d(x, w, conv_state, silu), ...), norm_w) * silu(z)
   (or swiglu(z, that)) -> fused_gated_deltanet(x, w, conv_state, ..., state, z, norm_w): the
   conv and its state update become outputs of the one node, whose kernel convolves the
   channels each work-group reads, runs the recurrence and applies each v head's RMSNorm
   and the silu(z) gate before storing. Only where the conv output and the recurrence
   output have no other reader and the gate is elementwise (z of the output's shape).

Per layer and call that is the conv, 3 slices, 2 norms, silu, 4 gate ops, the output norm,
silu and mul in the recurrence's one kernel: a decode token's Gated DeltaNet layer launches
nothing between its input projections and its out projection but that kernel. The slices
must be q = m[:, :Kd], k = m[:, Kd:2Kd], v = m[:, 2Kd:] as the Qwen3.5 builder makes them;
anything else is left alone.
"""
from __future__ import annotations

from dflash_ir.dtypes import DType
from dflash_ir.ir import Graph
from dflash_ir.rewrite import P, Rule, V, rewrite


def _conv_silu(m, emit):
    conv = m.node("conv")
    fused = emit.op("causal_conv1d", *(m[n] for n in ("x", "w", "state")), **{**conv.attr, "activation": "silu"})
    return {m.value: fused[0], **{old: new for old, new in zip(conv.outputs[1:], fused[1:])}}


def _heads(name: str, m: str, normed: bool) -> P:
    part = P("reshape", P("slice", V(m), name=f"{name}_slice", one_use=True), name=f"{name}_heads", one_use=True)
    return P("l2norm", part, name=f"{name}_normed", one_use=True) if normed else part


_WEIGHT = dict(kind="weight", dtype=DType.F32)
_GDN = P("gated_delta_rule",
         _heads("q", "m", True), _heads("k", "m", True), _heads("v", "m", False),
         P("mul", P("softplus", P("add", V("a"), V("dt_bias", **_WEIGHT), one_use=True), one_use=True),
           V("ssm_a", **_WEIGHT), name="g", one_use=True),
         P("sigmoid", V("b"), name="beta", one_use=True),
         V("state"), name="gdn")


def _slices_are_qkv(m) -> bool:
    channels = m["m"].type.shape[1]
    key_width = m["k_heads"].type.shape[1] * m["k_heads"].type.shape[2]
    want = {"q": (0, key_width), "k": (key_width, 2 * key_width), "v": (2 * key_width, channels)}
    for part, (start, stop) in want.items():
        a = m.node(f"{part}_slice").attr
        if a["axis"] % 2 != 1 or a["start"] != start or a.get("stop", channels) not in (stop, None):
            return False
    return m.node("q_normed").attr["eps"] == m.node("k_normed").attr["eps"]


def _fuse_gdn(m, emit):
    if m["m"].type.rank != 2 or not isinstance(m["m"].type.shape[1], int) or not _slices_are_qkv(m):
        return None
    gdn = m.node("gdn")
    fused = emit.op("fused_gated_delta_rule", m["m"], m["a"], m["b"], m["dt_bias"], m["ssm_a"], m["state"],
                    key_heads=m["k_heads"].type.shape[1], eps=m.node("q_normed").attr["eps"], **gdn.attr)
    return dict(zip(gdn.outputs, fused))


_RECURRENCE = P("fused_gated_delta_rule",
                P("causal_conv1d", V("x"), V("w"), V("conv_state"), name="conv", one_use=True,
                  attrs={"activation": "silu"}),
                V("a"), V("b"), V("dt_bias"), V("ssm_a"), V("state"), name="gdn", one_use=True)
_NORMED = P("rmsnorm", _RECURRENCE, V("norm_w"), name="normed", one_use=True)
_LAYER = (P("mul", _NORMED, P("silu", V("z"), one_use=True), commutative=True)
          | P("swiglu", V("z"), _NORMED))


def _fuse_layer(m, emit):
    conv, gdn = m.node("conv"), m.node("gdn")
    if m["z"].type != m["normed"].type:
        return None
    y, conv_new, new = emit.op("fused_gated_deltanet", *(m[n] for n in ("x", "w", "conv_state", "a", "b", "dt_bias",
                                                                         "ssm_a", "state", "z", "norm_w")),
                               norm_eps=m.node("normed").attr["eps"], **gdn.attr)
    return {m.value: y, conv.outputs[1]: conv_new, gdn.outputs[1]: new}


RULES = [
    Rule("conv_silu", P("silu", P("causal_conv1d", V("x"), V("w"), V("state"), name="conv", one_use=True,
                                  attrs={"activation": lambda a: a in (None, "none")})), _conv_silu),
    Rule("gated_delta_rule", _GDN, _fuse_gdn),
    Rule("gated_deltanet", _LAYER, _fuse_layer),
]


def fuse_gated_deltanet(graph: Graph) -> Graph:
    return rewrite(graph, RULES, name="fuse_gated_deltanet")
