"""Gated DeltaNet state ops: depthwise causal conv1d and the gated delta rule, both with
optional per-row states (what a speculative verify rolls back to)."""
from __future__ import annotations

from dflash_ir.ir import Value

from ..lowering import NodeCtx, lowers
from .common import FLAT, cdiv, dim, f32, pow2_threads, weight_at


def _old_state(ctx: NodeCtx, state: Value, new_state: Value, allowed: bool = True) -> tuple[str, list]:
    """(the kernel's name for the old state, its buffer entries). Where allowed and nothing
    else reads the old state, the new state is written over it: the kernel then reads the
    old values through `new_state` and takes no `state` buffer."""
    if allowed and ctx.can_overwrite(state):
        ctx.alias(new_state, state)
        return "new_state", []
    return "state", [("state", state, False)]


@lowers("causal_conv1d")
def causal_conv1d(ctx: NodeCtx) -> None:
    """A thread per (row t, channel c) over xx = concat(state, x); the thread of the last row
    also writes the new state (= the window after that row). A single row (decode) whose old
    state nothing else reads shifts the window in place: each thread reads its channel's
    state cells before it overwrites them."""
    x, w, state = ctx.ins
    y, new_state, *rows = ctx.outs
    t, c = x.type.shape
    width = w.type.shape[1]
    T, C, K1 = dim(t), dim(c), width - 1
    source, state_buffers = _old_state(ctx, state, new_state, allowed=t == 1)
    at = f"(r < {K1} ? {source}[r * {C} + ch] : x[I64(r - {K1}) * {C} + ch])"
    emit = f"      row_states[(I64(row) * {K1} + e) * {C} + ch] = v;\n" if rows else ""
    body = (f"  int i = GID(0) * {FLAT} + LID(0);\n  if (i >= {T} * {C}) return;\n"
            f"  int row = i / {C}, ch = i % {C};\n  float acc = 0.0f;\n"
            f"  for (int j = 0; j < {width}; ++j) {{\n    int r = row + j;\n"
            f"    acc += {at} * {weight_at(w.type.dtype, 'w', 'ch', 'j', width)};\n  }}\n  y[i] = acc;\n"
            f"  for (int e = 0; e < {K1}; ++e) {{\n    int r = row + 1 + e;\n    float v = {at};\n{emit}"
            f"    if (row == {T} - 1) new_state[e * {C} + ch] = v;\n  }}\n")
    buffers = [("x", x, False), ("w", w, False), *state_buffers, ("y", y, True), ("new_state", new_state, True)]
    ctx.launch("causal_conv1d", body, buffers=buffers + [("row_states", r, True) for r in rows],
               groups=[cdiv(f"{T} * {C}", FLAT)])


CPU_COLS = 8  # CPU schedule: state columns per work-item


