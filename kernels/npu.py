"""How each graphrt op lowers on Ascend NPUs, and the lazy registration of those kernels.

``torch_npu`` is imported here only, and only when ``register_npu_kernels()`` is called (by the
NPU backend). Nothing in this file has run on an NPU: the table records the intended lowering;
ops marked ``None`` run their pure-torch CPU body on NPU tensors.
"""

from __future__ import annotations

import torch

# op → (torch_npu op it lowers to, or None; note)
NPU_LOWERING: dict[str, tuple[str | None, str]] = {
    "reshape_and_cache": ("torch_npu._npu_reshape_and_cache", "slot −1 skipped by the NPU kernel"),
    "slot_mapping": (None, "integer arithmetic; no torch_npu op fits, stays a small aten graph"),
    "paged_attention": (
        "torch_npu.npu_fused_infer_attention_score / torch_npu._npu_paged_attention",
        "prefill rows through the fused-infer op, decode rows through _npu_paged_attention",
    ),
    "mla_attention": (
        "torch_npu.npu_mla_prolog / torch_npu.npu_fused_infer_attention_score",
        "latent cache write + attention with the nope/rope caches split as here (vllm-ascend's TorchAir MLA)",
    ),
    "moe_experts": (
        "torch_npu.npu_moe_init_routing / npu_grouped_matmul / npu_moe_finalize_routing",
        "tokens sorted by expert, one grouped matmul per projection, weighted un-permute",
    ),
    "rms_norm": ("torch_npu.npu_rms_norm", "returns (y, rstd); graphrt keeps y"),
    "fused_add_rms_norm": ("torch_npu.npu_add_rms_norm", "returns (y, rstd, x + residual)"),
    "rotary_embedding": ("torch_npu.npu_rotary_mul", "NeoX layout; GPT-J layout has no NPU op"),
    "apply_token_bitmask": (None, "unpack + masked_fill in aten; no torch_npu op fits"),
    "sample": (None, "aten softmax/cumsum/searchsorted; no torch_npu op fits"),
    "draft_sample": (None, "aten softmax/sort/cumsum/searchsorted; no torch_npu op fits"),
    "rejection_sample": (None, "aten reference body; no torch_npu op fits"),
}


def register_npu_kernels() -> list[str]:
    """Register PrivateUse1 kernels for the ops with a torch_npu counterpart; returns their names.

    Unverified here: it needs torch_npu and the CANN runtime.
    """
    import torch_npu  # noqa: F401  (lazy: importing it without CANN breaks torch)

    registered = []

    def rms_norm(x, weight, eps):
        return torch_npu.npu_rms_norm(x, weight, epsilon=eps)[0]

    def fused_add_rms_norm(x, residual, weight, eps):
        y, _, new_residual = torch_npu.npu_add_rms_norm(x, residual, weight, epsilon=eps)
        return y, new_residual

    for name, fn in (("rms_norm", rms_norm), ("fused_add_rms_norm", fused_add_rms_norm)):
        torch.library.register_kernel(f"graphrt::{name}", "PrivateUse1", fn)
        registered.append(name)
    return registered
