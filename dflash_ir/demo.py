"""The main job (`make demo`): compile a target + DFlash draft pair for the best backend present,
generate with speculative decoding, and compare with target-only decoding.

The default pair is the shipped demo pair in demo/ (a small qwen35 coder target trained on the
Python standard library and its DFlash draft, see demo/README.md), prompted with the head of a
function from a held-out stdlib file. `--kind dense|moe` uses the oracle fixture pair in
../shared/fixtures instead (tiny random-weight models whose draft was trained on their own
outputs: the text is gibberish by design, acceptance is real); without the fixtures, a random
pair is generated (acceptance then stays near zero).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from dflash_ir.artifact import compile_pair, load_compiled
from dflash_ir.cli.compile import resolve_backend
from dflash_ir.fixtures import FixtureError, OracleFixtures, cache_root
from dflash_ir.runtime.sampling import SamplingParams

DEMO_DIR = Path(__file__).resolve().parents[1] / "demo"
CODER = (DEMO_DIR / "coder-target-q8_0.gguf", DEMO_DIR / "coder-dflash-q8_0.gguf")
FIXTURE_PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'


def demo_pair(kind: str) -> tuple[Path, Path, str]:
    if kind == "coder":
        if not all(p.is_file() for p in CODER):
            raise SystemExit(f"demo: the shipped pair {CODER[0].name} / {CODER[1].name} is missing from {DEMO_DIR}; "
                             f"retrain it with `make train-demo`, or use --kind dense")
        return *CODER, "shipped demo pair 'coder' (qwen35 target trained on the Python stdlib + its DFlash draft)"
    try:
        fx = OracleFixtures()
        return (fx.gguf(f"{kind}/gguf/{kind}-target-f16.gguf"), fx.gguf(f"{kind}/gguf/{kind}-dflash-f16.gguf"),
                f"oracle fixture pair '{kind}' (random weights, draft trained on the target's outputs)")
    except FixtureError as e:
        from dflash_ir.models.generator import tiny_draft_config, tiny_target_config, write_draft, write_target

        d = Path(tempfile.mkdtemp(prefix="dflash-ir-demo-"))
        tcfg = tiny_target_config("qwen35moe" if kind == "moe" else "qwen35")
        write_target(d / "target.gguf", tcfg, dtype="q8_0")
        write_draft(d / "draft.gguf", tiny_draft_config(tcfg), target_cfg=tcfg, dtype="f16")
        return d / "target.gguf", d / "draft.gguf", f"a generated random pair ({e})"


def heldout_prompt() -> tuple[str, str]:
    """(text, source file) of the first held-out code prompt shipped with the demo pair."""
    first = json.loads((DEMO_DIR / "prompts.json").read_text())[0]
    return first["text"], first["file"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dflash_ir.demo", description=__doc__.splitlines()[0])
    p.add_argument("--kind", choices=["coder", "dense", "moe"], default="coder")
    p.add_argument("--backend", default="auto")
    p.add_argument("-n", "--n-predict", type=int, default=96)
    p.add_argument("-p", "--prompt", help="default: a held-out stdlib function head (coder), else a fibonacci head")
    args = p.parse_args(argv)

    target, draft, what = demo_pair(args.kind)
    prompt, origin = args.prompt, "given"
    if prompt is None:
        prompt, origin = heldout_prompt() if args.kind == "coder" else (FIXTURE_PROMPT, "built in")
        origin = f"held out from training: {origin}" if args.kind == "coder" else origin
    backend = resolve_backend(args.backend)
    print(f"demo: {what}\ndemo: target {target}\ndemo: draft  {draft}\ndemo: backend {backend}\n"
          f"demo: prompt ({origin})", flush=True)
    out = cache_root().parent / "demo" / f"{args.kind}-{backend}"
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
