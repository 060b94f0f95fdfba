"""The tiny-model generator writes what llama.cpp writes.

The layout tests rebuild the configs of the oracle fixtures from their description files
(fixtures/oracle/*/gguf/*.gguf.txt: real llama.cpp conversions), generate the same models
and compare metadata keys, types and values and the full tensor table (name, type, ne, in
file order). Only values that come from the real checkpoint are not compared: the model
name, the tokenizer arrays and chat template, and the eos/padding ids (our tiny vocabulary
puts its special tokens elsewhere; the vocabulary size itself is the real 248320).
"""

import ast
import dataclasses
import re

import jinja2
import numpy as np
import pytest
from dflash_ir.models.config import DraftConfig, TargetConfig
from dflash_ir.models.tensors import converter_keeps_f32, validate_tensors
from dflash_ir.models import generator
from dflash_ir.models.generator import (
    TINY_MASK_ID,
    TINY_MIN_VOCAB,
    TINY_SPECIAL_IDS,
    draft_plan,
    real_configs,
    target_plan,
    tiny_draft_config,
    tiny_target_config,
    tiny_vocab,
    write_draft,
    write_gguf,
    write_target,
)
from dflash_ir.models.gguf_file import open_gguf
from dflash_ir.models.tokenizer import Tokenizer, TokenType

from dflash_ir.dtypes import DType

UNCOMPARED = {
    "general.name",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
    "tokenizer.chat_template",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.padding_token_id",
}
_META_LINE = re.compile(r"^(?P<key>[^:\s]+): (?P<type>\S+)(?: n=\d+)?(?: = (?P<value>.*)| first=.*)$")


def describe_fixture(path):
    """(metadata [(key, type, value or None if summarised)], tensors [(name, type, ne)]) of a .gguf.txt."""
    meta, tensors, section = [], [], None
    for line in path.read_text().splitlines():
        if line.startswith("["):
            section = line[1:].split("]")[0]
        elif section == "metadata" and line:
            m = _META_LINE.match(line)
            value = m["value"]
            meta.append((m["key"], m["type"], None if value is None else ast.literal_eval(value)))
        elif section == "tensors" and " | " in line:
            name, ggml_type, ne = line.split(" | ")[:3]
            tensors.append((name, ggml_type, ast.literal_eval(ne)))
    return meta, tensors


def describe_file(f):
    meta = [(k, f.metadata_types[k], v) for k, v in f.metadata.items()]
    tensors = [(t.name, t.dtype.value.upper(), list(t.ggml_shape)) for t in f.tensors.values()]
    return meta, tensors


def as_stored(cfg):
    """`cfg` with its float fields rounded to float32, as a GGUF holds them."""
    return dataclasses.replace(
        cfg, rms_eps=float(np.float32(cfg.rms_eps)), rope_theta=float(np.float32(cfg.rope_theta))
    )


def assert_same_layout(ours, theirs):
    (our_meta, our_tensors), (their_meta, their_tensors) = ours, theirs
    assert our_tensors == their_tensors
    assert [(k, t) for k, t, _ in our_meta] == [(k, t) for k, t, _ in their_meta]
    for (key, _, ours_v), (_, _, theirs_v) in zip(our_meta, their_meta):
        if key in UNCOMPARED:
            continue
        if isinstance(theirs_v, float):
            assert np.float32(ours_v) == np.float32(theirs_v), key
        else:
            assert ours_v == theirs_v, key


@pytest.fixture(scope="module")
def fixture_configs(oracle_dir):
    """kind -> (target cfg, draft cfg) rebuilt from the fixtures' description files."""

    def build(kind):
        meta, tensors = describe_fixture(oracle_dir / kind / "gguf" / f"{kind}-target-f16.gguf.txt")
        ne = {name: shape for name, _, shape in tensors}
        target = TargetConfig.from_metadata(
            {k: v for k, _, v in meta}, vocab_size=ne["token_embd.weight"][1], tied_output="output.weight" not in ne
        )
        meta, tensors = describe_fixture(oracle_dir / kind / "gguf" / f"{kind}-dflash-f16.gguf.txt")
        fc = next(shape for name, _, shape in tensors if name == "fc.weight")
        return target, DraftConfig.from_metadata({k: v for k, _, v in meta}, fc_in=fc[0])

    return {kind: build(kind) for kind in ("dense", "moe")}


