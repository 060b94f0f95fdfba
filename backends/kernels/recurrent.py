"""Gated DeltaNet state ops: depthwise causal conv1d and the gated delta rule, both with
optional per-row states (what a speculative verify rolls back to)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

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
    activated = "acc * sigmoid_f32(acc)" if ctx.attr.get("activation", "none") == "silu" else "acc"
    body = (f"  int i = GID(0) * {FLAT} + LID(0);\n  if (i >= {T} * {C}) return;\n"
            f"  int row = i / {C}, ch = i % {C};\n  float acc = 0.0f;\n"
            f"  for (int j = 0; j < {width}; ++j) {{\n    int r = row + j;\n"
            f"    acc += {at} * {weight_at(w.type.dtype, 'w', 'ch', 'j', width)};\n  }}\n  y[i] = {activated};\n"
            f"  for (int e = 0; e < {K1}; ++e) {{\n    int r = row + 1 + e;\n    float v = {at};\n{emit}"
            f"    if (row == {T} - 1) new_state[e * {C} + ch] = v;\n  }}\n")
    buffers = [("x", x, False), ("w", w, False), *state_buffers, ("y", y, True), ("new_state", new_state, True)]
    ctx.launch("causal_conv1d", body, buffers=buffers + [("row_states", r, True) for r in rows],
               groups=[cdiv(f"{T} * {C}", FLAT)])


CPU_COLS = 8  # CPU schedule: state columns per work-item


@dataclass(frozen=True)
class Reads:
    """Where a gated delta rule kernel finds token t's inputs, as expressions in the loop
    variables t, h (v head) and kh (its k head): the plain op's q, k, v, g, β buffers, or
    the fused op's conv output and raw gates (`prologue` then normalises q and k)."""

    buffers: tuple                   # (param, value, written) of the inputs, in order
    key_heads: int
    q: Callable[[str], str]          # q at key index e (normalised, not yet scaled)
    k: Callable[[str], str]
    v: Callable[[str], str]          # v at value column c
    decay: str                       # e^g
    beta: str
    prologue: str = ""               # statements starting token t


def plain_reads(ctx: NodeCtx) -> Reads:
    q, k, v, g, beta = ctx.ins[:5]
    _, hk, dk = q.type.shape
    hv, dv = v.type.shape[1:]
    qk = f"(I64(t) * {hk} + kh) * {dim(dk)} + "
    return Reads((("q", q, False), ("k", k, False), ("v", v, False), ("g", g, False), ("beta", beta, False)), hk,
                 lambda e: f"q[{qk}{e}]", lambda e: f"k[{qk}{e}]", lambda c: f"v[(I64(t) * {hv} + h) * {dim(dv)} + {c}]",
                 f"expf(g[t * {hv} + h])", f"beta[t * {hv} + h]")


def fused_reads(ctx: NodeCtx) -> Reads:
    mixed, a, b, dt_bias, ssm_a = ctx.ins[:5]
    hv, dk, dv = ctx.ins[5].type.shape
    kd, channels = ctx.attr["key_heads"] * dk, mixed.type.shape[1]
    q_at, k_at = f"I64(t) * {channels} + kh * {dk} + ", f"I64(t) * {channels} + {kd} + kh * {dk} + "
    eps = f32(ctx.attr["eps"])
    prologue = (f"    float qn = 0.0f, kn = 0.0f;\n"
                f"    for (int e = 0; e < {dk}; ++e) {{ float qa = mixed[{q_at}e], ka = mixed[{k_at}e]; "
                f"qn += qa * qa; kn += ka * ka; }}\n"
                f"    qn = 1.0f / sqrtf(qn + {eps});\n    kn = 1.0f / sqrtf(kn + {eps});\n")
    return Reads((("mixed", mixed, False), ("gate_a", a, False), ("gate_b", b, False), ("dt_bias", dt_bias, False),
                  ("ssm_a", ssm_a, False)), ctx.attr["key_heads"],
                 lambda e: f"mixed[{q_at}{e}] * qn", lambda e: f"mixed[{k_at}{e}] * kn",
                 lambda c: f"mixed[I64(t) * {channels} + {2 * kd} + h * {dv} + {c}]",
                 f"expf(softplus_f32(gate_a[t * {hv} + h] + dt_bias[h]) * ssm_a[h])",
                 f"sigmoid_f32(gate_b[t * {hv} + h])", prologue)


