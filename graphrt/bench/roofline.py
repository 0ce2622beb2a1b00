"""Memory bandwidth of this machine and the bytes a decode step must move."""

from __future__ import annotations

import time

import torch


def measure_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Read bandwidth in bytes per second: a streaming sum over ``gib`` GiB of float32 with the
    step's thread count (torch's), best of ``repeats``. Decode reads its weights and writes almost
    nothing, so this (not a copy, which counts writes too) is the roofline's denominator."""
    n = int(gib * 2**30) // 4
    data = torch.ones(n)
    data.sum()  # touch every page first
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - t)
    return n * 4 / best


def weight_bytes(model: torch.nn.Module) -> int:
    """Parameters and persistent buffers (a quantized model's weights are buffers)."""
    persistent = dict(model.named_buffers()).keys() & model.state_dict().keys()
    buffers = [b for name, b in model.named_buffers() if name in persistent]
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *buffers))


def decode_step_bytes(model: torch.nn.Module, cfg, batch: int, context: int, dtype: torch.dtype) -> int:
    """Weights once per step (the tied LM head is the embedding) + every row's K/V read."""
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize * context * batch
    return weight_bytes(model) + kv
