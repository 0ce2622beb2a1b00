"""``graphrt::rotary_embedding``: NeoX (halves) or GPT-J (interleaved) rotation, partial dims."""

import torch

from graphrt.kernels import checks
from graphrt.kernels.op_library import define


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    rot = cos.shape[-1] * 2
    x_rot = x[..., :rot].float()
    if is_neox:
        x1, x2 = x_rot[..., : rot // 2], x_rot[..., rot // 2 :]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return torch.cat((out.to(x.dtype), x[..., rot:]), dim=-1)


def _rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor, is_neox: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = cos_sin_cache[positions.long()].float().chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return _rotate(q, cos, sin, is_neox), _rotate(k, cos, sin, is_neox)


def _rotary_embedding_fake(positions, q, k, cos_sin_cache, is_neox):
    return torch.empty_like(q), torch.empty_like(k)


define(
    "rotary_embedding(Tensor positions, Tensor q, Tensor k, Tensor cos_sin_cache, bool is_neox) -> (Tensor, Tensor)",
    _rotary_embedding,
    _rotary_embedding_fake,
)


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor, is_neox: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, H, D] and k [T, Hkv, D] by ``cos_sin_cache[positions]`` ([max_pos, rot]: cos
    in the first half, sin in the second); dims past ``rot`` pass through."""
    checks.check_ndim("positions", positions, 1, "[num_tokens]")
    checks.check_int("positions", positions)
    checks.check_ndim("q", q, 3, "[num_tokens, num_heads, head_dim]")
    checks.check_ndim("k", k, 3, "[num_tokens, num_kv_heads, head_dim]")
    checks.check_ndim("cos_sin_cache", cos_sin_cache, 2, "[max_position, rotary_dim]")
    rot = cos_sin_cache.shape[1]
    if rot % 2 or rot > q.shape[2]:
        raise checks.KernelArgumentError(
            f"cos_sin_cache rotary_dim {rot} must be even and at most head_dim {q.shape[2]}"
        )
    checks.check_dim("q", q, 0, positions.shape[0], "num_tokens of positions")
    checks.check_dim("k", k, 0, positions.shape[0], "num_tokens of positions")
    return torch.ops.graphrt.rotary_embedding(positions, q, k, cos_sin_cache, is_neox)
