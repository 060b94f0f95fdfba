"""Retrain the shipped demo pair from scratch, seeded: `python -m train.run_all` (or `make train-demo`).

Stages (each writes into --work and is skipped when its output exists, so a run can resume):
  tokenizer  byte-level BPE on the training split            -> tokenizer.json (GGUF metadata)
  target     the qwen35 target, next-token loss on the corpus -> target.pt
  regen      greedy target continuations of corpus prompts    -> regen.pt (tokens + tap features)
  draft      the DFlash draft on those continuations          -> draft.pt
  export     Q8_0 GGUFs and held-out prompts                   -> demo/coder-{target,dflash}-q8_0.gguf, prompts.json
Timings go to <work>/timings.json.
"""
from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from . import corpus, export, prompts
from .draft import DFlashDraft, DraftHParams, draft_loss, hf_config
from .fit import fit
from .target import Target, TargetHParams
from .tokenizer import MASK, train_bpe

ROOT = Path(__file__).resolve().parents[1]
SEED = 1234
VOCAB = 4096
TARGET = dict(steps=450, batch=6, seq=128, lr=4e-3, warmup=30)
REGEN = dict(prompts=512, prompt_len=32, new=96, batch=128)
N_TAPS = 3
DRAFT = dict(steps=500, batch=8, anchors=16, lr=2e-3, warmup=30)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def load_tokenizer(work: Path):
    from dflash_ir.models.tokenizer import Tokenizer

    return Tokenizer.from_metadata(json.loads((work / "tokenizer.json").read_text()), source="tokenizer.json")


def token_stream(work: Path) -> torch.Tensor:
    """The training split as one token stream, files separated by <|endoftext|> (cached in --work)."""
    cached = work / "train_tokens.pt"
    if cached.exists():
        return torch.load(cached)
    tok = load_tokenizer(work)
    eot = tok.token_to_id("<|endoftext|>")
    ids: list[int] = []
    for p in corpus.split()["train"]:
        ids += tok.encode(corpus.read(p), parse_special=False) + [eot]
    stream = torch.tensor(ids, dtype=torch.long)
    torch.save(stream, cached)
    return stream


def stage_tokenizer(work: Path) -> None:
    meta = train_bpe((corpus.read(p) for p in corpus.split()["train"]), VOCAB)
    (work / "tokenizer.json").write_text(json.dumps(meta))


def stage_target(work: Path) -> None:
    seed_all(SEED)
    stream = token_stream(work)
    log(f"target: {len(stream)} training tokens")
    hp = TargetHParams(vocab_size=VOCAB)
    model = Target(hp)
    log(f"target: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")
    B, T = TARGET["batch"], TARGET["seq"]
    gen = torch.Generator().manual_seed(SEED)

    def loss_fn(step: int) -> torch.Tensor:
        starts = torch.randint(0, len(stream) - T - 1, (B,), generator=gen)
        x = torch.stack([stream[s:s + T + 1] for s in starts.tolist()])
        logits, _ = model(x[:, :-1])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, hp.vocab_size), x[:, 1:].reshape(-1))

    secs = fit(model.parameters(), loss_fn, steps=TARGET["steps"], lr=TARGET["lr"], warmup=TARGET["warmup"],
               log=lambda m: log("target: " + m), every=50)
    torch.save({"hp": hp.to_dict(), "state": model.state_dict(), "seconds": secs}, work / "target.pt")


def load_target(work: Path) -> Target:
    ck = torch.load(work / "target.pt")
    hp = ck["hp"]
    model = Target(TargetHParams(**{**hp, "rope_sections": tuple(hp["rope_sections"])}))
    model.load_state_dict(ck["state"])
    return model.eval()


def stage_regen(work: Path) -> None:
    """Target-aligned data (DFLASH.md §5): greedy continuations of random training-corpus prompts."""
    seed_all(SEED + 1)
    model = load_target(work)
    stream = token_stream(work)
    P, N = REGEN["prompt_len"], REGEN["new"]
    gen = torch.Generator().manual_seed(SEED + 1)
    starts = torch.randint(0, len(stream) - P, (REGEN["prompts"],), generator=gen).tolist()
    prompts = torch.stack([stream[s:s + P] for s in starts])
    t0 = time.perf_counter()
    seqs = []
    for i in range(0, len(prompts), REGEN["batch"]):
        part = prompts[i:i + REGEN["batch"]]
        seqs.append(torch.cat([part, model.greedy(part, N)], 1))
        log(f"regen: {i + len(part)}/{len(prompts)} ({time.perf_counter() - t0:.0f}s)")
    seqs = torch.cat(seqs)
    taps = draft_taps(model)
    with torch.no_grad():  # tap features of the frozen target, computed once and stored in f16
        feats = torch.cat([torch.cat([h[i] for i in taps], -1).half() for h in
                           (model(seqs[i:i + 64])[1] for i in range(0, len(seqs), 64))])
    torch.save({"tokens": seqs, "features": feats, "taps": taps, "prompt_len": P,
                "seconds": time.perf_counter() - t0}, work / "regen.pt")


