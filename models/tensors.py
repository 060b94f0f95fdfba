"""The tensors a model file must hold: `expected_tensors` is the single list of them, which
validation checks files against and the tiny-model generator writes.

Shapes are numpy order (ggml `ne` reversed). Sizes with a trailing ggml dim of 1 compare
equal to the squeezed size: the converter writes `ffn_gate_inp_shexp` as ne {H, 1},
llama-quantize rewrites it as {H}, and llama.cpp accepts both.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from dflash_ir.dtypes import DType

from .gguf_file import GGUFFile, squeeze_shape
from .metadata import DRAFT_ARCH, ModelConfigError

if TYPE_CHECKING:
    from .config import DraftConfig, TargetConfig

# What our runtime reads. Tensors the converter always keeps in float (1-D, norms, router,
# conv) must stay float: ggml's elementwise and ssm_conv ops need them that way too.
FLOAT_DTYPES = frozenset({DType.F32, DType.F16, DType.BF16})
ROPE_FACTORS = "rope_freqs.weight"  # Llama 3.1 RoPE scaling as llama.cpp's converter writes it
D2T = "d2t"  # a draft's reduced vocabulary: the target token id of each row of its own output.weight
INDEX_TENSORS = {D2T: frozenset({DType.I64})}  # llama.cpp stores d2t as I64, absolute ids
WEIGHT_DTYPES = FLOAT_DTYPES | {d for d in DType if d.is_block}


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
    if name in INDEX_TENSORS:
        return INDEX_TENSORS[name]
    return FLOAT_DTYPES if converter_keeps_f32(name, len(squeeze_shape(shape))) else WEIGHT_DTYPES


def expected_tensors(cfg: TargetConfig | DraftConfig) -> dict[str, tuple[int, ...]]:
    """Required tensors of `cfg`'s file with numpy-order shapes, in the converter's order.

    Target MTP blocks are not included (see `mtp_tensors`); a draft's optional
    token_embd/output are not either, except the reduced output head with its d2t.
    """
    if cfg.role == "draft":
        return _draft_tensors(cfg)
    t = {ROPE_FACTORS: (cfg.n_rot // 2,)} if cfg.rope_freq_factors else {}
    t["token_embd.weight"] = (cfg.vocab_size, cfg.hidden)
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
    if not cfg.is_hybrid:
        block = ({"attn_norm.weight": (cfg.hidden,)} | _swiglu(cfg.hidden, cfg.ff) | {"ffn_norm.weight": (cfg.hidden,)}
                 | _attention(cfg.hidden, cfg.head_dim, cfg.q_dim, cfg.kv_dim, cfg.q_dim, norms=cfg.qk_norm))
        return {f"blk.{i}.{n}": s for n, s in block.items()}
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
    if cfg.draft_vocab:
        t |= {"output.weight": (cfg.draft_vocab, h), D2T: (cfg.draft_vocab,)}
    return t


def _swiglu(h: int, ff: int) -> dict[str, tuple[int, ...]]:
    return {"ffn_down.weight": (h, ff), "ffn_gate.weight": (ff, h), "ffn_up.weight": (ff, h)}


def _attention(h: int, hd: int, q_rows: int, kv: int, o_cols: int, *, norms: bool = True) -> dict[str, tuple[int, ...]]:
    t = {
        "attn_k_norm.weight": (hd,),
        "attn_k.weight": (kv, h),
        "attn_output.weight": (h, o_cols),
        "attn_q_norm.weight": (hd,),
        "attn_q.weight": (q_rows, h),
        "attn_v.weight": (kv, h),
    }
    return t if norms else {n: s for n, s in t.items() if not n.endswith("_norm.weight")}


def validate_tensors(f: GGUFFile, cfg: TargetConfig | DraftConfig) -> None:
    """Check every expected tensor is present with its shape and a supported type, and nothing else is there.

    MTP blocks of a target, and a draft's token_embd/output, are optional and unchecked
    (a draft's output is checked when a d2t gives it a reduced vocabulary).
    """
    source = str(f.path)
    expected = expected_tensors(cfg)
    for name, shape in expected.items():
        info = f.tensors.get(name)
        if info is None:
            raise ModelConfigError(f"{source}: tensor {name} is missing (expected shape {_fmt(shape)})")
        if squeeze_shape(info.shape) != squeeze_shape(shape):
            raise ModelConfigError(f"{source}: tensor {name} has shape {_fmt(info.ggml_shape[::-1])}, "
                                   f"expected {_fmt(shape)}")
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
    if cfg.role == "draft":
        return name in ("token_embd.weight", "output.weight")
    parts = name.split(".")
    return parts[0] == "blk" and parts[1].isdigit() and cfg.n_layer <= int(parts[1]) < cfg.block_count


def _describe(cfg: TargetConfig | DraftConfig) -> str:
    if cfg.role == "draft":
        return f"{DRAFT_ARCH} draft with {cfg.n_layer} layers"
    tied = "tied" if cfg.tied_output else "untied"
    return f"{cfg.arch} model with {cfg.n_layer} layers + {cfg.n_nextn} MTP and {tied} output"


def _fmt(shape: tuple[int, ...]) -> str:
    shape = tuple(int(d) for d in shape)
    return f"{shape} (ggml ne {list(reversed(shape))})"
