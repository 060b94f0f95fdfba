"""`dflash-compile TARGET.gguf [DRAFT.gguf] -o OUT/ [--backend B]`: GGUF pair -> artifact."""
from __future__ import annotations

import argparse
import sys
import time

from dflash_ir.artifact import DEFAULT_CTX, compile_pair
from dflash_ir.backends.base import BackendUnavailable
from dflash_ir.backends.toolchain import CompileError
from dflash_ir.errors import DflashError


def add_compile_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-c", "--ctx-size", type=int, default=DEFAULT_CTX, help=f"context size in tokens (default {DEFAULT_CTX})")
    p.add_argument("--backend", default="auto", help="numpy, opencl, vulkan, cuda, rocm, tvm-llvm, tvm-opencl, tvm-cuda, tvm-rocm, or auto: CUDA with a "
                        "GPU, else Vulkan on a GPU, else OpenCL, else numpy (default auto)")
    p.add_argument("--spec-draft-n-max", type=int, default=15, help="default number of proposals per round (default 15)")
    p.add_argument("-O", dest="opt_level", type=int, choices=(0, 1, 2), default=None,
                   help="optimisation level: 0 graphs as built, 1 canonicalise, 2 all passes "
                        "(default: the backend's, 0 for numpy, 2 for kernel backends)")
    p.add_argument("--dump-ir", metavar="DIR", help="write every graph's IR (text + picture) after each pass under DIR")


def resolve_backend(name: str) -> str:
    """`auto` picks the best backend that can run here: CUDA, Vulkan on a GPU, OpenCL (a GPU,
    else PoCL on the CPU), the interpreter."""
    if name != "auto":
        return name
    from dflash_ir.backends.base import get_backend, known_backends

    for candidate, cpu_too in (("cuda", True), ("vulkan", False), ("opencl", True)):
        backend = get_backend(candidate) if candidate in known_backends() else None
        if backend and backend.unavailable_reason() is None and (cpu_too or not backend.device_is_cpu()):
            return candidate
    return "numpy"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dflash-compile", description="Compile a target GGUF and its DFlash draft GGUF "
                                "into a dflash-ir artifact.")
    p.add_argument("target", help="target model GGUF (qwen35 / qwen35moe)")
    p.add_argument("draft", nargs="?", help="DFlash draft GGUF (arch dflash); omit for a target-only artifact")
    p.add_argument("-o", "--output", required=True, help="artifact folder to write")
    add_compile_args(p)
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    try:
        out = compile_pair(args.target, args.draft, out=args.output, backend=resolve_backend(args.backend),
                           n_ctx=args.ctx_size, n_max=args.spec_draft_n_max, opt_level=args.opt_level,
                           dump_dir=args.dump_ir,
                           progress=lambda msg: print(f"dflash-compile: {msg}", file=sys.stderr, flush=True))
    except (DflashError, ValueError, OSError, BackendUnavailable, CompileError) as e:
        print(f"dflash-compile: error: {e}", file=sys.stderr)
        return 1
    print(f"dflash-compile: done in {time.perf_counter() - t0:.1f}s -> {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
