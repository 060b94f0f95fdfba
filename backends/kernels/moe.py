"""Mixture-of-experts kernels: expert_matmul and the fused MoE layer (fused_moe).

Q8_0 expert banks [E, n, k] are read packed by quant.pack_q8_0_cols16, expert by expert, each
padded to whole groups of 16 outputs: an expert's rows are a contiguous run of groups (a
`Bank`). A fused layer packs its shared expert after the bank, as expert number E with its own
width, so the kernels treat it as one more expert, the one every row selects in slot k.

fused_moe is three kernels on the CPU profile where each kernel's experts share a type the
tiles read (Q8_0 or one of quant.TILED_BLOCK_TYPES: the K-quants llama-quantize gives MoE
banks, decoded lane-wise as in the dense tiles; gate and up, and down, may differ):

    moe_route  a work-group per row: the router logits, softmax, top-k (ties to the lower
               index), the top-k probabilities renormalised, and sigmoid(x · shexp_gate_inp)
               as the weight of slot k (the shared expert): ids [T, k], weights [T, k + 1]
    moe_up     every (row, slot) pair: silu(x · gate_e) * (x · up_e): act [T, k + 1, F]
               (with Q8_0 x, the q8 numerics: x quantised, act in Q8_0 blocks)
    moe_down   every row: the sum over its slots, in slot order, of weight * (down_e · act)

and, with Q8_0 experts, four on the GPU profile, where the router product is the GEMV (or GEMM) launch before
moe_route: a work-group per row computing E dot products of H would leave the GPU idle (on a
CPU, one work-item per row reading four router rows at once was faster than a launch of its
own: 0.32 against 0.40 ms for the 35B-A3B's 256 x 2048 f32 router from memory, one row; one
row at a time, 0.36); there moe_up scales act by the weight, as moe_down sums a row's slots
in one work-group. Other expert dtypes or mixes, and the q8 numerics on the GPU profile: the
parts' kernels (fused.py).

CPU schedule of the expert products (`_expert_tiles`): register tiles as the dense products'
(linalg.tile_sums). A work-item owns a few groups of 16 outputs and a chunk of CHUNK rows;
it links the chunk's (row, slot) pairs by expert, then for each expert selected in the chunk
multiplies that expert's groups with the rows that selected it, 4, 2 or 1 rows per tile, so
an expert's weights are read once per chunk however many of its rows chose it (the shared
expert: once for all of them). GPU schedule (`_expert_lanes`): a work-group per (pair or
row, group of 16 outputs), 16 lanes over the K blocks, reduced in local memory.

Batch invariance: every output is the same sequence of operations whatever the number of rows
(a tile's sums do not depend on the other rows in it; a row's slots are summed in slot order),
so a verify row equals the decode of its token bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from dflash_ir import activations
from dflash_ir.dtypes import DType
from dflash_ir.ir import Value
from dflash_ir.ops.reduce import precedes
from dflash_ir.quant import COLS_BLOCK_BYTES, cols16_layout
from dflash_ir.types import TensorType

from ..kir import F32, I32, I64, K, call, cast, const, maximum, minimum, select, vsum
from ..kir.build import Buffer
from ..lowering import KernelSpec, NodeCtx, dim, lowers
from .access import KERNEL, weight_at
from .fused import fused_moe_parts
from .linalg import (COLS, ROWWISE_COLS, Gemv, _gemv, _rowwise, clamp_to_last, dp4_tiles, group_bytes, rowwise_groups,
                     store_q8_vectors, tile_sums, tiled)
from .shapes import cdiv, pow2_threads, prod

CHUNK = 16          # rows whose pairs a CPU work-item groups by expert
ITEMS = 2           # work-items per work-group of the CPU expert tiles
UP_UNITS = 2        # gate/up pairs of groups per CPU work-item (4 groups of sums per row): a Q8_0 block
DOWN_UNITS = 4      # groups of outputs per CPU work-item (down, expert_matmul)
ROUTE_ITEMS = 1     # work-items of the CPU route kernel's work-group (one core runs a work-group anyway)
ROUTER_STREAMS = 4  # router rows a CPU work-item reads at once
assert UP_UNITS * COLS == DType.Q8_0.block_size, "moe_up's store quantises a work-item's gate/up groups as one block"
LANES = 16          # GPU: lanes over K blocks per group of 16 outputs (16 x 16 work-groups)


def _groups(n: int) -> int:
    return -(-n // COLS)


def tiled_type(weights: list[Value]) -> DType | None:
    """The type the CPU tiles read all of `weights` in (one pack's, or one kernel's), or None
    where they differ or the tiles take no products of it."""
    types = {w.type.dtype for w in weights}
    return types.pop() if len(types) == 1 and tiled(weights[0]) else None


@dataclass(frozen=True)
class Bank:
    """Expert weights in one pack for the tiles (quant.cols16_layout of `dtype`): `experts`
    matrices of n outputs x k inputs, each padded to whole groups of 16 outputs, then the
    shared expert (`shared`: its outputs and inputs), if any, as expert number `experts`."""

    experts: int
    n: int
    k: int
    shared: tuple[int, int] | None = None
    dtype: DType = DType.Q8_0
    dp4: bool = False  # the pack of the tiles that sum Q8_0 x with VPDPBUSD (linalg.dp4_tiles)

    @property
    def layout(self) -> str:
        return cols16_layout(self.dtype, self.dp4)

    @property
    def units(self) -> int:
        """Groups of outputs of the widest expert."""
        return max(_groups(self.n), _groups(self.shared[0]) if self.shared else 0)

    @property
    def whole(self) -> bool:
        """Every expert's outputs fill whole groups."""
        return self.n % COLS == 0 and (self.shared is None or self.shared[0] % COLS == 0)

    @property
    def uniform(self) -> bool:
        """Every expert, the shared one too, has `units` groups."""
        return self.shared is None or _groups(self.shared[0]) == _groups(self.n)

    def _pick(self, e: K, routed: int, shared: int) -> K | int:
        if self.shared is None or routed == shared:
            return routed
        return select(e.eq(self.experts), shared, routed)

    def groups(self, e: K) -> K | int:
        return self._pick(e, _groups(self.n), _groups(self.shared[0]) if self.shared else 0)

    def width(self, e: K) -> K | int:
        return self._pick(e, self.n, self.shared[0] if self.shared else 0)

    def blocks(self, e: K) -> K | int:
        size = self.dtype.block_size
        return self._pick(e, self.k // size, self.shared[1] // size if self.shared else 0)

    def group_at(self, e: K, u: K) -> K:
        """Byte of expert e's group u in the pack."""
        routed = (cast(I64, e) * _groups(self.n) + u) * group_bytes(self.dtype, self.k)
        if self.shared is None:
            return routed
        bank = self.experts * _groups(self.n) * group_bytes(self.dtype, self.k)
        return select(e.eq(self.experts), bank + cast(I64, u) * group_bytes(self.dtype, self.shared[1]), routed)


@dataclass(frozen=True)
class Pairs:
    """The (row, slot) pairs of a call, numbered row * slots + slot: `k` routed slots per row
    (ids [T, k]), plus slot k, the shared expert (number `shared`), when `shared` is set."""

    k: int
    shared: int | None = None

    @property
    def slots(self) -> int:
        return self.k + (self.shared is not None)

    def expert(self, ids: Buffer, pair: K) -> K:
        if self.shared is None:
            return ids[pair]
        row, slot = pair / self.slots, pair % self.slots
        return select(slot.eq(self.k), self.shared, ids[row * self.k + minimum(slot, self.k - 1)])


@dataclass(frozen=True)
class Products:
    """One kernel's expert products: x rows (`xrow(pair)`: the offset of a pair's row; x f32,
    or Q8_0 blocks) times the units (a group of 16 outputs from each pack, side by side) of
    each pair's expert, written by `store(kb, bufs, pair or row, unit, sums, expert)`, or on
    the CPU tiles by `store_units(kb, bufs, pair, u0, sums, expert, units)` where given (the
    sums of all of a work-item's units u0, u0 + 1, ...: sums[p][pack]; `units` the expert's);
    `inputs` and `outs` are the other buffers the stores read and write."""

    x: Value
    xrow: Callable[[K], K]
    packs: dict[str, Value]
    bank: Bank
    ids: Value
    pairs: Pairs
    inputs: dict[str, Value]
    outs: dict[str, Value]
    store: Callable[[KernelSpec, dict, K, K, list, K | None], None]
    store_units: Callable[[KernelSpec, dict, K, K, list, K, K], None] | None = None

    def kernel(self, ctx: NodeCtx, op: str, local: tuple[int, ...]) -> tuple[KernelSpec, dict[str, Buffer]]:
        kb = ctx.kernel(op, local)
        bufs = {"x": kb.bind("x", self.x)}
        bufs.update({name: kb.bind(name, v) for name, v in self.packs.items()})
        bufs["ids"] = kb.bind("ids", self.ids)
        bufs.update({name: kb.bind(name, v) for name, v in self.inputs.items()})
        bufs.update({name: kb.bind(name, v, writes=True) for name, v in self.outs.items()})
        return kb, bufs


def _expert_tiles(ctx: NodeCtx, op: str, job: Products, per: int,
                  finish: Callable[[KernelSpec, dict, K, K, K], None] | None = None) -> None:
    """CPU schedule of expert products (see the module docstring): a work-item owns `per` units
    of every pair in a chunk of CHUNK rows; `finish(kb, bufs, r0, rows, u0)` runs after every
    expert of the chunk."""
    kb, bufs = job.kernel(ctx, op, (ITEMS,))
    bank, pairs, xrow, store = job.bank, job.pairs, job.xrow, job.store
    xb, ws, idb = bufs["x"], [bufs[name] for name in job.packs], bufs["ids"]
    S, T = pairs.slots, dim(job.ids.type.shape[0])
    n_experts = bank.experts + (pairs.shared is not None)
    V = F32.vec(COLS)
    decode = job.ids.type.shape[0] == 1  # one row: its one-row tiles unroll their block types' elements
    x_q8 = job.x.type.dtype is DType.Q8_0

    u0 = kb.let("u0", (kb.gid(0) * ITEMS + kb.lid(0)) * per)
    kb.return_if(u0 >= bank.units)
    r0 = kb.let("r0", kb.gid(1) * CHUNK)
    rows = kb.let("rows", minimum(T - r0, CHUNK))
    p0 = kb.let("p0", r0 * S)
    # the chunk's pairs linked by expert: head[e] is e's last pair, nxt[q] the pair before q
    head, nxt = kb.array("head", I32, n_experts), kb.array("nxt", I32, CHUNK * S)
    with kb.loop("e0", 0, n_experts) as e:
        head[e] = -1
    with kb.loop("q", 0, rows * S) as q:
        ex = kb.let("ex", pairs.expert(idb, p0 + q))
        nxt[q] = head[ex]
        head[ex] = q

    def tile(qs: list[K], ex: K, units: K, nb: K) -> None:
        R, pre = len(qs), f"t{len(qs)}_"
        gp = [kb.let(f"{pre}pair{r}", p0 + q) for r, q in enumerate(qs)]
        xo = [kb.let(f"{pre}xo{r}", xrow(g)) for r, g in enumerate(gp)]
        last = bank.units if bank.uniform else units  # a constant, or this expert's groups
        groups = [(w, kb.let(f"{pre}wg{p}_{m}", bank.group_at(ex, clamp_to_last(u0 + p, last, per))))
                  for p in range(per) for m, w in enumerate(ws)]
        acc = {(r, j): kb.let(f"{pre}acc{r}_{j}", cast(V, 0.0)) for r in range(R) for j in range(len(groups))}
        tile_sums(kb, groups, nb, acc, R, lambda r, i: xb[xo[r] + i], q8_x=(xb, [o / 32 for o in xo]) if x_q8 else None,
                  dp4=bank.dp4, dtype=bank.dtype, block_span=ctx.block_span if R == 1 and decode else 0)
        for r in range(R):
            sums = [[acc[r, p * len(ws) + m] for m in range(len(ws))] for p in range(per)]
            if job.store_units:
                job.store_units(kb, bufs, gp[r], u0, sums, ex, units)
                continue
            for p in range(per):
                with kb.if_(u0 + p < units):
                    store(kb, bufs, gp[r], u0 + p, sums[p], ex)

    with kb.loop("q", 0, rows * S) as q:
        ex = kb.let("ex", pairs.expert(idb, p0 + q))
        with kb.if_(head[ex].eq(q)):  # the expert's last pair in the chunk: walk its list
            units, nb = kb.let("units", bank.groups(ex)), kb.let("nb", bank.blocks(ex))
            cur = kb.let("cur", q)
            with kb.loop("it", 0, cond=cur >= 0):
                p1 = kb.let("p1", nxt[cur])
                p2 = kb.let("p2", select(p1 >= 0, nxt[maximum(p1, 0)], -1))
                p3 = kb.let("p3", select(p2 >= 0, nxt[maximum(p2, 0)], -1))
                with kb.if_(p3 >= 0):
                    tile([cur, p1, p2, p3], ex, units, nb)
                    kb.set(cur, nxt[p3])
                with kb.else_():
                    with kb.if_(p1 >= 0):
                        tile([cur, p1], ex, units, nb)
                        kb.set(cur, p2)
                    with kb.else_():
                        tile([cur], ex, units, nb)
                        kb.set(cur, -1)
    if finish:
        finish(kb, bufs, r0, rows, u0)
    kb.launch([cdiv(const(bank.units), per * ITEMS), cdiv(T, CHUNK)])


def _expert_lanes(ctx: NodeCtx, op: str, job: Products, per_row: bool) -> None:
    """GPU schedule of expert products: a work-group of 16 outputs x LANES lanes per (unit,
    pair), or with `per_row` per (unit, row), summing the row's pairs in slot order. Thread
    (j, lane) accumulates output j over blocks lane, lane + LANES, ...; a tree over the lanes
    in local memory; lane 0 stores (the expert is None per row)."""
    kb, bufs = job.kernel(ctx, op, (COLS, LANES))
    bank, pairs, xrow, store = job.bank, job.pairs, job.xrow, job.store
    xb, ws, idb = bufs["x"], [bufs[name] for name in job.packs], bufs["ids"]
    j, lane = kb.let("j", kb.lid(0)), kb.let("lane", kb.lid(1))
    u, at = kb.let("u", kb.gid(0)), kb.let("at", kb.gid(1))  # at: the pair, or the row
    red = kb.array("red", F32, len(ws) * COLS * LANES, "local")
    acc = [kb.let(f"acc{m}", 0.0) for m in range(len(ws))]

    def products(pair: K, ex: K) -> None:
        base = [kb.let(f"wg{m}", bank.group_at(ex, u)) for m in range(len(ws))]
        xo = kb.let("xo", xrow(pair))
        with kb.loop("b", lane, bank.blocks(ex), LANES) as b:
            blk = [kb.let(f"blk{m}", base[m] + b * COLS_BLOCK_BYTES) for m in range(len(ws))]
            sums = [kb.let(f"s{m}", 0.0) for m in range(len(ws))]
            with kb.loop("kk", 0, 32) as kk:
                xv = kb.let("xv", xb[xo + b * 32 + kk])
                for m, w in enumerate(ws):
                    quant = cast(F32, w.load(blk[m] + 2 * COLS + kk * COLS + j, "i8"))
                    kb.set(sums[m], call("fma", quant, xv, sums[m]))
            for m, w in enumerate(ws):
                kb.set(acc[m], call("fma", w.load(blk[m] / 2 + j, "f16"), sums[m], acc[m]))

    if per_row:
        ex = None
        with kb.loop("slot", 0, pairs.slots) as slot:
            pair = kb.let("pair", at * pairs.slots + slot)
            products(pair, kb.let("ex", pairs.expert(idb, pair)))
    else:
        ex = kb.let("ex", pairs.expert(idb, at))
        kb.return_if(u >= bank.groups(ex))  # the same for the whole work-group
        products(at, ex)
    for m in range(len(ws)):
        red[(m * LANES + lane) * COLS + j] = acc[m]
    kb.barrier()
    with kb.loop("s", LANES // 2, cond=lambda s: s > 0, next=lambda s: s >> 1) as s:
        with kb.if_(lane < s):
            for m in range(len(ws)):
                red[(m * LANES + lane) * COLS + j] = red[(m * LANES + lane) * COLS + j] + \
                    red[(m * LANES + lane + s) * COLS + j]
        kb.barrier()
    with kb.if_(lane.eq(0)):
        store(kb, bufs, at, u, [red[m * LANES * COLS + j] for m in range(len(ws))], ex)
    kb.launch([bank.units, prod([job.ids.type.shape[0]]) * (1 if per_row else pairs.slots)])


def _lanes_out(kb: KernelSpec, sums: list[K], count: K | int, write: Callable[[K, list[K]], None]) -> None:
    """A CPU tile's 16-wide sums lane by lane (the first `count` lanes): write(lane, values)."""
    arrays = [kb.array(f"lanes{m}", F32, COLS) for m in range(len(sums))]
    for a, v in zip(arrays, sums):
        kb.set(a.vec(0, COLS), v)
    with kb.loop("l", 0, COLS, cond=lambda l: l < count) as l:
        write(l, [a[l] for a in arrays])


def _swiglu(g: K, up: K) -> K:
    return activations.swiglu(KERNEL, g, up)


# -- fused_moe ------------------------------------------------------------------------------
@lowers("fused_moe")
def fused_moe(ctx: NodeCtx) -> None:
    """The kernels of the module docstring where the experts' types allow; else the parts'.
    With Q8_0 x (`xq`, the q8 numerics; CPU only) the products read it, moe_up quantises
    each SwiGLU block for down (a work-item's UP_UNITS groups are one Q8_0 block), and
    moe_down weights each pair's product after it, as the reference does."""
    x, router_w, gate_exps, up_exps, down_exps, sh_gate, sh_up, sh_down, gate_inp, *xq = ctx.ins
    cpu = ctx.profile == "cpu"
    up_type, down_type = tiled_type([gate_exps, up_exps, sh_gate, sh_up]), tiled_type([down_exps, sh_down])
    if not (up_type and down_type) or not cpu and ({up_type, down_type} != {DType.Q8_0} or xq):
        fused_moe_parts(ctx)
        return
    k = ctx.attr["k"]
    T, H = x.type.shape
    E, F, _ = gate_exps.type.shape
    Fs = sh_gate.type.shape[0]
    pairs = Pairs(k, shared=E)
    S, Fx = pairs.slots, max(F, Fs)
    ids = ctx.temp(TensorType(DType.I32, (T, k)))
    weights = ctx.temp(TensorType(DType.F32, (T, S)))
    _route(ctx, x, router_w if cpu else ctx.sub("matmul", x, router_w), gate_inp, ids, weights, k, inline=cpu)

    act = ctx.temp(TensorType(DType.Q8_0 if xq else DType.F32, (T, S, Fx)))
    dp4 = dp4_tiles(ctx, bool(xq))
    up_bank, down_bank = Bank(E, F, H, (Fs, H), up_type, dp4), Bank(E, H, F, (H, Fs), down_type, dp4)
    up_packs = {"gate": ctx.packed([gate_exps, sh_gate], up_bank.layout),
                "up": ctx.packed([up_exps, sh_up], up_bank.layout)}
    down_pack = {"down": ctx.packed([down_exps, sh_down], down_bank.layout)}

    def x_row(pair: K) -> K:
        return cast(I64, pair / S) * H

    def act_row(pair: K) -> K:
        return cast(I64, pair) * Fx

    def store_act(kb, bufs, pair, unit, sums, ex) -> None:
        wt = None if cpu else kb.let("wt", bufs["weights"][pair])  # the CPU tiles weight the product of down

        def write(lane, v):
            value = _swiglu(v[0], v[1])
            bufs["act"][act_row(pair) + unit * COLS + lane] = value if wt is None else value * wt
        if cpu:
            _lanes_out(kb, sums, up_bank.width(ex) - unit * COLS, write)
        else:
            with kb.if_(unit * COLS + kb.lid(0) < up_bank.width(ex)):
                write(kb.lid(0), sums)

    def store_act_block(kb, bufs, pair, u0, sums, ex, units) -> None:
        """The SwiGLU of a Q8_0 block's 32 outputs, quantised."""
        with kb.if_(u0 < units):
            values = kb.array("act_block", F32, 32)
            gate, up = (kb.array(f"{name}_lanes", F32, 32) for name in ("gate", "up"))
            for p, (g, u) in enumerate(sums):
                kb.set(gate.vec(p * COLS, COLS), g)
                kb.set(up.vec(p * COLS, COLS), u)
            with kb.loop("l", 0, 32) as l:
                values[l] = _swiglu(gate[l], up[l])
            store_q8_vectors(kb, bufs["act"], act_row(pair) / 32 + u0 * COLS / 32,
                             [kb.let(f"act{h}", values.vec(h, COLS)) for h in (0, COLS)])

    out = ctx.outs[0]
    up = Products(xq[0] if xq else x, x_row, up_packs, up_bank, ids, pairs, {"weights": weights}, {"act": act},
                  store_act, store_act_block if xq else None)
    if cpu:
        _expert_tiles(ctx, "moe_up", up, UP_UNITS)
        parts = ctx.temp(TensorType(DType.F32, (T, S, H)))

        def store_part(kb, bufs, pair, unit, sums, ex) -> None:
            bufs["parts"].store(cast(I64, pair) * H + unit * COLS, sums[0] * bufs["weights"][pair])

        def finish(kb, bufs, r0, rows, u0) -> None:
            """Each row's outputs: its pairs' products summed in slot order."""
            with kb.loop("r", 0, rows) as r:
                for p in range(DOWN_UNITS):
                    with kb.if_(u0 + p < down_bank.units):
                        at = kb.let(f"sum_at{p}", cast(I64, (r0 + r) * S) * H + (u0 + p) * COLS)
                        total = kb.let(f"total{p}", bufs["parts"].load(at, lanes=COLS))
                        with kb.loop("slot", 1, S) as slot:
                            kb.set(total, total + bufs["parts"].load(at + slot * H, lanes=COLS))
                        bufs["out"].store(cast(I64, r0 + r) * H + (u0 + p) * COLS, total)
        down = Products(act, act_row, down_pack, down_bank, ids, pairs, {"weights": weights},
                        {"parts": parts, "out": out}, store_part)
        _expert_tiles(ctx, "moe_down", down, DOWN_UNITS, finish)
        return

    def store_row(kb, bufs, row, unit, sums, ex) -> None:
        bufs["out"][cast(I64, row) * H + unit * COLS + kb.lid(0)] = sums[0]
    _expert_lanes(ctx, "moe_up", up, per_row=False)
    _expert_lanes(ctx, "moe_down", Products(act, act_row, down_pack, down_bank, ids, pairs, {}, {"out": out},
                                            store_row), per_row=True)


def _route(ctx: NodeCtx, x_value: Value, source: Value, gate_inp: Value, ids_value: Value, weights_value: Value,
           k: int, inline: bool) -> None:
    """A work-group per row: logits (`inline`: x · router rows, `source` the router weight;
    else `source` holds them), softmax, top-k as the topk kernel orders it (largest first, ties
    to the lower index), weights[:k] = top-k / their sum, weights[k] = sigmoid(x · gate_inp)."""
    T, H = x_value.type.shape
    E = source.type.shape[0] if inline else source.type.shape[-1]
    L = ROUTE_ITEMS if inline else pow2_threads(E)
    kb = ctx.kernel("moe_route", (L,))
    x, src = kb.bind("x", x_value), kb.bind("router" if inline else "logits", source)
    g = kb.bind("gate_inp", gate_inp)
    ids, wts = kb.bind("ids", ids_value, writes=True), kb.bind("weights", weights_value, writes=True)
    row, lid = kb.let("row", kb.gid(0)), kb.let("lid", kb.lid(0))
    xr = kb.let("xr", cast(I64, row) * H)
    prob = kb.array("prob", F32, E, "local")
    red, best = kb.array("red", F32, L, "local"), kb.array("best", I32, L, "local")
    if inline:
        _router_logits(kb, x, xr, src, source.type.dtype, E, H, L, prob)
    else:
        with kb.loop("e", lid, E, L) as e:
            prob[e] = src[cast(I64, row) * E + e]
    shared = kb.let("sg", 0.0)
    with kb.loop("c", lid, H, L) as c:
        kb.set(shared, call("fma", x[xr + c], weight_at(gate_inp.type.dtype, g, const(0), c, H), shared))
    red[lid] = shared
    kb.wg_reduce(red, L, "sum")
    kb.set(shared, red[0])
    kb.barrier()
    m = kb.let("m", float("-inf"))
    with kb.loop("e", lid, E, L) as e:
        kb.set(m, maximum(m, prob[e]))
    red[lid] = m
    kb.wg_reduce(red, L, "max")
    kb.set(m, red[0])
    kb.barrier()
    total = kb.let("total", 0.0)
    with kb.loop("e", lid, E, L) as e:
        prob[e] = call("exp", prob[e] - m)
        kb.set(total, total + prob[e])
    red[lid] = total
    kb.wg_reduce(red, L, "sum")
    kb.set(total, red[0])
    with kb.loop("e", lid, E, L) as e:  # each work-item its own experts: no barrier needed before
        prob[e] = prob[e] / total
    top = kb.array("top", F32, k)
    prev_v, prev_i = kb.let("pv", float("inf")), kb.let("pi", -1)
    with kb.loop("p", 0, k) as p:
        kb.barrier()  # every work-item's probabilities written, the last pick read
        bv, bi = kb.let("bv", float("-inf")), kb.let("bi", -1)
        with kb.loop("e", lid, E, L) as e:
            v = kb.let("v", prob[e])
            with kb.if_(precedes(KERNEL, prev_v, prev_i, v, e) & ((bi < 0) | (v > bv))):
                kb.set(bv, v)
                kb.set(bi, e)
        red[lid], best[lid] = bv, bi
        kb.barrier()
        with kb.loop("s", L // 2, cond=lambda s: s > 0, next=lambda s: s >> 1) as s:
            with kb.if_(lid < s):
                o = kb.let("o", lid + s)
                with kb.if_((best[o] >= 0) & ((best[lid] < 0) | precedes(KERNEL, red[o], best[o], red[lid], best[lid]))):
                    red[lid], best[lid] = red[o], best[o]
            kb.barrier()
        kb.set(prev_v, red[0])
        kb.set(prev_i, best[0])
        top[p] = prev_v
        with kb.if_(lid.eq(0)):
            ids[row * k + p] = prev_i
    with kb.if_(lid.eq(0)):
        chosen = kb.let("chosen", 0.0)
        with kb.loop("p", 0, k) as p:
            kb.set(chosen, chosen + top[p])
        with kb.loop("p", 0, k) as p:
            wts[row * (k + 1) + p] = top[p] / chosen
        wts[row * (k + 1) + k] = KERNEL.sigmoid(shared)
    kb.launch([prod([T])])


def _router_logits(kb: KernelSpec, x: Buffer, xr: K, w: Buffer, dtype: DType, E: int, H: int, L: int,
                   prob) -> None:
    """prob[e] = x row · router row e for every e, ROUTER_STREAMS rows E/ROUTER_STREAMS apart at
    a time per work-item (independent streams from memory: a single one ran at half the speed),
    16 lanes at a time for f32 and f16 rows, else element by element."""
    streams = ROUTER_STREAMS if E % ROUTER_STREAMS == 0 else 1
    Q, lanes = E // streams, COLS if dtype in (DType.F32, DType.F16) and H % COLS == 0 else 1
    with kb.loop("e", kb.lid(0), Q, L) as e:
        acc = [kb.let(f"rl{i}", cast(F32.vec(lanes), 0.0)) for i in range(streams)]
        rows = [cast(I64, e + i * Q) * H for i in range(streams)]
        with kb.loop("c", 0, H, lanes) as c:
            xv = kb.let("xv", x.load(xr + c, lanes=lanes) if lanes > 1 else x[xr + c])
            for i in range(streams):
                wv = w.load(rows[i] + c, "f32" if dtype is DType.F32 else "f16", lanes) if lanes > 1 else \
                    weight_at(dtype, w, e + i * Q, c, H)
                kb.set(acc[i], call("fma", wv, xv, acc[i]))
        for i in range(streams):
            prob[e + i * Q] = vsum(acc[i]) if lanes > 1 else acc[i]


# -- expert_matmul --------------------------------------------------------------------------
@lowers("expert_matmul")
def expert_matmul(ctx: NodeCtx) -> None:
    """out[t, s] = x[t] (or x[t, s]) @ w[ids[t, s]]ᵀ, reading only the selected experts' rows;
    x f32, or Q8_0 blocks. CPU profile, a type the tiles read: the expert tiles (as
    fused_moe's); GPU profile, a GEMV work-group per (output column block, pair) on the
    weights as stored; CPU profile, other dtypes (f32 x only): the rowwise schedule, a pair
    per work-item."""
    x_value, w_value, ids_value = ctx.ins
    out_value = ctx.outs[0]
    E, n, k = w_value.type.shape
    T, slots = ids_value.type.shape
    per_slot = x_value.type.rank != 2
    ctx.check("index", ids_value, size=E)
    x_q8 = x_value.type.dtype is DType.Q8_0
    if ctx.profile == "cpu" and tiled(w_value) and isinstance(slots, int):
        bank, pairs = Bank(E, n, k, dtype=w_value.type.dtype, dp4=dp4_tiles(ctx, x_q8)), Pairs(slots)

        def xrow(pair: K) -> K:
            return cast(I64, pair if per_slot else pair / slots) * k

        def store(kb, bufs, pair, unit, sums, ex) -> None:
            at = cast(I64, pair) * n + unit * COLS
            if bank.whole:
                bufs["out"].store(at, sums[0])
                return

            def write(lane, v):
                bufs["out"][at + lane] = v[0]
            _lanes_out(kb, sums, n - unit * COLS, write)
        job = Products(x_value, xrow, {"w": ctx.packed([w_value], bank.layout)}, bank, ids_value, pairs, {},
                       {"out": out_value}, store)
        _expert_tiles(ctx, "expert_matmul_tiles", job, DOWN_UNITS)
        return
    pairs = prod([T, slots])
    S = dim(slots)
    cpu = ctx.profile == "cpu"
    g = Gemv(w_value.type.dtype, k)
    kb = ctx.kernel("expert_matmul_rows" if cpu else "expert_matmul", (ROWWISE_COLS,) if cpu else (g.lanes, g.cols))
    x, w, ids = kb.bind("x", x_value), kb.bind("w", w_value), kb.bind("ids", ids_value)
    out = kb.bind("out", out_value, writes=True)

    def xrow(pair: K) -> K:
        return cast(I64, pair if per_slot else pair / S) * dim(k)

    def store(row: K, col: K, value: K) -> None:
        out[cast(I64, row) * dim(n) + col] = value
    if cpu:
        _rowwise(kb, w_value.type.dtype, pairs, n, k, 1, store, w, x,
                 wrow=lambda col, r0: cast(I64, ids[r0]) * dim(n) + col, xrow=xrow)
        kb.launch(rowwise_groups(pairs, n, 1))
        return
    n_col = kb.let("n", kb.gid(0) * g.cols + kb.lid(1))
    p = kb.let("p", kb.gid(1))
    _gemv(kb, g, 1, const(1), dim(n), n_col, w, (cast(I64, ids[p]) * dim(n) + n_col,), x,
          lambda row: xrow(p), lambda row, col, value: store(p, col, value), x_q8)
    kb.launch([cdiv(dim(n), g.cols), pairs])
