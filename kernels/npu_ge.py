"""graphrt's ops in Ascend IR: a GE converter per op for TorchAir's ``max-autotune`` mode.

Ops with an Ascend operator become that operator (attention with its cache write, the norms,
rotary embedding). Ops with none (slot mapping, the grammar bitmask, the samplers, the MoE
experts) are decomposed into their graph-safe aten bodies (``npu.py``) while TorchAir traces the
step, and TorchAir's own aten converters turn those into Ascend operators; a few aten ops those
bodies use have no converter in TorchAir and get one here. ``npu.NPU_LOWERING`` lists it all.

Written against the Ascend IR definitions shipped with TorchAir (``ge_apis``); converting runs
anywhere TorchAir imports, compiling and running the result needs an NPU and is not verified here.
"""

from __future__ import annotations

import torch

from graphrt.kernels.npu import graph_safe_bodies

# FusedInferAttentionScore's optional inputs, in the order of its IR definition
_FIA_OPTIONAL_INPUTS = (
    "pse_shift", "atten_mask", "actual_seq_lengths", "actual_seq_lengths_kv", "dequant_scale1", "quant_scale1",
    "dequant_scale2", "quant_scale2", "quant_offset2", "antiquant_scale", "antiquant_offset", "block_table",
    "query_padding_size", "kv_padding_size", "key_antiquant_scale", "key_antiquant_offset", "value_antiquant_scale",
    "value_antiquant_offset", "key_shared_prefix", "value_shared_prefix", "actual_shared_prefix_len", "query_rope",
    "key_rope", "key_rope_antiquant_scale", "dequant_scale_query", "learnable_sink", "q_start_idx", "kv_start_idx",
)  # fmt: skip

# FusedInferAttentionScore's causal mask for sparse_mode 3 (bottom-right aligned) is 2048 x 2048
_MASK_SIZE = 2048


# --- decompositions (ops with no Ascend operator) --------------------------------------------

CONVERTED = ("paged_attention", "mla_attention", "rms_norm", "fused_add_rms_norm", "rotary_embedding", "linear")


def decompositions() -> dict:
    """The graph-safe aten bodies of the ops with no Ascend operator, for TorchAir's trace."""
    return {
        getattr(torch.ops.graphrt, name).default: body
        for name, body in graph_safe_bodies().items()
        if name not in CONVERTED
    }


# --- converters (ops with an Ascend operator) --------------------------------------------------


