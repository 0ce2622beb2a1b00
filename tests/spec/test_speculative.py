"""Speculative decoding with the verify step: greedy output identical to plain decoding, random
sampling from the target distribution, state kept exact after rejections, graphs everywhere."""

import tempfile

import numpy as np
import pytest

import graphrt
from graphrt import SamplingParams
from graphrt.runner.graph_cache import CaptureSizes
from tests.helpers import drafting_always, make_llm
from tests.oracle import random_prompts

REPETITIVE = [[5, 6, 7, 8, 9, 10, 11, 12] * 4 + [5, 6], [1, 2, 3] * 7, [40, 41]]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def ngram(k):
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


class Oracle:
    """Drafts from a plain run's outputs: the true next tokens, every third draft position wrong,
    so that verify steps accept runs and reject in the middle of them."""

    def __init__(self, runs: list[list[int]], vocab: int) -> None:
        self.runs, self.vocab = runs, vocab

    def propose(self, tokens: np.ndarray, k: int) -> list[int]:
        seq = tokens.tolist()
        for run in self.runs:
            if run[: len(seq)] == seq:
                true = run[len(seq) : len(seq) + k]
                return [(t + 1) % self.vocab if (len(seq) + i) % 3 == 2 else t for i, t in enumerate(true)]
        return []


def plain_and_spec(path, prompts, params, k, **opts):
    plain = make_llm(path, **opts).generate(prompts, params)
    spec = drafting_always(make_llm(path, speculative_config=ngram(k), **opts))
    return plain, spec


