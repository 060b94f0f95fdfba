"""Rotary embedding: one thread per output element. The f32 inverse frequencies and the
position component of each frequency (M-RoPE sections, interleaved or not) are computed by
the op's own helpers at compile time and baked in as tables, so the angle f32(pos) * inv_freq
is the reference's f32 product; the pairs and their rotation are the op's (RotaryPairs,
rotate), here and in the fused attention kernels."""
from __future__ import annotations

from dflash_ir.ops.position import RotaryPairs, frequency_components, inv_freq_f32, rotate

from ..kir import F32, I32, K, call, cast, select
from ..lowering import NodeCtx, dim, lowers
from .shapes import flat_launch


@lowers("rope")
def rope(ctx: NodeCtx) -> None:
    pos_value = ctx.ins[1]
    _, h, d = ctx.ins[0].type.shape
    n_rot = ctx.attr["n_rot"]
    half = n_rot // 2
    inv_freq = inv_freq_f32(n_rot, ctx.attr["theta"], ctx.attr.get("freq_factors", ()))
    pairs = RotaryPairs(n_rot, ctx.attr.get("pairs", "halves"))
    components = frequency_components(half, tuple(ctx.attr.get("sections", ())), ctx.attr.get("interleaved", False))
    D = dim(d)

    def compute(kb, i, xs, out):
        x, pos = xs
        dd, t = kb.let("dd", i % D), kb.let("t", i / (dim(h) * D))
        with kb.if_(dd >= n_rot):  # partial rotary: the dims past n_rot are copied
            out[i] = x[i]
            kb.emit(K("return"))
        freq = kb.array("inv_freq", F32, half, init=[float(f) for f in inv_freq])
        comp = kb.array("comp", I32, half, init=[int(c) for c in components]) if pos_value.type.rank == 2 else None
        frequency, first = pairs.of(dd, select)
        j = kb.let("j", frequency)
        position = pos[t * dim(pos_value.type.shape[1]) + comp[j]] if comp is not None else pos[t]
        angle = kb.let("angle", cast(F32, position) * freq[j])
        c, s = kb.let("c", call("cos", angle)), kb.let("s", call("sin", angle))
        lo, hi = (kb.let(name, x[i - dd + at]) for name, at in zip(("lo", "hi"), pairs.dims(j)))
        out[i] = select(first, *rotate(lo, hi, c, s))
    flat_launch(ctx, compute)