@pytest.mark.oracle
@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("dtype", ["f16", "q8_0"])
def test_target_layout_matches_llama_cpp(fixture_configs, oracle_dir, tmp_path, kind, dtype):
    cfg = fixture_configs[kind][0]
    f = open_gguf(write_target(tmp_path / "t.gguf", cfg, dtype=dtype))
    assert_same_layout(
        describe_file(f), describe_fixture(oracle_dir / kind / "gguf" / f"{kind}-target-{dtype}.gguf.txt")
    )
    assert TargetConfig.from_gguf(f) == cfg
    validate_tensors(f, cfg)


@pytest.mark.oracle
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_draft_layout_matches_llama_cpp(fixture_configs, oracle_dir, tmp_path, kind):
    target, cfg = fixture_configs[kind]
    f = open_gguf(write_draft(tmp_path / "d.gguf", cfg, target_cfg=target))
    assert_same_layout(describe_file(f), describe_fixture(oracle_dir / kind / "gguf" / f"{kind}-dflash-f16.gguf.txt"))
    assert DraftConfig.from_gguf(f) == cfg
    validate_tensors(f, cfg)


@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe"])
@pytest.mark.parametrize("dtype", ["f32", "f16", "q8_0"])
def test_generated_files_load_back(tmp_path, arch, dtype):
    target = tiny_target_config(arch, n_nextn=1, tied_output=False)
    draft = tiny_draft_config(target)
    t = open_gguf(write_target(tmp_path / "t.gguf", target, dtype=dtype))
    d = open_gguf(write_draft(tmp_path / "d.gguf", draft, target_cfg=target, dtype=dtype))
    assert TargetConfig.from_gguf(t) == as_stored(target)
    assert DraftConfig.from_gguf(d) == as_stored(draft)
    validate_tensors(t, target)
    validate_tensors(d, draft)
    weight_type = DType.parse(dtype)
    for f in (t, d):
        for info in f.tensors.values():
            assert info.dtype == (DType.F32 if converter_keeps_f32(info.name, len(info.ggml_shape)) else weight_type)


def test_values_follow_converted_weights(tmp_path):
    cfg = tiny_target_config("qwen35moe", n_nextn=1, ssm_dt_rank=32)
    f = open_gguf(write_target(tmp_path / "t.gguf", cfg, dtype="f32", seed=3))
    norms = np.concatenate([f.dequantize(n).ravel() for n in f.tensors if n.endswith("norm.weight")])
    assert abs(norms.mean() - 1) < 0.02 and 0.08 < norms.std() < 0.12  # the converter's baked-in +1
    ssm_a = f.dequantize("blk.0.ssm_a")
    assert ((ssm_a <= -0.5) & (ssm_a >= -8)).all()  # -exp(A_log), A_log = log U(0.5, 8)
    assert 0.45 < f.dequantize("token_embd.weight").std() < 0.55
    for name in ("ssm_conv1d.weight", "ssm_dt.bias"):
        values = np.concatenate([f.dequantize(f"blk.{i}.{name}").ravel() for i in cfg.recurrent_layers])
        assert 0.4 < values.std() < 0.6, name
    for name in ("blk.0.attn_qkv.weight", "blk.3.ffn_down_exps.weight", "blk.4.nextn.eh_proj.weight"):
        w = f.dequantize(name)
        assert abs(w.std() * np.sqrt(w.shape[-1]) - 1) < 0.15, name  # N(0, 1/fan_in)


def test_seed_determines_weights(tmp_path):
    cfg = tiny_target_config()
    a, b, c = (write_target(tmp_path / f"{i}.gguf", cfg, seed=s) for i, s in enumerate((1, 1, 2)))
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()


def test_irregular_layer_pattern_uses_recurrent_layers_key(tmp_path):
    cfg = tiny_target_config(layer_is_recurrent=(True, False, False, True, True), n_layer=5, n_nextn=1)
    plan = target_plan(cfg)
    assert plan.metadata["qwen35.attention.recurrent_layers"] == [True, False, False, True, True, False]
    assert "qwen35.full_attention_interval" not in plan.metadata
    f = open_gguf(write_gguf(tmp_path / "t.gguf", plan))
    assert TargetConfig.from_gguf(f) == as_stored(cfg)


def test_q8_0_needs_whole_blocks():
    cfg = tiny_target_config(hidden=48)
    target_plan(cfg, dtype="f16")
    with pytest.raises(ValueError, match=r"q8_0: tensor token_embd.weight has rows of 48 elements .*multiple of 32"):
        target_plan(cfg, dtype="q8_0")


def test_unknown_file_dtype():
    with pytest.raises(ValueError, match="unsupported file dtype 'q4_0'"):
        target_plan(tiny_target_config(), dtype="q4_0")


