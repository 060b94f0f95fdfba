"""Slots on one set of compiled programs (OpenCL): interleaved round by round, each sequence's
output equals its single-client greedy result; cancel, queue bound, a failing job."""
import time

import pytest

from dflash_ir.artifact import VERIFY_SLOTS, batched_verify
from dflash_ir.serve.scheduler import Failed, Finished, Job, QueueFull, Scheduler, Tokens


class Recorder:
    """Delivered events of several jobs, in the order they came, and when."""

    def __init__(self):
        self.events: list[tuple[int, object]] = []
        self.times: list[float] = []  # time.perf_counter() at each delivery

    def job(self, key: int, prompt_ids, **options) -> Job:
        return Job(list(prompt_ids), {"ignore_eos": True, **options}, lambda ev: self._deliver(key, ev))

    def _deliver(self, key: int, event) -> None:
        self.events.append((key, event))
        self.times.append(time.perf_counter())

    def tokens(self, key: int) -> list[int]:
        return [t for k, ev in self.events if k == key and isinstance(ev, Tokens) for t in ev.ids]

    def ends(self, key: int) -> list[object]:
        return [ev for k, ev in self.events if k == key and isinstance(ev, (Finished, Failed))]


def run_all(scheduler: Scheduler, limit: int = 500) -> int:
    for steps in range(limit):
        if not scheduler.step():
            return steps
    raise AssertionError("the scheduler did not become idle")


@pytest.fixture(scope="module")
def prompt_ids(engine, prompts):
    return [engine.tokenizer.encode(p) for p in prompts[:4]]


def drafts(rounds) -> dict[int, list[int]]:
    return {r["anchor_pos"]: r["proposals"] for r in rounds}


def test_each_batched_verify_runs_once_before_the_first_request(engine, monkeypatch):
    """So that PoCL builds its kernels (seconds) before a request waits on them."""
    calls = []
    for size in VERIFY_SLOTS:
        program = engine.target.programs[batched_verify(size)]
        monkeypatch.setattr(program, "run", lambda *a, _run=program.run, _size=size, **kw: (calls.append(_size),
                                                                                           _run(*a, **kw))[1])
    scheduler = Scheduler(engine, n_slots=max(VERIFY_SLOTS), queue_size=0)
    assert sorted(calls) == sorted(VERIFY_SLOTS)
    assert all(slot.target.n_past == 0 and slot.target._pending is None for slot in scheduler.slots)
    calls.clear()
    Scheduler(engine, n_slots=max(VERIFY_SLOTS), queue_size=0, batch=False)
    assert calls == []


@pytest.mark.parametrize("batch", [True, False])
def test_two_slots_each_equal_their_single_client_result(engine, prompt_ids, batch):
    two_slots(engine, prompt_ids, batch)


def two_slots(engine, prompt_ids, batch: bool) -> None:
    """Two slots, their blocks verified together (`batch`) or slot after slot."""
    single = [engine.generate(prompt_ids=i, max_tokens=48, ignore_eos=True) for i in prompt_ids[:2]]
    rec = Recorder()
    scheduler = Scheduler(engine, n_slots=2, queue_size=0, batch=batch)
    for k in range(2):
        scheduler.submit(rec.job(k, prompt_ids[k], max_tokens=48))
    run_all(scheduler)
    assert [rec.tokens(k) for k in range(2)] == [g.tokens for g in single]
    for slot, alone in zip(scheduler.slots, single):  # job k ran in slot k
        # the draft saw the same context (its features were not overwritten by the other slot):
        # wherever both runs drafted, they proposed the same tokens
        ours, theirs = drafts(slot.state.engine.last_rounds), drafts(alone.rounds)
        common = ours.keys() & theirs.keys()
        assert common
        for pos in common:
            n = min(len(ours[pos]), len(theirs[pos]))
            assert ours[pos][:n] == theirs[pos][:n], pos
    order = [k for k, ev in rec.events if isinstance(ev, Tokens)]
    assert order[:6] == [0, 1, 0, 1, 0, 1]  # round by round, alternating
    ends = [ev for _, ev in rec.events if isinstance(ev, (Finished, Failed))]
    assert [type(e) for e in ends] == [Finished, Finished] and all(e.stats.generated_tokens == 48 for e in ends)
    for k in range(2):  # a step per Tokens event: the prefill, then at least one per round
        (end,) = rec.ends(k)
        assert end.steps == order.count(k) >= 1 + end.stats.rounds
    rounds = sum(e.stats.rounds for e in ends)
    assert scheduler.verified_blocks == rounds
    if batch:  # both slots' blocks in one pass while both were in a round: a pass per round of the longer job
        assert scheduler.verify_passes == max(e.stats.rounds for e in ends) < rounds
    else:
        assert scheduler.verify_passes == rounds
        # the generation's wall time includes the other slot's turns: the first to finish took
        # turns all along, so its time spans its first tokens to the other's last before its end
        # (a bound by the order of events: its clock starts before the first and stops after the last)
        finish = next(i for i, (_, ev) in enumerate(rec.events) if isinstance(ev, Finished))
        key = rec.events[finish][0]
        first = next(i for i, (k, ev) in enumerate(rec.events) if k == key and isinstance(ev, Tokens))
        other = max(i for i, (k, _) in enumerate(rec.events[:finish]) if k != key)
        assert first < other
        assert ends[0].predicted_seconds >= rec.times[other] - rec.times[first]


