"""The demo target in torch: a small Qwen3.5 (`qwen35`) text model with Hugging Face's parameter conventions.

Parameters follow transformers' `Qwen3_5ForCausalLM` (zero-centred `1 + w` RMSNorms, `A_log`,
grouped value-head order, `q_proj` rows interleaving [q_h | gate_h] per head), so `export.py`
has to apply llama.cpp's converter transforms to reach the GGUF; the export test checks the
result against our interpreter. The Gated DeltaNet uses the chunked form (QWEN35.md §5.4) for
any number of rows, on top of an optional carried state, so one forward serves training,
prefill and cached greedy decoding.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

GDN_CHUNK = 32  # faster than 64 on CPU; any size gives the same result


@dataclass(frozen=True)
class TargetHParams:
    vocab_size: int = 4096
    hidden: int = 192
    n_layer: int = 8
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 64
    n_rot: int = 16  # partial_rotary_factor 0.25
    rope_sections: tuple[int, ...] = (3, 3, 2, 0)  # interleaved mRoPE; all equal for text
    rope_theta: float = 1e7
    ff: int = 576
    ssm_k_heads: int = 2
    ssm_v_heads: int = 4
    ssm_head_dim: int = 32  # dk = dv
    conv_kernel: int = 4
    rms_eps: float = 1e-6
    full_attention_interval: int = 4

    def is_recurrent(self, i: int) -> bool:
        return (i + 1) % self.full_attention_interval != 0

    def to_dict(self) -> dict:
        return asdict(self)


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    """RMSNorm times `w` (DFlash drafts) or, centered, Qwen3.5's `1 + w` with w starting at 0
    (the GGUF stores 1 + w)."""

    def __init__(self, dim: int, eps: float, *, centered: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if centered else torch.ones(dim))
        self.eps = eps
        self.centered = centered

    def forward(self, x):
        return rms(x, self.eps) * (1 + self.weight if self.centered else self.weight)


def rope(x: torch.Tensor, positions: torch.Tensor, n_rot: int, theta: float) -> torch.Tensor:
    """Partial NeoX RoPE on the first n_rot dims of x [B, T, heads, D]; positions [T] or [B, T]."""
    inv = theta ** (-torch.arange(0, n_rot, 2, dtype=torch.float32) / n_rot)
    ang = positions.float()[..., None] * inv  # [(B,) T, n_rot/2]
    cos, sin = ang.cos()[..., None, :], ang.sin()[..., None, :]
    half = n_rot // 2
    x1, x2, rest = x[..., :half], x[..., half:n_rot], x[..., n_rot:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos, rest], dim=-1)


class GatedAttention(nn.Module):
    def __init__(self, hp: TargetHParams):
        super().__init__()
        self.hp = hp
        H, D = hp.hidden, hp.head_dim
        self.q_proj = nn.Linear(H, hp.n_head * D * 2, bias=False)
        self.k_proj = nn.Linear(H, hp.n_head_kv * D, bias=False)
        self.v_proj = nn.Linear(H, hp.n_head_kv * D, bias=False)
        self.o_proj = nn.Linear(hp.n_head * D, H, bias=False)
        self.q_norm = RMSNorm(D, hp.rms_eps, centered=True)
        self.k_norm = RMSNorm(D, hp.rms_eps, centered=True)

    def forward(self, x, positions, cache: dict | None):
        hp = self.hp
        B, T, _ = x.shape
        qg = self.q_proj(x).view(B, T, hp.n_head, 2 * hp.head_dim)
        q, gate = qg[..., :hp.head_dim], qg[..., hp.head_dim:]
        k = self.k_proj(x).view(B, T, hp.n_head_kv, hp.head_dim)
        v = self.v_proj(x).view(B, T, hp.n_head_kv, hp.head_dim)
        q = rope(self.q_norm(q), positions, hp.n_rot, hp.rope_theta)
        k = rope(self.k_norm(k), positions, hp.n_rot, hp.rope_theta)
        if cache is not None:
            if "k" in cache:
                k, v = torch.cat([cache["k"], k], 1), torch.cat([cache["v"], v], 1)
            cache["k"], cache["v"] = k, v
        rep = hp.n_head // hp.n_head_kv
        q, k, v = (t.transpose(1, 2) for t in (q, k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)))
        S = k.shape[2]
        mask = torch.ones(T, S, dtype=torch.bool).tril(S - T)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1 / math.sqrt(hp.head_dim))
        o = o.transpose(1, 2).reshape(B, T, -1) * torch.sigmoid(gate.reshape(B, T, -1))
        return self.o_proj(o)


def chunk_gated_delta_rule(q, k, v, g, beta, state, chunk: int = GDN_CHUNK):
    """Chunked gated delta rule. q, k [B,H,T,dk] (normalised, q scaled), v [B,H,T,dv], g, beta [B,H,T],
    state [B,H,dk,dv]; returns (o [B,H,T,dv], final state)."""
    B, Hh, T, dk = k.shape
    C = min(chunk, T)
    pad = (-T) % C
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    n = (T + pad) // C
    q, k, v = (t.reshape(B, Hh, n, C, -1) for t in (q, k, v))
    g, beta = g.reshape(B, Hh, n, C).cumsum(-1), beta.reshape(B, Hh, n, C)
    lower = torch.ones(C, C, dtype=torch.bool).tril()
    decay = (g[..., :, None] - g[..., None, :]).masked_fill(~lower, -math.inf).exp()  # [B,H,n,C,C]
    kb = k * beta[..., None]
    A = ((kb @ k.transpose(-1, -2)) * decay).tril(-1)
    eye = torch.eye(C)
    Tinv = torch.linalg.solve_triangular(eye + A, eye.expand_as(A), upper=False, unitriangular=True)
    U = Tinv @ (v * beta[..., None])
    W = Tinv @ (kb * g.exp()[..., None])
    qk = (q @ k.transpose(-1, -2)) * decay
    outs = []
    for i in range(n):
        vp = U[:, :, i] - W[:, :, i] @ state
        gi = g[:, :, i]
        outs.append((q[:, :, i] * gi.exp()[..., None]) @ state + qk[:, :, i] @ vp)
        last = gi[..., -1:]
        state = last.exp()[..., None] * state + (k[:, :, i] * (last - gi).exp()[..., None]).transpose(-1, -2) @ vp
    o = torch.stack(outs, 2).reshape(B, Hh, n * C, -1)[:, :, :T]
    return o, state


class GatedDeltaNet(nn.Module):
    def __init__(self, hp: TargetHParams):
        super().__init__()
        self.hp = hp
        H, Hv, d = hp.hidden, hp.ssm_v_heads, hp.ssm_head_dim
        self.key_dim, self.value_dim = hp.ssm_k_heads * d, Hv * d
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.in_proj_qkv = nn.Linear(H, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(H, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(H, Hv, bias=False)
        self.in_proj_a = nn.Linear(H, Hv, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, hp.conv_kernel, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(Hv))
        self.A_log = nn.Parameter(torch.log(torch.empty(Hv).uniform_(1, 16)))
        self.norm_weight = nn.Parameter(torch.ones(d))  # HF `linear_attn.norm.weight` (plain, not centred)
        self.out_proj = nn.Linear(self.value_dim, H, bias=False)

    def forward(self, x, cache: dict | None):
        hp = self.hp
        B, T, _ = x.shape
        Hk, Hv, d, K = hp.ssm_k_heads, hp.ssm_v_heads, hp.ssm_head_dim, hp.conv_kernel
        mixed = self.in_proj_qkv(x).transpose(1, 2)  # [B, C, T]
        prev = cache["conv"] if cache is not None and "conv" in cache else mixed.new_zeros(B, self.conv_dim, K - 1)
        padded = torch.cat([prev, mixed], 2)
        if cache is not None:
            cache["conv"] = padded[..., -(K - 1):]
        mixed = F.silu(F.conv1d(padded, self.conv1d.weight, groups=self.conv_dim)).transpose(1, 2)
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], -1)
        q = F.normalize(q.reshape(B, T, Hk, d), dim=-1, eps=1e-6).repeat_interleave(Hv // Hk, 2)
        k = F.normalize(k.reshape(B, T, Hk, d), dim=-1, eps=1e-6).repeat_interleave(Hv // Hk, 2)
        v = v.reshape(B, T, Hv, d)
        beta = torch.sigmoid(self.in_proj_b(x))
        g = -self.A_log.exp() * F.softplus(self.in_proj_a(x) + self.dt_bias)
        state = cache["ssm"] if cache is not None and "ssm" in cache else x.new_zeros(B, Hv, d, d)
        o, state = chunk_gated_delta_rule(*(t.transpose(1, 2) for t in (q / math.sqrt(d), k, v, g, beta)), state)
        if cache is not None:
            cache["ssm"] = state
        o = rms(o.transpose(1, 2), hp.rms_eps) * self.norm_weight
        o = o * F.silu(self.in_proj_z(x).view(B, T, Hv, d))
        return self.out_proj(o.reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, hidden: int, ff: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ff, bias=False)
        self.up_proj = nn.Linear(hidden, ff, bias=False)
        self.down_proj = nn.Linear(ff, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, hp: TargetHParams, i: int):
        super().__init__()
        self.recurrent = hp.is_recurrent(i)
        self.input_layernorm = RMSNorm(hp.hidden, hp.rms_eps, centered=True)
        self.mixer = GatedDeltaNet(hp) if self.recurrent else GatedAttention(hp)
        self.post_attention_layernorm = RMSNorm(hp.hidden, hp.rms_eps, centered=True)
        self.mlp = MLP(hp.hidden, hp.ff)

    def forward(self, h, positions, cache):
        x = self.input_layernorm(h)
        h = h + (self.mixer(x, cache) if self.recurrent else self.mixer(x, positions, cache))
        return h + self.mlp(self.post_attention_layernorm(h))


class Target(nn.Module):
    """Tied-embedding Qwen3.5 text model; `forward` returns (logits, residual outputs of every layer)."""

    def __init__(self, hp: TargetHParams):
        super().__init__()
        self.hp = hp
        self.embed_tokens = nn.Embedding(hp.vocab_size, hp.hidden)
        self.layers = nn.ModuleList(Layer(hp, i) for i in range(hp.n_layer))
        self.norm = RMSNorm(hp.hidden, hp.rms_eps, centered=True)
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, ids: torch.Tensor, caches: list[dict] | None = None, start: int = 0):
        positions = torch.arange(start, start + ids.shape[1])
        h = self.embed_tokens(ids)
        hidden = []
        for i, layer in enumerate(self.layers):
            h = layer(h, positions, caches[i] if caches is not None else None)
            hidden.append(h)
        return self.norm(h) @ self.embed_tokens.weight.T, hidden

    @torch.no_grad()
    def greedy(self, prompts: torch.Tensor, n_new: int) -> torch.Tensor:
        """Greedy continuations [B, n_new] of equal-length prompts [B, P], with cached state."""
        caches = [{} for _ in self.layers]
        logits, _ = self(prompts, caches)
        out = [logits[:, -1].argmax(-1)]
        for step in range(n_new - 1):
            logits, _ = self(out[-1][:, None], caches, start=prompts.shape[1] + step)
            out.append(logits[:, -1].argmax(-1))
        return torch.stack(out, 1)