@pytest.mark.parametrize("name", ["llama_gqa", "qwen2_tied", "qwen3"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_ngram_output_is_plain_output(tiny_model, name, k):
    path = tiny_model(name)
    prompts = REPETITIVE + random_prompts([3, 40, 9], seed=70)  # 40 > 16: a chunked prefill
    opts = dict(max_num_seqs=3, max_num_batched_tokens=16, kv_cache_memory=600_000, max_model_len=96)
    plain, spec = plain_and_spec(path, prompts, GREEDY, k, **opts)
    got = spec.generate(prompts, GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain]
    stats = spec.stats()
    assert stats["spec_draft_tokens"] > 0 and stats["free_blocks"] == stats["total_blocks"]


def test_accepted_runs_rejections_preemption_and_stops_stay_exact(tiny_model):
    path = tiny_model("llama_gqa")
    prompts = random_prompts([7, 30, 12, 5], seed=71)
    opts = dict(max_num_seqs=3, max_num_batched_tokens=16, kv_cache_memory=60_000, max_model_len=64)
    runs = [p + o.token_ids for p, o in zip(prompts, make_llm(path, **opts).generate(prompts, GREEDY))]
    spec = drafting_always(make_llm(path, speculative_config=ngram(4), **opts))
    spec.engine.proposer.proposer = Oracle(runs, 256)
    got = spec.generate(prompts, GREEDY)
    assert [p + o.token_ids for p, o in zip(prompts, got)] == runs
    s = spec.stats()
    assert s["preemptions"] > 0 and s["spec_acceptance_rate"] > 0.4 and s["spec_mean_accepted_length"] > 1.5
    assert s["free_blocks"] == s["total_blocks"]
    assert sum(o.num_accepted_tokens for o in got) == s["spec_accepted_tokens"]
    # a stop token inside an accepted run ends the request exactly there, as plain decoding does
    stop = runs[1][len(prompts[1]) + 9]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop_token_ids=[stop])
    want = [o.token_ids for o in make_llm(path, **opts).generate(prompts, params)]
    assert [o.token_ids for o in spec.generate(prompts, params)] == want
    assert want[1][-1] == stop and len(want[1]) <= 10


def test_verify_graphs_compile_load_from_a_shipped_cache_and_pad_without_writing(tiny_model):
    path = tiny_model("qwen3")
    prompts = REPETITIVE + random_prompts([6], seed=72)
    opts = dict(max_num_seqs=2, max_num_batched_tokens=32, kv_cache_memory=4_000_000, progress=False)
    sizes = CaptureSizes((2,), (32,))  # a one-row step pads into the two-row graphs
    cache = tempfile.mkdtemp()
    built = drafting_always(
        graphrt.LLM(path, graph_cache=cache, capture_sizes=sizes, speculative_config=ngram(3), **opts)
    )
    names = [r.key.name for r in built.capture_report()]
    assert sorted(names) == ["main-t2-r2", "main-t32-r2", "verify-t8-r2"] and built.stats()["compiles"] == 3
    want = [o.token_ids for o in make_llm(path, **opts).generate(prompts, GREEDY)]
    assert [o.token_ids for o in built.generate(prompts, GREEDY)] == want
    s = built.stats()
    assert s["graph_misses"] == 0 and s["spec_draft_tokens"] > 0 and s["free_blocks"] == s["total_blocks"]
    loaded = drafting_always(graphrt.LLM(path, graph_cache=cache, speculative_config=ngram(3), progress=False))
    assert loaded.stats()["compiles"] == 0 and [r.how for r in loaded.capture_report()] == ["loaded"] * 3
    assert [o.token_ids for o in loaded.generate(prompts, GREEDY)] == want
    # one verify row in the two-row graph: the padding row and padding tokens write nothing
    engine = loaded.engine
    rid = engine.add_request(REPETITIVE[1], GREEDY)
    engine.step()  # the prefill
    before = [(k.clone(), v.clone()) for k, v in engine.kv_caches]
    req = engine.scheduler.requests[rid]
    computed = req.num_computed_tokens
    engine.proposer.proposer = Oracle([], 256)  # no drafts from it: use fixed ones
    req_drafts = [7, 8]
    engine.proposer.propose_for = lambda running, tracked, n: setattr(req, "draft_token_ids", list(req_drafts))
    engine.step()  # one verify step: 1 + 2 tokens of one row in verify-t8-r2
    bs = engine.block_size
    real = {(engine.blocks.block_table(rid)[p // bs], p % bs) for p in range(computed, computed + 3)}
    for (k0, v0), (k1, v1) in zip(before, engine.kv_caches):
        changed = ((k0 != k1).flatten(2).any(-1) | (v0 != v1).flatten(2).any(-1)).nonzero().tolist()
        written = {tuple(c) for c in changed if c[0] != 0}
        assert written <= real and written, (written, real)


def test_random_and_filtered_sampling_with_drafts_is_plain_sampling(tiny_model):
    """Seeded random requests — plain, top-k, top-p with min-p — with drafts (the plain run's
    tokens, every third one wrong) emit exactly plain sampling's tokens: the verify step samples
    each position as a main step does and keeps a draft only while it equals that token. (That
    this is the target distribution, for one-hot and for probabilistic drafts, is tested on the
    op: tests/kernels/test_sampling.py.)"""
    path = tiny_model("llama_gqa")
    prompts = random_prompts([11, 5, 8, 14, 6, 9], seed=73) * 10
    kinds = [
        dict(temperature=0.8),
        dict(temperature=1.0, top_k=5),
        dict(temperature=0.9, top_p=0.8, min_p=0.05),
    ]
    params = [
        SamplingParams(max_tokens=8, seed=s, ignore_eos=True, logprobs=True, **kinds[s % 3])
        for s in range(len(prompts))
    ]
    opts = dict(max_num_seqs=8, max_num_batched_tokens=32, kv_cache_memory=4_000_000)
    plain = make_llm(path, **opts).generate(prompts, params)
    spec = drafting_always(make_llm(path, speculative_config=ngram(3), **opts))
    spec.engine.proposer.proposer = Oracle([p + o.token_ids for p, o in zip(prompts, plain)], 256)
    got = spec.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain]
    for kind in range(3):
        outs = got[kind::3]
        drafted = sum(o.num_draft_tokens for o in outs)
        accepted = sum(o.num_accepted_tokens for o in outs)
        assert 0 < accepted < drafted, (kinds[kind], accepted, drafted)
    lp = np.array([x for o in got for x in o.logprobs]) - np.array([x for o in plain for x in o.logprobs])
    assert np.abs(lp).max() < 1e-4


@pytest.mark.parametrize("grammar_backend", ["in-graph", "xgrammar-cpu"])
def test_grammar_requests_draft_under_their_masks(tiny_tok_model, grammar_backend):
    """A JSON-schema request drafts (oracle drafts, every third one wrong and mostly illegal): the
    verify step masks each draft position after the drafts before it, the matcher advances over
    accepted tokens only, and the output is plain decoding's, schema-valid."""
    import json

    schema = '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'
    params = [
        SamplingParams(max_tokens=30, temperature=0, json_schema=schema),
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
    ]
    prompts = ["Give me JSON", "a b a b a b a b"]
    opts = dict(max_num_seqs=4, max_num_batched_tokens=64, kv_cache_memory=8_000_000, grammar_backend=grammar_backend)
    plain = make_llm(tiny_tok_model, **opts)
    want = plain.generate(prompts, params)
    ids = [plain.engine.tokenize(p) for p in prompts]
    spec = drafting_always(make_llm(tiny_tok_model, speculative_config=ngram(3), **opts))
    spec.engine.proposer.proposer = Oracle([i + o.token_ids for i, o in zip(ids, want)], 49152)
    got = spec.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert isinstance(json.loads(got[0].text)["a"], int) and got[0].finish_reason == want[0].finish_reason
    assert got[0].num_draft_tokens > 0 and 0 < got[0].num_accepted_tokens < got[0].num_draft_tokens
    short = spec.generate([[7]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    assert len(short.token_ids) == 3  # shorter than prompt_lookup_min + 1: no draft, no error


def test_smollm2_greedy_with_ngram_drafts_is_plain_greedy():
    from graphrt.bench.spec import repetitive_prompt

    opts = dict(max_num_seqs=2, max_num_batched_tokens=512, kv_cache_memory=200_000_000)
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    prompts = [repetitive_prompt(12), "What is the capital of France? Answer in one sentence."]
    plain = make_llm(None, **opts)
    want = [plain.generate([prompts[0]], params)[0].token_ids, plain.generate([prompts[1]], params, chat=True)[0]]
    spec = drafting_always(make_llm(None, speculative_config=ngram(5), **opts))
    got = [spec.generate([prompts[0]], params)[0], spec.generate([prompts[1]], params, chat=True)[0]]
    assert [got[0].token_ids, got[1].token_ids] == [want[0], want[1].token_ids]
    assert got[0].num_accepted_tokens > 10  # the copy is drafted and accepted
