"""`GET /metrics`: Prometheus text under llama-server's names, so its dashboards read it.

llama-server's `llamacpp:*` counters and gauges (prompt and predicted tokens and seconds,
requests processing and deferred, average throughputs, speculative draft and accepted
tokens) plus dflash's own: `dflash:round_tokens`, a histogram of the tokens each
speculative round commits (accepted + bonus; its sum / count is τ), `dflash:verify_passes_total`
and `dflash:verify_blocks_total` (target verify passes and the blocks they verified: fewer
passes than blocks where slots' blocks were batched), and `dflash:requests_total` by outcome
(finished, cancelled, failed, rejected, invalid).
A request's figures are added when it ends.
"""
from __future__ import annotations

from typing import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import disable_created_metrics

disable_created_metrics()  # no `*_created` timestamp series beside the counters (llama-server has none)

OUTCOMES = ("finished", "cancelled", "failed", "rejected", "invalid")


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, block_size: int, busy: Callable[[], int], queued: Callable[[], int]):
        r = self.registry = CollectorRegistry()
        self._totals = {"prompt_tokens": 0.0, "prompt_seconds": 0.0, "predicted": 0.0, "predicted_seconds": 0.0}
        self.prompt_tokens = Counter("llamacpp:prompt_tokens", "Number of prompt tokens processed.", registry=r)
        self.prompt_seconds = Counter("llamacpp:prompt_seconds", "Prompt process time.", registry=r)
        self.predicted = Counter("llamacpp:tokens_predicted", "Number of generation tokens processed.", registry=r)
        self.predicted_seconds = Counter("llamacpp:tokens_predicted_seconds", "Predict process time (wall, "
                                         "including other slots' turns).", registry=r)
        self.steps = Counter("llamacpp:n_decode", "Engine steps: prefills, speculative rounds, decode steps.",
                             registry=r)
        Gauge("llamacpp:requests_processing", "Number of requests processing.", registry=r).set_function(busy)
        Gauge("llamacpp:requests_deferred", "Number of requests waiting for a slot.", registry=r).set_function(queued)
        Gauge("llamacpp:prompt_tokens_seconds", "Average prompt throughput in tokens/s.", registry=r).set_function(
            lambda: self._rate("prompt_tokens", "prompt_seconds"))
        Gauge("llamacpp:predicted_tokens_seconds", "Average generation throughput in tokens/s.", registry=r).set_function(
            lambda: self._rate("predicted", "predicted_seconds"))
        self.drafts = Counter("llamacpp:spec_decode_num_drafts", "Speculative rounds (one draft each).", registry=r)
        self.draft_tokens = Counter("llamacpp:spec_decode_num_draft_tokens", "Draft tokens proposed.", registry=r)
        self.accepted = Counter("llamacpp:spec_decode_num_accepted_tokens", "Draft tokens accepted.", registry=r)
        self.accepted_per_pos = Counter("llamacpp:spec_decode_num_accepted_tokens_per_pos",
                                        "Rounds whose draft token at this position was accepted.", ["position"],
                                        registry=r)
        self.round_tokens = Histogram("dflash:round_tokens", "Tokens committed per speculative round (accepted + "
                                      "bonus); sum / count is tau.", buckets=range(1, block_size + 1), registry=r)
        self.verify_passes = Counter("dflash:verify_passes", "Target verify passes (a batched pass of several "
                                     "slots' blocks counts once).", registry=r)
        self.verify_blocks = Counter("dflash:verify_blocks", "Blocks the verify passes verified.", registry=r)
        self.requests = Counter("dflash:requests", "Requests by outcome.", ["outcome"], registry=r)
        for outcome in OUTCOMES:
            self.requests.labels(outcome)

    def request(self, outcome: str) -> None:
        self.requests.labels(outcome).inc()

    def verified(self, blocks: int) -> None:
        """Count a target verify pass of `blocks` blocks."""
        self.verify_passes.inc()
        self.verify_blocks.inc(blocks)

    def job_ended(self, ending, outcome: str) -> None:
        """Count a job that ran (`ending`: scheduler.Finished, None if it never started)."""
        self.request(outcome)
        if ending is None:
            return
        stats = ending.stats
        for name, amount in (("prompt_tokens", stats.prompt_tokens), ("prompt_seconds", ending.prompt_seconds),
                             ("predicted", stats.generated_tokens), ("predicted_seconds", ending.predicted_seconds)):
            getattr(self, name).inc(amount)
            self._totals[name] += amount
        self.steps.inc(ending.steps)
        self.drafts.inc(stats.rounds)
        self.draft_tokens.inc(stats.drafted)
        self.accepted.inc(stats.accepted)
        for accepted, rounds in stats.accept_hist.items():
            for position in range(accepted):
                self.accepted_per_pos.labels(str(position)).inc(rounds)
            for _ in range(rounds):
                self.round_tokens.observe(accepted + 1)

    def _rate(self, amount: str, seconds: str) -> float:
        return self._totals[amount] / self._totals[seconds] if self._totals[seconds] else 0.0

    def render(self) -> bytes:
        return generate_latest(self.registry)
