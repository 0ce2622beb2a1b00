"""``graphrt bench kernels``: graphrt's skinny GEMM against aten's linear on a model's projection
shapes, with cold weights, next to the machine's read bandwidth measured in the same run.

Cold means what a decode step sees: every call reads a matrix that is not in any cache. Each
shape gets enough distinct matrices that one sweep over them is several times the last-level
cache; a single repeated matrix would sit in cache and report a bandwidth the memory cannot give.
With ``huge_pages`` (the default, as an engine places its weights) the matrices and the
bandwidth's reads both sit in 2 MiB pages; without, both in 4 KiB pages.
"""

from __future__ import annotations

import glob
import math
import time

import torch
import torch.nn.functional as F

from graphrt.bench.roofline import pages_name, streaming_reads
from graphrt.bench.steal import StealMeter, steal_note
from graphrt.runner.huge_pages import move_to_huge_pages

# SmolLM2-135M's projections (graphrt stacks q/k/v and gate/up): name → (N, K)
SMOLLM2_SHAPES = {
    "qkv": (960, 576),
    "o": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "lm_head": (49152, 576),
}
COLD_BYTES = 256 * 2**20  # per shape and sweep, at least: past a usual last-level cache (32 MiB)


def last_level_cache_bytes() -> int:
    """The largest CPU cache Linux reports (0 when it reports none)."""
    sizes = []
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            text = open(path).read().strip().upper()
        except OSError:
            continue
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes, default=0)


def cold_sweep_bytes() -> int:
    """Bytes of distinct matrices a shape's sweep reads: twice the last-level cache, and at least
    COLD_BYTES. A VM can report (and have) a large one: 480 MiB on one Intel Xeon, where four
    copies of SmolLM2's LM head (226 MB) read at 38-41 GB/s against 29-37 for twenty."""
    return max(COLD_BYTES, 2 * last_level_cache_bytes())


QUANTIZED = ("int8", "int4")  # weight formats measured with fp32 activations


def _engines(quantized: bool = False):
    if quantized:  # graphrt reads the quantized bytes; aten gets the matrix dequantised first
        return {"graphrt": _quantized_product, "aten": lambda x, w: F.linear(x, _dequantized(w, x.dtype))}
    return {
        "graphrt": _product,
        "aten": lambda x, w: F.linear(x, w),
    }


def _product(x, w):
    """graphrt's product of a row-major matrix, or of a packed bf16 one (kernels/packed_bf16.py)."""
    if w.ndim == 4:
        return torch.ops.graphrt.linear_packed_bf16(x, w, None)
    return torch.ops.graphrt.linear(x, w, None)


def _quantized_product(x, w: tuple):
    """(tiles,) or the plain (qweight, scales, mins): the op an engine's graph calls on it."""
    if len(w) == 1:
        return torch.ops.graphrt.linear_tiles(x, w[0], None)
    return torch.ops.graphrt.linear_quantized(x, *w, None)


def _dequantized(w: tuple, dtype: torch.dtype):
    if len(w) == 1:
        return torch.ops.graphrt.dequantize_tiles(w[0], dtype)
    return torch.ops.graphrt.dequantize(*w, dtype)


def _matrix(n: int, k: int, kind: str):
    """A random [n, k] matrix as an engine holds it: a quantized one in the layout an engine would
    give it on this CPU (tiles where ``quant_tiles.wanted``, kernels/quant_tiles.py)."""
    from graphrt.kernels import NATIVE_ISA, quant_tiles
    from graphrt.kernels.quantized import quantize_int4, quantize_int8

    w = torch.randn(n, k)
    if kind not in QUANTIZED:
        return w.to(getattr(torch, kind))
    q = quantize_int4(w) if kind == "int4" else (*quantize_int8(w), None)
    if quant_tiles.wanted(NATIVE_ISA) and quant_tiles.tileable(q[0]):
        return (quant_tiles.to_tiles(*q),)
    return q


def _bytes(w) -> int:
    parts = w if isinstance(w, tuple) else (w,)
    return sum(t.numel() * t.element_size() for t in parts if t is not None)


def _to_huge_pages(weights: list) -> None:
    """Re-point every matrix (and a quantized one's scales and minimums) into 2 MiB pages."""
    holder = torch.nn.Module()
    parts = [t for w in weights for t in (w if isinstance(w, tuple) else (w,)) if t is not None]
    for i, t in enumerate(parts):
        holder.register_buffer(f"t{i}", t)
    move_to_huge_pages(holder)


def _sweep_seconds(fn, x, weights, repeats: int) -> float:
    fn(x, weights[0])
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for w in weights:
            fn(x, w)
        best = min(best, time.perf_counter() - t)
    return best


