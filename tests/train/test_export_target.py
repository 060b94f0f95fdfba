"""Our torch target, exported with the converter's transforms, runs the same in the interpreter."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dflash_ir.artifact import open_engine  # noqa: E402
from dflash_ir.models.generator import tiny_vocab  # noqa: E402
from train import export  # noqa: E402


def test_exported_target_logits_match_torch(tmp_path, tiny_hp, random_target):
    HP, model = tiny_hp, random_target
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    path = export.write_target(tmp_path / "t.gguf", state, HP.to_dict(), tokenizer=tiny_vocab(HP.vocab_size),
                               dtype="f32")
    ids = np.random.default_rng(1).integers(0, HP.vocab_size, 100)  # > one 64-row GDN chunk
    with torch.no_grad():
        want, hidden = model(torch.as_tensor(ids)[None])
    engine = open_engine(path, taps=(1, 3))
    out = engine.target.prefill(ids.tolist(), all_logits=True)
    np.testing.assert_allclose(out.logits, want[0].numpy(), atol=1e-3, rtol=0)
    np.testing.assert_allclose(out.features, torch.cat([hidden[1][0], hidden[3][0]], -1).numpy(), atol=1e-3, rtol=0)
    # one-row decode after the prompt (recurrent form, carried state)
    with torch.no_grad():
        full, _ = model(torch.as_tensor([*ids, 7])[None])
    np.testing.assert_allclose(engine.target.decode(7).logits[-1], full[0, -1].numpy(), atol=1e-3, rtol=0)


def test_tiled_order_matches_llama_cpp_comment():
    # llama-model.cpp: "Qwen 3.5: [k0_v0, k1_v1, k0_v2, k1_v3]" -> GGUF slot j holds HF v-head perm[j]
    assert export.tiled_order(2, 4).tolist() == [0, 2, 1, 3]
