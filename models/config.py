"""Model hyper-parameters read from GGUF metadata, checked the way llama.cpp's loader would.

A bad file should fail here, with the file and the metadata key or tensor named, rather
than as a shape error deep inside a graph builder. Key names, tensor names and shapes are
llama.cpp's (QWEN35.md §11, DFLASH.md §7.3; checked against real conversions in
fixtures/oracle/*/gguf/*.gguf.txt). `expected_tensors` is the single list of what a file
holds: validation checks files against it and the tiny-model generator writes it.

Shapes are numpy order (ggml `ne` reversed). Sizes with a trailing ggml dim of 1 compare
equal to the squeezed size: the converter writes `ffn_gate_inp_shexp` as ne {H, 1},
llama-quantize rewrites it as {H}, and llama.cpp accepts both.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from dflash_ir.dtypes import DType

from .gguf_file import GGUFError, GGUFFile

TARGET_ARCHS = ("qwen35", "qwen35moe")
DRAFT_ARCH = "dflash"
DEFAULT_FULL_ATTENTION_INTERVAL = 4  # llama.cpp's default when the key is absent

# Metadata key (without the "{arch}." prefix) of each config field: what the reader reads,
# the generator writes, and error messages name.
TARGET_KEYS = {
    "hidden": "embedding_length",
    "n_head": "attention.head_count",
    "n_head_kv": "attention.head_count_kv",
    "head_dim": "attention.key_length",
    "rope_theta": "rope.freq_base",
    "n_rot": "rope.dimension_count",
    "rope_sections": "rope.dimension_sections",
    "rms_eps": "attention.layer_norm_rms_epsilon",
    "ssm_conv_kernel": "ssm.conv_kernel",
    "ssm_d_state": "ssm.state_size",
    "ssm_n_group": "ssm.group_count",
    "ssm_dt_rank": "ssm.time_step_rank",
    "ssm_inner": "ssm.inner_size",
    "ff": "feed_forward_length",
    "n_expert": "expert_count",
    "n_expert_used": "expert_used_count",
    "expert_ff": "expert_feed_forward_length",
    "shared_ff": "expert_shared_feed_forward_length",
    "context_length": "context_length",
    "n_nextn": "nextn_predict_layers",
}
DRAFT_KEYS = {
    "n_layer": "block_count",
    "hidden": "embedding_length",
    "ff": "feed_forward_length",
    "n_head": "attention.head_count",
    "n_head_kv": "attention.head_count_kv",
    "head_dim": "attention.key_length",
    "n_rot": "rope.dimension_count",
    "rope_sections": "rope.dimension_sections",
    "rope_theta": "rope.freq_base",
    "rms_eps": "attention.layer_norm_rms_epsilon",
    "block_size": "block_size",
    "target_layers": "target_layers",
    "sliding_window": "attention.sliding_window",
    "swa_layers": "attention.sliding_window_pattern",
    "context_length": "context_length",
}
MASK_TOKEN_KEYS = ("tokenizer.ggml.mask_token_id", "dflash.mask_token_id")  # standard key first
_MOE_FIELDS = ("n_expert", "n_expert_used", "expert_ff", "shared_ff")

# What our runtime reads. Tensors the converter always keeps in float (1-D, norms, router,
# conv) must stay float: ggml's elementwise and ssm_conv ops need them that way too.
FLOAT_DTYPES = frozenset({DType.F32, DType.F16, DType.BF16})
WEIGHT_DTYPES = FLOAT_DTYPES | {DType.Q8_0}


class ModelConfigError(GGUFError):
    """A GGUF whose metadata or tensors do not describe a model we can run."""


def converter_keeps_f32(name: str, ndim: int) -> bool:
    """llama.cpp's rule for tensors kept in F32 (convert_hf_to_gguf prepare_tensors, llama-quantize)."""
    return (
        ndim == 1
        or name.endswith("_norm.weight")
        or not name.endswith(".weight")
        or any(part in name for part in (".ffn_gate_inp", ".ssm_conv1d"))
    )


def allowed_dtypes(name: str, shape: tuple[int, ...]) -> frozenset[DType]:
    """Storage types we accept for tensor `name`."""
    return FLOAT_DTYPES if converter_keeps_f32(name, len(squeeze_shape(shape))) else WEIGHT_DTYPES


