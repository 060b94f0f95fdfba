"""Gated DeltaNet state ops: depthwise causal conv1d and the gated delta rule, and the whole
layer between its projections (fused_gated_deltanet: conv, recurrence, output norm and gate) as
one kernel on the gated delta rule's schedules."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

from dflash_ir import activations
from dflash_ir.dtypes import DType
from dflash_ir.ir import Value
from dflash_ir.ops.recurrent import delta_error, delta_update

from ..kir import F32, I64, K, call, cast, const, minimum, select, vsum
from ..kir.build import Array, Buffer
from ..lowering import KernelSpec, NodeCtx, NodeCtxBase, dim, lowers
from .access import KERNEL, inline, weight_at
from .linalg import Q8_VALUES, store_q8_block, store_q8_blocks
from .shapes import FLAT, cdiv, pow2_threads


@dataclass(frozen=True)
class StateBuffers:
    """The buffers a recurrence kernel binds for one state: `old` where it reads the old
    state (the `state` input, or `new` itself when the update overwrites it), `out` its
    output (if bound with the state) and `new` the new state."""

    old: Buffer
    out: Buffer | None
    new: Buffer

    @property
    def in_place(self) -> bool:
        return self.old is self.new


def _bind_state(ctx: NodeCtx, kb: KernelSpec, state: Value, new_state: Value, *, out: tuple[str, Value] | None = None, allowed: bool = True, prefix: str = "") -> StateBuffers:
    """Where allowed and nothing else reads the old state, the new state is written over it:
    the kernel then reads the old values through `new_state` and takes no `state` buffer."""
    in_place = allowed and ctx.can_overwrite(state)
    if in_place:
        ctx.alias(new_state, state)
    old = None if in_place else kb.bind(f"{prefix}state", state)
    result = kb.bind(out[0], out[1], writes=True) if out else None
    new = kb.bind(f"{prefix}new_state", new_state, writes=True)
    return StateBuffers(new if in_place else old, result, new)


def _bind_states(ctx: NodeCtx, kb: KernelSpec, state: Value, out_name: str, allowed: bool = True) -> StateBuffers:
    """The state of a node whose outputs are (out, new state)."""
    out, new_state = ctx.outs
    return _bind_state(ctx, kb, state, new_state, out=(out_name, out), allowed=allowed)


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
    states.out[i] = activations.silu(KERNEL, acc) if ctx.attr.get("activation", "none") == "silu" else acc
    with kb.if_(row.eq(T - 1)), kb.loop("e", 0, K1) as e:
        states.new[e * C + ch] = xx(row + 1 + e)
    kb.launch([cdiv(T * C, FLAT)])


CPU_COLS = 8  # CPU schedule: state columns per work-item
VECTOR_LANES = 16  # CPU vector schedule: the widest vector of state columns
VECTORS = 8  # CPU vector schedule: column vectors whose sums a pass over the state rows keeps in registers
MAX_GROUP = 1024  # work-items a fused_gated_deltanet work-group may hold (CUDA's, and most Vulkan devices')


@dataclass(frozen=True)
class Token:
    """Token t's inputs to v head h (k head kh), as expressions."""

    q: Callable[[K], K]              # q at key index e (normalised, not yet scaled)
    k: Callable[[K], K]
    v: Callable[[K], K]              # v at value column c (may add the statements computing it)
    decay: K                         # e^g
    beta: K
    v_raw: Callable[[K], K] | None = None  # where v is silu of this (a conv's output): v before its SiLU


@dataclass(frozen=True)
class Reads:
    """Where a gated delta rule kernel finds token t's inputs: the plain op's q, k, v, g, β
    buffers, the fused op's conv output and raw gates (whose token starts by normalising
    q and k), or the layer op's conv input. `token(t, kh)` adds the statements starting
    token t for k head kh (q and k) to the kernel whose buffers the reads were bound in, and
    returns a function that adds those of one of its v heads h and returns its inputs.
    `shared`: q and k are read from work-group memory that the token's own statements fill
    (ending with a barrier), so a schedule need not copy them there."""

    key_heads: int
    token: Callable[[K, K], Callable[[K], Token]]
    shared: bool = False


def _bind_inputs(ctx: NodeCtx, kb: KernelSpec, names: tuple[str, ...]) -> list[Buffer]:
    return [kb.bind(name, value) for name, value in zip(names, ctx.ins)]


