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

What one controller learns of the draft's acceptance can seed the next one (`learned`,
`recall`): the engine keeps it beside the artifact's costs, so a process that loads the pair
again starts from the acceptance its draft last showed instead of PRIOR_ACCEPT.

Decoding verifies nothing, so while it decodes the engine drafts in the shadow now and then:
it runs the draft block once and scores its proposals against the tokens the target then
decodes, one per step, which is what a verify would have accepted, at the cost of a draft
block and no verify. Each decode step earns EXPLORE of its cost as credit and a shadow draft
spends what it took (the block and the injects before it); the first decode step of a
controller's life has one ready,
so a draft that agrees is found within a block of tokens, and shadow drafts cost at most
EXPLORE of the time spent decoding after that. When even a draft that is always right could
not beat decoding (`can_pay` is false), the engine never drafts.

The costs measured at load are a starting point, not the truth: other work on the machine
(or a cache measured under it) can leave them off by a factor, and off in ratio. The engine
reports what each decode step and round really took. The first call at each length is not
counted (it sets up buffers for its size); the next replaces the table's figure; later ones
move the estimate by at most STEP each (a hiccup of the machine can take many times the
usual), as a running mean of logarithms. A length's own observations count for FORGET steps
after its last one; lengths not observed lately follow the measured table scaled by how far
the rounds observed in the last FORGET steps stand from it (by nothing when none was).
Speculating, the engine would never time a decode step again, so every REFRESH rounds
without one a round decodes instead (the first step too): a table whose decode step is too
dear cannot keep it speculating at a loss. Decoding, round estimates are forgotten FORGET
steps after their last observation, so rounds timed in a busy moment cannot keep it
decoding once the machine is quiet again. Shadow drafts are paid for from the estimated
decode time, at the table's draft cost scaled as the rounds are.
"""
from __future__ import annotations

import numpy as np

from .costs import SpecCosts

PRIOR_ACCEPT = 0.75  # before any round: 15 proposals give tau ~ 4, the low end of published DFlash drafts
PRIOR_ROUNDS = 2.0   # weight of the prior, in observed rounds
DECAY = 0.95         # per round: the estimates remember the last ~20 rounds
EXPLORE = 0.03       # share of decoding time that shadow drafts may spend
TRACK = 0.5          # weight of the newest observed time in the running estimates (load comes and goes)
STEP = 1.5           # most that one observation multiplies or divides an estimate by
REFRESH = 8          # speculative rounds after which a decode step is timed again
FORGET = 64          # steps after which a length's own observations no longer count


class LengthController:
    def __init__(self, costs: SpecCosts, track: bool = True):
        self.costs = costs
        self.track = track  # whether observed times correct the costs (off: the policy under `costs` alone)
        self.trials = np.zeros(costs.max_proposals)
        self.hits = np.zeros(costs.max_proposals)
        self.credit = costs.draft  # seconds of shadow drafting earned: the first decode step has one
        # measured seconds of a round verifying k proposals, k = 0 (a decode step) .. B-1
        self.table = np.array([costs.decode, *(costs.draft + v for v in costs.verify[1:])])
        self.log_observed = np.full_like(self.table, np.nan)  # running means of log(seconds) of observed rounds
        self.log_scale = 0.0  # running mean of log(observed / table) over the observed rounds (not decode steps)
        self.since_decode = REFRESH  # speculative rounds since a decode step was timed
        self.last_seen = np.full(len(self.table), -FORGET)  # step of each length's last observation
        self.steps = 0  # observations so far
        self.warm = np.zeros(len(self.table), bool)  # lengths called once (their first call is not counted)

    @property
    def seconds(self) -> np.ndarray:
        """Estimated seconds of a round verifying k = 0..B-1 proposals."""
        fresh = ~np.isnan(self.log_observed) & (self.steps - self.last_seen < FORGET)
        return np.where(fresh, np.exp(np.where(fresh, self.log_observed, 0.0)), self.table * self.scale)

    @property
    def scale(self) -> float:
        """How far the rounds of the last FORGET steps stand from the table (1 when none was timed)."""
        return float(np.exp(self.log_scale)) if self.steps - self.last_seen[1:].max() < FORGET else 1.0

    def observe_seconds(self, proposals: int, seconds: float) -> None:
        """Record what a round verifying `proposals` proposals (0: a decode step) took."""
        if not (self.track and seconds > 0.0):
            return
        if not proposals:
            self.since_decode = 0
        if not self.warm[proposals]:
            self.warm[proposals] = True
            return
        first = np.isnan(self.log_observed[proposals])
        estimate = np.log(self.seconds[proposals])
        if proposals:
            self.log_scale += _step(np.log(seconds / self.table[proposals]) - self.log_scale)
        self.log_observed[proposals] = np.log(seconds) if first else estimate + _step(np.log(seconds) - estimate)
        self.steps += 1
        self.last_seen[proposals] = self.steps

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
        k = self.best(n_max, self.acceptance())
        if self.track and k and self.since_decode >= REFRESH:
            return 0
        self.since_decode += k > 0
        return k

    def decoding(self, idle: bool) -> bool:
        """Book a decode step; whether it also drafts in the shadow: when no shadow draft is
        being scored (`idle`) and the credit pays for a block (the table's draft time, scaled
        as the rounds are). The engine then reports what the shadow took (`shadow_took`)."""
        shadow = idle and self.credit >= self.costs.draft * self.scale
        self.credit += EXPLORE * self.seconds[0]
        return shadow

    def shadow_took(self, seconds: float) -> None:
        """Charge a shadow draft's real time to the credit: the draft block and the injects
        of the decoded rows it waited for (a table's draft time leaves those out)."""
        self.credit -= seconds

    def learned(self) -> dict:
        """The acceptance observations so far (faded as they are): what a controller of the same
        pair starts from in a later process (`recall`), rather than from the prior alone."""
        return {"trials": self.trials.tolist(), "hits": self.hits.tolist()}

    def recall(self, learned: dict) -> bool:
        """Take `learned` (another controller's `learned()`) as this one's observations; False,
        and nothing taken, where it does not describe this block size (B-1 positions of
        0 <= hits <= trials <= 1 / (1 - DECAY), the most DECAY leaves)."""
        try:
            trials, hits = (np.array(learned[key], dtype=float) for key in ("trials", "hits"))
        except (KeyError, TypeError, ValueError):
            return False
        fits = (trials.shape == hits.shape == self.trials.shape and np.all(np.isfinite(trials))
                and np.all((0 <= hits) & (hits <= trials) & (trials <= 1 / (1 - DECAY) + 1e-9)))
        if fits:
            self.trials, self.hits = trials, hits
        return bool(fits)

    def observe(self, proposed: int, accepted: int) -> None:
        """Record a round that verified `proposed` proposals and accepted `accepted`."""
        self.trials *= DECAY
        self.hits *= DECAY
        self.trials[:min(accepted + 1, proposed)] += 1
        self.hits[:accepted] += 1


def _step(error: float) -> float:
    """TRACK of the way from an estimate to an observation (logarithms), at most log(STEP)."""
    return float(np.clip(TRACK * error, -np.log(STEP), np.log(STEP)))
