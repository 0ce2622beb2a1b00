"""fuse_sampling: the logits-processing chain → one ``graphrt::sample``.

Before (``canonical.sample``; abridged)::

    logits = linear(hidden[logits_indices], lm_head).float()
    logits = logits.masked_fill(~unpack(bitmask), -inf)          # grammar
    greedy = logits.argmax(dim=-1)
    probs = softmax(logits.double() / temperature[:, None])      # + top-k/top-p sort, min-p
    drawn = searchsorted(cumsum(probs), row_uniform(seeds, offsets) * total)
    tokens = where(temperature > 0, drawn, greedy)
    logprobs = log_softmax(logits).gather(1, tokens[:, None])[:, 0]

After::

    sample = torch.ops.graphrt.sample(logits, temperature, top_k, top_p, min_p, seeds, offsets, bitmask)
    tokens, logprobs = sample[0], sample[1]

The verify step's chain (``canonical.rejection_sample``: the same chain over each row's K + 1
positions, then drafts accepted while they equal the sampled tokens) becomes one
``graphrt::rejection_sample`` the same way, and so does its spelling with draft distributions
(``canonical.rejection_sample_by_ratio``, MTP drafts). An MTP step's draft sampling
(``canonical.draft_sample``) becomes ``graphrt::draft_sample``, which skips the sort when no row
filters by rank.

Only the model's logits are sampled: the chain must start from a linear projection (the LM head).
The same chain over any other tensor is left alone. The fused op skips the sort when no row uses
top-k / top-p, which the traceable chain cannot.
"""

from __future__ import annotations

import torch

from graphrt.kernels import canonical
from graphrt.passes.base import FusionPass
from graphrt.passes.matcher import emit


def _is_draw(n) -> bool:
    return n.op == "call_function" and n.target is torch.searchsorted


class FuseSampling(FusionPass):
    name = "fuse_sampling"
    # the verify step's chain first: it holds the main step's chain over its K + 1 positions a row
    pattern_fns = (
        canonical.rejection_sample_by_ratio,
        canonical.rejection_sample,
        canonical.sample,
        canonical.draft_sample,
    )
    witness = staticmethod(_is_draw)

    def accept(self, m) -> bool:
        logits = m["logits"]
        return getattr(logits, "op", None) == "call_function" and logits.target is torch._C._nn.linear

    def rewrite(self, graph, m):
        if m.pattern.name == "draft_sample":
            args = tuple(m[n] for n in ("logits", "temperature", "top_k", "top_p", "min_p", "seeds", "offsets"))
            return emit(graph, torch.ops.graphrt.draft_sample.default, args, num_outputs=2)
        if m.pattern.name.startswith("rejection_sample"):
            probs = "draft_probs" if m.pattern.name == "rejection_sample_by_ratio" else None
            names = ("draft_token_ids", "num_drafts", probs, "logits", "temperature", "top_k", "top_p", "min_p")
            args = tuple(None if n is None else m[n] for n in names) + (m["seeds"], m["offsets"], m["bitmask"])
            return emit(graph, torch.ops.graphrt.rejection_sample.default, args, num_outputs=2)
        args = tuple(m[n] for n in ("logits", "temperature", "top_k", "top_p", "min_p", "seeds", "offsets", "bitmask"))
        return emit(graph, torch.ops.graphrt.sample.default, args, num_outputs=2)
