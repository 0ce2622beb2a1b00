"""Packed bf16 weights: a bf16 matrix laid out for AMX tiles, and its ops.

The row-major ``[N, K]`` matrix reaches a tile product 16 weight rows at a time, 64 bytes of each:
every k-step of 32 values reads 32 lines from 32 places 2·K bytes apart, and the tiles' output
is the transpose of the result. Packed, the weights are the tile product's second operand in its
own pair layout: the 32 values of 32 output columns that one k-step reads are 2 KiB in one place,
a block of 32 columns is one stream read front to back, and the activations are the first
operand, read as they are. ``packed`` is bf16 ``[N / 32, K / 32, 32, 32]``; viewed as
``[N / 32, K / 32, 2, 16, 16, 2]``, element ``[b, s, h, p, c, e]`` is
``w[32·b + 16·h + c, 32·s + 2·p + e]``. A block starts where its first row did (element
``32·b·K``), so the packed matrix is the same size and holds exactly the same numbers.

Measured on an Intel Xeon with AMX, SmolLM2's projection shapes, cold, two threads (`graphrt bench
kernels --rows 1,8 --dtypes bfloat16`): 8 activation rows at 83% of the read bandwidth, against
67-71% over the row-major matrices; 1 row at 85%. Prefill rows too: at 32-512 rows the tile
product ran 0.96-1.8x aten's GEMM on the row-major matrix (docs/performance.md, "Packed bf16
weights for AMX tiles").

The same layout serves AVX512-BF16's dot product on a CPU without tiles (an AMD EPYC): one
64-byte vector of a k-step is 16 weight rows' pairs of one k-pair, so ``vdpbf16ps`` against an
activation pair broadcast to every lane adds into 16 outputs' own lanes, with no sum across lanes
at the end (``native/dot_packed_gemm.h``). SmolLM2's projection shapes, cold, two threads, 8 rows:
about twice the row-major kernel's speed; prefill rows ahead of aten's GEMM too (docs/performance.md,
"Packed bf16 weights on AVX512-BF16").

Ops:

- ``graphrt::unpack_bf16(packed)``: the row-major matrix ``[N, K]``; a model spells a projection
  ``F.linear(x, unpack_bf16(packed), bias)``, which runs as written only where
  ``use_skinny_gemm`` is disabled.
- ``graphrt::linear_packed_bf16(x, packed, bias)``: ``x · Wᵀ (+ bias)`` over the packed blocks,
  bf16 activations, fp32 accumulation, bf16 out; ``passes/use_skinny_gemm.py`` rewrites the
  spelling above into it in every graph, prefill included. Where the CPU has neither AMX tiles
  nor AVX512-BF16 it multiplies the matrix put back (correct, slower; such a CPU does not pack:
  ``wanted()``).

Both dimensions must be multiples of 32 (every projection and embedding table of the models
graphrt runs; a matrix that is not stays row-major). An embedding lookup gathers its rows back
(``rows``).
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import torch.nn.functional as F

from graphrt.kernels import checks

ROWS = 32  # weight rows a block holds; also the values of a k-step

_lib = torch.library.Library("graphrt", "FRAGMENT")
_lib.define("unpack_bf16(Tensor packed) -> Tensor")
_lib.define("linear_packed_bf16(Tensor x, Tensor packed, Tensor? bias) -> Tensor")


def wanted(native_product: bool) -> bool:
    """Whether bf16 projections (and embedding tables) are packed on this CPU: where the native
    library multiplies the packed blocks (``native_product``, ``graphrt.kernels.NATIVE_PACKS_BF16``:
    AMX tiles, or AVX512-BF16's dot product). ``GRAPHRT_PACKED_BF16=0`` or ``1`` overrides the
    choice (``1`` on a CPU without either: the packed ops' row-major fallback, for tests)."""
    forced = os.environ.get("GRAPHRT_PACKED_BF16")
    if forced in ("0", "1"):
        return forced == "1"
    return native_product


def packable(weight: torch.Tensor) -> bool:
    """A bf16 matrix [N, K] with N and K multiples of 32."""
    return (
        weight.dtype == torch.bfloat16
        and weight.ndim == 2
        and weight.shape[0] % ROWS == 0
        and weight.shape[1] % ROWS == 0
    )


def to_packed(weight: torch.Tensor) -> torch.Tensor:
    """The row-major bf16 matrix [N, K] → packed [N / 32, K / 32, 32, 32]."""
    if not isinstance(weight, torch.Tensor) or not packable(weight):
        got = f"{weight.dtype} of shape {tuple(weight.shape)}" if isinstance(weight, torch.Tensor) else type(weight)
        raise checks.KernelArgumentError(
            f"packing needs a bfloat16 matrix [N, K] with N and K multiples of {ROWS}; got {got}"
        )
    N, K = weight.shape
    parts = weight.detach().reshape(N // ROWS, 2, 16, K // ROWS, 16, 2)  # [b, h, c, s, p, e]
    return parts.permute(0, 3, 1, 4, 2, 5).reshape(N // ROWS, K // ROWS, ROWS, ROWS).contiguous()


def out_features(packed: torch.Tensor) -> int:
    return packed.shape[0] * ROWS


def in_features(packed: torch.Tensor) -> int:
    return packed.shape[1] * ROWS


def _parts(packed: torch.Tensor) -> torch.Tensor:
    """[B, S, 32, 32] → its view [B, S, h, p, c, e]."""
    return packed.view(*packed.shape[:2], 2, 16, 16, 2)


def unpack_torch(packed: torch.Tensor) -> torch.Tensor:
    """The reference (and portable) body: the row-major matrix [N, K]."""
    return _parts(packed).permute(0, 2, 4, 1, 3, 5).reshape(out_features(packed), in_features(packed))


def linear_packed_bf16_torch(x, packed, bias):
    """The portable body (and the reference): aten's linear in fp32 over the matrix put back."""
    y = F.linear(x.float(), unpack_torch(packed).float(), None if bias is None else bias.float())
    return y.to(x.dtype)


def rows(packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` (any shape) of a packed matrix, ``[*ids.shape, K]``: an embedding lookup reads
    only its rows' pairs (traceable: no data read on the host)."""
    within = ids % ROWS
    picked = _parts(packed)[ids // ROWS, :, within // 16, :, within % 16]  # [*ids.shape, S, p, e]
    return picked.reshape(*ids.shape, in_features(packed))


_lib.impl("unpack_bf16", unpack_torch, "CompositeExplicitAutograd")
_lib.impl("linear_packed_bf16", linear_packed_bf16_torch, "CompositeExplicitAutograd")


@torch.library.register_fake("graphrt::unpack_bf16")
def _(packed):
    return packed.new_empty((out_features(packed), in_features(packed)))


@torch.library.register_fake("graphrt::linear_packed_bf16")
def _(x, packed, bias):
    return x.new_empty((*x.shape[:-1], out_features(packed)))


def check_packed(packed: torch.Tensor) -> None:
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.bfloat16:
        got = packed.dtype if isinstance(packed, torch.Tensor) else type(packed).__name__
        raise checks.KernelArgumentError(f"packed must be bfloat16 (kernels/packed_bf16.py), got {got}")
    if packed.ndim != 4 or packed.shape[2:] != (ROWS, ROWS):
        raise checks.KernelArgumentError(
            f"packed must be [N / {ROWS}, K / {ROWS}, {ROWS}, {ROWS}], got shape {tuple(packed.shape)}"
        )
    if not packed.is_contiguous():
        raise checks.KernelArgumentError(f"packed must be contiguous, got strides {packed.stride()}")


def unpack_bf16(packed: torch.Tensor) -> torch.Tensor:
    check_packed(packed)
    return torch.ops.graphrt.unpack_bf16(packed)


def linear_packed_bf16(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [..., K] bf16 · Wᵀ (+ bias [N]) → [..., N] bf16, W [N, K] packed."""
    checks.check_float("x", x)
    if x.dtype != torch.bfloat16:
        raise checks.KernelArgumentError(f"x must be bfloat16 (the packed weights' dtype), got {x.dtype}")
    check_packed(packed)
    checks.check_stored_product(x, bias, "packed", packed, in_features(packed), out_features(packed))
    return torch.ops.graphrt.linear_packed_bf16(x, packed, bias)
