"""Qwen3.5 / Qwen3.6 targets (GGUF arch `qwen35` dense, `qwen35moe` MoE) as IR graphs: the
shared decoder (models/transformer.py) with Gated DeltaNet layers between the attention
layers and, for `qwen35moe`, a routed MoE with a shared expert as the FFN.

Gated DeltaNet layers run chunked in prefill and, in verify, emit per-row conv and
recurrent states so the speculative loop can roll back to any row.

GGUF conventions honoured here (QWEN35.md §4, §11, §14): norms carry the `+1` already
(except `ssm_norm`), `ssm_a` is -exp(A_log), value heads are in tiled order, the query
projection interleaves [q_h | gate_h] per head, RoPE is partial NeoX with interleaved
multi-section positions, and the output head falls back to `token_embd` when untied.
"""
from __future__ import annotations

import math

from dflash_ir.dtypes import DType
from dflash_ir.ir import Value

from .transformer import GraphSpec, Slot, TargetBuilder

GDN_CHUNK = 64


class Qwen35Builder(TargetBuilder):
    """The shared decoder with Qwen3.5's recurrent layers and MoE FFN."""

    def _mixer(self, b, i, x, spec: GraphSpec, slots: list[Slot]) -> Value:
        if self.cfg.layer_is_recurrent[i]:
            return self._gated_deltanet(b, i, x, spec, slots)
        return self._attention(b, i, x, slots)

    def _ffn(self, b, i, x) -> Value:
        return self._moe(b, i, x) if self.cfg.n_expert else super()._ffn(b, i, x)

    def _gated_deltanet(self, b, i, x, spec: GraphSpec, slots: list[Slot]) -> Value:
        """Each sequence's rows run the conv and the recurrence from its own states."""
        return self._per_sequence(b, i, x, slots, lambda slot, rows: self._recurrence(b, i, spec, slot, rows),
                                  "ssm_out")

    def _recurrence(self, b, i, spec: GraphSpec, slot: Slot, rows) -> Value:
        cfg = self.cfg
        Hk, Hv, dk, dv = cfg.ssm_n_group, cfg.ssm_dt_rank, cfg.ssm_d_state, cfg.ssm_d_state
        Kd, Vd, C, K = Hk * dk, Hv * dv, cfg.conv_channels, cfg.ssm_conv_kernel
        qkv = rows("attn_qkv")
        T = qkv.type.shape[0]
        z = rows("attn_gate")
        beta = b.sigmoid(rows("ssm_beta"), name="beta")
        alpha = b.add(rows("ssm_alpha"), self._w(b, f"blk.{i}.ssm_dt.bias"))
        g = b.mul(b.softplus(alpha), self._w(b, f"blk.{i}.ssm_a"), name="log_decay")

        conv_state = slot.state(b, f"blk.{i}.conv_state", DType.F32, (K - 1, C))
        conv = b.causal_conv1d(qkv, self._w(b, f"blk.{i}.ssm_conv1d.weight"), conv_state,
                               emit_row_states=spec.row_states, name="conv")
        b.update_state(conv_state, conv[1])
        mixed = b.silu(conv[0])
        q = b.l2norm(b.reshape(b.slice(mixed, axis=1, start=0, stop=Kd), shape=(T, Hk, dk)), eps=cfg.rms_eps, name="q")
        k = b.l2norm(b.reshape(b.slice(mixed, axis=1, start=Kd, stop=2 * Kd), shape=(T, Hk, dk)), eps=cfg.rms_eps,
                     name="k")
        v = b.reshape(b.slice(mixed, axis=1, start=2 * Kd, stop=C), shape=(T, Hv, dv), name="v")

        ssm_state = slot.state(b, f"blk.{i}.ssm_state", DType.F32, (Hv, dk, dv))
        delta = b.gated_delta_rule(q, k, v, g, beta, ssm_state, scale=1.0 / math.sqrt(dk), head_map="tiled",
                                   chunk_size=GDN_CHUNK if spec.chunked else 0,
                                   emit_row_states=spec.row_states, name="delta")
        b.update_state(ssm_state, delta[1])
        if spec.row_states:
            for state, per_row in ((conv_state, conv[2]), (ssm_state, delta[2])):
                b.output(f"{state.name}.rows", per_row)
                b.meta.setdefault("row_states", []).append((state.name, f"{state.name}.rows"))
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

