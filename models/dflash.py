"""The DFlash draft (GGUF arch `dflash`) as two IR graphs (DFLASH.md §2.3, §7).

- inject: features of newly committed target rows -> fc -> hidden_norm -> per-layer
  K/V (k_norm + RoPE at the rows' positions) appended to the draft's context cache;
- block:  the B-row non-causal pass over [anchor, MASK x (B-1)]: queries from the block,
  keys/values from the context cache plus the block itself (written past the cache
  length and never kept), logits of rows 1..B-1 through the target's output head, and
  their argmax as proposals.

The draft has no embedding of its own: it is the target's (weights with source "target"),
as is the output head unless the draft carries a reduced one (`d2t`, models/draft_vocab.py):
then its logits cover those rows and its proposals are row numbers, which the runtime maps
to target ids (DraftRunner; on the host, where 64-bit ids need no device support). Its
norms are plain RMSNorm weights (no +1).
"""
from __future__ import annotations

import math

from dflash_ir.builder import GraphBuilder
from dflash_ir.dtypes import DType
from dflash_ir.ir import Graph, Value

from .config import DraftConfig, TargetConfig
from .draft_vocab import DRAFT_HEAD
from .gguf_file import GGUFFile


class DFlashBuilder:
    def __init__(self, draft: GGUFFile, cfg: DraftConfig, target: GGUFFile, target_cfg: TargetConfig):
        self.draft, self.cfg, self.target, self.target_cfg = draft, cfg, target, target_cfg

    def _w(self, b: GraphBuilder, name: str, *, source: str = "draft") -> Value:
        info = (self.draft if source == "draft" else self.target).tensors[name]
        return b.weight(name, info.dtype, info.shape, source=source)

    def _linear(self, b: GraphBuilder, x: Value, name: str, *, source: str = "draft") -> Value:
        w = self._w(b, name, source=source)
        if w.type.dtype != DType.F32:
            w = b.dequantize(w, name=f"{name}.f32")
        return b.matmul(x, w)

    def _rope(self, b: GraphBuilder, x: Value, positions: Value) -> Value:
        return b.rope(x, positions, n_rot=self.cfg.n_rot, theta=self.cfg.rope_theta)

    def _kv(self, b: GraphBuilder, i: int, x: Value, positions: Value) -> tuple[Value, Value]:
        cfg = self.cfg
        rows = x.type.shape[0]
        k = b.reshape(self._linear(b, x, f"blk.{i}.attn_k.weight"), shape=(rows, cfg.n_head_kv, cfg.head_dim))
        k = self._rope(b, b.rmsnorm(k, self._w(b, f"blk.{i}.attn_k_norm.weight"), eps=cfg.rms_eps), positions)
        v = b.reshape(self._linear(b, x, f"blk.{i}.attn_v.weight"), shape=(rows, cfg.n_head_kv, cfg.head_dim))
        return k, v

    def _caches(self, b: GraphBuilder, i: int) -> tuple[Value, Value]:
        shape = ("C", self.cfg.n_head_kv, self.cfg.head_dim)
        return b.state(f"blk.{i}.k_cache", DType.F32, shape), b.state(f"blk.{i}.v_cache", DType.F32, shape)

    def inject(self) -> Graph:
        cfg = self.cfg
        b = GraphBuilder("dflash.inject")
        b.meta.update(arch="dflash", kind="inject")
        features = b.input("features", DType.F32, ("S", len(cfg.tap_layers) * self.target_cfg.hidden))
        positions = b.input("positions", DType.I32, ("S",))
        pos = b.input("pos", DType.I32, ())
        ctx = b.rmsnorm(self._linear(b, features, "fc.weight"), self._w(b, "enc.output_norm.weight"),
                        eps=cfg.rms_eps, name="context")
        for i in range(cfg.n_layer):
            with b.scope(f"blk.{i}"):
                k, v = self._kv(b, i, ctx, positions)
                k_cache, v_cache = self._caches(b, i)
                b.update_state(k_cache, b.kv_write(k_cache, k, pos, name="k_cache.new"))
                b.update_state(v_cache, b.kv_write(v_cache, v, pos, name="v_cache.new"))
        return b.build()

    def block(self) -> Graph:
        cfg, B = self.cfg, self.cfg.block_size
        b = GraphBuilder("dflash.block")
        b.meta.update(arch="dflash", kind="block")
        tokens = b.input("tokens", DType.I32, (B,))
        positions = b.input("positions", DType.I32, (B,))
        pos = b.input("pos", DType.I32, ())
        kv_len = b.input("kv_len", DType.I32, ())
        h = b.embedding(self._w(b, "token_embd.weight", source="target"), tokens, name="embd")
        for i in range(cfg.n_layer):
            with b.scope(f"blk.{i}"):
                x = b.rmsnorm(h, self._w(b, f"blk.{i}.attn_norm.weight"), eps=cfg.rms_eps)
                q = b.reshape(self._linear(b, x, f"blk.{i}.attn_q.weight"), shape=(B, cfg.n_head, cfg.head_dim))
                q = self._rope(b, b.rmsnorm(q, self._w(b, f"blk.{i}.attn_q_norm.weight"), eps=cfg.rms_eps), positions)
                k, v = self._kv(b, i, x, positions)
                k_cache, v_cache = self._caches(b, i)
                k_all = b.kv_write(k_cache, k, pos, name="k_block")
                v_all = b.kv_write(v_cache, v, pos, name="v_block")
                a = b.attention(q, k_all, v_all, kv_len, scale=1.0 / math.sqrt(cfg.head_dim), causal=False,
                                window=cfg.layer_window(i))
                h = b.add(h, self._linear(b, b.reshape(a, shape=(B, cfg.n_head * cfg.head_dim)),
                                          f"blk.{i}.attn_output.weight"), name="resid_attn")
                x = b.rmsnorm(h, self._w(b, f"blk.{i}.ffn_norm.weight"), eps=cfg.rms_eps)
                mlp = b.mul(b.silu(self._linear(b, x, f"blk.{i}.ffn_gate.weight")),
                            self._linear(b, x, f"blk.{i}.ffn_up.weight"), name="swiglu")
                h = b.add(h, self._linear(b, mlp, f"blk.{i}.ffn_down.weight"), name="resid_ffn")
        out = b.rmsnorm(h, self._w(b, "output_norm.weight"), eps=cfg.rms_eps, name="hidden")
        b.output("hidden", out)
        rows = b.slice(out, axis=0, start=1, stop=B)
        if cfg.draft_vocab:
            logits = self._linear(b, rows, DRAFT_HEAD)
        else:
            logits = self._linear(b, rows, self.target_cfg.head_tensor, source="target")
        b.output("logits", logits)
        b.output("proposals", b.argmax(logits))
        return b.build()