@pytest.mark.parametrize("batch", [True, False])
@pytest.mark.parametrize("skip", ["own_states", "own_features"])
def test_without_each_copy_the_slots_corrupt_each_other(engine, prompt_ids, monkeypatch, skip, batch):
    """Why the copies exist: sharing the programs' buffers, one slot's run overwrites the
    other's states (wrong tokens) or tap features (the draft sees the wrong context). Prompts
    of one length, so both prefills run in the same buffers (a program keeps a set per size)."""
    import dflash_ir.serve.slot_state as slot_state

    shortest = min(len(i) for i in prompt_ids[:2])
    same_length = [i[:shortest] for i in prompt_ids[:2]]
    two_slots(engine, same_length, batch)  # with the copies: each equal to its single-client result
    owner = slot_state.SlotEngine if skip == "own_states" else slot_state.SlotTargetRunner
    monkeypatch.setattr(owner, skip, lambda self, out=None: out)
    with pytest.raises(AssertionError):
        two_slots(engine, same_length, batch)


def test_more_jobs_than_slots_with_different_lengths(engine, prompt_ids):
    lengths = [20, 48, 7, 33]
    want = [engine.generate(prompt_ids=i, max_tokens=n, ignore_eos=True).tokens for i, n in zip(prompt_ids, lengths)]
    rec = Recorder()
    scheduler = Scheduler(engine, n_slots=2, queue_size=2)
    for k, (i, n) in enumerate(zip(prompt_ids, lengths)):
        scheduler.submit(rec.job(k, i, max_tokens=n))
    run_all(scheduler)
    assert [rec.tokens(k) for k in range(4)] == want
    assert scheduler.busy_slots == 0 and scheduler.queued == 0


def one_slot_two_jobs(engine, prompt_ids, lengths):
    """A one-slot scheduler with a running job and a waiting one."""
    rec = Recorder()
    scheduler = Scheduler(engine, n_slots=1, queue_size=1)
    jobs = [rec.job(k, prompt_ids[k], max_tokens=n) for k, n in enumerate(lengths)]
    for job in jobs:
        scheduler.submit(job)
    return rec, scheduler, jobs


def test_a_cancelled_job_frees_its_slot_before_its_next_round(engine, prompt_ids):
    rec, scheduler, (gone, waiting) = one_slot_two_jobs(engine, prompt_ids, (400, 10))
    scheduler.step()
    scheduler.step()
    assert gone.steps == 2 and waiting.steps == 0
    scheduler.cancel(gone)
    scheduler.step()  # drops `gone` without running it, then the waiting job takes the slot next cycle
    assert gone.steps == 2 and rec.ends(0) == []
    run_all(scheduler)
    assert gone.steps == 2
    assert rec.tokens(1) == engine.generate(prompt_ids=prompt_ids[1], max_tokens=10, ignore_eos=True).tokens


def test_a_cancelled_waiting_job_never_runs(engine, prompt_ids):
    rec, scheduler, (_, second) = one_slot_two_jobs(engine, prompt_ids, (5, 5))
    scheduler.cancel(second)
    assert scheduler.queued == 1
    run_all(scheduler)
    assert second.steps == 0 and rec.tokens(1) == [] and len(rec.tokens(0)) == 5


