"""int4 tiles: an int4 matrix laid out for the VNNI dot product's lanes, and its two ops.

``kernels/quantized.py``'s int4 layout keeps each weight row's blocks together, so a product
reduces every row's 16 lanes to one output (a horizontal sum, its scales spread over the lanes)
and streams three tensors. The tile layout puts 16 weight rows side by side, one per lane, so each
lane accumulates one output column and nothing is reduced across lanes; the scales and minimums of
the 16 rows follow their values, so a product reads one stream front to back. ``tiles`` is uint8
``[N / 16, K / 32, 320]``: for row group g and block b (32 values along K), 320 bytes:

- bytes ``64·c + 4·r + j`` (c, j in 0..3; r in 0..15): the stored byte ``4·c + j`` of row
  ``16·g + r``'s block, so its low nibble is value ``4·c + j`` and its high nibble value
  ``16 + 4·c + j`` (the plain layout's bytes, regrouped four at a time);
- bytes 256-287: the 16 rows' float16 scales; bytes 288-319: their float16 minimums.

``w = q · scale + min`` as in the plain layout: tiles are a permutation of its bytes, nothing is
rounded again. Rows must come in whole groups of 16 (every projection of the models graphrt runs).

Ops (the same pair as the plain layout's):

- ``graphrt::dequantize_tiles(tiles, dtype)``: the float matrix ``[N, K]``; prefill graphs keep
  ``F.linear(x, dequantize_tiles(...))``.
- ``graphrt::linear_tiles(x, tiles, bias)``: ``x · Wᵀ (+ bias)`` over the stored bytes;
  ``passes/use_skinny_gemm.py`` rewrites the spelling above into it for decode-sized graphs.

Where tiles are used: ``wanted()``.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import torch.nn.functional as F

from graphrt.kernels import checks
from graphrt.kernels.quantized import BLOCK, check_quantized, dequantize_torch

ROWS = 16  # weight rows a tile holds side by side
VALUE_BYTES = ROWS * BLOCK // 2  # 256: a block's values for 16 rows
TILE_BYTES = VALUE_BYTES + 2 * ROWS * 2  # 320: values, then 16 scales and 16 minimums (float16)

_lib = torch.library.Library("graphrt", "FRAGMENT")
_lib.define("dequantize_tiles(Tensor tiles, ScalarType dtype) -> Tensor")
_lib.define("linear_tiles(Tensor x, Tensor tiles, Tensor? bias) -> Tensor")


def wanted(isa: Optional[str]) -> bool:
    """Whether int4 projections are stored as tiles on this CPU: where the native kernels run on
    AVX512-VNNI without AMX tiles (``isa`` "vnni"). An AMD EPYC (family 1Ah), 30 layers of
    SmolLM2's int4 projections, cold, two threads: 40.5 against 26.9 GB/s in the plain layout.
    A CPU with AMX keeps the plain layout, whose 6-8-row products run on AMX there (tiles are not
    measured on one). ``GRAPHRT_INT4_TILES=0`` or ``1`` overrides the choice."""
    forced = os.environ.get("GRAPHRT_INT4_TILES")
    if forced in ("0", "1"):
        return forced == "1"
    return isa == "vnni"


def tileable(qweight: torch.Tensor) -> bool:
    """An int4 matrix [N, K / 2] whose rows come in whole groups of 16."""
    return qweight.dtype == torch.uint8 and qweight.ndim == 2 and qweight.shape[0] % ROWS == 0


def to_tiles(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """The plain int4 layout's (qweight [N, K / 2], scales, mins [N, K / 32]) → tiles."""
    check_quantized(qweight, scales, mins)
    if not tileable(qweight):
        raise checks.KernelArgumentError(
            f"tiles need int4 (uint8) weights [N, K / 2] with N a multiple of {ROWS}; "
            f"got {qweight.dtype} of shape {tuple(qweight.shape)}"
        )
    N, half = qweight.shape
    G, B = N // ROWS, half * 2 // BLOCK
    values = qweight.reshape(G, ROWS, B, 4, 4).permute(0, 2, 3, 1, 4).reshape(G, B, VALUE_BYTES)

    def per_block(t: torch.Tensor) -> torch.Tensor:  # [N, B] float16 → [G, B, 32] bytes
        return t.reshape(G, ROWS, B).permute(0, 2, 1).contiguous().view(torch.uint8)

    return torch.cat((values, per_block(scales), per_block(mins)), dim=-1).contiguous()


