"""The drafter's cost model and the step timings it reads, without a model."""

from types import SimpleNamespace

import pytest

from graphrt.runner.graph_key import GraphKey
from graphrt.runner.step_times import StepTimes
from graphrt.sampling_params import SamplingParams
from graphrt.spec import SpeculativeConfig
from graphrt.spec.drafter import Drafter

CONFIG = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})


def decoding(rid, tokens, accepted=0, misses=0, prefill=False):
    return SimpleNamespace(
        request_id=rid,
        all_token_ids=tokens,
        num_tokens=len(tokens),
        num_computed_tokens=len(tokens) - (5 if prefill else 1),
        output_token_ids=[],
        params=SamplingParams(max_tokens=100, temperature=0.7, top_k=5),
        num_draft_tokens=accepted + 3 * misses,
        num_accepted_tokens=accepted,
        num_draft_misses=misses,
        draft_token_ids=[],
    )


REPEATS = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]  # proposes [3, 4, 1]


def test_unmeasured_costs_take_drafts_and_filtered_random_rows_draft():
    reqs = [decoding("a", REPEATS), decoding("b", [9, 8, 7])]
    Drafter(CONFIG).propose_for(reqs, {"a": 0, "b": 0}, 1000)
    assert reqs[0].draft_token_ids == [3, 4, 1] and reqs[1].draft_token_ids == []


@pytest.mark.parametrize(
    "ratio, accepted, misses, takes",
    [
        (1.4, 0, 0, True),  # nothing scored yet: all three drafts count, 3 > 0.4
        (1.4, 30, 10, True),  # a = 32/42: expects 1.78 > 0.4
        (1.4, 4, 36, False),  # a = 6/42: expects 0.17 < 0.4
        (1.3, 0, 6, True),  # six misses, none accepted: a = 2/8 still expects 0.33 > 0.3
        (1.3, 0, 7, False),  # the seventh: a = 2/9 expects 0.28 < 0.3
        (3.0, 38, 2, False),  # a = 40/42: expects 2.72 < 4 (two rows x (3 - 1)), the other row drafts nothing
    ],
)
def test_drafts_are_taken_when_expected_accepted_tokens_pay_for_the_verify_step(ratio, accepted, misses, takes):
    reqs = [decoding("a", REPEATS, accepted, misses)]
    if ratio == 3.0:
        reqs.append(decoding("b", [9, 8, 7], 0, 40))  # a second decoding row that finds no draft
    Drafter(CONFIG, cost_ratio=lambda rows: ratio).propose_for(reqs, {r.request_id: 0 for r in reqs}, 1000)
    assert (reqs[0].draft_token_ids == [3, 4, 1]) is takes
    assert all(r.draft_token_ids == [] for r in reqs[1:])


def test_prefill_rows_and_untracked_rows_do_not_draft_and_room_caps_drafts():
    reqs = [decoding("a", REPEATS, prefill=True), decoding("b", REPEATS), decoding("c", REPEATS)]
    Drafter(CONFIG).propose_for(reqs, {"a": 0, "b": 0}, max_model_len=len(REPEATS) + 3)
    assert reqs[0].draft_token_ids == [] and reqs[2].draft_token_ids == []
    assert reqs[1].draft_token_ids == [3, 4]  # max_model_len leaves room for two drafts + one token


def test_step_times_skip_warm_up_and_take_the_median_of_the_last_few():
    times, main, verify = StepTimes(skip=2, window=3), GraphKey("main", 8, 8), GraphKey("verify", 32, 8)
    for t in (9.0, 9.0, 1.0, 3.0):
        times.record(main, t)
    assert times.ratio(verify, main) is None
    for t in (50.0, 4.0):
        times.record(verify, t)
    assert times.ratio(verify, main) is None  # only warm-up steps so far
    times.record(verify, 4.0)
    assert times.seconds[main] == 2.0 and times.ratio(verify, main) == 2.0
    times.record(main, 269.0)  # one slow step (a host pause) does not move the median
    assert times.seconds[main] == 3.0
    times.record(main, 5.0)
    times.record(main, 5.0)
    assert times.seconds[main] == 5.0  # the window holds the last three: 269, 5, 5