def register_ge_converters(torchair) -> None:
    """Register a GE converter for every graphrt op with an Ascend operator. Idempotent."""
    global _registered
    if _registered:
        return
    from torchair._ge_concrete_graph import ge_apis as ge
    from torchair.ge._ge_graph import DataType, get_default_ge_graph

    ops = torch.ops.graphrt
    register = torchair.register_fx_node_ge_converter

    def torch_dtype(t):
        return t.meta.dtype if t.meta is not None else t.dtype

    def shape(t) -> list[int]:
        return [int(s) for s in t.meta.shape]

    def last_dims(x, start: int, end: int):
        r = len(shape(x))
        return ge.SliceD(x, offsets=[0] * (r - 1) + [start], size=[-1] * (r - 1) + [end - start])

    masks: dict[int, object] = {}

    def causal_mask():
        """The 2048 x 2048 upper-triangle mask (1 = hidden), built once per GE graph."""
        graph = get_default_ge_graph()
        if id(graph) not in masks:
            idx = ge.Range(ge.Const(0, dtype=DataType.DT_INT32), ge.Const(_MASK_SIZE, dtype=DataType.DT_INT32),
                           ge.Const(1, dtype=DataType.DT_INT32))  # fmt: skip
            above = ge.Greater(ge.Unsqueeze(idx, axes=[0]), ge.Unsqueeze(idx, axes=[1]))
            masks[id(graph)] = ge.Cast(above, dst_type=DataType.DT_INT8)
        return masks[id(graph)]

    def paged_fia(query, key_cache, value_cache, cache_shape, block_tables, seq_lens, query_start_loc, scale, **extra):
        """FusedInferAttentionScore over a paged cache ``cache_shape`` [blocks, block_size, kv heads, dim],
        TND rows of any query length (prefill, chunked prefill and decode in one call), causal
        bottom-right aligned (sparse_mode 3)."""
        blocks, block_size, kv_heads = cache_shape[:3]
        q_heads = shape(query)[1]
        flat = lambda c: ge.Reshape(c, [blocks, block_size, -1])  # noqa: E731  (BSH paged layout)
        ends = ge.Cast(last_dims(query_start_loc, 1, shape(query_start_loc)[0]), dst_type=DataType.DT_INT64)
        if query.dtype not in (DataType.DT_FLOAT16, DataType.DT_BF16):
            raise TypeError(
                f"FusedInferAttentionScore takes float16 or bfloat16 queries, got {torch_dtype(query)}: "
                "load the model with dtype=bfloat16 or float16 for the NPU"
            )
        inputs = dict.fromkeys(_FIA_OPTIONAL_INPUTS)
        inputs.update(
            atten_mask=causal_mask(),
            actual_seq_lengths=ends,
            actual_seq_lengths_kv=ge.Cast(seq_lens, dst_type=DataType.DT_INT64),
            block_table=ge.Cast(block_tables, dst_type=DataType.DT_INT32),
            **extra,
        )
        out = ge.FusedInferAttentionScore(
            query, [flat(key_cache)], [flat(value_cache)], *inputs.values(),
            num_heads=q_heads, scale=scale, input_layout="TND", num_key_value_heads=kv_heads,
            sparse_mode=3, block_size=block_size,
        )  # fmt: skip
        return out[0]

    @register(ops.paged_attention.default)
    def paged_attention(
        q, k, v, k_cache, v_cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale, meta_outputs=None
    ):
        cache_shape = shape(k_cache)
        if k is not None:  # the new tokens' K/V into the cache; slot −1 (padding) is skipped
            k_cache, v_cache = ge.ScatterPaKvCache(
                k, k_cache, slot_mapping, v, v_cache, None, None, None, strides=[1, 1], offsets=[0, 0]
            )
        return paged_fia(q, k_cache, v_cache, cache_shape, block_tables, seq_lens, query_start_loc, scale)

    @register(ops.mla_attention.default)
    def mla_attention(
        q_latent, q_pe, latent, k_pe, latent_cache, pe_cache, slot_mapping, block_tables, seq_lens,
        query_start_loc, scale, meta_outputs=None,
    ):  # fmt: skip
        cache_shape, pe_shape = shape(latent_cache), shape(pe_cache)
        latent_cache, pe_cache = ge.ScatterPaKvCache(
            latent, latent_cache, slot_mapping, k_pe, pe_cache, None, None, None, strides=[1, 1], offsets=[0, 0]
        )
        key_rope = ge.Reshape(pe_cache, [pe_shape[0], pe_shape[1], -1])
        # latent space: keys and values are the latent cache, the rope key scores with q_pe
        lengths = (block_tables, seq_lens, query_start_loc)
        return paged_fia(
            q_latent, latent_cache, latent_cache, cache_shape, *lengths, scale, query_rope=q_pe, key_rope=key_rope
        )

    @register(ops.rms_norm.default)
    def rms_norm(x, weight, eps, meta_outputs=None):
        return ge.RmsNorm(x, weight, epsilon=eps)[0]

    @register(ops.fused_add_rms_norm.default)
    def fused_add_rms_norm(x, residual, weight, eps, meta_outputs=None):
        y, _, summed = ge.AddRmsNorm(x, residual, weight, epsilon=eps)
        return y, summed

    @register(ops.rotary_embedding.default)
    def rotary_embedding(positions, q, k, cos_sin_cache, is_neox, meta_outputs=None):
        half = shape(cos_sin_cache)[1] // 2
        rows = ge.GatherV2(cos_sin_cache, positions, ge.Const(0, dtype=DataType.DT_INT32))  # [T, rot]
        cos, sin = last_dims(rows, 0, half), last_dims(rows, half, 2 * half)
        # the operator wants cos/sin over the whole rotated width, in the layout of the rotation
        if is_neox:
            cos, sin = ge.ConcatV2D([cos, cos], concat_dim=-1, N=2), ge.ConcatV2D([sin, sin], concat_dim=-1, N=2)
        else:
            tokens = shape(q)[0]
            pairs = lambda t: ge.Reshape(ge.ConcatV2D([ge.Unsqueeze(t, axes=[2])] * 2, concat_dim=2, N=2),  # noqa: E731
                                         [tokens, 2 * half])  # fmt: skip
            cos, sin = pairs(cos), pairs(sin)
        cos = ge.Cast(ge.Unsqueeze(cos, axes=[0, 2]), dst_type=q.dtype)  # [1, T, 1, rot]: BSND
        sin = ge.Cast(ge.Unsqueeze(sin, axes=[0, 2]), dst_type=q.dtype)

        def rotate(x):
            width = shape(x)[-1]
            x4 = ge.Unsqueeze(x, axes=[0])
            if width == 2 * half:
                return ge.Squeeze(ge.RotaryPositionEmbedding(x4, cos, sin, mode=0 if is_neox else 1), axis=[0])
            turned = ge.RotaryPositionEmbedding(last_dims(x4, 0, 2 * half), cos, sin, mode=0 if is_neox else 1)
            return ge.Squeeze(ge.ConcatV2D([turned, last_dims(x4, 2 * half, width)], concat_dim=-1, N=2), axis=[0])

        return rotate(q), rotate(k)

    @register(ops.linear.default)
    def linear(x, weight, bias, meta_outputs=None):
        y = ge.MatMulV2(x, weight, None, None, transpose_x1=False, transpose_x2=True)
        return y if bias is None else ge.Add(y, bias)

    register_aten_gaps(torchair, ge, DataType)
    _registered = True