def from_tiles(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tiles → the plain int4 layout (qweight, scales, mins), the inverse of ``to_tiles``."""
    G, B, _ = tiles.shape
    values = tiles[..., :VALUE_BYTES].reshape(G, B, 4, ROWS, 4).permute(0, 3, 1, 2, 4)
    qweight = values.reshape(G * ROWS, B * BLOCK // 2)

    def per_row(lo: int) -> torch.Tensor:  # bytes [lo, lo + 32) of every tile → [N, B] float16
        halves = tiles[..., lo : lo + 2 * ROWS].contiguous().view(torch.float16)
        return halves.permute(0, 2, 1).reshape(G * ROWS, B)

    return qweight.contiguous(), per_row(VALUE_BYTES), per_row(VALUE_BYTES + 2 * ROWS)


def out_features(tiles: torch.Tensor) -> int:
    return tiles.shape[0] * ROWS


def in_features(tiles: torch.Tensor) -> int:
    return tiles.shape[1] * BLOCK


def dequantize_tiles_torch(tiles: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The reference (and portable) body: [N, K] in ``dtype``, computed in fp32."""
    return dequantize_torch(*from_tiles(tiles), dtype)


def linear_tiles_torch(x, tiles, bias):
    """The portable body (and the reference): dequantise, then aten's linear in fp32."""
    w = dequantize_tiles_torch(tiles, torch.float32)
    y = F.linear(x.float(), w, None if bias is None else bias.float())
    return y.to(x.dtype)


_lib.impl("dequantize_tiles", dequantize_tiles_torch, "CompositeExplicitAutograd")
_lib.impl("linear_tiles", linear_tiles_torch, "CompositeExplicitAutograd")


@torch.library.register_fake("graphrt::dequantize_tiles")
def _(tiles, dtype):
    return tiles.new_empty((out_features(tiles), in_features(tiles)), dtype=dtype)


@torch.library.register_fake("graphrt::linear_tiles")
def _(x, tiles, bias):
    return x.new_empty((*x.shape[:-1], out_features(tiles)))


def check_tiles(tiles: torch.Tensor) -> None:
    if not isinstance(tiles, torch.Tensor) or tiles.dtype != torch.uint8:
        got = tiles.dtype if isinstance(tiles, torch.Tensor) else type(tiles).__name__
        raise checks.KernelArgumentError(f"tiles must be uint8 (int4 tiles, kernels/quant_tiles.py), got {got}")
    if tiles.ndim != 3 or tiles.shape[2] != TILE_BYTES:
        raise checks.KernelArgumentError(
            f"tiles must be [N / {ROWS}, K / {BLOCK}, {TILE_BYTES}], got shape {tuple(tiles.shape)}"
        )
    if not tiles.is_contiguous():
        raise checks.KernelArgumentError(f"tiles must be contiguous, got strides {tiles.stride()}")


def dequantize_tiles(tiles: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    check_tiles(tiles)
    if dtype not in (torch.float32, torch.bfloat16):
        raise checks.KernelArgumentError(f"dtype must be float32 or bfloat16, got {dtype}")
    return torch.ops.graphrt.dequantize_tiles(tiles, dtype)


def linear_tiles(x: torch.Tensor, tiles: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [..., K] · Wᵀ (+ bias [N]) → [..., N] in x's dtype, W [N, K] as int4 tiles."""
    checks.check_float("x", x)
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise checks.KernelArgumentError(f"x must be float32 or bfloat16, got {x.dtype}")
    check_tiles(tiles)
    if x.ndim == 0:
        raise checks.KernelArgumentError("x must have at least one dimension [..., in_features], got a scalar")
    checks.check_dim("x", x, x.ndim - 1, in_features(tiles), "in_features of tiles")
    if bias is not None:
        checks.check_ndim("bias", bias, 1, "[out_features]")
        checks.check_dim("bias", bias, 0, out_features(tiles), "out_features of tiles")
    checks.check_same_device(("x", "tiles"), (x, tiles))
    return torch.ops.graphrt.linear_tiles(x, tiles, bias)
