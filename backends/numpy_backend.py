"""The reference backend: programs run on the IR interpreter (numpy)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from dflash_ir.interpreter import Interpreter
from dflash_ir.ir import Graph
from dflash_ir.program import WeightLoader

from .base import Backend, register_backend


@register_backend
class NumpyBackend(Backend):
    name = "numpy"
    default_opt_level = 0

    def device_is_cpu(self) -> bool:
        return True

    def compile(self, graph: Graph, out_dir: Path) -> dict[str, Any]:
        return {"kernels": []}

    def load(self, graph: Graph, entry: Mapping[str, Any], artifact_dir: Path, weights: WeightLoader) -> Interpreter:
        return Interpreter(graph, weights)