def test_the_queue_is_bounded(engine, prompt_ids):
    rec = Recorder()
    scheduler = Scheduler(engine, n_slots=2, queue_size=1)
    for k in range(3):  # two for the free slots, one waiting
        scheduler.submit(rec.job(k, prompt_ids[k], max_tokens=4))
    with pytest.raises(QueueFull, match="2 slots are busy and 1 requests are waiting"):
        scheduler.submit(rec.job(3, prompt_ids[3], max_tokens=4))
    run_all(scheduler)
    scheduler.submit(rec.job(3, prompt_ids[3], max_tokens=4))  # room again
    run_all(scheduler)
    assert all(len(rec.tokens(k)) == 4 for k in range(4))


def test_an_engine_error_fails_only_its_job(engine, prompt_ids):
    rec = Recorder()
    scheduler = Scheduler(engine, n_slots=2, queue_size=0)
    scheduler.submit(rec.job(0, prompt_ids[0], max_tokens=12))
    scheduler.submit(rec.job(1, prompt_ids[1], max_tokens=12, n_max=99))
    run_all(scheduler)
    (failed,) = rec.ends(1)
    assert isinstance(failed, Failed) and "n_max must be in 1..15" in failed.message
    assert rec.tokens(0) == engine.generate(prompt_ids=prompt_ids[0], max_tokens=12, ignore_eos=True).tokens
    assert scheduler.busy_slots == 0


def test_slot_count_and_queue_size_are_checked(engine):
    with pytest.raises(ValueError, match="at least 1"):
        Scheduler(engine, n_slots=0, queue_size=1)
    with pytest.raises(ValueError, match="queue size"):
        Scheduler(engine, n_slots=1, queue_size=-1)


def test_zero_tokens_reads_the_prompt_only(engine, prompt_ids):
    rec = Recorder()
    scheduler = Scheduler(engine, n_slots=1, queue_size=0)
    scheduler.submit(rec.job(0, prompt_ids[0], max_tokens=0))
    run_all(scheduler)
    (end,) = rec.ends(0)
    assert rec.tokens(0) == [] and isinstance(end, Finished)
    assert (end.stats.prompt_tokens, end.stats.generated_tokens) == (len(prompt_ids[0]), 0)


def test_a_jobs_end_is_delivered_once_its_slot_is_free(engine, prompt_ids):
    """The HTTP answer goes out when the end is delivered: a client that has it must find the
    slot free and the request no longer processing (llama-server's /metrics, /slots)."""
    scheduler = Scheduler(engine, n_slots=1, queue_size=1)
    busy_at_end = []

    def deliver(event):
        if isinstance(event, (Finished, Failed)):
            busy_at_end.append((type(event).__name__, scheduler.busy_slots))
    scheduler.submit(Job(list(prompt_ids[0]), {"ignore_eos": True, "max_tokens": 5}, deliver))
    scheduler.submit(Job(list(prompt_ids[1]), {"ignore_eos": True, "max_tokens": 5, "n_max": 99}, deliver))
    run_all(scheduler)
    assert busy_at_end == [("Finished", 0), ("Failed", 0)]


def test_slots_propose_through_a_reduced_draft_head(agreeing_pair, tmp_path):
    """A slot's draft maps its proposals through the draft's d2t as the engine's does: with a
    head that holds the text, every round of a draft agreeing on 5 accepts 5 (the interpreter)."""
    import numpy as np

    from dflash_ir.artifact import open_engine
    from dflash_ir.models.draft_vocab import reduced_draft_plan
    from dflash_ir.models.generator import TINY_MASK_ID, write_gguf
    from dflash_ir.models.gguf_file import open_gguf

    target, draft = agreeing_pair("qwen35", 5)
    prompt = [5, 77, 140, 9, 260, 31, 8, 101, 44, 203, 17, 66, 250, 12, 90, 133]
    ids = np.array(sorted(set(prompt) | {TINY_MASK_ID}), np.int64)
    reduced = write_gguf(tmp_path / "reduced.gguf", reduced_draft_plan(open_gguf(draft), open_gguf(target), ids))
    rec = Recorder()
    scheduler = Scheduler(open_engine(target, reduced, n_ctx=96), n_slots=2, queue_size=0, batch=False)
    for k in range(2):
        scheduler.submit(rec.job(k, prompt, max_tokens=20, n_max=7))
    run_all(scheduler)
    assert [type(e) for k in range(2) for e in rec.ends(k)] == [Finished, Finished]
    assert {r["accepted"] for slot in scheduler.slots for r in slot.state.engine.last_rounds} == {5}
