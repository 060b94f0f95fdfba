"""The engine: prompt in, tokens out, with DFlash speculative decoding or target-only.

One round (DFLASH.md §3.1, z-lab's reference loop):
  1. inject the target features of the newly committed rows into the draft's cache;
  2. draft the block [anchor, MASK x (B-1)] once; proposals = argmax of rows 1..B-1,
     truncated to n_max (the draft always sees the whole block);
  3. verify [anchor, proposals...] with one target pass;
  4. sample the target's rows in order and accept proposals while they equal the sample;
     the first sample that differs (or the one after the last proposal) is the bonus token;
  5. roll the target back to the committed rows; keep only the accepted rows' features.
The first anchor is the token sampled from the prefill logits.

Greedy rounds read only token ids from the device (the draft's proposals, the target's
argmax per row); logits stay there, and the accepted rows' features go from the target's
output buffer into the draft's cache on the device. Sampling reads the logits.

How many proposals a round verifies: n_max every round (`adaptive=False`), or, when the
engine knows its costs (`costs`, measured at load), the number with the most expected
tokens per second, down to 0: a plain target decode step (runtime/controller.py). A decode
step's features are read to the host (its buffer is reused by the next step) and injected
into the draft before it next runs. While decoding, the draft now and then proposes a block
in the shadow: its proposals are scored against the tokens decoded next, so the controller
learns the draft's acceptance without paying for a verify; every verified round, fixed-length
ones included, teaches it too.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Generator, Iterator, Sequence

import numpy as np

from dflash_ir.errors import ContextOverflowError

from .controller import LengthController
from .costs import SpecCosts
from .draft_runner import DraftRunner
from .sampling import Sampler, SamplingParams
from .stats import GenerationStats
from .target_runner import TargetOutput, TargetRunner


@dataclass
class Generation:
    tokens: list[int]
    text: str
    stats: GenerationStats
    rounds: list[dict] = field(default_factory=list)  # per round: anchor_pos, anchor, proposals, accepted


@dataclass
class VerifyBlock:
    """A round's block [anchor, proposals...], for the target to verify on top of the committed
    state (`Engine.steps`); nothing is committed until the round's result is sent back."""
    tokens: list[int]


