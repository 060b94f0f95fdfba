"""The main job (`make demo`): compile a target + DFlash draft pair for the best backend present,
generate with speculative decoding, and compare with target-only decoding.

The pair is the oracle fixture pair in ../shared/fixtures (tiny random-weight Qwen3.5 models
whose draft was trained on their own outputs: the text is gibberish by design, acceptance is
real). Without the fixtures, a random pair is generated (acceptance then stays near zero).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from dflash_ir.artifact import compile_pair, load_compiled
from dflash_ir.cli.compile import resolve_backend
from dflash_ir.fixtures import FixtureError, OracleFixtures, cache_root
from dflash_ir.runtime.sampling import SamplingParams


def demo_pair(kind: str) -> tuple[Path, Path, str]:
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dflash_ir.demo", description=__doc__.splitlines()[0])
    p.add_argument("--kind", choices=["dense", "moe"], default="dense")
    p.add_argument("--backend", default="auto")
    p.add_argument("-n", "--n-predict", type=int, default=48)
    p.add_argument("-p", "--prompt", default='def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n')
    args = p.parse_args(argv)

    target, draft, what = demo_pair(args.kind)
    backend = resolve_backend(args.backend)
    print(f"demo: {what}\ndemo: target {target}\ndemo: draft  {draft}\ndemo: backend {backend}", flush=True)
    out = cache_root().parent / "demo" / f"{args.kind}-{backend}"
    compile_pair(target, draft, out=out, backend=backend, n_ctx=512,
                 progress=lambda msg: print(f"dflash-compile: {msg}", flush=True))
    engine = load_compiled(out)

    runs = {}
    for mode, speculative in (("speculative", True), ("target-only", False)):
        print(f"\n=== {mode}: completion ===\n{args.prompt}", end="", flush=True)
        for piece in engine.stream(args.prompt, max_tokens=args.n_predict, speculative=speculative, ignore_eos=True,
                                   sampling=SamplingParams()):
            print(piece, end="", flush=True)
        runs[mode] = engine.last_stats
        print(f"\n--- stats ---\n{runs[mode].summary()}")
    chat = engine.generate(messages=[{"role": "user", "content": "What is 17 * 23?"}], enable_thinking=False,
                           max_tokens=args.n_predict, ignore_eos=True)
    print(f"\n=== speculative: chat (thinking off) ===\n{chat.text}\n--- stats ---\n{chat.stats.summary()}")

    spec, plain = runs["speculative"], runs["target-only"]
    print(f"\ndemo: tau {spec.tau:.2f}; speculative {spec.generate_tps:.1f} tok/s vs target-only "
          f"{plain.generate_tps:.1f} tok/s = {spec.generate_tps / max(plain.generate_tps, 1e-9):.2f}x on {backend}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
