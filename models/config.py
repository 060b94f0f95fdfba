"""The two model configs, TargetConfig (qwen35 / qwen35moe / llama / qwen3) and DraftConfig
(dflash), read from GGUF metadata and the tensor table the way llama.cpp's loader would.

A bad file fails here, with the file and the metadata key or tensor named, rather than as a
shape error deep inside a graph builder: reading is typed (metadata.py), the values are
checked for consistency and bounded (checks.py) and, by `validate_tensors`, the tensor
table against what the config implies (tensors.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from .checks import check_draft, check_layer_count, check_target
from .gguf_file import GGUFFile
from .metadata import (
    DRAFT_ARCH,
    DRAFT_KEYS,
    HYBRID_ARCHS,
    MOE_FIELDS,
    TARGET_KEYS,
    REQUIRED,
    MetadataReader,
    ModelConfigError,
    check_arch,
    read_mask_id,
)
from .tensors import D2T, FLOAT_DTYPES, ROPE_FACTORS

DEFAULT_FULL_ATTENTION_INTERVAL = 4  # llama.cpp's default when the key is absent
DEFAULT_ROPE_THETA = 10000.0  # llama.cpp's rope.freq_base when the key is absent


def interval_pattern(n_layer: int, interval: int) -> tuple[bool, ...]:
    """Recurrent-layer flags of `{arch}.full_attention_interval`: every interval-th layer is attention."""
    return tuple((i + 1) % interval != 0 for i in range(n_layer))


@dataclass(frozen=True)
class TargetConfig:
    """Hyper-parameters of a target: `qwen35` (dense) or `qwen35moe` (hybrid Gated DeltaNet
    + attention), `llama` or `qwen3` (attention in every layer, ssm sizes 0).

    `n_layer` counts main layers only (block_count - nextn_predict_layers): MTP blocks
    `blk.{n_layer}..` are never run. Gated DeltaNet sizes use llama.cpp's names:
    Hk = ssm_n_group key heads, Hv = ssm_dt_rank value heads, dk = dv = ssm_d_state,
    Vd = ssm_inner = Hv * dv.
    """

    arch: str
    vocab_size: int
    hidden: int
    n_layer: int
    layer_is_recurrent: tuple[bool, ...]
    n_head: int
    n_head_kv: int
    head_dim: int
    rope_theta: float
    n_rot: int
    rms_eps: float
    rope_sections: tuple[int, ...] = ()
    ssm_conv_kernel: int = 0
    ssm_d_state: int = 0
    ssm_n_group: int = 0
    ssm_dt_rank: int = 0
    ssm_inner: int = 0
    ff: int = 0
    n_expert: int = 0
    n_expert_used: int = 0
    expert_ff: int = 0
    shared_ff: int = 0
    tied_output: bool = True
    context_length: int = 262144
    n_nextn: int = 0
    rope_freq_factors: tuple[float, ...] = ()  # Llama 3 RoPE scaling: tensor rope_freqs.weight
    role: ClassVar[str] = "target"

    @property
    def head_tensor(self) -> str:
        """The tensor the logits are made with: the embedding when tied."""
        return "token_embd.weight" if self.tied_output else "output.weight"

    @property
    def is_moe(self) -> bool:
        return self.arch == "qwen35moe"

    @property
    def is_hybrid(self) -> bool:
        """Gated DeltaNet layers between the attention layers (the qwen35 family)."""
        return self.arch in HYBRID_ARCHS

    @property
    def gated_attention(self) -> bool:
        """The query projection holds [q_h | gate_h] per head; o is gated by sigmoid(gate)."""
        return self.is_hybrid

    @property
    def qk_norm(self) -> bool:
        """Per-head RMSNorm of q and k before RoPE (attn_q_norm / attn_k_norm)."""
        return self.arch != "llama"

    @property
    def permuted_qk(self) -> bool:
        """llama.cpp's converter permutes llama's q/k rows so that its adjacent-pair RoPE
        matches HF's rotate-half: the graph ropes adjacent pairs too (ops/position.py)."""
        return self.arch == "llama"

    @property
    def ffn_norm(self) -> str:
        """Name of the norm before the FFN (Qwen3.5 calls it post_attention_norm)."""
        return "post_attention_norm" if self.is_hybrid else "ffn_norm"

    @property
    def block_count(self) -> int:
        return self.n_layer + self.n_nextn

    @property
    def key_dim(self) -> int:
        return self.ssm_n_group * self.ssm_d_state

    @property
    def value_dim(self) -> int:
        return self.ssm_inner

    @property
    def ssm_head_v_dim(self) -> int:
        return self.ssm_inner // self.ssm_dt_rank

    @property
    def conv_channels(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_head_kv * self.head_dim

    @property
    def recurrent_layers(self) -> tuple[int, ...]:
        return tuple(i for i, r in enumerate(self.layer_is_recurrent) if r)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, r in enumerate(self.layer_is_recurrent) if not r)

    def key(self, field: str) -> str:
        """Metadata key holding `field`."""
        return f"{self.arch}.{TARGET_KEYS[field]}"

    @classmethod
    def from_gguf(cls, f: GGUFFile) -> TargetConfig:
        """Config of target file `f`; vocab size and tying come from its tensor table."""
        source = str(f.path)
        check_arch(f.metadata, source, want_target=True)
        embd = f.tensors.get("token_embd.weight")
        if embd is None:
            raise ModelConfigError(f"{source}: tensor token_embd.weight is missing (it gives the vocabulary size)")
        cfg = cls.from_metadata(f.metadata, vocab_size=embd.shape[0], tied_output="output.weight" not in f.tensors,
                                source=source, tensor_names=f.tensors, rope_freq_factors=_rope_factors(f, source))
        tokens = f.metadata.get("tokenizer.ggml.tokens")
        if tokens is not None and len(tokens) != cfg.vocab_size:
            raise ModelConfigError(
                f"{source}: tokenizer.ggml.tokens has {len(tokens)} entries but token_embd.weight has "
                f"{cfg.vocab_size} rows"
            )
        return cfg

    @classmethod
    def from_metadata(
        cls, meta: Mapping[str, Any], *, vocab_size: int, tied_output: bool, source: str = "<metadata>",
        tensor_names: Iterable[str] | None = None, rope_freq_factors: tuple[float, ...] = (),
    ) -> TargetConfig:
        """Config from a metadata dict (what `from_gguf` reads, with the values of its
        rope_freqs.weight); with the file's `tensor_names`, the layer count is checked against
        them before anything per layer is built."""
        arch = check_arch(meta, source, want_target=True)
        r = MetadataReader(meta, source, arch)
        block_count = r.int("block_count")
        n_nextn = r.int(TARGET_KEYS["n_nextn"], 0)
        if not 0 <= n_nextn < block_count:
            raise r.error(TARGET_KEYS["n_nextn"], f"= {n_nextn} must be below block_count = {block_count}")
        n_layer = block_count - n_nextn
        if tensor_names is not None:
            check_layer_count(tensor_names, r, "block_count", n_layer)
        hybrid = arch in HYBRID_ARCHS
        ints = ["hidden", "n_head", "n_head_kv", "context_length"]
        if hybrid:
            ints += ["ssm_conv_kernel", "ssm_d_state", "ssm_n_group", "ssm_dt_rank", "ssm_inner"]
        ints += list(MOE_FIELDS) if arch == "qwen35moe" else ["ff"]
        sizes = {f: r.int(TARGET_KEYS[f]) for f in ints}
        # llama.cpp's defaults where a dense file leaves the key out: n_embd / n_head, 10000
        head_dim = r.int(TARGET_KEYS["head_dim"], REQUIRED if hybrid else _head_dim(r, sizes))
        if r.int("attention.value_length", head_dim) != head_dim:
            raise r.error("attention.value_length", f"must equal attention.key_length = {head_dim}")
        if not hybrid:
            _check_no_rope_scaling(r)
        cfg = cls(
            arch=arch,
            vocab_size=int(vocab_size),
            n_layer=n_layer,
            layer_is_recurrent=_read_layer_pattern(r, n_layer, block_count) if hybrid else (False,) * n_layer,
            head_dim=head_dim,
            rope_theta=r.float(TARGET_KEYS["rope_theta"], REQUIRED if hybrid else DEFAULT_ROPE_THETA),
            n_rot=r.int(TARGET_KEYS["n_rot"], head_dim),
            rope_sections=r.ints(TARGET_KEYS["rope_sections"], ()),
            rms_eps=r.float(TARGET_KEYS["rms_eps"]),
            tied_output=bool(tied_output),
            n_nextn=n_nextn,
            rope_freq_factors=tuple(rope_freq_factors),
            **sizes,
        )
        check_target(cfg, source)
        return cfg


