"""The decoder skeleton every target shares, as IR graphs: `llama` and `qwen3` use it as is,
`qwen35` / `qwen35moe` (models/qwen35.py) swap in their Gated DeltaNet layers and MoE.

One builder serves every call shape the runtime needs:
- prefill: T prompt rows (Gated DeltaNet in chunked form);
- verify:  T rows on top of existing state (recurrent form; a target with recurrent layers
           also has a `commit` graph that replays them over the accepted rows);
- decode:  one row;
- a batched verify: the blocks of `slots` sequences, `rows` (an int) each, stacked in one
  pass: embedding, projections, FFNs and the LM head run once over every row (one weight
  read), while each sequence's attention and recurrence read and write its own state
  (states and the position inputs named `s<j>.<name>` for sequence j, rows [j*rows,
  (j+1)*rows) of the stacked values). A row's result does not depend on the other rows.
Each returns logits for the rows listed in `logit_rows` (decode and verify: for all their
rows, without a gather) and their argmax ids (`greedy`), the concatenated residual-stream outputs of the tap
layers (DFlash features), and updates the explicit state: a fixed-capacity KV cache per
attention layer (rows >= kv_len are ignored, so rolling back attention is just a shorter
kv_len).

Attention differs by architecture only where TargetConfig says so: Qwen3.5's query
projection interleaves [q_h | gate_h] per head and gates the output; q/k carry per-head
RMSNorms except in llama; llama's GGUF q/k rows are permuted for llama.cpp's adjacent-pair
RoPE and put back in rotate-half order here, so every target uses the one NeoX `rope` op.
GGUF norms are plain RMSNorm weights (Qwen3.5's converter already added its `+1`).
"""
from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass

from dflash_ir.builder import GraphBuilder
from dflash_ir.dtypes import DType
from dflash_ir.ir import Graph, Value

from .config import TargetConfig
from .gguf_file import GGUFFile


@dataclass(frozen=True)
class GraphSpec:
    """What one target graph computes. `rows` is the row count (a symbol or an int)."""

    kind: str  # "prefill" | "verify" | "decode" ("commit": the recurrent layers alone, models/qwen35.py)
    taps: tuple[int, ...] = ()
    rows: int | str = "T"
    slots: int = 1  # sequences verified together (a verify of an int row count each)

    @property
    def chunked(self) -> bool:
        return self.kind == "prefill"


@dataclass(frozen=True)
class Slot:
    """One sequence of a graph: its rows of the stacked values ([start, stop), or all of
    them when alone), its position inputs, and the prefix of its state names."""

    prefix: str
    start: int
    stop: int | None
    positions: Value
    pos: Value
    kv_len: Value

    def rows(self, b: GraphBuilder, x: Value) -> Value:
        """This sequence's rows of `x` (x itself when the graph has one sequence)."""
        return x if self.stop is None else b.slice(x, axis=0, start=self.start, stop=self.stop)

    def state(self, b: GraphBuilder, name: str, dtype: DType, shape) -> Value:
        return b.state(self.prefix + name, dtype, shape)

    def scope(self, b: GraphBuilder):
        """Names of this sequence's values (unchanged when alone)."""
        return b.scope(self.prefix.rstrip(".")) if self.prefix else contextlib.nullcontext()


