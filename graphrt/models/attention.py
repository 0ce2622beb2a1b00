"""Attention in its canonical unfused form: the shape the attention-fusion pass recognises.

Every step is flat: T tokens of R request rows. A request row r owns the blocks
``block_tables[r]``; token t belongs to row ``token_req[t]`` (−1 for padding) at ``positions[t]``.
Block 0 of every cache is the null block: padding writes land there and nothing reads them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionInputs:
    block_tables: torch.Tensor  # [R, B] int64, unused entries point at the null block 0
    seq_lens: torch.Tensor  # [R] int64, context length of each row after this step
    query_start_loc: torch.Tensor  # [R + 1] int64, offsets of each row's tokens in the step
    token_req: torch.Tensor  # [T] int64, request row of each token, −1 for padding
    slot_mapping: torch.Tensor  # [T] int64, cache slot of each token, −1 for padding


def compute_slot_mapping(
    positions: torch.Tensor, token_req: torch.Tensor, block_tables: torch.Tensor, block_size: int
) -> torch.Tensor:
    """``block_table[req, pos // bs] * bs + pos % bs``; −1 where the token is padding."""
    block = block_tables[token_req, positions // block_size]
    slots = block * block_size + positions % block_size
    return torch.where(token_req >= 0, slots, -1)


def attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    positions: torch.Tensor,  # [T]
    attn: AttentionInputs,
    scale: float,
) -> torch.Tensor:  # [T, H * D]
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads

    # 1. Write this step's K/V at the slot mapping (padding → slot 0 of the null block).
    slots = attn.slot_mapping.clamp(min=0)
    k_cache.view(num_blocks * block_size, num_kv_heads, head_dim).index_copy_(0, slots, k)
    v_cache.view(num_blocks * block_size, num_kv_heads, head_dim).index_copy_(0, slots, v)

    # 2. Gather each token's sequence through its row's block table: [T, L, Hkv, D].
    blocks = attn.block_tables[attn.token_req]
    keys = k_cache[blocks].reshape(num_tokens, -1, num_kv_heads, head_dim)
    values = v_cache[blocks].reshape(num_tokens, -1, num_kv_heads, head_dim)

    # 3. Causal softmax attention; query head h reads kv head h // group.
    context = torch.arange(keys.shape[1], device=q.device)
    allowed = context[None, :] <= positions[:, None]  # [T, L]
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    scores = torch.einsum("tkgd,tlkd->tkgl", qg, keys).float() * scale
    scores = scores.masked_fill(~allowed[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    out = torch.einsum("tkgl,tlkd->tkgd", probs, values)
    return out.reshape(num_tokens, num_heads * head_dim)
