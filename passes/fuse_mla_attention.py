"""fuse_mla_attention: multi-head latent attention with its latent-cache write → one
``graphrt::mla_attention``.

Before (``canonical.mla_attention``; abridged)::

    latent_cache.view(-1, C).index_copy_(0, slots.clamp(min=0), latent)      # the write
    pe_cache.view(-1, R).index_copy_(0, slots.clamp(min=0), k_pe)
    keys, keys_pe = latent_cache[block_tables[token_req]], pe_cache[...]      # the gather
    scores = einsum(q_latent, keys) + einsum(q_pe, keys_pe)                  # + causal mask
    out = einsum(softmax(scores * scale), keys)

After::

    out = torch.ops.graphrt.mla_attention(q_latent, q_pe, latent, k_pe, latent_cache, pe_cache,
                                          slots, block_tables, seq_lens, query_start_loc, scale)

Runs after fuse_slot_mapping (the slots are the step's one slot-mapping op) and before
fuse_attention, whose witness counts every einsum left over.
"""

from __future__ import annotations

import torch

from graphrt.kernels import canonical
from graphrt.passes.base import FusionPass
from graphrt.passes.matcher import emit


class FuseMLAAttention(FusionPass):
    name = "fuse_mla_attention"
    pattern_fns = (canonical.mla_attention,)

    def accept(self, m) -> bool:
        return isinstance(m["scale"], float)

    def rewrite(self, graph, m):
        names = ("q_latent", "q_pe", "latent", "k_pe", "latent_cache", "pe_cache", "slots", "block_tables")
        args = tuple(m[n] for n in names) + (m["seq_lens"], m["query_start_loc"], m["scale"])
        return emit(graph, torch.ops.graphrt.mla_attention.default, args)
