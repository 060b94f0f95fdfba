"""The cost-aware length (runtime/controller.py): its choice against hand-derived expectations
for given costs and acceptance, and speculative output equal to target-only output whatever
it chooses, on drafts that agree on 0, 5 or 15 proposals per round."""
import json

import pytest

from dflash_ir.artifact import open_engine
from dflash_ir.runtime.controller import EXPLORE, FORGET, PRIOR_ACCEPT, REFRESH, STEP, TRACK, LengthController
from dflash_ir.runtime.costs import SpecCosts

MS = 1e-3
PROMPT = [5, 77, 140, 9, 260, 31, 8, 101, 44, 203, 17, 66, 250, 12, 90, 133]  # >= 15 tokens, no MASK


def _costs(verify_rows, *, decode, draft) -> SpecCosts:
    """Costs in ms; verify_rows(r) is the cost of a verify of r rows, r = 1..16."""
    return SpecCosts(tuple(verify_rows(r) * MS for r in range(1, 17)), decode * MS, draft * MS)


def test_decodes_when_verify_is_costly_and_acceptance_low():
    # decode 1, draft 1, verify of r rows 1 + r: k proposals take 1 + (k + 2) = k + 3 ms for at most
    # k + 1 tokens, under the decode step's 1 token per ms even if every proposal were right
    c = LengthController(_costs(lambda r: 1 + r, decode=1, draft=1))
    assert not c.can_pay(15)
    for _ in range(5):
        c.observe(3, 0)
    assert c.choose(15) == 0


def test_uses_the_longest_block_when_acceptance_is_high_and_verify_cheap():
    # a verify costs one decode step whatever its rows, the draft a tenth: tokens(k) grows with k
    # at a constant cost, so the longest block wins, from the prior on and after full acceptance
    c = LengthController(_costs(lambda r: 1, decode=1, draft=0.1), track=False)
    assert c.choose(15) == 15
    for _ in range(5):
        c.observe(15, 15)
    assert c.choose(15) == 15 and c.choose(6) == 6


def test_choice_follows_the_documented_rate():
    """One round that verified 2 proposals and accepted 1 (prior weight 2, each position's prior
    the estimate before it): p1 = (1 + 2 * 0.75) / 3 = 5/6, p2 = (0 + 2 * 5/6) / 3 = 5/9, and
    p3.. = 5/9 (not observed: their prior alone).
    decode 2 ms, draft 1 ms, verify of r rows 0.5 + 0.5 r ms:
      rate(0) = 1/2                                 = 0.5
      rate(1) = (1 + 5/6) / (1 + 1.5)               = 0.733
      rate(2) = (1 + 5/6 + 25/54) / (1 + 2)         = 0.765
      rate(3) = (1 + 5/6 + 25/54 + 125/486) / 3.5   = 0.730
      rate(4) = (... + 625/4374) / 4                = 0.674, and falling  -> 2
    With a 1 ms decode step, rate(0) = 1 beats every length -> 0."""
    c = LengthController(_costs(lambda r: 0.5 + 0.5 * r, decode=2, draft=1), track=False)
    c.observe(2, 1)
    assert c.acceptance()[:4] == pytest.approx([5 / 6, 5 / 9, 5 / 9, 5 / 9])
    assert [round(r * MS, 3) for r in c.rates(c.acceptance())[:5]] == [0.5, 0.733, 0.765, 0.73, 0.674]
    assert c.choose(15) == 2
    assert LengthController(_costs(lambda r: 0.5 + 0.5 * r, decode=1, draft=1)).choose(15) == 0


