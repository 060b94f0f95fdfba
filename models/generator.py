"""Random-weight GGUFs laid out exactly as llama.cpp writes real ones, for tests and demos.

Real checkpoints are gigabytes; every layer of the stack still has to be exercised on files
that look like the ones users bring. So the files written here use llama.cpp's metadata
keys (in the converter's order), tensor names, ggml shapes and storage-type rules; the
tests compare them with the converter's own output (fixtures/oracle/*/gguf/*.gguf.txt).

* f32 / f16 files follow `convert_hf_to_gguf.py --outtype f32|f16`; q8_0 files follow
  `llama-quantize <f16> <out> Q8_0` (how the oracle fixtures' Q8_0 files were made): tensors
  sorted by (block, name), trailing ggml dims of 1 dropped, and general.quantization_version
  / general.file_type moved to the end of the metadata.
* Tensors the converter keeps in F32 (`converter_keeps_f32`) stay F32 in every file type.
  Q8_0 needs rows (ggml ne0) that are whole 32-element blocks; where they are not, the
  converter and llama-quantize fall back to F16 for that tensor with a warning. We raise:
  a tiny model that is not really Q8_0 would test less than it claims.
* Values mimic the converted weights: target norms hold 1 + w (the converter bakes in the
  +1 of Qwen3.5's zero-centred norms; `ssm_norm` is the raw gated-norm weight, same values),
  draft norms are raw weights (same values), `ssm_a` = -exp(A_log) with A_log = log U(0.5, 8),
  `ssm_dt.bias` and conv1d N(0, 0.5^2), embeddings N(0, 0.5^2), matrices N(0, 1/fan_in).

`target_plan` / `draft_plan` return an editable `GGUFPlan` (metadata + tensors) and
`write_gguf` writes one: tests build broken files by editing a plan, not by packing bytes.
Random drafts never agree with their targets; models/agreeing.py edits these plans into
pairs whose draft agrees on a chosen number of proposals per round.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from dflash_ir import quant
from dflash_ir.dtypes import GGML_TYPE_IDS, DType

from .checks import check_draft, check_target
from .config import DEFAULT_FULL_ATTENTION_INTERVAL, DraftConfig, TargetConfig, interval_pattern
from .gguf_file import squeeze_shape
from .metadata import DENSE_ARCHS, DRAFT_ARCH, MASK_TOKEN_KEYS
from .tensors import D2T, converter_keeps_f32, expected_tensors, mtp_tensors
from .tokenizer import BYTE_TO_UNICODE, TokenType

# Requested file type -> (storage type of quantisable tensors, general.file_type = llama_ftype).
FILE_TYPES = {"f32": (DType.F32, 0), "f16": (DType.F16, 1), "q8_0": (DType.Q8_0, 7)}
QUANTIZATION_VERSION = 2  # GGML_QNT_VERSION
_GGML_IDS = {d: i for i, d in GGML_TYPE_IDS.items()}

# -- tiny tokenizer -----------------------------------------------------------------------

# A few byte-pair merges (enough to exercise BPE), each building on earlier tokens.
_MERGES = [
    (b" ", b"t"),
    (b"h", b"e"),
    (b"i", b"n"),
    (b" t", b"he"),
    (b"e", b"r"),
    (b"o", b"n"),
    (b" ", b"a"),
    (b"r", b"e"),
    (b"a", b"t"),
    (b"e", b"n"),
    (b"o", b"r"),
    (b"\n", b"\n"),
    (b" ", b" "),
    (b"i", b"s"),
    (b"u", b"s"),
    (b"us", b"er"),
]
# Qwen's special tokens (CONTROL) and think tags (USER_DEFINED: added but not special), plus a mask token.
SPECIAL_TOKENS = {
    "<|endoftext|>": TokenType.CONTROL,
    "<|im_start|>": TokenType.CONTROL,
    "<|im_end|>": TokenType.CONTROL,
    "<think>": TokenType.USER_DEFINED,
    "</think>": TokenType.USER_DEFINED,
    "<|MASK|>": TokenType.CONTROL,
}
TINY_SPECIAL_IDS = {text: 256 + len(_MERGES) + i for i, text in enumerate(SPECIAL_TOKENS)}
TINY_MASK_ID = TINY_SPECIAL_IDS["<|MASK|>"]
TINY_MIN_VOCAB = 256 + len(_MERGES) + len(SPECIAL_TOKENS)

# ChatML with Qwen3.5's generation prompt (thinking on unless enable_thinking is false).
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}"
    "{{- '<think>\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)


def tiny_vocab(vocab_size: int) -> dict[str, Any]:
    """`tokenizer.*` metadata of a small valid byte-level BPE vocabulary with Qwen's special tokens.

    Ids: 256 byte tokens (GPT-2 byte-to-unicode form, in Qwen's order), the merged tokens,
    the special tokens (`TINY_SPECIAL_IDS`), then `[PAD{i}]` rows (UNUSED) up to `vocab_size`.
    """
    if vocab_size < TINY_MIN_VOCAB:
        raise ValueError(f"tiny_vocab needs vocab_size >= {TINY_MIN_VOCAB}, got {vocab_size}")

    def text(b: bytes) -> str:
        return "".join(BYTE_TO_UNICODE[c] for c in b)

    tokens = [*BYTE_TO_UNICODE.values(), *(text(a + b) for a, b in _MERGES), *SPECIAL_TOKENS]
    types = [TokenType.NORMAL] * (256 + len(_MERGES)) + list(SPECIAL_TOKENS.values())
    tokens += [f"[PAD{i}]" for i in range(len(tokens), vocab_size)]
    types += [TokenType.UNUSED] * (vocab_size - len(types))
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen35",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [int(t) for t in types],
        "tokenizer.ggml.merges": [f"{text(a)} {text(b)}" for a, b in _MERGES],
        "tokenizer.ggml.eos_token_id": TINY_SPECIAL_IDS["<|im_end|>"],
        "tokenizer.ggml.padding_token_id": TINY_SPECIAL_IDS["<|endoftext|>"],
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": CHATML_TEMPLATE,
    }


# -- tiny configs ---------------------------------------------------------------------------


def tiny_target_config(arch: str = "qwen35", **overrides: Any) -> TargetConfig:
    """A small valid target (hidden 64, 4 layers: LLLA for the hybrid archs, all attention for
    `llama` / `qwen3`, vocab 320); any field can be overridden.

    Unless given, a hybrid target's `layer_is_recurrent` follows n_layer with interval 4 and
    `ssm_inner` is ssm_dt_rank * ssm_d_state; a dense one rotates whole heads with plain RoPE.
    """
    fields: dict[str, Any] = {
        "arch": arch,
        "vocab_size": 320,
        "hidden": 64,
        "n_layer": 4,
        "n_head": 4,
        "n_head_kv": 2,
        "head_dim": 32,
        "rope_theta": 1e7,
        "n_rot": 8,
        "rope_sections": (2, 1, 1, 0),
        "rms_eps": 1e-6,
        "ssm_conv_kernel": 4,
        "ssm_d_state": 16,
        "ssm_n_group": 2,
        "ssm_dt_rank": 4,
        "tied_output": True,
        "context_length": 4096,
        "n_nextn": 0,
    }
    fields |= (
        {"n_expert": 4, "n_expert_used": 2, "expert_ff": 32, "shared_ff": 64} if arch == "qwen35moe" else {"ff": 128}
    )
    if arch in DENSE_ARCHS:
        fields |= {"n_rot": fields["head_dim"], "rope_sections": (), "ssm_conv_kernel": 0, "ssm_d_state": 0,
                   "ssm_n_group": 0, "ssm_dt_rank": 0}
    fields |= overrides
    pattern = interval_pattern(fields["n_layer"], DEFAULT_FULL_ATTENTION_INTERVAL if arch not in DENSE_ARCHS else 1)
    fields.setdefault("layer_is_recurrent", pattern)
    fields.setdefault("ssm_inner", fields["ssm_dt_rank"] * fields["ssm_d_state"])
    cfg = TargetConfig(**fields)
    check_target(cfg, "tiny_target_config")
    return cfg


def tiny_draft_config(target_cfg: TargetConfig, **overrides: Any) -> DraftConfig:
    """A small valid draft for `target_cfg` (2 layers, taps HF layers 1 and n_layer-2, block 16)."""
    n = target_cfg.n_layer
    taps = sorted({min(1, n - 1), max(n - 2, 0)})
    fields: dict[str, Any] = {
        "n_layer": 2,
        "hidden": target_cfg.hidden,
        "n_head": 4,
        "n_head_kv": 2,
        "head_dim": 32,
        "ff": 128,
        "rope_theta": 1e7,
        "rms_eps": 1e-6,
        "block_size": 16,
        "target_layers": tuple(i + 1 for i in taps),
        "mask_token_id": TINY_MASK_ID,
        "context_length": target_cfg.context_length,
    }
    fields |= overrides
    fields.setdefault("n_rot", fields["head_dim"])
    fields.setdefault("fc_in", len(fields["target_layers"]) * fields["hidden"])
    cfg = DraftConfig(**fields)
    check_draft(cfg, "tiny_draft_config")
    return cfg


# Real model shapes (../shared/docs/QWEN35.md section 1, DFLASH.md section 2.4) with random
# weights: what real files cost in compile time, load time, memory and speed, without the files.
REAL_TARGETS: dict[str, dict[str, Any]] = {
    "qwen35-9b": dict(arch="qwen35", ff=12288, hidden=4096, n_layer=32, n_head=16, n_head_kv=4),
    "qwen36-35b-a3b": dict(arch="qwen35moe", n_expert=256, n_expert_used=8, expert_ff=512, shared_ff=512,
                           hidden=2048, n_layer=40, n_head=16, n_head_kv=2),
}
_QWEN35_FAMILY = dict(vocab_size=248320, head_dim=256, n_rot=64, rope_sections=(11, 11, 10, 0), ssm_d_state=128,
                      ssm_n_group=16, ssm_dt_rank=32, ssm_inner=4096, tied_output=False, context_length=262144)
REAL_DRAFTS: dict[str, dict[str, Any]] = {  # z-lab's drafts; target_layers as GGUF stores them (HF ids + 1)
    "qwen35-9b": dict(n_layer=5, n_head=32, n_head_kv=8, head_dim=128, ff=12288, target_layers=(2, 9, 16, 23, 30)),
    "qwen36-35b-a3b": dict(n_layer=8, n_head=32, n_head_kv=4, head_dim=128, ff=6144,
                           target_layers=(2, 11, 20, 29, 38)),
}


def real_configs(name: str) -> tuple[TargetConfig, DraftConfig]:
    """The target and DFlash draft configs of a real model (`REAL_TARGETS`' names)."""
    if name not in REAL_TARGETS:
        raise ValueError(f"no real shape {name!r}; known: {', '.join(REAL_TARGETS)}")
    fields = dict(REAL_TARGETS[name])
    target = tiny_target_config(fields.pop("arch"), **_QWEN35_FAMILY, **fields)
    return target, tiny_draft_config(target, **REAL_DRAFTS[name])


# -- plans ----------------------------------------------------------------------------------


class PlannedTensor:
    """Float32 values (numpy order) and the type they are stored as, or the storage itself
    (an array already of the stored type's numpy dtype, with `shape` the tensor's: rows
    copied from another file, an index tensor), written as it is. A generated tensor's
    values are made when first read, from the random generator's state recorded when it was
    planned, and kept from then on (edits stick); `write_gguf` makes an unread tensor's values
    for its own write only, so a plan larger than memory is written one tensor at a time."""

    def __init__(self, values: np.ndarray | None, dtype: DType, *, make: Callable[[], np.ndarray] | None = None,
                 shape: tuple[int, ...] | None = None):
        self._values, self._make, self.dtype = values, make, dtype
        self._shape = tuple(shape) if shape is not None else tuple(values.shape)

    @property
    def values(self) -> np.ndarray:
        if self._values is None:
            self._values = self._make()
        return self._values

    @values.setter
    def values(self, values: np.ndarray) -> None:
        self._values, self._shape = values, tuple(values.shape)

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    def values_to_write(self) -> np.ndarray:
        """The values, made for this call (and not kept) when nothing has read them yet."""
        return self._values if self._values is not None else self._make()


@dataclass
class GGUFPlan:
    """Everything one GGUF file will hold, in file order; edit freely before `write_gguf`.

    Metadata value types follow the converter: bool -> BOOL, int -> UINT32 (INT32 if
    negative), float -> FLOAT32, str -> STRING, list -> ARRAY (ints as INT32).
    """

    metadata: dict[str, Any]
    tensors: dict[str, PlannedTensor]

    def set_tensor(self, name: str, shape: tuple[int, ...], dtype: DType | str = DType.F32, seed: int = 0) -> None:
        """Add or replace tensor `name` with random values of `shape`."""
        self.tensors[name] = PlannedTensor(_init(np.random.default_rng(seed), name, tuple(shape)), _dtype(dtype))


def target_plan(
    cfg: TargetConfig,
    *,
    dtype: str = "f16",
    seed: int = 0,
    tokenizer: Mapping[str, Any] | None = None,
    name: str = "Tiny Target",
) -> GGUFPlan:
    """Plan of a target GGUF (MTP blocks included when cfg.n_nextn > 0)."""
    file_type = _file_type(dtype)
    tensors = expected_tensors(cfg)
    mtp = mtp_tensors(cfg)
    if cfg.tied_output:  # converter order: MTP blocks follow output_norm
        tensors |= mtp
    else:
        output = tensors.pop("output.weight")
        tensors |= mtp | {"output.weight": output}
    moe = cfg.is_moe
    put = partial(_fields_metadata, cfg)
    meta: dict[str, Any] = {  # in the converter's order
        f"{cfg.arch}.block_count": cfg.block_count,
        **put("context_length", "hidden", *(() if moe else ("ff",)), "n_head", "n_head_kv"),
        **put(*(("rope_sections",) if cfg.rope_sections else ())),
        cfg.key("rope_theta"): float(cfg.rope_theta),
        cfg.key("rms_eps"): float(cfg.rms_eps),
        **put(*(("n_expert", "n_expert_used") if moe else ()), "head_dim"),
        f"{cfg.arch}.attention.value_length": cfg.head_dim,
        "general.file_type": file_type,
        **put(*(("expert_ff", "shared_ff") if moe else ()), *(("n_nextn",) if cfg.n_nextn else ())),
        **(_hybrid_metadata(cfg) if cfg.is_hybrid else {}),
        **put("n_rot"),
    }
    return _plan(cfg.arch, name, meta, tensors, dtype, seed, tokenizer or tiny_vocab(cfg.vocab_size))


def draft_plan(
    cfg: DraftConfig,
    *,
    target_cfg: TargetConfig,
    dtype: str = "f16",
    seed: int = 0,
    tokenizer: Mapping[str, Any] | None = None,
    name: str = "Tiny Dflash",
) -> GGUFPlan:
    """Plan of a DFlash draft GGUF; like the converter, it carries the target's tokenizer."""
    file_type = _file_type(dtype)
    tensors = expected_tensors(cfg)
    tensors["fc.weight"] = (cfg.hidden, cfg.fc_in)
    put = partial(_fields_metadata, cfg)
    meta: dict[str, Any] = {  # in the converter's order; optional keys only when they say something
        **put("n_layer", "context_length", "hidden", "ff", "n_head", "n_head_kv"),
        **put(*(("sliding_window", "swa_layers") if cfg.swa_layers else ())),
        cfg.key("rope_theta"): float(cfg.rope_theta),
        cfg.key("rms_eps"): float(cfg.rms_eps),
        **put("head_dim"),
        f"{DRAFT_ARCH}.attention.value_length": cfg.head_dim,
        **put(*(("n_rot",) if cfg.n_rot != cfg.head_dim else ()), *(("rope_sections",) if cfg.rope_sections else ())),
        "general.file_type": file_type,
        **put("block_size", "target_layers"),
    }
    vocab = dict(tokenizer or tiny_vocab(target_cfg.vocab_size)) | {MASK_TOKEN_KEYS[0]: cfg.mask_token_id}
    plan = _plan(DRAFT_ARCH, name, meta, tensors, dtype, seed, vocab)
    if cfg.draft_vocab:  # ids spread over the target's vocabulary; models/draft_vocab.py copies real head rows
        plan.tensors[D2T] = PlannedTensor(np.arange(cfg.draft_vocab, dtype=np.int64) * target_cfg.vocab_size
                                          // cfg.draft_vocab, DType.I64)
    return plan


def write_gguf(path: str | os.PathLike[str], plan: GGUFPlan) -> Path:
    """Write `plan` as a GGUF file at `path`."""
    path = Path(path)
    meta = dict(plan.metadata)
    writer = gguf.GGUFWriter(path, arch=meta.pop("general.architecture"))
    for key, value in meta.items():
        writer.add_key_value(key, *_gguf_value(value))
    for name, t in plan.tensors.items():
        stored = quant.storage_shape(t.shape, t.dtype)
        item = np.dtype(t.dtype.numpy()).itemsize
        writer.add_tensor_info(name, stored, t.dtype.numpy(), math.prod(stored) * item,
                               raw_dtype=gguf.GGMLQuantizationType(_GGML_IDS[t.dtype]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in plan.tensors.values():  # one tensor's values in memory at a time
        writer.write_tensor_data(_stored(t.values_to_write(), t.dtype))
    writer.close()
    return path


QUANTIZE_CHUNK = 1 << 24  # elements rounded at once: the rounding's temporaries stay ~0.3 GB for any tensor


def _stored(values: np.ndarray, dtype: DType) -> np.ndarray:
    """`quant.quantize(values, dtype)`, a chunk of rows at a time (every stored type rounds rows
    independently), so a 248k x 4096 embedding needs its values and its storage, not 4x its values.
    Values already of the storage's numpy dtype are the storage (PlannedTensor)."""
    if values.dtype == dtype.numpy():
        return values
    if values.ndim < 2 or values.size <= QUANTIZE_CHUNK:
        return quant.quantize(values, dtype)
    rows = values.reshape(-1, values.shape[-1])
    stored = np.empty(quant.storage_shape(rows.shape, dtype), dtype.numpy())
    step = max(1, QUANTIZE_CHUNK // rows.shape[1])
    for i in range(0, len(rows), step):
        stored[i:i + step] = quant.quantize(rows[i:i + step], dtype)
    return stored.reshape(quant.storage_shape(values.shape, dtype))


def write_target(path: str | os.PathLike[str], cfg: TargetConfig, **kwargs: Any) -> Path:
    """Write a random-weight target GGUF (keyword arguments as `target_plan`)."""
    return write_gguf(path, target_plan(cfg, **kwargs))


def write_draft(path: str | os.PathLike[str], cfg: DraftConfig, *, target_cfg: TargetConfig, **kwargs: Any) -> Path:
    """Write a random-weight DFlash draft GGUF (keyword arguments as `draft_plan`)."""
    return write_gguf(path, draft_plan(cfg, target_cfg=target_cfg, **kwargs))


def _plan(
    arch: str,
    name: str,
    meta: dict[str, Any],
    shapes: dict[str, tuple[int, ...]],
    dtype: str,
    seed: int,
    vocab: Mapping[str, Any],
) -> GGUFPlan:
    weight_dtype = FILE_TYPES[dtype][0]
    quantize_layout = weight_dtype is DType.Q8_0
    rng = np.random.default_rng(seed)
    tensors = {}
    for tname, shape in shapes.items():
        if quantize_layout:  # llama-quantize writes ggml_n_dims dims: trailing ne of 1 go
            shape = squeeze_shape(shape)
        stored = DType.F32 if converter_keeps_f32(tname, len(shape)) else weight_dtype
        if stored.is_block and shape[-1] % stored.block_size:
            raise ValueError(
                f"{dtype}: tensor {tname} has rows of {shape[-1]} elements (ggml ne0), not a multiple of "
                f"{stored.block_size}; llama.cpp would fall back to F16 for it. Choose sizes divisible by "
                f"{stored.block_size} for {dtype} files"
            )
        state = rng.bit_generator.state
        _init(rng, tname, shape)  # moves the generator past this tensor, as making it would
        tensors[tname] = PlannedTensor(None, stored, make=partial(_replay, state, tname, shape), shape=shape)
    if quantize_layout:
        tensors = dict(sorted(tensors.items(), key=lambda kv: (_block_of(kv[0]), kv[0])))
    general = {
        "general.architecture": arch,
        "general.type": "model",
        "general.name": name,
        "general.size_label": _size_label(tensors),
    }
    tail = {"general.quantization_version": QUANTIZATION_VERSION}
    metadata = general | meta | tail | dict(vocab)
    if quantize_layout:  # llama-quantize re-sets these two keys last
        for key in ("general.quantization_version", "general.file_type"):
            metadata[key] = metadata.pop(key)
    return GGUFPlan(metadata, tensors)


def _file_type(dtype: str) -> int:
    if dtype not in FILE_TYPES:
        raise ValueError(f"unsupported file dtype {dtype!r} (supported: {', '.join(FILE_TYPES)})")
    return FILE_TYPES[dtype][1]


def _replay(state: dict, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """The values `_init` made from the generator in `state`."""
    bits = np.random.PCG64()
    bits.state = state
    return _init(np.random.Generator(bits), name, shape)


def _init(rng: np.random.Generator, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Random values distributed like the converted weights (see the module docstring)."""
    normal = rng.standard_normal(shape, dtype=np.float32)  # scaled in place: one copy of a 4 GB embedding
    if name.endswith("norm.weight"):
        normal *= np.float32(0.1)
        normal += np.float32(1)
        return normal
    if name.endswith(".ssm_a"):
        return -rng.uniform(0.5, 8.0, shape).astype(np.float32)
    if name.endswith((".ssm_dt.bias", ".ssm_conv1d.weight")) or name == "token_embd.weight":
        normal *= np.float32(0.5)
        return normal
    normal /= np.float32(math.sqrt(shape[-1]))
    return normal


def _hybrid_metadata(cfg: TargetConfig) -> dict[str, Any]:
    """The Gated DeltaNet sizes and the layer pattern (hybrid targets only)."""
    ssm = _fields_metadata(cfg, "ssm_conv_kernel", "ssm_d_state", "ssm_n_group", "ssm_dt_rank", "ssm_inner")
    return ssm | _layer_pattern_metadata(cfg)


def _layer_pattern_metadata(cfg: TargetConfig) -> dict[str, Any]:
    """`full_attention_interval` when an interval reproduces the pattern, else llama.cpp's per-block flags."""
    a = cfg.arch
    for interval in (DEFAULT_FULL_ATTENTION_INTERVAL, *range(1, cfg.n_layer + 2)):
        if interval_pattern(cfg.n_layer, interval) == cfg.layer_is_recurrent:
            return {f"{a}.full_attention_interval": interval}
    return {f"{a}.attention.recurrent_layers": [*cfg.layer_is_recurrent, *([False] * cfg.n_nextn)]}


def _size_label(tensors: Mapping[str, PlannedTensor]) -> str:
    """general.size_label as the converter computes it (GGUFWriter.get_total_parameter_count)."""
    total = shared = experts = 0
    counts = []
    for name, t in tensors.items():
        size = math.prod(t.shape)
        total += size
        if "_exps." in name and len(t.shape) >= 3:
            counts.append(t.shape[0])
            experts += size // t.shape[0]
        else:
            shared += size
    n_expert = sum(counts) // len(counts) if counts else 0
    return gguf.size_label(total, shared, experts, n_expert)


def _gguf_value(value: Any) -> tuple[Any, gguf.GGUFValueType, gguf.GGUFValueType | None]:
    """(value, type, array element type) as the converter would write `value`."""
    if isinstance(value, (np.generic, np.ndarray)):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError("GGUF arrays cannot be empty")
        _, elem, _ = _gguf_value(value[0])
        elem = gguf.GGUFValueType.INT32 if elem is gguf.GGUFValueType.UINT32 else elem
        return list(value), gguf.GGUFValueType.ARRAY, elem
    if isinstance(value, bool):
        return value, gguf.GGUFValueType.BOOL, None
    if isinstance(value, int):
        return value, gguf.GGUFValueType.UINT32 if value >= 0 else gguf.GGUFValueType.INT32, None
    if isinstance(value, float):
        return value, gguf.GGUFValueType.FLOAT32, None
    if isinstance(value, str):
        return value, gguf.GGUFValueType.STRING, None
    raise TypeError(f"cannot store {type(value).__name__} in GGUF metadata")


def _fields_metadata(cfg: TargetConfig | DraftConfig, *fields: str) -> dict[str, Any]:
    """Metadata entries of config `fields` (tuples become GGUF arrays)."""
    return {cfg.key(f): list(v) if isinstance(v := getattr(cfg, f), tuple) else v for f in fields}


def _block_of(name: str) -> int:
    parts = name.split(".")
    return int(parts[1]) if parts[0] == "blk" else -1


def _dtype(dtype: DType | str) -> DType:
    return dtype if isinstance(dtype, DType) else DType.parse(dtype)
