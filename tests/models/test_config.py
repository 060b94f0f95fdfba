"""Reading and validating model configs: good files of many shapes, the oracle fixtures, and a
suite of broken files, each rejected with a message naming the file and the key or tensor."""

import dataclasses
import re

import numpy as np
import pytest
from dflash_ir.models.checks import check_pair
from dflash_ir.models.config import DraftConfig, TargetConfig
from dflash_ir.models.metadata import ModelConfigError
from dflash_ir.models.tensors import expected_tensors, validate_tensors
from dflash_ir.models.generator import (
    TINY_MASK_ID,
    draft_plan,
    target_plan,
    tiny_draft_config,
    tiny_target_config,
    write_draft,
    write_gguf,
    write_target,
)
from dflash_ir.models.gguf_file import GGUFError, open_gguf

from dflash_ir.dtypes import DType


def as_stored(cfg):
    return dataclasses.replace(
        cfg, rms_eps=float(np.float32(cfg.rms_eps)), rope_theta=float(np.float32(cfg.rope_theta))
    )


def raises(path, what):
    """pytest.raises for a ModelConfigError whose message names `path` and then `what`."""
    return pytest.raises(ModelConfigError, match=re.escape(str(path)) + ".*" + what)


# -- good files ---------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe"])
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("n_nextn", [0, 1])
@pytest.mark.parametrize("n_head_kv", [4, 2])
def test_target_round_trip(tmp_path, arch, tied, n_nextn, n_head_kv):
    cfg = tiny_target_config(arch, tied_output=tied, n_nextn=n_nextn, n_head_kv=n_head_kv, n_layer=6)
    f = open_gguf(write_target(tmp_path / "t.gguf", cfg))
    read = TargetConfig.from_gguf(f)
    assert read == as_stored(cfg)
    validate_tensors(f, read)
    assert read.layer_is_recurrent == (True, True, True, False, True, True)
    assert read.attention_layers == (3,) and read.block_count == 6 + n_nextn
    assert read.conv_channels == 2 * 2 * 16 + 64 and read.ssm_head_v_dim == 16
    assert ("output.weight" in f.tensors) == (not tied)
    assert any(n.startswith("blk.6.") for n in f.tensors) == bool(n_nextn)


def test_draft_round_trip_with_sliding_window(tmp_path):
    target = tiny_target_config(n_layer=8)
    cfg = tiny_draft_config(
        target,
        n_layer=3,
        target_layers=(2, 5, 8),
        sliding_window=64,
        swa_layers=(True, True, False),
        rope_sections=(16, 0, 0, 0),
    )
    f = open_gguf(write_draft(tmp_path / "d.gguf", cfg, target_cfg=target))
    read = DraftConfig.from_gguf(f)
    assert read == as_stored(cfg)
    assert read.tap_layers == (1, 4, 7) and read.fc_in == 3 * 64
    assert [read.layer_window(i) for i in range(3)] == [64, 64, 0]
    validate_tensors(f, read)
    check_pair(read, target, draft_path="d", target_path="t")


def test_draft_accepts_fork_mask_key(tmp_path):
    target = tiny_target_config()
    plan = draft_plan(tiny_draft_config(target), target_cfg=target)
    plan.metadata["dflash.mask_token_id"] = plan.metadata.pop("tokenizer.ggml.mask_token_id")
    assert DraftConfig.from_gguf(open_gguf(write_gguf(tmp_path / "d.gguf", plan))).mask_token_id == TINY_MASK_ID


def test_mtp_tensors_are_optional(tmp_path):
    cfg = tiny_target_config(n_nextn=1)
    plan = target_plan(cfg)
    for name in [n for n in plan.tensors if n.startswith("blk.4.")][:3]:
        del plan.tensors[name]
    f = open_gguf(write_gguf(tmp_path / "t.gguf", plan))
    validate_tensors(f, TargetConfig.from_gguf(f))


def test_expected_tensor_lists():
    dense = expected_tensors(tiny_target_config())
    assert len(dense) == 1 + 3 * 14 + 11 + 1  # token_embd, 3 GDN blocks, 1 attention block, output_norm
    assert dense["blk.3.attn_q.weight"] == (2 * 4 * 32, 64)  # query and gate interleaved per head
    assert dense["blk.0.attn_qkv.weight"] == (128, 64) and dense["blk.0.ssm_conv1d.weight"] == (128, 4)
    moe = expected_tensors(tiny_target_config("qwen35moe", tied_output=False))
    assert moe["blk.0.ffn_gate_exps.weight"] == (4, 32, 64) and moe["blk.0.ffn_down_exps.weight"] == (4, 64, 32)
    assert moe["blk.0.ffn_gate_inp_shexp.weight"] == (1, 64) and moe["output.weight"] == (320, 64)
    draft = expected_tensors(tiny_draft_config(tiny_target_config()))
    assert len(draft) == 3 + 2 * 11 and draft["fc.weight"] == (64, 2 * 64)


