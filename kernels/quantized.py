"""Weight-only quantized matrices: graphrt's int4 and int8 layouts and their two ops.

A weight ``W [N, K]`` (K a multiple of 32) is stored in blocks of 32 values along K, GGUF's
blocks split into three tensors so every kernel streams each one front to back:

- **int4** (GGUF Q4_0 and Q4_1): ``qweight`` uint8 ``[N, K / 2]``, each block's 16 bytes holding
  values 0-15 of the block in their low nibbles and values 16-31 in their high nibbles (GGUF's
  order); ``scales`` and ``mins`` float16 ``[N, K / 32]``; ``w = q · scale + min`` with q in 0..15.
  Q4_1 is exactly this; Q4_0's ``w = (q − 8) · scale`` is stored with ``min = −8 · scale``
  (exact in float16).
- **int8** (GGUF Q8_0): ``qweight`` int8 ``[N, K]``, ``scales`` float16 ``[N, K / 32]``, no mins;
  ``w = q · scale``.

The qweight's dtype names the format (uint8: int4, int8: int8). Ops:

- ``graphrt::dequantize(qweight, scales, mins, dtype)``: the float matrix. Models write
  ``F.linear(x, dequantize(...))`` (and ``dequantize(qweight[ids], ...)`` for an embedding
  lookup, which reads only the rows it needs); that is the spelling prefill graphs keep.
- ``graphrt::linear_quantized(x, qweight, scales, mins, bias)``: ``x · Wᵀ (+ bias)`` reading the
  quantized bytes directly (the native kernel dequantises a block in registers and multiplies
  every activation row by it; fp32 accumulation). ``passes/use_skinny_gemm.py`` rewrites the
  spelling above into it for decode-sized graphs.

``quantize_int4`` / ``quantize_int8`` pack a float matrix (quantize-at-load): int4 per block
asymmetric (scale = (max − min) / 15, min = the block's minimum, as Q4_1), int8 per block
symmetric (scale = max |w| / 127, as Q8_0).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from graphrt.kernels import checks

BLOCK = 32
FORMATS = {torch.uint8: "int4", torch.int8: "int8"}

_lib = torch.library.Library("graphrt", "FRAGMENT")
_lib.define("dequantize(Tensor qweight, Tensor scales, Tensor? mins, ScalarType dtype) -> Tensor")
_lib.define("linear_quantized(Tensor x, Tensor qweight, Tensor scales, Tensor? mins, Tensor? bias) -> Tensor")


def in_features(qweight: torch.Tensor) -> int:
    return qweight.shape[-1] * 2 if qweight.dtype == torch.uint8 else qweight.shape[-1]


def dequantize_torch(
    qweight: torch.Tensor, scales: torch.Tensor, mins: Optional[torch.Tensor], dtype: torch.dtype
) -> torch.Tensor:
    """The reference (and portable) body: [..., K] in ``dtype``, computed in fp32."""
    lead = qweight.shape[:-1]
    blocks = scales.shape[-1]
    if qweight.dtype == torch.uint8:
        packed = qweight.reshape(*lead, blocks, BLOCK // 2)
        q = torch.cat((packed & 0xF, packed >> 4), dim=-1).float()
    else:
        q = qweight.reshape(*lead, blocks, BLOCK).float()
    w = q * scales.float()[..., None]
    if mins is not None:
        w = w + mins.float()[..., None]
    return w.reshape(*lead, blocks * BLOCK).to(dtype)


def linear_quantized_torch(x, qweight, scales, mins, bias):
    """The portable body (and the reference): dequantise, then aten's linear in fp32."""
    w = dequantize_torch(qweight, scales, mins, torch.float32)
    y = F.linear(x.float(), w, None if bias is None else bias.float())
    return y.to(x.dtype)


_lib.impl("dequantize", dequantize_torch, "CompositeExplicitAutograd")
_lib.impl("linear_quantized", linear_quantized_torch, "CompositeExplicitAutograd")


@torch.library.register_fake("graphrt::dequantize")
def _(qweight, scales, mins, dtype):
    return qweight.new_empty((*qweight.shape[:-1], in_features(qweight)), dtype=dtype)


@torch.library.register_fake("graphrt::linear_quantized")
def _(x, qweight, scales, mins, bias):
    return x.new_empty((*x.shape[:-1], qweight.shape[0]))