@dataclass(frozen=True)
class DraftConfig:
    """Hyper-parameters of a `dflash` draft GGUF.

    `target_layers` is stored as llama.cpp has it: HF layer ids + 1. llama.cpp taps the
    *input* of target layer `id`, which is the output of HF layer `id - 1`, i.e. HF
    `hidden_states[id]`; the converter writes `[i + 1 for i in target_layer_ids]`. So a
    stored id must lie in 1..n_layer of the target (n_layer taps the last layer's output),
    and `tap_layers` gives the 0-based HF ids (whose outputs are concatenated into fc).
    `fc_in` is the stored input width of fc.weight (n_taps * hidden in a valid pair).
    `n_rot` is rope.dimension_count, the head dim when absent (drafts rotate whole heads).
    `swa_layers` flags the sliding-window layers (empty: no sliding window).
    `draft_vocab` is the row count of the draft's own reduced output head (`output.weight`,
    whose row i proposes target token `d2t[i]`: llama.cpp's reduced draft vocabulary), 0 when
    the draft borrows the target's whole head.
    """

    n_layer: int
    hidden: int
    n_head: int
    n_head_kv: int
    head_dim: int
    ff: int
    rope_theta: float
    rms_eps: float
    block_size: int
    target_layers: tuple[int, ...]
    mask_token_id: int
    fc_in: int
    n_rot: int
    rope_sections: tuple[int, ...] = ()
    sliding_window: int = 0
    swa_layers: tuple[bool, ...] = ()
    context_length: int = 262144
    draft_vocab: int = 0
    role: ClassVar[str] = "draft"

    @property
    def tap_layers(self) -> tuple[int, ...]:
        """HF 0-based target layer ids whose outputs feed the draft (stored ids - 1)."""
        return tuple(i - 1 for i in self.target_layers)

    @property
    def n_taps(self) -> int:
        return len(self.target_layers)

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_head_kv * self.head_dim

    def layer_window(self, i: int) -> int:
        """Sliding-window size of layer `i` (0: full attention)."""
        return self.sliding_window if self.swa_layers and self.swa_layers[i] else 0

    @staticmethod
    def key(field: str) -> str:
        """Metadata key holding `field`."""
        return f"{DRAFT_ARCH}.{DRAFT_KEYS[field]}"

    @classmethod
    def from_gguf(cls, f: GGUFFile) -> DraftConfig:
        """Config of draft file `f`; `fc_in` comes from its fc.weight."""
        source = str(f.path)
        check_arch(f.metadata, source, want_target=False)
        fc = f.tensors.get("fc.weight")
        if fc is None:
            raise ModelConfigError(f"{source}: tensor fc.weight is missing")
        d2t = f.tensors.get(D2T)
        return cls.from_metadata(f.metadata, fc_in=fc.shape[-1], source=source, tensor_names=f.tensors,
                                 draft_vocab=d2t.shape[0] if d2t is not None and d2t.shape else 0)

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any], *, fc_in: int, source: str = "<metadata>",
                      tensor_names: Iterable[str] | None = None, draft_vocab: int = 0) -> DraftConfig:
        """Config from a metadata dict plus the stored fc input width and reduced-head rows
        (and, as for a target, the tensor names the layer count is checked against)."""
        check_arch(meta, source, want_target=False)
        r = MetadataReader(meta, source, DRAFT_ARCH)
        n_layer = r.int(DRAFT_KEYS["n_layer"])
        if tensor_names is not None:
            check_layer_count(tensor_names, r, DRAFT_KEYS["n_layer"], n_layer)
        head_dim = r.int(DRAFT_KEYS["head_dim"])
        if r.int("attention.value_length", head_dim) != head_dim:
            raise r.error("attention.value_length", f"must equal attention.key_length = {head_dim}")
        window = r.int(DRAFT_KEYS["sliding_window"], 0)
        swa = r.bools(DRAFT_KEYS["swa_layers"], (True,) * n_layer if window else ())
        if swa and not window:
            raise r.error(DRAFT_KEYS["swa_layers"], "is set but attention.sliding_window is missing or 0")
        cfg = cls(
            n_layer=n_layer,
            head_dim=head_dim,
            mask_token_id=read_mask_id(meta, source),
            fc_in=int(fc_in),
            draft_vocab=int(draft_vocab),
            sliding_window=window,
            swa_layers=swa,
            target_layers=r.ints(DRAFT_KEYS["target_layers"]),
            rope_theta=r.float(DRAFT_KEYS["rope_theta"]),
            rms_eps=r.float(DRAFT_KEYS["rms_eps"]),
            rope_sections=r.ints(DRAFT_KEYS["rope_sections"], ()),
            n_rot=r.int(DRAFT_KEYS["n_rot"], head_dim),
            **{
                f: r.int(DRAFT_KEYS[f]) for f in ("hidden", "ff", "n_head", "n_head_kv", "block_size", "context_length")
            },
        )
        check_draft(cfg, source)
        return cfg


