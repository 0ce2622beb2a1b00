"""The grammar bitmask: ``graphrt::apply_token_bitmask`` and the unpacking the sampling ops use.

xgrammar's layout: int32 words [rows, ceil(V/32)], bit j of word w allows token 32w + j.
"""

import sys
from typing import Optional

import torch

from graphrt.kernels import checks
from graphrt.kernels.op_library import define

# --- bitmask --------------------------------------------------------------------------------


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, ceil(V/32)] int32 → [rows, V] bool (True = allowed); bit j of word w is token 32w+j."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask[:, :, None] >> bits) & 1).bool().reshape(bitmask.shape[0], -1)
    return allowed[:, :vocab_size]


# bit j of byte b → token 8b + j (a little-endian int32 word w holds tokens 32w..32w+31 in bytes 4w..4w+3)
_BYTE_BITS = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool()


def mask_logits(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``logits`` with −inf where the packed bitmask has a zero bit, for the ops' CPU bodies: a
    mask of all ones (no row constrained: the usual step) is skipped, and bytes are unpacked by a
    table (8x fewer operations than unpack_bitmask's shifts, which traced code keeps)."""
    if bool((bitmask == -1).all()):
        return logits
    vocab = logits.shape[1]
    if sys.byteorder != "little":
        return logits.masked_fill(~unpack_bitmask(bitmask, vocab), float("-inf"))
    table = _BYTE_BITS.to(bitmask.device)
    allowed = table[bitmask.contiguous().view(torch.uint8).long()].reshape(bitmask.shape[0], -1)[:, :vocab]
    return logits.masked_fill(~allowed, float("-inf"))


def _apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, indices: Optional[torch.Tensor]) -> torch.Tensor:
    rows = indices.long() if indices is not None else torch.arange(bitmask.shape[0])
    allowed = unpack_bitmask(bitmask[rows], logits.shape[1])
    out = logits.clone()
    out[rows] = out[rows].masked_fill(~allowed, float("-inf"))
    return out


def _apply_token_bitmask_fake(logits, bitmask, indices):
    return torch.empty_like(logits)


define(
    "apply_token_bitmask(Tensor logits, Tensor bitmask, Tensor? indices) -> Tensor",
    _apply_token_bitmask,
    _apply_token_bitmask_fake,
)


def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, indices: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Logits with −inf wherever the packed bitmask has a zero bit (xgrammar's semantics: row r of
    the bitmask masks row r of the logits, for the rows in ``indices``, or all). Returns a new tensor."""
    checks.check_ndim("logits", logits, 2, "[rows, vocab]")
    checks.check_ndim("bitmask", bitmask, 2, "[rows, ceil(vocab / 32)]")
    if bitmask.dtype != torch.int32:
        raise checks.KernelArgumentError(f"bitmask must be int32 (xgrammar's layout), got {bitmask.dtype}")
    checks.check_dim("bitmask", bitmask, 0, logits.shape[0], "rows of logits")
    checks.check_dim("bitmask", bitmask, 1, (logits.shape[1] + 31) // 32, "ceil(vocab / 32) words")
    if indices is not None:
        checks.check_ndim("indices", indices, 1, "[selected rows]")
        checks.check_int("indices", indices)
    return torch.ops.graphrt.apply_token_bitmask(logits, bitmask, indices)