def test_a_round_observes_the_accepted_positions_and_the_first_rejection():
    c = LengthController(_costs(lambda r: 1, decode=1, draft=1))
    c.observe(7, 3)  # positions 1..3 right, 4 wrong, 5..7 not seen
    p1 = 2.5 / 3
    p2 = (1 + 2 * p1) / 3
    p3 = (1 + 2 * p2) / 3
    p4 = 2 * p3 / 3
    assert c.acceptance()[:6] == pytest.approx([p1, p2, p3, p4, p4, p4])
    c.observe(2, 2)  # both right, nothing rejected; the earlier round fades by 0.95
    q1 = (0.95 + 1 + 2 * 0.75) / (0.95 + 1 + 2)
    q2 = (0.95 + 1 + 2 * q1) / (0.95 + 1 + 2)
    q3 = (0.95 + 2 * q2) / (0.95 + 2)
    assert c.acceptance()[:4] == pytest.approx([q1, q2, q3, 2 * q3 / (0.95 + 2)])


def test_shadow_drafts_spend_at_most_the_exploration_share_of_decoding():
    # decode 1 ms, draft 1 ms: the first decode step drafts in the shadow (the credit starts at a
    # block), later ones once 0.03 ms per step has paid for the next: n shadow drafts in N steps
    # cost n ms <= 1 + 0.03 N ms, and each comes as soon as it is paid for
    c = LengthController(_costs(lambda r: 1 + r / 4, decode=1, draft=1))
    shadows = _shadows(c, 1000, took=1 * MS)
    assert shadows[0] and not any(shadows[1:33])
    assert int(EXPLORE * 1000) <= shadows.count(True) <= 1 + EXPLORE * 1000
    assert not any(c.decoding(idle=False) for _ in range(100))  # one block is scored at a time


def _shadows(c: LengthController, steps: int, took: float, step_seconds: float | None = None) -> list[bool]:
    """Decode steps booked one after another; each shadow draft reports it took `took` s, and
    each step `step_seconds` when given."""
    shadows = []
    for _ in range(steps):
        shadows.append(c.decoding(idle=True))
        if shadows[-1]:
            c.shadow_took(took)
        if step_seconds is not None:
            c.observe_seconds(0, step_seconds)
    return shadows


def test_a_shadow_draft_is_charged_what_it_took():
    """The table says a draft block takes 1 ms; the shadow drafts really take 3 (the injects of
    the rows decoded since the last one come first): they come a third as often, so they still
    spend at most EXPLORE of the decoding time."""
    c = LengthController(_costs(lambda r: 1 + r / 4, decode=1, draft=1))
    shadows = _shadows(c, 3000, took=3 * MS)
    assert 3 * shadows.count(True) <= 1 + EXPLORE * 3000 + 3


def test_decode_steps_between_rounds_keep_the_draft_context_whole(agreeing_pair, scripted_lengths):
    """Rows committed by decode steps reach the draft's context before the next round: the
    copy draft reads positions back from the anchor, so a gap or a misordered row would
    change what it proposes, and every round still accepts min(5, k)."""
    engine = open_engine(*agreeing_pair("qwen35", 5), n_ctx=96)
    script = [0, 0, 7, 0, 3, 0, 0, 0, 7, 7, 0, 2, 0]
    plain = engine.generate(prompt_ids=PROMPT, max_tokens=40, speculative=False, ignore_eos=True).tokens
    engine.controller = scripted_lengths(script + [6] * 40)
    gen = engine.generate(prompt_ids=PROMPT, max_tokens=40, ignore_eos=True)
    assert gen.tokens == plain and gen.stats.lengths[:len(script)] == script
    assert [r["accepted"] for r in gen.rounds] == [min(5, len(r["proposals"])) for r in gen.rounds]
    assert gen.stats.decode_steps == script.count(0) and gen.stats.policy == "cost-aware"
    assert f"proposals verified per step (cost-aware): decode:{gen.stats.decode_steps} 2:1 3:1 6:" in gen.stats.summary()


