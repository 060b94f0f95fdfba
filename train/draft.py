"""The DFlash draft in torch (z-lab's `DFlashDraftModel` parameter names) and its training loss.

Forward math as DFLASH.md §2.3: target tap features -> fc -> hidden_norm give per-position
context K/V in every layer; a block [anchor, MASK x (B-1)] attends to the context and to
itself without a causal mask. Norms are plain RMSNorm (`x * w`). Embedding and LM head are
the frozen target's. Training (§5): random anchors over the target's own greedy continuations,
all blocks of a sequence in one forward, each block seeing strictly earlier context and only
itself, same-position labels weighted by exp(-(k-1)/gamma).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .target import MLP, RMSNorm, Target, rope


@dataclass(frozen=True)
class DraftHParams:
    hidden: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]  # HF 0-based ids; the GGUF stores id + 1
    n_layer: int = 2
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 48
    ff: int = 384
    block_size: int = 16
    rope_theta: float = 1e7
    rms_eps: float = 1e-6
    gamma: float = 7.0  # loss decay for block size 16
    context_length: int = 4096

    @staticmethod
    def spread_taps(n_target_layers: int, n_taps: int) -> tuple[int, ...]:
        """z-lab's `build_target_layer_ids`: from layer 1 to n-3, evenly spread."""
        start, end = 1, n_target_layers - 3
        return tuple(round(start + i * (end - start) / (n_taps - 1)) for i in range(n_taps))

    def to_dict(self) -> dict:
        return asdict(self)


def hf_config(hp: dict, n_target_layers: int) -> dict:
    """A z-lab style config.json for these hyper-parameters (what export.draft_config reads)."""
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": hp["block_size"],
        "dflash_config": {"mask_token_id": hp["mask_token_id"], "target_layer_ids": list(hp["target_layer_ids"])},
        "head_dim": hp["head_dim"], "hidden_size": hp["hidden"], "intermediate_size": hp["ff"],
        "num_attention_heads": hp["n_head"], "num_key_value_heads": hp["n_head_kv"],
        "num_hidden_layers": hp["n_layer"], "num_target_layers": n_target_layers,
        "rms_norm_eps": hp["rms_eps"], "rope_theta": hp["rope_theta"],
        "max_position_embeddings": hp["context_length"], "tie_word_embeddings": False,
    }


class Attention(nn.Module):
    def __init__(self, hp: DraftHParams):
        super().__init__()
        self.hp = hp
        H, D = hp.hidden, hp.head_dim
        self.q_proj = nn.Linear(H, hp.n_head * D, bias=False)
        self.k_proj = nn.Linear(H, hp.n_head_kv * D, bias=False)
        self.v_proj = nn.Linear(H, hp.n_head_kv * D, bias=False)
        self.o_proj = nn.Linear(hp.n_head * D, H, bias=False)
        self.q_norm = RMSNorm(D, hp.rms_eps)
        self.k_norm = RMSNorm(D, hp.rms_eps)

    def _kv(self, x, positions):
        B, T, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, T, self.hp.n_head_kv, self.hp.head_dim))
        return rope(k, positions, self.hp.head_dim, self.hp.rope_theta), \
            self.v_proj(x).view(B, T, self.hp.n_head_kv, self.hp.head_dim)

    def forward(self, x, ctx, x_pos, ctx_pos, mask):
        hp = self.hp
        B, Q, _ = x.shape
        q = rope(self.q_norm(self.q_proj(x).view(B, Q, hp.n_head, hp.head_dim)), x_pos, hp.head_dim, hp.rope_theta)
        k_ctx, v_ctx = self._kv(ctx, ctx_pos)  # context: same projections, no input_layernorm
        k_blk, v_blk = self._kv(x, x_pos)
        rep = hp.n_head // hp.n_head_kv
        k = torch.cat([k_ctx, k_blk], 1).repeat_interleave(rep, 2)
        v = torch.cat([v_ctx, v_blk], 1).repeat_interleave(rep, 2)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=mask, scale=1 / math.sqrt(hp.head_dim))
        return self.o_proj(o.transpose(1, 2).reshape(B, Q, -1))


