"""Padding to captured sizes: same tokens as eager at every batch size, real KV slots untouched."""

import graphrt
from graphrt import SamplingParams
from graphrt.runner.graph_cache import CaptureSizes
from tests.helpers import make_llm
from tests.oracle import random_prompts

OPTS = dict(max_num_seqs=6, max_num_batched_tokens=32, kv_cache_memory=4_000_000)
SIZES = CaptureSizes(decode=(2, 4), mixed=(16,))
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def test_every_batch_size_matches_eager_and_misses_are_counted(tiny_model):
    path = tiny_model("llama_gqa")
    graph = graphrt.LLM(path, backend="eager", capture_sizes=SIZES, progress=False, **OPTS)
    eager = make_llm(path, **OPTS)
    for n in range(1, 7):  # 5 and 6 rows exceed every decode size: they pad into the mixed graph
        prompts = random_prompts([2 + i % 2 for i in range(n)], seed=30 + n)  # prefills fit 16 tokens
        assert [o.token_ids for o in graph.generate(prompts, GREEDY)] == [
            o.token_ids for o in eager.generate(prompts, GREEDY)
        ], f"{n} prompts"
    assert graph.stats()["graph_misses"] == 0
    long_prompt = random_prompts([30], seed=40)  # a 30-token prefill is bigger than every graph
    assert graph.generate(long_prompt, GREEDY)[0].token_ids == eager.generate(long_prompt, GREEDY)[0].token_ids
    assert graph.stats()["graph_misses"] == 1
    assert graph.stats()["free_blocks"] == graph.stats()["total_blocks"]


def test_padded_rows_leave_every_real_kv_slot_untouched(tiny_model):
    path = tiny_model("qwen3")
    llm = graphrt.LLM(path, backend="eager", capture_sizes=SIZES, progress=False, **OPTS)
    engine = llm.engine
    for p in random_prompts([5, 9, 7], seed=41):  # 3 rows → decode padded to the 4-row graph
        engine.add_request(p, GREEDY)
    engine.step()  # the prefill
    before = [(k.clone(), v.clone()) for k, v in engine.kv_caches]
    hits = llm.stats()["graph_hits"]
    engine.step()  # one padded decode burst: each of its steps replays the 4-row graph
    steps = llm.stats()["graph_hits"] - hits
    assert steps == engine.scheduler.decode_burst > 1
    bs = engine.block_size
    # the slots the burst's real tokens own: each row's last `steps` positions
    real = set()
    for rid, req in engine.scheduler.requests.items():
        for pos in range(req.num_computed_tokens - steps, req.num_computed_tokens):
            real.add((engine.blocks.block_table(rid)[pos // bs], pos % bs))
    assert len(real) == 3 * steps
    for (k0, v0), (k1, v1) in zip(before, engine.kv_caches):
        changed = ((k0 != k1).flatten(2).any(-1) | (v0 != v1).flatten(2).any(-1)).nonzero().tolist()
        written = {tuple(c) for c in changed if c[0] != 0}  # block 0 is the null block
        # (a real token's K/V can equal what was there: token 0's embedding is zero in these models)
        assert written <= real and written, (written, real)
