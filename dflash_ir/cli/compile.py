"""`dflash-compile TARGET.gguf [DRAFT.gguf] -o OUT/ [--backend B]`: GGUF pair -> artifact."""
from __future__ import annotations

import argparse
import sys
import time

from dflash_ir.artifact import DEFAULT_CTX, DEFAULT_N_MAX, compile_pair
from dflash_ir.backends.base import BackendUnavailable
from dflash_ir.backends.toolchain import CompileError
from dflash_ir.errors import DflashError
from dflash_ir.models.checks import MAX_BLOCK_SIZE, MAX_POSITIONS
from dflash_ir.models.metadata import TARGET_ARCHS
from dflash_ir.passes.quantize_activations import NUMERICS

from .args import add_quiet, integer, progress_printer

TUNE_S = 600.0  # --tune without SECONDS


def add_compile_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-c", "--ctx-size", type=integer(0, MAX_POSITIONS), default=None,
                   help=f"context size in tokens, 0 = the model's trained context (default {DEFAULT_CTX})")
    p.add_argument("--backend", default="auto", help="numpy, opencl, vulkan, cuda, rocm, tvm-llvm, tvm-opencl, tvm-cuda, tvm-rocm, or auto: CUDA with a "
                        "GPU, else Vulkan on a GPU, else OpenCL, else numpy (default auto)")
    p.add_argument("--spec-draft-n-max", type=integer(0, MAX_BLOCK_SIZE - 1), default=None,
                   help=f"proposals per round, at most the draft's block size - 1; 0 = no drafting "
                        f"(default {DEFAULT_N_MAX}, or block size - 1 when smaller)")
    p.add_argument("-O", dest="opt_level", type=int, choices=(0, 1, 2), default=None,
                   help="optimisation level: 0 graphs as built, 1 canonicalise, 2 all passes "
                        "(default: the backend's, 0 for numpy, 2 for kernel backends)")
    p.add_argument("--numerics", choices=NUMERICS, default=None,
                   help="exact: f32 activations (matches Transformers within 3e-4); q8: activations quantised "
                        "to Q8_0 for the block-quantised weights' products, exact integer block sums, as "
                        "llama.cpp's CPU path (default: $DFLASH_IR_NUMERICS, else the device's: q8 on a CPU "
                        "OpenCL device with AVX-512 VNNI, exact elsewhere)")
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
    p.add_argument("target", help=f"target model GGUF ({' / '.join(TARGET_ARCHS)})")
    p.add_argument("draft", nargs="?", help="DFlash draft GGUF (arch dflash); omit for a target-only artifact")
    p.add_argument("-o", "--output", required=True, help="artifact folder to write")
    p.add_argument("--tune", nargs="?", const=TUNE_S, type=float, default=None, metavar="SECONDS",
                   help=f"tvm-llvm: tune the program's kernels with MetaSchedule for about SECONDS (default {TUNE_S:g}); "
                        "records are cached and reused by later compiles")
    add_compile_args(p)
    add_quiet(p)
    args = p.parse_args(argv)
    say = progress_printer("dflash-compile", args.quiet)
    t0 = time.perf_counter()
    try:
        out = compile_pair(args.target, args.draft, out=args.output, backend=resolve_backend(args.backend),
                           n_ctx=DEFAULT_CTX if args.ctx_size is None else args.ctx_size,
                           n_max=args.spec_draft_n_max, opt_level=args.opt_level,
                           numerics=args.numerics, dump_dir=args.dump_ir, tune_s=args.tune,
                           progress=say)
    except (DflashError, ValueError, OSError, BackendUnavailable, CompileError) as e:
        print(f"dflash-compile: error: {e}", file=sys.stderr)
        return 1
    say(f"done in {time.perf_counter() - t0:.1f}s -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
