"""Measure the shipped pair on held-out prompts: python -m train.measure [-n 128] [--backend numpy].

Greedy, speculative vs target-only on the same compiled artifact: per prompt tau, the
accepted-per-round histogram, generation tokens/s of both modes and whether the outputs are
identical. Writes demo/measurements.json; demo/README.md quotes it.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
from collections import Counter
from pathlib import Path

from dflash_ir.artifact import compile_pair, load_compiled

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "demo"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m train.measure", description=__doc__.splitlines()[0])
    p.add_argument("-n", "--n-predict", type=int, default=128)
    p.add_argument("--backend", default="numpy")
    p.add_argument("--pair", type=Path, default=DEMO, help="folder with the pair and prompts.json (default demo/)")
    args = p.parse_args(argv)
    out = ROOT / "build" / f"demo-measure-{args.backend}"
    compile_pair(args.pair / "coder-target-q8_0.gguf", args.pair / "coder-dflash-q8_0.gguf", out=out, backend=args.backend,
                 n_ctx=512)
    engine = load_compiled(out)
    rows, hist = [], Counter()
    spec_tok = spec_s = plain_tok = plain_s = 0.0
    for prompt in json.loads((args.pair / "prompts.json").read_text()):
        spec = engine.generate(prompt["text"], max_tokens=args.n_predict, ignore_eos=True)
        plain = engine.generate(prompt["text"], max_tokens=args.n_predict, ignore_eos=True, speculative=False)
        s, t = spec.stats, plain.stats
        hist.update(s.accept_hist)
        spec_tok, spec_s = spec_tok + s.generated_tokens, spec_s + s.generate_seconds
        plain_tok, plain_s = plain_tok + t.generated_tokens, plain_s + t.generate_seconds
        rows.append({"file": prompt["file"], "tau": round(s.tau, 2), "identical": spec.tokens == plain.tokens,
                     "spec_tps": round(s.generate_tps, 1), "target_tps": round(t.generate_tps, 1),
                     "accept_hist": dict(sorted(s.accept_hist.items())), "text": spec.text})
        print(f"{prompt['file']:40s} tau {s.tau:5.2f}  spec {s.generate_tps:6.1f} tok/s  target {t.generate_tps:6.1f} "
              f"tok/s  identical {spec.tokens == plain.tokens}", flush=True)
    rounds = sum(hist.values())
    summary = {
        "backend": args.backend, "n_predict": args.n_predict, "machine": f"{platform.machine()}, "
        f"{platform.python_implementation()} {platform.python_version()}, "
        f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}",
        "tau_mean": round(sum(k * v for k, v in hist.items()) / rounds + 1, 2),
        "accept_hist": dict(sorted(hist.items())),
        "spec_tps": round(spec_tok / spec_s, 1), "target_tps": round(plain_tok / plain_s, 1),
        "speedup": round((spec_tok / spec_s) / (plain_tok / plain_s), 2),
        "all_identical": all(r["identical"] for r in rows), "prompts": rows,
    }
    (args.pair / "measurements.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "prompts"}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