def interval_pattern(n_layer: int, interval: int) -> tuple[bool, ...]:
    """Recurrent-layer flags of `{arch}.full_attention_interval`: every interval-th layer is attention."""
    return tuple((i + 1) % interval != 0 for i in range(n_layer))


@dataclass(frozen=True)
class TargetConfig:
    """Hyper-parameters of a `qwen35` (dense) or `qwen35moe` target.

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
    rope_sections: tuple[int, ...]
    rms_eps: float
    ssm_conv_kernel: int
    ssm_d_state: int
    ssm_n_group: int
    ssm_dt_rank: int
    ssm_inner: int
    ff: int = 0
    n_expert: int = 0
    n_expert_used: int = 0
    expert_ff: int = 0
    shared_ff: int = 0
    tied_output: bool = True
    context_length: int = 262144
    n_nextn: int = 0

    @property
    def is_moe(self) -> bool:
        return self.arch == "qwen35moe"

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
        _check_arch(f.metadata, source, want_target=True)
        embd = f.tensors.get("token_embd.weight")
        if embd is None:
            raise ModelConfigError(f"{source}: tensor token_embd.weight is missing (it gives the vocabulary size)")
        cfg = cls.from_metadata(
            f.metadata, vocab_size=embd.shape[0], tied_output="output.weight" not in f.tensors, source=source
        )
        tokens = f.metadata.get("tokenizer.ggml.tokens")
        if tokens is not None and len(tokens) != cfg.vocab_size:
            raise ModelConfigError(
                f"{source}: tokenizer.ggml.tokens has {len(tokens)} entries but token_embd.weight has "
                f"{cfg.vocab_size} rows"
            )
        return cfg

    @classmethod
    def from_metadata(
        cls, meta: Mapping[str, Any], *, vocab_size: int, tied_output: bool, source: str = "<metadata>"
    ) -> TargetConfig:
        """Config from a metadata dict (what `from_gguf` reads, minus the tensor table)."""
        arch = _check_arch(meta, source, want_target=True)
        r = _Reader(meta, source, arch)
        block_count = r.int("block_count")
        n_nextn = r.int(TARGET_KEYS["n_nextn"], 0)
        if not 0 <= n_nextn < block_count:
            raise r.error(TARGET_KEYS["n_nextn"], f"= {n_nextn} must be below block_count = {block_count}")
        n_layer = block_count - n_nextn
        head_dim = r.int(TARGET_KEYS["head_dim"])
        if r.int("attention.value_length", head_dim) != head_dim:
            raise r.error("attention.value_length", f"must equal attention.key_length = {head_dim}")
        ints = [
            "hidden",
            "n_head",
            "n_head_kv",
            "context_length",
            "ssm_conv_kernel",
            "ssm_d_state",
            "ssm_n_group",
            "ssm_dt_rank",
            "ssm_inner",
        ]
        ints += list(_MOE_FIELDS) if arch == "qwen35moe" else ["ff"]
        cfg = cls(
            arch=arch,
            vocab_size=int(vocab_size),
            n_layer=n_layer,
            layer_is_recurrent=_read_layer_pattern(r, n_layer, block_count),
            head_dim=head_dim,
            rope_theta=r.float(TARGET_KEYS["rope_theta"]),
            n_rot=r.int(TARGET_KEYS["n_rot"], head_dim),
            rope_sections=r.ints(TARGET_KEYS["rope_sections"], ()),
            rms_eps=r.float(TARGET_KEYS["rms_eps"]),
            tied_output=bool(tied_output),
            n_nextn=n_nextn,
            **{f: r.int(TARGET_KEYS[f]) for f in ints},
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
        _check_arch(f.metadata, source, want_target=False)
        fc = f.tensors.get("fc.weight")
        if fc is None:
            raise ModelConfigError(f"{source}: tensor fc.weight is missing")
        return cls.from_metadata(f.metadata, fc_in=fc.shape[-1], source=source)

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any], *, fc_in: int, source: str = "<metadata>") -> DraftConfig:
        """Config from a metadata dict plus the stored fc input width."""
        _check_arch(meta, source, want_target=False)
        r = _Reader(meta, source, DRAFT_ARCH)
        n_layer = r.int(DRAFT_KEYS["n_layer"])
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
            mask_token_id=_read_mask_id(meta, source),
            fc_in=int(fc_in),
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


# -- consistency checks ------------------------------------------------------------------


def check_target(cfg: TargetConfig, source: str) -> None:
    """Raise ModelConfigError naming the key of the first inconsistent hyper-parameter."""
    positive = ["hidden", "n_head", "n_head_kv", "head_dim", "n_rot", "rope_theta", "rms_eps", "context_length"]
    positive += ["ssm_conv_kernel", "ssm_d_state", "ssm_n_group", "ssm_dt_rank", "ssm_inner"]
    _check_positive(cfg, source, positive + (list(_MOE_FIELDS) if cfg.is_moe else ["ff"]))
    if cfg.vocab_size <= 0:
        raise ModelConfigError(f"{source}: token_embd.weight has no rows")
    if len(cfg.layer_is_recurrent) != cfg.n_layer:
        raise ModelConfigError(
            f"{source}: the layer pattern has {len(cfg.layer_is_recurrent)} entries for {cfg.n_layer} layers"
        )
    _check_heads_and_rope(cfg, source)
    if cfg.ssm_dt_rank % cfg.ssm_n_group:
        raise _field_error(
            cfg,
            source,
            "ssm_dt_rank",
            f"= {cfg.ssm_dt_rank} value heads is not a multiple of ssm.group_count = {cfg.ssm_n_group} key heads",
        )
    if cfg.ssm_inner != cfg.ssm_dt_rank * cfg.ssm_d_state:
        raise _field_error(
            cfg,
            source,
            "ssm_inner",
            f"= {cfg.ssm_inner} must equal ssm.time_step_rank * "
            f"ssm.state_size = {cfg.ssm_dt_rank} * {cfg.ssm_d_state} (value head dim = key head dim)",
        )
    if cfg.is_moe and cfg.n_expert_used > cfg.n_expert:
        raise _field_error(cfg, source, "n_expert_used", f"= {cfg.n_expert_used} exceeds expert_count = {cfg.n_expert}")


def check_draft(cfg: DraftConfig, source: str) -> None:
    """Raise ModelConfigError naming the key of the first inconsistent draft hyper-parameter."""
    _check_positive(
        cfg,
        source,
        [
            "n_layer",
            "hidden",
            "ff",
            "n_head",
            "n_head_kv",
            "head_dim",
            "n_rot",
            "rope_theta",
            "rms_eps",
            "context_length",
        ],
    )
    _check_heads_and_rope(cfg, source)
    if cfg.block_size < 2:
        raise _field_error(
            cfg, source, "block_size", f"= {cfg.block_size} must be at least 2 (anchor + one drafted token)"
        )
    if not cfg.target_layers or min(cfg.target_layers) < 1:
        raise _field_error(
            cfg,
            source,
            "target_layers",
            f"= {list(cfg.target_layers)} must be a non-empty list of ids >= 1 (stored ids are HF layer ids + 1)",
        )
    if cfg.mask_token_id < 0:
        raise ModelConfigError(f"{source}: {MASK_TOKEN_KEYS[0]} = {cfg.mask_token_id} is negative")
    if cfg.sliding_window < 0:
        raise _field_error(cfg, source, "sliding_window", "is negative")
    if cfg.swa_layers and len(cfg.swa_layers) != cfg.n_layer:
        raise _field_error(
            cfg, source, "swa_layers", f"has {len(cfg.swa_layers)} entries for block_count = {cfg.n_layer}"
        )


def check_pair(draft_cfg: DraftConfig, target_cfg: TargetConfig, *, draft_path: Any, target_path: Any) -> None:
    """Raise ModelConfigError if the draft cannot run on this target (it borrows its embeddings and lm_head)."""
    where = f"draft {draft_path} / target {target_path}"
    if draft_cfg.hidden != target_cfg.hidden:
        raise ModelConfigError(
            f"{where}: hidden size mismatch: {DraftConfig.key('hidden')} = {draft_cfg.hidden} but "
            f"{target_cfg.key('hidden')} = {target_cfg.hidden} (the draft reads the target's embeddings)"
        )
    if not 0 <= draft_cfg.mask_token_id < target_cfg.vocab_size:
        raise ModelConfigError(
            f"{where}: {MASK_TOKEN_KEYS[0]} = {draft_cfg.mask_token_id} is outside the target vocabulary "
            f"(token_embd.weight has {target_cfg.vocab_size} rows)"
        )
    bad = [i for i in draft_cfg.target_layers if not 1 <= i <= target_cfg.n_layer]
    if bad:
        raise ModelConfigError(
            f"{where}: {DraftConfig.key('target_layers')} = {list(draft_cfg.target_layers)}: ids {bad} are outside "
            f"1..{target_cfg.n_layer} (stored ids are HF layer ids + 1; the target has {target_cfg.n_layer} layers)"
        )
    want = draft_cfg.n_taps * target_cfg.hidden
    if draft_cfg.fc_in != want:
        raise ModelConfigError(
            f"{where}: fc.weight input width {draft_cfg.fc_in} != {draft_cfg.n_taps} taps * target hidden "
            f"{target_cfg.hidden} = {want}"
        )


def _field_error(cfg: TargetConfig | DraftConfig, source: str, field: str, problem: str) -> ModelConfigError:
    return ModelConfigError(f"{source}: {cfg.key(field)} {problem}")


def _check_positive(cfg: TargetConfig | DraftConfig, source: str, fields: list[str]) -> None:
    for field in fields:
        if getattr(cfg, field) <= 0:
            raise _field_error(cfg, source, field, f"= {getattr(cfg, field)} must be positive")


def _check_heads_and_rope(cfg: TargetConfig | DraftConfig, source: str) -> None:
    if cfg.n_head % cfg.n_head_kv:
        raise _field_error(
            cfg, source, "n_head_kv", f"= {cfg.n_head_kv} does not divide attention.head_count = {cfg.n_head}"
        )
    if cfg.n_rot > cfg.head_dim or cfg.n_rot % 2:
        raise _field_error(
            cfg, source, "n_rot", f"= {cfg.n_rot} must be even and at most attention.key_length = {cfg.head_dim}"
        )
    sections = cfg.rope_sections
    if sections and (len(sections) > 4 or min(sections) < 0 or sum(sections) != cfg.n_rot // 2):
        raise _field_error(
            cfg,
            source,
            "rope_sections",
            f"= {list(sections)} must be at most 4 non-negative entries "
            f"summing to rope.dimension_count / 2 = {cfg.n_rot // 2}",
        )


# -- tensors -----------------------------------------------------------------------------


def expected_tensors(cfg: TargetConfig | DraftConfig) -> dict[str, tuple[int, ...]]:
    """Required tensors of `cfg`'s file with numpy-order shapes, in the converter's order.

    Target MTP blocks are not included (see `mtp_tensors`); a draft's optional
    token_embd/output are not either.
    """
    if isinstance(cfg, DraftConfig):
        return _draft_tensors(cfg)
    t = {"token_embd.weight": (cfg.vocab_size, cfg.hidden)}
    for i, recurrent in enumerate(cfg.layer_is_recurrent):
        t |= _target_block(cfg, i, recurrent)
    t["output_norm.weight"] = (cfg.hidden,)
    if not cfg.tied_output:
        t["output.weight"] = (cfg.vocab_size, cfg.hidden)
    return t


def mtp_tensors(cfg: TargetConfig) -> dict[str, tuple[int, ...]]:
    """Tensors of the MTP blocks blk.{n_layer}.. (optional: validated only as far as present, never run)."""
    t: dict[str, tuple[int, ...]] = {}
    h = cfg.hidden
    for i in range(cfg.n_layer, cfg.block_count):
        t[f"blk.{i}.nextn.eh_proj.weight"] = (h, 2 * h)
        t |= _target_block(cfg, i, recurrent=False)
        t |= {f"blk.{i}.nextn.{n}.weight": (h,) for n in ("shared_head_norm", "enorm", "hnorm")}
    return t


def _target_block(cfg: TargetConfig, i: int, recurrent: bool) -> dict[str, tuple[int, ...]]:
    h, hv, vd = cfg.hidden, cfg.ssm_dt_rank, cfg.ssm_inner
    if cfg.is_moe:
        e, ef, sf = cfg.n_expert, cfg.expert_ff, cfg.shared_ff
        ffn = {
            "ffn_down_exps.weight": (e, h, ef),
            "ffn_gate_exps.weight": (e, ef, h),
            "ffn_up_exps.weight": (e, ef, h),
            "ffn_gate_inp.weight": (e, h),
            "ffn_down_shexp.weight": (h, sf),
            "ffn_gate_shexp.weight": (sf, h),
            "ffn_up_shexp.weight": (sf, h),
            "ffn_gate_inp_shexp.weight": (1, h),
        }
    else:
        ffn = _swiglu(h, cfg.ff)
    ffn["post_attention_norm.weight"] = (h,)
    if recurrent:
        mixer = {
            "ssm_a": (hv,),
            "ssm_conv1d.weight": (cfg.conv_channels, cfg.ssm_conv_kernel),
            "ssm_dt.bias": (hv,),
            "ssm_alpha.weight": (hv, h),
            "ssm_beta.weight": (hv, h),
            "attn_qkv.weight": (cfg.conv_channels, h),
            "attn_gate.weight": (vd, h),
            "ssm_norm.weight": (cfg.ssm_head_v_dim,),
            "ssm_out.weight": (h, vd),
        }
        block = {"attn_norm.weight": (h,)} | mixer | ffn
    else:  # the query projection holds [q_h | gate_h] per head
        block = {"attn_norm.weight": (h,)} | ffn | _attention(h, cfg.head_dim, 2 * cfg.q_dim, cfg.kv_dim, cfg.q_dim)
    return {f"blk.{i}.{n}": s for n, s in block.items()}


def _draft_tensors(cfg: DraftConfig) -> dict[str, tuple[int, ...]]:
    h = cfg.hidden
    t = {"fc.weight": (h, cfg.n_taps * h), "enc.output_norm.weight": (h,)}
    for i in range(cfg.n_layer):
        block = (
            {"attn_norm.weight": (h,)}
            | _swiglu(h, cfg.ff)
            | {"ffn_norm.weight": (h,)}
            | _attention(h, cfg.head_dim, cfg.q_dim, cfg.kv_dim, cfg.q_dim)
        )
        t |= {f"blk.{i}.{n}": s for n, s in block.items()}
    t["output_norm.weight"] = (h,)
    return t


def _swiglu(h: int, ff: int) -> dict[str, tuple[int, ...]]:
    return {"ffn_down.weight": (h, ff), "ffn_gate.weight": (ff, h), "ffn_up.weight": (ff, h)}


def _attention(h: int, hd: int, q_rows: int, kv: int, o_cols: int) -> dict[str, tuple[int, ...]]:
    return {
        "attn_k_norm.weight": (hd,),
        "attn_k.weight": (kv, h),
        "attn_output.weight": (h, o_cols),
        "attn_q_norm.weight": (hd,),
        "attn_q.weight": (q_rows, h),
        "attn_v.weight": (kv, h),
    }


def validate_tensors(f: GGUFFile, cfg: TargetConfig | DraftConfig) -> None:
    """Check every expected tensor is present with its shape and a supported type, and nothing else is there.

    MTP blocks of a target, and a draft's token_embd/output, are optional and unchecked.
    """
    source = str(f.path)
    expected = expected_tensors(cfg)
    for name, shape in expected.items():
        info = f.tensors.get(name)
        if info is None:
            raise ModelConfigError(f"{source}: tensor {name} is missing (expected shape {_fmt(shape)})")
        if squeeze_shape(info.shape) != squeeze_shape(shape):
            raise ModelConfigError(f"{source}: tensor {name} has shape {_fmt(info.shape)}, expected {_fmt(shape)}")
        allowed = allowed_dtypes(name, shape)
        if info.dtype not in allowed:
            names = ", ".join(sorted(d.value.upper() for d in allowed))
            raise ModelConfigError(
                f"{source}: tensor {name} has type {info.dtype.value.upper()}, "
                f"which is not supported for it (supported: {names})"
            )
    for name in f.tensors:
        if name not in expected and not _optional(name, cfg):
            raise ModelConfigError(f"{source}: unexpected tensor {name} (not part of a {_describe(cfg)})")


def _optional(name: str, cfg: TargetConfig | DraftConfig) -> bool:
    if isinstance(cfg, DraftConfig):
        return name in ("token_embd.weight", "output.weight")
    parts = name.split(".")
    return parts[0] == "blk" and parts[1].isdigit() and cfg.n_layer <= int(parts[1]) < cfg.block_count


def _describe(cfg: TargetConfig | DraftConfig) -> str:
    if isinstance(cfg, DraftConfig):
        return f"{DRAFT_ARCH} draft with {cfg.n_layer} layers"
    tied = "tied" if cfg.tied_output else "untied"
    return f"{cfg.arch} model with {cfg.n_layer} layers + {cfg.n_nextn} MTP and {tied} output"


def squeeze_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Drop leading numpy (= trailing ggml) dims of 1, as ggml_n_dims does (llama-quantize writes that many)."""
    shape = tuple(int(d) for d in shape)
    while len(shape) > 1 and shape[0] == 1:
        shape = shape[1:]
    return shape