# -- the oracle fixtures (README tables) ----------------------------------------------------

FIXTURES = {
    "dense": {
        "target": {
            "arch": "qwen35",
            "vocab_size": 248320,
            "hidden": 64,
            "n_layer": 8,
            "n_nextn": 1,
            "n_head": 4,
            "n_head_kv": 2,
            "head_dim": 64,
            "n_rot": 16,
            "rope_sections": (3, 3, 2, 0),
            "ssm_n_group": 2,
            "ssm_dt_rank": 4,
            "ssm_d_state": 32,
            "ssm_inner": 128,
            "ssm_conv_kernel": 4,
            "ff": 192,
            "tied_output": True,
        },
        "conv_channels": 256,
        "draft": {
            "n_layer": 3,
            "hidden": 64,
            "n_head": 4,
            "n_head_kv": 2,
            "head_dim": 32,
            "ff": 128,
            "block_size": 16,
            "mask_token_id": 248070,
            "target_layers": (2, 4, 6),
            "fc_in": 192,
        },
        "taps": (1, 3, 5),
    },
    "moe": {
        "target": {
            "arch": "qwen35moe",
            "vocab_size": 248320,
            "hidden": 32,
            "n_layer": 8,
            "n_nextn": 1,
            "n_head": 4,
            "n_head_kv": 1,
            "head_dim": 32,
            "n_rot": 8,
            "rope_sections": (2, 1, 1, 0),
            "ssm_n_group": 1,
            "ssm_dt_rank": 2,
            "ssm_d_state": 32,
            "ssm_inner": 64,
            "ssm_conv_kernel": 4,
            "n_expert": 8,
            "n_expert_used": 2,
            "expert_ff": 64,
            "shared_ff": 96,
            "tied_output": True,
        },
        "conv_channels": 128,
        "draft": {
            "n_layer": 2,
            "hidden": 32,
            "n_head": 2,
            "n_head_kv": 1,
            "head_dim": 32,
            "ff": 96,
            "block_size": 16,
            "mask_token_id": 248070,
            "target_layers": (2, 6),
            "fc_in": 64,
        },
        "taps": (1, 5),
    },
}


@pytest.mark.oracle
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_oracle_fixtures(oracle_gguf, kind):
    want = FIXTURES[kind]
    drafts = {}
    for precision in ("f16", "q8_0"):
        path = oracle_gguf(f"{kind}/gguf/{kind}-target-{precision}.gguf")
        f = open_gguf(path)
        target = TargetConfig.from_gguf(f)
        validate_tensors(f, target)
        assert {k: getattr(target, k) for k in want["target"]} == want["target"]
        assert target.layer_is_recurrent == tuple(c == "L" for c in "LLLALLLA")
        assert target.conv_channels == want["conv_channels"]
        assert target.rope_theta == 1e7 and np.float32(target.rms_eps) == np.float32(1e-6)
        drafts[precision] = path
    draft_path = oracle_gguf(f"{kind}/gguf/{kind}-dflash-f16.gguf")
    f = open_gguf(draft_path)
    draft = DraftConfig.from_gguf(f)
    validate_tensors(f, draft)
    assert {k: getattr(draft, k) for k in want["draft"]} == want["draft"]
    assert draft.tap_layers == want["taps"] and draft.n_rot == draft.head_dim and draft.swa_layers == ()
    check_pair(draft, target, draft_path=draft_path, target_path=drafts["q8_0"])


# -- bad files ------------------------------------------------------------------------------


def edited_target(tmp_path, edit, **overrides):
    plan = target_plan(tiny_target_config(**overrides))
    edit(plan)
    return write_gguf(tmp_path / "bad.gguf", plan)


def set_key(key, value):
    return lambda plan: plan.metadata.__setitem__(key, value)


def del_key(key):
    return lambda plan: plan.metadata.pop(key)


