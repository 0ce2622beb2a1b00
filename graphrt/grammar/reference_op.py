"""The reference grammar path, as the seed runner does it: copy the logits to the CPU as float32,
apply the bitmask with xgrammar's C++ kernel, copy them back to the logits' device and dtype.

Selected with ``grammar_backend="xgrammar-cpu"``; the default applies the bitmask inside the
sampling op instead, with no copy of the logits.
"""

import torch


@torch.library.custom_op("graphrt::xgrammar_bitmask_cpu", mutates_args=())
def xgrammar_bitmask_cpu(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    import xgrammar

    host = logits.to("cpu", torch.float32).clone()
    xgrammar.apply_token_bitmask_inplace(host, bitmask.to("cpu"))
    return host.to(logits.device, logits.dtype)


@xgrammar_bitmask_cpu.register_fake
def _(logits, bitmask):
    return torch.empty_like(logits)
