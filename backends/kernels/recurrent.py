"""Gated DeltaNet state ops: depthwise causal conv1d and the gated delta rule, both with
optional per-row states (what a speculative verify rolls back to)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from dflash_ir.ir import Value

from ..kir import F32, I64, K, call, call_function, cast, minimum, select
from ..kir.build import Buffer
from ..lowering import KernelSpec, NodeCtx, dim, lowers
from .access import SIGMOID, SOFTPLUS, weight_at
from .shapes import FLAT, cdiv, pow2_threads


@dataclass(frozen=True)
class StateBuffers:
    """The buffers a recurrence kernel binds after its inputs: `old` where it reads the old
    state (the `state` input, or `new` itself when the update overwrites it), `out` its
    output, `new` the new state, and `rows` the state after every row when the node emits it."""

    old: Buffer
    out: Buffer
    new: Buffer
    rows: Buffer | None

    @property
    def in_place(self) -> bool:
        return self.old is self.new


def _bind_states(ctx: NodeCtx, kb: KernelSpec, state: Value, out_name: str, allowed: bool = True) -> StateBuffers:
    """Where allowed and nothing else reads the old state, the new state is written over it:
    the kernel then reads the old values through `new_state` and takes no `state` buffer."""
    out, new_state, *rows = ctx.outs
    in_place = allowed and ctx.can_overwrite(state)
    if in_place:
        ctx.alias(new_state, state)
    old = None if in_place else kb.bind("state", state)
    result = kb.bind(out_name, out, writes=True)
    new = kb.bind("new_state", new_state, writes=True)
    row_states = kb.bind("row_states", rows[0], writes=True) if rows else None
    return StateBuffers(new if in_place else old, result, new, row_states)


@lowers("causal_conv1d")
def causal_conv1d(ctx: NodeCtx) -> None:
    """A thread per (row t, channel c) over xx = concat(state, x); the thread of the last row
    also writes the new state (= the window after that row). A single row (decode) whose old
    state nothing else reads shifts the window in place: each thread reads its channel's
    state cells before it overwrites them."""
    x_value, w_value, state = ctx.ins
    t, c = x_value.type.shape
    width = w_value.type.shape[1]
    T, C, K1 = dim(t), dim(c), width - 1
    kb = ctx.kernel("causal_conv1d", local=(FLAT,))
    x, w = kb.bind("x", x_value), kb.bind("w", w_value)
    states = _bind_states(ctx, kb, state, "y", allowed=t == 1)
    i = kb.let("i", kb.gid(0) * FLAT + kb.lid(0))
    kb.return_if(i >= T * C)
    row, ch = kb.let("row", i / C), kb.let("ch", i % C)

    def xx(r: K) -> K:
        return select(r < K1, states.old[r * C + ch], x[cast(I64, r - K1) * C + ch])

    acc = kb.let("acc", 0.0)
    with kb.loop("j", 0, width) as j:
        r = kb.let("r", row + j)
        kb.set(acc, acc + xx(r) * weight_at(w_value.type.dtype, w, ch, j, width))
    states.out[i] = acc * call_function(SIGMOID, acc) if ctx.attr.get("activation", "none") == "silu" else acc
    with kb.loop("e", 0, K1) as e:
        r = kb.let("r", row + 1 + e)
        v = kb.let("v", xx(r))
        if states.rows is not None:
            states.rows[(cast(I64, row) * K1 + e) * C + ch] = v
        with kb.if_(row.eq(T - 1)):
            states.new[e * C + ch] = v
    kb.launch([cdiv(T * C, FLAT)])


CPU_COLS = 8  # CPU schedule: state columns per work-item


@dataclass(frozen=True)
class Token:
    """Token t's inputs to v head h (k head kh), as expressions."""

    q: Callable[[K], K]              # q at key index e (normalised, not yet scaled)
    k: Callable[[K], K]
    v: Callable[[K], K]              # v at value column c
    decay: K                         # e^g
    beta: K


@dataclass(frozen=True)
class Reads:
    """Where a gated delta rule kernel finds token t's inputs: the plain op's q, k, v, g, β
    buffers, or the fused op's conv output and raw gates (whose token starts by normalising
    q and k). `token(t, h, kh)` adds the statements starting token t for v head h to the
    kernel whose buffers the reads were bound in, and returns its inputs."""

    key_heads: int
    token: Callable[[K, K, K], Token]


def _bind_inputs(ctx: NodeCtx, kb: KernelSpec, names: tuple[str, ...]) -> list[Buffer]:
    return [kb.bind(name, value) for name, value in zip(names, ctx.ins)]


