"""``graphrt::rms_norm`` and ``graphrt::fused_add_rms_norm`` (residual add + norm in one op)."""

import torch

from graphrt.kernels import checks
from graphrt.kernels.canonical import rms_norm as _rms  # the CPU body is the canonical computation


@torch.library.custom_op("graphrt::rms_norm", mutates_args=())
def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _rms(x, weight, eps)


@_rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


@torch.library.custom_op("graphrt::fused_add_rms_norm", mutates_args=())
def _fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    new_residual = x + residual
    return _rms(new_residual, weight, eps), new_residual


@_fused_add_rms_norm.register_fake
def _(x, residual, weight, eps):
    return torch.empty_like(x), torch.empty_like(x)


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    checks.check_float("x", x)
    checks.check_ndim("weight", weight, 1, "[hidden]")
    checks.check_dim("x", x, x.ndim - 1, weight.shape[0], "hidden size of weight")
    checks.check_same_device(("x", "weight"), (x, weight))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    _check(x, weight)
    return torch.ops.graphrt.rms_norm(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(rms_norm(x + residual), x + residual)``."""
    _check(x, weight)
    if residual.shape != x.shape:
        raise checks.KernelArgumentError(
            f"residual shape {tuple(residual.shape)} differs from x shape {tuple(x.shape)}"
        )
    return torch.ops.graphrt.fused_add_rms_norm(x, residual, weight, eps)