def _head_dim(r: MetadataReader, sizes: Mapping[str, int]) -> int:
    """llama.cpp's default head size, n_embd / n_head, when attention.key_length is absent."""
    if sizes["n_head"] <= 0 or sizes["hidden"] % sizes["n_head"]:
        raise r.error(TARGET_KEYS["head_dim"], f"is missing and {r.arch}.{TARGET_KEYS['hidden']} = {sizes['hidden']} "
                                               f"is not a multiple of {r.arch}.{TARGET_KEYS['n_head']} = {sizes['n_head']}")
    return sizes["hidden"] // sizes["n_head"]


def _rope_factors(f: GGUFFile, source: str) -> tuple[float, ...]:
    """The values of tensor rope_freqs.weight (Llama 3 RoPE scaling, one factor per
    frequency; checked against the config by check_target), or () without it."""
    info = f.tensors.get(ROPE_FACTORS)
    if info is None:
        return ()
    if info.dtype not in FLOAT_DTYPES or len(info.shape) != 1:
        raise ModelConfigError(f"{source}: tensor {ROPE_FACTORS} must be a vector of floats, "
                               f"got {info.dtype.value.upper()} {list(info.shape)}")
    return tuple(float(v) for v in np.asarray(f.dequantize(ROPE_FACTORS), np.float32))


def _check_no_rope_scaling(r: MetadataReader) -> None:
    """RoPE scaling by metadata (linear, YaRN) changes the angles: refused, not ignored. (Llama 3's
    frequency factors come as a tensor, ROPE_FACTORS, and are applied.)"""
    kind = r.meta.get(f"{r.arch}.rope.scaling.type", "none")
    if kind != "none":
        raise r.error("rope.scaling.type", f"= {kind!r}: RoPE scaling is not supported (only 'none')")


def _read_layer_pattern(r: MetadataReader, n_layer: int, block_count: int) -> tuple[bool, ...]:
    """llama.cpp: `attention.recurrent_layers` (one flag per block) if present, else the interval rule."""
    if r.has("attention.recurrent_layers"):
        flags = r.bools("attention.recurrent_layers")
        if len(flags) != block_count:
            raise r.error("attention.recurrent_layers", f"has {len(flags)} entries for block_count = {block_count}")
        return flags[:n_layer]
    interval = r.int("full_attention_interval", DEFAULT_FULL_ATTENTION_INTERVAL)
    if interval <= 0:
        raise r.error("full_attention_interval", f"= {interval} must be positive")
    return interval_pattern(n_layer, interval)
