"""Rotary embedding: one thread per output element. The f32 inverse frequencies and the
position component of each frequency (M-RoPE sections, interleaved or not) are computed by
the op's own helpers at compile time and baked in as tables, so the angle f32(pos) * inv_freq
is the reference's f32 product."""
from __future__ import annotations

from dflash_ir.ops.position import frequency_components, inv_freq_f32

from ..lowering import NodeCtx, lowers
from .common import dim, f32_table, flat_launch


@lowers("rope")
def rope(ctx: NodeCtx) -> None:
    x, pos = ctx.ins
    _, h, d = x.type.shape
    n_rot = ctx.attr["n_rot"]
    half = n_rot // 2
    inv_freq = inv_freq_f32(n_rot, ctx.attr["theta"])
    components = frequency_components(half, tuple(ctx.attr.get("sections", ())), ctx.attr.get("interleaved", False))
    D = dim(d)
    if pos.type.rank == 2:
        position = f"x1[t * {dim(pos.type.shape[1])} + comp[j]]"
        table = f"  const int comp[{half}] = {{{', '.join(str(int(c)) for c in components)}}};\n"
    else:
        position, table = "x1[t]", ""
    flat_launch(ctx, f"  int dd = i % {D}, t = i / ({dim(h)} * {D});\n"
                     f"  if (dd >= {n_rot}) {{ out[i] = x0[i]; return; }}\n"
                     f"  const float inv_freq[{half}] = {f32_table(inv_freq)};\n{table}"
                     f"  int j = dd < {half} ? dd : dd - {half};\n"
                     f"  float angle = F32({position}) * inv_freq[j];\n"
                     f"  float c = cosf(angle), s = sinf(angle);\n"
                     f"  float lo = x0[i - dd + j], hi = x0[i - dd + j + {half}];\n"
                     f"  out[i] = dd < {half} ? lo * c - hi * s : hi * c + lo * s;\n")
