"""torch.library.opcheck for every graphrt op: schema, fake implementation, functionalisation."""

import pytest
import torch

import graphrt.kernels as kernels
from tests.kernels.paged_batch import make_batch


def cases():
    b = make_batch([(9, 9), (6, 1), (12, 5)], 4, 4, 2, 8, pad_tokens=2)
    cache_args = (b.k, b.v, b.k_cache.clone(), b.v_cache.clone(), b.slots)
    attn = (
        b.q,
        b.k,
        b.v,
        b.k_cache.clone(),
        b.v_cache.clone(),
        b.slots,
        b.block_tables,
        b.seq_lens,
        b.query_start_loc,
        0.35,
    )
    x, w = torch.randn(3, 16), torch.randn(16)
    cos_sin = torch.randn(32, 8)
    n, vocab = 4, 40
    samp = (
        torch.randn(n, vocab),
        torch.tensor([0.0, 0.7, 1.0, 1.5]),
        torch.tensor([0, 5, 0, 3]),
        torch.tensor([1.0, 0.9, 0.5, 1.0]),
        torch.tensor([0.0, 0.0, 0.1, 0.0]),
        torch.arange(n),
        torch.arange(n) * 3,
        torch.randint(-9, 9, (n, 2), dtype=torch.int32),
    )
    rej = (
        torch.randint(0, vocab, (n, 3)),
        torch.tensor([3, 1, 0, 2]),
        torch.softmax(torch.randn(n, 3, vocab), -1),
        torch.randn(n * 4, vocab),
        torch.tensor([0.0, 1.0, 0.5, 0.0]),
        torch.tensor([0, 5, 0, 3]),
        torch.tensor([1.0, 0.9, 0.5, 1.0]),
        torch.tensor([0.0, 0.0, 0.1, 0.0]),
        torch.arange(n),
        torch.zeros(n, dtype=torch.long),
        # token 0 allowed at every position: a position whose mask allows no token samples with a
        # NaN logprob (as torch's log_softmax of all -inf), and opcheck takes NaN for a difference
        torch.randint(-9, 9, (n * 4, 2), dtype=torch.int32) | torch.tensor([1, 0], dtype=torch.int32),
    )
    c = make_batch([(9, 9), (6, 1), (12, 5)], 4, 4, 1, 12, pad_tokens=2, seed=3)
    r = make_batch([(9, 9), (6, 1), (12, 5)], 4, 4, 1, 6, pad_tokens=2, seed=3)
    mla = (
        c.q,
        r.q,
        c.k[:, 0],
        r.k[:, 0],
        c.k_cache.clone(),
        r.k_cache.clone(),
        c.slots,
        c.block_tables,
        c.seq_lens,
        c.query_start_loc,
        0.3,
    )
    moe = (
        torch.randn(5, 16),
        torch.randint(0, 6, (5, 2)),
        torch.rand(5, 2),
        torch.randn(6, 20, 16),
        torch.randn(6, 16, 10),
    )
    from graphrt.kernels.quant_tiles import to_tiles
    from graphrt.kernels.quantized import quantize_int4, quantize_int8

    q4, q8 = quantize_int4(torch.randn(6, 64)), quantize_int8(torch.randn(6, 64))
    tiles = to_tiles(*quantize_int4(torch.randn(32, 64)))
    from graphrt.kernels.packed_bf16 import to_packed

    packed = to_packed(torch.randn(64, 96).bfloat16())
    return {
        "unpack_bf16": (packed,),
        "linear_packed_bf16": (torch.randn(2, 3, 96).bfloat16(), packed, torch.randn(64).bfloat16()),
        "dequantize": (*q4, torch.float32),
        "dequantize_tiles": (tiles, torch.bfloat16),
        "linear_tiles": (torch.randn(2, 3, 64), tiles, torch.randn(32)),
        "linear_quantized": (torch.randn(3, 64), *q8, None, torch.randn(6)),
        "mla_attention": mla,
        "moe_experts": moe,
        "linear": (torch.randn(3, 33), torch.randn(7, 33), torch.randn(7)),
        "slot_mapping": (b.positions, b.token_req, b.block_tables, 4),
        "reshape_and_cache": cache_args,
        "paged_attention": attn,
        "rms_norm": (x, w, 1e-6),
        "fused_add_rms_norm": (x, torch.randn(3, 16), w, 1e-6),
        "rotary_embedding": (torch.tensor([0, 5, 31]), torch.randn(3, 4, 8), torch.randn(3, 2, 8), cos_sin, True),
        "apply_token_bitmask": (
            torch.randn(n, vocab),
            torch.randint(-100, 100, (n, 2), dtype=torch.int32),
            torch.tensor([0, 2]),
        ),
        "sample": samp,
        "draft_sample": samp[:7],
        "rejection_sample": rej,
    }


with torch.random.fork_rng():  # the same inputs in every run, whatever ran before in the process
    torch.manual_seed(0)
    CASES = cases()


def test_every_op_has_a_case():
    assert set(CASES) == set(kernels.OPS)


@pytest.mark.parametrize("name", kernels.OPS)
def test_opcheck(name):
    torch.library.opcheck(getattr(torch.ops.graphrt, name).default, CASES[name])


def test_opcheck_bf16_linear_without_bias():
    args = (torch.randn(2, 5, 40).bfloat16(), torch.randn(9, 40).bfloat16(), None)
    torch.library.opcheck(torch.ops.graphrt.linear.default, args)


def test_opcheck_packed_linear_without_bias_and_prefill_rows():
    from graphrt.kernels.packed_bf16 import to_packed

    packed = to_packed(torch.randn(32, 64).bfloat16())
    torch.library.opcheck(torch.ops.graphrt.linear_packed_bf16.default, (torch.randn(40, 64).bfloat16(), packed, None))


def test_opcheck_int4_linear_and_bf16_dequantize():
    from graphrt.kernels.quantized import quantize_int4, quantize_int8

    q4 = quantize_int4(torch.randn(5, 96))
    torch.library.opcheck(torch.ops.graphrt.linear_quantized.default, (torch.randn(2, 3, 96), *q4, None))
    torch.library.opcheck(
        torch.ops.graphrt.dequantize.default, (*quantize_int8(torch.randn(4, 32)), None, torch.bfloat16)
    )
