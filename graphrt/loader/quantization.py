"""Quantized weights at load: GGUF's Q4_0 / Q4_1 / Q8_0 blocks split into graphrt's layouts, float
checkpoints quantized on request, and both placed into the model as quantized modules.

A quantized weight travels through the loader as a ``QuantizedTensor`` (it has the float
weight's shape, so shape checks and q/k/v stacking read the same as for floats) and lands in the
state dict as ``<name>.qweight``, ``.scales`` and (int4) ``.mins`` instead of ``<name>.weight``;
``swap_quantized_modules`` then gives those names ``QuantizedLinear`` / ``QuantizedEmbedding``
modules. Layouts and formulas: ``kernels/quantized.py``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from graphrt.kernels.quantized import BLOCK, dequantize_torch, quantize_int4, quantize_int8
from graphrt.models.quantized import QuantizedEmbedding, QuantizedLinear

log = logging.getLogger("graphrt.loader")

QUANTIZATIONS = ("int8", "int4", "none")  # and None: the checkpoint as it is stored
GGUF_KEPT = ("Q4_0", "Q4_1", "Q8_0")  # GGUF block types kept quantized; others are dequantised
_QUANTIZABLE = ("proj.weight", "embed_tokens.weight", "lm_head.weight")


def check_quantization(quantization: str | None) -> None:
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(
            f"quantization {quantization!r} is not supported; use one of {list(QUANTIZATIONS)} or None "
            "(None keeps a checkpoint as stored: a Q4/Q8 GGUF stays quantized, a float one stays float)"
        )


@dataclass
class QuantizedTensor:
    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None  # int4 only

    @property
    def bits(self) -> int:
        return 4 if self.qweight.dtype == torch.uint8 else 8

    @property
    def shape(self) -> tuple[int, int]:
        return (self.qweight.shape[0], self.scales.shape[1] * BLOCK)

    def rows(self, index: torch.Tensor) -> QuantizedTensor:
        return QuantizedTensor(self.qweight[index], self.scales[index], None if self.mins is None else self.mins[index])

    def dequantize(self) -> torch.Tensor:
        return dequantize_torch(self.qweight, self.scales, self.mins, torch.float32)

    def parts(self, name: str) -> dict[str, torch.Tensor]:
        base = name.removesuffix(".weight")
        out = {f"{base}.qweight": self.qweight.contiguous(), f"{base}.scales": self.scales.contiguous()}
        if self.mins is not None:
            out[f"{base}.mins"] = self.mins.contiguous()
        return out


def cat_rows(parts: list) -> torch.Tensor | QuantizedTensor:
    """Stacked rows (q/k/v, gate/up): quantized parts of one format stay quantized; a mix of
    formats, or of quantized and float, is dequantised (it cannot share one layout)."""
    if all(isinstance(p, QuantizedTensor) for p in parts) and len({p.bits for p in parts}) == 1:
        mins = None if parts[0].mins is None else torch.cat([p.mins for p in parts])
        return QuantizedTensor(torch.cat([p.qweight for p in parts]), torch.cat([p.scales for p in parts]), mins)
    return torch.cat([p.dequantize() if isinstance(p, QuantizedTensor) else p for p in parts])


def from_gguf_blocks(raw: np.ndarray, kind: str, shape: tuple[int, int]) -> QuantizedTensor:
    """A GGUF tensor's block bytes [rows, row bytes] → graphrt's layout, no float trip."""
    rows, cols = shape
    size = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[kind]
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, cols // BLOCK, size)
    scales = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0])
    if kind == "Q8_0":
        q = torch.from_numpy(blocks[..., 2:].copy().view(np.int8).reshape(rows, cols))
        return QuantizedTensor(q, scales, None)
    if kind == "Q4_1":
        mins = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0])
        q = torch.from_numpy(blocks[..., 4:].copy().reshape(rows, cols // 2))
    else:  # Q4_0: w = (q - 8) * d, stored as q * d + (-8 d), exact in float16
        mins = scales * -8
        q = torch.from_numpy(blocks[..., 2:].copy().reshape(rows, cols // 2))
    return QuantizedTensor(q, scales, mins)


def quantize_state(state: dict, quantization: str) -> dict:
    """Float projection and embedding weights quantized to ``quantization`` ("int8" / "int4");
    a weight whose rows are no whole number of 32-value blocks stays float (named in a notice).
    Weights a checkpoint stores quantized (a Q4_1 GGUF's) stay as stored: those in the other
    format are named in a notice, since int4 weights under quantization="int8" are what the
    caller asked for only in part (quantization="none" makes every weight float first)."""
    other = 4 if quantization == "int8" else 8  # the format a stored weight would be "wrong" in
    stored = [name for name, t in state.items() if isinstance(t, QuantizedTensor) and t.bits == other]
    if stored:
        shown = ", ".join(stored[:3]) + (f" and {len(stored) - 3} more" if len(stored) > 3 else "")
        log.warning(
            "quantization=%r quantizes float weights; %d weight(s) stored as int%d stay int%d: %s",
            quantization,
            len(stored),
            other,
            other,
            shown,
        )
    out, kept = {}, []
    for name, t in state.items():
        if isinstance(t, torch.Tensor) and t.ndim == 2 and name.endswith(_QUANTIZABLE):
            if t.shape[1] % BLOCK:
                kept.append(name)
            elif quantization == "int8":
                t = QuantizedTensor(*quantize_int8(t), None)
            else:
                t = QuantizedTensor(*quantize_int4(t))
        out[name] = t
    if kept:
        log.warning("not quantized (rows not a multiple of %d values): %s", BLOCK, ", ".join(kept))
    return out


def dequantize_state(state: dict) -> dict:
    return {k: v.dequantize() if isinstance(v, QuantizedTensor) else v for k, v in state.items()}


def swap_quantized_modules(model: nn.Module, state: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    """Replace the module of every ``<name>.qweight`` in ``state`` by its quantized counterpart."""
    for key in [k for k in state if k.endswith(".qweight")]:
        path = key.removesuffix(".qweight")
        parent_name, _, attr = path.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, attr)
        q = state[key]
        bits = 4 if q.dtype == torch.uint8 else 8
        if isinstance(old, nn.Embedding):
            new = QuantizedEmbedding(old.num_embeddings, old.embedding_dim, bits, dtype)
        elif isinstance(old, nn.Linear):
            new = QuantizedLinear(old.in_features, old.out_features, bits, old.bias is not None)
        else:
            raise TypeError(f"{path} is a {type(old).__name__}; only Linear and Embedding weights can be quantized")
        setattr(parent, attr, new.to("meta"))
