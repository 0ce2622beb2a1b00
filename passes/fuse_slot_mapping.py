"""fuse_slot_mapping: the slot arithmetic of a step → one ``graphrt::slot_mapping``.

Before (``canonical.slot_mapping``, bs = 16)::

    floordiv = positions // 16
    block = block_tables[token_req, floordiv]
    slots = block * 16 + positions % 16
    slot_mapping = torch.where(token_req >= 0, slots, -1)

After::

    slot_mapping = torch.ops.graphrt.slot_mapping(positions, token_req, block_tables, 16)

The block size must be the same literal at all three places: ``block_table[pos // 16] * 8 + pos %
8`` is another formula and is left alone. The step computes slots once and every layer's cache
write reads that one node, so the host never computes slots and no layer recomputes them.
"""

from __future__ import annotations

import torch

from graphrt.kernels import canonical
from graphrt.passes.base import FusionPass
from graphrt.passes.matcher import emit


class FuseSlotMapping(FusionPass):
    name = "fuse_slot_mapping"
    pattern_fns = (canonical.slot_mapping,)
    witness = staticmethod(lambda n: n.op == "call_function" and n.target is torch.where and n.args[2:3] == (-1,))

    def accept(self, m) -> bool:
        return isinstance(m["block_size"], int)

    def rewrite(self, graph, m):
        args = (m["positions"], m["token_req"], m["block_tables"], m["block_size"])
        return emit(graph, torch.ops.graphrt.slot_mapping.default, args)
