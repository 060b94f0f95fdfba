"""The optimisation pipeline: ordered passes, optimisation levels, verification and dumps.

    -O0  the graph as built
    -O1  canonicalise
    -O2  canonicalise, fuse_attention, fuse_moe, fuse_gated_deltanet, specialise_matmul,
         fuse_elementwise, group_matmuls, fuse_matmul, canonicalise   (the default)

Memory is planned after the pipeline, at the end of lowering (passes/plan_memory.py: the
buffers of a call are only known once views, in-place writes and temporaries are decided).

Numerics `q8` (default `exact`) adds quantize_activations after group_matmuls (after
specialise_matmul at levels below 2): Q8_0 products take Q8_0 activations, as llama.cpp's CPU
path does. `only` keeps just the named passes of the level, `skip` drops named ones. The graph is
verified after every pass. With `dump_dir`, DIR/<graph name>/NN-<pass>.txt (the printer's
text form, which parse_graph reads back) and .dot are written for the input (00-input)
and after each pass, plus .png when graphviz's `dot` is installed.
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable, Iterable

from dflash_ir.ir import Graph
from dflash_ir.printer import format_graph
from dflash_ir.verifier import VerifyError, verify
from dflash_ir.visualize import render, to_dot

from .canonicalise import canonicalise
from .fuse_attention import fuse_attention
from .fuse_elementwise import fuse_elementwise
from .fuse_gated_deltanet import fuse_gated_deltanet
from .fuse_matmul import fuse_matmul
from .fuse_moe import fuse_moe
from .group_matmuls import group_matmuls
from .quantize_activations import NUMERICS, quantize_activations
from .specialise_matmul import specialise_matmul

Pass = Callable[[Graph], Graph]
PASSES: tuple[Pass, ...] = (canonicalise, fuse_attention, fuse_moe, fuse_gated_deltanet, specialise_matmul,
                            fuse_elementwise, group_matmuls, fuse_matmul, canonicalise)
LEVELS: dict[int, tuple[Pass, ...]] = {0: (), 1: (canonicalise,), 2: PASSES}
DEFAULT_LEVEL = 2
PASS_NAMES = tuple(dict.fromkeys(p.__name__ for p in PASSES + (quantize_activations,)))


def with_numerics(passes: tuple[Pass, ...], numerics: str) -> tuple[Pass, ...]:
    if numerics not in NUMERICS:
        raise ValueError(f"numerics must be one of {', '.join(NUMERICS)}, got {numerics!r}")
    if numerics == "exact":
        return passes
    if group_matmuls in passes:
        at = passes.index(group_matmuls) + 1
        return passes[:at] + (quantize_activations,) + passes[at:]
    return passes + (specialise_matmul, quantize_activations)


def select(level: int = DEFAULT_LEVEL, only: Iterable[str] | None = None, skip: Iterable[str] = (),
           numerics: str = "exact") -> list[Pass]:
    """The passes run at `level` under `numerics`, restricted to `only` and without `skip`."""
    if level not in LEVELS:
        raise ValueError(f"optimisation level must be one of {sorted(LEVELS)}, got {level!r}")
    only = None if only is None else set(only)
    skip = set(skip)
    unknown = ((only or set()) | skip) - set(PASS_NAMES)
    if unknown:
        raise ValueError(f"unknown pass(es) {', '.join(sorted(unknown))}; passes: {', '.join(PASS_NAMES)}")
    return [p for p in with_numerics(LEVELS[level], numerics)
            if (only is None or p.__name__ in only) and p.__name__ not in skip]


class Dumper:
    """Writes DIR/stem.{txt,dot[,png]}; a picture equal to the previous one is copied, not redrawn
    (graphviz layout is the slow part of a dump)."""

    def __init__(self, directory: Path):
        self.directory = directory
        self._last: tuple[str, Path] | None = None  # (dot text, picture)

    def write(self, graph: Graph, stem: str) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / f"{stem}.txt").write_text(format_graph(graph))
        dot = to_dot(graph)
        (self.directory / f"{stem}.dot").write_text(dot)
        if shutil.which("dot") is None:
            return
        png = self.directory / f"{stem}.png"
        if self._last is not None and self._last[0] == dot:
            shutil.copyfile(self._last[1], png)
        else:
            render(graph, png)
        self._last = (dot, png)


def run_pipeline(graph: Graph, *, level: int = DEFAULT_LEVEL, only: Iterable[str] | None = None,
                 skip: Iterable[str] = (), dump_dir: str | Path | None = None, numerics: str = "exact") -> Graph:
    passes = select(level, only, skip, numerics)
    dumper = None if dump_dir is None else Dumper(Path(dump_dir) / graph.name)
    if dumper is not None:
        dumper.write(graph, "00-input")
    for i, p in enumerate(passes, 1):
        try:
            graph = verify(p(graph))
        except VerifyError as e:
            raise VerifyError(f"after pass {p.__name__}: {e}") from None
        if dumper is not None:
            dumper.write(graph, f"{i:02d}-{p.__name__}")
    return graph
