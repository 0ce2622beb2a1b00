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


def record_prompt_logprobs(model, tracked_requests: dict, out, result) -> None:
    """For the requests that asked (``tracked_requests``: request id → the engine's record): the
    log-probabilities of the prompt tokens this step's hidden states predict (the state at
    position p predicts the token at p + 1)."""
    if result.hidden is None:
        return
    for r, rid in enumerate(result.req_ids):
        tracked = tracked_requests.get(rid)
        if tracked is None or tracked.prompt_logprobs is None:
            continue
        req = tracked.request
        start, prompt = req.num_computed_tokens, req.prompt_token_ids
        end = min(start + out.num_scheduled_tokens[rid], len(prompt) - 1)
        todo = [p for p in range(start, end) if tracked.prompt_logprobs[p + 1] is None]
        if not todo:
            continue  # a decode row, or a recomputation after preemption
        first = int(result.query_start_loc[r]) + todo[0] - start
        hidden = result.hidden[first : first + len(todo)]
        entries = token_logprobs(model, hidden, [prompt[p + 1] for p in todo], req.params.prompt_logprobs)
        for p, entry in zip(todo, entries):
            tracked.prompt_logprobs[p + 1] = entry


def sampled_top_logprobs(model, tracked_requests: dict, out, result) -> dict[str, list[dict[int, float]]]:
    """For the requests with logprobs=k: each sampled token's entry with the k likeliest tokens,
    from the hidden state that predicted it (a drafted row's j-th token: its j-th position;
    any other row's token: its last position)."""
    tops: dict[str, list[dict[int, float]]] = {}
    if result.hidden is None:
        return tops
    qsl = result.query_start_loc
    for r, rid in enumerate(result.req_ids):
        tracked = tracked_requests.get(rid)
        if tracked is None or tracked.top_logprobs is None or not result.sampled.get(rid):
            continue
        sampled = result.sampled[rid]
        if out.draft_token_ids.get(rid):
            rows = [int(qsl[r]) + j for j in range(len(sampled))]
        else:
            rows = [int(qsl[r + 1]) - 1]
        k = tracked.request.params.num_top_logprobs
        tops[rid] = token_logprobs(model, result.hidden[rows], sampled, k)
    return tops
