"""The building blocks of the Llama family, written to compute exactly what transformers computes."""

from __future__ import annotations

import math

import torch
from torch import nn

from graphrt.kernels import canonical
from graphrt.lora.projection import project
from graphrt.models.config import RopeConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return canonical.rms_norm(x, self.weight, self.eps)


def rope_inv_freq(rope: RopeConfig, rotary_dim: int) -> torch.Tensor:
    """Inverse frequencies [rotary_dim // 2] for the rope types graphrt supports."""
    # on the CPU even while a model is built on the meta device (meta math imports the compiler)
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float() / rotary_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.type == "linear":
        return inv_freq / rope.factor
    if rope.type == "llama3":
        low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
        high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    if rope.type == "yarn":
        return _yarn_inv_freq(rope, rotary_dim, inv_freq)
    return inv_freq


def _yarn_inv_freq(rope: RopeConfig, dim: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """YaRN: interpolated (÷ factor) low frequencies, extrapolated high ones, a linear ramp between
    the dims that turn ``beta_fast`` and ``beta_slow`` times over the original context."""

    def correction_dim(rotations: float) -> float:
        return (
            dim
            * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi))
            / (2 * math.log(rope.theta))
        )

    low = max(math.floor(correction_dim(rope.beta_fast)), 0)
    high = min(math.ceil(correction_dim(rope.beta_slow)), dim - 1)
    ramp = (torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / ((high - low) or 0.001)
    extrapolation = 1 - ramp.clamp(0, 1)
    return inv_freq / rope.factor * (1 - extrapolation) + inv_freq * extrapolation


class RotaryEmbedding(nn.Module):
    """cos/sin for a step's positions, computed once per forward and shared by every layer."""

    def __init__(self, rope: RopeConfig, rotary_dim: int) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        self.scale = rope.cos_sin_scale
        self.register_buffer("inv_freq", rope_inv_freq(rope, rotary_dim), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq[None, :]  # [T, rot/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # NeoX layout: [T, rot]
        if self.scale != 1.0:
            return (emb.cos() * self.scale).to(dtype), (emb.sin() * self.scale).to(dtype)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX-style rotation of x [T, heads, head_dim] over its first cos.shape[-1] dims."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    x1, x2 = x_rot[..., : rot // 2], x_rot[..., rot // 2 :]
    rotated = torch.cat((-x2, x1), dim=-1)
    out = x_rot * cos[:, None, :] + rotated * sin[:, None, :]
    if x_pass.shape[-1] == 0:
        return out
    return torch.cat((out, x_pass), dim=-1)


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's interleaved rotation of x [T, heads, rot]: pairs (x0, x1), (x2, x3), … each turned
    by one frequency, the results laid out as [evens' rotation, odds' rotation] (transformers'
    spelling; q and k share the layout, so their dot products are those of the pairs)."""
    half = cos.shape[-1] // 2
    cos, sin = cos[:, None, :half], sin[:, None, :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool) -> None:
        super().__init__()
        self.intermediate = intermediate
        # gate and up stacked into one matmul: [2 * intermediate, hidden]
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor, lora_slot: torch.Tensor | None = None) -> torch.Tensor:
        """``lora_slot``: each token's adapter slot when the model serves LoRA adapters."""
        gate, up = project(self.gate_up_proj, x, lora_slot).split(self.intermediate, dim=-1)
        return project(self.down_proj, nn.functional.silu(gate) * up, lora_slot)
