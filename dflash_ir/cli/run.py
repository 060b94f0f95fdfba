"""`dflash-run`: generate with DFlash speculative decoding, flags as in llama.cpp.

    dflash-run -m target.gguf -md draft.gguf -p "def fib(n):" -n 64
    dflash-run --artifact OUT/ --jinja -p "What is 17 * 23?" --no-think
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from dflash_ir.errors import DflashError
from dflash_ir.integrity import SOURCE_CHECKS
from dflash_ir.runtime.sampling import SamplingParams

from .args import add_quiet, argument_text, digest, file_text, integer, number, progress_printer
from .compile import add_compile_args, resolve_backend


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dflash-run", description="Generate text with DFlash speculative decoding.")
    src = p.add_argument_group("model")
    src.add_argument("-m", "--model", help="target GGUF (compiled on the fly into --artifact or a temp folder)")
    src.add_argument("-md", "--model-draft", help="DFlash draft GGUF")
    src.add_argument("--artifact", help="artifact folder from dflash-compile (or where to write one with -m)")
    add_compile_args(src)
    src.add_argument("--artifact-digest", type=digest, help="refuse an artifact whose root digest (printed by "
                     "dflash-compile) is not this one")
    src.add_argument("--verify-sources", choices=SOURCE_CHECKS, default="fast",
                     help="how the source GGUFs are checked: fast hashes them when their size, times or inode "
                          "changed; strict hashes them at every load (~13 s per 10 GB) (default fast)")
    gen = p.add_argument_group("generation")
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("-p", "--prompt", help="prompt text (the user message with --jinja)")
    prompt.add_argument("-f", "--file", help="read the prompt from this file (UTF-8)")
    gen.add_argument("-n", "--n-predict", type=integer(-1), default=128,
                     help="tokens to generate; -1 = until end of generation or the context is full, 0 = none "
                          "(the prompt is only read) (default 128)")
    gen.add_argument("--jinja", action="store_true", help="apply the model's chat template to the prompt")
    gen.add_argument("-sys", "--system-prompt", help="system message (with --jinja)")
    gen.add_argument("--no-think", action="store_true", help="chat with thinking disabled (enable_thinking=false)")
    gen.add_argument("--temp", type=number(0), default=0.0, help="temperature, 0 = greedy (default 0)")
    gen.add_argument("--top-k", type=integer(0), default=40, help="0 = off (default 40)")
    gen.add_argument("--top-p", type=number(0, 1, low_open=True), default=0.95, help="in (0, 1], 1 = off (default 0.95)")
    gen.add_argument("--min-p", type=number(0, 1, high_open=True), default=0.05, help="in [0, 1), 0 = off (default 0.05)")
    gen.add_argument("--seed", type=integer(-1, 2**63 - 1), default=-1, help="-1 = random (default -1)")
    gen.add_argument("--no-spec", action="store_true", help="target only (no draft), for comparison")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--stats-json", help="write the generation stats to this JSON file")
    add_quiet(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from dflash_ir.artifact import DEFAULT_CTX, compile_pair, load_compiled

    say = progress_printer("dflash-run", args.quiet)
    try:
        prompt = file_text(args.file, "-f") if args.file is not None else argument_text(args.prompt, "-p")
        system = argument_text(args.system_prompt, "-sys") if args.system_prompt else None
        if args.model:
            out = Path(args.artifact or tempfile.mkdtemp(prefix="dflash-ir-"))
            compile_pair(args.model, args.model_draft, out=out, backend=resolve_backend(args.backend),
                         n_ctx=DEFAULT_CTX if args.ctx_size is None else args.ctx_size,
                         n_max=args.spec_draft_n_max, opt_level=args.opt_level,
                         numerics=args.numerics, dump_dir=args.dump_ir,
                         progress=say)
        elif args.artifact:
            out = Path(args.artifact)
            if args.ctx_size is not None:
                print("dflash-run: error: -c applies when compiling (with -m); an artifact keeps the context it "
                      "was compiled for (dflash-compile -c N)", file=sys.stderr)
                return 2
        else:
            print("dflash-run: error: give -m TARGET.gguf [-md DRAFT.gguf] or --artifact DIR", file=sys.stderr)
            return 2
        engine = load_compiled(out, n_max=args.spec_draft_n_max, digest=args.artifact_digest,
                               sources=args.verify_sources, progress=say)
        kw = dict(max_tokens=engine.n_ctx if args.n_predict == -1 else args.n_predict,
                  speculative=not args.no_spec and engine.draft is not None and engine.n_max > 0,
                  ignore_eos=args.ignore_eos,
                  sampling=SamplingParams(args.temp, args.top_k, args.top_p, args.min_p,
                                          None if args.seed == -1 else args.seed))
        if args.jinja:
            messages = ([{"role": "system", "content": system}] if system else [])
            messages.append({"role": "user", "content": prompt})
            pieces = engine.stream(messages=messages, enable_thinking=not args.no_think, **kw)
        else:
            print(prompt, end="", flush=True)
            pieces = engine.stream(prompt, **kw)
        for piece in pieces:
            print(piece, end="", flush=True)
        print()
        stats = engine.last_stats
        if not args.quiet:
            print("\n" + stats.summary(), file=sys.stderr)
        if args.stats_json:
            Path(args.stats_json).write_text(json.dumps(stats.to_dict(), indent=2))
    except (DflashError, ValueError, OSError) as e:
        print(f"dflash-run: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
