"""transformers as the oracle: greedy references and prefill logits on the same weights."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=8)
def hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def bf16_kv_cache(model):
    """A transformers cache that keeps K/V rounded to bf16 (and widened back), as graphrt's
    ``kv_cache_dtype="bfloat16"`` does: every attention, the step's own keys included, reads them
    rounded."""
    from transformers import DynamicCache

    class Bf16KV(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            def rounded(t):
                return t.to(torch.bfloat16).to(t.dtype)

            return super().update(rounded(key_states), rounded(value_states), layer_idx, *args, **kwargs)

    return Bf16KV(config=model.config)


def hf_greedy(path: str, prompt: list[int], max_new_tokens: int, eos: bool = False, bf16_kv: bool = False) -> list[int]:
    model = hf_model(path)
    ids = torch.tensor([prompt])
    kwargs = {} if eos else {"eos_token_id": None}
    if bf16_kv:
        kwargs["cache"] = bf16_kv_cache(model)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
            **kwargs,
        )
    gen = out[0, len(prompt) :].tolist()
    if eos:  # generate pads after EOS; cut there (the EOS itself stays, as graphrt keeps it)
        eos_ids = model.generation_config.eos_token_id
        eos_ids = {eos_ids} if isinstance(eos_ids, int) else set(eos_ids)
        for i, t in enumerate(gen):
            if t in eos_ids:
                return gen[: i + 1]
    return gen


def random_prompts(lengths, vocab: int = 256, seed: int = 0, low: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(low, vocab, (n,), generator=g).tolist() for n in lengths]