def plain_reads(ctx: NodeCtx, kb: KernelSpec) -> Reads:
    q_value, _, v_value = ctx.ins[:3]
    q, k, v, g, beta = _bind_inputs(ctx, kb, ("q", "k", "v", "g", "beta"))
    _, hk, dk = q_value.type.shape
    hv, dv = v_value.type.shape[1:]

    def token(t: K, kh: K) -> Callable[[K], Token]:
        def qk(e: K) -> K:
            return (cast(I64, t) * hk + kh) * dim(dk) + e
        return lambda h: Token(lambda e: q[qk(e)], lambda e: k[qk(e)],
                               lambda c: v[(cast(I64, t) * hv + h) * dim(dv) + c], call("exp", g[t * hv + h]),
                               beta[t * hv + h])
    return Reads(hk, token)


def _gates(gate_a: Buffer, gate_b: Buffer, dt_bias: Buffer, ssm_a: Buffer, hv: int, t: K, h: K) -> tuple[K, K]:
    """The decay e^(softplus(a + dt_bias) · ssm_a) and β = sigmoid(b) of token t, v head h."""
    return call("exp", KERNEL.softplus(gate_a[t * hv + h] + dt_bias[h]) * ssm_a[h]), KERNEL.sigmoid(gate_b[t * hv + h])


def fused_reads(ctx: NodeCtx, kb: KernelSpec) -> Reads:
    mixed, gate_a, gate_b, dt_bias, ssm_a = _bind_inputs(ctx, kb, ("mixed", "gate_a", "gate_b", "dt_bias", "ssm_a"))
    hv, dk, dv = ctx.ins[5].type.shape
    hk = ctx.attr["key_heads"]
    kd, channels = hk * dk, ctx.ins[0].type.shape[1]
    eps = float(ctx.attr["eps"])

    def token(t: K, kh: K) -> Callable[[K], Token]:
        def q_at(e: K) -> K:
            return cast(I64, t) * channels + kh * dk + e

        def k_at(e: K) -> K:
            return cast(I64, t) * channels + kd + kh * dk + e
        qn, kn = kb.let("qn", 0.0), kb.let("kn", 0.0)
        with kb.loop("e", 0, dk) as e:
            qa, ka = kb.let("qa", mixed[q_at(e)]), kb.let("ka", mixed[k_at(e)])
            kb.set(qn, qn + qa * qa)
            kb.set(kn, kn + ka * ka)
        kb.set(qn, activations.inverse_rms(KERNEL, qn, None, eps))
        kb.set(kn, activations.inverse_rms(KERNEL, kn, None, eps))
        return lambda h: Token(lambda e: mixed[q_at(e)] * qn, lambda e: mixed[k_at(e)] * kn,
                               lambda c: mixed[cast(I64, t) * channels + 2 * kd + h * dv + c],
                               *_gates(gate_a, gate_b, dt_bias, ssm_a, hv, t, h))
    return Reads(hk, token)


@dataclass(frozen=True)
class Conv:
    """The causal conv + SiLU inside a fused_gated_deltanet kernel, over xx = concat(conv
    state, x) ([K-1 + T rows, C channels]). Each channel is convolved, and its states
    written, by one work-item of one work-group: the k head's group takes the k head's q
    and k channels (work-item i those at i, i + L, ...), the item owning a value column
    its v channel. That item reads a channel's old state before it writes the channel's
    new state, so the new state may overwrite the old one, for any number of rows."""

    x: Buffer
    w: Buffer
    w_dtype: DType
    width: int
    channels: int
    key_heads: int
    dk: int
    dv: int
    T: K
    states: StateBuffers

    def xx(self, r: K, ch: K) -> K:
        k1, c = self.width - 1, self.channels
        return select(r < k1, self.states.old[r * c + ch], self.x[cast(I64, r - k1) * c + ch])

    def raw(self, kb: KernelSpec, t: K, ch: K) -> K:
        """The conv output of token t, channel ch (the window xx[t .. t + K-1])."""
        taps = [self.xx(t + j, ch) * weight_at(self.w_dtype, self.w, ch, j, self.width) for j in range(self.width)]
        return kb.let("conv", functools.reduce(lambda a, b: a + b, taps))

    def silu(self, kb: KernelSpec, t: K, ch: K) -> K:
        conv = self.raw(kb, t, ch)
        return activations.silu(KERNEL, conv)

    def key_channels(self, kb: KernelSpec):
        """Loop over this work-item's share i of the 2·dk q and k channels of its k head."""
        return kb.loop("i", kb.lid(0), 2 * self.dk, kb.local[0])

    def qk_channel(self, kh: K, i: K) -> K:
        """The channel of q (i < dk) or k (i - dk) element i of k head kh."""
        kd = self.key_heads * self.dk
        return kh * self.dk + i + select(i < self.dk, 0, kd - self.dk)

    def v_channel(self, h: K, c: K) -> K:
        return 2 * self.key_heads * self.dk + h * self.dv + c

    def write(self, kb: KernelSpec, ch: K) -> None:
        """Channel ch of the new state: xx rows T .. T+K-2 (rows of the old state are read
        before row e is overwritten: e < T + e)."""
        k1, c = self.width - 1, self.channels
        with kb.loop("e", 0, k1) as e:
            self.states.new[e * c + ch] = self.xx(self.T + e, ch)

    def write_key_head(self, kb: KernelSpec, kh: K) -> None:
        with self.key_channels(kb) as i:
            self.write(kb, kb.let("ch", self.qk_channel(kh, i)))


