"""``graphrt::linear``: the skinny GEMM of decode steps, ``y = x · Wᵀ (+ bias)``.

For the few rows of a decode step a matrix product is a stream over the weights, and its speed is
the memory's: the native CPU kernel (``native/skinny_gemm.h``) reads every weight byte once for
all rows, with AVX-512, AVX2 or portable vectors chosen at run time, fp32 accumulation, parallel
over the output columns with torch's thread count. The weights are the model's own tensors, in
place, row-major ``[N, K]`` (fp32 or bf16): no packed copy, so every graph reads one set.
``passes/use_skinny_gemm.py`` puts this op where a graph's row count is small; prefill keeps aten's
GEMM. Without the native library the op runs ``linear_torch`` (aten), on any device.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from graphrt.kernels import checks

_lib = torch.library.Library("graphrt", "FRAGMENT")
_lib.define("linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")

WEIGHT_DTYPES = (torch.float32, torch.bfloat16)


def linear_torch(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """The portable body (and the reference): aten's linear with fp32 accumulation."""
    y = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return y.to(x.dtype)


_lib.impl("linear", linear_torch, "CompositeExplicitAutograd")


@torch.library.register_fake("graphrt::linear")
def _(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [..., K] · weight [N, K]ᵀ (+ bias [N]) → [..., N] in x's dtype."""
    checks.check_float("x", x)
    if x.dtype not in WEIGHT_DTYPES:
        raise checks.KernelArgumentError(f"x must be float32 or bfloat16, got {x.dtype}")
    checks.check_ndim("weight", weight, 2, "[out_features, in_features]")
    if weight.dtype not in WEIGHT_DTYPES:
        raise checks.KernelArgumentError(f"weight must be float32 or bfloat16, got {weight.dtype}")
    if not weight.is_contiguous():
        raise checks.KernelArgumentError(
            f"weight must be contiguous (row-major [N, K]), got strides {weight.stride()} for shape "
            f"{tuple(weight.shape)}; pass weight.contiguous()"
        )
    if x.ndim == 0:
        raise checks.KernelArgumentError("x must have at least one dimension [..., in_features], got a scalar")
    checks.check_dim("x", x, x.ndim - 1, weight.shape[1], "in_features of weight")
    if bias is not None:
        checks.check_ndim("bias", bias, 1, "[out_features]")
        checks.check_dim("bias", bias, 0, weight.shape[0], "out_features of weight")
    checks.check_same_device(("x", "weight"), (x, weight))
    return torch.ops.graphrt.linear(x, weight, bias)
