"""Decode bursts end to end: the same outputs as one decode step at a time, and no step wasted
after a stop token."""

import collections

import numpy as np
import pytest

from graphrt import SamplingParams
from graphrt.runner.decode_burst import advance, views
from tests.helpers import EAGER_GRAPHS, make_llm, stop_token_case
from tests.oracle import random_prompts


def counting_bursts(llm) -> collections.Counter:
    """How many steps ran at each burst length."""
    counts = collections.Counter()
    runner = llm.engine.runner
    execute = runner.execute

    def counted(out):
        counts[out.decode_steps] += 1
        return execute(out)

    runner.execute = counted
    return counts


def outputs(llm, prompts, params):
    return [(o.token_ids, o.logprobs, o.finish_reason, o.text) for o in llm.generate(prompts, params)]


PARAMS = [
    SamplingParams(max_tokens=23, temperature=0, ignore_eos=True, logprobs=True),
    SamplingParams(max_tokens=17, temperature=0.8, top_k=20, seed=5, ignore_eos=True, logprobs=True),
    SamplingParams(max_tokens=30, temperature=1.0, top_p=0.9, seed=7, logprobs=True),  # may reach EOS
    SamplingParams(max_tokens=19, temperature=0.7, min_p=0.05, seed=1, ignore_eos=True, stop_token_ids=[11, 12, 13]),
    SamplingParams(max_tokens=2, temperature=0, ignore_eos=True),
]


@pytest.mark.parametrize("graphs", [False, True], ids=["no-graphs", "eager-graphs"])
def test_bursts_give_what_single_steps_give(tiny_model, graphs):
    llm = make_llm(tiny_model("llama_gqa"), kv_cache_memory=4_000_000, **(EAGER_GRAPHS if graphs else {}))
    counts = counting_bursts(llm)
    prompts = random_prompts([5, 9, 3, 12, 7], seed=3)
    assert llm.engine.scheduler.decode_burst == 4  # on by default
    bursts = outputs(llm, prompts, PARAMS)
    alone = [outputs(llm, [p], [q])[0] for p, q in zip(prompts, PARAMS)]
    assert sum(n for k, n in counts.items() if k > 1) > 5, "no bursts ran: the test would prove nothing"
    llm.engine.scheduler.decode_burst = 1
    counts.clear()
    single = outputs(llm, prompts, PARAMS)
    single_alone = [outputs(llm, [p], [q])[0] for p, q in zip(prompts, PARAMS)]
    assert set(counts) == {1}
    # the same bits, log-probabilities included (a batch's are not those of its rows alone)
    assert bursts == single and alone == single_alone


def test_a_stop_token_ends_the_burst_and_no_step_is_wasted(tiny_model):
    llm, prompt, full, stop_at, first = stop_token_case(tiny_model("llama_gqa"), 6)
    replays = []
    run = llm.engine.graphs.run
    llm.engine.graphs.run = lambda *a: replays.append(1) or run(*a)
    counts = counting_bursts(llm)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop_token_ids=[stop_at])
    out = llm.generate([prompt], params)
    assert out[0].token_ids == full[: first + 1] and out[0].finish_reason == "stop"
    assert max(counts) == 4
    assert len(replays) == first + 1  # the prefill's step, then one a token after the first: none past the stop


def test_a_stop_string_inside_a_burst_cuts_the_output_where_single_steps_do(tiny_tok_model):
    llm = make_llm(tiny_tok_model, kv_cache_memory=8_000_000)
    prompt = llm.tokenizer.hf.encode("Once upon a time")
    full = llm.generate([prompt], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0]
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
    assert stop.strip(), "pick a visible stop string"
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[stop])
    counts = counting_bursts(llm)
    burst = outputs(llm, [prompt], params)
    assert max(counts) > 1
    llm.engine.scheduler.decode_burst = 1
    assert burst == outputs(llm, [prompt], params) and burst[0][2] == "stop"


def test_an_ngram_engine_bursts_where_it_has_no_drafts_and_verifies_where_it_has(tiny_model):
    path = tiny_model("llama_gqa")
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    spec = make_llm(path, kv_cache_memory=4_000_000, speculative_config=ngram)
    spec.engine.proposer.cost_ratio = lambda rows: 1.0  # every step with drafts verifies them
    counts = counting_bursts(spec)
    drafted = []
    execute = spec.engine.runner.execute
    spec.engine.runner.execute = lambda out: drafted.append(bool(out.draft_token_ids)) or execute(out)
    prompts = [[5, 6, 7, 8] * 5, *random_prompts([7], seed=5)]  # one repeats itself, one does not
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    got = [o.token_ids for o in spec.generate(prompts, params)]
    plain = make_llm(path, kv_cache_memory=4_000_000)
    plain.engine.scheduler.decode_burst = 1
    assert got == [o.token_ids for o in plain.generate(prompts, params)]
    assert any(drafted) and max(counts) > 1


def test_an_mtp_engine_decodes_a_step_at_a_time(tmp_path):
    from tests.tiny_models import save_tiny_with_mtp

    path = save_tiny_with_mtp(str(tmp_path))
    llm = make_llm(path, kv_cache_memory=4_000_000, speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    assert llm.engine.scheduler.decode_burst == 1


def test_requests_that_end_before_the_caller_stops_stepping_free_their_runner_slots(tiny_model):
    # A burst ends requests in fewer steps than their tokens; a step with nothing to run must still
    # let the runner forget them, or the next requests find no slot in its table.
    llm = make_llm(tiny_model("llama_gqa"), kv_cache_memory=4_000_000, max_num_seqs=2)
    engine = llm.engine
    for _ in range(3):
        ids = [engine.add_request([10 + i, 20, 30], SamplingParams(max_tokens=6, ignore_eos=True)) for i in range(2)]
        for _ in range(8):  # more steps than the requests need
            engine.step()
        assert all(engine.output(r).finish_reason == "length" for r in ids)
        for r in ids:
            engine.release(r)
    assert not engine.runner.table.slot_of


def test_advance_moves_each_row_one_token_on_and_leaves_the_padding():
    class Buffers:
        host = {
            n: np.array(v)
            for n, v in dict(
                input_ids=[5, 6, 0, 0], positions=[9, 3, 0, 0], seq_lens=[10, 4, 0, 0], offsets=[10, 4, 0, 0]
            ).items()
        }

    b = Buffers()
    advance(views(b), [41, 42])
    assert b.host["input_ids"].tolist() == [41, 42, 0, 0]
    assert b.host["positions"].tolist() == [10, 4, 0, 0]
    assert b.host["seq_lens"].tolist() == [11, 5, 0, 0]
    assert b.host["offsets"].tolist() == [11, 5, 0, 0]