def register_aten_gaps(torchair, ge, DataType) -> None:
    """Converters for the aten ops graphrt's aten bodies use that TorchAir leaves unimplemented."""
    aten = torch.ops.aten
    register = torchair.register_fx_node_ge_converter

    def const_like(value, like):
        return ge.Cast(ge.Const(value), dst_type=like.dtype)

    @register(aten.__rshift__.Tensor)
    def rshift(self, other, meta_outputs=None):
        return ge.RightShift(self, ge.Cast(other, dst_type=self.dtype))

    @register(aten.__rshift__.Scalar)
    def rshift_scalar(self, other, meta_outputs=None):
        return ge.RightShift(self, const_like(other, self))

    @register(aten.bitwise_xor.Tensor)
    def bitwise_xor(self, other, meta_outputs=None):
        return ge.BitwiseXor(self, ge.Cast(other, dst_type=self.dtype))

    @register(aten.bitwise_and.Scalar)
    def bitwise_and_scalar(self, other, meta_outputs=None):
        if self.dtype == DataType.DT_BOOL:
            return ge.LogicalAnd(self, ge.Cast(ge.Const(other), dst_type=DataType.DT_BOOL))
        return ge.BitwiseAnd(self, const_like(other, self))

    @register(aten.bitwise_xor.Scalar)
    def bitwise_xor_scalar(self, other, meta_outputs=None):
        return ge.BitwiseXor(self, const_like(other, self))

    @register(aten.amax.default)
    def amax(self, dim=(), keepdim=False, meta_outputs=None):
        axes = list(dim) if len(dim) else list(range(self.rank))
        return ge.ReduceMax(self, ge.Const(axes, dtype=DataType.DT_INT64), keep_dims=keepdim)

    @register(aten.cumprod.default)
    def cumprod(self, dim, dtype=None, meta_outputs=None):
        return ge.Cumprod(self, ge.Const(dim, dtype=DataType.DT_INT64))

    @register(aten.repeat_interleave.self_int)
    def repeat_interleave(self, repeats, dim=None, output_size=None, meta_outputs=None):
        if self.rank != 1 or dim not in (None, 0):
            raise NotImplementedError("torch.ops.aten.repeat_interleave.self_int ge_converter: 1-D only")
        tiled = ge.Tile(ge.Unsqueeze(self, axes=[1]), ge.Const([1, int(repeats)], dtype=DataType.DT_INT64))
        return ge.Reshape(tiled, ge.Const([-1], dtype=DataType.DT_INT64))

    @register(aten.sort.stable)
    def sort_stable(self, stable=None, dim=-1, descending=False, meta_outputs=None):
        values, indices = ge.Sort(self, axis=dim, descending=descending, stable=bool(stable))
        return values, ge.Cast(indices, dst_type=DataType.DT_INT64)


_registered = False