def _sum_squares(kb: KernelSpec, arr: Array, start: int, n: int, name: str) -> K:
    """Σ arr[start .. start+n)², CPU_COLS lanes wide where n allows (independent partial sums)."""
    lanes = CPU_COLS if n % CPU_COLS == 0 else 1
    acc = kb.let(name, cast(F32.vec(lanes), 0.0))
    with kb.loop("e", 0, n // lanes) as e:
        v = kb.let(f"{name}v", arr.vec(start + e * lanes, lanes) if lanes > 1 else arr[start + e])
        kb.set(acc, acc + v * v)
    return vsum(acc) if lanes > 1 else acc


def conv_reads(kb: KernelSpec, conv: Conv, gates: Callable[[K, K], tuple[K, K]], eps: float,
               lanes: int = 1) -> Reads:
    """A fused_gated_deltanet token: the work-group convolves its k head's q and k channels
    into work-group memory, then every work-item takes their L2 norms from there; v is
    convolved where it is read, by the work-item owning the column. (The next token
    overwrites q and k only after the barriers of this token's output norm.) With `lanes`
    (a one-item work-group: no barrier), the SiLU of q and k is taken `lanes` channels at a
    time, and a token offers v before its SiLU (`v_raw`) for the same."""
    dk = conv.dk
    qk = kb.array("qk", F32, 2 * dk, "local")

    def token(t: K, kh: K) -> Callable[[K], Token]:
        if lanes > 1:
            with kb.loop("i", 0, 2 * dk, lanes) as i:
                with kb.loop("l", 0, lanes) as j:
                    qk[i + j] = conv.raw(kb, t, kb.let("ch", conv.qk_channel(kh, i + j)))
                kb.set(qk.vec(i, lanes), activations.silu(inline(kb, "qke"), qk.vec(i, lanes)))
        else:
            with conv.key_channels(kb) as i:
                qk[i] = conv.silu(kb, t, kb.let("ch", conv.qk_channel(kh, i)))
            kb.barrier()
        qn = kb.let("qn", activations.inverse_rms(KERNEL, _sum_squares(kb, qk, 0, dk, "qss"), None, eps))
        kn = kb.let("kn", activations.inverse_rms(KERNEL, _sum_squares(kb, qk, dk, dk, "kss"), None, eps))
        return lambda h: Token(lambda e: qk[e] * qn, lambda e: qk[e + dk] * kn,
                               lambda c: conv.silu(kb, t, conv.v_channel(h, c)), *gates(t, h),
                               v_raw=lambda c: conv.raw(kb, t, conv.v_channel(h, c)))
    return Reads(conv.key_heads, token, shared=True)


@dataclass(frozen=True)
class NormGate:
    """A fused_gated_deltanet's output: each v head's output row y RMS-normalised with
    norm_w, times silu(z), in rmsnorm's and the gate's order: ((y · r) · w) · silu(z). The
    row's sum of squares is reduced in work-group memory over the head's `seg` work-items
    (the work-group holds every v head of a k head, `whole` when that is one v head)."""

    red: Array | None
    z: Buffer
    w: Buffer
    w_dtype: DType
    hv: int
    dv: int
    eps: float
    seg: int
    whole: bool

    def factor(self, kb: KernelSpec, lid: K, p: K, partial: K) -> K:
        """r = 1 / sqrt(mean of squares + eps) of the v head of work-item lid (place p in
        its head), from every work-item's `partial` sum of squares."""
        red, seg = self.red, self.seg
        red[lid] = partial
        if self.whole and seg & (seg - 1) == 0:
            kb.wg_reduce(red, seg, "sum")
            total = red[0]
        else:  # wg_reduce's tree within each v head's run of work-items, of any length
            kb.barrier()
            with kb.loop("s", _pow2(seg) // 2, cond=lambda s: s > 0, next=lambda s: s >> 1) as s:
                with kb.if_((p < s) & (p + s < seg)):
                    red[lid] = red[lid] + red[lid + s]
                kb.barrier()
            total = red[lid - p]
        return self.inverse_rms(kb, total)

    def inverse_rms(self, kb: KernelSpec, total: K) -> K:
        """r from a v head's whole sum of squares."""
        return kb.let("rn", activations.inverse_rms(KERNEL, total, self.dv, self.eps))

    def _z(self, t: K, h: K, c: K) -> K:
        return (cast(I64, t) * self.hv + h) * self.dv + c

    def apply(self, kb: KernelSpec, scaled: K, t: K, h: K, c: K, gate: K | None = None) -> K:
        """The output at value column c from y · r (and silu(z) at c, if taken already)."""
        if gate is None:
            z = kb.let("zg", self.z[self._z(t, h, c)])
            gate = activations.silu(KERNEL, z)
        return scaled * weight_at(self.w_dtype, self.w, const(0), c, self.dv) * gate

    def gates(self, kb: KernelSpec, t: K, h: K, c: K, lanes: int) -> K:
        """silu(z) at value columns c .. c + lanes - 1, as one vector."""
        return activations.silu(inline(kb, "ze"), kb.let("zv", self.z.load(self._z(t, h, c), lanes=lanes)))


@dataclass(frozen=True)
class DeltaRule:
    """One gated delta rule node as both schedules see it: T rows, the DK x DV state of each
    of hv v heads, how a v head finds its k head, q's scale, where token t's inputs are
    read, and the output and state buffers. A fused_gated_deltanet node adds `seg` (a
    work-group per k head holding its v heads, seg work-items each), the output norm and
    gate, and the conv whose states it writes."""

    T: K
    DK: K
    DV: K
    hv: int
    tiled: bool
    scale: float
    reads: Reads
    states: StateBuffers
    seg: int = 0
    norm: NormGate | None = None
    conv: Conv | None = None
    q8_out: bool = False

    def key_head(self, h: K) -> K:
        hk = self.reads.key_heads
        return h % hk if self.tiled else h / (self.hv // hk)

    def group_heads(self, kb: KernelSpec, lid: K) -> tuple[K, K, K]:
        """(k head, v head, place in the v head) of work-item lid of a k head's work-group."""
        kh = kb.let("kh", kb.gid(0))
        return kh, kb.let("h", self.group_head(kh, lid / self.seg)), kb.let("p", lid % self.seg)

    def group_head(self, kh: K, sub: K) -> K:
        """The v head in place `sub` of k head kh's work-group."""
        hk = self.reads.key_heads
        return kh + sub * hk if self.tiled else kh * (self.hv // hk) + sub

    @property
    def q8_blocks(self) -> int:
        """Q8_0 blocks of a v head's output row (`q8_out`: the value dim is a multiple of 32)."""
        return self.DV.arg // Q8_VALUES

    def store_q8_row(self, kb: KernelSpec, t: K, h: K, values: Callable[[K], K]) -> None:
        """v head h's output row of token t (values(c)) as its Q8_0 blocks (`q8_out`)."""
        store_q8_blocks(kb, self.states.out, (cast(I64, t) * self.hv + h) * self.q8_blocks, self.q8_blocks, values)

    def store_q8_group(self, kb: KernelSpec, t: K, kh: K, lid: K, rows: Array) -> None:
        """Token t's output rows of k head kh's work-group as Q8_0 blocks (`q8_out`), from
        `rows` (work-group memory: its v heads' rows side by side), a block per work-item in
        turn, between barriers (the rows are written before, and the next token's after)."""
        per_head, per = self.q8_blocks, self.hv // self.reads.key_heads
        kb.barrier()
        with kb.loop("qb", lid, per * per_head, per * self.seg) as i:
            h = kb.let("qh", self.group_head(kh, i / per_head))
            store_q8_block(kb, self.states.out, (cast(I64, t) * self.hv + h) * per_head + i % per_head,
                           lambda e: rows[i * Q8_VALUES + e])
        kb.barrier()

    def state_row(self, h: K, e: K) -> K:
        """Offset of row e of v head h's state."""
        return (cast(I64, h) * self.DK + e) * self.DV

    def out_row(self, t: K, h: K) -> K:
        return (cast(I64, t) * self.hv + h) * self.DV


@lowers("gated_delta_rule", "fused_gated_delta_rule")
def gated_delta_rule(ctx: NodeCtx) -> None:
    """The gated delta rule over T rows from `state`, one kernel either way: on a CPU the
    vector schedule (_cpu_vector_body) where its compiler keeps vectors, else the CPU
    schedule where the value dim splits into CPU_COLS-wide column groups (lavapipe), else
    the GPU one (which is also correct on a CPU). The chunked form (chunk_size > 0) is the same recurrence, so it
    runs these kernels too. When nothing else reads the old state (a decode or verify step),
    the new state is written over it: each thread reads a state cell before it writes that
    cell, and a decode then copies no state. The fused op differs only in its `Reads`."""
    state = ctx.ins[5]
    t, hv, dv = ctx.outs[0].type.shape
    dk = state.type.shape[1]
    lanes = _vector_lanes(ctx, dv)
    cpu = ctx.profile == "cpu" and isinstance(dv, int) and dv % CPU_COLS == 0
    L = 1 if lanes else dv // CPU_COLS if cpu else pow2_threads(dv, most=64) if isinstance(dv, int) else 64
    kb = ctx.kernel(ctx.node.op, local=(L,))
    reads = (fused_reads if ctx.node.op == "fused_gated_delta_rule" else plain_reads)(ctx, kb)
    rule = DeltaRule(dim(t), dim(dk), dim(dv), hv, ctx.attr.get("head_map", "tiled") == "tiled",
                     float(ctx.attr["scale"]), reads, _bind_states(ctx, kb, state, "o"))
    if lanes:
        _cpu_vector_body(kb, rule, dv, lanes)
        kb.launch([hv])
    elif cpu:
        _cpu_body(kb, rule)
        kb.launch([hv])
    else:
        _gpu_body(kb, rule, dk, L)
        kb.launch([hv, cdiv(rule.DV, L)])


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _vector_lanes(ctx: NodeCtx, dv) -> int:
    """The lanes of _cpu_vector_body's column vectors, or 0 where it does not apply: a CPU
    whose compiler keeps vectors (PoCL, not lavapipe: row_streams) and a value dim with a
    power-of-two divisor of at least 4."""
    if ctx.profile != "cpu" or ctx.row_streams <= 1 or not isinstance(dv, int):
        return 0
    lanes = _divisor_lanes(dv, VECTOR_LANES)
    return lanes if lanes >= 4 else 0


def _divisor_lanes(n: int, most: int) -> int:
    """The largest power of two up to `most` that divides n (at least 1)."""
    lanes = max(most, 1)
    while n % lanes:
        lanes //= 2
    return lanes


@lowers("fused_gated_deltanet")
def gated_deltanet(ctx: NodeCtx) -> None:
    """A Gated DeltaNet layer between its projections in one kernel: a work-group per k head
    holds all the v heads reading it, so the k head's q and k channels are convolved once
    and each conv channel, whose state the kernel shifts, is read by one work-group only
    (the state is then updated in place whenever nothing else reads it, as the recurrent
    state is). Per token: conv + SiLU of the k head's q and k into work-group memory,
    their L2 norms, the recurrence of each v head (the schedules of gated_delta_rule: the
    CPU vector one, one work-item taking the v heads in turn; CPU where the value dim
    splits into CPU_COLS-wide groups; a work-item per value column otherwise), then the
    head's RMSNorm, reduced over its work-items, and the silu(z) gate. A k head whose v
    heads would not fit a work-group is lowered as the parts. With `q8_out` each head's
    output row is quantised where it is made: by its work-item, or by the work-group's items
    a block each from work-group memory."""
    x, conv_w, conv_state, gate_a, gate_b, dt_bias, ssm_a, state, z, norm_w = ctx.ins
    y, conv_new, new_state = ctx.outs
    t, (hv, dk, dv) = x.type.shape[0], state.type.shape
    hk = ctx.attr["key_heads"]
    per = hv // hk
    lanes = _vector_lanes(ctx, dv)
    cpu = ctx.profile == "cpu" and dv % CPU_COLS == 0
    # work-items per v head: none idle (PoCL ran guarded stores of idle ones)
    seg = 1 if lanes else dv // CPU_COLS if cpu else dv
    if per * seg > MAX_GROUP:
        gated_deltanet_parts(ctx)
        return
    kb = ctx.kernel(ctx.node.op, local=(1 if lanes else per * seg,))
    xb, wb, ab, bb, dtb, sab, zb, nwb = (kb.bind(name, v) for name, v in (
        ("x", x), ("conv_w", conv_w), ("gate_a", gate_a), ("gate_b", gate_b), ("dt_bias", dt_bias), ("ssm_a", ssm_a),
        ("z", z), ("norm_w", norm_w)))
    conv = Conv(xb, wb, conv_w.type.dtype, conv_w.type.shape[1], x.type.shape[1], hk, dk, dv, dim(t),
                _bind_state(ctx, kb, conv_state, conv_new, prefix="conv_"))
    states = _bind_state(ctx, kb, state, new_state, out=("o", y))
    reads = conv_reads(kb, conv, lambda t_, h: _gates(ab, bb, dtb, sab, hv, t_, h), float(ctx.attr["eps"]),
                       _divisor_lanes(2 * dk, lanes))
    norm = NormGate(None if lanes else kb.array("red", F32, per * seg, "local"), zb, nwb, norm_w.type.dtype, hv, dv,
                    float(ctx.attr["norm_eps"]), seg, per == 1)
    rule = DeltaRule(dim(t), dim(dk), dim(dv), hv, ctx.attr.get("head_map", "tiled") == "tiled",
                     float(ctx.attr["scale"]), reads, states, seg, norm, conv, bool(ctx.attr.get("q8_out", False)))
    if lanes:
        _cpu_vector_body(kb, rule, dv, lanes)
    elif cpu:
        _cpu_body(kb, rule)
    else:
        _gpu_body(kb, rule, dk, per * seg)
    kb.launch([hk])


def gated_deltanet_parts(ctx: NodeCtxBase) -> None:
    """fused_gated_deltanet as its parts' kernels (its reference's composition): the conv with
    SiLU, fused_gated_delta_rule, rmsnorm and the gate (with `q8_out`, its rows quantised).
    Written against `ctx.sub` alone, so the TVM lowering registers it too."""
    x, conv_w, conv_state, gate_a, gate_b, dt_bias, ssm_a, state, z, norm_w = ctx.ins
    y, conv_new, new_state = ctx.outs
    a = ctx.attr
    mixed = ctx.sub("causal_conv1d", x, conv_w, conv_state, outputs=[ctx.temp(x.type), conv_new],
                    activation="silu")[0]
    rule = {n: a[n] for n in ("key_heads", "eps", "scale", "head_map", "chunk_size") if n in a}
    o = ctx.sub("fused_gated_delta_rule", mixed, gate_a, gate_b, dt_bias, ssm_a, state,
                outputs=[ctx.temp(z.type), new_state], **rule)[0]
    gated = (ctx.sub("rmsnorm", o, norm_w, eps=a["norm_eps"]), ctx.sub("silu", z))
    if not a.get("q8_out"):
        ctx.sub("mul", *gated, outputs=[y])
        return
    rows = ctx.sub("reshape", ctx.sub("mul", *gated), shape=y.type.shape)
    ctx.sub("quantize_q8_0", rows, outputs=[y])


def _gpu_body(kb: KernelSpec, rule: DeltaRule, dk: int, L: int) -> None:
    """A thread per state column (v head h, value dim col) keeps S[:, col] in registers and
    walks the rows in order, so every reduction over the key dim stays inside the thread;
    the work-group shares each row's q and k through local memory (a fused_gated_deltanet
    token leaves them there itself, and its work-group holds whole v heads, so their
    output norms are reduced inside it)."""
    T, DK, DV, states = rule.T, rule.DK, rule.DV, rule.states
    if rule.seg:
        lid = kb.let("lid", kb.lid(0))
        kh, h, col = rule.group_heads(kb, lid)
    else:
        h, lid = kb.let("h", kb.gid(0)), kb.let("lid", kb.lid(0))
        col = kb.let("col", kb.gid(1) * L + lid)
        kh = kb.let("kh", rule.key_head(h))
    live = kb.let("live", col < DV)
    shared = rule.reads.shared
    if not shared:
        qs, ks = kb.array("qs", F32, dk, "local"), kb.array("ks", F32, dk, "local")
    S = kb.array("S", F32, dk)
    rows = _group_rows(kb, rule)

    def cell(e: K) -> K:
        return rule.state_row(h, e) + col

    with kb.loop("e", 0, DK) as e:
        S[e] = select(live, states.old[cell(e)], 0.0)
    with kb.loop("t", 0, T) as t:
        token = rule.reads.token(t, kh)(h)
        if shared:
            q_at, k_at = (lambda e: token.q(e) * rule.scale), token.k
        else:
            kb.barrier()
            with kb.loop("e", lid, DK, L) as e:
                qs[e] = token.q(e) * rule.scale
                ks[e] = token.k(e)
            kb.barrier()
            q_at, k_at = qs.__getitem__, ks.__getitem__
        decay, b = kb.let("decay", token.decay), kb.let("b", token.beta)
        sk, y = kb.let("sk", 0.0), kb.let("y", 0.0)
        with kb.loop("e", 0, DK) as e:
            kb.set(sk, sk + S[e] * k_at(e))
        # (a conv's v statements run on every thread: a fused_gated_deltanet's threads are all live)
        delta = kb.let("delta", delta_error(select(live, token.v(col), 0.0), sk, decay, b))
        with kb.loop("e", 0, DK) as e:
            S[e] = delta_update(S[e], k_at(e), delta, decay)
            kb.set(y, y + S[e] * q_at(e))
        if rule.norm is not None:
            r = rule.norm.factor(kb, lid, col, y * y)  # a v head's threads are all live
        if rows is not None:  # (q8_out: a fused layer's, whose threads are all live)
            rows[lid] = rule.norm.apply(kb, y * r, t, h, col)
            rule.store_q8_group(kb, t, kh, lid, rows)
        else:
            with kb.if_(live):
                states.out[rule.out_row(t, h) + col] = y if rule.norm is None else rule.norm.apply(kb, y * r, t, h, col)
    with kb.if_(live), kb.loop("e", 0, DK) as e:
        states.new[cell(e)] = S[e]
    if rule.conv is not None:
        rule.conv.write_key_head(kb, kh)
        with kb.if_(live):
            rule.conv.write(kb, rule.conv.v_channel(h, col))


def _group_rows(kb: KernelSpec, rule: DeltaRule) -> Array | None:
    """With `q8_out`, work-group memory for a token's output rows of the work-group's v heads
    side by side (DeltaRule.store_q8_group quantises them); None without."""
    if not rule.q8_out:
        return None
    return kb.array("ys", F32, rule.hv // rule.reads.key_heads * rule.DV.arg, "local")


def _walk_tokens(kb: KernelSpec, rule: DeltaRule, kh: K, token: Callable[[K, Buffer], None]) -> None:
    """token(t, rows) for every token: token 0 reads the old state (new_state itself in
    place), later ones the rows the token before wrote to new_state; then the conv state's
    q and k channels of k head kh (the v channels are the schedule's to write)."""
    with kb.loop("t", 0, minimum(rule.T, 1)) as t:
        token(t, rule.states.old)
    with kb.loop("t", 1, rule.T) as t:
        token(t, rule.states.new)
    if rule.conv is not None:
        rule.conv.write_key_head(kb, kh)


def _cpu_vector_body(kb: KernelSpec, rule: DeltaRule, dv: int, lanes: int) -> None:
    """A work-item per v head (in a fused_gated_deltanet kernel, a one-item work-group per k
    head, taking its v heads in turn) holds the head's state columns as `lanes`-wide
    vectors, VECTORS of them in registers per pass: per token, one pass over the state rows
    sums k·S, the next writes the updated rows and sums y, a column group at a time. No
    barrier and no work-group memory between the passes: on a CPU, a work-group of items
    that share a token through work-group memory (_cpu_body) spends most of its time on
    the barriers' bookkeeping (PoCL keeps each item's live values in memory across them).
    Each column's arithmetic is _cpu_body's, so a row's result does not depend on how many
    rows share the call; the output norm sums the head's squares in vector order."""
    T, DK, states = rule.T, rule.DK, rule.states
    V, n = F32.vec(lanes), dv // lanes
    groups = [range(g, min(g + VECTORS, n)) for g in range(0, n, VECTORS)]
    if rule.seg:
        kh = kb.let("kh", kb.gid(0))
        per = rule.hv // rule.reads.key_heads

        def head(sub: K) -> K:
            return kb.let("h", kh + sub * rule.reads.key_heads if rule.tiled else kh * per + sub)
    else:
        per, h0 = 1, kb.let("h", kb.gid(0))
        kh = kb.let("kh", rule.key_head(h0))

        def head(sub: K) -> K:
            return h0
    vv, yy = kb.array("vv", F32, dv), kb.array("yy", F32, dv)

    def token(t: K, src: Buffer) -> None:
        key_head = rule.reads.token(t, kh)
        with kb.loop("sub", 0, per) as sub:
            h = head(sub)
            reads = key_head(h)
            decay, b = kb.let("decay", reads.decay), kb.let("b", reads.beta)
            if reads.v_raw is None:
                with kb.loop("c", 0, dv) as c:
                    vv[c] = reads.v(c)
            else:
                with kb.loop("c", 0, dv, lanes) as c:
                    with kb.loop("l", 0, lanes) as j:
                        vv[c + j] = reads.v_raw(c + j)
                    kb.set(vv.vec(c, lanes), activations.silu(inline(kb, "ve"), vv.vec(c, lanes)))
            for g in groups:
                sk = {i: kb.let(f"sk{i}", cast(V, 0.0)) for i in g}
                with kb.loop("e", 0, DK) as e:
                    kv = kb.let("kv", reads.k(e))
                    r = kb.let("r", rule.state_row(h, e))
                    for i in g:
                        kb.set(sk[i], sk[i] + src.load(r + i * lanes, lanes=lanes) * kv)
                delta = {i: kb.let(f"delta{i}", delta_error(vv.vec(i * lanes, lanes), sk[i], decay, b)) for i in g}
                y = {i: kb.let(f"y{i}", cast(V, 0.0)) for i in g}
                with kb.loop("e", 0, DK) as e:
                    kv, qv = kb.let("kv", reads.k(e)), kb.let("qv", reads.q(e) * rule.scale)
                    r = kb.let("r", rule.state_row(h, e))
                    for i in g:
                        s = kb.let(f"s{i}", delta_update(src.load(r + i * lanes, lanes=lanes), kv, delta[i], decay))
                        kb.set(y[i], y[i] + s * qv)
                        states.new.store(r + i * lanes, s)
                for i in g:
                    kb.set(yy.vec(i * lanes, lanes), y[i])
            if rule.norm is None:
                with kb.loop("c", 0, dv) as c:
                    states.out[rule.out_row(t, h) + c] = yy[c]
                return
            squares = kb.let("squares", cast(V, 0.0))
            with kb.loop("i", 0, n) as i:
                kb.set(squares, squares + yy.vec(i * lanes, lanes) * yy.vec(i * lanes, lanes))
            rn = rule.norm.inverse_rms(kb, vsum(squares))
            with kb.loop("c", 0, dv, lanes) as c:
                kb.set(vv.vec(c, lanes), rule.norm.gates(kb, t, h, c, lanes))
            with kb.loop("c", 0, dv) as c:
                if rule.q8_out:
                    yy[c] = rule.norm.apply(kb, yy[c] * rn, t, h, c, vv[c])
                else:
                    states.out[rule.out_row(t, h) + c] = rule.norm.apply(kb, yy[c] * rn, t, h, c, vv[c])
            if rule.q8_out:
                rule.store_q8_row(kb, t, h, yy.__getitem__)

    if not states.in_place:  # no token runs when T is 0: the new state is the old one
        with kb.if_(T.eq(0)), kb.loop("sub", 0, per) as sub, kb.loop("e", 0, DK * dv) as e:
            at = kb.let("at", rule.state_row(head(sub), const(0)) + e)
            states.new[at] = states.old[at]
    _walk_tokens(kb, rule, kh, token)
    if rule.conv is not None:
        with kb.loop("sub", 0, per) as sub:
            h = head(sub)
            with kb.loop("c", 0, dv) as c:
                rule.conv.write(kb, rule.conv.v_channel(h, c))


def _cpu_body(kb: KernelSpec, rule: DeltaRule) -> None:
    """A work-item per (v head, CPU_COLS state columns) streams the state rows twice per
    token, once for k·S and once to write the updated rows (and sum y), with nothing held
    but CPU_COLS-wide sums: the inner loops over contiguous columns become vector loads and
    FMAs, where a thread holding a whole column does not vectorise. Row 0 reads the old
    state (new_state itself in place); later rows read the rows the previous token wrote
    to new_state. In a fused_gated_deltanet kernel the work-items of a k head's v heads
    share a work-group: a token starts with the conv of the k head's q and k and ends with
    each head's output norm, both through work-group memory."""
    T, DK, states = rule.T, rule.DK, rule.states
    if rule.seg:
        lid = kb.let("lid", kb.lid(0))
        kh, h, p = rule.group_heads(kb, lid)
        c0 = kb.let("c0", p * CPU_COLS)
    else:
        h, c0 = kb.let("h", kb.gid(0)), kb.let("c0", kb.lid(0) * CPU_COLS)
        kh = kb.let("kh", rule.key_head(h))
    sk, y, delta = (kb.array(name, F32, CPU_COLS) for name in ("sk", "y", "delta"))
    rows = _group_rows(kb, rule)

    def columns():
        return kb.loop("j", 0, CPU_COLS)

    def token(t: K, src: Buffer) -> None:
        reads = rule.reads.token(t, kh)(h)
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
            delta[j] = delta_error(reads.v(c0 + j), sk[j], decay, b)
        with kb.loop("e", 0, DK) as e:
            kv, qv = kb.let("kv", reads.k(e)), kb.let("qv", reads.q(e) * rule.scale)
            r = kb.let("r", rule.state_row(h, e) + c0)
            with columns() as j:
                s = kb.let("s", delta_update(src[r + j], kv, delta[j], decay))
                y[j] = y[j] + s * qv
                states.new[r + j] = s
        if rule.norm is None:
            with columns() as j:
                states.out[rule.out_row(t, h) + c0 + j] = y[j]
            return
        rn = rule.norm.factor(kb, lid, p, vsum(y.vec(0, CPU_COLS) * y.vec(0, CPU_COLS)))
        with columns() as j:
            value = rule.norm.apply(kb, y[j] * rn, t, h, c0 + j)
            if rows is None:
                states.out[rule.out_row(t, h) + c0 + j] = value
            else:
                rows[lid * CPU_COLS + j] = value
        if rows is not None:
            rule.store_q8_group(kb, t, kh, lid, rows)

    if not states.in_place:  # no token runs when T is 0: the new state is the old one
        with kb.if_(T.eq(0)), kb.loop("e", 0, DK) as e:
            r = kb.let("r", rule.state_row(h, e) + c0)
            with columns() as j:
                states.new[r + j] = states.old[r + j]
    _walk_tokens(kb, rule, kh, token)
    if rule.conv is not None:
        with columns() as j:
            rule.conv.write(kb, rule.conv.v_channel(h, c0 + j))
