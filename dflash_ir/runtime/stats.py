"""Generation statistics: the numbers users ask for first ("why is speculation not faster")."""
from __future__ import annotations

import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class GenerationStats:
    mode: str = "speculative"
    prompt_tokens: int = 0
    generated_tokens: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    accept_hist: Counter = field(default_factory=Counter)  # accepted proposals per round -> count
    policy: str = ""  # how speculative rounds chose their length: "fixed" (n_max) or "cost-aware"
    lengths: list[int] = field(default_factory=list)  # per step after the first token: proposals verified, 0 = decode step
    shadow_drafts: int = 0  # blocks drafted while decoding, to learn the draft's acceptance
    seconds: Counter = field(default_factory=Counter)  # phase -> seconds
    stop_reason: str = ""

    @contextmanager
    def timed(self, phase: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] += time.perf_counter() - t0

    def record_round(self, drafted: int, accepted: int) -> None:
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted
        self.accept_hist[accepted] += 1

    def record_length(self, proposals: int) -> None:
        self.lengths.append(proposals)

    @property
    def decode_steps(self) -> int:
        """Steps of a speculative generation that decoded one token instead of verifying proposals."""
        return self.lengths.count(0)

    @property
    def tau(self) -> float:
        """Mean tokens committed per verify round, counting the target's bonus token."""
        return (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0

    @property
    def acceptance_rate(self) -> float:
        """llama.cpp's figure: accepted / drafted."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def prefill_tps(self) -> float:
        s = self.seconds["prefill"]
        return self.prompt_tokens / s if s else 0.0

    @property
    def generate_seconds(self) -> float:
        return sum(v for k, v in self.seconds.items() if k != "prefill")

    @property
    def generate_tps(self) -> float:
        s = self.generate_seconds
        return self.generated_tokens / s if s else 0.0

    def summary(self) -> str:
        lines = [
            f"mode: {self.mode}; stop: {self.stop_reason}",
            f"prompt: {self.prompt_tokens} tokens, {self.prefill_tps:.1f} tok/s; "
            f"generated: {self.generated_tokens} tokens, {self.generate_tps:.2f} tok/s",
        ]
        if self.rounds and self.mode == "speculative":
            hist = " ".join(f"{k}:{self.accept_hist[k]}" for k in sorted(self.accept_hist))
            lines.append(f"rounds: {self.rounds}; tau (tokens/round incl. bonus): {self.tau:.2f}; "
                         f"accepted/drafted: {self.accepted}/{self.drafted} = {self.acceptance_rate:.1%}")
            lines.append(f"accepted-per-round histogram: {hist}")
        if self.lengths:
            chosen = Counter(self.lengths)
            split = " ".join(f"{'decode' if k == 0 else k}:{chosen[k]}" for k in sorted(chosen))
            shadow = f"; shadow drafts: {self.shadow_drafts}" if self.shadow_drafts else ""
            lines.append(f"proposals verified per step ({self.policy}): {split}{shadow}")
        total = sum(self.seconds.values()) or 1.0
        split = ", ".join(f"{k} {v:.3f}s ({v / total:.0%})" for k, v in sorted(self.seconds.items()))
        lines.append(f"time: {split}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "mode": self.mode, "prompt_tokens": self.prompt_tokens, "generated_tokens": self.generated_tokens,
            "rounds": self.rounds, "drafted": self.drafted, "accepted": self.accepted, "tau": self.tau,
            "acceptance_rate": self.acceptance_rate, "accept_hist": dict(sorted(self.accept_hist.items())),
            "policy": self.policy, "lengths": list(self.lengths), "decode_steps": self.decode_steps,
            "shadow_drafts": self.shadow_drafts,
            "seconds": dict(self.seconds), "prefill_tps": self.prefill_tps, "generate_tps": self.generate_tps,
            "stop_reason": self.stop_reason,
        }