def test_tiny_vocab_is_a_working_qwen_style_tokenizer():
    meta = tiny_vocab(300)
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    assert len(tokens) == len(types) == 300
    assert tokens[:4] == ["!", '"', "#", "$"] and tokens[-1] == "[PAD299]" and types[-1] == TokenType.UNUSED
    for text, i in TINY_SPECIAL_IDS.items():
        assert tokens[i] == text
        assert types[i] == (TokenType.USER_DEFINED if "think" in text else TokenType.CONTROL)
    assert tokens[TINY_MASK_ID] == "<|MASK|>"
    for merge in meta["tokenizer.ggml.merges"]:
        left, right = merge.split(" ")
        assert {left, right, left + right} <= set(tokens)
    tok = Tokenizer.from_metadata(meta)
    text = "<|im_start|>user\nthe user<|im_end|>\n"
    ids = tok.encode(text)
    assert ids[0] == TINY_SPECIAL_IDS["<|im_start|>"] and tokens.index("user") in ids and tok.decode(ids) == text
    render = jinja2.Template(meta["tokenizer.chat_template"]).render
    messages = [{"role": "user", "content": "hi"}]
    assert (
        render(messages=messages, add_generation_prompt=True)
        == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    )
    assert render(messages=messages, add_generation_prompt=True, enable_thinking=False).endswith(
        "<think>\n\n</think>\n\n"
    )
    with pytest.raises(ValueError, match=f"vocab_size >= {TINY_MIN_VOCAB}"):
        tiny_vocab(TINY_MIN_VOCAB - 1)


def test_draft_carries_target_tokenizer_and_mask_id():
    target = tiny_target_config(vocab_size=400)
    meta = draft_plan(tiny_draft_config(target), target_cfg=target).metadata
    assert len(meta["tokenizer.ggml.tokens"]) == 400
    assert meta["tokenizer.ggml.mask_token_id"] == TINY_MASK_ID
    assert meta["dflash.target_layers"] == [2, 3]  # HF taps 1 and n_layer - 2, stored + 1


def test_tiny_configs_reject_inconsistent_overrides():
    with pytest.raises(ValueError, match=r"tiny_target_config: qwen35.attention.head_count_kv = 3"):
        tiny_target_config(n_head_kv=3)
    with pytest.raises(ValueError, match=r"tiny_draft_config: dflash.block_size = 1"):
        tiny_draft_config(tiny_target_config(), block_size=1)


_WRITE_CHILD = r"""
import math, sys
from pathlib import Path
from dflash_ir.models.generator import target_plan, tiny_target_config, write_gguf

def status(key):
    return int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1]) << 10

cfg = tiny_target_config("qwen35", vocab_size=4096, hidden=512, ff=1536, n_layer=32, n_head=4, ssm_d_state=64,
                         ssm_dt_rank=8, ssm_inner=512, ssm_n_group=4)
Path("/proc/self/clear_refs").write_text("5")  # the peak restarts here
before = status("VmRSS")
plan = target_plan(cfg, dtype="q8_0")
write_gguf(Path(sys.argv[1]) / "t.gguf", plan)
grew = status("VmHWM") - before
sizes = [4 * math.prod(t.shape) for t in plan.tensors.values()]
print(grew, sum(sizes), max(sizes))
"""


def test_writing_a_plan_holds_one_tensor_at_a_time(tmp_path):
    """A plan's random values are made tensor by tensor as the file is written (so a model
    larger than memory can be generated), not all at planning: planning and writing grow the
    process by a few of its largest tensor (76 MiB here), not by the model (401 MiB of f32
    values: 540 MiB when the plan held them all)."""
    import subprocess
    import sys

    child = subprocess.run([sys.executable, "-c", _WRITE_CHILD, str(tmp_path)], capture_output=True, text=True,
                           timeout=300)
    assert child.returncode == 0, child.stderr
    grew, total, largest = map(int, child.stdout.split()[-3:])
    bound = 6 * largest + (48 << 20)
    assert total > 2 * bound  # a model whose values at once would not fit the bound
    assert grew < bound, f"writing grew {grew >> 20} MiB for {total >> 20} MiB of values (largest {largest >> 20})"


def test_planned_values_are_made_once_and_keep_edits():
    plan = target_plan(tiny_target_config("qwen35"), dtype="f32", seed=5)
    t = plan.tensors["blk.0.attn_norm.weight"]
    first = t.values_to_write()
    np.testing.assert_array_equal(first, t.values_to_write())  # made again from the same state: equal
    t.values[:] = 2.0
    np.testing.assert_array_equal(t.values_to_write(), np.full(t.shape, 2.0, np.float32))