BAD_TARGET_METADATA = [
    (
        set_key("general.architecture", "gemma3"),
        r"general.architecture 'gemma3' is not supported as a target \(supported: qwen35, qwen35moe, llama, qwen3\)",
    ),
    (del_key("qwen35.ssm.state_size"), "metadata key qwen35.ssm.state_size is missing"),
    (del_key("qwen35.feed_forward_length"), "metadata key qwen35.feed_forward_length is missing"),
    (
        set_key("qwen35.ssm.inner_size", 96),
        r"qwen35.ssm.inner_size = 96 must equal ssm.time_step_rank \* ssm.state_size",
    ),
    (set_key("qwen35.ssm.group_count", 3), r"qwen35.ssm.time_step_rank = 4 value heads is not a multiple"),
    (set_key("qwen35.attention.head_count_kv", 3), "qwen35.attention.head_count_kv = 3 does not divide"),
    (set_key("qwen35.attention.value_length", 16), "qwen35.attention.value_length must equal attention.key_length"),
    (set_key("qwen35.rope.dimension_count", 48), "qwen35.rope.dimension_count = 48 must be even and at most"),
    (set_key("qwen35.rope.dimension_sections", [2, 2, 2, 0]), r"qwen35.rope.dimension_sections = \[2, 2, 2, 0\] must"),
    (set_key("qwen35.nextn_predict_layers", 4), "qwen35.nextn_predict_layers = 4 must be below block_count"),
    (set_key("qwen35.embedding_length", "64"), "qwen35.embedding_length = '64' is not an integer"),
    (set_key("qwen35.full_attention_interval", 0), "qwen35.full_attention_interval = 0 must be positive"),
    (set_key("qwen35.attention.recurrent_layers", [True, False]), "qwen35.attention.recurrent_layers has 2 entries"),
    (
        set_key("tokenizer.ggml.tokens", ["a"] * 300),
        "tokenizer.ggml.tokens has 300 entries but token_embd.weight has 320",
    ),
    (lambda plan: plan.tensors.pop("token_embd.weight"), "tensor token_embd.weight is missing"),
    # limits, checked before anything is sized from them
    (set_key("qwen35.block_count", 5), r"qwen35.block_count = 5 declares more layers than the file has tensors for "
                                        r"\(4 blocks blk.N\)"),
    (set_key("qwen35.block_count", 10**8), r"qwen35.block_count = 100000000 declares more layers"),
    (set_key("qwen35.rope.freq_base", float("nan")), r"qwen35.rope.freq_base = nan is not a finite number"),
    (set_key("qwen35.attention.layer_norm_rms_epsilon", float("inf")),
     r"qwen35.attention.layer_norm_rms_epsilon = inf is not a finite number"),
    (set_key("qwen35.attention.layer_norm_rms_epsilon", -1e-6), r"layer_norm_rms_epsilon = -9\.9\d+e-07 must be positive"),
    (set_key("qwen35.context_length", 2**31), r"qwen35.context_length = 2147483648 exceeds 2147483647"),
]


@pytest.mark.parametrize("edit, message", BAD_TARGET_METADATA)
def test_bad_target_metadata(tmp_path, edit, message):
    path = edited_target(tmp_path, edit)
    with raises(path, message):
        TargetConfig.from_gguf(open_gguf(path))


@pytest.mark.parametrize("edit, message", [
    (set_key("qwen35moe.expert_used_count", 5), "qwen35moe.expert_used_count = 5 exceeds expert_count = 4"),
    (set_key("qwen35moe.expert_count", 100000), r"qwen35moe.expert_count = 100000 exceeds 512 \(llama.cpp's"),
    (set_key("qwen35moe.expert_used_count", 0), "qwen35moe.expert_used_count = 0 must be positive"),
])
def test_bad_moe_metadata(tmp_path, edit, message):
    path = edited_target(tmp_path, edit, arch="qwen35moe")
    with raises(path, message):
        TargetConfig.from_gguf(open_gguf(path))


def test_draft_passed_as_target_and_back(tmp_path):
    target = tiny_target_config()
    draft_path = write_draft(tmp_path / "d.gguf", tiny_draft_config(target), target_cfg=target)
    target_path = write_target(tmp_path / "t.gguf", target)
    with raises(draft_path, r"'dflash': this is a DFlash draft model; pass it as the draft \(-md\)"):
        TargetConfig.from_gguf(open_gguf(draft_path))
    with raises(target_path, r"'qwen35': this is a target model; pass it as the target \(-m\)"):
        DraftConfig.from_gguf(open_gguf(target_path))


BAD_TARGET_TENSORS = [
    (
        lambda plan: plan.tensors.pop("blk.1.ssm_out.weight"),
        r"tensor blk.1.ssm_out.weight is missing \(expected shape \(64, 64\)",
    ),
    (
        lambda plan: plan.set_tensor("blk.3.attn_q.weight", (128, 64)),
        r"tensor blk.3.attn_q.weight has shape \(128, 64\) \(ggml ne \[64, 128\]\), expected \(256, 64\)",
    ),
    (
        lambda plan: setattr(plan.tensors["blk.0.attn_norm.weight"], "dtype", DType.Q8_0),
        r"tensor blk.0.attn_norm.weight has type Q8_0, which is not supported for it \(supported: BF16, F16, F32\)",
    ),
    (lambda plan: plan.set_tensor("blk.4.attn_norm.weight", (64,)), "unexpected tensor blk.4.attn_norm.weight"),
    (lambda plan: plan.set_tensor("output.weight", (320, 64)), "unexpected tensor output.weight"),
]


