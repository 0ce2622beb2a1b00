"""fuse_attention: cache write + block-table gather + masked softmax attention → one
``graphrt::paged_attention`` that writes, then attends.

Recognised spellings (each traced from ``graphrt.kernels.canonical``): the einsum/softmax form
``canonical.attention`` and the same attention computed by ``scaled_dot_product_attention`` over the
gathered K/V (``canonical.attention_sdpa``).

Before (one layer, 2 kv heads × 2 query heads each, head_dim 16, 16 tokens)::

    write_at = slot_mapping.clamp(min=0)
    view = k_cache.view(3904, 2, 16);  view.index_copy_(0, write_at, k)      # and v
    keys = k_cache[block_tables[token_req]].reshape(16, -1, 2, 16)          # and values
    last = seq_lens[token_req] - (query_start_loc[token_req + 1] - arange(16))
    allowed = arange(512)[None, :] <= last[:, None]
    scores = einsum("tkgd,tlkd->tkgl", q.reshape(16, 2, 2, 16), keys).float() * 0.25
    probs = softmax(scores.masked_fill(~allowed[:, None, None, :], -inf), dim=-1).to(float32)
    out = einsum("tkgl,tlkd->tkgd", probs, values).reshape(16, 64)

After::

    attn = torch.ops.graphrt.paged_attention(q, k, v, k_cache, v_cache, slot_mapping,
                                             block_tables, seq_lens, query_start_loc, 0.25)
    out = attn.reshape(16, 64)

The match is exact, so a near miss (another head mapping, a non-causal or shifted mask, a
different gather) is left unfused, and the report counts its einsum / SDPA calls as unmatched.
"""

from __future__ import annotations

import torch

from graphrt.kernels import canonical
from graphrt.passes.base import FusionPass
from graphrt.passes.matcher import emit


def _is_einsum(n) -> bool:
    return n.op == "call_function" and n.target is torch.einsum


def _is_sdpa(n) -> bool:
    return n.op == "call_function" and n.target is torch.nn.functional.scaled_dot_product_attention


class FuseAttention(FusionPass):
    name = "fuse_attention"
    pattern_fns = (canonical.attention, canonical.attention_sdpa)
    witness = staticmethod(lambda n: _is_einsum(n) or _is_sdpa(n))

    def accept(self, m) -> bool:
        return isinstance(m["scale"], float)

    def rewrite(self, graph, m):
        args = (
            m["q"],
            m["k"],
            m["v"],
            m["k_cache"],
            m["v_cache"],
            m["slots"],
            m["block_tables"],
            m["seq_lens"],
            m["query_start_loc"],
            m["scale"],
        )
        (attn,) = emit(graph, torch.ops.graphrt.paged_attention.default, args)
        return emit(graph, torch.flatten, (attn, 1))  # [T, H, D] → the pattern's [T, H * D]
