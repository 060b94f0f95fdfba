"""What one speculative round costs on the device an engine runs on, so that the engine can
choose how long to speculate (runtime/controller.py): seconds per target verify of k rows
(k = 1..B: the anchor and k-1 proposals), per target decode step, and per draft block
(inject one committed row + propose).

Measured once per artifact and device, at load, and cached as JSON under
`$DFLASH_IR_COST_CACHE` (default ~/.cache/dflash-ir/costs): an entry is keyed by the
artifact's manifest (which pins the dflash-ir version, the sources and every compiled file)
and by the device, so a recompiled artifact or another device is measured afresh. Costs are
taken at a short context: attention's share of a verify grows with the context.

Before timing anything the measurement runs each program once at every row count a
generation gives it (`run_every_size`): a device that builds a kernel on its first launch
at a new size (PoCL: seconds per kernel, then kept in its disk cache) does so at the first
load of an artifact, not in the middle of a generation, and the timed calls find it done.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from .draft_runner import DraftRunner
from .target_runner import TargetRunner

MEASURE_CONTEXT = 32  # committed tokens the costs are measured on top of (fewer in a small context)
TIMED = 2             # timed calls per figure, after one untimed call
_FORMAT = 3  # 3: calls timed in the order generation makes them


@dataclass(frozen=True)
class SpecCosts:
    verify: tuple[float, ...]  # verify[k - 1]: seconds for a verify of k rows, k = 1..B
    decode: float              # seconds per target decode step
    draft: float               # seconds per draft block (inject one row + propose)

    def verify_rows(self, k: int) -> float:
        return self.verify[k - 1]

    @property
    def max_proposals(self) -> int:
        return len(self.verify) - 1

    def summary(self) -> str:
        steps = ", ".join(f"{k}: {1e3 * s:.2f}" for k, s in enumerate(self.verify, 1))
        return (f"decode step {1e3 * self.decode:.2f} ms; draft block {1e3 * self.draft:.2f} ms; "
                f"verify of k rows (ms) {steps}")


def measure_round_costs(target: TargetRunner, draft: DraftRunner,
                        progress: Callable[[str], None] = lambda msg: None) -> SpecCosts:
    """Times the calls in the order generation makes them, since a call after another program
    or size can cost several times a repeated one (PoCL): decode steps back to back, and for
    each k a draft block followed by a verify of k rows, one untimed pair then TIMED pairs.
    A figure is its fastest call (other work on the machine only ever adds time), the draft
    block's the median of all; a verify of k rows costs at most what a longer one costs (which
    removes what noise still adds). Leaves both runners reset."""
    B = draft.block_size
    context = min(MEASURE_CONTEXT, target.n_ctx - B - TIMED - 1)  # room for the decode steps and a verify
    if context < 1:
        raise ValueError(f"measuring costs needs a context of more than {B + TIMED + 1} tokens, this engine "
                         f"has {target.n_ctx}: compile with a larger one, or load with measure_costs=False")
    run_every_size(target, draft, progress)
    _reset(target, draft)
    features = target.prefill(np.zeros(context, np.int32)).device_features  # valid until the next prefill
    draft.inject(features)
    decode = [_seconds(lambda: target.decode(0)) for _ in range(TIMED + 1)][1:]
    drafts, verify = [], []
    for k in range(1, B + 1):
        timed = []
        for _ in range(TIMED + 1):
            if draft.ctx_len >= draft.n_ctx - 1:
                draft.reset()
                draft.inject(features)
            drafts.append(_seconds(lambda: (draft.inject(features[:1]), draft.propose(0))))
            timed.append(_seconds(lambda: target.verify(np.zeros(k, np.int32))))
        verify.append(min(timed[1:]))
    _reset(target, draft)
    verify = np.minimum.accumulate(verify[::-1])[::-1]
    return SpecCosts(tuple(float(v) for v in verify), min(decode), float(np.median(drafts)))


def run_every_size(target: TargetRunner, draft: DraftRunner, progress: Callable[[str], None] = lambda msg: None) -> None:
    """One call of every kind at every row count n = 1..B that generation makes: a prompt
    of n tokens, a verify of n rows and the commit of all n, an inject of n rows (after a
    verify or a run of decode steps; longer runs fall in the largest row bucket, as prompts
    do) and a draft block; a decode step. Results are dropped; leaves both runners reset;
    `progress` hears of every fourth row count. Needs a context of B tokens or more."""
    B = draft.block_size
    _reset(target, draft)
    width = target.prefill(np.zeros(1, np.int32)).features.shape[-1]
    target.decode(0)
    for n in range(1, B + 1):
        for call in (lambda: target.prefill(np.zeros(n, np.int32)),
                     lambda: (target.verify(np.zeros(n, np.int32)), target.commit(n))):
            if target.n_past + n > target.n_ctx:
                target.reset()
            call()
        if draft.ctx_len + n > draft.n_ctx:
            draft.reset()
        draft.inject(np.zeros((n, width), np.float32))
        draft.propose(0)
        if n % 4 == 0 or n == B:
            progress(f"first calls of every program: row counts 1-{n} of {B} done")
    _reset(target, draft)


def _seconds(call: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    call()
    return time.perf_counter() - t0


def _reset(target: TargetRunner, draft: DraftRunner) -> None:
    target.reset()
    draft.reset()


def artifact_costs(engine, manifest_text: str, backend, progress: Callable[[str], None] = lambda msg: None) -> SpecCosts:
    """The engine's round costs on `backend`'s device: cached, else measured now."""
    device = f"{backend.name}: {backend.device_description()} ({backend.profile()} profile, {os.cpu_count()} host CPUs)"
    return cached_costs(manifest_text, device, lambda: measure_round_costs(engine.target, engine.draft, progress))


def cost_cache_dir() -> Path:
    if env := os.environ.get("DFLASH_IR_COST_CACHE"):
        return Path(env)
    return Path.home() / ".cache" / "dflash-ir" / "costs"


def acceptance_file(artifact: str) -> Path:
    """Where the acceptance a controller learned on `artifact` (its manifest text) is kept
    between processes (controller.LengthController.learned): beside its costs, keyed by the
    artifact alone, since acceptance belongs to the pair and the text, not to the device."""
    return cost_cache_dir() / f"acceptance-{hashlib.sha256(artifact.encode()).hexdigest()[:32]}.json"


def cached_costs(artifact: str, device: str, measure: Callable[[], SpecCosts], *,
                 folder: Path | None = None) -> SpecCosts:
    """The costs recorded for (`artifact`, `device`), else `measure()`'s, recorded for next time.
    `artifact` identifies the compiled artifact (its manifest text), `device` the device it runs on."""
    folder = cost_cache_dir() if folder is None else Path(folder)
    key = {"format": _FORMAT, "artifact": hashlib.sha256(artifact.encode()).hexdigest(), "device": device}
    path = folder / f"{hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]}.json"
    if path.is_file():
        entry = json.loads(path.read_text())
        if entry.get("key") == key:
            return SpecCosts(tuple(entry["costs"]["verify"]), entry["costs"]["decode"], entry["costs"]["draft"])
    costs = measure()
    folder.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"key": key, "costs": asdict(costs)}, indent=1))
    os.replace(tmp, path)
    return costs