def draft_taps(target: Target) -> tuple[int, ...]:
    return DraftHParams.spread_taps(target.hp.n_layer, N_TAPS)


def stage_draft(work: Path) -> None:
    seed_all(SEED + 2)
    target = load_target(work)
    for p in target.parameters():
        p.requires_grad_(False)
    data = torch.load(work / "regen.pt")
    tok = load_tokenizer(work)
    hp = DraftHParams(hidden=target.hp.hidden, mask_token_id=tok.token_to_id(MASK), target_layer_ids=data["taps"])
    draft = DFlashDraft(hp, target)
    log(f"draft: {sum(p.numel() for p in draft.parameters() if p.requires_grad) / 1e6:.2f}M trainable parameters, "
        f"taps {hp.target_layer_ids}")
    tokens, feats, P = data["tokens"], data["features"], data["prompt_len"]
    gen = torch.Generator().manual_seed(SEED + 2)

    def loss_fn(step: int) -> torch.Tensor:
        rows = torch.randint(0, len(tokens), (DRAFT["batch"],), generator=gen)
        return draft_loss(draft, tokens[rows], first_anchor=P - 1, n_anchors=DRAFT["anchors"], generator=gen,
                          feats=feats[rows].float())

    secs = fit([p for p in draft.parameters() if p.requires_grad], loss_fn, steps=DRAFT["steps"], lr=DRAFT["lr"],
               warmup=DRAFT["warmup"],
               log=lambda m: log("draft: " + m))
    torch.save({"hp": hp.to_dict(), "state": draft.own_state(), "seconds": secs}, work / "draft.pt")


def stage_export(work: Path, out: Path) -> None:
    meta = json.loads((work / "tokenizer.json").read_text())
    target = load_target(work)
    state = {k: v.numpy() for k, v in target.state_dict().items()}
    out.mkdir(parents=True, exist_ok=True)
    export.write_target(out / "coder-target-q8_0.gguf", state, target.hp.to_dict(), tokenizer=meta)
    ck = torch.load(work / "draft.pt")
    dstate = {k: v.numpy() for k, v in ck["state"].items()}
    export.write_draft(out / "coder-dflash-q8_0.gguf", dstate, hf_config(ck["hp"], target.hp.n_layer),
                       target_cfg=export.target_config(target.hp.to_dict()), tokenizer=meta)
    prompts.write(out / "prompts.json")


STAGES = {"tokenizer": ("tokenizer.json", stage_tokenizer), "target": ("target.pt", stage_target),
          "regen": ("regen.pt", stage_regen), "draft": ("draft.pt", stage_draft), "export": (None, stage_export)}


def run_stages(work: Path, stages: dict[str, tuple[str | None, Callable[[], None]]]) -> None:
    """Run each stage in order unless its output file is already in `work` (a run resumes);
    wall times go to <work>/timings.json."""
    timings_path = work / "timings.json"
    timings = json.loads(timings_path.read_text()) if timings_path.exists() else {}
    for name, (output, run) in stages.items():
        if output and (work / output).exists():
            log(f"{name}: {output} exists, skipped")
            continue
        t0 = time.perf_counter()
        log(f"{name}: start")
        run()
        timings[name] = round(time.perf_counter() - t0, 1)
        timings_path.write_text(json.dumps(timings, indent=1))
        log(f"{name}: done in {timings[name]:.0f}s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m train.run_all", description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, default=ROOT / "build" / "demo-train")
    p.add_argument("--stage", choices=list(STAGES), action="append", help="run only these stages")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=ROOT / "demo", help="where export writes the pair (default demo/)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.work.mkdir(parents=True, exist_ok=True)
    stages = {name: (output, (lambda run=run: run(args.work, args.out)) if name == "export"
                     else (lambda run=run: run(args.work)))
              for name, (output, run) in STAGES.items() if not args.stage or name in args.stage}
    run_stages(args.work, stages)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
