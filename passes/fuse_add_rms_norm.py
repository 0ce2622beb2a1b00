"""fuse_add_rms_norm: residual add + RMSNorm → one ``graphrt::fused_add_rms_norm``.

Before (``canonical.add_rms_norm``)::

    new_residual = x + residual
    x32 = new_residual.float()
    normed = weight * (x32 * rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(float32)

After::

    fused = torch.ops.graphrt.fused_add_rms_norm(x, residual, weight, eps)
    normed, new_residual = fused[0], fused[1]

It pays where the backend has a fused add-norm kernel (NPU: ``npu_add_rms_norm``). Inductor
already fuses this elementwise chain into one loop, and the op's CPU body is eager torch, so the
pass manager leaves it off for Inductor.
"""

from __future__ import annotations

import torch

from graphrt.kernels import canonical
from graphrt.passes.base import FusionPass
from graphrt.passes.matcher import emit


class FuseAddRmsNorm(FusionPass):
    name = "fuse_add_rms_norm"
    pattern_fns = (canonical.add_rms_norm,)

    def accept(self, m) -> bool:
        return isinstance(m["eps"], float)

    def rewrite(self, graph, m):
        args = (m["x"], m["residual"], m["weight"], m["eps"])
        return emit(graph, torch.ops.graphrt.fused_add_rms_norm.default, args, num_outputs=2)
