"""Qwen3.5 / Qwen3.6 targets (GGUF arch `qwen35` dense, `qwen35moe` MoE) as IR graphs.

One builder serves every call shape the runtime needs:
- prefill: T prompt rows, Gated DeltaNet in chunked form;
- verify:  T rows on top of existing state, recurrent form, emitting per-row conv and
           recurrent states so the speculative loop can roll back to any row;
- decode:  one row.
Each returns logits for the rows listed in `logit_rows` (decode: for its one row, without
a gather) and their argmax ids (`greedy`), the
concatenated residual-stream outputs of the tap layers (DFlash features), and updates the
explicit state: a fixed-capacity KV cache per attention layer (rows >= kv_len are ignored,
so rolling back attention is just a shorter kv_len), and conv + recurrent state per Gated
DeltaNet layer.

GGUF conventions honoured here (QWEN35.md §4, §11, §14): norms carry the `+1` already
(except `ssm_norm`), `ssm_a` is -exp(A_log), value heads are in tiled order, the query
projection interleaves [q_h | gate_h] per head, RoPE is partial NeoX with interleaved
multi-section positions, and the output head falls back to `token_embd` when untied.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from dflash_ir.builder import GraphBuilder
from dflash_ir.dtypes import DType
from dflash_ir.ir import Graph, Value

from .config import TargetConfig
from .gguf_file import GGUFFile

GDN_CHUNK = 64


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


class Qwen35Builder:
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
        logit_rows = None if spec.kind == "decode" else b.input("logit_rows", DType.I32, ("R",))

        h = b.embedding(self._w(b, "token_embd.weight"), tokens, name="embd")
        features = []
        for i in range(cfg.n_layer):
            with b.scope(f"blk.{i}"):
                x = b.rmsnorm(h, self._w(b, f"blk.{i}.attn_norm.weight"), eps=cfg.rms_eps)
                if cfg.layer_is_recurrent[i]:
                    x = self._gated_deltanet(b, i, x, spec)
                else:
                    x = self._attention(b, i, x, positions, pos, kv_len)
                h = b.add(h, x, name="resid_attn")
                x = b.rmsnorm(h, self._w(b, f"blk.{i}.post_attention_norm.weight"), eps=cfg.rms_eps)
                x = self._moe(b, i, x) if cfg.n_expert else self._mlp(b, i, x)
                h = b.add(h, x, name="resid_ffn")
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

    def _attention(self, b, i, x, positions, pos, kv_len) -> Value:
        cfg = self.cfg
        T, H, Hkv, D = x.type.shape[0], cfg.n_head, cfg.n_head_kv, cfg.head_dim
        qg = b.reshape(self._linear(b, x, f"blk.{i}.attn_q.weight"), shape=(T, H, 2 * D))
        q = b.slice(qg, axis=2, start=0, stop=D, name="q")
        gate = b.slice(qg, axis=2, start=D, stop=2 * D, name="gate")
        k = b.reshape(self._linear(b, x, f"blk.{i}.attn_k.weight"), shape=(T, Hkv, D))
        v = b.reshape(self._linear(b, x, f"blk.{i}.attn_v.weight"), shape=(T, Hkv, D))
        q = b.rmsnorm(q, self._w(b, f"blk.{i}.attn_q_norm.weight"), eps=cfg.rms_eps)
        k = b.rmsnorm(k, self._w(b, f"blk.{i}.attn_k_norm.weight"), eps=cfg.rms_eps)
        rope = dict(n_rot=cfg.n_rot, theta=cfg.rope_theta, sections=tuple(cfg.rope_sections), interleaved=True)
        q = b.rope(q, positions, **rope)
        k = b.rope(k, positions, **rope)
        k_cache = b.state(f"blk.{i}.k_cache", DType.F32, ("C", Hkv, D))
        v_cache = b.state(f"blk.{i}.v_cache", DType.F32, ("C", Hkv, D))
        k_all = b.kv_write(k_cache, k, pos, name="k_cache.new")
        v_all = b.kv_write(v_cache, v, pos, name="v_cache.new")
        b.update_state(k_cache, k_all)
        b.update_state(v_cache, v_all)
        o = b.attention(q, k_all, v_all, kv_len, scale=1.0 / math.sqrt(D), causal=True)
        o = b.mul(b.reshape(o, shape=(T, H * D)), b.sigmoid(b.reshape(gate, shape=(T, H * D))), name="gated")
        return self._linear(b, o, f"blk.{i}.attn_output.weight")

    def _gated_deltanet(self, b, i, x, spec: GraphSpec) -> Value:
        cfg = self.cfg
        T = x.type.shape[0]
        Hk, Hv, dk, dv = cfg.ssm_n_group, cfg.ssm_dt_rank, cfg.ssm_d_state, cfg.ssm_d_state
        Kd, Vd, C, K = Hk * dk, Hv * dv, cfg.conv_channels, cfg.ssm_conv_kernel
        qkv = self._linear(b, x, f"blk.{i}.attn_qkv.weight")
        z = self._linear(b, x, f"blk.{i}.attn_gate.weight")
        beta = b.sigmoid(self._linear(b, x, f"blk.{i}.ssm_beta.weight"), name="beta")
        alpha = b.add(self._linear(b, x, f"blk.{i}.ssm_alpha.weight"), self._w(b, f"blk.{i}.ssm_dt.bias"))
        g = b.mul(b.softplus(alpha), self._w(b, f"blk.{i}.ssm_a"), name="log_decay")

        conv_state = b.state(f"blk.{i}.conv_state", DType.F32, (K - 1, C))
        conv = b.causal_conv1d(qkv, self._w(b, f"blk.{i}.ssm_conv1d.weight"), conv_state,
                               emit_row_states=spec.row_states, name="conv")
        b.update_state(conv_state, conv[1])
        mixed = b.silu(conv[0])
        q = b.l2norm(b.reshape(b.slice(mixed, axis=1, start=0, stop=Kd), shape=(T, Hk, dk)), eps=cfg.rms_eps, name="q")
        k = b.l2norm(b.reshape(b.slice(mixed, axis=1, start=Kd, stop=2 * Kd), shape=(T, Hk, dk)), eps=cfg.rms_eps, name="k")
        v = b.reshape(b.slice(mixed, axis=1, start=2 * Kd, stop=C), shape=(T, Hv, dv), name="v")

        ssm_state = b.state(f"blk.{i}.ssm_state", DType.F32, (Hv, dk, dv))
        delta = b.gated_delta_rule(q, k, v, g, beta, ssm_state, scale=1.0 / math.sqrt(dk), head_map="tiled",
                                   chunk_size=GDN_CHUNK if spec.chunked else 0,
                                   emit_row_states=spec.row_states, name="delta")
        b.update_state(ssm_state, delta[1])
        if spec.row_states:
            for state, rows in ((conv_state, conv[2]), (ssm_state, delta[2])):
                b.output(f"{state.name}.rows", rows)
                b.meta.setdefault("row_states", []).append((state.name, f"{state.name}.rows"))
        o = b.rmsnorm(delta[0], self._w(b, f"blk.{i}.ssm_norm.weight"), eps=cfg.rms_eps)
        o = b.mul(o, b.silu(b.reshape(z, shape=(T, Hv, dv))), name="gated")
        return self._linear(b, b.reshape(o, shape=(T, Vd)), f"blk.{i}.ssm_out.weight")

    def _swiglu(self, b, x, gate: str, up: str, down: str) -> Value:
        h = b.mul(b.silu(self._linear(b, x, gate)), self._linear(b, x, up), name="swiglu")
        return self._linear(b, h, down)

    def _mlp(self, b, i, x) -> Value:
        return self._swiglu(b, x, f"blk.{i}.ffn_gate.weight", f"blk.{i}.ffn_up.weight", f"blk.{i}.ffn_down.weight")

    def _moe(self, b, i, x) -> Value:
        """Softmax over all experts, top-k, renormalise; only selected experts are computed."""
        cfg = self.cfg
        T, k = x.type.shape[0], cfg.n_expert_used
        probs = b.softmax(self._linear(b, x, f"blk.{i}.ffn_gate_inp.weight"), axis=-1, name="router")
        top_p, top_ids = b.topk(probs, k=k, name="top")
        weights = b.div(top_p, b.sum(top_p, axis=-1, keepdims=True), name="route_w")
        gate = b.expert_matmul(x, self._w(b, f"blk.{i}.ffn_gate_exps.weight"), top_ids, name="exp_gate")
        up = b.expert_matmul(x, self._w(b, f"blk.{i}.ffn_up_exps.weight"), top_ids, name="exp_up")
        act = b.mul(b.silu(gate), up, name="exp_swiglu")
        down = b.expert_matmul(act, self._w(b, f"blk.{i}.ffn_down_exps.weight"), top_ids, name="exp_down")
        routed = b.sum(b.mul(down, b.reshape(weights, shape=(T, k, 1))), axis=1, name="routed")
        shared = self._swiglu(b, x, f"blk.{i}.ffn_gate_shexp.weight", f"blk.{i}.ffn_up_shexp.weight",
                              f"blk.{i}.ffn_down_shexp.weight")
        shared_gate_w = b.reshape(self._w(b, f"blk.{i}.ffn_gate_inp_shexp.weight"), shape=(1, cfg.hidden))
        shared_gate = b.sigmoid(b.matmul(x, shared_gate_w), name="shared_gate")
        return b.add(routed, b.mul(shared, shared_gate), name="moe")


def build_target_graph(gguf: GGUFFile, cfg: TargetConfig, kind: str, *, taps: Sequence[int] = (), rows: int | str = "T") -> Graph:
    return Qwen35Builder(gguf, cfg).build(GraphSpec(kind, tuple(taps), rows))