def _fmt(shape: tuple[int, ...]) -> str:
    shape = tuple(int(d) for d in shape)
    return f"{shape} (ggml ne {list(reversed(shape))})"


# -- metadata reading --------------------------------------------------------------------

_REQUIRED = object()


class _Reader:
    """Typed access to one file's `{arch}.*` metadata; errors name the file and the key."""

    def __init__(self, meta: Mapping[str, Any], source: str, arch: str):
        self.meta, self.source, self.arch = meta, source, arch

    def error(self, key: str, problem: str) -> ModelConfigError:
        return ModelConfigError(f"{self.source}: {self.arch}.{key} {problem}")

    def _get(self, key: str, default: Any) -> Any:
        full = f"{self.arch}.{key}"
        if full in self.meta:
            return self.meta[full]
        if default is _REQUIRED:
            raise ModelConfigError(f"{self.source}: metadata key {full} is missing")
        return default

    def int(self, key: str, default: Any = _REQUIRED) -> int:
        v = self._get(key, default)
        if not _is_int(v):
            raise self.error(key, f"= {v!r} is not an integer")
        return int(v)

    def float(self, key: str, default: Any = _REQUIRED) -> float:
        v = self._get(key, default)
        if not (_is_int(v) or isinstance(v, (float, np.floating))):
            raise self.error(key, f"= {v!r} is not a number")
        return float(v)

    def ints(self, key: str, default: Any = _REQUIRED) -> tuple[int, ...]:
        v = self._get(key, default)
        if not _is_array(v) or not all(_is_int(x) for x in v):
            raise self.error(key, f"= {v!r} is not an integer array")
        return tuple(int(x) for x in v)

    def bools(self, key: str, default: Any = _REQUIRED) -> tuple[bool, ...]:
        v = self._get(key, default)
        if not _is_array(v) or not all(isinstance(x, (bool, np.bool_)) for x in v):
            raise self.error(key, f"= {v!r} is not a bool array")
        return tuple(bool(x) for x in v)


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _is_array(v: Any) -> bool:
    return isinstance(v, (list, tuple, np.ndarray))


