"""Qwen3.5 / Qwen3.6 targets (GGUF arch `qwen35` dense, `qwen35moe` MoE) as IR graphs: the
shared decoder (models/transformer.py) with Gated DeltaNet layers between the attention
layers and, for `qwen35moe`, a routed MoE with a shared expert as the FFN.

Gated DeltaNet layers run chunked in prefill. A verify also outputs each such layer's input
projections, the rows the `commit` graph replays the layer's recurrence on: the states after
the accepted rows, computed as a decode of those rows computes them (runtime/target_runner.py).

GGUF conventions honoured here (QWEN35.md §4, §11, §14): norms carry the `+1` already
(except `ssm_norm`), `ssm_a` is -exp(A_log), value heads are in tiled order, the query
projection interleaves [q_h | gate_h] per head, RoPE is partial NeoX with interleaved
multi-section positions, and the output head falls back to `token_embd` when untied.
"""
from __future__ import annotations

import math

from dflash_ir.builder import GraphBuilder
from dflash_ir.dtypes import DType
from dflash_ir.ir import Graph, Value

from .transformer import GraphSpec, Slot, TargetBuilder

GDN_CHUNK = 64
# a Gated DeltaNet layer's input projections: what its recurrence reads of a row, and so what a
# verify outputs for the commit to replay
PROJECTIONS = ("attn_qkv", "attn_gate", "ssm_alpha", "ssm_beta")


class Qwen35Builder(TargetBuilder):
    """The shared decoder with Qwen3.5's recurrent layers and MoE FFN."""

    def _mixer(self, b, i, x, spec: GraphSpec, slots: list[Slot]) -> Value:
        if self.cfg.layer_is_recurrent[i]:
            return self._gated_deltanet(b, i, x, spec, slots)
        return self._attention(b, i, x, slots)

    def _ffn(self, b, i, x) -> Value:
        return self._moe(b, i, x) if self.cfg.n_expert else super()._ffn(b, i, x)

    def commit(self) -> Graph:
        """The Gated DeltaNet states after the first T rows of a verify, from the states before
        it: each layer's recurrence run again on those rows' projections (inputs named as the
        verify outputs them) exactly as the verify ran it, so the same fused kernel writes bit
        for bit the states a decode of those rows writes (under q8 the verify's kernel also
        quantises the layer's output, which the commit's leaves in f32: the same recurrence).
        Each layer's output is an output too: without it the layer would not be the layer the
        fusion pass recognises."""
        cfg = self.cfg
        widths = {"attn_qkv": cfg.conv_channels, "attn_gate": cfg.value_dim,
                  "ssm_alpha": cfg.ssm_dt_rank, "ssm_beta": cfg.ssm_dt_rank}
        b = GraphBuilder(f"{cfg.arch}.commit")
        b.meta.update(arch=cfg.arch, kind="commit")
        spec, alone = GraphSpec("commit"), Slot("", 0, None, None, None, None)  # a recurrence reads no positions
        for i in range(cfg.n_layer):
            if cfg.layer_is_recurrent[i]:
                with b.scope(f"blk.{i}"):
                    rows = {name: b.input(f"blk.{i}.{name}", DType.F32, ("T", widths[name])) for name in PROJECTIONS}
                    b.output(f"blk.{i}.replayed", self._recurrence(b, i, spec, alone, rows.__getitem__))
        return b.build()

    def _gated_deltanet(self, b, i, x, spec: GraphSpec, slots: list[Slot]) -> Value:
        """Each sequence's rows run the conv and the recurrence from its own states."""
        return self._per_sequence(b, i, x, slots, lambda slot, rows: self._recurrence(b, i, spec, slot, rows),
                                  "ssm_out")

    def _recurrence(self, b, i, spec: GraphSpec, slot: Slot, rows) -> Value:
        cfg = self.cfg
        Hk, Hv, dk, dv = cfg.ssm_n_group, cfg.ssm_dt_rank, cfg.ssm_d_state, cfg.ssm_d_state
        Kd, Vd, C, K = Hk * dk, Hv * dv, cfg.conv_channels, cfg.ssm_conv_kernel
        if spec.kind == "verify":
            for name in PROJECTIONS:
                b.output(f"{slot.prefix}blk.{i}.{name}", rows(name))
        qkv = rows("attn_qkv")
        T = qkv.type.shape[0]
        z = rows("attn_gate")
        beta = b.sigmoid(rows("ssm_beta"), name="beta")
        alpha = b.add(rows("ssm_alpha"), self._w(b, f"blk.{i}.ssm_dt.bias"))
        g = b.mul(b.softplus(alpha), self._w(b, f"blk.{i}.ssm_a"), name="log_decay")

        conv_state = slot.state(b, f"blk.{i}.conv_state", DType.F32, (K - 1, C))
        conv = b.causal_conv1d(qkv, self._w(b, f"blk.{i}.ssm_conv1d.weight"), conv_state, name="conv")
        b.update_state(conv_state, conv[1])
        mixed = b.silu(conv[0])
        q = b.l2norm(b.reshape(b.slice(mixed, axis=1, start=0, stop=Kd), shape=(T, Hk, dk)), eps=cfg.rms_eps, name="q")
        k = b.l2norm(b.reshape(b.slice(mixed, axis=1, start=Kd, stop=2 * Kd), shape=(T, Hk, dk)), eps=cfg.rms_eps,
                     name="k")
        v = b.reshape(b.slice(mixed, axis=1, start=2 * Kd, stop=C), shape=(T, Hv, dv), name="v")

        ssm_state = slot.state(b, f"blk.{i}.ssm_state", DType.F32, (Hv, dk, dv))
        delta = b.gated_delta_rule(q, k, v, g, beta, ssm_state, scale=1.0 / math.sqrt(dk), head_map="tiled",
                                   chunk_size=GDN_CHUNK if spec.chunked else 0, name="delta")
        b.update_state(ssm_state, delta[1])
        o = b.rmsnorm(delta[0], self._w(b, f"blk.{i}.ssm_norm.weight"), eps=cfg.rms_eps)
        o = b.mul(o, b.silu(b.reshape(z, shape=(T, Hv, dv))), name="gated")
        return b.reshape(o, shape=(T, Vd))

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

