"""Our torch DFlash draft, exported to a `dflash` GGUF, proposes the same block in the interpreter."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dflash_ir.artifact import open_engine  # noqa: E402
from dflash_ir.models.generator import tiny_vocab  # noqa: E402
from train import export  # noqa: E402
from train.draft import DFlashDraft, DraftHParams, accepted_per_block, draft_loss, hf_config  # noqa: E402


def _random_draft(target) -> DFlashDraft:
    torch.manual_seed(3)
    hp = target.hp
    draft = DFlashDraft(DraftHParams(hidden=hp.hidden, mask_token_id=hp.vocab_size - 1, target_layer_ids=(0, 2),
                                     head_dim=32, ff=96), target)
    with torch.no_grad():  # norms away from 1, so a missing or extra +1 shows
        for p in draft.parameters():
            if p.ndim == 1:
                p.add_(0.2 * torch.randn_like(p))
    return draft


def test_exported_draft_first_block_matches_torch(tmp_path, tiny_hp, random_target):
    HP, target = tiny_hp, random_target
    draft = _random_draft(target)
    vocab = tiny_vocab(HP.vocab_size)
    t_path = export.write_target(tmp_path / "t.gguf", {k: v.numpy() for k, v in target.state_dict().items()},
                                 HP.to_dict(), tokenizer=vocab, dtype="f32")
    d_path = export.write_draft(tmp_path / "d.gguf", {k: v.numpy() for k, v in draft.own_state().items()},
                                hf_config(draft.hp.to_dict(), HP.n_layer),
                                target_cfg=export.target_config(HP.to_dict()), tokenizer=vocab, dtype="f32")
    ids = np.random.default_rng(2).integers(0, HP.vocab_size - 1, 40)
    engine = open_engine(t_path, d_path)
    out = engine.target.prefill(ids.tolist())
    feats = draft.features(torch.as_tensor(ids)[None])[0]
    np.testing.assert_allclose(out.features, feats.numpy(), atol=1e-3, rtol=0)
    engine.draft.inject(out.features)
    anchor = int(out.logits[-1].argmax())
    res = engine.draft.block_outputs(anchor)
    proposals = res["proposals"]
    hidden, logits = draft.first_block(torch.as_tensor(out.features), anchor)  # the same features on both sides
    np.testing.assert_allclose(res["hidden"], hidden.numpy(), atol=1e-3, rtol=0)
    np.testing.assert_allclose(res["logits"], logits.numpy(), atol=1e-3, rtol=0)
    assert proposals.tolist() == logits.argmax(-1).tolist()


def test_training_mask_equals_inference_view(tiny_hp, random_target):
    """A block in the batched training forward sees what the inference forward sees."""
    HP, target = tiny_hp, random_target
    draft = _random_draft(target)
    tokens = torch.randint(0, HP.vocab_size - 1, (1, 60))
    feats = draft.features(tokens)
    gen = torch.Generator().manual_seed(0)
    loss = draft_loss(draft, tokens, first_anchor=30, n_anchors=1, generator=gen, feats=feats)
    a = int(torch.randperm(60 - 16 - 30 + 1, generator=torch.Generator().manual_seed(0))[0]) + 30
    _, logits = draft.first_block(feats[0, :a], int(tokens[0, a]))
    ce = torch.nn.functional.cross_entropy(logits, tokens[0, a + 1:a + 16], reduction="none")
    w = torch.exp(-torch.arange(15.0) / draft.hp.gamma)
    torch.testing.assert_close(loss, (ce * w).sum() / w.sum(), atol=1e-4, rtol=1e-4)


def test_accepted_per_block_is_the_run_of_proposals_a_greedy_target_keeps(tiny_hp, random_target):
    """The validation measure of train/smollm2.py: where the sequence continues with the block's
    greedy proposals (made by the single-block inference forward) but for another token after the
    first m, m are accepted (not the 14 that match), whatever other blocks share the forward."""
    draft = _random_draft(random_target)
    V, a = tiny_hp.vocab_size - 1, 30
    base = torch.randint(0, V, (1, 60), generator=torch.Generator().manual_seed(5))

    def proposals(tokens, anchor):
        return draft.first_block(draft.features(tokens)[0, :anchor], int(tokens[0, anchor]))[1].argmax(-1)

    def kept(tokens, anchor):  # the leading run of proposals equal to the tokens after the anchor
        hits = (proposals(tokens, anchor) == tokens[0, anchor + 1:anchor + 16]).int()
        return int(hits.cumprod(0).sum())

    made = proposals(base, a)  # depend on tokens up to the anchor only: the target is causal
    for m in (0, 3, 15):
        tokens = base.clone()
        tokens[0, a + 1:a + 16] = made
        if m < 15:
            tokens[0, a + 1 + m] = (made[m] + 1) % V
        got = accepted_per_block(draft, tokens, torch.tensor([a - 10, a, a + 5]), draft.features(tokens))
        assert got.tolist() == [kept(tokens, a - 10), m, kept(tokens, a + 5)]