def test_step_times_seeded_by_replaying_graphs_then_taken_over_by_steps():
    calls = []
    main, verify, other = GraphKey("main", 1, 1), GraphKey("verify", 2, 1), GraphKey("main", 8, 8)
    times = StepTimes(skip=1)
    times.seed({main: lambda: calls.append("main"), verify: lambda: calls.append("verify")}, [main, verify, other])
    assert calls == ["main"] * 3 + ["verify"] * 3  # one untimed replay, then two timed
    assert times.seconds[main] > 0 and times.seconds[verify] > 0 and other not in times.seconds  # no graph
    times.seconds[main] = 2.0
    times.seed({main: lambda: calls.append("again")}, [main])
    assert "again" not in calls  # a key with a time keeps it
    times.record(main, 100.0)  # a first step: left out
    assert times.seconds[main] == 2.0
    times.record(main, 4.0)
    assert times.seconds[main] == 4.0  # measured steps replace the seeded replay


def test_a_time_older_than_stale_steps_starts_its_key_anew_and_mtp_steps_do_not_age_it():
    times = StepTimes(skip=0, window=5, stale=4)
    main, verify, mtp = GraphKey("main", 8, 8), GraphKey("verify", 32, 8), GraphKey("mtp", 8, 8)
    for _ in range(3):
        times.record(main, 36.0)  # long context
    for _ in range(10):
        times.record(mtp, 1.0)
    assert times.age(main) == 0 and not times.is_stale(main)  # MTP steps run beside engine steps
    for _ in range(4):
        times.record(verify, 46.0)
    assert times.age(main) == 4 and not times.is_stale(main)
    times.record(verify, 46.0)
    assert times.is_stale(main) and times.seconds[main] == 36.0  # kept, but marked
    times.record(main, 6.0)  # the short context's: the old window is gone
    assert times.seconds[main] == 6.0 and not times.is_stale(main)


def _engine_with(times: StepTimes, keys: tuple, mtp_module=None):
    """What LLMEngine._verify_cost_ratio reads of its engine."""
    return SimpleNamespace(
        graphs=SimpleNamespace(decode_keys=lambda rows: keys, key_for=lambda kind, t, r: keys[2]),
        runner=SimpleNamespace(step_times=times),
        mtp_module=mtp_module,
    )


def test_drafts_stop_paying_when_the_context_shrinks_and_a_plain_step_finds_out():
    """A long prompt, then chat prompts, at eight rows: the main time measured at the long
    context makes a verify step look cheap; once it is `stale` steps old the engine decodes one
    step plainly, measures the short context's main step, and the drafts stop."""
    from graphrt.engine import LLMEngine

    keys = (GraphKey("main", 8, 8), GraphKey("verify", 32, 8), GraphKey("mtp", 32, 8))
    times = StepTimes(skip=0, stale=32)
    engine = _engine_with(times, keys)
    drafter = Drafter(CONFIG, cost_ratio=lambda rows: LLMEngine._verify_cost_ratio(engine, rows))
    for _ in range(5):
        times.record(keys[0], 0.036)  # 36 ms a main step at 2,100 tokens of context
    times.record(keys[1], 0.046)  # and a short-context verify step: 1.3 main steps, it seems
    steps = {"verify": 0, "main": 0}
    for _ in range(80):
        reqs = [decoding(str(i), REPEATS, accepted=1, misses=3) for i in range(8)]  # a = 0.5: 0.88 each
        drafter.propose_for(reqs, {r.request_id: 0 for r in reqs}, 1000)
        kind = "verify" if any(r.draft_token_ids for r in reqs) else "main"
        steps[kind] += 1
        times.record(keys[0 if kind == "main" else 1], 0.006 if kind == "main" else 0.046)
    assert steps["verify"] == 32  # until the main time was stale: then one plain step, and no drafts since
    assert LLMEngine._verify_cost_ratio(engine, 8) == pytest.approx(0.046 / 0.006)


def test_the_verify_cost_ratio_counts_a_stale_or_missing_main_time_as_untimed():
    from graphrt.engine import LLMEngine

    keys = (GraphKey("main", 1, 1), GraphKey("verify", 4, 1), GraphKey("mtp", 4, 1))
    times = StepTimes(skip=0, stale=2)
    engine = _engine_with(times, keys)
    assert LLMEngine._verify_cost_ratio(engine, 1) == float("inf")  # no main time: plain steps first
    times.record(keys[0], 2.0)
    assert LLMEngine._verify_cost_ratio(engine, 1) == 1.0  # no verify time: drafts taken to time it
    times.record(keys[1], 3.0)
    assert LLMEngine._verify_cost_ratio(engine, 1) == 1.5
    times.record(keys[1], 3.0)
    times.record(keys[1], 3.0)
    assert LLMEngine._verify_cost_ratio(engine, 1) == float("inf")  # three verify steps since the last main
    mtp_engine = _engine_with(times, keys, mtp_module=object())
    times.record(keys[0], 2.0)
    assert LLMEngine._verify_cost_ratio(mtp_engine, 1) == 1.0  # the MTP step's time still unknown
    times.record(keys[2], 1.0)
    assert LLMEngine._verify_cost_ratio(mtp_engine, 1) == 2.0  # (3 + 1) / 2


