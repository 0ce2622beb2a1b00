"""kv_cache_dtype="bfloat16" under a float32 model: half the cache, against transformers whose
cache rounds K/V the same way."""

import pytest
import torch

from graphrt import SamplingParams
from tests.helpers import EAGER_GRAPHS, drafting_always, make_llm
from tests.models.test_quantized_models import prompt_logprob_values
from tests.oracle import hf_greedy, random_prompts

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
# a decode row, a prompt over two blocks, one of three, and one chunked by the 32-token budget
PROMPTS = random_prompts([5, 30, 17, 40], seed=3)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "eager-graphs"])
def test_a_bf16_cache_gives_transformers_tokens_over_bf16_kv(tiny_model, graphs):
    path = tiny_model("llama_gqa")
    opts = dict(EAGER_GRAPHS, max_model_len=72) if graphs else dict(max_num_seqs=4)
    llm = make_llm(path, kv_cache_memory=4_000_000, kv_cache_dtype="bfloat16", **opts)
    assert {c.dtype for pair in llm.engine.kv_caches for c in pair} == {torch.bfloat16}
    if graphs:
        assert all("fuse_attention=2" in line for line in llm.pass_report())  # the fused op reads them
    got = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    want = [hf_greedy(path, p, GREEDY.max_tokens, bf16_kv=True) for p in PROMPTS]
    assert got == want
    # the rounding shows: a float32 cache gives other tokens on these prompts
    assert want != [hf_greedy(path, p, GREEDY.max_tokens) for p in PROMPTS]


def test_verified_ngram_drafts_over_a_bf16_cache_give_its_plain_tokens(tiny_model):
    # a verify step's k + 1 tokens a row write their K/V rounded, then each sees the rounded keys
    # before it, as the plain steps' tokens did one at a time
    path = tiny_model("llama_gqa")
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12] * 4 + [5, 6], [1, 2, 3] * 7, *random_prompts([9], seed=72)]
    opts = dict(max_num_seqs=3, kv_cache_memory=4_000_000, kv_cache_dtype="bfloat16")
    plain = [o.token_ids for o in make_llm(path, **opts).generate(prompts, GREEDY)]
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    spec = drafting_always(make_llm(path, speculative_config=ngram, **opts))
    assert [o.token_ids for o in spec.generate(prompts, GREEDY)] == plain
    assert spec.stats()["spec_draft_tokens"] > 0


def test_a_bf16_cache_holds_twice_the_tokens_of_a_float32_one(tiny_model):
    path = tiny_model("llama_gqa")
    auto = make_llm(path, kv_cache_memory=4_000_000)
    half = make_llm(path, kv_cache_memory=4_000_000, kv_cache_dtype="bfloat16")
    assert half.engine.kv_plan.bytes_per_block * 2 == auto.engine.kv_plan.bytes_per_block
    assert half.engine.kv_plan.max_tokens >= 2 * auto.engine.kv_plan.max_tokens
    assert auto.engine.kv_caches[0][0].dtype == torch.float32
    assert half.engine.settings.kv_cache_dtype == "bfloat16" and auto.engine.settings.kv_cache_dtype == "auto"
    # "float32" under a float32 model is the model's own dtype: the same engine as "auto"
    same = make_llm(path, kv_cache_memory=4_000_000, kv_cache_dtype="float32")
    assert same.engine.settings.kv_cache_dtype == "auto" and same.engine.kv_dtype == torch.float32


@pytest.mark.parametrize(
    "name, opts, message",
    [
        ("float16", {}, r"kv_cache_dtype='float16' is not known; choose one of \['auto', 'float32', 'bfloat16'\]"),
        ("float32", {"dtype": "bfloat16"}, r"kv_cache_dtype='float32' under a bfloat16 model"),
    ],
)
def test_a_kv_cache_dtype_the_model_cannot_take_is_refused_by_name(tiny_model, name, opts, message):
    with pytest.raises(ValueError, match=message):
        make_llm(tiny_model("llama_gqa"), kv_cache_memory=4_000_000, kv_cache_dtype=name, **opts)


def test_a_latent_cache_keeps_the_model_dtype(tiny_model):
    with pytest.raises(ValueError, match=r"kv_cache_dtype='bfloat16': .*latent \(MLA\) cache keeps the model's dtype"):
        make_llm(tiny_model("deepseek_v3"), kv_cache_memory=4_000_000, kv_cache_dtype="bfloat16")


def test_an_unknown_recorded_kv_cache_dtype_is_refused_by_name():
    # a shipped cache's manifest is read without CacheConfig's check: the resolution checks again
    from graphrt.runner.kv_cache import resolve_kv_cache_dtype

    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8' is not known; choose one of"):
        resolve_kv_cache_dtype("fp8", torch.float32, None, "inductor")


def prompt_logprobs(llm, prompts):
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    return torch.cat(prompt_logprob_values(outs))


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_weights_default_to_a_bf16_cache(tiny_model, quantization):
    # "auto" under int4/int8 weights is bf16 K/V; "float32" keeps them float32 and is recorded as
    # asked, so that a graph cache built with it is not read back as "auto" (bf16)
    path = tiny_model("llama_gqa")
    opts = dict(quantization=quantization, kv_cache_memory=4_000_000, max_model_len=128)
    auto = make_llm(path, **opts)
    f32 = make_llm(path, kv_cache_dtype="float32", **opts)
    assert {c.dtype for pair in auto.engine.kv_caches for c in pair} == {torch.bfloat16}
    assert {c.dtype for pair in f32.engine.kv_caches for c in pair} == {torch.float32}
    assert (auto.engine.settings.kv_cache_dtype, f32.engine.settings.kv_cache_dtype) == ("auto", "float32")
    assert auto.engine.kv_plan.bytes_per_block * 2 == f32.engine.kv_plan.bytes_per_block
    # the cache's rounding shows in the prompt log-probabilities, and moves them far less than the
    # weights' own rounding does (this tiny random model is far more sensitive than a trained one)
    prompts = random_prompts([40, 17], seed=91)
    original = prompt_logprobs(make_llm(path, kv_cache_memory=4_000_000, max_model_len=128), prompts)
    quantized = prompt_logprobs(f32, prompts)
    by_cache = (prompt_logprobs(auto, prompts) - quantized).abs().mean().item()
    by_weights = (quantized - original).abs().mean().item()
    assert 0 < by_cache < by_weights / 4, (by_cache, by_weights)


def test_auto_keeps_the_model_dtype_where_a_bf16_cache_cannot_serve():
    from types import SimpleNamespace

    from graphrt.runner.kv_cache import auto_kv_dtype, resolve_kv_cache_dtype

    plain, latent = SimpleNamespace(mla=None), SimpleNamespace(mla=object())
    assert resolve_kv_cache_dtype("auto", torch.float32, plain, "inductor", quantized=True) == torch.bfloat16
    assert resolve_kv_cache_dtype("auto", torch.float32, plain, "inductor", quantized=False) == torch.float32
    assert resolve_kv_cache_dtype("float32", torch.float32, plain, "inductor", quantized=True) == torch.float32
    assert auto_kv_dtype(torch.float32, latent, "inductor", quantized=True) == torch.float32  # a latent cache
    assert auto_kv_dtype(torch.float32, plain, "torchair", quantized=True) == torch.float32  # TorchAir's attention
    assert auto_kv_dtype(torch.bfloat16, plain, "eager", quantized=True) == torch.bfloat16  # the model's already
