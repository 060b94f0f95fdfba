"""A draft's reduced head (models/draft_vocab.py, llama.cpp's d2t): the file as llama.cpp
stores it, logits that are the target head's columns at d2t, proposals mapped through d2t,
the choice of ids by frequency, and files that get it wrong refused naming the tensor."""
import gguf
import numpy as np
import pytest

from dflash_ir.artifact import open_engine, open_pair
from dflash_ir.dtypes import DType
from dflash_ir.models.config import DraftConfig
from dflash_ir.models.draft_vocab import frequent_tokens, reduced_draft_plan
from dflash_ir.models.generator import (TINY_MASK_ID, GGUFPlan, PlannedTensor, tiny_draft_config, tiny_target_config,
                                        write_draft, write_gguf, write_target)
from dflash_ir.models.gguf_file import open_gguf
from dflash_ir.models.metadata import ModelConfigError

PROMPT = np.array([5, 77, 140, 9, 260, 31, 8], np.int32)
AGREEING_PROMPT = [5, 77, 140, 9, 260, 31, 8, 101, 44, 203, 17, 66, 250, 12, 90, 133]  # >= 15 tokens, no MASK
IDS = np.sort(np.random.default_rng(7).choice(320, 40, replace=False))  # of the tiny target's 320 tokens


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(target, full draft, the same draft with a reduced head of IDS)."""
    d = tmp_path_factory.mktemp("draft-vocab")
    tcfg = tiny_target_config("qwen35")
    target = write_target(d / "target.gguf", tcfg, dtype="q8_0", seed=0)
    draft = write_draft(d / "draft.gguf", tiny_draft_config(tcfg), target_cfg=tcfg, dtype="q8_0", seed=1)
    reduced = write_gguf(d / "reduced.gguf", reduced_draft_plan(open_gguf(draft), open_gguf(target), IDS))
    return target, draft, reduced


def test_the_file_holds_the_target_heads_rows_and_i64_ids_as_llama_cpp_reads_them(files):
    target, draft, reduced = files
    tensors = {t.name: t for t in gguf.GGUFReader(reduced).tensors}
    assert tensors["d2t"].tensor_type == gguf.GGMLQuantizationType.I64
    assert np.array_equal(tensors["d2t"].data, IDS)
    head = {t.name: t for t in gguf.GGUFReader(target).tensors}["token_embd.weight"]  # tied
    assert tensors["output.weight"].tensor_type == head.tensor_type
    assert np.array_equal(tensors["output.weight"].data, head.data[IDS])
    assert DraftConfig.from_gguf(open_gguf(reduced)).draft_vocab == len(IDS)
    assert DraftConfig.from_gguf(open_gguf(draft)).draft_vocab == 0


def test_logits_are_the_full_heads_columns_and_proposals_their_ids(files):
    target, draft, reduced = files
    outputs = []
    for d in (draft, reduced):
        engine = open_engine(target, d)
        engine.draft.inject(engine.target.prefill(PROMPT).features)
        outputs.append(engine.draft.block_outputs(int(PROMPT[-1])))
    full, red = outputs
    assert np.array_equal(red["logits"], full["logits"][:, IDS])  # the same rows, bit for bit
    assert np.array_equal(red["proposals"], IDS[np.argmax(full["logits"][:, IDS], axis=1)])
    assert red["proposals"].dtype == full["proposals"].dtype == np.int32


def test_an_engine_reads_the_d2t_ids_once_from_its_pair(files, monkeypatch):
    """open_pair validates the ids and keeps them (pair.draft_vocab); open_engine's draft
    maps its proposals through those, not a second read of the file."""
    from dflash_ir.models import draft_vocab

    target, _, reduced = files
    reads = []
    read = draft_vocab.read_d2t
    monkeypatch.setattr(draft_vocab, "read_d2t", lambda *a: reads.append(a) or read(*a))
    assert np.array_equal(open_pair(target, reduced).draft_vocab, IDS) and len(reads) == 1
    assert np.array_equal(open_engine(target, reduced).draft.vocab, IDS) and len(reads) == 2


@pytest.mark.parametrize("holds_text", [True, False])
def test_greedy_output_is_the_targets_whether_or_not_the_head_holds_the_text(agreeing_pair, tmp_path, holds_text):
    """A draft agreeing on 5 proposals a round keeps them all with a head holding the text's
    tokens and MASK, and none with one that holds neither; either way the tokens are the
    target's alone."""
    target, draft = agreeing_pair("qwen35", 5)
    text = set(AGREEING_PROMPT) | {TINY_MASK_ID}
    ids = np.array(sorted(text if holds_text else set(range(320)) - text), np.int64)
    reduced = write_gguf(tmp_path / "reduced.gguf", reduced_draft_plan(open_gguf(draft), open_gguf(target), ids))
    engine = open_engine(target, reduced, n_ctx=96)
    want = engine.generate(prompt_ids=AGREEING_PROMPT, max_tokens=25, speculative=False, ignore_eos=True).tokens
    gen = engine.generate(prompt_ids=AGREEING_PROMPT, max_tokens=25, n_max=7, ignore_eos=True)
    assert gen.tokens == want
    assert {r["accepted"] for r in gen.rounds} == ({5} if holds_text else {0})