@lowers("gated_delta_rule", "fused_gated_delta_rule")
def gated_delta_rule(ctx: NodeCtx) -> None:
    """The gated delta rule over T rows from `state`, one kernel either way: the CPU schedule
    where the value dim splits into CPU_COLS-wide column groups, else the GPU one (which is
    also correct on a CPU). The chunked form (chunk_size > 0) is the same recurrence, so it
    runs these kernels too. When nothing else reads the old state (a decode or verify step),
    the new state is written over it: each thread reads a state cell before it writes that
    cell, and a decode then copies no state. The fused op differs only in its `Reads`."""
    reads = fused_reads(ctx) if ctx.node.op == "fused_gated_delta_rule" else plain_reads(ctx)
    state = ctx.ins[5]
    o, new_state, *rows = ctx.outs
    t, hv, dv = o.type.shape
    dk = state.type.shape[1]
    hk = reads.key_heads
    kh = f"h % {hk}" if ctx.attr.get("head_map", "tiled") == "tiled" else f"h / {hv // hk}"
    shape = (dim(t), dim(dk), dim(dv), hv)
    scale = f32(ctx.attr["scale"])
    source, state_buffers = _old_state(ctx, state, new_state)
    if ctx.profile == "cpu" and isinstance(dv, int) and dv % CPU_COLS == 0:
        body, groups, local = _cpu_body(*shape, kh, scale, bool(rows), source, reads), [str(hv)], (dv // CPU_COLS,)
    else:
        L = pow2_threads(dv, most=64) if isinstance(dv, int) else 64
        body = _gpu_body(*shape, kh, scale, bool(rows), dk, L, source, reads)
        groups, local = [str(hv), cdiv(dim(dv), L)], (L,)
    buffers = [*reads.buffers, *state_buffers, ("o", o, True), ("new_state", new_state, True)]
    ctx.launch(ctx.node.op, body, buffers=buffers + [("row_states", r, True) for r in rows],
               groups=groups, local=local)


def _gpu_body(T: str, DK: str, DV: str, hv: int, kh: str, scale: str, rows: bool, dk, L: int,
              source: str, reads: Reads) -> str:
    """A thread per state column (v head h, value dim col) keeps S[:, col] in registers and
    walks the rows in order, so every reduction over the key dim stays inside the thread;
    the work-group shares each row's q and k through local memory. `source` holds the old
    state (new_state itself when updating in place)."""
    cell = f"(I64(h) * {DK} + e) * {DV} + col"
    emit = f"      for (int e = 0; e < {DK}; ++e) row_states[I64(t) * {hv} * {DK} * {DV} + {cell}] = S[e];\n" if rows else ""
    return (f"  int h = GID(0), lid = LID(0), col = GID(1) * {L} + lid, kh = {kh};\n  bool live = col < {DV};\n"
            f"  LOCAL float qs[{dk}];\n  LOCAL float ks[{dk}];\n  float S[{dk}];\n"
            f"  for (int e = 0; e < {DK}; ++e) S[e] = live ? {source}[{cell}] : 0.0f;\n"
            f"  for (int t = 0; t < {T}; ++t) {{\n{reads.prologue}"
            f"    BARRIER();\n    for (int e = lid; e < {DK}; e += {L}) {{\n"
            f"      qs[e] = {reads.q('e')} * {scale};\n      ks[e] = {reads.k('e')};\n    }}\n    BARRIER();\n"
            f"    float decay = {reads.decay}, b = {reads.beta}, sk = 0.0f, y = 0.0f;\n"
            f"    for (int e = 0; e < {DK}; ++e) {{ S[e] *= decay; sk += S[e] * ks[e]; }}\n"
            f"    float delta = b * ((live ? {reads.v('col')} : 0.0f) - sk);\n"
            f"    for (int e = 0; e < {DK}; ++e) {{ S[e] += ks[e] * delta; y += S[e] * qs[e]; }}\n"
            f"    if (live) {{\n      o[(I64(t) * {hv} + h) * {DV} + col] = y;\n{emit}    }}\n  }}\n"
            f"  if (live) for (int e = 0; e < {DK}; ++e) new_state[{cell}] = S[e];\n")


def _cpu_body(T: str, DK: str, DV: str, hv: int, kh: str, scale: str, rows: bool, source: str,
              reads: Reads) -> str:
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
        return (f"{reads.prologue}    float decay = {reads.decay}, b = {reads.beta};\n"
                f"    {cols} {{ sk[j] = 0.0f; y[j] = 0.0f; }}\n"
                f"    for (int e = 0; e < {DK}; ++e) {{\n      float kv = {reads.k('e')};\n"
                f"      i64 r = (I64(h) * {DK} + e) * {DV} + c0;\n      {cols} sk[j] += {src}[r + j] * kv;\n    }}\n"
                f"    {cols} delta[j] = b * ({reads.v('c0 + j')} - decay * sk[j]);\n"
                f"    for (int e = 0; e < {DK}; ++e) {{\n"
                f"      float kv = {reads.k('e')}, qv = {reads.q('e')} * {scale};\n"
                f"      i64 r = (I64(h) * {DK} + e) * {DV} + c0;\n"
                f"      {cols} {{ float s = decay * {src}[r + j] + kv * delta[j]; y[j] += s * qv; "
                f"new_state[r + j] = s;{emit} }}\n    }}\n"
                f"    {cols} o[(I64(t) * {hv} + h) * {DV} + c0 + j] = y[j];\n")

    copy = (f"  if ({T} == 0) for (int e = 0; e < {DK}; ++e) {{ i64 r = (I64(h) * {DK} + e) * {DV} + c0; "
            f"{cols} new_state[r + j] = state[r + j]; }}\n") if source == "state" else ""
    return (f"  int h = GID(0), c0 = LID(0) * {C}, kh = {kh};\n"
            f"  float sk[{C}], y[{C}], delta[{C}];\n{copy}"
            f"  for (int t = 0; t < min({T}, 1); ++t) {{\n{token(source)}  }}\n"
            f"  for (int t = 1; t < {T}; ++t) {{\n{token('new_state')}  }}\n")