def test_a_draft_that_agrees_is_found_by_drafting_in_the_shadow(agreeing_pair):
    """decode 1 ms, draft 1 ms, verify of r rows 1 + r/4 ms: the prior (tokens(15) = 3.96 in 6 ms)
    says decode. The first decode step drafts a block in the shadow; the next 15 decoded tokens
    all match it, and with that evidence 15 proposals pay (about 10.5 tokens in 6 ms)."""
    engine = open_engine(*agreeing_pair("qwen35", 15), n_ctx=128)
    plain = engine.generate(prompt_ids=PROMPT, max_tokens=60, speculative=False, ignore_eos=True).tokens
    engine.costs = _costs(lambda r: 1 + r / 4, decode=1, draft=1)
    engine.controller.track = False  # the policy under these costs, not this machine's times
    gen = engine.generate(prompt_ids=PROMPT, max_tokens=60, ignore_eos=True)
    assert gen.tokens == plain
    assert gen.stats.lengths[:15] == [0] * 15 and set(gen.stats.lengths[15:]) == {15}
    assert gen.stats.shadow_drafts == 1 and "shadow drafts: 1" in gen.stats.summary()


# a GPU-like device: a verify costs about one decode step plus a little per row, the draft a fifth
CHEAP_VERIFY = _costs(lambda r: 1 + 0.1 * r, decode=1, draft=0.2)


@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe"])
@pytest.mark.parametrize("agree, settles_in", [(0, {0}), (5, {5, 6}), (15, {15})])
def test_cost_aware_greedy_equals_target_only(agreeing_pair, arch, agree, settles_in):
    """With verify cheap, the controller settles where the draft stops agreeing: decoding for a
    draft that is never right, 5 for one right 5 times per round (and now and then 6, as the
    estimate of position 6 fades back towards the prior), the longest block for one always right."""
    engine = open_engine(*agreeing_pair(arch, agree), n_ctx=128)
    plain = engine.generate(prompt_ids=PROMPT, max_tokens=60, speculative=False, ignore_eos=True).tokens
    engine.costs = CHEAP_VERIFY
    engine.controller.track = False
    gen = engine.generate(prompt_ids=PROMPT, max_tokens=60, ignore_eos=True)
    assert gen.tokens == plain
    assert set(gen.stats.lengths[-4:]) <= settles_in, gen.stats.lengths
    assert all(r["accepted"] == min(agree, len(r["proposals"])) for r in gen.rounds)


def test_when_speculation_cannot_pay_the_draft_is_left_alone(agreeing_pair):
    engine = open_engine(*agreeing_pair("qwen35", 15), n_ctx=96)
    engine.costs = _costs(lambda r: 1 + r, decode=1, draft=1)
    gen = engine.generate(prompt_ids=PROMPT, max_tokens=20, ignore_eos=True)
    assert gen.stats.lengths == [0] * 19 and gen.stats.rounds == 0
    assert engine.draft.ctx_len == 0  # no context kept for a draft that will not run


def test_observed_round_times_correct_a_cost_table_measured_under_load():
    """A table measured while the machine was busy: decode 166 ms, a verify of r rows 100 + 5.4 r
    (barely more than a decode step), draft 35. The first step decodes, to time one, and the
    machine is still busy: 166 ms. So the controller speculates; then the load goes: a round
    takes 150 ms, a decode step would take 35, and the draft is never right. Within REFRESH
    rounds it times a decode step again, sees 35 ms, and decodes from then on."""
    c = LengthController(_costs(lambda r: 100 + 5.4 * r, decode=166, draft=35))
    c.warm[:] = True  # (first calls at each length, which are not counted, made before)
    choices = []
    for step in range(3 * REFRESH):
        k = c.choose(15)
        choices.append(k)
        c.observe_seconds(k, 150 * MS if k else (166 if step == 0 else 35) * MS)
        if k:
            c.observe(k, 0)
    assert choices[0] == 0 and choices[1] > 0
    assert choices.index(0, 1) <= 1 + REFRESH
    assert set(choices[choices.index(0, 1):]) == {0}


def test_without_tracking_the_table_alone_decides():
    c = LengthController(_costs(lambda r: 100 + 5.4 * r, decode=166, draft=35), track=False)
    for _ in range(3):
        c.observe_seconds(0, 35 * MS)
    assert c.choose(15) > 0 and c.seconds[0] == pytest.approx(166 * MS)


