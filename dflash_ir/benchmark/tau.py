"""Speculative tokens/s at a chosen acceptance length tau, measured rather than modelled.

A scripted draft runs the real draft network every round (its time is real) and then
proposes the target's own greedy continuation, right for the first tau-1 positions of the
block and wrong after: a round that verifies at least tau-1 proposals commits exactly tau
tokens. For each tau the same prompt is generated three ways: target-only, with B-1 (15)
proposals every round (fixed), and with the cost-aware length (after one untimed generation
in which the controller learns this draft's acceptance). The three run in turn `repeats`
times and each keeps its fastest run: other work on a shared machine only ever adds time.
(Each point's target-only figure is its own best of `repeats`: the fastest of the whole
sweep would be a best of many more runs, and flatter the baseline.)
Greedy, so both speculative runs must give the target-only tokens: a difference is an
error, not a number.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np

from dflash_ir.runtime.costs import SpecCosts

from .e2e import after_first_tps, compiled_engine, prompt_ids, run_label
from .models import BenchModel

TAUS = tuple(range(1, 17))


class TooSlow(RuntimeError):
    """The backend would need longer than the sweep's time box for a handful of tokens."""


class ScriptedDraft:
    """A draft runner whose proposals are `sequence` (prompt + target-only tokens, by position,
    known a block past the generation's end) for the first `accept` positions of each block
    and wrong after; the network still runs."""

    def __init__(self, draft, sequence: Sequence[int], accept: int):
        self.draft, self.sequence, self.accept = draft, list(sequence), accept
        self.block_size = draft.block_size

    def reset(self) -> None:
        self.draft.reset()

    def inject(self, features) -> None:
        self.draft.inject(features)

    def propose(self, anchor: int) -> np.ndarray:
        anchor_pos = self.draft.ctx_len
        self.draft.propose(anchor)
        right = self.sequence[anchor_pos + 1:anchor_pos + self.block_size]
        if len(right) < self.block_size - 1:
            raise IndexError(f"the scripted continuation ends at position {len(self.sequence)}, "
                             f"a block from {anchor_pos} needs {self.block_size - 1} more")
        return np.array([t if i < self.accept else (t - 1 if t > 0 else 1) for i, t in enumerate(right)], np.int32)


@dataclass(frozen=True)
class TauPoint:
    backend: str
    model: str
    tau: int
    tokens: int
    decode_tps: float        # target only
    fixed_tps: float         # B-1 proposals every round
    adaptive_tps: float      # the cost-aware length
    lengths: dict[int, int]  # cost-aware: proposals verified per step (0 = decode) -> steps

    @property
    def fixed_speedup(self) -> float:
        return self.fixed_tps / self.decode_tps

    @property
    def adaptive_speedup(self) -> float:
        return self.adaptive_tps / self.decode_tps

    def to_dict(self) -> dict:
        return {**asdict(self), "fixed_speedup": self.fixed_speedup, "adaptive_speedup": self.adaptive_speedup}


def run_tau_sweep(backend: str, model: BenchModel, work_dir, *, taus: Sequence[int] = TAUS, max_tokens: int = 32,
                  repeats: int = 3, seconds: float = 300.0, n_ctx: int = 512,
                  numerics: str = "exact") -> tuple[SpecCosts, list[TauPoint]]:
    """The engine's measured round costs and one point per tau; `max_tokens` per generation,
    fewer where the costs say the sweep would take longer than `seconds`."""
    engine = compiled_engine(backend, model, work_dir, n_ctx=n_ctx, numerics=numerics)
    costs, block = engine.costs, engine.draft.block_size
    if not all(1 <= tau <= block for tau in taus):
        raise ValueError(f"tau must lie in 1..{block} (the block size), got {list(taus)}")
    full_round = costs.draft + costs.verify_rows(block)
    per_token = sum(repeats * full_round / tau + (2 * repeats + 1) * costs.decode for tau in taus)
    n = min(max_tokens, int(seconds / per_token))
    if n < 4:
        raise TooSlow(f"a sweep token costs {per_token:.1f} s here: too slow for a tau sweep in {seconds:.0f} s")
    ids = prompt_ids(engine, model)
    engine.generate(prompt_ids=ids, max_tokens=4, speculative=False, ignore_eos=True)  # warm-up
    known = engine.generate(prompt_ids=ids, max_tokens=n + block, speculative=False, ignore_eos=True).tokens
    want = known[:n]
    network = engine.draft
    points = []
    try:
        for tau in taus:
            engine.draft = ScriptedDraft(network, ids + known, tau - 1)
            engine.costs = costs  # a fresh controller: it learns this tau's acceptance untimed, then is timed
            _checked(engine, ids, want, n_max=block - 1, adaptive=True)
            best = {"plain": 0.0, "fixed": 0.0, "adaptive": 0.0}
            for _ in range(repeats):
                runs = {"plain": engine.generate(prompt_ids=ids, max_tokens=n, speculative=False, ignore_eos=True),
                        "fixed": _checked(engine, ids, want, n_max=block - 1, adaptive=False),
                        "adaptive": _checked(engine, ids, want, n_max=block - 1, adaptive=True)}
                best = {k: max(best[k], after_first_tps(gen)) for k, gen in runs.items()}
            lengths = runs["adaptive"].stats.lengths
            points.append(TauPoint(run_label(backend, numerics), model.name, tau, n, best["plain"], best["fixed"], best["adaptive"],
                                   {k: lengths.count(k) for k in sorted(set(lengths))}))
    finally:
        engine.draft = network
    return costs, points


def _checked(engine, ids, want, **kw):
    gen = engine.generate(prompt_ids=ids, max_tokens=len(want), ignore_eos=True, **kw)
    if gen.tokens != want:
        raise AssertionError(f"speculative tokens ({kw}) differ from target-only tokens:\n"
                             f"  speculative {gen.tokens}\n  target-only {want}")
    return gen
