"""The main job (`make demo`): compile a target + DFlash draft pair for the best backend present,
generate with speculative decoding, and compare with target-only decoding.

The default pair is the shipped demo pair in demo/ (a small qwen35 coder target trained on the
Python standard library and its DFlash draft, see demo/README.md), prompted with the head of a
function from a held-out stdlib file. Any other pair runs the same way through
`dflash-run -m TARGET.gguf -md DRAFT.gguf` (text, then the same stats).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dflash_ir.artifact import compile_pair, load_compiled
from dflash_ir.cache import cache_dir
from dflash_ir.cli.compile import resolve_backend
from dflash_ir.runtime.sampling import SamplingParams

DEMO_DIR = Path(__file__).resolve().parents[1] / "demo"
CODER = (DEMO_DIR / "coder-target-q8_0.gguf", DEMO_DIR / "coder-dflash-q8_0.gguf")


def heldout_prompt() -> tuple[str, str]:
    """(text, source file) of the first held-out code prompt shipped with the demo pair."""
    first = json.loads((DEMO_DIR / "prompts.json").read_text())[0]
    return first["text"], first["file"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dflash_ir.demo", description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="auto")
    p.add_argument("-n", "--n-predict", type=int, default=96)
    p.add_argument("-p", "--prompt", help="default: a held-out stdlib function head")
    args = p.parse_args(argv)

    target, draft = CODER
    if not (target.is_file() and draft.is_file()):
        raise SystemExit(f"demo: the shipped pair {target.name} / {draft.name} is missing from {DEMO_DIR}; "
                         f"retrain it with `make train-demo`")
    prompt, origin = args.prompt, "given"
    if prompt is None:
        prompt, origin = heldout_prompt()
        origin = f"held out from training: {origin}"
    backend = resolve_backend(args.backend)
    print(f"demo: shipped demo pair 'coder' (qwen35 target trained on the Python stdlib + its DFlash draft)\n"
          f"demo: target {target}\ndemo: draft  {draft}\ndemo: backend {backend}\n"
          f"demo: prompt ({origin})", flush=True)
    out = cache_dir("demo") / f"coder-{backend}"
    compile_pair(target, draft, out=out, backend=backend, n_ctx=512,
                 progress=lambda msg: print(f"dflash-compile: {msg}", flush=True))
    engine = load_compiled(out)
    for speculative in (True, False):  # warm-up: some backends compile kernels on first use
        engine.generate(prompt, max_tokens=4, speculative=speculative, ignore_eos=True)

    runs, texts = {}, {}
    for mode, speculative in (("speculative", True), ("target-only", False)):
        print(f"\n=== {mode}: completion ===\n{prompt}", end="", flush=True)
        pieces = []
        for piece in engine.stream(prompt, max_tokens=args.n_predict, speculative=speculative, ignore_eos=True,
                                   sampling=SamplingParams()):
            pieces.append(piece)
            print(piece, end="", flush=True)
        runs[mode], texts[mode] = engine.last_stats, "".join(pieces)
        print(f"\n--- stats ---\n{runs[mode].summary()}")
    chat = engine.generate(messages=[{"role": "user", "content": "What is 17 * 23?"}], enable_thinking=False,
                           max_tokens=args.n_predict, ignore_eos=True)
    print(f"\n=== speculative: chat (thinking off) ===\n{chat.text}\n--- stats ---\n{chat.stats.summary()}")

    spec, plain = runs["speculative"], runs["target-only"]
    same = "identical" if texts["speculative"] == texts["target-only"] else "DIFFERENT (a bug)"
    print(f"\ndemo: speculative output is {same} to target-only (greedy)")
    print(f"demo: tau {spec.tau:.2f}; speculative {spec.generate_tps:.1f} tok/s vs target-only "
          f"{plain.generate_tps:.1f} tok/s = {spec.generate_tps / max(plain.generate_tps, 1e-9):.2f}x on {backend}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