@pytest.mark.parametrize("name, params, recurrent, shapes", [
    # QWEN35.md 1.1 / 10 (ggml ne reversed) and DFLASH.md 2.4: 8.95B parameters, 24 of 32 layers
    # Gated DeltaNet (full attention at 3, 7, ..., 31), an untied 248320 x 4096 LM head
    ("qwen35-9b", 8.95e9, [i % 4 != 3 for i in range(32)],
     {"output.weight": (248320, 4096), "blk.0.attn_qkv.weight": (8192, 4096), "blk.0.ssm_alpha.weight": (32, 4096),
      "blk.3.attn_q.weight": (8192, 4096), "blk.3.attn_k.weight": (1024, 4096), "blk.0.ffn_down.weight": (4096, 12288)}),
    # QWEN35.md 1.2: 40 layers, 10 x (3 Gated DeltaNet + 1 attention), 256 experts of 512, hidden 2048
    ("qwen36-35b-a3b", 34.66e9, [i % 4 != 3 for i in range(40)],
     {"blk.0.ffn_gate_exps.weight": (256, 512, 2048), "blk.0.ffn_down_exps.weight": (256, 2048, 512),
      "blk.0.ffn_gate_inp.weight": (256, 2048), "blk.3.attn_k.weight": (512, 2048)}),
])
def test_real_shapes_are_the_model_cards(name, params, recurrent, shapes):
    from dflash_ir.models.tensors import expected_tensors

    target, draft = real_configs(name)
    tensors = expected_tensors(target)
    assert sum(np.prod(s, dtype=np.float64) for s in tensors.values()) == pytest.approx(params, rel=2e-3)
    assert list(target.layer_is_recurrent) == recurrent and not target.tied_output
    assert {k: tensors[k] for k in shapes} == shapes
    taps = {"qwen35-9b": [1, 8, 15, 22, 29], "qwen36-35b-a3b": [1, 10, 19, 28, 37]}[name]
    assert [t - 1 for t in draft.target_layers] == taps and draft.block_size == 16  # GGUF stores HF ids + 1
    assert draft.fc_in == len(taps) * target.hidden and draft.hidden == target.hidden


@pytest.mark.parametrize("dtype", [DType.F32, DType.F16, DType.BF16, DType.Q8_0])
def test_rounding_in_chunks_of_rows_equals_rounding_at_once(monkeypatch, dtype):
    from dflash_ir.quant import quantize

    monkeypatch.setattr(generator, "QUANTIZE_CHUNK", 5000)  # 52 rows of 96 a chunk: 1000 rows end mid-chunk
    x = np.random.default_rng(0).standard_normal((3, 1000, 96), dtype=np.float32)
    x[0, 0, :32] = 0  # a zero block
    chunked, whole = generator._stored(x, dtype), quantize(x, dtype)
    assert chunked.dtype == whole.dtype and chunked.shape == whole.shape
    assert chunked.tobytes() == whole.tobytes()


_BIG_TENSOR_CHILD = r"""
import sys
from pathlib import Path
from dflash_ir.models import generator
from dflash_ir.models.generator import GGUFPlan, PlannedTensor, write_gguf
from dflash_ir.dtypes import DType

def status(key):
    return int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1]) << 10

generator.QUANTIZE_CHUNK = 1 << 20
shape = (32768, 1024)
plan = GGUFPlan({"general.architecture": "llama"},
                {"token_embd.weight": PlannedTensor(None, DType.Q8_0, shape=shape,
                                                    make=lambda: generator._init(
                                                        generator.np.random.default_rng(0), "token_embd.weight", shape))})
Path("/proc/self/clear_refs").write_text("5")
before = status("VmRSS")
write_gguf(Path(sys.argv[1]) / "big.gguf", plan)
print(status("VmHWM") - before)
"""


def test_a_large_tensor_is_made_and_rounded_without_copies(tmp_path):
    """A 248k x 4096 embedding is 4 GB of values: making it scales them in place and writing it
    rounds a chunk of rows at a time, so the process grows by the values plus their storage
    (here 128 + 34 MiB), not by several copies of the values (scaling a copy: +128 MiB;
    rounding at once: ~+400 MiB of temporaries)."""
    import subprocess
    import sys

    child = subprocess.run([sys.executable, "-c", _BIG_TENSOR_CHILD, str(tmp_path)], capture_output=True, text=True,
                           timeout=300)
    assert child.returncode == 0, child.stderr
    values, storage = 32768 * 1024 * 4, 32768 * 1024 // 32 * 34
    grew = int(child.stdout.split()[-1])
    assert grew < values + storage + (64 << 20), f"writing grew {grew >> 20} MiB"
