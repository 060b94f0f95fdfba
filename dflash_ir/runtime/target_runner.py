"""Drives the target's programs and owns its state, including speculative rollback.

Rollback design: attention KV caches have a fixed capacity and a length (`n_past`); rows
past it are ignored by attention and overwritten by the next write, so trimming attention
is free. A recurrent (Gated DeltaNet) layer's state has no rows to trim: the verify outputs
each such layer's input projections, and `commit(n)` runs the `commit` program, which replays
the layers' recurrence over the first n rows from the states before the verify, with the
kernel the verify ran. Its cost is the recurrence alone (no projections, no attention, no
FFN) over the accepted rows; what a verify keeps for it is those rows' projections
(Qwen3.5-9B, T=16: 16 x 24 x 49 KB = 19 MB in f32) where per-row states would be 0.8 GB
written on every verify. The committed states are then bit for bit a decode's.
"""
from __future__ import annotations

import functools
from typing import Mapping, Sequence

import numpy as np

from dflash_ir.errors import ContextOverflowError
from dflash_ir.program import Program, RunResult

from .state import zero_states

_ON_DEVICE = ("logits", "features")  # read to the host only when asked for


class TargetOutput:
    """One target call's results. Logits and tap features stay where the program wrote them
    (the device, on a device backend) until `logits` / `features` read them: a greedy round
    needs only the `greedy` ids, and the draft injects `device_features` without a copy
    through the host. The device arrays are valid until the same program runs again."""

    def __init__(self, logits, greedy: np.ndarray, features=None):
        self.device_logits = logits        # [rows asked for, vocab]
        self.greedy = greedy               # [rows asked for] argmax ids
        self.device_features = features   # [T, n_taps * hidden] or None without taps

    @functools.cached_property
    def logits(self) -> np.ndarray:
        return np.asarray(self.device_logits)

    @functools.cached_property
    def features(self) -> np.ndarray | None:
        return None if self.device_features is None else np.asarray(self.device_features)

    def to_host(self) -> "TargetOutput":
        """The same results read to the host, before the program's next call reuses its buffers."""
        return TargetOutput(self.logits, self.greedy, self.features)


class TargetRunner:
    def __init__(self, programs: Mapping[str, Program], n_ctx: int):
        self.programs = programs
        self.n_ctx = n_ctx
        self._commit = programs.get("commit")
        # the rows a commit replays: inputs of the commit program, outputs of the verify
        self.replayed = tuple(v.name for v in self._commit.graph.inputs) if self._commit else ()
        self.reset()

    def reset(self) -> None:
        self.states = zero_states(self.programs["prefill"].graph, self.n_ctx)
        self.n_past = 0
        self._pending = None

    def _run(self, kind: str, tokens, logit_rows, keep: tuple[str, ...] = ()) -> tuple[TargetOutput, object]:
        tokens = np.asarray(tokens, np.int32)
        T = len(tokens)
        if self.n_past + T > self.n_ctx:
            raise ContextOverflowError(
                f"context overflow: {self.n_past} cached + {T} new tokens exceed the context size {self.n_ctx}; "
                f"compile with a larger context (dflash-compile -c N) or shorten the prompt")
        inputs = {
            "tokens": tokens,
            "positions": np.arange(self.n_past, self.n_past + T, dtype=np.int32),
            "pos": np.int32(self.n_past),
            "kv_len": np.int32(self.n_past + T),
            "logit_rows": np.asarray(logit_rows, np.int32),
        }
        res = self.programs[kind].run(inputs, self.states, keep=_ON_DEVICE + keep)
        return TargetOutput(res.outputs["logits"], res.outputs["greedy"], res.outputs.get("features")), res

    def prefill(self, tokens, *, chunk: int = 512, all_logits: bool = False) -> TargetOutput:
        """Process prompt rows in chunks; returns the last row's logits (every row's with
        all_logits) and every row's features."""
        tokens = np.asarray(tokens, np.int32)
        if len(tokens) == 0:
            raise ValueError("prefill needs at least one token")
        if self.n_past + len(tokens) > self.n_ctx:
            raise ContextOverflowError(
                f"prompt of {len(tokens)} tokens (+{self.n_past} cached) does not fit the context size {self.n_ctx}; "
                f"compile with a larger context (dflash-compile -c N) or shorten the prompt")
        parts = []
        for s in range(0, len(tokens), chunk):
            part = tokens[s:s + chunk]
            out, res = self._run("prefill", part, np.arange(len(part)) if all_logits else [len(part) - 1])
            self.states = {**self.states, **res.states}
            self.n_past += len(part)
            parts.append(out.to_host() if len(tokens) > chunk else out)  # the next chunk reuses the buffers
        if len(parts) == 1:
            return parts[0]
        return TargetOutput(np.concatenate([p.logits for p in parts]) if all_logits else parts[-1].logits,
                            np.concatenate([p.greedy for p in parts]) if all_logits else parts[-1].greedy,
                            None if parts[0].features is None else np.concatenate([p.features for p in parts]))

    def decode(self, token: int) -> TargetOutput:
        out, res = self._run("decode", [token], [0])
        self.states = {**self.states, **res.states}
        self.n_past += 1
        return out

    def verify(self, tokens) -> TargetOutput:
        """Run a block on top of the committed state; nothing is committed until `commit`."""
        tokens = np.asarray(tokens, np.int32)
        out, res = self._run("verify", tokens, np.arange(len(tokens)), keep=self.replayed)
        self._pending = res
        return out

    def commit(self, n_rows: int) -> None:
        """Keep the first n_rows rows of the last verify: state becomes 'after row n_rows-1'."""
        res = self._pending
        if res is None:
            raise RuntimeError("commit() without a preceding verify()")
        T = len(res.outputs["greedy"])
        if not 1 <= n_rows <= T:
            raise ValueError(f"commit of {n_rows} rows, verify had {T}")
        new = {**self.states, **res.states}
        if self._commit is not None:
            before = {s.value.name: self.states[s.value.name] for s in self._commit.graph.states}
            rows = {name: res.outputs[name][:n_rows] for name in self.replayed}
            layers = [name for name, _ in self._commit.graph.outputs]  # nobody reads them: left on the device
            new.update(self._commit.run(rows, before, keep=layers).states)
        self.states = new
        self.n_past += n_rows
        self._pending = None


