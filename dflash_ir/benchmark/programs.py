"""A graph compiled and loaded on a backend the way `dflash-compile` would (its default pass
pipeline, its own compile and load), as a call that runs the kernels and waits."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Callable, Mapping

import numpy as np

from dflash_ir.ir import Graph
from dflash_ir.passes.pipeline import run_pipeline
from dflash_ir.passes.plan_memory import REPLAYED


def single_graph_runner(backend, graph: Graph, weights: Mapping[str, np.ndarray], inputs: Mapping[str, np.ndarray],
                        states: Mapping[str, np.ndarray], work_dir: Path, numerics: str = "exact") -> Callable[[], object]:
    """Inputs and states are uploaded once; each call launches every kernel and waits for the
    device (kernel backends), or evaluates the graph (the interpreter). `numerics`: the
    pipeline's mode, as dflash-compile's. The graph is compiled as `replayed`, so that no
    kernel writes over an input a later replay reads (a q8 decode product's quantised x
    would take the slot of the x before it)."""
    graph = replace(graph, meta=graph.meta + ((REPLAYED, True),))
    graph = run_pipeline(graph, level=backend.default_opt_level, numerics=numerics)
    work_dir = Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    program = backend.load(graph, backend.compile(graph, work_dir), work_dir, lambda w: weights[w.tensor])
    if hasattr(program, "launcher"):
        return program.launcher(inputs, states)
    return lambda: program.run(inputs, states)
