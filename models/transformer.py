"""The decoder skeleton every target shares, as IR graphs: `llama` and `qwen3` use it as is,
`qwen35` / `qwen35moe` (models/qwen35.py) swap in their Gated DeltaNet layers and MoE.

One builder serves every call shape the runtime needs:
- prefill: T prompt rows (Gated DeltaNet in chunked form);
- verify:  T rows on top of existing state (recurrent form, emitting per-row states so the
           speculative loop can roll back to any row);
- decode:  one row.
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

    kind: str  # "prefill" | "verify" | "decode"
    taps: tuple[int, ...] = ()
    rows: int | str = "T"

    @property
    def chunked(self) -> bool:
        return self.kind == "prefill"

    @property
    def row_states(self) -> bool:
        return self.kind == "verify"


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
    def build(self, spec: GraphSpec) -> Graph:
        cfg = self.cfg
        for t in spec.taps:
            if not 0 <= t < cfg.n_layer:
                raise ValueError(f"{self.gguf.path}: tap layer {t} is outside the target's {cfg.n_layer} layers")
        b = GraphBuilder(f"{cfg.arch}.{spec.kind}")
        b.meta.update(arch=cfg.arch, kind=spec.kind, taps=list(spec.taps))
        T = spec.rows
        tokens = b.input("tokens", DType.I32, (T,))
        positions = b.input("positions", DType.I32, (T,))
        pos = b.input("pos", DType.I32, ())
        kv_len = b.input("kv_len", DType.I32, ())
        logit_rows = None if spec.kind in ("decode", "verify") else b.input("logit_rows", DType.I32, ("R",))

        h = b.embedding(self._w(b, "token_embd.weight"), tokens, name="embd")
        features = []
        for i in range(cfg.n_layer):
            with b.scope(f"blk.{i}"):
                x = b.rmsnorm(h, self._w(b, f"blk.{i}.attn_norm.weight"), eps=cfg.rms_eps)
                h = b.add(h, self._mixer(b, i, x, spec, positions, pos, kv_len), name="resid_attn")
                x = b.rmsnorm(h, self._w(b, f"blk.{i}.{cfg.ffn_norm}.weight"), eps=cfg.rms_eps)
                h = b.add(h, self._ffn(b, i, x), name="resid_ffn")
            if i in spec.taps:
                features.append(h)

        out = h if logit_rows is None else b.gather(h, logit_rows, axis=0, name="logit_rows")
        out = b.rmsnorm(out, self._w(b, "output_norm.weight"), eps=cfg.rms_eps)
        head = "token_embd.weight" if cfg.tied_output else "output.weight"
        logits = self._linear(b, out, head)
        b.output("logits", logits)
        b.output("greedy", b.argmax(logits))  # a greedy round reads these ids, not the logits
        if spec.taps:
            ordered = [features[sorted(spec.taps).index(t)] for t in spec.taps]
            b.output("features", b.concat(*ordered, axis=1, name="features") if len(ordered) > 1 else ordered[0])
        return b.build()

    # -- layers: subclasses replace the mixer or the FFN of some layers ------------------
    def _mixer(self, b, i, x, spec: GraphSpec, positions, pos, kv_len) -> Value:
        return self._attention(b, i, x, positions, pos, kv_len)

    def _ffn(self, b, i, x) -> Value:
        return self._swiglu(b, x, f"blk.{i}.ffn_gate.weight", f"blk.{i}.ffn_up.weight", f"blk.{i}.ffn_down.weight")

    def _attention(self, b, i, x, positions, pos, kv_len) -> Value:
        cfg = self.cfg
        T, H, Hkv, D = x.type.shape[0], cfg.n_head, cfg.n_head_kv, cfg.head_dim
        q = b.reshape(self._linear(b, x, f"blk.{i}.attn_q.weight"), shape=(T, H, 2 * D if cfg.gated_attention else D))
        if cfg.gated_attention:
            q, gate = b.slice(q, axis=2, start=0, stop=D, name="q"), b.slice(q, axis=2, start=D, stop=2 * D, name="gate")
        k = b.reshape(self._linear(b, x, f"blk.{i}.attn_k.weight"), shape=(T, Hkv, D))
        v = b.reshape(self._linear(b, x, f"blk.{i}.attn_v.weight"), shape=(T, Hkv, D))
        if cfg.permuted_qk:
            q, k = _rotate_half_order(b, q, "q"), _rotate_half_order(b, k, "k")
        if cfg.qk_norm:
            q = b.rmsnorm(q, self._w(b, f"blk.{i}.attn_q_norm.weight"), eps=cfg.rms_eps)
            k = b.rmsnorm(k, self._w(b, f"blk.{i}.attn_k_norm.weight"), eps=cfg.rms_eps)
        rope = dict(n_rot=cfg.n_rot, theta=cfg.rope_theta)
        if cfg.is_hybrid:
            rope.update(sections=tuple(cfg.rope_sections), interleaved=True)
        q = b.rope(q, positions, **rope)
        k = b.rope(k, positions, **rope)
        k_cache = b.state(f"blk.{i}.k_cache", DType.F32, ("C", Hkv, D))
        v_cache = b.state(f"blk.{i}.v_cache", DType.F32, ("C", Hkv, D))
        k_all = b.kv_write(k_cache, k, pos, name="k_cache.new")
        v_all = b.kv_write(v_cache, v, pos, name="v_cache.new")
        b.update_state(k_cache, k_all)
        b.update_state(v_cache, v_all)
        o = b.reshape(b.attention(q, k_all, v_all, kv_len, scale=1.0 / math.sqrt(D), causal=True), shape=(T, H * D))
        if cfg.gated_attention:
            o = b.mul(o, b.sigmoid(b.reshape(gate, shape=(T, H * D))), name="gated")
        return self._linear(b, o, f"blk.{i}.attn_output.weight")

    def _swiglu(self, b, x, gate: str, up: str, down: str) -> Value:
        h = b.mul(b.silu(self._linear(b, x, gate)), self._linear(b, x, up), name="swiglu")
        return self._linear(b, h, down)


def _rotate_half_order(b: GraphBuilder, x: Value, name: str) -> Value:
    """Undo llama.cpp's llama q/k row permutation on [T, heads, D] projections: the file's
    head dim d = 2i + s holds HF's dim s * D/2 + i, so [.., D/2, 2] -> [.., 2, D/2]."""
    T, heads, D = x.type.shape
    pairs = b.reshape(x, shape=(T, heads, D // 2, 2))
    return b.reshape(b.transpose(pairs, perm=(0, 1, 3, 2)), shape=(T, heads, D), name=f"{name}_hf")
