"""Measure a shipped pair on held-out prompts: python -m train.measure [coder|smollm2] [-n 128] [--backend numpy].

Greedy, on the same compiled artifact, per prompt: speculative with n_max proposals every round
(`fixed`: the draft's tau and accepted-per-round histogram), speculative with the default
cost-aware length (what a user gets), and target-only; generation tokens/s of each, and whether
each speculative output is identical to target-only. `coder`: the held-out stdlib function heads of demo/prompts.json, completed to n
tokens, written to demo/measurements.json (demo/README.md quotes it). `smollm2`: the chat
prompts held out from its draft's training (train/chat_prompts.py), answered to the end of
the turn or n tokens, written to demo/smollm2-measurements.json (train/README.md quotes it).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
from collections import Counter
from pathlib import Path

from dflash_ir import demo
from dflash_ir.artifact import compile_pair, load_compiled

from . import chat_prompts

ROOT = Path(__file__).resolve().parents[1]


def coder_requests(folder: Path) -> list[demo.Request]:
    return [demo.Request(p["file"], "held out", prompt=p["text"], ignore_eos=True)
            for p in json.loads((folder / "prompts.json").read_text())]


def smollm2_requests() -> list[demo.Request]:
    return [demo.Request(q, "held out", question=q) for q in chat_prompts.split()["held_out"]]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m train.measure", description=__doc__.splitlines()[0])
    p.add_argument("pair", nargs="?", choices=sorted(demo.PAIRS), default="coder")
    p.add_argument("-n", "--n-predict", type=int, default=128)
    p.add_argument("--backend", default="numpy")
    p.add_argument("--dir", type=Path, default=demo.DEMO_DIR,
                   help="coder: the folder with the pair and prompts.json (default demo/)")
    p.add_argument("--work", type=Path, default=ROOT / "build", help="where the artifact is compiled (default build/)")
    p.add_argument("--prompts", type=int, default=None,
                   help="only the first N held-out prompts (smollm2: 54 are the first prompt set's)")
    p.add_argument("--draft", type=Path, default=None, help="smollm2: another draft GGUF for the target")
    p.add_argument("-o", "--out", type=Path, default=None, help="the JSON to write (default: the pair's, above)")
    args = p.parse_args(argv)
    if args.pair == "coder":
        coder = demo.PAIRS["coder"]
        target, draft = args.dir / coder.target().name, args.dir / coder.draft.name
        requests, written = coder_requests(args.dir), args.dir / "measurements.json"
    else:
        target, draft = demo.pair_files(demo.PAIRS[args.pair])
        draft = args.draft or draft
        requests, written = smollm2_requests(), demo.DEMO_DIR / "smollm2-measurements.json"
    requests, written = requests[:args.prompts], args.out or written
    out = args.work / f"measure-{args.pair}-{args.backend}-{draft.stem}"
    compile_pair(target, draft, out=out, backend=args.backend, n_ctx=demo.PAIRS[args.pair].n_ctx)
    engine = load_compiled(out)
    modes = {"fixed": dict(adaptive=False), "spec": {}, "target": dict(speculative=False)}
    rows, hist, tokens, seconds = [], Counter(), Counter(), Counter()
    for request in requests:
        runs = {mode: engine.generate(max_tokens=args.n_predict, **kw, **request.kwargs()) for mode, kw in modes.items()}
        for mode, run in runs.items():
            tokens[mode] += run.stats.generated_tokens
            seconds[mode] += run.stats.generate_seconds
        fixed, plain = runs["fixed"], runs["target"]
        hist.update(fixed.stats.accept_hist)
        identical = all(runs[mode].tokens == plain.tokens for mode in ("fixed", "spec"))
        rows.append({"prompt": request.label, "tau": round(fixed.stats.tau, 2), "identical": identical,
                     "tokens": plain.stats.generated_tokens,
                     **{f"{mode}_tps": round(run.stats.generate_tps, 1) for mode, run in runs.items()},
                     "accept_hist": dict(sorted(fixed.stats.accept_hist.items())), "text": plain.text})
        print(f"{request.label[:56]:56s} tau {fixed.stats.tau:5.2f}  tok/s: fixed {fixed.stats.generate_tps:6.1f}  "
              f"cost-aware {runs['spec'].stats.generate_tps:6.1f}  target {plain.stats.generate_tps:6.1f}  "
              f"identical {identical}", flush=True)
    tps = {mode: tokens[mode] / seconds[mode] for mode in modes}
    rounds = sum(hist.values())
    summary = {
        "pair": args.pair, "draft": draft.name,
        "draft_head": "the target's" if engine.draft.vocab is None else f"{len(engine.draft.vocab)} tokens (d2t)",
        "backend": args.backend, "n_predict": args.n_predict, "machine": f"{platform.machine()}, "
        f"{platform.python_implementation()} {platform.python_version()}, "
        f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}",
        "tau_mean": round(sum(k * v for k, v in hist.items()) / rounds + 1, 2),
        "accept_hist": dict(sorted(hist.items())),
        **{f"{mode}_tps": round(v, 1) for mode, v in tps.items()},
        "speedup": round(tps["spec"] / tps["target"], 2), "speedup_fixed": round(tps["fixed"] / tps["target"], 2),
        "all_identical": all(r["identical"] for r in rows), "prompts": rows,
    }
    written.write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "prompts"}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
