"""What the optimisation pipeline does to a model pair: op counts and activation memory.

    python -m dflash_ir.passes.report TARGET.gguf [DRAFT.gguf] [-O 2] [--rows 16] [--prefill-rows 512] [--ctx 4096]
                                      [--profile gpu|cpu]

prints, for the target verify graph and the draft block graph, the count of every op as
built (-O0) and after the pipeline at -O N, the total, and the kernels (ops other than
reshape, which is a view); then the memory of a call of the optimised target verify
(`--rows` rows) and prefill (`--prefill-rows` rows) graphs lowered for `--profile`: with
every buffer (input, activation, temporary) on its own, with the slots of the plan's memory
plan (passes/plan_memory.py: what the runner allocates), and the states' slots.
"""
from __future__ import annotations

import argparse
import sys

from dflash_ir.artifact import DEFAULT_CTX, open_pair
from dflash_ir.backends.lowering import PROFILES, lower
from dflash_ir.ir import Graph

from .pipeline import DEFAULT_LEVEL, LEVELS, run_pipeline
from .plan_memory import memory

COUNTED = ("target.verify", "draft.block")
VIEWS = ("reshape",)


def kernels(graph: Graph) -> int:
    return sum(n.op not in VIEWS for n in graph.nodes)


def op_table(name: str, before: Graph, after: Graph, level: int) -> str:
    b, a = before.op_counts(), after.op_counts()
    lines = [f"{name}: ops -O0 -> -O{level}", f"  {'op':<18}{'-O0':>6}{f'-O{level}':>6}"]
    lines += [f"  {op:<18}{b.get(op, 0):>6}{a.get(op, 0):>6}" for op in sorted(b.keys() | a.keys())]
    lines.append(f"  {'total':<18}{len(before.nodes):>6}{len(after.nodes):>6}")
    lines.append(f"  {'kernels':<18}{kernels(before):>6}{kernels(after):>6}")
    return "\n".join(lines)


def memory_line(name: str, graph: Graph, bindings: dict[str, int], profile: str) -> str:
    own, planned, states = memory(graph, lower(graph, profile), bindings)
    shown = ", ".join(f"{k}={v}" for k, v in sorted(bindings.items()))
    return (f"  {name:<16} ({shown}): own buffers {own / 2**20:9.3f} MiB, planned {planned / 2**20:9.3f} MiB "
            f"({planned / own:.0%}), states {states / 2**20:9.3f} MiB")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dflash_ir.passes.report", description=__doc__.split("\n\n")[0])
    p.add_argument("target", help="target GGUF")
    p.add_argument("draft", nargs="?", help="DFlash draft GGUF")
    p.add_argument("-O", dest="level", type=int, choices=sorted(LEVELS), default=DEFAULT_LEVEL)
    p.add_argument("--rows", type=int, default=16, help="verify rows T (default 16)")
    p.add_argument("--prefill-rows", type=int, default=512, help="prefill rows T (default 512)")
    p.add_argument("--ctx", type=int, default=DEFAULT_CTX, help=f"context (cache rows C, default {DEFAULT_CTX})")
    p.add_argument("--profile", choices=PROFILES, default="gpu", help="device profile lowered for (default gpu)")
    args = p.parse_args(argv)
    pair = open_pair(args.target, args.draft, opt_level=0)
    optimised = {name: run_pipeline(g, level=args.level) for name, g in pair.graphs.items()}
    for name in COUNTED:
        if name in pair.graphs:
            print(op_table(name, pair.graphs[name], optimised[name], args.level), end="\n\n")
    print(f"memory of a call at -O{args.level}, {args.profile} profile:")
    for name, bindings in (("target.verify", {"T": args.rows, "R": args.rows, "C": args.ctx}),
                           ("target.prefill", {"T": args.prefill_rows, "R": 1, "C": args.ctx})):
        print(memory_line(name, optimised[name], bindings, args.profile))
    return 0


if __name__ == "__main__":
    sys.exit(main())