def test_unobserved_lengths_follow_the_shared_factor_and_observed_ones_their_own_mean():
    c = LengthController(_costs(lambda r: 10, decode=10, draft=10))  # every round 20 ms, decode 10 ms
    c.warm[:] = True  # (first calls at each length, which are not counted, made before)
    assert c.seconds[0] == pytest.approx(10 * MS) and c.seconds[5] == pytest.approx(20 * MS)
    c.observe_seconds(5, 40 * MS)  # a round twice the table: its first observation replaces the table's
    assert c.seconds[5] == pytest.approx(40 * MS)  # and the unobserved lengths move part of the way
    assert c.seconds[3] == pytest.approx(20 * MS * 2 ** TRACK) and c.seconds[0] == pytest.approx(10 * MS * 2 ** TRACK)
    c.observe_seconds(5, 400 * MS)  # a hiccup ten times that: the estimate moves by STEP at most
    assert c.seconds[5] == pytest.approx(40 * MS * STEP)
    for _ in range(FORGET):  # decode steps at the table's time: the rounds' observations are forgotten
        c.observe_seconds(0, 10 * MS)
    assert c.seconds[0] == pytest.approx(10 * MS, rel=1e-3)
    assert c.seconds[5] == pytest.approx(20 * MS) and c.seconds[3] == pytest.approx(20 * MS)


def test_rounds_timed_in_a_busy_moment_do_not_keep_it_decoding():
    """Decode 1 ms, a round of 15 proposals 3 ms by the table, and the draft always right. For
    12 rounds the machine is busy (200 ms a round): it turns to decoding. Decode steps take
    their usual 1 ms again; FORGET steps after the last round was timed its estimate is the
    table's scaled by the recent observations (the decode steps: the table's own) again, so
    it speculates again, and stays at it (but for a decode step timed every REFRESH rounds)."""
    c = LengthController(_costs(lambda r: 2, decode=1, draft=1))
    c.warm[:] = True  # (first calls at each length, which are not counted, made before)
    busy, choices = 12, []
    for _ in range(300):
        k = c.choose(15)
        choices.append(k)
        c.observe_seconds(k, (200 if busy else 3) * MS if k else 1 * MS)
        if k:
            busy = max(0, busy - 1)
            c.observe(k, k)
        else:
            c.observe(15, 15)  # what shadow drafts would report: every proposal right
    assert choices[1:30].count(0) >= 10  # the busy rounds made it decode (and try other lengths)
    assert set(choices[-40:]) == {0, 15} and choices[-40:].count(0) <= 40 // REFRESH  # it came back


def test_the_first_call_at_a_length_is_not_counted():
    c = LengthController(_costs(lambda r: 2, decode=1, draft=1))
    c.observe_seconds(15, 500 * MS)
    c.observe_seconds(0, 500 * MS)
    assert c.seconds[15] == pytest.approx(3 * MS) and c.seconds[0] == pytest.approx(1 * MS)


def test_a_draft_that_is_seldom_right_is_not_retried():
    """A round of 15 costs 6 decode steps and the draft is never right: it decodes, and the
    forgotten round estimates (the table's, which are right) never make a round look worth it."""
    c = LengthController(_costs(lambda r: 5, decode=1, draft=1))
    for _ in range(5):
        c.observe(15, 0)
    choices = []
    for _ in range(200):
        k = c.choose(15)
        choices.append(k)
        c.observe_seconds(k, (6 if k else 1) * MS)
    assert set(choices) == {0}


def test_shadow_drafts_are_paid_from_the_decode_time_observed():
    """A table measured under load: decode 30 ms, draft 4 ms; really a decode step takes 1 ms.
    Paid from the table's decode time, a shadow draft would come every 4 / (0.03 x 30) = 4.4
    steps (the demo spent a third of its time on them); paid from the observed 1 ms, once the
    first two calls are done, one comes every 4 / 0.03 = 133 steps."""
    c = LengthController(_costs(lambda r: 5, decode=30, draft=4))
    assert _shadows(c, 200, took=4 * MS, step_seconds=1 * MS).count(True) <= 3


