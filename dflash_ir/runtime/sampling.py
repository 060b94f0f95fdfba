"""Token sampling with llama.cpp's knobs (temperature, top-k, top-p, min-p, seed).

Speculative decoding samples the target's rows one by one and accepts a proposal while it
equals the sample (sample-and-match): every emitted token is a target sample given the
correct prefix, so the output distribution is exactly the target's.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int | None = None

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def probs(self, logits: np.ndarray) -> np.ndarray:
        """The distribution a token is drawn from (after the filters), as float64."""
        p = self.params
        x = logits.astype(np.float64)
        keep = np.ones(x.shape, bool)
        if p.top_k:
            kth = np.partition(x, -min(p.top_k, x.size))[-min(p.top_k, x.size)]
            keep &= x >= kth
        probs = _softmax(np.where(keep, x, -np.inf))
        if p.top_p < 1:
            order = np.argsort(-probs, kind="stable")
            before = np.cumsum(probs[order]) - probs[order]
            cut = np.zeros_like(keep)
            cut[order[before >= p.top_p]] = True
            keep &= ~cut
        if p.min_p > 0:
            keep &= probs >= p.min_p * probs.max()
        return _softmax(np.where(keep, x / p.temperature, -np.inf))

    def sample(self, logits: np.ndarray) -> int:
        if self.params.greedy:
            return int(np.argmax(logits))
        probs = self.probs(logits)
        return int(self.rng.choice(probs.size, p=probs))


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def logsumexp(x: np.ndarray) -> np.ndarray:
    """log(sum(exp(x))) over the last axis, stable."""
    m = x.max(-1, keepdims=True)
    return (m + np.log(np.exp(x - m).sum(-1, keepdims=True)))[..., 0]
