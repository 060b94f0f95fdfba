"""train/measure.py on a copy of the coder pair, the first of two held-out prompts: the figures
it writes, where it is told to."""
import json
import shutil

from dflash_ir import demo
from train import measure


def test_measure_writes_tau_speed_and_identity_per_prompt(tmp_path, capsys):
    for name in ("coder-target-q8_0.gguf", "coder-dflash-q8_0.gguf"):
        shutil.copy(demo.DEMO_DIR / name, tmp_path / name)
    first, second = json.loads((demo.DEMO_DIR / "prompts.json").read_text())[:2]
    (tmp_path / "prompts.json").write_text(json.dumps([first, second]))
    assert measure.main(["coder", "--dir", str(tmp_path), "--work", str(tmp_path / "build"), "-n", "16",
                         "--prompts", "1", "-o", str(tmp_path / "one.json")]) == 0
    got = json.loads((tmp_path / "one.json").read_text())
    assert (got["draft"], got["draft_head"]) == ("coder-dflash-q8_0.gguf", "the target's")
    (row,) = got["prompts"]
    assert row["prompt"] == first["file"] and row["identical"] and got["all_identical"]
    assert row["tokens"] == 16 and row["text"]  # ignore_eos: a completion runs to n tokens
    rounds = sum(row["accept_hist"].values())
    assert row["tau"] == round(sum(int(k) * v for k, v in row["accept_hist"].items()) / rounds + 1, 2)
    assert got["tau_mean"] == row["tau"] and got["speedup"] > 0


def test_smollm2_demo_requests_are_held_out_from_the_drafts_training():
    from train import chat_prompts

    held_out = chat_prompts.split()["held_out"]
    assert all(r.question in held_out for r in demo.SMOLLM2_REQUESTS)
    assert len(measure.smollm2_requests()) == len(held_out)
