"""Decode bursts in the scheduler: when a step runs as several decode steps, and how far."""

from graphrt.core.block_manager import BlockManager
from graphrt.core.request import Request
from graphrt.core.scheduler import Scheduler, SchedulerConfig
from graphrt.sampling_params import SamplingParams


def make(num_blocks=64, block_size=4, burst=4, **cfg):
    s = Scheduler(
        SchedulerConfig(**{"max_num_seqs": 4, "max_num_batched_tokens": 64, "max_model_len": 64, **cfg}),
        BlockManager(num_blocks, block_size, True),
    )
    s.decode_burst = burst
    return s


def req(rid, n, max_tokens=20, **params):
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens, temperature=0, **params), seed=0)


def decoding(s, *requests):
    """The requests prefilled, each with its first token: the next step decodes them all."""
    for r in requests:
        s.add_request(r)
    out = s.schedule()
    assert out.decode_steps == 1  # a prefill is never a burst
    for r in s.after_step(out):
        r.output_token_ids.append(7)


def test_decoding_rows_burst_as_far_as_every_row_can_go():
    s = make()
    decoding(s, req("a", 6, max_tokens=20), req("b", 3, max_tokens=4))
    out = s.schedule()
    # b has 3 tokens left (max_tokens 4, one sampled): the burst stops there for every row
    assert out.decode_steps == 3 and out.num_scheduled_tokens == {"a": 3, "b": 3}
    # each row's blocks hold the burst's last token (a: tokens 6..8 computed → 9 slots, 3 blocks)
    assert len(s.blocks.block_table("a")) == 3 and len(s.blocks.block_table("b")) == 2
    for r in s.after_step(out):
        r.output_token_ids += [7, 7, 7]
    assert s.requests["a"].num_computed_tokens == 9 and s.requests["a"].num_tokens == 10


def test_the_longest_burst_and_max_model_len_cap_it():
    s = make(burst=4)
    decoding(s, req("a", 6, max_tokens=50))
    assert s.schedule().decode_steps == 4
    s = make(burst=4, max_model_len=9)
    decoding(s, req("a", 6, max_tokens=50))  # 7 tokens: two more fit under max_model_len 9
    assert s.schedule().decode_steps == 2


def test_a_burst_ended_early_advances_each_row_by_the_tokens_it_got():
    s = make()
    decoding(s, req("a", 6))
    out = s.schedule()
    assert out.decode_steps == 4
    for r in s.after_step(out, {"a": 2}):  # a stop token after two steps
        r.output_token_ids += [7, 2]
    a = s.requests["a"]
    assert a.num_computed_tokens == 8 and a.num_tokens == 9  # the next step decodes token 9


def test_no_burst_with_a_request_waiting_a_prefill_or_drafts():
    s = make(max_num_seqs=1)
    decoding(s, req("a", 6))
    s.add_request(req("b", 3))  # waits: max_num_seqs
    assert s.schedule().decode_steps == 1
    s = make()
    decoding(s, req("a", 6))
    s.add_request(req("b", 3))  # admitted this step: a prefill rides along
    out = s.schedule()
    assert out.decode_steps == 1 and out.num_scheduled_tokens == {"a": 1, "b": 3}
    s = make(max_verify_tokens=16)
    decoding(s, req("a", 6))
    s.requests["a"].draft_token_ids = [4, 5]
    out = s.schedule()
    assert out.decode_steps == 1 and out.draft_token_ids == {"a": (4, 5)}


def test_no_burst_for_a_grammar_top_logprobs_or_one_token_left():
    for params in (dict(regex="[ab]+"), dict(logprobs=2)):
        s = make()
        decoding(s, req("a", 6), req("b", 6, **params))
        assert s.schedule().decode_steps == 1, params
    s = make()
    decoding(s, req("a", 6), req("b", 6, max_tokens=2))  # b's next token is its last
    assert s.schedule().decode_steps == 1
    s = make(burst=1)
    decoding(s, req("a", 6))
    assert s.schedule().decode_steps == 1


def test_no_burst_where_the_blocks_would_run_short_and_nobody_is_preempted():
    s = make(num_blocks=5, block_size=4)  # 4 usable blocks (one is the null block)
    decoding(s, req("a", 7), req("b", 7))  # 8 tokens each: two blocks each, all four taken
    out = s.schedule()
    assert out.decode_steps == 1 and s.num_preemptions == 0
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}
