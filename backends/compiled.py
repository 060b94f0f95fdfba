"""What the opencl, cuda and rocm backends share: lower a graph once, print its kernels in
the backend's dialect, store the source (named by its hash, so programs with the same
kernels share one file and one build) and the launch plan; load = plan + device + weights."""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Mapping

from dflash_ir.ir import Graph
from dflash_ir.program import WeightLoader

from .base import Backend
from .kir.build import FUNCTIONS
from .kir.c import PRINTERS
from .lowering import lower
from .plan import Plan
from .runner import DeviceProgram, Resident


class CompiledBackend(Backend):
    dialect = ""

    def __init__(self):
        self._resident = Resident()

    def write_source(self, graph: Graph, out_dir: Path) -> tuple[Plan, str, Path]:
        """Lower and render `graph`; returns the plan, the source and its path in out_dir."""
        plan = lower(graph)
        dialect = PRINTERS[self.dialect]
        source = dialect.render(plan.kernels.values(), tuple(FUNCTIONS.values()))
        digest = hashlib.sha256(source.encode()).hexdigest()[:16]
        path = Path(out_dir) / "kernels" / f"{self.dialect}-{digest}.{dialect.extension}"
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            path.write_text(source)
        return plan, source, path

    def build_files(self, source: str, path: Path) -> dict[str, Any]:
        """Compile the source into device binaries next to it; returns their manifest fields."""
        return {}

    def compile(self, graph: Graph, out_dir: Path) -> dict[str, Any]:
        plan, source, path = self.write_source(graph, out_dir)
        return {"dialect": self.dialect, "source": str(path.relative_to(out_dir)),
                **self.build_files(source, path), "plan": plan.to_dict()}

    def device_for(self, entry: Mapping[str, Any], artifact_dir: Path):
        """A device (see runner.Device) holding the entry's kernels."""
        raise NotImplementedError

    def load(self, graph: Graph, entry: Mapping[str, Any], artifact_dir: Path, weights: WeightLoader) -> DeviceProgram:
        self.require()
        device = self.device_for(entry, Path(artifact_dir))
        return DeviceProgram(graph, Plan.from_dict(entry["plan"]), device, weights, self._resident)