def plain_reads(ctx: NodeCtx, kb: KernelSpec) -> Reads:
    q_value, _, v_value = ctx.ins[:3]
    q, k, v, g, beta = _bind_inputs(ctx, kb, ("q", "k", "v", "g", "beta"))
    _, hk, dk = q_value.type.shape
    hv, dv = v_value.type.shape[1:]

    def token(t: K, h: K, kh: K) -> Token:
        def qk(e: K) -> K:
            return (cast(I64, t) * hk + kh) * dim(dk) + e
        return Token(lambda e: q[qk(e)], lambda e: k[qk(e)], lambda c: v[(cast(I64, t) * hv + h) * dim(dv) + c],
                     call("exp", g[t * hv + h]), beta[t * hv + h])
    return Reads(hk, token)


def fused_reads(ctx: NodeCtx, kb: KernelSpec) -> Reads:
    mixed, gate_a, gate_b, dt_bias, ssm_a = _bind_inputs(ctx, kb, ("mixed", "gate_a", "gate_b", "dt_bias", "ssm_a"))
    hv, dk, dv = ctx.ins[5].type.shape
    hk = ctx.attr["key_heads"]
    kd, channels = hk * dk, ctx.ins[0].type.shape[1]
    eps = float(ctx.attr["eps"])

    def token(t: K, h: K, kh: K) -> Token:
        def q_at(e: K) -> K:
            return cast(I64, t) * channels + kh * dk + e

        def k_at(e: K) -> K:
            return cast(I64, t) * channels + kd + kh * dk + e
        qn, kn = kb.let("qn", 0.0), kb.let("kn", 0.0)
        with kb.loop("e", 0, dk) as e:
            qa, ka = kb.let("qa", mixed[q_at(e)]), kb.let("ka", mixed[k_at(e)])
            kb.set(qn, qn + qa * qa)
            kb.set(kn, kn + ka * ka)
        kb.set(qn, 1.0 / call("sqrt", qn + eps))
        kb.set(kn, 1.0 / call("sqrt", kn + eps))
        return Token(lambda e: mixed[q_at(e)] * qn, lambda e: mixed[k_at(e)] * kn,
                     lambda c: mixed[cast(I64, t) * channels + 2 * kd + h * dv + c],
                     call("exp", call_function(SOFTPLUS, gate_a[t * hv + h] + dt_bias[h]) * ssm_a[h]),
                     call_function(SIGMOID, gate_b[t * hv + h]))
    return Reads(hk, token)


