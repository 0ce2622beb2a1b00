"""Prompts given as embeddings (vLLM's ``prompt_embeds``): merged in the step like image
embeddings, equal to transformers' ``inputs_embeds``; bad ones named."""

import pytest
import torch

from graphrt import SamplingParams
from graphrt.runner.graph_cache import CaptureSizes
from graphrt.sampling_params import InvalidRequestError
from tests.helpers import make_llm
from tests.oracle import hf_model, random_prompts

PARAMS = SamplingParams(max_tokens=6, temperature=0, prompt_logprobs=0)


def logprob_values(out):
    return torch.tensor([e[t] for t, e in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:])])


def test_prompt_embeds_match_transformers_inputs_embeds_in_graphs(tiny_model):
    path = tiny_model("llama_gqa")
    llm = make_llm(
        path, compile=True, backend="eager", enable_prompt_embeds=True, max_num_seqs=2, max_num_batched_tokens=32,
        capture_sizes=CaptureSizes(decode=(2,), mixed=(32,)), max_model_len=128, kv_cache_memory=2_000_000,
    )  # fmt: skip
    ids, plain_ids = random_prompts([12, 9], seed=95)
    hf = hf_model(path)
    own = hf.get_input_embeddings().weight[torch.tensor(ids)].detach()
    noisy = own + 0.3 * torch.randn(own.shape, generator=torch.Generator().manual_seed(0))
    outs = llm.generate(
        [{"prompt_token_ids": ids, "prompt_embeds": own}, {"prompt_token_ids": ids, "prompt_embeds": noisy}, plain_ids],
        PARAMS,
    )
    plain = llm.generate(ids, PARAMS)[0]
    assert outs[0].token_ids == plain.token_ids  # the token's own embeddings: the plain prompt
    assert (logprob_values(outs[0]) - logprob_values(plain)).abs().max().item() < 1e-5
    with torch.no_grad():
        want = hf.generate(
            inputs_embeds=noisy[None], attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=6,
            do_sample=False, eos_token_id=None, pad_token_id=0,
        )[0].tolist()  # fmt: skip
        logits = hf(inputs_embeds=noisy[None]).logits[0].float()
    assert outs[1].token_ids == want[-6:]
    lp = torch.log_softmax(logits, -1)
    expected = torch.tensor([lp[p - 1, ids[p]].item() for p in range(1, len(ids))])
    assert (logprob_values(outs[1]) - expected).abs().max().item() < 1e-4
    assert outs[1].token_ids != outs[0].token_ids or not torch.equal(logprob_values(outs[1]), logprob_values(outs[0]))
    assert llm.stats()["graph_misses"] == 0


def test_bad_prompt_embeds_are_named(tiny_model):
    path = tiny_model("llama_gqa")
    ids = [1, 5, 6]
    off = make_llm(path, max_model_len=64, kv_cache_memory=1_000_000)
    with pytest.raises(InvalidRequestError, match="enable_prompt_embeds=True"):
        off.generate({"prompt_token_ids": ids, "prompt_embeds": torch.zeros(3, 64)}, PARAMS)
    llm = make_llm(path, max_model_len=64, kv_cache_memory=1_000_000, enable_prompt_embeds=True)
    with pytest.raises(InvalidRequestError, match=r"shape \(2, 64\); the prompt needs \(3, 64\)"):
        llm.generate({"prompt_token_ids": ids, "prompt_embeds": torch.zeros(2, 64)}, PARAMS)
    with pytest.raises(InvalidRequestError, match="NaN or infinite"):
        llm.generate({"prompt_token_ids": ids, "prompt_embeds": torch.full((3, 64), float("nan"))}, PARAMS)
    with pytest.raises(InvalidRequestError, match="must be a float tensor"):
        llm.generate({"prompt_token_ids": ids, "prompt_embeds": [[0.0] * 64] * 3}, PARAMS)
    with pytest.raises(ValueError, match="limit_mm_per_prompt must be an int >= 0, got -1"):
        make_llm(path, limit_mm_per_prompt=-1)
