"""The step's sampling in its canonical unfused form: the chain the sampling pass fuses.

It computes exactly what ``graphrt::sample`` computes (grammar bitmask, then per-row greedy or
temperature / top-k / top-p / min-p with a counter-based seeded draw), written in traceable torch:
no host branches, so a whole step is one graph.
"""

from __future__ import annotations

import torch

from graphrt.kernels.rng import row_uniform
from graphrt.kernels.sampling import draw, filtered_probs, unpack_bitmask


def sample_tokens(
    logits: torch.Tensor,  # [R, V]
    bitmask: torch.Tensor,  # [R, ceil(V / 32)] int32, -1 = every token allowed
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = logits.float()
    logits = logits.masked_fill(~unpack_bitmask(bitmask, logits.shape[1]), float("-inf"))
    greedy = logits.argmax(dim=-1)
    probs = filtered_probs(logits, temperature, top_k, top_p, min_p, skip_unused_sort=False)
    drawn = draw(probs, row_uniform(seeds, offsets, 0))
    tokens = torch.where(temperature > 0, drawn, greedy)
    logprobs = torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None])[:, 0]
    return tokens, logprobs
