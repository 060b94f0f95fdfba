"""`dflash-draft-vocab`: a draft's reduced head chosen from texts' token counts, removed
again with --size 0, and its mistakes reported in one line."""
import numpy as np
import pytest

from dflash_ir.artifact import open_engine
from dflash_ir.cli.draft_vocab import main
from dflash_ir.models.config import DraftConfig
from dflash_ir.models.generator import tiny_draft_config, tiny_target_config, write_draft, write_target
from dflash_ir.models.gguf_file import open_gguf
from dflash_ir.models.tokenizer import Tokenizer

TEXT = "the cat sat on the mat. the dog sat on the log. "


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("draft-vocab-cli")
    tcfg = tiny_target_config("llama")
    target = write_target(d / "target.gguf", tcfg, dtype="f32", seed=0)
    return target, write_draft(d / "draft.gguf", tiny_draft_config(tcfg), target_cfg=tcfg, dtype="f32", seed=1)


def test_the_head_holds_the_texts_most_frequent_tokens_and_the_end_of_generation(pair, tmp_path, capsys):
    target, draft = pair
    text = tmp_path / "text.txt"
    text.write_text(TEXT * 3)
    out = tmp_path / "reduced.gguf"
    assert main([str(draft), str(target), "--size", "6", "--text", str(text), "-o", str(out)]) == 0
    tok = Tokenizer.from_gguf(target)
    ids = tok.encode(TEXT * 3)
    counts = {t: ids.count(t) for t in set(ids)}
    ranked = sorted(counts, key=lambda t: (-counts[t], t))[:5]  # and the end of generation
    assert open_gguf(out).raw("d2t").tolist() == sorted(ranked + [tok.eos_id])
    assert "a head of 6 of 320 tokens" in capsys.readouterr().err
    engine = open_engine(target, out)
    want = engine.generate(prompt_ids=ids[:8], max_tokens=12, speculative=False, ignore_eos=True).tokens
    assert engine.generate(prompt_ids=ids[:8], max_tokens=12, n_max=7, ignore_eos=True).tokens == want

    back = tmp_path / "back.gguf"
    assert main([str(out), str(target), "--size", "0", "-o", str(back)]) == 0
    assert DraftConfig.from_gguf(open_gguf(back)).draft_vocab == 0
    assert back.read_bytes() == draft.read_bytes()  # the draft it came from, byte for byte


@pytest.mark.parametrize("extra, message", [
    (["--size", "6"], "--text is needed"),
    (["--size", "400", "--text", "{text}"], "--size 400 is more than the target's 320 tokens"),
    (["--size", "6", "--text", "{missing}"], "No such file"),
    (["--size", "0", "-o", "{draft}"], "is one of the inputs"),
])
def test_mistakes_are_one_line_errors(pair, tmp_path, capsys, extra, message):
    target, draft = pair
    (tmp_path / "text.txt").write_text(TEXT)
    names = {"text": tmp_path / "text.txt", "missing": tmp_path / "missing.txt", "draft": draft}
    args = [str(draft), str(target), *(a.format(**names) for a in extra)]
    if "-o" not in args:
        args += ["-o", str(tmp_path / "out.gguf")]
    assert main(args) in (1, 2)
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
