"""train/export.py converts z-lab's HF draft exactly like llama.cpp's converter.

The fixture's `hf-dflash/` checkpoint exported by us must equal the fixture's llama.cpp GGUF of
the same model (`convert_hf_to_gguf.py --outtype f16 --target-model-dir`): same tensors in the
same order, same types and shapes, identical bytes, and the same `dflash.*` metadata.
"""
from __future__ import annotations

import json

import pytest

from dflash_ir.models.config import TargetConfig
from dflash_ir.models.gguf_file import open_gguf
from train import export

pytestmark = pytest.mark.oracle


def test_hf_draft_export_equals_llama_cpp(oracle_dir, oracle_gguf, tmp_path):
    safetensors = pytest.importorskip("safetensors.numpy")
    hf = oracle_dir / "dense" / "hf-dflash"
    with open_gguf(oracle_gguf("dense/gguf/dense-target-f16.gguf")) as t:
        target_cfg = TargetConfig.from_gguf(t)
    want = open_gguf(oracle_gguf("dense/gguf/dense-dflash-f16.gguf"))
    tokenizer = {k: v for k, v in want.metadata.items() if k.startswith("tokenizer.") and "mask" not in k}
    ours = open_gguf(export.write_draft(
        tmp_path / "draft.gguf", safetensors.load_file(hf / "model.safetensors"),
        json.loads((hf / "config.json").read_text()), target_cfg=target_cfg, tokenizer=tokenizer, dtype="f16"))
    with want, ours:
        assert list(ours.tensors) == list(want.tensors)
        for name, w in want.tensors.items():
            o = ours.tensors[name]
            assert (o.dtype, o.ggml_shape) == (w.dtype, w.ggml_shape), name
            assert ours.raw(name).tobytes() == want.raw(name).tobytes(), name
        keys = [k for k in want.metadata if k.startswith("dflash.")] + ["tokenizer.ggml.mask_token_id",
                                                                       "general.file_type"]
        assert {k: ours.metadata.get(k) for k in keys} == {k: want.metadata[k] for k in keys}
        assert {k: ours.metadata_types.get(k) for k in keys} == {k: want.metadata_types[k] for k in keys}
        order = [[k for k in f.metadata if k.startswith("dflash.")] for f in (ours, want)]
        assert order[0] == order[1]