def verify_together(runners: Sequence[TargetRunner], blocks: Sequence[Sequence[int]], program: Program
                    ) -> list[TargetOutput]:
    """The blocks of several sequences, one per runner, verified in one pass of a batched
    verify `program` (artifact.batched_verify: sequence j's rows are [j*R, (j+1)*R), its
    inputs and states are named `s<j>.<name>`). Each block is padded to R rows with its last
    token: the padding's KV rows lie past the block, where attention does not look and the
    next write replaces them, and no commit reaches them. Each runner is left as after its
    own `verify(block)`: `commit` keeps its rows' states."""
    S, R = program.graph.meta_dict["slots"], program.graph.values()["s0.positions"].type.shape[0]
    if len(runners) != S or len(blocks) != S:
        raise ValueError(f"{program.graph.name} verifies {S} blocks, got {len(blocks)} for {len(runners)} runners")
    inputs, states = {}, {}
    tokens = np.empty(S * R, np.int32)
    for j, (runner, block) in enumerate(zip(runners, blocks)):
        n = len(block)
        if not 1 <= n <= R:
            raise ValueError(f"{program.graph.name}: a block of {n} tokens; it takes 1..{R}")
        if runner.n_past + R > runner.n_ctx:
            raise ContextOverflowError(
                f"context overflow: {runner.n_past} cached + {R} rows of a batched verify exceed the context size "
                f"{runner.n_ctx}; verify that block alone")
        tokens[j * R:(j + 1) * R] = [*block, *[block[-1]] * (R - n)]
        inputs.update({f"s{j}.positions": np.arange(runner.n_past, runner.n_past + R, dtype=np.int32),
                       f"s{j}.pos": np.int32(runner.n_past), f"s{j}.kv_len": np.int32(runner.n_past + R)})
        states.update({f"s{j}.{name}": value for name, value in runner.states.items()})
    kept = tuple(f"s{j}.{name}" for j, runner in enumerate(runners) for name in runner.replayed)
    res = program.run({"tokens": tokens, **inputs}, states, keep=_ON_DEVICE + kept)
    features = res.outputs.get("features")
    outs = []
    for j, (runner, block) in enumerate(zip(runners, blocks)):
        first, n = j * R, len(block)
        greedy = res.outputs["greedy"][first:first + n]
        runner._pending = RunResult(
            {"greedy": greedy, **{name: res.outputs[f"s{j}.{name}"][:n] for name in runner.replayed}},
            {name: res.states[f"s{j}.{name}"] for name in runner.states}, res.bindings)
        outs.append(TargetOutput(res.outputs["logits"][first:first + n], greedy,
                                 None if features is None else features[first:first + n]))
    return outs
