"""Stop handling (EOS, stop token ids, stop strings, lengths) against transformers; streaming."""

import torch

from graphrt import SamplingParams
from tests.helpers import make_llm, stop_token_case
from tests.oracle import hf_greedy, hf_model, random_prompts


def test_eos_ends_generation_where_transformers_does(tiny_model):
    path = tiny_model("llama_gqa")
    llm = make_llm(path, kv_cache_memory=4_000_000)
    # Prompts whose greedy continuation reaches EOS (id 2) within 40 tokens, found by the oracle.
    found = 0
    for prompt in random_prompts([4] * 40, seed=11):
        ref = hf_greedy(path, prompt, 40, eos=True)
        out = llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0))[0]
        assert out.token_ids == ref
        if ref[-1] == 2:
            found += 1
            assert out.finish_reason == "stop"
        else:
            assert out.finish_reason == "length"
    assert found > 0, "no prompt reached EOS: the test would prove nothing"


def test_stop_token_ids_and_max_tokens(tiny_model):
    llm, prompt, full, stop_at, first = stop_token_case(tiny_model("llama_gqa"), 5)
    out = llm.generate(
        [prompt], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop_token_ids=[stop_at])
    )[0]
    assert out.token_ids == full[: first + 1] and out.finish_reason == "stop"
    out = llm.generate([prompt], SamplingParams(max_tokens=7, temperature=0, ignore_eos=True))[0]
    assert out.token_ids == full[:7] and out.finish_reason == "length"


def test_max_model_len_ends_with_length(tiny_model):
    llm = make_llm(tiny_model("llama_gqa"), max_model_len=32, kv_cache_memory=2_000_000)
    out = llm.generate([list(range(3, 23))], SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 12 and out.finish_reason == "length"


def test_stop_strings_match_transformers_and_are_cut_from_text(tiny_tok_model):
    llm = make_llm(tiny_tok_model, kv_cache_memory=8_000_000)
    tok = llm.tokenizer.hf
    prompt = tok.encode("Once upon a time")
    full = hf_greedy(tiny_tok_model, prompt, 30)
    text = tok.decode(full, skip_special_tokens=True)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), "pick a visible stop string"
    out = llm.generate([prompt], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[stop]))[0]
    model = hf_model(tiny_tok_model)
    ids = torch.tensor([prompt])
    ref = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=30,
        do_sample=False,
        stop_strings=[stop],
        tokenizer=tok,
        eos_token_id=None,
        pad_token_id=0,
    )[0, len(prompt) :]
    assert out.token_ids == ref.tolist()
    assert out.finish_reason == "stop"
    assert stop not in out.text and text.startswith(out.text) and out.text == text[: text.index(stop)]


def test_streaming_yields_the_same_text_and_tokens(tiny_tok_model):
    llm = make_llm(tiny_tok_model, kv_cache_memory=8_000_000)
    prompts = ["Hello there", "The weather today"]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=["zzz-never"])
    whole = llm.generate(prompts, params)
    texts, tokens, reasons = ["", ""], [[], []], [None, None]
    for ev in llm.generate_stream(prompts, params):
        texts[ev.index] += ev.text
        tokens[ev.index] += ev.token_ids
        if ev.finish_reason:
            reasons[ev.index] = ev.finish_reason
    assert texts == [o.text for o in whole]
    assert tokens == [o.token_ids for o in whole]
    assert reasons == ["length", "length"]


def test_logprobs_are_returned_when_asked(tiny_model):
    llm = make_llm(tiny_model("llama_gqa"), kv_cache_memory=2_000_000)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=5, temperature=0, logprobs=True, ignore_eos=True))[0]
    assert len(out.logprobs) == 5 and all(lp <= 0 for lp in out.logprobs)
    assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))[0].logprobs is None
