"""``graphrt::rms_norm`` and ``graphrt::fused_add_rms_norm`` (residual add + norm in one op)."""

import torch

from graphrt.kernels import checks
from graphrt.kernels.canonical import rms_norm as _rms  # the CPU body is the canonical computation
from graphrt.kernels.op_library import define


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _rms(x, weight, eps)


def _rms_norm_fake(x, weight, eps):
    return torch.empty_like(x)


define(
    "rms_norm(Tensor x, Tensor weight, float eps) -> Tensor",
    _rms_norm,
    _rms_norm_fake,
)


def _fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    new_residual = x + residual
    return _rms(new_residual, weight, eps), new_residual


def _fused_add_rms_norm_fake(x, residual, weight, eps):
    return torch.empty_like(x), torch.empty_like(x)


define(
    "fused_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)",
    _fused_add_rms_norm,
    _fused_add_rms_norm_fake,
)


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
