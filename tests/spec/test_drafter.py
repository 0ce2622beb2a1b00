"""The drafter's cost model and the step timings it reads, without a model."""

from types import SimpleNamespace

import pytest

from graphrt.runner.graph_key import GraphKey
from graphrt.runner.step_times import StepTimes
from graphrt.sampling_params import SamplingParams
from graphrt.spec import SpeculativeConfig
from graphrt.spec.drafter import Drafter

CONFIG = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})


def decoding(rid, tokens, drafted=0, accepted=0, prefill=False):
    return SimpleNamespace(
        request_id=rid,
        all_token_ids=tokens,
        num_tokens=len(tokens),
        num_computed_tokens=len(tokens) - (5 if prefill else 1),
        output_token_ids=[],
        params=SamplingParams(max_tokens=100, temperature=0.7, top_k=5),
        num_draft_tokens=drafted,
        num_accepted_tokens=accepted,
        draft_token_ids=[],
    )


REPEATS = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]  # proposes [3, 4, 1]


def test_unmeasured_costs_take_drafts_and_filtered_random_rows_draft():
    reqs = [decoding("a", REPEATS), decoding("b", [9, 8, 7])]
    Drafter(CONFIG).propose_for(reqs, {"a": 0, "b": 0}, 1000)
    assert reqs[0].draft_token_ids == [3, 4, 1] and reqs[1].draft_token_ids == []


@pytest.mark.parametrize(
    "ratio, drafted, accepted, takes",
    [
        (1.4, 0, 0, True),  # still probed: all three drafts count, 3 > 0.4
        (1.4, 40, 30, True),  # a = 31/42: expects 1.6 > 0.4
        (1.4, 40, 4, False),  # a = 5/42: expects 0.13 < 0.4
        (3.0, 40, 38, False),  # a = 39/42: expects 2.6 < 4 (two rows x (3 - 1)), the other row drafts nothing
    ],
)
def test_drafts_are_taken_when_expected_accepted_tokens_pay_for_the_verify_step(ratio, drafted, accepted, takes):
    reqs = [decoding("a", REPEATS, drafted, accepted)]
    if ratio == 3.0:
        reqs.append(decoding("b", [9, 8, 7], 40, 0))  # a second decoding row that finds no draft
    Drafter(CONFIG, cost_ratio=lambda rows: ratio).propose_for(reqs, {r.request_id: 0 for r in reqs}, 1000)
    assert (reqs[0].draft_token_ids == [3, 4, 1]) is takes
    assert all(r.draft_token_ids == [] for r in reqs[1:])


def test_prefill_rows_and_untracked_rows_do_not_draft_and_room_caps_drafts():
    reqs = [decoding("a", REPEATS, prefill=True), decoding("b", REPEATS), decoding("c", REPEATS)]
    Drafter(CONFIG).propose_for(reqs, {"a": 0, "b": 0}, max_model_len=len(REPEATS) + 3)
    assert reqs[0].draft_token_ids == [] and reqs[2].draft_token_ids == []
    assert reqs[1].draft_token_ids == [3, 4]  # max_model_len leaves room for two drafts + one token


def test_step_times_skip_warm_up_and_average():
    times, main, verify = StepTimes(skip=2, weight=0.5), GraphKey("main", 8, 8), GraphKey("verify", 32, 8)
    for t in (9.0, 9.0, 1.0, 3.0):
        times.record(main, t)
    assert times.ratio(verify, main) is None
    for t in (50.0, 4.0):
        times.record(verify, t)
    assert times.ratio(verify, main) is None  # only warm-up steps so far
    times.record(verify, 4.0)
    assert times.mean[main] == 2.0 and times.ratio(verify, main) == 2.0


def test_mtp_requests_leave_the_mtp_layer_when_drafting_cannot_pay():
    from graphrt.spec.drafter import MTPDrafter

    drafter = MTPDrafter(SpeculativeConfig.from_dict({"method": "mtp", "num_speculative_tokens": 2}))
    fresh, failing, good = decoding("a", REPEATS), decoding("b", REPEATS, 40, 2), decoding("c", REPEATS, 40, 36)
    drafter.per_row_need = float("inf")  # plain steps untimed: everyone stays
    assert all(drafter.wants_mtp(r) for r in (fresh, failing, good))
    drafter.per_row_need = 1.2  # drafting costs 2.2 main steps a row
    assert drafter.wants_mtp(fresh) and drafter.wants_mtp(good)  # probed: up to 2 > 1.2; a = 37/42: 1.66
    assert not drafter.wants_mtp(failing)  # a = 3/42: 0.08
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