@lowers("gated_delta_rule")
def gated_delta_rule(ctx: NodeCtx) -> None:
    """The gated delta rule over T rows from `state`, one kernel either way: the CPU schedule
    where the value dim splits into CPU_COLS-wide column groups, else the GPU one (which is
    also correct on a CPU). The chunked form (chunk_size > 0) is the same recurrence, so it
    runs these kernels too. When nothing else reads the old state (a decode or verify step),
    the new state is written over it: each thread reads a state cell before it writes that
    cell, and a decode then copies no state."""
    q, k, v, g, beta, state = ctx.ins
    o, new_state, *rows = ctx.outs
    t, hk, dk = q.type.shape
    hv, dv = v.type.shape[1], v.type.shape[2]
    kh = f"h % {hk}" if ctx.attr.get("head_map", "tiled") == "tiled" else f"h / {hv // hk}"
    shape = (dim(t), dim(dk), dim(dv), hk, hv)
    scale = f32(ctx.attr["scale"])
    source, state_buffers = _old_state(ctx, state, new_state)
    if ctx.profile == "cpu" and isinstance(dv, int) and dv % CPU_COLS == 0:
        body, groups, local = _cpu_body(*shape, kh, scale, bool(rows), source), [str(hv)], (dv // CPU_COLS,)
    else:
        L = pow2_threads(dv, most=64) if isinstance(dv, int) else 64
        body, groups, local = _gpu_body(*shape, kh, scale, bool(rows), dk, L, source), [str(hv), cdiv(dim(dv), L)], (L,)
    buffers = [("q", q, False), ("k", k, False), ("v", v, False), ("g", g, False), ("beta", beta, False),
               *state_buffers, ("o", o, True), ("new_state", new_state, True)]
    ctx.launch("gated_delta_rule", body, buffers=buffers + [("row_states", r, True) for r in rows],
               groups=groups, local=local)


def _gpu_body(T: str, DK: str, DV: str, hk: int, hv: int, kh: str, scale: str, rows: bool, dk, L: int,
              source: str) -> str:
    """A thread per state column (v head h, value dim col) keeps S[:, col] in registers and
    walks the rows in order, so every reduction over the key dim stays inside the thread;
    the work-group shares each row's q and k through local memory. `source` holds the old
    state (new_state itself when updating in place)."""
    cell = f"(I64(h) * {DK} + e) * {DV} + col"
    emit = f"      for (int e = 0; e < {DK}; ++e) row_states[I64(t) * {hv} * {DK} * {DV} + {cell}] = S[e];\n" if rows else ""
    qk_row = f"(I64(t) * {hk} + kh) * {DK}"
    return (f"  int h = GID(0), lid = LID(0), col = GID(1) * {L} + lid, kh = {kh};\n  bool live = col < {DV};\n"
            f"  LOCAL float qs[{dk}];\n  LOCAL float ks[{dk}];\n  float S[{dk}];\n"
            f"  for (int e = 0; e < {DK}; ++e) S[e] = live ? {source}[{cell}] : 0.0f;\n"
            f"  for (int t = 0; t < {T}; ++t) {{\n"
            f"    BARRIER();\n    for (int e = lid; e < {DK}; e += {L}) {{\n"
            f"      qs[e] = q[{qk_row} + e] * {scale};\n      ks[e] = k[{qk_row} + e];\n    }}\n    BARRIER();\n"
            f"    float decay = expf(g[t * {hv} + h]), b = beta[t * {hv} + h], sk = 0.0f, y = 0.0f;\n"
            f"    for (int e = 0; e < {DK}; ++e) {{ S[e] *= decay; sk += S[e] * ks[e]; }}\n"
            f"    float delta = b * ((live ? v[(I64(t) * {hv} + h) * {DV} + col] : 0.0f) - sk);\n"
            f"    for (int e = 0; e < {DK}; ++e) {{ S[e] += ks[e] * delta; y += S[e] * qs[e]; }}\n"
            f"    if (live) {{\n      o[(I64(t) * {hv} + h) * {DV} + col] = y;\n{emit}    }}\n  }}\n"
            f"  if (live) for (int e = 0; e < {DK}; ++e) new_state[{cell}] = S[e];\n")


def _cpu_body(T: str, DK: str, DV: str, hk: int, hv: int, kh: str, scale: str, rows: bool, source: str) -> str:
    """A work-item per (v head, CPU_COLS state columns) streams the state rows twice per
    token, once for k·S and once to write the updated rows (and sum y), with nothing held
    but CPU_COLS-wide sums: the inner loops over contiguous columns become vector loads and
    FMAs, where a thread holding a whole column does not vectorise. Row 0 reads `source`
    (the old state, or new_state itself in place); later rows read the rows the previous
    token wrote to new_state."""
    C = CPU_COLS
    cols = f"for (int j = 0; j < {C}; ++j)"
    emit = f" row_states[I64(t) * {hv} * {DK} * {DV} + r + j] = s;" if rows else ""

    def token(src: str) -> str:
        return (f"    float decay = expf(g[t * {hv} + h]), b = beta[t * {hv} + h];\n"
                f"    i64 qk = (I64(t) * {hk} + kh) * {DK}, vo = (I64(t) * {hv} + h) * {DV} + c0;\n"
                f"    {cols} {{ sk[j] = 0.0f; y[j] = 0.0f; }}\n"
                f"    for (int e = 0; e < {DK}; ++e) {{\n      float kv = k[qk + e];\n"
                f"      i64 r = (I64(h) * {DK} + e) * {DV} + c0;\n      {cols} sk[j] += {src}[r + j] * kv;\n    }}\n"
                f"    {cols} delta[j] = b * (v[vo + j] - decay * sk[j]);\n"
                f"    for (int e = 0; e < {DK}; ++e) {{\n"
                f"      float kv = k[qk + e], qv = q[qk + e] * {scale};\n"
                f"      i64 r = (I64(h) * {DK} + e) * {DV} + c0;\n"
                f"      {cols} {{ float s = decay * {src}[r + j] + kv * delta[j]; y[j] += s * qv; "
                f"new_state[r + j] = s;{emit} }}\n    }}\n"
                f"    {cols} o[vo + j] = y[j];\n")

    copy = (f"  if ({T} == 0) for (int e = 0; e < {DK}; ++e) {{ i64 r = (I64(h) * {DK} + e) * {DV} + c0; "
            f"{cols} new_state[r + j] = state[r + j]; }}\n") if source == "state" else ""
    return (f"  int h = GID(0), c0 = LID(0) * {C}, kh = {kh};\n"
            f"  float sk[{C}], y[{C}], delta[{C}];\n{copy}"
            f"  for (int t = 0; t < min({T}, 1); ++t) {{\n{token(source)}  }}\n"
            f"  for (int t = 1; t < {T}; ++t) {{\n{token('new_state')}  }}\n")
