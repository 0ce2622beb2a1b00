"""graphrt's ops on Ascend NPUs: what each becomes, and the graph-safe aten bodies.

Two ways an op reaches an NPU, one per TorchAir mode:

- ``max-autotune`` (one GE graph): a GE converter turns the op into Ascend IR operators
  (``npu_ge.py``); an op with no Ascend operator is first decomposed into the aten body below.
- ``reduce-overhead`` (ACL graph capture): the op is dispatched on NPU tensors, so it needs a
  kernel that can be captured: one that never reads device data on the host. The norms go to
  torch_npu's fused kernels; every other op gets the aten body below (the CPU bodies branch on
  data on the host, or loop per row, which a captured graph cannot do).

The aten bodies are the canonical spellings (``canonical.py``), which the CPU ops equal; tests
check each against its op and that it traces without reading data. ``torch_npu`` is imported only
by ``register_npu_kernels()``, called by the NPU backend on a machine that has it; nothing in
this file has run on an NPU.
"""

from __future__ import annotations

import torch

from graphrt.kernels import cache, canonical, packed_bf16, quant_tiles, quantized
from graphrt.kernels.bitmask import unpack_bitmask

# op → (max-autotune: Ascend operators; reduce-overhead: the kernel dispatched on NPU tensors)
NPU_LOWERING: dict[str, tuple[str, str]] = {
    "paged_attention": (
        "ScatterPaKvCache + FusedInferAttentionScore (TND rows, paged, sparse_mode 3)",
        "aten body (canonical.attention); FusedInferAttentionScore needs host lengths per replay",
    ),
    "mla_attention": (
        "ScatterPaKvCache + FusedInferAttentionScore with query_rope / key_rope",
        "aten body (canonical.mla_attention)",
    ),
    "rms_norm": ("RmsNorm", "torch_npu.npu_rms_norm"),
    "fused_add_rms_norm": ("AddRmsNorm", "torch_npu.npu_add_rms_norm"),
    "rotary_embedding": ("GatherV2 + RotaryPositionEmbedding (mode 0 NeoX, 1 GPT-J)", "its own aten body"),
    "linear": ("MatMulV2", "its own aten body (CPU backends only use it)"),
    "linear_quantized": (
        "aten body: dequantise + MatMulV2 (CPU backends only use it; an NPU would take "
        "npu_weight_quant_batchmatmul, not written)",
        "its own aten body",
    ),
    "dequantize": ("aten body: unpack + Mul/Add", "its own aten body"),
    "linear_tiles": (
        "aten body: dequantise + MatMulV2 (a CPU layout: an NPU engine keeps the plain one)",
        "its own aten body",
    ),
    "dequantize_tiles": ("aten body: regroup + unpack + Mul/Add (a CPU layout)", "its own aten body"),
    "linear_packed_bf16": (
        "aten body: unpack + MatMulV2 (a CPU layout: an NPU engine keeps the row-major one)",
        "its own aten body",
    ),
    "unpack_bf16": ("aten body: Transpose (a CPU layout)", "its own aten body"),
    "slot_mapping": ("aten body: integer arithmetic, no Ascend operator fits", "its own aten body"),
    "apply_token_bitmask": ("aten body: unpack + masked_fill", "aten body"),
    "sample": ("aten body: no Ascend sampling operator takes graphrt's seeds", "aten body (canonical.sample)"),
    "draft_sample": ("aten body", "aten body (canonical.draft_sample)"),
    "rejection_sample": ("aten body", "aten body (canonical.rejection_sample[_by_ratio])"),
    "moe_experts": ("aten body: every expert over every token (dense)", "aten body (dense)"),
}


