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
    """cos/sin for a step's positions, looked up in float32 tables of every position the model
    allows (transformers computes them per forward, in float32 whatever the model's dtype: the
    tables hold the same values).

    A lookup, not the formula, because a compiled step inlines a pointwise cos/sin into each of
    its consumers: every layer's rotation computed them again (96 vector cos and sin a layer at
    one decode token)."""

    def __init__(self, rope: RopeConfig, rotary_dim: int, max_positions: int) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        inv_freq = rope_inv_freq(rope, rotary_dim)
        # the angles as transformers forms them (a float32 product), on the CPU even while a model
        # is built on the meta device
        angles = torch.arange(max_positions, device="cpu").float()[:, None] * inv_freq[None, :]
        cos, sin = angles.cos(), angles.sin()
        if rope.cos_sin_scale != 1.0:
            cos, sin = cos * rope.cos_sin_scale, sin * rope.cos_sin_scale
        self.register_buffer("cos_table", cos, persistent=False)  # [max_positions, rotary_dim // 2]
        self.register_buffer("sin_table", sin, persistent=False)

    def _apply(self, fn, recurse=True):
        # the tables stay float32 when the model moves to another dtype (transformers keeps its
        # inverse frequencies float32; a bf16 angle is off by a radian a thousand positions in)
        tables = dict(self._buffers)
        super()._apply(fn, recurse)
        for name, table in tables.items():
            self._buffers[name] = table.to(self._buffers[name].device)
        return self

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, rotary_dim // 2]: one per frequency (transformers repeats them for the
        two halves a frequency turns). Positions past the model's last read its last angles: only
        MTP's chained drafts reach them (a row at max_model_len drafts past it), and those drafts
        are never kept."""
        positions = positions.clamp(0, self.cos_table.shape[0] - 1)
        return self.cos_table[positions].to(dtype), self.sin_table[positions].to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX-style rotation of x [T, heads, head_dim] over its first 2 * cos.shape[-1] dims.

    transformers' x * cos + rotate_half(x) * sin, written per half: the same roundings (a + (-b)
    is a - b), and no rotated copy of x for a compiled step to store and read back."""
    half = cos.shape[-1]
    x1, x2, x_pass = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    parts = _turned(x1, x2, cos, sin)
    return torch.cat(parts if x_pass.shape[-1] == 0 else (*parts, x_pass), dim=-1)


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's interleaved rotation of x [T, heads, rot]: pairs (x0, x1), (x2, x3), … each turned
    by one frequency, the results laid out as [evens' rotation, odds' rotation] (transformers'
    spelling; q and k share the layout, so their dot products are those of the pairs)."""
    return torch.cat(_turned(x[..., 0::2], x[..., 1::2], cos, sin), dim=-1)


def _turned(x1: torch.Tensor, x2: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each pair (x1[..., i], x2[..., i]) [T, heads, rot/2] turned by its frequency's angle."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


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
