"""Transformers `LlamaForCausalLM` / `Qwen3ForCausalLM` weights as a GGUF laid out the way
llama.cpp's convert_hf_to_gguf.py lays it out, so the `llama` and `qwen3` graphs can be
checked against Transformers on models built here from a config.

Conventions kept (the converter's): tensor names token_embd, blk.N.{attn_norm, attn_q,
attn_k, attn_v, attn_output, attn_q_norm, attn_k_norm, ffn_norm, ffn_gate, ffn_up, ffn_down},
output_norm, output (absent when the embeddings are tied); llama's q/k rows permuted per
head for llama.cpp's adjacent-pair RoPE (HF row s * D/2 + i of a head becomes row 2i + s);
1-D tensors kept F32; metadata under `{arch}.` with llama.cpp's key names.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from dflash_ir.ops.position import inv_freq_f32

from .generator import FILE_TYPES, GGUFPlan, PlannedTensor, tiny_vocab
from .metadata import DENSE_ARCHS
from .tensors import ROPE_FACTORS, converter_keeps_f32

# HF name (after "model.layers.N.", or "layers.N." in a z-lab draft) -> GGUF name (after "blk.N.")
HF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}


def permute_for_llama_cpp(w: np.ndarray, n_head: int) -> np.ndarray:
    """Rows of a q or k projection reordered per head from HF's rotate-half pairing
    (i, i + D/2) to llama.cpp's adjacent pairs (2i, 2i + 1)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_from_llama_cpp(w: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of `permute_for_llama_cpp`: a llama GGUF's q or k rows in HF order."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf_name: str) -> str:
    """GGUF tensor name of an HF state-dict entry (ValueError naming an unknown one)."""
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    parts = hf_name.split(".", 3)
    if parts[:2] == ["model", "layers"] and len(parts) == 4 and parts[3] in HF_LAYER_NAMES:
        return f"blk.{int(parts[2])}.{HF_LAYER_NAMES[parts[3]]}"
    raise ValueError(f"no GGUF name for HF tensor {hf_name!r}")


def hf_plan(arch: str, hf_config: Mapping[str, Any], state: Mapping[str, np.ndarray], *, dtype: str = "f32",
            tokenizer: Mapping[str, Any] | None = None, name: str = "Tiny HF") -> GGUFPlan:
    """GGUF plan of an HF `arch` model from its config dict and its state dict (numpy arrays)."""
    if arch not in DENSE_ARCHS:
        raise ValueError(f"hf_plan exports {', '.join(DENSE_ARCHS)} models, not {arch!r}")
    c = hf_config
    n_head, n_head_kv = c["num_attention_heads"], c["num_key_value_heads"]
    head_dim = c.get("head_dim") or c["hidden_size"] // n_head
    weight_dtype, file_type = FILE_TYPES[dtype]
    factors = _llama3_rope_factors(c, head_dim)
    tensors = {} if factors is None else {ROPE_FACTORS: PlannedTensor(factors, FILE_TYPES["f32"][0])}
    for hf_name, value in state.items():
        if hf_name == "lm_head.weight" and c.get("tie_word_embeddings"):
            continue
        gname = gguf_name(hf_name)
        value = np.asarray(value, dtype=np.float32)
        if arch == "llama" and gname.endswith((".attn_q.weight", ".attn_k.weight")):
            value = permute_for_llama_cpp(value, n_head if ".attn_q." in gname else n_head_kv)
        stored = weight_dtype if not converter_keeps_f32(gname, value.ndim) else FILE_TYPES["f32"][0]
        tensors[gname] = PlannedTensor(value, stored)
    a = arch
    meta: dict[str, Any] = {  # the converter's order
        "general.architecture": arch,
        "general.type": "model",
        "general.name": name,
        f"{a}.block_count": c["num_hidden_layers"],
        f"{a}.context_length": c["max_position_embeddings"],
        f"{a}.embedding_length": c["hidden_size"],
        f"{a}.feed_forward_length": c["intermediate_size"],
        f"{a}.attention.head_count": n_head,
        f"{a}.attention.head_count_kv": n_head_kv,
        f"{a}.rope.freq_base": float(_rope_theta(c)),
        f"{a}.attention.layer_norm_rms_epsilon": float(c["rms_norm_eps"]),
        **({f"{a}.attention.key_length": head_dim, f"{a}.attention.value_length": head_dim} if "head_dim" in c else {}),
        "general.file_type": file_type,
        **({f"{a}.vocab_size": c["vocab_size"], f"{a}.rope.dimension_count": head_dim} if arch == "llama" else {}),
        "general.quantization_version": 2,
    }
    return GGUFPlan(meta | dict(tokenizer or tiny_vocab(c["vocab_size"])), tensors)


def _rope_params(c: Mapping[str, Any]) -> Mapping[str, Any]:
    """The RoPE parameters of an HF config (Transformers 5: rope_parameters; before: rope_scaling)."""
    return c.get("rope_parameters") or c.get("rope_scaling") or {}


def _rope_theta(c: Mapping[str, Any]) -> float:
    return _rope_params(c).get("rope_theta", c.get("rope_theta", 10000.0))


def _llama3_rope_factors(c: Mapping[str, Any], head_dim: int) -> np.ndarray | None:
    """Llama 3's RoPE scaling as llama.cpp's converter stores it: rope_freqs.weight, the factor
    that divides each inverse frequency (1 for short wavelengths, `factor` for long ones,
    interpolated between); None for unscaled RoPE. Other scalings are refused."""
    params = _rope_params(c)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise ValueError(f"RoPE scaling {params!r} is not exported (unscaled and llama3 only)")
    inv_freq = inv_freq_f32(head_dim, _rope_theta(c))
    factor, low, high = params["factor"], params.get("low_freq_factor", 1.0), params.get("high_freq_factor", 4.0)
    old_context = params.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv_freq.astype(np.float64)
    smooth = (old_context / wavelen - low) / (high - low)
    factors = np.where(wavelen < old_context / high, 1.0,
                       np.where(wavelen > old_context / low, factor, 1 / ((1 - smooth) / factor + smooth)))
    return factors.astype(np.float32)
