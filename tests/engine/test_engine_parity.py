"""The engine against transformers: queueing, preemption, chunked prefill, prefix caching."""

import pytest

from graphrt import SamplingParams
from tests.helpers import make_llm
from tests.oracle import hf_greedy, random_prompts

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def assert_all_blocks_free(llm):
    stats = llm.stats()
    assert stats["free_blocks"] == stats["total_blocks"], stats


def check_against_hf(path, llm, prompts, params=GREEDY):
    outs = llm.generate(prompts, params)
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(path, p, params.max_tokens), f"prompt of {len(p)} tokens"
    assert_all_blocks_free(llm)
    return outs


def test_twelve_prompts_queue_behind_max_num_seqs(tiny_model):
    path = tiny_model("llama_gqa")
    prompts = random_prompts([1, 2, 5, 9, 17, 33, 50, 64, 100, 128, 150, 200], seed=2)
    llm = make_llm(path, max_num_seqs=3, kv_cache_memory=8_000_000)
    check_against_hf(path, llm, prompts)


def test_preemption_keeps_outputs_exact(tiny_model):
    path = tiny_model("qwen3")
    prompts = random_prompts([40, 45, 50, 55], seed=3)
    # 4 layers' worth of KV for ~ one full sequence: requests must be preempted and recomputed
    llm = make_llm(path, max_num_seqs=4, max_model_len=128, block_size=8, kv_cache_memory=2 * 2 * 2 * 32 * 4 * 8 * 20)
    check_against_hf(path, llm, prompts, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    assert llm.stats()["preemptions"] > 0


def test_chunked_prefill_with_a_small_token_budget(tiny_model):
    path = tiny_model("qwen2_tied")
    prompts = random_prompts([70, 3, 33], seed=4)
    llm = make_llm(path, max_num_seqs=3, max_num_batched_tokens=16, kv_cache_memory=4_000_000)
    check_against_hf(path, llm, prompts)


def test_prefix_caching_hits_and_outputs_unchanged(tiny_model):
    path = tiny_model("llama_mqa")
    prefix = random_prompts([96], seed=5)[0]
    prompts = [prefix + tail for tail in random_prompts([3, 7, 12, 1], seed=6)]
    llm = make_llm(path, max_num_seqs=2, enable_prefix_caching=True, kv_cache_memory=4_000_000)
    check_against_hf(path, llm, prompts[:1])
    check_against_hf(path, llm, prompts[1:])
    assert llm.stats()["prefix_cache_hits"] >= 3 * (96 // 16)


@pytest.fixture(scope="module")
def seeded_llm(tiny_model):
    return make_llm(tiny_model("llama_gqa"), max_num_seqs=4, kv_cache_memory=4_000_000)


def test_seeded_sampling_is_reproducible_and_batch_invariant(seeded_llm):
    prompts = random_prompts([5, 20, 9, 14], seed=7)
    params = [
        SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, top_k=50, seed=100 + i, ignore_eos=True)
        for i in range(4)
    ]
    together = [o.token_ids for o in seeded_llm.generate(prompts, params)]
    again = [o.token_ids for o in seeded_llm.generate(prompts, params)]
    alone = [seeded_llm.generate([p], sp)[0].token_ids for p, sp in zip(prompts, params)]
    reordered = seeded_llm.generate(
        prompts[::-1] + random_prompts([30], seed=8), params[::-1] + [SamplingParams(max_tokens=16, temperature=1.0)]
    )
    assert together == again == alone == [o.token_ids for o in reordered[:4]][::-1]
    assert len({tuple(t) for t in together}) == 4  # they really sample


def test_engine_seed_makes_unseeded_requests_reproducible(tiny_model):
    path = tiny_model("llama_gqa")
    prompts = random_prompts([6, 6], seed=9)
    params = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    a = [o.token_ids for o in make_llm(path, seed=1, kv_cache_memory=2_000_000).generate(prompts, params)]
    b = [o.token_ids for o in make_llm(path, seed=1, kv_cache_memory=2_000_000).generate(prompts, params)]
    assert a == b
