"""GGUF export in llama.cpp's layout (metadata, names, order, storage types from models/generator.py).

Target: our torch model holds Hugging Face conventions, so this applies llama.cpp's converter
transforms (conversion/qwen.py, QWEN35.md §4, §5.5, §11): `1 + w` baked into every norm except
`ssm_norm`, `ssm_a = -exp(A_log)`, value heads reordered from grouped to tiled order, conv1d
squeezed; `q_proj` keeps its per-head [q | gate] interleave. Draft: z-lab's safetensors names
(DFLASH.md §2.2) to the `dflash` GGUF (§7.3): plain norms, `hidden_norm` -> `enc.output_norm`,
HF tap ids + 1, the mask id in `tokenizer.ggml.mask_token_id`. No torch needed here.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from dflash_ir.models.checks import check_draft
from dflash_ir.models.config import DraftConfig, TargetConfig, interval_pattern
from dflash_ir.models.generator import GGUFPlan, draft_plan, target_plan, write_gguf
from dflash_ir.models.hf_export import HF_LAYER_NAMES

Arrays = Mapping[str, np.ndarray]


def target_config(hp: Mapping[str, Any], *, context_length: int = 4096) -> TargetConfig:
    """The GGUF-side config of a `TargetHParams.to_dict()`."""
    return TargetConfig(
        arch="qwen35", vocab_size=hp["vocab_size"], hidden=hp["hidden"], n_layer=hp["n_layer"],
        layer_is_recurrent=interval_pattern(hp["n_layer"], hp["full_attention_interval"]),
        n_head=hp["n_head"], n_head_kv=hp["n_head_kv"], head_dim=hp["head_dim"], rope_theta=hp["rope_theta"],
        n_rot=hp["n_rot"], rope_sections=tuple(hp["rope_sections"]), rms_eps=hp["rms_eps"],
        ssm_conv_kernel=hp["conv_kernel"], ssm_d_state=hp["ssm_head_dim"], ssm_n_group=hp["ssm_k_heads"],
        ssm_dt_rank=hp["ssm_v_heads"], ssm_inner=hp["ssm_v_heads"] * hp["ssm_head_dim"], ff=hp["ff"],
        tied_output=True, context_length=context_length, n_nextn=0,
    )


def tiled_order(k_heads: int, v_heads: int) -> np.ndarray:
    """GGUF v-head j = r * Hk + g holds HF v-head g * R + r (R = Hv / Hk)."""
    r, g = np.divmod(np.arange(v_heads), k_heads)
    return g * (v_heads // k_heads) + r


def target_tensors(state: Arrays, cfg: TargetConfig) -> dict[str, np.ndarray]:
    """GGUF tensors (numpy order) from our torch target's state dict."""
    one = np.float32(1)
    t = {"token_embd.weight": state["embed_tokens.weight"], "output_norm.weight": one + state["norm.weight"]}
    perm = tiled_order(cfg.ssm_n_group, cfg.ssm_dt_rank)
    Kd, dv = cfg.key_dim, cfg.ssm_head_v_dim

    def heads(x: np.ndarray, axis: int = 0) -> np.ndarray:  # reorder the Hv value heads along `axis`
        shape = x.shape
        split = shape[:axis] + (cfg.ssm_dt_rank, shape[axis] // cfg.ssm_dt_rank) + shape[axis + 1:]
        return np.take(x.reshape(split), perm, axis=axis).reshape(shape)

    for i in range(cfg.n_layer):
        p, b = f"layers.{i}.", f"blk.{i}."
        m = p + "mixer."
        t[b + "attn_norm.weight"] = one + state[p + "input_layernorm.weight"]
        t[b + "post_attention_norm.weight"] = one + state[p + "post_attention_layernorm.weight"]
        for ours, gguf_name in (("gate_proj", "ffn_gate"), ("up_proj", "ffn_up"), ("down_proj", "ffn_down")):
            t[f"{b}{gguf_name}.weight"] = state[f"{p}mlp.{ours}.weight"]
        if cfg.layer_is_recurrent[i]:
            qkv = state[m + "in_proj_qkv.weight"]
            conv = state[m + "conv1d.weight"][:, 0, :]
            t[b + "attn_qkv.weight"] = np.concatenate([qkv[:2 * Kd], heads(qkv[2 * Kd:])])
            t[b + "ssm_conv1d.weight"] = np.concatenate([conv[:2 * Kd], heads(conv[2 * Kd:])])
            t[b + "attn_gate.weight"] = heads(state[m + "in_proj_z.weight"])
            t[b + "ssm_beta.weight"] = heads(state[m + "in_proj_b.weight"])
            t[b + "ssm_alpha.weight"] = heads(state[m + "in_proj_a.weight"])
            t[b + "ssm_dt.bias"] = heads(state[m + "dt_bias"])
            t[b + "ssm_a"] = -np.exp(heads(state[m + "A_log"]))
            t[b + "ssm_norm.weight"] = state[m + "norm_weight"]
            t[b + "ssm_out.weight"] = heads(state[m + "out_proj.weight"], axis=1)
            assert t[b + "ssm_norm.weight"].shape == (dv,)
        else:
            for ours, gguf_name in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"),
                                    ("o_proj", "attn_output")):
                t[f"{b}{gguf_name}.weight"] = state[f"{m}{ours}.weight"]
            t[b + "attn_q_norm.weight"] = one + state[m + "q_norm.weight"]
            t[b + "attn_k_norm.weight"] = one + state[m + "k_norm.weight"]
    return t