@pytest.mark.parametrize("edit, message", BAD_TARGET_TENSORS)
def test_bad_target_tensors(tmp_path, edit, message):
    path = edited_target(tmp_path, edit)
    f = open_gguf(path)
    cfg = TargetConfig.from_gguf(f)
    if "output.weight" in f.tensors:  # a stray output.weight only looks wrong against the tied config
        cfg = dataclasses.replace(cfg, tied_output=True)
    with raises(path, message):
        validate_tensors(f, cfg)


def edited_draft(tmp_path, edit, target=None, **overrides):
    target = target or tiny_target_config()
    plan = draft_plan(tiny_draft_config(target, **overrides), target_cfg=target)
    edit(plan)
    return write_gguf(tmp_path / "bad-draft.gguf", plan)


BAD_DRAFT = [
    (del_key("tokenizer.ggml.mask_token_id"), r"tokenizer.ggml.mask_token_id \(or dflash.mask_token_id\) is missing"),
    (set_key("dflash.block_size", 1), "dflash.block_size = 1 must be at least 2"),
    (set_key("dflash.block_size", 10**6), r"dflash.block_size = 1000000 exceeds 256 \(a block is verified in one batch"),
    (set_key("dflash.block_count", 10**8), r"dflash.block_count = 100000000 declares more layers than the file has"),
    (set_key("dflash.rope.freq_base", float("-inf")), r"dflash.rope.freq_base = -inf is not a finite number"),
    (set_key("tokenizer.ggml.mask_token_id", "5"), r"tokenizer.ggml.mask_token_id = '5' is not an integer"),
    (set_key("dflash.target_layers", [0, 2]), r"dflash.target_layers = \[0, 2\] must be a non-empty list of ids >= 1"),
    (del_key("dflash.attention.head_count"), "metadata key dflash.attention.head_count is missing"),
    (
        set_key("dflash.attention.sliding_window_pattern", [True, False]),
        "dflash.attention.sliding_window_pattern is set but attention.sliding_window is missing",
    ),
    (
        set_key("general.architecture", "dflash-draft"),
        r"'dflash-draft' is not supported as a draft \(supported: dflash\)",
    ),
]


@pytest.mark.parametrize("edit, message", BAD_DRAFT)
def test_bad_draft_metadata(tmp_path, edit, message):
    path = edited_draft(tmp_path, edit)
    with raises(path, message):
        DraftConfig.from_gguf(open_gguf(path))


def test_bad_draft_tensor(tmp_path):
    path = edited_draft(tmp_path, lambda plan: plan.tensors.pop("blk.1.attn_k_norm.weight"))
    f = open_gguf(path)
    with raises(path, r"tensor blk.1.attn_k_norm.weight is missing \(expected shape \(32,\)"):
        validate_tensors(f, DraftConfig.from_gguf(f))


# -- draft / target pairs -------------------------------------------------------------------


def pair(tmp_path, target, draft):
    t = write_target(tmp_path / "t.gguf", target)
    d = write_draft(tmp_path / "d.gguf", draft, target_cfg=target)
    return DraftConfig.from_gguf(open_gguf(d)), TargetConfig.from_gguf(open_gguf(t)), d, t


@pytest.mark.parametrize(
    "draft_overrides, message",
    [
        ({"hidden": 32}, "hidden size mismatch: dflash.embedding_length = 32 but qwen35.embedding_length = 64"),
        ({"mask_token_id": 320}, "tokenizer.ggml.mask_token_id = 320 is outside the target vocabulary"),
        ({"target_layers": (2, 5)}, r"dflash.target_layers = \[2, 5\]: ids \[5\] are outside 1..4"),
        ({"fc_in": 3 * 64}, r"fc.weight input width 192 != 2 taps \* target hidden 64 = 128"),
    ],
)
def test_mismatched_pair(tmp_path, draft_overrides, message):
    target = tiny_target_config()
    draft, target, d, t = pair(tmp_path, target, tiny_draft_config(target, **draft_overrides))
    with pytest.raises(ModelConfigError, match=f"draft {re.escape(str(d))} / target {re.escape(str(t))}: {message}"):
        check_pair(draft, target, draft_path=d, target_path=t)


def test_fc_width_is_also_a_tensor_error(tmp_path):
    target = tiny_target_config()
    draft, _, d, _ = pair(tmp_path, target, tiny_draft_config(target, fc_in=3 * 64))
    with raises(d, r"tensor fc.weight has shape \(64, 192\)"):
        validate_tensors(open_gguf(d), draft)


def test_errors_are_gguf_and_value_errors():
    assert issubclass(ModelConfigError, GGUFError) and issubclass(ModelConfigError, ValueError)
