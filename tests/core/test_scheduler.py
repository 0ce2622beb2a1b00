from graphrt.core.block_manager import BlockManager
from graphrt.core.request import Request, RequestStatus
from graphrt.core.scheduler import Scheduler, SchedulerConfig
from graphrt.sampling_params import SamplingParams


def make(num_blocks=64, block_size=4, **cfg):
    return Scheduler(SchedulerConfig(**cfg), BlockManager(num_blocks, block_size, True))


def req(rid, n, max_tokens=4):
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens, temperature=0), seed=0)


def finish_step(s, out, token=5):
    """Play the runner: every request whose prompt is done gets one token."""
    for r in s.after_step(out):
        r.output_token_ids.append(token)


def test_chunked_prefill_under_the_token_budget():
    s = make(max_num_seqs=4, max_num_batched_tokens=8, max_model_len=64)
    s.add_request(req("a", 20))
    chunks = []
    for _ in range(3):
        out = s.schedule()
        chunks.append(out.num_scheduled_tokens["a"])
        finish_step(s, out)
    assert chunks == [8, 8, 4]
    assert s.requests["a"].output_token_ids == [5]


def test_decode_first_then_waiting_prefills():
    s = make(max_num_seqs=2, max_num_batched_tokens=10, max_model_len=64)
    s.add_request(req("a", 3))
    finish_step(s, s.schedule())
    s.add_request(req("b", 30))
    s.add_request(req("c", 3))
    out = s.schedule()
    assert list(out.num_scheduled_tokens.items()) == [("a", 1), ("b", 9)]  # c waits: max_num_seqs
    assert [n.request_id for n in out.new_requests] == ["b"]


def test_preemption_by_recompute_when_blocks_run_out():
    s = make(num_blocks=6, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=20)
    s.add_request(req("a", 8, max_tokens=6))
    s.add_request(req("b", 8, max_tokens=6))
    finish_step(s, s.schedule())  # 4 of 5 blocks used
    out = s.schedule()  # a takes the last block for token 9; b has none: b is preempted
    assert list(out.num_scheduled_tokens) == ["a"] and s.num_preemptions == 1
    b = s.requests["b"]
    assert b.status == RequestStatus.WAITING and b.num_computed_tokens == 0 and b.output_token_ids == [5]
    finish_step(s, out)
    steps = 0
    while s.has_unfinished() and steps < 50:
        out = s.schedule()
        finish_step(s, out)
        for r in list(s.running):
            if len(r.output_token_ids) >= r.params.max_tokens:
                s.finish(r, "length")
        steps += 1
    assert not s.has_unfinished()
    assert s.blocks.num_free_blocks == s.blocks.num_usable_blocks


def test_abort_frees_blocks():
    s = make(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64)
    s.add_request(req("a", 10))
    s.schedule()
    s.finish(s.requests["a"], "abort")
    assert s.blocks.num_free_blocks == s.blocks.num_usable_blocks
    assert not s.has_unfinished()
    assert "a" in s.schedule().finished_request_ids
