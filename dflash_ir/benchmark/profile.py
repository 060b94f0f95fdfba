"""Where a call's time goes, kernel by kernel: a target decode step after a 64-token prompt,
a verify of a whole block and the draft's block pass, of a bench pair compiled as the e2e
suite compiles it.

Each launch of one real call is timed alone, in place: after its predecessors have finished,
to the device's finish (Program.launch_times: with its launch overhead and the caches its
predecessors leave), and the prices are summed per kernel family (the kernel's name without
its hash). Beside their sum stands the call as generation runs it (inputs bound and
uploaded, the list replayed without waits, outputs left on the device): the host's work per
call, less what launches overlap when nothing waits between them, is the difference.
"""
from __future__ import annotations

import re
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .e2e import compiled_engine, prompt_ids, run_label
from .models import BenchModel

KERNEL_HASH = re.compile(r"_[0-9a-f]{10}$")


class NoLaunches(ValueError):
    """The backend runs a graph without a launch list (the numpy interpreter): nothing to price."""


@dataclass(frozen=True)
class CallProfile:
    backend: str
    model: str
    call: str
    seconds: float                                        # the whole call, as generation runs it (fastest)
    launches: tuple[tuple[str, tuple[int, ...], float], ...]  # (kernel, work-groups, seconds)

    @property
    def launch_seconds(self) -> float:
        """The launches' prices summed."""
        return sum(t for *_, t in self.launches)

    def families(self) -> list[tuple[str, int, float]]:
        """(kernel family, launches, seconds), the costliest first."""
        count, total = defaultdict(int), defaultdict(float)
        for kernel, _, seconds in self.launches:
            family = KERNEL_HASH.sub("", kernel)
            count[family] += 1
            total[family] += seconds
        return sorted(((f, count[f], total[f]) for f in total), key=lambda row: -row[2])

    def to_dict(self) -> dict:
        return {"backend": self.backend, "model": self.model, "call": self.call, "ms": self.seconds * 1e3,
                "launch_ms": self.launch_seconds * 1e3, "launches": len(self.launches),
                "families": [{"family": f, "launches": n, "ms": s * 1e3} for f, n, s in self.families()]}


def _recorded(program, call) -> tuple[dict, dict]:
    """The inputs `call` runs `program` with (its last run), and the states after it: those
    the program holds in its own buffers, as the next call of a generation passes them."""
    seen = []
    run = program.run

    def recording(inputs, states=None, **kw):
        result = run(inputs, states, **kw)
        seen.append((inputs, {**(states or {}), **result.states}))
        return result

    program.run = recording
    try:
        call()
    finally:
        del program.run
    return seen[-1]


def _profile_call(label: str, model: str, name: str, program, call, repeats: int) -> CallProfile:
    if not hasattr(program, "launch_times"):
        raise NoLaunches(f"{label} runs graphs without kernel launches: the profile needs a kernel backend")
    inputs, states = _recorded(program, call)
    outputs = tuple(name for name, _ in program.graph.outputs)  # left on the device, as generation leaves them
    best = float("inf")
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        first = next(iter(program.run(inputs, states, keep=outputs).outputs.values()))
        np.asarray(first[:1])  # one row read back: the in-order queue has finished the call
        best = min(best, time.perf_counter() - t0)
    return CallProfile(label, model, name, best, tuple(program.launch_times(inputs, states, repeats)))


def profile_engine(engine, ids: list[int], label: str, model: str, repeats: int = 3) -> list[CallProfile]:
    """Profiles of a decode step, a verify of a whole block and a draft block; leaves the
    engine reset."""
    target, draft = engine.target, engine.draft
    block = draft.block_size
    target.reset()
    draft.reset()
    draft.inject(target.prefill(np.asarray(ids, np.int32)).device_features)
    calls = [("decode step", target.programs["decode"], lambda: target.decode(0)),
             (f"verify of {block} rows", target.programs["verify"], lambda: target.verify(np.zeros(block, np.int32))),
             ("draft block", draft.programs["block"], lambda: draft.propose(0))]
    try:
        return [_profile_call(label, model, name, program, call, repeats) for name, program, call in calls]
    finally:
        target.reset()
        draft.reset()


def run_profile(backend: str, model: BenchModel, work_dir: Path, *, numerics: str = "exact", n_ctx: int = 512,
                repeats: int = 3) -> list[CallProfile]:
    engine = compiled_engine(backend, model, work_dir, n_ctx=n_ctx, numerics=numerics)
    return profile_engine(engine, prompt_ids(engine, model), run_label(backend, numerics), model.name, repeats)


def summary(p: CallProfile, top: int = 6) -> list[str]:
    """The CLI's lines for one call: totals, then its costliest kernel families."""
    lines = [f"  {p.model} / {p.backend} {p.call}: {p.seconds * 1e3:.3f} ms a call, of which its "
             f"{len(p.launches)} launches {p.launch_seconds * 1e3:.3f} ms"]
    for family, n, seconds in p.families()[:top]:
        share = seconds / p.launch_seconds if p.launch_seconds else 0.0
        lines.append(f"    {family:32s} x{n:<4d} {seconds * 1e3:8.3f} ms  {share:4.0%}")
    return lines
