"""Log-probabilities with alternatives, equal to transformers': prompt tokens' (vLLM's
``prompt_logprobs``) through chunked prefill, beside a cached prefix, in a batch with other
requests and in compiled graphs; sampled tokens' top k (``logprobs=k``), also with drafts."""

import pytest
import torch

from graphrt import SamplingParams
from graphrt.runner.graph_cache import CaptureSizes
from graphrt.sampling_params import InvalidRequestError
from tests.helpers import make_llm
from tests.oracle import hf_model, random_prompts


def hf_prompt_logprobs(path, prompt):
    with torch.no_grad():
        logits = hf_model(path)(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)  # row p: the distribution of the token at p + 1


def check(path, prompt, got, k):
    want = hf_prompt_logprobs(path, prompt)
    assert len(got) == len(prompt) and got[0] is None
    for p in range(1, len(prompt)):
        entry = got[p]
        assert entry[prompt[p]] == pytest.approx(want[p - 1, prompt[p]].item(), abs=1e-4)
        top = want[p - 1].topk(k)
        assert set(top.indices.tolist()) <= set(entry) and len(entry) in (k, k + 1)
        for token, value in zip(top.indices.tolist(), top.values.tolist()):
            assert entry[token] == pytest.approx(value, abs=1e-4)


def test_prompt_logprobs_match_transformers_through_chunks_caches_and_batches(tiny_model):
    path = tiny_model("llama_gqa")
    llm = make_llm(path, max_num_batched_tokens=16, max_model_len=128, kv_cache_memory=2_000_000)
    long, short, other = random_prompts([45, 7, 20], seed=81)
    params = SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=3)
    plain = SamplingParams(max_tokens=3, temperature=0)
    outs = llm.generate([long, other, short], [params, plain, SamplingParams(max_tokens=3, prompt_logprobs=0)])
    check(path, long, outs[0].prompt_logprobs, 3)  # 45 tokens in 16-token chunks, beside another row
    assert outs[1].prompt_logprobs is None
    assert all(len(e) == 1 for e in outs[2].prompt_logprobs[1:])
    check(path, short, outs[2].prompt_logprobs, 0)
    # the same prompt again: its blocks are cached, yet every position is computed and returned
    hits = llm.stats()["prefix_cache_hits"]
    again = llm.generate([long], params)[0]
    assert again.prompt_logprobs == outs[0].prompt_logprobs and again.token_ids == outs[0].token_ids
    assert llm.stats()["prefix_cache_hits"] == hits
    assert llm.generate([long], plain)[0].token_ids == outs[0].token_ids  # a plain request still hits
    assert llm.stats()["prefix_cache_hits"] > hits


def test_prompt_logprobs_in_captured_graphs(tiny_model):
    """The hidden states every step graph returns carry the prompt positions: graphs captured and
    rewritten by the passes, replayed as Python (Inductor's code for them is the end-to-end tests')."""
    path = tiny_model("qwen3")
    sizes = CaptureSizes(decode=(2,), mixed=(32,))
    llm = make_llm(
        path,
        compile=True,
        backend="eager",
        max_num_seqs=2,
        max_num_batched_tokens=32,
        capture_sizes=sizes,
        kv_cache_memory=2_000_000,
        max_model_len=128,
    )
    prompts = random_prompts([40, 9], seed=82)
    outs = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=2))
    for prompt, out in zip(prompts, outs):
        check(path, prompt, out.prompt_logprobs, 2)
    assert llm.stats()["graph_misses"] == 0


def test_sampled_tokens_top_logprobs_match_transformers_with_and_without_drafts(tiny_model):
    from tests.helpers import drafting_always

    path = tiny_model("llama_gqa")
    prompts = [[5, 6, 7, 8, 9] * 4, *random_prompts([11], seed=83)]
    params = [
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3),
        SamplingParams(max_tokens=12, temperature=0.8, seed=5, ignore_eos=True, logprobs=2),
    ]
    opts = dict(max_model_len=128, kv_cache_memory=2_000_000)
    plain = make_llm(path, **opts).generate(prompts, params)
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    drafted = drafting_always(make_llm(path, speculative_config=ngram, **opts)).generate(prompts, params)
    assert drafted[0].num_accepted_tokens > 0  # the repetitive prompt's drafts were taken
    for prompt, p, out, other in zip(prompts, params, plain, drafted):
        k = p.num_top_logprobs
        assert other.token_ids == out.token_ids and len(out.top_logprobs) == len(out.token_ids)
        want = hf_prompt_logprobs(path, prompt + out.token_ids)[len(prompt) - 1 : -1]  # the generated positions
        for i, (token, entry, again) in enumerate(zip(out.token_ids, out.top_logprobs, other.top_logprobs)):
            top = want[i].topk(k)
            assert entry[token] == pytest.approx(out.logprobs[i], abs=1e-4)  # the sampler's own
            assert set(top.indices.tolist()) <= set(entry) and len(entry) in (k, k + 1)
            for t, v in zip(top.indices.tolist(), top.values.tolist()):
                assert entry[t] == pytest.approx(v, abs=1e-4) and again[t] == pytest.approx(v, abs=1e-4)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(prompt_logprobs=-1), "prompt_logprobs=-1"),
        (dict(prompt_logprobs=21), "prompt_logprobs=21"),
        (dict(prompt_logprobs=1.5), "prompt_logprobs=1.5"),
        (dict(logprobs=21), "logprobs=21"),
        (dict(logprobs=-2), "logprobs=-2"),
        (dict(logprobs=2, regex="a+"), "cannot be combined with structured output"),
    ],
)
def test_bad_logprob_requests(kwargs, match):
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams(**kwargs)
