"""``graphrt::mla_attention``: multi-head latent attention (DeepSeek-V2/V3) over a paged latent
cache, writing the step's latents first.

MLA caches one entry per token and layer: the normalised latent ``c`` [kv_lora_rank] and the
rotated shared key ``k_pe`` [rope_dim], kept as two caches [num_blocks, block_size, 1, ·] (the
split vllm-ascend uses for its NPU MLA). With the up-projection absorbed into the query
(``q_latent = q_nope · W_uk``, per head), attention is one-kv-head attention in latent space:
``score(t, j) = (q_latent[t] · c[j] + q_pe[t] · k_pe[j]) · scale`` and ``out[t] = Σ p(t, j) c[j]``
[T, H, kv_lora_rank]; the caller applies ``W_uv`` and the output projection. Rows are laid out
as for ``paged_attention``: row r's queries are the last ``query_len`` positions of its
``seq_len`` keys, each seeing the keys up to its own position.
"""

import torch

from graphrt.kernels import checks
from graphrt.kernels.op_library import LIBRARY

LIBRARY.define(
    "mla_attention(Tensor q_latent, Tensor q_pe, Tensor latent, Tensor k_pe, Tensor(a!) latent_cache, "
    "Tensor(b!) pe_cache, Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, "
    "float scale) -> Tensor"
)


def write_latents(latent, k_pe, latent_cache, pe_cache, slot_mapping) -> None:
    valid = slot_mapping >= 0
    if not bool(valid.any()):
        return
    slots = slot_mapping[valid].long()
    latent_cache.view(-1, latent_cache.shape[-1])[slots] = latent[valid].to(latent_cache.dtype)
    pe_cache.view(-1, pe_cache.shape[-1])[slots] = k_pe[valid].to(pe_cache.dtype)


def _rows(cache: torch.Tensor, blocks: torch.Tensor, length: int) -> torch.Tensor:
    """A sequence's first ``length`` cache entries [L, dim] through its block ids."""
    n = -(-length // cache.shape[1])
    return cache[blocks[:n].long()].reshape(-1, cache.shape[-1])[:length]


def mla_attention_torch(
    q_latent, q_pe, latent, k_pe, latent_cache, pe_cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale
):
    """The portable body: the write, then one attention per row (queries of a row together)."""
    write_latents(latent, k_pe, latent_cache, pe_cache, slot_mapping)
    out = torch.zeros_like(q_latent)
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    for r, seq_len in enumerate(lens):
        start, end = qsl[r], qsl[r + 1]
        if end == start or seq_len == 0:
            continue
        keys = _rows(latent_cache, block_tables[r], seq_len)  # [L, C]
        keys_pe = _rows(pe_cache, block_tables[r], seq_len)  # [L, R]
        scores = (q_latent[start:end] @ keys.T + q_pe[start:end] @ keys_pe.T).float() * scale  # [q, H, L]
        pos = torch.arange(seq_len - (end - start), seq_len)
        allowed = torch.arange(seq_len)[None, :] <= pos[:, None]  # [q, L]
        scores = scores.masked_fill(~allowed[:, None, :], float("-inf"))
        out[start:end] = torch.softmax(scores, dim=-1).to(q_latent.dtype) @ keys
    return out


LIBRARY.impl("mla_attention", mla_attention_torch, "CompositeExplicitAutograd")


@torch.library.register_fake("graphrt::mla_attention", lib=LIBRARY)
def _(
    q_latent, q_pe, latent, k_pe, latent_cache, pe_cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale
):
    return torch.empty_like(q_latent)


def mla_attention(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    latent: torch.Tensor,
    k_pe: torch.Tensor,
    latent_cache: torch.Tensor,
    pe_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q_latent [T, H, C], q_pe [T, H, R]; this step's latent [T, C] and k_pe [T, R], written at
    ``slot_mapping`` (−1: not written) into latent_cache [num_blocks, block_size, 1, C] and
    pe_cache [num_blocks, block_size, 1, R] first. Returns [T, H, C]; rows of no request are zero."""
    checks.check_ndim("q_latent", q_latent, 3, "[num_tokens, num_heads, kv_lora_rank]")
    checks.check_ndim("q_pe", q_pe, 3, "[num_tokens, num_heads, rope_dim]")
    checks.check_ndim("latent_cache", latent_cache, 4, "[num_blocks, block_size, 1, kv_lora_rank]")
    checks.check_ndim("pe_cache", pe_cache, 4, "[num_blocks, block_size, 1, rope_dim]")
    if latent_cache.shape[2] != 1 or pe_cache.shape[:3] != latent_cache.shape[:3]:
        raise checks.KernelArgumentError(
            f"latent_cache {tuple(latent_cache.shape)} and pe_cache {tuple(pe_cache.shape)} must share "
            "[num_blocks, block_size, 1]"
        )
    rank, rope = latent_cache.shape[3], pe_cache.shape[3]
    checks.check_dim("q_latent", q_latent, 2, rank, "kv_lora_rank of latent_cache")
    checks.check_dim("q_pe", q_pe, 2, rope, "rope_dim of pe_cache")
    checks.check_dim("q_pe", q_pe, 1, q_latent.shape[1], "num_heads of q_latent")
    checks.check_ndim("latent", latent, 2, "[num_tokens, kv_lora_rank]")
    checks.check_ndim("k_pe", k_pe, 2, "[num_tokens, rope_dim]")
    for name, t, dim, what in (("latent", latent, rank, "kv_lora_rank"), ("k_pe", k_pe, rope, "rope_dim")):
        checks.check_dim(name, t, 0, q_latent.shape[0], "num_tokens of q_latent")
        checks.check_dim(name, t, 1, dim, what)
    checks.check_ndim("slot_mapping", slot_mapping, 1, "[num_tokens]")
    checks.check_dim("slot_mapping", slot_mapping, 0, q_latent.shape[0], "num_tokens of q_latent")
    checks.check_ndim("block_tables", block_tables, 2, "[num_reqs, max_blocks]")
    checks.check_dim("seq_lens", seq_lens, 0, block_tables.shape[0], "num_reqs of block_tables")
    checks.check_dim("query_start_loc", query_start_loc, 0, block_tables.shape[0] + 1, "num_reqs + 1")
    for name, t in (
        ("slot_mapping", slot_mapping),
        ("block_tables", block_tables),
        ("seq_lens", seq_lens),
        ("query_start_loc", query_start_loc),
    ):
        checks.check_int(name, t)
    checks.check_same_dtype(
        ("q_latent", "q_pe", "latent", "k_pe", "latent_cache", "pe_cache"),
        (q_latent, q_pe, latent, k_pe, latent_cache, pe_cache),
    )
    return torch.ops.graphrt.mla_attention(
        q_latent,
        q_pe,
        latent,
        k_pe,
        latent_cache,
        pe_cache,
        slot_mapping,
        block_tables,
        seq_lens,
        query_start_loc,
        scale,
    )