def test_frequent_tokens_rank_by_count_ties_to_the_lower_id_and_keep_the_always_kept():
    tokens = [9, 9, 9, 4, 4, 7, 7, 2, 5]
    assert frequent_tokens(tokens, 3).tolist() == [4, 7, 9]
    assert frequent_tokens(tokens, 3, always=[11]).tolist() == [4, 9, 11]
    assert frequent_tokens(tokens, 9).tolist() == [2, 4, 5, 7, 9]  # no more than the text has
    with pytest.raises(ValueError, match="cannot hold"):
        frequent_tokens(tokens, 1, always=[1, 2])


def _edited(files, tmp_path, edit):
    target, draft, reduced = files
    f = open_gguf(reduced)
    tensors = {n: PlannedTensor(f.raw(n), i.dtype, shape=i.shape) for n, i in f.tensors.items()}
    edit(tensors)
    return target, write_gguf(tmp_path / "bad.gguf", GGUFPlan(dict(f.metadata), tensors))


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.update(d2t=PlannedTensor(IDS + 400, DType.I64)), "d2t holds ids outside the target vocabulary"),
    (lambda t: t.update(d2t=PlannedTensor(np.full(len(IDS), 3, np.int64), DType.I64)), "d2t names a target token twice"),
    (lambda t: t.update(d2t=PlannedTensor(IDS.astype(np.float32), DType.F32)), "tensor d2t has type F32"),
    (lambda t: t.pop("output.weight"), "tensor output.weight is missing"),
    (lambda t: t.update(d2t=PlannedTensor(IDS[:-1], DType.I64)), "tensor output.weight has shape"),
])
def test_a_wrong_reduced_head_is_refused_naming_the_tensor(files, tmp_path, edit, message):
    target, bad = _edited(files, tmp_path, edit)
    with pytest.raises(ModelConfigError, match=message) as e:
        open_pair(target, bad)
    assert str(bad) in str(e.value)


def test_the_generator_writes_a_reduced_head_that_validates(tmp_path):
    """A generated draft with draft_vocab holds what expected_tensors lists: a head of that
    many rows and d2t ids spread over the target's vocabulary."""
    tcfg = tiny_target_config("qwen35")
    target = write_target(tmp_path / "target.gguf", tcfg, dtype="q8_0", seed=0)
    draft = write_draft(tmp_path / "draft.gguf", tiny_draft_config(tcfg, draft_vocab=24), target_cfg=tcfg,
                        dtype="q8_0", seed=1)
    assert open_pair(target, draft).configs["draft"].draft_vocab == 24
    assert open_gguf(draft).raw("d2t").tolist() == [i * 320 // 24 for i in range(24)]
