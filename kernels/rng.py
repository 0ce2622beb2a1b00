"""Counter-based random numbers: one uniform per (seed, offset, stream), with no state.

A row's random draw depends only on its own seed and position, never on its neighbours in the
batch or on a generator's history: that is what makes seeded sampling batch-invariant and lets the
draw sit inside a compiled graph with no host synchronisation.
"""

from __future__ import annotations

import torch


def _i64(c: int) -> int:
    """A 64-bit constant as the signed value torch's int64 holds."""
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN = _i64(0x9E3779B97F4A7C15)
_MIX1 = _i64(0xBF58476D1CE4E5B9)
_MIX2 = _i64(0x94D049BB133111EB)
_OFFSET_MUL = _i64(0xD1B54A32D192ED03)
_STREAM_MUL = 0xABC98388FB8FAC03


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    z = x + _GOLDEN
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def row_uniform(seeds: torch.Tensor, offsets: torch.Tensor, stream: int) -> torch.Tensor:
    """Uniforms in [0, 1) as float64, one per row; a pure function of (seed, offset, stream)."""
    x = splitmix64(seeds.long()) + offsets.long() * _OFFSET_MUL + _i64(stream * _STREAM_MUL % (1 << 64))
    z = splitmix64(splitmix64(x))
    return _shr(z, 11).double() * (1.0 / (1 << 53))