def draft_config(hf: Mapping[str, Any], *, mask_token_id: int | None = None) -> DraftConfig:
    """The GGUF-side config of a z-lab DFlash `config.json` (both schema revisions, DFLASH.md §2.1)."""
    dc = hf.get("dflash_config") or {}
    pick = lambda key: dc.get(key, hf.get(key))  # noqa: E731
    taps = pick("target_layer_ids")
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    theta = hf.get("rope_theta") or (hf.get("rope_parameters") or {})["rope_theta"]
    cfg = DraftConfig(
        n_layer=hf["num_hidden_layers"], hidden=hf["hidden_size"], n_head=hf["num_attention_heads"],
        n_head_kv=hf["num_key_value_heads"], head_dim=head_dim, ff=hf["intermediate_size"],
        rope_theta=float(theta), rms_eps=float(hf["rms_norm_eps"]), block_size=pick("block_size"),
        target_layers=tuple(i + 1 for i in taps), mask_token_id=mask_token_id if mask_token_id is not None
        else pick("mask_token_id"), fc_in=len(taps) * hf["hidden_size"], n_rot=head_dim,
        context_length=hf.get("max_position_embeddings", 262144),
    )
    check_draft(cfg, "draft config.json")
    return cfg


def draft_tensors(state: Arrays) -> dict[str, np.ndarray]:
    """GGUF tensors from z-lab-named draft weights (no embedding / lm_head: borrowed from the target)."""
    t = {"fc.weight": state["fc.weight"], "enc.output_norm.weight": state["hidden_norm.weight"],
         "output_norm.weight": state["norm.weight"]}
    for name, x in state.items():
        if name.startswith("layers."):
            _, i, rest = name.split(".", 2)
            t[f"blk.{i}.{HF_LAYER_NAMES[rest]}"] = x
    return t


def fill(plan: GGUFPlan, tensors: Mapping[str, np.ndarray]) -> GGUFPlan:
    """Put trained values into a plan, checking that names and element counts match exactly."""
    if set(plan.tensors) != set(tensors):
        raise ValueError(f"tensor sets differ: missing {sorted(set(plan.tensors) - set(tensors))}, "
                         f"unexpected {sorted(set(tensors) - set(plan.tensors))}")
    for name, pt in plan.tensors.items():
        x = np.asarray(tensors[name], np.float32)
        if x.size != pt.values.size or x.shape[-1] != pt.values.shape[-1]:
            raise ValueError(f"{name}: shape {x.shape} does not fit the GGUF's {pt.values.shape}")
        pt.values = np.ascontiguousarray(x.reshape(pt.values.shape))
    return plan


def write_target(path: str | os.PathLike[str], state: Arrays, hp: Mapping[str, Any], *, tokenizer: Mapping[str, Any],
                 dtype: str = "q8_0", name: str = "DFlash-IR Demo Coder") -> Path:
    cfg = target_config(hp)
    return write_gguf(path, fill(target_plan(cfg, dtype=dtype, tokenizer=tokenizer, name=name),
                                 target_tensors(state, cfg)))


def write_draft(path: str | os.PathLike[str], state: Arrays, hf_config: Mapping[str, Any], *,
                target_cfg: TargetConfig, tokenizer: Mapping[str, Any], dtype: str = "q8_0",
                name: str = "DFlash-IR Demo Coder DFlash", mask_token_id: int | None = None) -> Path:
    cfg = draft_config(hf_config, mask_token_id=mask_token_id)
    plan = draft_plan(cfg, target_cfg=target_cfg, dtype=dtype, tokenizer=tokenizer, name=name)
    return write_gguf(path, fill(plan, draft_tensors(state)))
