"""Memory bandwidth of this machine and the bytes a decode step must move."""

from __future__ import annotations

import time

import torch

from graphrt.runner.huge_pages import huge_page_buffer, huge_pages_available

READ_COLUMNS = 576  # the product read's row length: a decode projection's (K = 2048: 31.6 GB/s)


def measure_bandwidth(gib: float = 1.0, repeats: int = 5, huge_pages: bool = False) -> float:
    """Read bandwidth in bytes per second: the faster of the two streaming reads of
    ``streaming_reads``. Decode reads its weights and writes almost nothing, so a read (not a
    copy, which counts writes too) is the roofline's denominator; and the faster read, because a
    roofline is what the memory can give: a step that beats its roofline had a wrong one."""
    return max(streaming_reads(gib, repeats, huge_pages).values())


def streaming_reads(gib: float = 1.0, repeats: int = 5, huge_pages: bool = False) -> dict[str, float]:
    """Bytes per second of two reads of the same ``gib`` GiB of float32 with the step's thread
    count (torch's), each the best of ``repeats``:

    ``sum``: torch's sum, which leaves the streaming to the hardware prefetchers;
    ``product``: graphrt's one-row product over the GiB as a [rows, 576] matrix (SmolLM2's hidden
    size), the decode kernel's software-prefetched stream. On the 2-vCPU Intel VM it read 37.1
    GB/s where the sum read 30.8 (2 MiB pages; 28.7 against 24.8 over 4 KiB pages), so the
    product sets the roofline there; without the native kernels it is aten's product.

    ``huge_pages``: the GiB sits in 2 MiB pages, as an engine with ``huge_pages`` on places its
    weights. The roofline must be read through the pages the step reads: the sum read 24.4 GB/s
    over 4 KiB pages and 30.0 over 2 MiB pages, and a decode step over huge pages "beat" a 4 KiB
    roofline by 23%."""
    import graphrt.kernels  # noqa: F401  (graphrt::linear)

    data = read_buffer(int(gib * 2**30) // 4 * 4, huge_pages)
    rows = data.numel() // READ_COLUMNS
    matrix = data[: rows * READ_COLUMNS].view(rows, READ_COLUMNS)
    x = torch.ones(1, READ_COLUMNS)
    reads = {
        "sum": (data.numel() * 4, data.sum),
        "product": (matrix.numel() * 4, lambda: torch.ops.graphrt.linear(x, matrix, None)),
    }
    out = {}
    for name, (nbytes, read) in reads.items():
        read()
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            read()
            best = min(best, time.perf_counter() - t)
        out[name] = nbytes / best
    return out


def pages_name(huge_pages: bool) -> str:
    """The page size a ``huge_pages`` setting gives here (the JSON's ``bandwidth_pages``)."""
    return "2 MiB" if _in_huge_pages(huge_pages) else "4 KiB"


def _in_huge_pages(huge_pages: bool) -> bool:
    return huge_pages and huge_pages_available()


_buffer: tuple[tuple[int, bool], torch.Tensor] | None = None  # the last one, kept for the next row


def read_buffer(nbytes: int, huge_pages: bool) -> torch.Tensor:
    """``nbytes`` of float32 ones in 2 MiB pages (where the kernel gives them) or 4 KiB ones, every
    page touched. Kept for the process until a different one is asked for: a benchmark measures
    before and after every row, and a fresh GiB of huge pages costs its first touch each time
    (3.2 s on the VM above, against 0.2 s in 4 KiB pages)."""
    global _buffer
    key = (nbytes, _in_huge_pages(huge_pages))
    if _buffer is None or _buffer[0] != key:
        _buffer = None  # the old one goes first: two GiB are never held at once
        data = huge_page_buffer(nbytes).view(torch.float32) if key[1] else torch.empty(nbytes // 4)
        data.fill_(1.0)
        _buffer = (key, data)
    return _buffer[1]


def weight_bytes(model: torch.nn.Module) -> int:
    """Parameters and persistent buffers (a quantized model's weights are buffers)."""
    persistent = dict(model.named_buffers()).keys() & model.state_dict().keys()
    buffers = [b for name, b in model.named_buffers() if name in persistent]
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *buffers))


def decode_step_bytes(model: torch.nn.Module, cfg, batch: int, context: int, kv_dtype: torch.dtype) -> int:
    """Weights once per step (the tied LM head is the embedding) + every row's K/V read (in the
    caches' dtype)."""
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * kv_dtype.itemsize * context * batch
    return weight_bytes(model) + kv
