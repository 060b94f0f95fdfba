"""How many proposals to verify each round: the number that maximises expected tokens per
second, 0 meaning a plain target decode step (the costs come from runtime/costs.py).

Acceptance: p_i = P(proposal i is accepted | proposals 1..i-1 were), i = 1..B-1, estimated
online. A round that verified k proposals and accepted a of them is a success at positions
1..a and a failure at a+1 (when a < k); later positions are not observed. Each estimate
is its observations plus a prior worth PRIOR_ROUNDS observations: PRIOR_ACCEPT for position
1, the estimate of position i-1 for position i (a draft right up to its last proposal is
believed to go on being right; one that fails early, to go on failing). Observations fade
by DECAY per round, so the estimates follow the text being generated.

    tokens(k) = 1 + sum_{j=1..k} prod_{i<=j} p_i      (the bonus token plus expected accepted proposals)
    rate(k)   = tokens(k) / (cost(draft block) + cost(verify of k+1 rows)),   rate(0) = 1 / cost(decode)

A round takes the k in 0..n_max with the highest rate (the shortest on a tie).

Decoding verifies nothing, so while it decodes the engine drafts in the shadow now and then:
it runs the draft block once and scores its proposals against the tokens the target then
decodes, one per step, which is what a verify would have accepted, at the cost of a draft
block and no verify. Each decode step earns EXPLORE of its cost as credit and a shadow draft
spends the cost of a draft block; the first decode step of a controller's life has one ready,
so a draft that agrees is found within a block of tokens, and shadow drafts cost at most
EXPLORE of the time spent decoding after that. When even a draft that is always right could
not beat decoding (`can_pay` is false), the engine never drafts.
"""
from __future__ import annotations

import numpy as np

from .costs import SpecCosts

PRIOR_ACCEPT = 0.75  # before any round: 15 proposals give tau ~ 4, the low end of published DFlash drafts
PRIOR_ROUNDS = 2.0   # weight of the prior, in observed rounds
DECAY = 0.95         # per round: the estimates remember the last ~20 rounds
EXPLORE = 0.03       # share of decoding time that shadow drafts may spend


class LengthController:
    def __init__(self, costs: SpecCosts):
        self.costs = costs
        self.trials = np.zeros(costs.max_proposals)
        self.hits = np.zeros(costs.max_proposals)
        self.credit = costs.draft  # seconds of shadow drafting earned: the first decode step has one
        # seconds of a round verifying k proposals, k = 0 (a decode step) .. B-1
        self.seconds = np.array([costs.decode, *(costs.draft + v for v in costs.verify[1:])])

    def acceptance(self) -> np.ndarray:
        """p_i for i = 1..B-1 (index i-1)."""
        p, prior = [], PRIOR_ACCEPT
        for hits, trials in zip(self.hits.tolist(), self.trials.tolist()):
            prior = (hits + PRIOR_ROUNDS * prior) / (trials + PRIOR_ROUNDS)
            p.append(prior)
        return np.array(p)

    def rates(self, acceptance: np.ndarray) -> np.ndarray:
        """Expected committed tokens per second of a round verifying k = 0..B-1 proposals."""
        return (1.0 + np.concatenate(([0.0], np.cumsum(np.cumprod(acceptance))))) / self.seconds

    def best(self, n_max: int, acceptance: np.ndarray) -> int:
        return int(np.argmax(self.rates(acceptance)[:n_max + 1]))

    def can_pay(self, n_max: int) -> bool:
        """Whether a draft that is always right would beat decoding at some length up to n_max."""
        return self.best(n_max, np.ones(self.costs.max_proposals)) > 0

    def choose(self, n_max: int) -> int:
        """Proposals to verify this round (0: decode), at most n_max."""
        return self.best(n_max, self.acceptance())

    def decoding(self, idle: bool) -> bool:
        """Book a decode step; whether it also drafts in the shadow: when no shadow draft is
        being scored (`idle`) and the credit pays for a block."""
        shadow = idle and self.credit >= self.costs.draft
        self.credit += EXPLORE * self.costs.decode - (self.costs.draft if shadow else 0.0)
        return shadow

    def observe(self, proposed: int, accepted: int) -> None:
        """Record a round that verified `proposed` proposals and accepted `accepted`."""
        self.trials *= DECAY
        self.hits *= DECAY
        self.trials[:min(accepted + 1, proposed)] += 1
        self.hits[:accepted] += 1
