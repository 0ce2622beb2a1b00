"""Random paged batches for kernel tests: mixed prefill / continuation / decode rows."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedBatch:
    q: torch.Tensor  # [T, H, D]
    k: torch.Tensor  # [T, Hkv, D] new keys of this step
    v: torch.Tensor
    k_cache: torch.Tensor  # [NB, bs, Hkv, D], holding every row's earlier context
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [R, B]
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    positions: torch.Tensor  # [T]
    token_req: torch.Tensor  # [T], −1 for padding tokens
    slots: torch.Tensor  # [T], −1 for padding tokens
    rows: list[tuple[int, int]]  # (seq_len, query_len)


def make_batch(
    rows: list[tuple[int, int]],
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    pad_tokens: int = 0,
    seed: int = 0,
) -> PagedBatch:
    g = torch.Generator().manual_seed(seed)
    blocks_per_row = [-(-s // block_size) for s, _ in rows]
    max_blocks = max(blocks_per_row + [1])
    num_blocks = sum(blocks_per_row) + 2  # + null block 0 + a spare
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()  # scattered, never block 0
    block_tables = torch.zeros(len(rows), max_blocks, dtype=torch.int64)
    for r, nb in enumerate(blocks_per_row):
        block_tables[r, :nb] = torch.tensor([perm.pop() for _ in range(nb)], dtype=torch.int64)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    positions, token_req, slots, qsl = [], [], [], [0]
    for r, (seq_len, q_len) in enumerate(rows):
        for p in range(seq_len - q_len, seq_len):
            positions.append(p)
            token_req.append(r)
            slots.append(int(block_tables[r, p // block_size]) * block_size + p % block_size)
        qsl.append(qsl[-1] + q_len)
    positions += [0] * pad_tokens
    token_req += [-1] * pad_tokens
    slots += [-1] * pad_tokens
    t = len(positions)
    return PagedBatch(
        q=torch.randn(t, num_heads, head_dim, generator=g).to(dtype),
        k=torch.randn(t, num_kv_heads, head_dim, generator=g).to(dtype),
        v=torch.randn(t, num_kv_heads, head_dim, generator=g).to(dtype),
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=block_tables,
        seq_lens=torch.tensor([s for s, _ in rows], dtype=torch.int64),
        query_start_loc=torch.tensor(qsl, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        token_req=torch.tensor(token_req, dtype=torch.int64),
        slots=torch.tensor(slots, dtype=torch.int64),
        rows=rows,
    )