def bench_kernels(
    dtypes: list[str],
    rows: list[int],
    shapes: dict[str, tuple[int, int]] | None = None,
    repeats: int = 3,
    cold_bytes: int | None = None,
    huge_pages: bool = True,
) -> dict:
    import graphrt.kernels as kernels

    shapes = shapes or SMOLLM2_SHAPES
    cold_bytes = cold_sweep_bytes() if cold_bytes is None else cold_bytes
    pages = pages_name(huge_pages)
    from graphrt.kernels import packed_bf16, quant_tiles

    layout = "tiles" if quant_tiles.wanted(kernels.NATIVE_ISA) else "the plain layouts"
    packs = packed_bf16.wanted(kernels.NATIVE_PACKS_BF16)
    bf16_layout = "packed" if packs else "row-major"
    print(
        f"native kernels: {kernels.NATIVE_ISA or 'off'}; quantized matrices as {layout}; bf16 ones {bf16_layout} "
        f"for graphrt (as an engine holds them), row-major for aten; {cold_bytes / 2**20:.0f} MiB of matrices a "
        f"shape; read bandwidth measured around each row (the faster of a sum and graphrt's one-row product over "
        f"1 GiB); {pages} pages"
    )
    results = []
    for dtype_name in dtypes:
        quantized = dtype_name in QUANTIZED
        dtype = torch.float32 if quantized else getattr(torch, dtype_name)
        engines = _engines(quantized)
        mats, own = {}, {}  # each shape's matrices; graphrt's own copies where it reads another layout
        for name, (n, k) in shapes.items():
            one = _bytes(_matrix(n, k, dtype_name))
            mats[name] = [_matrix(n, k, dtype_name) for _ in range(max(2, math.ceil(cold_bytes / one)))]
            if dtype_name == "bfloat16" and packs and all(packed_bf16.packable(w) for w in mats[name]):
                own[name] = [packed_bf16.to_packed(w) for w in mats[name]]
            for group in (mats[name], own.get(name, [])):
                if huge_pages and group:
                    _to_huge_pages(group)
        for m in rows:
            row = {"dtype": dtype_name, "rows": m, "shapes": {}}
            before = streaming_reads(huge_pages=huge_pages)  # the machine drifts: each row gets its own, around it
            total = {e: [0, 0.0] for e in engines}
            with StealMeter() as meter:
                for name, weights in mats.items():
                    x = torch.randn(m, shapes[name][1]).to(dtype)
                    nbytes = sum(_bytes(w) for w in weights)
                    per = {}
                    for engine, fn in engines.items():  # side by side, shape by shape
                        read = own[name] if engine == "graphrt" and name in own else weights
                        s = _sweep_seconds(fn, x, read, repeats)
                        per[engine] = nbytes / s / 1e9
                        total[engine][0] += nbytes
                        total[engine][1] += s
                    row["shapes"][name] = per
            row["steal_frac"] = meter.fraction
            after = streaming_reads(huge_pages=huge_pages)
            # the roofline: the faster read (measure_bandwidth's); the plain streaming read, the
            # sum, is kept beside it (graphrt's one-row product outruns it on some machines)
            row["bandwidth_gb_s"] = (max(before.values()) + max(after.values())) / 2e9
            row["bandwidth_reads_gb_s"] = {k: (before[k] + after[k]) / 2e9 for k in before}
            for engine, (nbytes, s) in total.items():
                row[engine + "_gb_s"] = nbytes / s / 1e9
                row[engine + "_frac"] = nbytes / s / (row["bandwidth_gb_s"] * 1e9)
                row[engine + "_frac_sum"] = nbytes / s / (row["bandwidth_reads_gb_s"]["sum"] * 1e9)
            results.append(row)
            shapes_txt = "  ".join(f"{k} {v['graphrt']:.0f}/{v['aten']:.0f}" for k, v in row["shapes"].items())
            print(
                f"{dtype_name:>8} M={m:<3} read {row['bandwidth_gb_s']:5.1f} GB/s  "
                f"graphrt {row['graphrt_gb_s']:5.1f} GB/s ({100 * row['graphrt_frac']:3.0f}%; "
                f"{100 * row['graphrt_frac_sum']:3.0f}% of the sum's {row['bandwidth_reads_gb_s']['sum']:.1f})"
                f"  aten {row['aten_gb_s']:5.1f} GB/s ({100 * row['aten_frac']:3.0f}%)   per shape graphrt/aten: "
                + shapes_txt
                + steal_note(meter.fraction)
            )
        del mats, own
    return {
        "native_isa": kernels.NATIVE_ISA,
        "quantized_layout": layout,
        "bf16_layout": bf16_layout,
        "cold_bytes": cold_bytes,
        "pages": pages,
        "rows": results,
    }