def test_mtp_requests_leave_the_mtp_layer_when_drafting_cannot_pay():
    from graphrt.spec.drafter import MTPDrafter

    drafter = MTPDrafter(SpeculativeConfig.from_dict({"method": "mtp", "num_speculative_tokens": 2}))
    fresh, failing, good = decoding("a", REPEATS), decoding("b", REPEATS, 2, 20), decoding("c", REPEATS, 36, 2)
    drafter.per_row_need = float("inf")  # plain steps untimed: everyone stays
    assert all(drafter.wants_mtp(r) for r in (fresh, failing, good))
    drafter.per_row_need = 1.2  # drafting costs 2.2 main steps a row
    assert drafter.wants_mtp(fresh) and drafter.wants_mtp(good)  # nothing scored: 2 > 1.2; a = 38/40: 1.85
    assert not drafter.wants_mtp(failing)  # a = 4/24: 0.19
    drafter.per_row_need = 2.5  # now not even two right drafts pay
    assert not drafter.wants_mtp(fresh) and not drafter.wants_mtp(good)
    drafter.per_row_need = 0.0
    assert not drafter.wants_mtp(failing)  # once left, for good (its MTP cache has gaps since)
    drafter.forget("b", finished=True)
    assert drafter.wants_mtp(failing)  # (a finished id may come back as a new request)
    drafter.remember("c", 10, [4, 5], None)
    assert drafter.propose(good, 2) == [4, 5] and drafter.propose(good, 1) == [4]
    assert drafter.probs_of("c", [4, 5]) is None
    drafter.remember("c", 11, [4, 5], "q")
    assert drafter.propose(good, 2) == [] and drafter.probs_of("c", [4]) == "q" and drafter.probs_of("c", [5]) is None


@pytest.mark.parametrize("need, misses_to_leave", [(0.9, 1), (0.45, 3), (0.22, 8)])
def test_a_request_whose_drafts_all_miss_leaves_after_a_few_misses(need, misses_to_leave):
    """Optimistic acceptance: the cheaper drafting is, the longer a request is given; far below
    the break-even (a verify + MTP round near two main steps at one row) the first miss ends it.
    A request whose drafts are all accepted never leaves."""
    from graphrt.spec.drafter import MTPDrafter

    drafter = MTPDrafter(SpeculativeConfig.from_dict({"method": "mtp", "num_speculative_tokens": 1}))
    drafter.per_row_need = need
    req = decoding("a", REPEATS)
    for misses in range(1, 12):
        req.num_draft_misses = misses
        if not drafter.wants_mtp(req):
            break
    assert misses == misses_to_leave
    right = decoding("b", REPEATS, accepted=200)
    drafter.per_row_need = 0.99
    assert drafter.wants_mtp(right) and drafter.expected_accepted(right, 1) == 1.0


@pytest.mark.parametrize("drafting_rows, verifies", [(8, True), (4, False)])
def test_mtp_requests_leave_when_their_step_declines_their_drafts(drafting_rows, verifies):
    """Eight decoding rows, drafting costing 1.41 main steps: rows whose own drafts would pay
    (a = 0.5 > 0.41) verify together when all eight draft; with four rows already gone from the
    MTP layer the four left cannot pay for a step over eight rows, and since their records cannot
    change without verify steps they leave too, rather than run the MTP layer for nothing."""
    from graphrt.spec.drafter import MTPDrafter

    drafter = MTPDrafter(SpeculativeConfig.from_dict({"method": "mtp", "num_speculative_tokens": 1}), lambda r: 1.41)
    reqs = [decoding(str(i), REPEATS + [i], accepted=0, misses=2) for i in range(8)]
    for req in reqs[drafting_rows:]:
        drafter.left.add(req.request_id)
    for req in reqs[:drafting_rows]:
        drafter.remember(req.request_id, req.num_tokens, [7])
    drafter.propose_for(reqs, {r.request_id: 0 for r in reqs}, 1000)
    assert [r.draft_token_ids for r in reqs[:drafting_rows]] == ([[7]] * drafting_rows if verifies else [[]] * 4)
    assert all(drafter.wants_mtp(r) for r in reqs[:drafting_rows]) is verifies