class Layer(nn.Module):
    def __init__(self, hp: DraftHParams):
        super().__init__()
        self.input_layernorm = RMSNorm(hp.hidden, hp.rms_eps)
        self.self_attn = Attention(hp)
        self.post_attention_layernorm = RMSNorm(hp.hidden, hp.rms_eps)
        self.mlp = MLP(hp.hidden, hp.ff)

    def forward(self, h, ctx, h_pos, ctx_pos, mask):
        h = h + self.self_attn(self.input_layernorm(h), ctx, h_pos, ctx_pos, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDraft(nn.Module):
    """Own weights only in `state_dict()`; the target (frozen) is held outside the module tree."""

    def __init__(self, hp: DraftHParams, target: Target):
        super().__init__()
        self.hp = hp
        self._target = [target]
        H = hp.hidden
        self.fc = nn.Linear(len(hp.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, hp.rms_eps)
        self.layers = nn.ModuleList(Layer(hp) for _ in range(hp.n_layer))
        self.norm = RMSNorm(H, hp.rms_eps)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=1 / math.sqrt(m.in_features))

    @property
    def target(self) -> Target:
        return self._target[0]

    def own_state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.state_dict().items()}

    def features(self, tokens: torch.Tensor) -> torch.Tensor:
        """Concatenated residual outputs of the tap layers, [B, L, n_taps * H] (no grad)."""
        with torch.no_grad():
            _, hidden = self.target(tokens)
        return torch.cat([hidden[i] for i in self.hp.target_layer_ids], -1)

    def hidden(self, feats, ctx_pos, block_ids, block_pos, mask):
        """Final-normed draft hidden states of the block rows."""
        ctx = self.hidden_norm(self.fc(feats))
        h = self.target.embed_tokens(block_ids)
        for layer in self.layers:
            h = layer(h, ctx, block_pos, ctx_pos, mask)
        return self.norm(h)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.target.embed_tokens.weight.T

    def first_block(self, feats: torch.Tensor, anchor: int) -> tuple[torch.Tensor, torch.Tensor]:
        """z-lab-style single block after a context of S rows: (hidden [B_s, H], logits of rows 1.. [B_s-1, V])."""
        S, Bs = feats.shape[0], self.hp.block_size
        ids = torch.full((1, Bs), self.hp.mask_token_id)
        ids[0, 0] = anchor
        with torch.no_grad():
            h = self.hidden(feats[None], torch.arange(S), ids, torch.arange(S, S + Bs), None)[0]
            return h, self.logits(h[1:])


def _block_rows(draft: DFlashDraft, tokens: torch.Tensor, anchors: torch.Tensor, feats: torch.Tensor):
    """Final hidden states of rows 1.. of the block at each anchor [B, nA, Bs-1, H], and their
    labels (the tokens there) [B, nA, Bs-1]: all blocks of a sequence in one forward."""
    hp = draft.hp
    Bn, L = tokens.shape
    Bs, n_anchors = hp.block_size, anchors.shape[1]
    offs = torch.arange(Bs)
    pos = (anchors[..., None] + offs).reshape(Bn, -1)  # [B, nA*Bs] absolute positions of block rows
    block_ids = torch.full_like(pos, hp.mask_token_id)
    block_ids[:, ::Bs] = torch.gather(tokens, 1, anchors)
    labels = torch.gather(tokens, 1, pos).view(Bn, n_anchors, Bs)[..., 1:]
    # mask [B, 1, Q, L + Q]: context strictly before the block's anchor, plus the block itself
    ctx_ok = torch.arange(L)[None, None, :] < anchors.repeat_interleave(Bs, 1)[..., None]
    blk = torch.arange(n_anchors).repeat_interleave(Bs)
    own = (blk[:, None] == blk[None, :]).expand(Bn, -1, -1)
    mask = torch.cat([ctx_ok, own], 2)[:, None]
    h = draft.hidden(feats, torch.arange(L), block_ids, pos, mask).view(Bn, n_anchors, Bs, -1)[:, :, 1:]
    return h, labels


def draft_loss(draft: DFlashDraft, tokens: torch.Tensor, *, first_anchor: int, n_anchors: int,
               generator: torch.Generator, feats: torch.Tensor | None = None) -> torch.Tensor:
    """DFlash block loss on sequences `tokens` [B, L] (features computed unless given)."""
    hp = draft.hp
    Bn, L = tokens.shape
    Bs = hp.block_size
    feats = draft.features(tokens) if feats is None else feats
    # anchors: distinct random positions per sequence whose whole block lies inside the sequence
    span = L - Bs - first_anchor + 1
    anchors = torch.stack([torch.randperm(span, generator=generator)[:n_anchors] for _ in range(Bn)]) + first_anchor
    h, labels = _block_rows(draft, tokens, anchors, feats)
    logits = draft.logits(h)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
    w = torch.exp(-torch.arange(Bs - 1, dtype=torch.float32) / hp.gamma).expand(Bn, n_anchors, -1).reshape(-1)
    return (ce * w).sum() / w.sum()


def accepted_per_block(draft: DFlashDraft, tokens: torch.Tensor, anchors: torch.Tensor,
                       feats: torch.Tensor) -> torch.Tensor:
    """How many of each block's greedy proposals a greedy target whose output is `tokens` [1, L]
    would accept (the leading run of matches): tau = 1 + their mean, as speculation measures it."""
    with torch.no_grad():
        h, labels = _block_rows(draft, tokens, anchors[None], feats)
        hits = (draft.logits(h).argmax(-1) == labels)[0].int()
    return hits.cumprod(-1).sum(-1)
