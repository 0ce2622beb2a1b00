"""Argument checks for the public op wrappers: every error names the argument and its value."""

from __future__ import annotations

import torch


class KernelArgumentError(ValueError):
    """An op was called with a tensor of the wrong shape, dtype or device."""


def check_ndim(name: str, t: torch.Tensor, ndim: int, layout: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise KernelArgumentError(f"{name} must be a tensor {layout}, got {type(t).__name__}")
    if t.ndim != ndim:
        raise KernelArgumentError(f"{name} must be {layout} ({ndim}-D), got shape {tuple(t.shape)}")


def check_dim(name: str, t: torch.Tensor, dim: int, size: int, what: str) -> None:
    if t.shape[dim] != size:
        raise KernelArgumentError(
            f"{name} has size {t.shape[dim]} in dim {dim}, expected {size} ({what}); shape {tuple(t.shape)}"
        )


def check_int(name: str, t: torch.Tensor) -> None:
    if t.dtype not in (torch.int32, torch.int64):
        raise KernelArgumentError(f"{name} must be int32 or int64, got {t.dtype}")


def check_float(name: str, t: torch.Tensor) -> None:
    if not t.dtype.is_floating_point:
        raise KernelArgumentError(f"{name} must be a floating-point tensor, got {t.dtype}")


def check_same_dtype(names: tuple[str, ...], tensors: tuple[torch.Tensor, ...]) -> None:
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1:
        got = ", ".join(f"{n}={t.dtype}" for n, t in zip(names, tensors))
        raise KernelArgumentError(f"{' and '.join(names)} must share a dtype, got {got}")


def cache_holds(dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """Whether a KV cache of ``cache_dtype`` serves a model computing in ``dtype``: its own dtype,
    or bfloat16 under float32 (a bf16 KV cache: half the bytes; its values rounded on the write,
    widened on the read). The attention kernels and the engine's ``kv_cache_dtype`` share this rule."""
    return cache_dtype == dtype or (dtype, cache_dtype) == (torch.float32, torch.bfloat16)


def check_cache_dtype(name: str, t: torch.Tensor, cache_name: str, cache: torch.Tensor) -> None:
    if not cache_holds(t.dtype, cache.dtype):
        raise KernelArgumentError(
            f"{cache_name} is {cache.dtype} under {name} of {t.dtype}: a cache holds {name}'s dtype, "
            f"or torch.bfloat16 under torch.float32"
        )


def check_same_device(names: tuple[str, ...], tensors: tuple[torch.Tensor, ...]) -> None:
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        got = ", ".join(f"{n} on {t.device}" for n, t in zip(names, tensors))
        raise KernelArgumentError(f"all tensors must be on one device, got {got}")


def check_stored_product(x: torch.Tensor, bias, name: str, stored: torch.Tensor, in_features: int, out_features: int):
    """What a product ``x [..., K] · Wᵀ (+ bias [N])`` over a stored layout ``name`` checks once the
    layout itself is checked: x's rank and K, the bias's size, one device."""
    if x.ndim == 0:
        raise KernelArgumentError("x must have at least one dimension [..., in_features], got a scalar")
    check_dim("x", x, x.ndim - 1, in_features, f"in_features of {name}")
    if bias is not None:
        check_ndim("bias", bias, 1, "[out_features]")
        check_dim("bias", bias, 0, out_features, f"out_features of {name}")
    check_same_device(("x", name), (x, stored))