class TargetBuilder:
    """Builds target graphs for one GGUF file; weights stay references into that file."""

    def __init__(self, gguf: GGUFFile, cfg: TargetConfig, *, source: str = "target"):
        self.gguf = gguf
        self.cfg = cfg
        self.source = source

    # -- weights ----------------------------------------------------------------------
    def _w(self, b: GraphBuilder, name: str) -> Value:
        info = self.gguf.tensors[name]
        return b.weight(name, info.dtype, info.shape, source=self.source)

    def _linear(self, b: GraphBuilder, x: Value, name: str) -> Value:
        w = self._w(b, name)
        if w.type.dtype != DType.F32:
            w = b.dequantize(w, name=f"{name}.f32")
        return b.matmul(x, w)

    # -- graph ------------------------------------------------------------------------
    def commit(self) -> Graph | None:
        """The graph that brings states with no rows to trim to the accepted rows of a verify
        (recurrent layers'); None where every layer is attention: trimming a KV cache is free."""
        return None

    def build(self, spec: GraphSpec) -> Graph:
        cfg = self.cfg
        for t in spec.taps:
            if not 0 <= t < cfg.n_layer:
                raise ValueError(f"{self.gguf.path}: tap layer {t} is outside the target's {cfg.n_layer} layers")
        S = spec.slots
        if S > 1 and (spec.kind != "verify" or not isinstance(spec.rows, int)):
            raise ValueError(f"{spec.slots} sequences in one graph need a verify of an int row count, got {spec}")
        b = GraphBuilder(f"{cfg.arch}.{spec.kind}" + (f"_s{S}" if S > 1 else ""))
        b.meta.update(arch=cfg.arch, kind=spec.kind, taps=list(spec.taps), **({"slots": S} if S > 1 else {}))
        T = spec.rows if S == 1 else S * spec.rows
        tokens = b.input("tokens", DType.I32, (T,))
        slots = [self._slot(b, j, spec.rows, batched=S > 1) for j in range(S)]
        logit_rows = None if spec.kind in ("decode", "verify") else b.input("logit_rows", DType.I32, ("R",))

        h = b.embedding(self._w(b, "token_embd.weight"), tokens, name="embd")
        features = []
        for i in range(cfg.n_layer):
            with b.scope(f"blk.{i}"):
                x = b.rmsnorm(h, self._w(b, f"blk.{i}.attn_norm.weight"), eps=cfg.rms_eps)
                h = b.add(h, self._mixer(b, i, x, spec, slots), name="resid_attn")
                x = b.rmsnorm(h, self._w(b, f"blk.{i}.{cfg.ffn_norm}.weight"), eps=cfg.rms_eps)
                h = b.add(h, self._ffn(b, i, x), name="resid_ffn")
            if i in spec.taps:
                features.append(h)

        out = h if logit_rows is None else b.gather(h, logit_rows, axis=0, name="logit_rows")
        out = b.rmsnorm(out, self._w(b, "output_norm.weight"), eps=cfg.rms_eps)
        logits = self._linear(b, out, cfg.head_tensor)
        b.output("logits", logits)
        b.output("greedy", b.argmax(logits))  # a greedy round reads these ids, not the logits
        if spec.taps:
            ordered = [features[sorted(spec.taps).index(t)] for t in spec.taps]
            b.output("features", b.concat(*ordered, axis=1, name="features") if len(ordered) > 1 else ordered[0])
        return b.build()

    @staticmethod
    def _slot(b: GraphBuilder, j: int, rows: int | str, batched: bool) -> Slot:
        """Sequence j's inputs, of `rows` rows; alone (not `batched`) all rows are its own."""
        prefix = f"s{j}." if batched else ""
        return Slot(prefix, j * rows if batched else 0, (j + 1) * rows if batched else None,
                    b.input(f"{prefix}positions", DType.I32, (rows,)), b.input(f"{prefix}pos", DType.I32, ()),
                    b.input(f"{prefix}kv_len", DType.I32, ()))

    def _per_sequence(self, b: GraphBuilder, i: int, x: Value, slots: list[Slot], body, out: str) -> Value:
        """A mixer: `body(slot, rows)` for each sequence, where `rows(name)` is the sequence's
        rows of x times layer i's weight `name` (each product made once, over every row, where
        the first sequence reads it: a lone sequence's graph has its nodes in the order it
        reads them); the results stacked back into rows and projected by weight `out`."""
        project = functools.cache(lambda name: self._linear(b, x, f"blk.{i}.{name}.weight"))
        parts = []
        for slot in slots:
            with slot.scope(b):
                parts.append(body(slot, lambda name: slot.rows(b, project(name))))
        stacked = parts[0] if len(parts) == 1 else b.concat(*parts, axis=0, name=f"{out}.rows")
        return self._linear(b, stacked, f"blk.{i}.{out}.weight")

    # -- layers: subclasses replace the mixer or the FFN of some layers ------------------
    def _mixer(self, b, i, x, spec: GraphSpec, slots: list[Slot]) -> Value:
        return self._attention(b, i, x, slots)

    def _ffn(self, b, i, x) -> Value:
        return self._swiglu(b, x, f"blk.{i}.ffn_gate.weight", f"blk.{i}.ffn_up.weight", f"blk.{i}.ffn_down.weight")

    def _attention(self, b, i, x, slots: list[Slot]) -> Value:
        """Each sequence's rows attend over its own KV cache."""
        return self._per_sequence(b, i, x, slots, lambda slot, rows: self._attend(b, i, slot, rows),
                                  "attn_output")

    def _attend(self, b, i, slot: Slot, rows) -> Value:
        cfg = self.cfg
        H, Hkv, D = cfg.n_head, cfg.n_head_kv, cfg.head_dim
        qs = rows("attn_q")
        T = qs.type.shape[0]
        q = b.reshape(qs, shape=(T, H, 2 * D if cfg.gated_attention else D))
        if cfg.gated_attention:
            q, gate = (b.slice(q, axis=2, start=0, stop=D, name="q"),
                       b.slice(q, axis=2, start=D, stop=2 * D, name="gate"))
        k = b.reshape(rows("attn_k"), shape=(T, Hkv, D))
        v = b.reshape(rows("attn_v"), shape=(T, Hkv, D))
        if cfg.qk_norm:
            q = b.rmsnorm(q, self._w(b, f"blk.{i}.attn_q_norm.weight"), eps=cfg.rms_eps)
            k = b.rmsnorm(k, self._w(b, f"blk.{i}.attn_k_norm.weight"), eps=cfg.rms_eps)
        rope = dict(n_rot=cfg.n_rot, theta=cfg.rope_theta)
        if cfg.is_hybrid:
            rope.update(sections=tuple(cfg.rope_sections), interleaved=True)
        if cfg.permuted_qk:  # q and k stay in the file's order, the caches too (scores are dot products)
            rope.update(pairs="adjacent")
        if cfg.rope_freq_factors:
            rope.update(freq_factors=cfg.rope_freq_factors)
        q = b.rope(q, slot.positions, **rope)
        k = b.rope(k, slot.positions, **rope)
        k_cache = slot.state(b, f"blk.{i}.k_cache", DType.F32, ("C", Hkv, D))
        v_cache = slot.state(b, f"blk.{i}.v_cache", DType.F32, ("C", Hkv, D))
        k_all = b.kv_write(k_cache, k, slot.pos, name="k_cache.new")
        v_all = b.kv_write(v_cache, v, slot.pos, name="v_cache.new")
        b.update_state(k_cache, k_all)
        b.update_state(v_cache, v_all)
        o = b.reshape(b.attention(q, k_all, v_all, slot.kv_len, scale=1.0 / math.sqrt(D), causal=True),
                      shape=(T, H * D))
        if cfg.gated_attention:
            o = b.mul(o, b.sigmoid(b.reshape(gate, shape=(T, H * D))), name="gated")
        return o

    def _swiglu(self, b, x, gate: str, up: str, down: str) -> Value:
        h = b.mul(b.silu(self._linear(b, x, gate)), self._linear(b, x, up), name="swiglu")
        return self._linear(b, h, down)
