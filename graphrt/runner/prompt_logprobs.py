"""Prompt log-probabilities: each prompt token's log-probability under the model given the tokens
before it (and the k most likely tokens at its position), computed on the host from the final
hidden states a step graph returns, only for the requests that ask (vLLM's ``prompt_logprobs``)."""

from __future__ import annotations

import torch


@torch.inference_mode()
def prompt_logprobs(model, hidden: torch.Tensor, next_tokens: list[int], k: int) -> list[dict[int, float]]:
    """``hidden`` [N, H]: the final hidden states at N consecutive prompt positions; ``next_tokens``:
    the prompt token after each. Returns, per position, {next token: its log-probability} plus the
    k most likely tokens' (fp32 log-softmax over the full logits)."""
    logits = model.compute_logits(hidden, torch.arange(hidden.shape[0])).float()
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = logprobs.gather(1, torch.tensor(next_tokens).unsqueeze(1)).squeeze(1).tolist()
    top = logprobs.topk(k, dim=-1) if k else None
    out = []
    for i, token in enumerate(next_tokens):
        entry = {}
        if top is not None:
            entry = dict(zip(top.indices[i].tolist(), top.values[i].tolist()))
        entry[token] = chosen[i]
        out.append(entry)
    return out