def test_a_controller_starts_from_the_acceptance_an_earlier_one_learned(agreeing_pair, tmp_path):
    """A draft that is never right, verify cheap: a fresh controller believes the prior and
    speculates until its rounds teach it otherwise; an engine loaded later with the first one's
    acceptance file decodes from its first step (drafting in the shadow) and the output stays
    target-only's."""
    memory = tmp_path / "acceptance.json"
    runs = []
    for _ in range(2):
        engine = open_engine(*agreeing_pair("qwen35", 0), n_ctx=128)
        plain = engine.generate(prompt_ids=PROMPT, max_tokens=40, speculative=False, ignore_eos=True).tokens
        engine.costs = CHEAP_VERIFY
        engine.controller.track = False
        engine.remember_acceptance(memory)
        recalled = engine.controller.acceptance()
        gen = engine.generate(prompt_ids=PROMPT, max_tokens=40, ignore_eos=True)
        assert gen.tokens == plain
        runs.append((recalled, gen.stats.lengths, engine.controller.learned()))
    (fresh, first, learned), (recalled, second, _) = runs
    assert fresh.tolist() == [PRIOR_ACCEPT] * 15 and first[0] > 0
    expected = LengthController(CHEAP_VERIFY)
    assert expected.recall(learned) and recalled.tolist() == expected.acceptance().tolist()
    assert second[0] == 0 and set(second) == {0}


def test_fixed_length_rounds_teach_the_acceptance_too(agreeing_pair):
    """A draft that is never right: after one generation of n_max proposals every round, the
    cost-aware length decodes from its first step, where a fresh controller (the prior) would
    first speculate to find out."""
    engine = open_engine(*agreeing_pair("qwen35", 0), n_ctx=128)
    plain = engine.generate(prompt_ids=PROMPT, max_tokens=30, speculative=False, ignore_eos=True).tokens
    engine.costs = CHEAP_VERIFY
    engine.controller.track = False
    assert engine.controller.acceptance().tolist() == [PRIOR_ACCEPT] * 15
    fixed = engine.generate(prompt_ids=PROMPT, max_tokens=30, adaptive=False, ignore_eos=True)
    assert fixed.tokens == plain and set(fixed.stats.lengths) == {15}
    assert engine.controller.acceptance()[0] < PRIOR_ACCEPT / 2
    gen = engine.generate(prompt_ids=PROMPT, max_tokens=30, ignore_eos=True)
    assert gen.tokens == plain and set(gen.stats.lengths) == {0}


@pytest.mark.parametrize("learned", [{"trials": [1.0] * 3, "hits": [0.0] * 3},           # another block size
                                     {"trials": [1.0] * 15, "hits": [2.0] * 15},          # hits > trials
                                     {"trials": [float("nan")] * 15, "hits": [0.0] * 15},
                                     {"trials": [30.0] * 15, "hits": [0.0] * 15},         # more than DECAY leaves
                                     {"trials": "x", "hits": [0.0] * 15}, {"hits": [0.0] * 15}])
def test_recall_takes_nothing_that_does_not_fit(learned):
    c = LengthController(CHEAP_VERIFY)
    assert not c.recall(learned)
    assert c.acceptance().tolist() == [PRIOR_ACCEPT] * 15 and not c.trials.any()


def test_an_unreadable_acceptance_file_is_ignored_then_replaced(agreeing_pair, tmp_path):
    memory = tmp_path / "acceptance.json"
    memory.write_text("{not json")
    engine = open_engine(*agreeing_pair("qwen35", 0), n_ctx=96)
    engine.costs = CHEAP_VERIFY
    engine.remember_acceptance(memory)
    assert engine.controller.acceptance().tolist() == [PRIOR_ACCEPT] * 15
    engine.generate(prompt_ids=PROMPT, max_tokens=20, ignore_eos=True)
    assert json.loads(memory.read_text()) == engine.controller.learned()
