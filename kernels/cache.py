"""KV-cache ops: ``graphrt::slot_mapping`` and ``graphrt::reshape_and_cache``."""

import torch

from graphrt.kernels import checks
from graphrt.kernels.op_library import define


def _slot_mapping(
    positions: torch.Tensor, token_req: torch.Tensor, block_tables: torch.Tensor, block_size: int
) -> torch.Tensor:
    valid = token_req >= 0
    req = torch.where(valid, token_req, 0).long()
    block = block_tables[req, positions.long() // block_size].long()
    slots = block * block_size + positions.long() % block_size
    return torch.where(valid, slots, -1)


def _slot_mapping_fake(positions, token_req, block_tables, block_size):
    return torch.empty(positions.shape, dtype=torch.int64, device=positions.device)


define(
    "slot_mapping(Tensor positions, Tensor token_req, Tensor block_tables, int block_size) -> Tensor",
    _slot_mapping,
    _slot_mapping_fake,
)


@torch.library.custom_op("graphrt::reshape_and_cache", mutates_args=("k_cache", "v_cache"))
def _reshape_and_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    write_kv(k, v, k_cache, v_cache, slot_mapping)


@_reshape_and_cache.register_fake
def _(k, v, k_cache, v_cache, slot_mapping):
    return None


def write_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
    """The CPU body shared by reshape_and_cache and the fused paged attention."""
    valid = slot_mapping >= 0
    if not bool(valid.any()):
        return
    slots = slot_mapping[valid].long()
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim)[slots] = k[valid].to(k_cache.dtype)
    v_cache.view(-1, num_kv_heads, head_dim)[slots] = v[valid].to(v_cache.dtype)


def slot_mapping(
    positions: torch.Tensor, token_req: torch.Tensor, block_tables: torch.Tensor, block_size: int
) -> torch.Tensor:
    """Cache slot of every token (−1 for padding rows, ``token_req < 0``)."""
    checks.check_ndim("positions", positions, 1, "[num_tokens]")
    checks.check_ndim("token_req", token_req, 1, "[num_tokens]")
    checks.check_ndim("block_tables", block_tables, 2, "[num_reqs, max_blocks]")
    checks.check_dim("token_req", token_req, 0, positions.shape[0], "num_tokens of positions")
    for name, t in (("positions", positions), ("token_req", token_req), ("block_tables", block_tables)):
        checks.check_int(name, t)
    if block_size <= 0:
        raise checks.KernelArgumentError(f"block_size must be positive, got {block_size}")
    return torch.ops.graphrt.slot_mapping(positions, token_req, block_tables, block_size)


def reshape_and_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write k/v rows [T, Hkv, D] into the caches [num_blocks, block_size, Hkv, D] at their slots."""
    check_kv_write(k, v, k_cache, v_cache, slot_mapping)
    torch.ops.graphrt.reshape_and_cache(k, v, k_cache, v_cache, slot_mapping)


def check_kv_write(k, v, k_cache, v_cache, slot_mapping) -> None:
    checks.check_ndim("k_cache", k_cache, 4, "[num_blocks, block_size, num_kv_heads, head_dim]")
    checks.check_ndim("v_cache", v_cache, 4, "[num_blocks, block_size, num_kv_heads, head_dim]")
    if v_cache.shape != k_cache.shape:
        raise checks.KernelArgumentError(
            f"v_cache shape {tuple(v_cache.shape)} differs from k_cache shape {tuple(k_cache.shape)}"
        )
    for name, t in (("k", k), ("v", v)):
        checks.check_ndim(name, t, 3, "[num_tokens, num_kv_heads, head_dim]")
        checks.check_dim(name, t, 1, k_cache.shape[2], "num_kv_heads of k_cache")
        checks.check_dim(name, t, 2, k_cache.shape[3], "head_dim of k_cache")
    checks.check_ndim("slot_mapping", slot_mapping, 1, "[num_tokens]")
    checks.check_int("slot_mapping", slot_mapping)
    checks.check_dim("slot_mapping", slot_mapping, 0, k.shape[0], "num_tokens of k")
    checks.check_same_dtype(("k", "v"), (k, v))
    checks.check_same_dtype(("k_cache", "v_cache"), (k_cache, v_cache))
    checks.check_cache_dtype("k", k, "k_cache", k_cache)
    checks.check_same_device(("k", "k_cache", "slot_mapping"), (k, k_cache, slot_mapping))
