"""Log-probabilities with alternatives: a token's log-probability under the model given the tokens
before it and the k most likely tokens at its position, computed on the host from the final
hidden states a step graph returns, only for the requests that ask — for prompt tokens (vLLM's
``prompt_logprobs``) and for sampled ones (``logprobs=k``)."""

from __future__ import annotations

import torch


@torch.inference_mode()
def token_logprobs(model, hidden: torch.Tensor, next_tokens: list[int], k: int) -> list[dict[int, float]]:
    """``hidden`` [N, H]: final hidden states at N positions; ``next_tokens``: the token that
    followed each (the prompt's next token, or the one sampled there). Returns, per position,
    {next token: its log-probability} plus the k most likely tokens' (fp32 log-softmax over the
    full logits)."""
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
