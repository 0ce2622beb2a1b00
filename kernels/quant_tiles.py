"""Quantized tiles: an int4 or int8 matrix laid out for the VNNI dot product's lanes, and its ops.

``kernels/quantized.py``'s layouts keep each weight row's blocks together, so a product reduces
every row's 16 lanes to one output (a horizontal sum, its scales spread over the lanes) and
streams two or three tensors. The tile layout puts 16 weight rows side by side, one per lane, so
each lane accumulates one output column and nothing is reduced across lanes; the scales (and
minimums) of the 16 rows follow their values, so a product reads one stream front to back.
``tiles`` is uint8 ``[N / 16, K / 32, T]``; for row group g and block b (32 values along K), T
bytes, with r in 0..15 the row ``16·g + r``:

- **int4** (T = 320): bytes ``64·c + 4·r + j`` (c, j in 0..3) hold the stored byte ``4·c + j`` of
  row r's block, so the low nibble is value ``4·c + j`` and the high nibble value ``16 + 4·c + j``
  (the plain layout's bytes, regrouped four at a time); bytes 256-287 the 16 rows' float16
  scales, 288-319 their float16 minimums. ``w = q · scale + min``.
- **int8** (T = 544): bytes ``64·c + 4·r + j`` (c in 0..7, j in 0..3) hold value ``4·c + j`` of
  row r's block as ``q + 128`` (the dot product's unsigned operand); bytes 512-543 the 16 rows'
  float16 scales. ``w = q · scale``.

The format is the tile size. Tiles hold exactly the plain layout's numbers, regrouped (int8's
offset is undone exactly); rows must come in whole groups of 16 (every projection of the models
graphrt runs).

Ops (the same pair as the plain layout's):

- ``graphrt::dequantize_tiles(tiles, dtype)``: the float matrix ``[N, K]``; prefill graphs keep
  ``F.linear(x, dequantize_tiles(...))``.
- ``graphrt::linear_tiles(x, tiles, bias)``: ``x · Wᵀ (+ bias)`` over the stored bytes;
  ``passes/use_skinny_gemm.py`` rewrites the spelling above into it for decode-sized graphs.

An embedding lookup gathers its rows back into the plain layout (``rows``). Where tiles are
used: ``wanted()``.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import torch.nn.functional as F

from graphrt.kernels import checks
from graphrt.kernels.quantized import BLOCK, check_quantized, dequantize_torch

ROWS = 16  # weight rows a tile holds side by side
VALUE_BYTES = {4: ROWS * BLOCK // 2, 8: ROWS * BLOCK}  # a block's values for 16 rows
TILE_BYTES = {4: 256 + 2 * ROWS * 2, 8: 512 + ROWS * 2}  # values, 16 scales (and 16 minimums)
BITS = {size: bits for bits, size in TILE_BYTES.items()}  # the format, by tile size

_lib = torch.library.Library("graphrt", "FRAGMENT")
_lib.define("dequantize_tiles(Tensor tiles, ScalarType dtype) -> Tensor")
_lib.define("linear_tiles(Tensor x, Tensor tiles, Tensor? bias) -> Tensor")


def wanted(isa: Optional[str]) -> bool:
    """Whether quantized projections (and embedding tables) are stored as tiles on this CPU: where
    the native kernels run on AVX512-VNNI (``isa`` "vnni", or "amx": VNNI beside AMX tiles). An
    AMD EPYC (family 1Ah), 30 layers of SmolLM2's int4 projections, cold, two threads: 40.5
    against 26.9 GB/s in the plain layout. An Intel Xeon with AMX, SmolLM2's shapes cold (`graphrt
    bench kernels`): one row int4 24.5 against 22.2 GB/s, int8 28.0 against 23.9; eight rows int4
    12.5 against 10.2 (the plain layout's AMX tiles), int8 17.5 against 18.3.
    ``GRAPHRT_QUANT_TILES=0`` or ``1`` overrides the choice."""
    forced = os.environ.get("GRAPHRT_QUANT_TILES")
    if forced in ("0", "1"):
        return forced == "1"
    return isa in ("vnni", "amx")


def tileable(qweight: torch.Tensor) -> bool:
    """A plain int4 or int8 matrix [N, K / 2 or K] whose rows come in whole groups of 16."""
    return qweight.dtype in (torch.uint8, torch.int8) and qweight.ndim == 2 and qweight.shape[0] % ROWS == 0


def to_tiles(qweight: torch.Tensor, scales: torch.Tensor, mins: Optional[torch.Tensor]) -> torch.Tensor:
    """The plain layout's (qweight, scales[, mins]) → tiles."""
    check_quantized(qweight, scales, mins)
    if not tileable(qweight):
        raise checks.KernelArgumentError(
            f"tiles need weights [N, packed K] with N a multiple of {ROWS}; "
            f"got {qweight.dtype} of shape {tuple(qweight.shape)}"
        )
    bits = 4 if qweight.dtype == torch.uint8 else 8
    N = qweight.shape[0]
    G, B = N // ROWS, scales.shape[1]
    stored = qweight if bits == 4 else qweight.view(torch.uint8) ^ 0x80  # int8: q + 128 (mod 256)
    # four bytes a row move together: regrouped as int32 (a load-time copy at memory speed, not a
    # byte at a time)
    quads = stored.contiguous().view(torch.int32).reshape(G, ROWS, B, -1).permute(0, 2, 3, 1)
    values = quads.contiguous().view(torch.uint8).reshape(G, B, VALUE_BYTES[bits])

    def per_block(t: torch.Tensor) -> torch.Tensor:  # [N, B] float16 → [G, B, 32] bytes
        return t.reshape(G, ROWS, B).permute(0, 2, 1).contiguous().view(torch.uint8)

    parts = (values, per_block(scales)) + ((per_block(mins),) if bits == 4 else ())
    return torch.cat(parts, dim=-1).contiguous()


def _signed(values: torch.Tensor) -> torch.Tensor:
    """int8 tiles' stored bytes (q + 128) → q, the inverse of to_tiles' XOR."""
    return (values ^ 0x80).view(torch.int8)


def _plain(tiles: torch.Tensor):
    """[..., B, T] tiles → ([..., 16, B · stored bytes], scales [..., 16, B], mins or None)."""
    bits = BITS[tiles.shape[-1]]
    *lead, B, _ = tiles.shape
    v = VALUE_BYTES[bits]
    values = tiles[..., :v].reshape(*lead, B, v // (4 * ROWS), ROWS, 4)
    values = values.movedim(-2, -4).reshape(*lead, ROWS, B * v // ROWS)  # row r's bytes in order
    if bits == 8:
        values = _signed(values)

    def per_row(lo: int) -> torch.Tensor:  # bytes [lo, lo + 32) of every tile → [..., 16, B] float16
        return tiles[..., lo : lo + 2 * ROWS].contiguous().view(torch.float16).transpose(-1, -2)

    return values, per_row(v), per_row(v + 2 * ROWS) if bits == 4 else None


def from_tiles(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Tiles → the plain layout (qweight, scales, mins or None), the inverse of ``to_tiles``."""
    G = tiles.shape[0]
    q, s, m = _plain(tiles)

    def flat(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(G * ROWS, t.shape[-1]).contiguous()

    return flat(q), flat(s), None if m is None else flat(m)


def rows(tiles: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Rows ``ids`` (any shape) of a tiled matrix in the plain layout: an embedding lookup reads
    only its rows' groups and takes one lane of each (traceable: no data read on the host)."""
    bits = BITS[tiles.shape[-1]]
    v = VALUE_BYTES[bits]
    picked = tiles[ids // ROWS]  # [..., B, T]: each id's group
    *lead, B, _ = picked.shape
    lane = (ids % ROWS).reshape(*lead, 1, 1, 1, 1)
    quads = picked[..., :v].reshape(*lead, B, v // (4 * ROWS), ROWS, 4)
    values = torch.gather(quads, -2, lane.expand(*lead, B, v // (4 * ROWS), 1, 4)).reshape(*lead, B * v // ROWS)
    if bits == 8:
        values = _signed(values)

    def per_row(lo: int) -> torch.Tensor:  # bytes [lo, lo + 32) of each group's tiles → [..., B] float16
        halves = picked[..., lo : lo + 2 * ROWS].contiguous().view(torch.float16)  # [..., B, 16]
        return torch.gather(halves, -1, lane.reshape(*lead, 1, 1).expand(*lead, B, 1)).squeeze(-1)

    return values, per_row(v), per_row(v + 2 * ROWS) if bits == 4 else None


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
        raise checks.KernelArgumentError(f"tiles must be uint8 (kernels/quant_tiles.py), got {got}")
    if tiles.ndim != 3 or tiles.shape[2] not in BITS:
        raise checks.KernelArgumentError(
            f"tiles must be [N / {ROWS}, K / {BLOCK}, 320 (int4) or 544 (int8)], got shape {tuple(tiles.shape)}"
        )
    if not tiles.is_contiguous():
        raise checks.KernelArgumentError(f"tiles must be contiguous, got strides {tiles.stride()}")


def dequantize_tiles(tiles: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    check_tiles(tiles)
    if dtype not in (torch.float32, torch.bfloat16):
        raise checks.KernelArgumentError(f"dtype must be float32 or bfloat16, got {dtype}")
    return torch.ops.graphrt.dequantize_tiles(tiles, dtype)


def linear_tiles(x: torch.Tensor, tiles: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [..., K] · Wᵀ (+ bias [N]) → [..., N] in x's dtype, W [N, K] as tiles."""
    checks.check_float("x", x)
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise checks.KernelArgumentError(f"x must be float32 or bfloat16, got {x.dtype}")
    check_tiles(tiles)
    checks.check_stored_product(x, bias, "tiles", tiles, in_features(tiles), out_features(tiles))
    return torch.ops.graphrt.linear_tiles(x, tiles, bias)