def _token_rows(query_start_loc: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[T]: the row each token belongs to, −1 for the padding after the last row."""
    token = torch.arange(num_tokens, device=query_start_loc.device)
    row = torch.searchsorted(query_start_loc[1:], token, right=True)
    return torch.where(token < query_start_loc[-1], row, -1)


def paged_attention(q, k, v, k_cache, v_cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale):
    num_tokens = q.shape[0]
    token_req = _token_rows(query_start_loc, num_tokens)
    if k is None or slot_mapping is None:  # nothing to write: zeros into the null block 0, as padding does
        k, v = q.new_zeros(num_tokens, *k_cache.shape[2:]), q.new_zeros(num_tokens, *v_cache.shape[2:])
        slot_mapping = torch.full((num_tokens,), -1, dtype=torch.long, device=q.device)
    out = canonical.attention(
        q, k, v, k_cache, v_cache, slot_mapping.long(), block_tables, seq_lens, query_start_loc, token_req, scale
    )
    return out.view_as(q)


def mla_attention(
    q_latent, q_pe, latent, k_pe, latent_cache, pe_cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale
):
    token_req = _token_rows(query_start_loc, q_latent.shape[0])
    return canonical.mla_attention(
        q_latent, q_pe, latent, k_pe, latent_cache, pe_cache, slot_mapping.long(), block_tables, seq_lens,
        query_start_loc, token_req, scale,
    )  # fmt: skip


def _no_mask(logits: torch.Tensor, bitmask):
    if bitmask is not None:
        return bitmask
    words = (logits.shape[1] + 31) // 32
    return torch.full((logits.shape[0], words), -1, dtype=torch.int32, device=logits.device)


def apply_token_bitmask(logits, bitmask, indices):
    if indices is None:
        return logits.masked_fill(~unpack_bitmask(bitmask, logits.shape[1]), float("-inf"))
    rows = indices.long()
    picked = logits.index_select(0, rows).masked_fill(
        ~unpack_bitmask(bitmask.index_select(0, rows), logits.shape[1]), float("-inf")
    )
    return logits.index_copy(0, rows, picked)


def sample(logits, temperature, top_k, top_p, min_p, seeds, offsets, bitmask):
    return canonical.sample(logits, _no_mask(logits, bitmask), temperature, top_k, top_p, min_p, seeds, offsets)


def draft_sample(logits, temperature, top_k, top_p, min_p, seeds, offsets):
    return canonical.draft_sample(logits, temperature, top_k, top_p, min_p, seeds, offsets)


def rejection_sample(
    draft_token_ids, num_draft_tokens, draft_probs, target_logits, temperature, top_k, top_p, min_p, seeds, offsets,
    bitmask,
):  # fmt: skip
    mask = _no_mask(target_logits, bitmask)
    args = (target_logits, mask, temperature, top_k, top_p, min_p, seeds, offsets, draft_token_ids, num_draft_tokens)
    if draft_probs is None:
        return canonical.rejection_sample(*args)
    return canonical.rejection_sample_by_ratio(*args, draft_probs)


def moe_experts(x, topk_ids, topk_weights, w_gate_up, w_down):
    """Dense: every expert over every token, weighted by the routing (0 where not chosen)."""
    experts, inter = w_gate_up.shape[0], w_down.shape[2]
    routing = torch.zeros(x.shape[0], experts, dtype=topk_weights.dtype, device=x.device)
    routing = routing.scatter_add(1, topk_ids.long(), topk_weights)  # [T, E]
    gate_up = torch.einsum("th,eih->eti", x, w_gate_up)
    gate, up = gate_up[..., :inter], gate_up[..., inter:]
    y = torch.einsum("eti,ehi->eth", torch.nn.functional.silu(gate) * up, w_down)
    return torch.einsum("eth,te->th", y, routing.to(y.dtype)).to(x.dtype)


def graph_safe_bodies() -> dict[str, object]:
    """op name → an aten body that reads no device data on the host (traceable, capturable)."""
    return {
        "paged_attention": paged_attention,
        "mla_attention": mla_attention,
        "slot_mapping": cache._slot_mapping,  # already one
        "apply_token_bitmask": apply_token_bitmask,
        "sample": sample,
        "draft_sample": draft_sample,
        "rejection_sample": rejection_sample,
        "moe_experts": moe_experts,
        "dequantize": quantized.dequantize_torch,  # already one
        "linear_quantized": quantized.linear_quantized_torch,
        "dequantize_tiles": quant_tiles.dequantize_tiles_torch,  # already one
        "linear_tiles": quant_tiles.linear_tiles_torch,
        "unpack_bf16": packed_bf16.unpack_torch,  # already one
        "linear_packed_bf16": packed_bf16.linear_packed_bf16_torch,
    }


def register_npu_kernels() -> list[str]:
    """Register the PrivateUse1 (NPU) kernel of every op whose CPU body cannot be captured, and
    torch_npu's fused norms; returns the names. Unverified here: it needs torch_npu and CANN."""
    import torch_npu  # noqa: F401  (lazy: importing it without CANN breaks torch)

    def rms_norm(x, weight, eps):
        return torch_npu.npu_rms_norm(x, weight, epsilon=eps)[0]

    def fused_add_rms_norm(x, residual, weight, eps):
        y, _, new_residual = torch_npu.npu_add_rms_norm(x, residual, weight, epsilon=eps)
        return y, new_residual

    kernels = {"rms_norm": rms_norm, "fused_add_rms_norm": fused_add_rms_norm, **graph_safe_bodies()}
    for name, fn in kernels.items():
        torch.library.register_kernel(f"graphrt::{name}", "PrivateUse1", fn)
    return list(kernels)
