"""``graphrt::paged_attention``: attention of a mixed step over paged K/V, optionally writing first.

A step holds rows of any kind at once: prefill (``query_len == seq_len``), chunked-prefill
continuation and decode (``query_len == 1``). Row r's queries are ``q[qsl[r]:qsl[r+1]]`` and sit at
the last ``query_len`` positions of its ``seq_len`` keys; each sees the keys up to its own position.
"""

from typing import Optional

import torch
import torch.nn.functional as F

from graphrt.kernels import checks
from graphrt.kernels.cache import check_kv_write, write_kv

_lib = torch.library.Library("graphrt", "FRAGMENT")
_lib.define(
    "paged_attention(Tensor q, Tensor? k, Tensor? v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? slot_mapping, "
    "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, float scale) -> Tensor"
)


def paged_attention_torch(
    q: torch.Tensor,
    k: Optional[torch.Tensor],
    v: Optional[torch.Tensor],
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: Optional[torch.Tensor],
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The portable body, on any device: torch ops, decode rows batched, a loop over the others.
    On the CPU the native kernel (``native/paged_attention.h``) replaces it: one call over every
    row with no Python, each KV row read once per query-head group."""
    if k is not None:
        write_kv(k, v, k_cache, v_cache, slot_mapping)
    return _attend_torch(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)


_lib.impl("paged_attention", paged_attention_torch, "CompositeExplicitAutograd")


@torch.library.register_fake("graphrt::paged_attention")
def _(q, k, v, k_cache, v_cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale):
    return torch.empty_like(q)


def _gather(cache: torch.Tensor, block_row: torch.Tensor, length: int, dtype: torch.dtype) -> torch.Tensor:
    """[..., nblocks] block ids → that sequence's first ``length`` cache rows [..., L, Hkv, D], in
    ``dtype`` (q's: a bf16 cache under an fp32 model is widened)."""
    block_size = cache.shape[1]
    num_blocks = -(-length // block_size)
    rows = cache[block_row[..., :num_blocks].long()]  # [..., nb, bs, Hkv, D]
    rows = rows.reshape(*rows.shape[:-4], num_blocks * block_size, *cache.shape[2:])
    return rows[..., :length, :, :].to(dtype)


def _attend_torch(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale):
    out = torch.zeros_like(q)
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    enable_gqa = num_heads != num_kv_heads
    decode_rows = [r for r in range(len(lens)) if qsl[r + 1] - qsl[r] == 1 and lens[r] > 0]
    if decode_rows:
        # Decode rows together: one batched attention, keys padded to the longest and masked.
        idx = torch.tensor(decode_rows)
        max_len = max(lens[r] for r in decode_rows)
        keys = _gather(k_cache, block_tables[idx], max_len, q.dtype).transpose(1, 2)  # [n, Hkv, L, D]
        values = _gather(v_cache, block_tables[idx], max_len, q.dtype).transpose(1, 2)
        valid = torch.arange(max_len)[None, :] < seq_lens[idx].long()[:, None]  # [n, L]
        tok = torch.tensor([qsl[r] for r in decode_rows])
        res = F.scaled_dot_product_attention(
            q[tok][:, :, None, :],
            keys,
            values,
            attn_mask=valid[:, None, None, :],
            scale=scale,
            enable_gqa=enable_gqa,
        )  # [n, H, 1, D]
        out[tok] = res[:, :, 0, :]
    for r in range(len(lens)):
        start, end, seq_len = qsl[r], qsl[r + 1], lens[r]
        q_len = end - start
        if q_len == 0 or seq_len == 0 or (q_len == 1 and r in decode_rows):
            continue
        keys = _gather(k_cache, block_tables[r], seq_len, q.dtype).transpose(0, 1)  # [Hkv, L, D]
        values = _gather(v_cache, block_tables[r], seq_len, q.dtype).transpose(0, 1)
        query = q[start:end].transpose(0, 1)  # [H, q_len, D]
        if q_len == seq_len:
            res = F.scaled_dot_product_attention(
                query, keys, values, is_causal=True, scale=scale, enable_gqa=enable_gqa
            )
        else:
            pos = torch.arange(seq_len - q_len, seq_len)
            mask = torch.arange(seq_len)[None, :] <= pos[:, None]
            res = F.scaled_dot_product_attention(
                query, keys, values, attn_mask=mask, scale=scale, enable_gqa=enable_gqa
            )
        out[start:end] = res.transpose(0, 1)
    return out


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    k: Optional[torch.Tensor] = None,
    v: Optional[torch.Tensor] = None,
    slot_mapping: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """q [T, H, D] over caches [num_blocks, block_size, Hkv, D]; with k/v/slot_mapping, writes
    them into the caches first (the fused form). Returns [T, H, D]; rows of no request are zero."""
    checks.check_ndim("q", q, 3, "[num_tokens, num_heads, head_dim]")
    checks.check_ndim("k_cache", k_cache, 4, "[num_blocks, block_size, num_kv_heads, head_dim]")
    checks.check_dim("q", q, 2, k_cache.shape[3], "head_dim of k_cache")
    if q.shape[1] % k_cache.shape[2]:
        raise checks.KernelArgumentError(
            f"q has {q.shape[1]} heads, not a multiple of the cache's {k_cache.shape[2]} kv heads"
        )
    checks.check_ndim("block_tables", block_tables, 2, "[num_reqs, max_blocks]")
    checks.check_ndim("seq_lens", seq_lens, 1, "[num_reqs]")
    checks.check_ndim("query_start_loc", query_start_loc, 1, "[num_reqs + 1]")
    checks.check_dim("seq_lens", seq_lens, 0, block_tables.shape[0], "num_reqs of block_tables")
    checks.check_dim("query_start_loc", query_start_loc, 0, block_tables.shape[0] + 1, "num_reqs + 1")
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens), ("query_start_loc", query_start_loc)):
        checks.check_int(name, t)
    checks.check_same_dtype(("k_cache", "v_cache"), (k_cache, v_cache))
    checks.check_cache_dtype("q", q, "k_cache", k_cache)
    if (k is None) != (v is None) or (k is None) != (slot_mapping is None):
        raise checks.KernelArgumentError("k, v and slot_mapping must be given together (or none of them)")
    if k is not None:
        check_kv_write(k, v, k_cache, v_cache, slot_mapping)
        checks.check_dim("k", k, 0, q.shape[0], "num_tokens of q")
    return torch.ops.graphrt.paged_attention(
        q, k, v, k_cache, v_cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale
    )