class Engine:
    def __init__(self, target: TargetRunner, draft: DraftRunner | None, tokenizer=None, chat_template=None,
                 *, n_max: int = 15, info: dict | None = None, costs: SpecCosts | None = None):
        self.target = target
        self.draft = draft
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.n_max = n_max
        self.info = info or {}
        self.acceptance_file: Path | None = None  # where the controller's acceptance is kept (remember_acceptance)
        self.costs = costs
        self.last_stats: GenerationStats | None = None
        self.last_rounds: list[dict] = []  # per round of the last generation: anchor_pos, anchor, proposals, accepted

    @property
    def costs(self) -> SpecCosts | None:
        """Measured round costs on this engine's device; setting them starts a fresh controller
        (acceptance estimates are kept across generations, they describe the draft)."""
        return self._costs

    @costs.setter
    def costs(self, costs: SpecCosts | None) -> None:
        self._costs = costs
        self.controller = LengthController(costs) if costs is not None else None
        self._recall_acceptance()

    def remember_acceptance(self, path: Path) -> None:
        """Keep what the controller learns of the draft's acceptance in `path` (JSON) across
        processes: recalled now and by a controller made for new costs, written after each
        generation. A file that cannot be read as one is ignored, and replaced at the next write."""
        self.acceptance_file = Path(path)
        self._recall_acceptance()

    def _recall_acceptance(self) -> None:
        if self.controller is None or self.acceptance_file is None:
            return
        try:
            learned = json.loads(self.acceptance_file.read_text())
        except (OSError, ValueError):
            return
        if isinstance(learned, dict):
            self.controller.recall(learned)

    def _keep_acceptance(self) -> None:
        learned = self.controller.learned() if self.controller is not None and self.acceptance_file else None
        if not learned or not any(learned["trials"]):
            return
        tmp = self.acceptance_file.with_suffix(f".{os.getpid()}.tmp")
        try:
            self.acceptance_file.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(learned))
            os.replace(tmp, self.acceptance_file)
        except OSError:  # a cache that cannot be written costs the next process its head start only
            tmp.unlink(missing_ok=True)

    @property
    def n_ctx(self) -> int:
        return self.target.n_ctx

    # -- prompts ----------------------------------------------------------------------
    def encode_prompt(self, prompt: str | None = None, *, messages: Sequence[dict] | None = None,
                      enable_thinking: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this engine has no tokenizer: pass prompt_ids")
        if messages is not None:
            if self.chat_template is None:
                raise ValueError("the target GGUF has no chat template (tokenizer.chat_template): pass a plain prompt")
            prompt = self.chat_template.render(list(messages), add_generation_prompt=True, enable_thinking=enable_thinking)
        if prompt is None:
            raise ValueError("give a prompt, messages or prompt_ids")
        return self.tokenizer.encode(prompt, parse_special=True)

    # -- generation -------------------------------------------------------------------
    def generate(self, prompt: str | None = None, **kw) -> Generation:
        gen = self.iter_tokens(prompt, **kw)
        tokens: list[int] = []
        for piece in gen:
            tokens.extend(piece)
        return self._finish(tokens)

    def stream(self, prompt: str | None = None, **kw) -> Iterator[str]:
        """Yields text pieces as tokens are committed (valid UTF-8 only); stats in `last_stats`."""
        from dflash_ir.models.tokenizer import StreamDecoder

        decoder = StreamDecoder(self.tokenizer)
        for piece in self.iter_tokens(prompt, **kw):
            for t in piece:
                text = decoder.feed(t)
                if text:
                    yield text
        tail = decoder.flush()
        if tail:
            yield tail

    def _finish(self, tokens: list[int]) -> Generation:
        text = self.tokenizer.decode(tokens) if self.tokenizer is not None else ""
        return Generation(tokens, text, self.last_stats, self.last_rounds)

    def iter_tokens(self, prompt: str | None = None, **kw) -> Iterator[list[int]]:
        """Yields the tokens committed by each step (the first token, then each round's accepted
        proposals plus bonus); between yields the target state holds exactly the committed tokens.
        `adaptive` (default: when the engine knows its costs) chooses each round's length up to
        n_max by expected tokens per second; False verifies n_max proposals every round.
        Keywords as `steps`, whose blocks this runs on the engine's own target."""
        steps = self.steps(prompt, **kw)
        try:
            sent = None
            while True:
                item = steps.send(sent)
                if isinstance(item, VerifyBlock):
                    sent = self.target.verify(item.tokens)
                else:
                    sent = None
                    yield item
        except StopIteration:
            return
        finally:
            steps.close()

    def steps(self, prompt: str | None = None, **kw) -> Generator[list[int] | VerifyBlock, TargetOutput | None, None]:
        """`iter_tokens`, with each round's verify left to the caller: besides the committed
        tokens it yields a `VerifyBlock`, and expects `send` to answer it with the target's
        output for that block, as `self.target.verify` gives it (dflash-serve verifies the
        blocks of several sequences in one pass). Keywords as `_steps`'. When it ends, the
        acceptance the controller learned is kept (`remember_acceptance`)."""
        try:
            yield from self._steps(prompt, **kw)
        finally:
            self._keep_acceptance()

    def _steps(self, prompt: str | None = None, *, messages=None, prompt_ids=None, max_tokens: int = 128,
               sampling: SamplingParams = SamplingParams(), speculative: bool = True, n_max: int | None = None,
               stop: Sequence[str] = (), ignore_eos: bool = False, enable_thinking: bool = True,
               adaptive: bool | None = None) -> Generator[list[int] | VerifyBlock, TargetOutput | None, None]:
        ids = list(prompt_ids) if prompt_ids is not None else self.encode_prompt(prompt, messages=messages,
                                                                                enable_thinking=enable_thinking)
        if speculative and self.draft is None:
            raise ValueError("speculative decoding needs a draft model: compile with one, or use speculative=False")
        if len(ids) >= self.n_ctx:
            raise ContextOverflowError(f"the prompt has {len(ids)} tokens but the context size is {self.n_ctx}; "
                                       f"compile with a larger context (dflash-compile -c N) or shorten the prompt")
        n_max = self.n_max if n_max is None else n_max
        if speculative and not 1 <= n_max < self.draft.block_size:
            raise ValueError(f"n_max must be in 1..{self.draft.block_size - 1} (block size {self.draft.block_size}), got {n_max}")
        adaptive = speculative and (self.controller is not None if adaptive is None else adaptive)
        if adaptive and self.controller is None:
            raise ValueError("adaptive speculation needs the engine's measured costs (load_compiled measures them)")
        stats = GenerationStats(mode="speculative" if speculative else "target-only", prompt_tokens=len(ids),
                                policy=("cost-aware" if adaptive else "fixed") if speculative else "")
        self.last_stats, self.last_rounds = stats, []
        sampler = Sampler(sampling)
        stop_ids = set() if ignore_eos or self.tokenizer is None else set(self.tokenizer.eos_ids)
        stopper = _Stopper(self.tokenizer, stop_ids, stop, max_tokens, stats)

        self.target.reset()
        if self.draft is not None:
            self.draft.reset()
        with stats.timed("prefill"):
            out = self.target.prefill(ids)
        with stats.timed("sample"):
            token = _sample(sampler, out, -1)
        emitted = stopper.admit([token])
        yield emitted
        if stopper.done:
            return
        drafting = speculative and (not adaptive or self.controller.can_pay(n_max))
        feed = _DraftFeed(self.draft, out.device_features) if drafting else None
        shadow = None  # a block drafted while decoding, being scored

        while True:
            start = self.target.n_past  # position of the anchor `token`
            room = self.n_ctx - start
            if room < 1:
                stats.stop_reason = f"context full ({self.n_ctx} tokens)"
                return
            k, began, shadowed = 0, time.perf_counter(), False
            if drafting:
                k = self.controller.choose(min(n_max, room - 1)) if adaptive else min(n_max, room - 1)
            if k:
                with stats.timed("draft"):
                    feed.flush()
                    proposals = [int(t) for t in self.draft.propose(token)[:k]]
                with stats.timed("verify"):
                    out = yield VerifyBlock([token, *proposals])
                with stats.timed("sample"):
                    accepted, bonus = _sample_and_match(sampler, out, proposals)
                with stats.timed("rollback"):
                    self.target.commit(accepted + 1)
                stats.record_round(len(proposals), accepted)
                if self.controller is not None:  # a fixed-length round teaches the acceptance as well
                    self.controller.observe(len(proposals), accepted)
                self.last_rounds.append({"anchor_pos": start, "anchor": token, "proposals": proposals, "accepted": accepted})
                feed.add(out.device_features[:accepted + 1] if out.device_features is not None else None)
                new = [*proposals[:accepted], bonus]
                shadow = None
            else:
                if drafting and adaptive and room > 1 and self.controller.decoding(idle=shadow is None):
                    shadowed = True
                    with stats.timed("draft"):
                        feed.flush()
                        shadow = _Shadow(self.draft.propose(token)[:min(n_max, room - 1)])
                    self.controller.shadow_took(time.perf_counter() - began)
                    stats.shadow_drafts += 1
                with stats.timed("decode"):
                    out = self.target.decode(token)
                    if feed is not None:
                        feed.add(out.features)
                with stats.timed("sample"):
                    new = [_sample(sampler, out, -1)]
                verdict = shadow.score(new[0]) if shadow is not None else None
                if verdict is not None:
                    self.controller.observe(*verdict)
                    shadow = None
            if adaptive and not shadowed:  # what the step took (a shadow draft is not a decode step's cost)
                self.controller.observe_seconds(k, time.perf_counter() - began)
            if speculative:
                stats.record_length(k)
            token = new[-1]
            emitted = stopper.admit(new)
            if emitted:
                yield emitted
            if stopper.done:
                return


class _Shadow:
    """Proposals drafted while decoding, scored against the tokens the target decodes next: the
    first that differs is where a verify would have stopped accepting."""

    def __init__(self, proposals):
        self.proposals = [int(t) for t in proposals]
        self.matched = 0

    def score(self, token: int) -> tuple[int, int] | None:
        """(proposed, accepted) once known, else None."""
        if token != self.proposals[self.matched]:
            return len(self.proposals), self.matched
        self.matched += 1
        return (len(self.proposals), self.matched) if self.matched == len(self.proposals) else None


class _DraftFeed:
    """Features of committed rows not yet in the draft's cache, injected in order before the
    next draft. A prefill's or verify's rows stay on the device (their buffers live until that
    program runs again); a decode step's row comes already read to the host."""

    def __init__(self, draft: DraftRunner, features):
        self.draft = draft
        self.pending = []
        self.add(features)

    def add(self, features) -> None:
        if features is not None:
            self.pending.append(features)

    def flush(self) -> None:
        run: list[np.ndarray] = []
        for f in self.pending:
            if isinstance(f, np.ndarray):
                run.append(f)
                continue
            self._inject(run)
            self.draft.inject(f)
        self._inject(run)
        self.pending = []

    def _inject(self, host_rows: list[np.ndarray]) -> None:
        if host_rows:
            self.draft.inject(np.concatenate(host_rows))
            host_rows.clear()


def _sample(sampler: Sampler, out: TargetOutput, row: int) -> int:
    """The target's token for one logits row: the device's argmax when greedy."""
    return int(out.greedy[row]) if sampler.params.greedy else sampler.sample(out.logits[row])


def _sample_and_match(sampler: Sampler, out: TargetOutput, proposals: Sequence[int]) -> tuple[int, int]:
    """Accepted proposal count and the target's own next token (the bonus)."""
    for i, p in enumerate(proposals):
        t = _sample(sampler, out, i)
        if t != p:
            return i, t
    return len(proposals), _sample(sampler, out, len(proposals))


class _Stopper:
    """Applies EOS, stop strings and the token budget to committed tokens."""

    def __init__(self, tokenizer, stop_ids: set[int], stop_strings: Sequence[str], max_tokens: int, stats):
        self.tokenizer, self.stop_ids, self.stop_strings = tokenizer, stop_ids, tuple(stop_strings)
        self.max_tokens, self.stats = max_tokens, stats
        self.tokens: list[int] = []
        self.done = max_tokens <= 0

    def admit(self, new: list[int]) -> list[int]:
        kept = []
        for t in new:
            if self.done:
                break
            kept.append(t)
            self.tokens.append(t)
            if t in self.stop_ids:
                self._stop("eos")
            elif len(self.tokens) >= self.max_tokens:
                self._stop("max tokens")
            elif self.stop_strings and any(s in self.tokenizer.decode(self.tokens[-64:]) for s in self.stop_strings):
                self._stop("stop string")
        self.stats.generated_tokens = len(self.tokens)
        return kept

    def _stop(self, reason: str) -> None:
        self.done = True
        self.stats.stop_reason = reason