def _read_layer_pattern(r: _Reader, n_layer: int, block_count: int) -> tuple[bool, ...]:
    """llama.cpp: `attention.recurrent_layers` (one flag per block) if present, else the interval rule."""
    if f"{r.arch}.attention.recurrent_layers" in r.meta:
        flags = r.bools("attention.recurrent_layers")
        if len(flags) != block_count:
            raise r.error("attention.recurrent_layers", f"has {len(flags)} entries for block_count = {block_count}")
        return flags[:n_layer]
    interval = r.int("full_attention_interval", DEFAULT_FULL_ATTENTION_INTERVAL)
    if interval <= 0:
        raise r.error("full_attention_interval", f"= {interval} must be positive")
    return interval_pattern(n_layer, interval)


def _read_mask_id(meta: Mapping[str, Any], source: str) -> int:
    for key in MASK_TOKEN_KEYS:
        if key in meta:
            if not _is_int(meta[key]):
                raise ModelConfigError(f"{source}: {key} = {meta[key]!r} is not an integer")
            return int(meta[key])
    raise ModelConfigError(
        f"{source}: metadata key {MASK_TOKEN_KEYS[0]} (or {MASK_TOKEN_KEYS[1]}) is missing: "
        "a DFlash draft needs its mask token id"
    )


def _check_arch(meta: Mapping[str, Any], source: str, *, want_target: bool) -> str:
    arch = meta.get("general.architecture")
    if want_target and arch == DRAFT_ARCH:
        raise ModelConfigError(
            f"{source}: general.architecture is '{DRAFT_ARCH}': this is a DFlash draft model; "
            "pass it as the draft (-md), not as the target (-m)"
        )
    if not want_target and arch in TARGET_ARCHS:
        raise ModelConfigError(
            f"{source}: general.architecture is '{arch}': this is a target model; "
            f"pass it as the target (-m), not as the draft (-md)"
        )
    supported = TARGET_ARCHS if want_target else (DRAFT_ARCH,)
    if arch not in supported:
        role = "target" if want_target else "draft"
        raise ModelConfigError(
            f"{source}: general.architecture {arch!r} is not supported as a {role} (supported: {', '.join(supported)})"
        )
    return arch
