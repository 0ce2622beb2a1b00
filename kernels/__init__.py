"""graphrt's op library: ``torch.library`` custom ops in the ``graphrt::`` namespace.

Importing this package registers every op. Each op has a pure-torch reference
(``reference.py``), a fake implementation (graphs trace anywhere), a CPU implementation and an
entry in the NPU lowering table (``npu.py``). ``linear``, ``linear_quantized``, ``dequantize``,
``linear_tiles``, ``dequantize_tiles``, ``linear_packed_bf16``, ``unpack_bf16`` and ``paged_attention``
also have native CPU kernels
(``native/``, built on first use by ``native_library.py``), which take over on CPU tensors when
the library loads. The wrappers below check their arguments; graph passes call
``torch.ops.graphrt.*`` directly. Kernels import nothing else from graphrt.
"""

import torch as _torch

from graphrt.kernels.attention import paged_attention
from graphrt.kernels.bitmask import apply_token_bitmask
from graphrt.kernels.cache import reshape_and_cache, slot_mapping
from graphrt.kernels.checks import KernelArgumentError
from graphrt.kernels.linear import linear
from graphrt.kernels.mla import mla_attention
from graphrt.kernels.moe import moe_experts
from graphrt.kernels.native_library import load as _load_native
from graphrt.kernels.norm import fused_add_rms_norm, rms_norm
from graphrt.kernels.packed_bf16 import linear_packed_bf16, unpack_bf16
from graphrt.kernels.quant_tiles import dequantize_tiles, linear_tiles
from graphrt.kernels.quantized import dequantize, linear_quantized
from graphrt.kernels.rotary import rotary_embedding
from graphrt.kernels.sampling import draft_sample, rejection_sample, sample

NATIVE_ISA = _load_native()  # the instruction set of the native CPU kernels; None: the torch bodies
# whether they multiply bf16 matrices packed for the tiles (packed_bf16.py): AMX tiles, or
# AVX512-BF16's dot product over the same layout
NATIVE_PACKS_BF16 = NATIVE_ISA is not None and bool(_torch.ops.graphrt_native.packs_bf16())

OPS = (
    "linear",
    "linear_quantized",
    "dequantize",
    "linear_tiles",
    "dequantize_tiles",
    "linear_packed_bf16",
    "unpack_bf16",
    "slot_mapping",
    "reshape_and_cache",
    "paged_attention",
    "mla_attention",
    "moe_experts",
    "rms_norm",
    "fused_add_rms_norm",
    "rotary_embedding",
    "apply_token_bitmask",
    "sample",
    "draft_sample",
    "rejection_sample",
)

__all__ = [
    "OPS",
    "KernelArgumentError",
    "NATIVE_ISA",
    "NATIVE_PACKS_BF16",
    "apply_token_bitmask",
    "dequantize",
    "dequantize_tiles",
    "draft_sample",
    "fused_add_rms_norm",
    "linear",
    "linear_packed_bf16",
    "linear_quantized",
    "linear_tiles",
    "mla_attention",
    "moe_experts",
    "paged_attention",
    "rejection_sample",
    "reshape_and_cache",
    "rms_norm",
    "rotary_embedding",
    "sample",
    "slot_mapping",
    "unpack_bf16",
]