@dataclass(frozen=True)
class DeltaRule:
    """One gated delta rule node as both schedules see it: T rows, the DK x DV state of each
    of hv v heads, how a v head finds its k head, q's scale, where token t's inputs are
    read, and the output and state buffers."""

    T: K
    DK: K
    DV: K
    hv: int
    tiled: bool
    scale: float
    reads: Reads
    states: StateBuffers

    def key_head(self, h: K) -> K:
        hk = self.reads.key_heads
        return h % hk if self.tiled else h / (self.hv // hk)

    def state_row(self, h: K, e: K) -> K:
        """Offset of row e of v head h's state."""
        return (cast(I64, h) * self.DK + e) * self.DV

    def row_states_at(self, t: K) -> K:
        """Offset of the state after token t in the per-row states."""
        return cast(I64, t) * self.hv * self.DK * self.DV

    def out_row(self, t: K, h: K) -> K:
        return (cast(I64, t) * self.hv + h) * self.DV


@lowers("gated_delta_rule", "fused_gated_delta_rule")
def gated_delta_rule(ctx: NodeCtx) -> None:
    """The gated delta rule over T rows from `state`, one kernel either way: the CPU schedule
    where the value dim splits into CPU_COLS-wide column groups, else the GPU one (which is
    also correct on a CPU). The chunked form (chunk_size > 0) is the same recurrence, so it
    runs these kernels too. When nothing else reads the old state (a decode or verify step),
    the new state is written over it: each thread reads a state cell before it writes that
    cell, and a decode then copies no state. The fused op differs only in its `Reads`."""
    state = ctx.ins[5]
    t, hv, dv = ctx.outs[0].type.shape
    dk = state.type.shape[1]
    cpu = ctx.profile == "cpu" and isinstance(dv, int) and dv % CPU_COLS == 0
    L = dv // CPU_COLS if cpu else pow2_threads(dv, most=64) if isinstance(dv, int) else 64
    kb = ctx.kernel(ctx.node.op, local=(L,))
    reads = (fused_reads if ctx.node.op == "fused_gated_delta_rule" else plain_reads)(ctx, kb)
    rule = DeltaRule(dim(t), dim(dk), dim(dv), hv, ctx.attr.get("head_map", "tiled") == "tiled",
                     float(ctx.attr["scale"]), reads, _bind_states(ctx, kb, state, "o"))
    if cpu:
        _cpu_body(kb, rule)
        kb.launch([hv])
    else:
        _gpu_body(kb, rule, dk, L)
        kb.launch([hv, cdiv(rule.DV, L)])


def _gpu_body(kb: KernelSpec, rule: DeltaRule, dk: int, L: int) -> None:
    """A thread per state column (v head h, value dim col) keeps S[:, col] in registers and
    walks the rows in order, so every reduction over the key dim stays inside the thread;
    the work-group shares each row's q and k through local memory."""
    T, DK, DV, states = rule.T, rule.DK, rule.DV, rule.states
    h, lid = kb.let("h", kb.gid(0)), kb.let("lid", kb.lid(0))
    col = kb.let("col", kb.gid(1) * L + lid)
    kh = kb.let("kh", rule.key_head(h))
    live = kb.let("live", col < DV)
    qs, ks = kb.array("qs", F32, dk, "local"), kb.array("ks", F32, dk, "local")
    S = kb.array("S", F32, dk)

    def cell(e: K) -> K:
        return rule.state_row(h, e) + col

    with kb.loop("e", 0, DK) as e:
        S[e] = select(live, states.old[cell(e)], 0.0)
    with kb.loop("t", 0, T) as t:
        token = rule.reads.token(t, h, kh)
        kb.barrier()
        with kb.loop("e", lid, DK, L) as e:
            qs[e] = token.q(e) * rule.scale
            ks[e] = token.k(e)
        kb.barrier()
        decay, b = kb.let("decay", token.decay), kb.let("b", token.beta)
        sk, y = kb.let("sk", 0.0), kb.let("y", 0.0)
        with kb.loop("e", 0, DK) as e:
            S[e] = S[e] * decay
            kb.set(sk, sk + S[e] * ks[e])
        delta = kb.let("delta", b * (select(live, token.v(col), 0.0) - sk))
        with kb.loop("e", 0, DK) as e:
            S[e] = S[e] + ks[e] * delta
            kb.set(y, y + S[e] * qs[e])
        with kb.if_(live):
            states.out[rule.out_row(t, h) + col] = y
            if states.rows is not None:
                with kb.loop("e", 0, DK) as e:
                    states.rows[rule.row_states_at(t) + cell(e)] = S[e]
    with kb.if_(live), kb.loop("e", 0, DK) as e:
        states.new[cell(e)] = S[e]


def _cpu_body(kb: KernelSpec, rule: DeltaRule) -> None:
    """A work-item per (v head, CPU_COLS state columns) streams the state rows twice per
    token, once for k·S and once to write the updated rows (and sum y), with nothing held
    but CPU_COLS-wide sums: the inner loops over contiguous columns become vector loads and
    FMAs, where a thread holding a whole column does not vectorise. Row 0 reads the old
    state (new_state itself in place); later rows read the rows the previous token wrote
    to new_state."""
    T, DK, states = rule.T, rule.DK, rule.states
    h, c0 = kb.let("h", kb.gid(0)), kb.let("c0", kb.lid(0) * CPU_COLS)
    kh = kb.let("kh", rule.key_head(h))
    sk, y, delta = (kb.array(name, F32, CPU_COLS) for name in ("sk", "y", "delta"))

    def columns():
        return kb.loop("j", 0, CPU_COLS)

    def token(t: K, src: Buffer) -> None:
        reads = rule.reads.token(t, h, kh)
        decay, b = kb.let("decay", reads.decay), kb.let("b", reads.beta)
        with columns() as j:
            sk[j] = 0.0
            y[j] = 0.0
        with kb.loop("e", 0, DK) as e:
            kv = kb.let("kv", reads.k(e))
            r = kb.let("r", rule.state_row(h, e) + c0)
            with columns() as j:
                sk[j] = sk[j] + src[r + j] * kv
        with columns() as j:
            delta[j] = b * (reads.v(c0 + j) - decay * sk[j])
        with kb.loop("e", 0, DK) as e:
            kv, qv = kb.let("kv", reads.k(e)), kb.let("qv", reads.q(e) * rule.scale)
            r = kb.let("r", rule.state_row(h, e) + c0)
            with columns() as j:
                s = kb.let("s", decay * src[r + j] + kv * delta[j])
                y[j] = y[j] + s * qv
                states.new[r + j] = s
                if states.rows is not None:
                    states.rows[rule.row_states_at(t) + r + j] = s
        with columns() as j:
            states.out[rule.out_row(t, h) + c0 + j] = y[j]

    if not states.in_place:  # no token runs when T is 0: the new state is the old one
        with kb.if_(T.eq(0)), kb.loop("e", 0, DK) as e:
            r = kb.let("r", rule.state_row(h, e) + c0)
            with columns() as j:
                states.new[r + j] = states.old[r + j]
    with kb.loop("t", 0, minimum(T, 1)) as t:
        token(t, states.old)
    with kb.loop("t", 1, T) as t:
        token(t, states.new)