def check_quantized(qweight: torch.Tensor, scales: torch.Tensor, mins: Optional[torch.Tensor]) -> None:
    """Every layout rule, each error naming the argument and what is allowed."""
    if not isinstance(qweight, torch.Tensor) or qweight.dtype not in FORMATS:
        got = qweight.dtype if isinstance(qweight, torch.Tensor) else type(qweight).__name__
        raise checks.KernelArgumentError(f"qweight must be uint8 (int4, two values a byte) or int8 (int8), got {got}")
    if qweight.ndim < 1:
        raise checks.KernelArgumentError("qweight must have at least one dimension [..., packed in_features]")
    K = in_features(qweight)
    if K % BLOCK:
        raise checks.KernelArgumentError(
            f"qweight holds {K} values a row, not a whole number of {BLOCK}-value blocks; shape {tuple(qweight.shape)}"
        )
    if not isinstance(scales, torch.Tensor) or scales.dtype != torch.float16:
        got = scales.dtype if isinstance(scales, torch.Tensor) else type(scales).__name__
        raise checks.KernelArgumentError(f"scales must be float16, got {got}")
    want = (*qweight.shape[:-1], K // BLOCK)
    if tuple(scales.shape) != want:
        raise checks.KernelArgumentError(
            f"scales must have shape {want} (one per {BLOCK}-value block), got {tuple(scales.shape)}"
        )
    if qweight.dtype == torch.uint8:
        if mins is None:
            raise checks.KernelArgumentError("mins is required for int4 (uint8) weights: w = q * scale + min")
        if mins.dtype != torch.float16 or tuple(mins.shape) != want:
            raise checks.KernelArgumentError(
                f"mins must be float16 of shape {want}, got {mins.dtype} of shape {tuple(mins.shape)}"
            )
    elif mins is not None:
        raise checks.KernelArgumentError("mins must be None for int8 weights (w = q * scale, symmetric)")
    for name, t in (("qweight", qweight), ("scales", scales), ("mins", mins)):
        if t is not None and not t.is_contiguous():
            raise checks.KernelArgumentError(
                f"{name} must be contiguous (row-major), got strides {t.stride()} for shape {tuple(t.shape)}"
            )


def dequantize(
    qweight: torch.Tensor, scales: torch.Tensor, mins: Optional[torch.Tensor] = None, dtype=torch.float32
) -> torch.Tensor:
    check_quantized(qweight, scales, mins)
    if dtype not in (torch.float32, torch.bfloat16):
        raise checks.KernelArgumentError(f"dtype must be float32 or bfloat16, got {dtype}")
    return torch.ops.graphrt.dequantize(qweight, scales, mins, dtype)


def linear_quantized(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """x [..., K] · Wᵀ (+ bias [N]) → [..., N] in x's dtype, W [N, K] quantized as above."""
    checks.check_float("x", x)
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise checks.KernelArgumentError(f"x must be float32 or bfloat16, got {x.dtype}")
    check_quantized(qweight, scales, mins)
    checks.check_ndim("qweight", qweight, 2, "[out_features, packed in_features]")
    if x.ndim == 0:
        raise checks.KernelArgumentError("x must have at least one dimension [..., in_features], got a scalar")
    checks.check_dim("x", x, x.ndim - 1, in_features(qweight), "in_features of qweight")
    if bias is not None:
        checks.check_ndim("bias", bias, 1, "[out_features]")
        checks.check_dim("bias", bias, 0, qweight.shape[0], "out_features of qweight")
    checks.check_same_device(("x", "qweight"), (x, qweight))
    return torch.ops.graphrt.linear_quantized(x, qweight, scales, mins, bias)


def _blocks(w: torch.Tensor) -> torch.Tensor:
    checks.check_ndim("weight", w, 2, "[out_features, in_features]")
    if w.shape[1] % BLOCK:
        raise checks.KernelArgumentError(
            f"weight has {w.shape[1]} in_features, not a multiple of the {BLOCK}-value block; cannot quantize"
        )
    return w.float().reshape(w.shape[0], -1, BLOCK)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block symmetric int8 (Q8_0): (qweight int8 [N, K], scales fp16 [N, K / 32])."""
    b = _blocks(w)
    scales = (b.abs().amax(dim=-1) / 127).half()
    s = scales.float()[..., None]
    q = torch.where(s > 0, torch.round(b / torch.where(s > 0, s, 1)), 0).clamp(-127, 127)
    return q.to(torch.int8).reshape(w.shape), scales


def quantize_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-block asymmetric int4 (Q4_1): (qweight uint8 [N, K / 2], scales, mins fp16 [N, K / 32])."""
    b = _blocks(w)
    lo, hi = b.amin(dim=-1), b.amax(dim=-1)
    mins = lo.half()
    scales = ((hi - mins.float()) / 15).half()
    s = scales.float()[..., None]
    q = torch.where(s > 0, torch.round((b - mins.float()[..., None]) / torch.where(s > 0, s, 1)), 0).clamp(0, 15)
    q = q.to(torch.uint8)
    packed = q[..., : BLOCK // 2] | (q[..., BLOCK // 2 :] << 4)
    return packed.reshape(w.shape[0], -1), scales, mins
