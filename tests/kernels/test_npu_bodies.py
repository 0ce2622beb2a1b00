"""The graph-safe aten bodies the NPU path uses (kernels/npu.py): each equals its CPU op, and each
traces on fake tensors, so it reads no device data on the host (what an ACL graph capture and a
GE graph need). On the NPU they are the reduce-overhead kernels and the max-autotune
decompositions; here they run on the CPU."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from graphrt.kernels import npu, sampling
from graphrt.kernels.packed_bf16 import to_packed
from graphrt.kernels.quant_tiles import to_tiles
from graphrt.kernels.quantized import quantize_int4
from graphrt.kernels.sampling import _sample as cpu_sample
from tests.kernels.paged_batch import make_batch

ROWS = [(9, 9), (6, 1), (12, 5), (17, 1)]  # prefill, decode, chunked continuation, decode
VOCAB = 50


def attention_args(pad=3):
    b = make_batch(ROWS, 4, 4, 2, 8, pad_tokens=pad, seed=5)
    args = (b.q, b.k, b.v, b.k_cache, b.v_cache, b.slots, b.block_tables, b.seq_lens, b.query_start_loc, 0.3)
    return args, len(b.q) - pad


def mla_args(pad=2):
    c = make_batch(ROWS, 4, 4, 1, 12, pad_tokens=pad, seed=3)
    r = make_batch(ROWS, 4, 4, 1, 6, pad_tokens=pad, seed=3)
    args = (c.q, r.q, c.k[:, 0], r.k[:, 0], c.k_cache, r.k_cache, c.slots, c.block_tables, c.seq_lens)
    return (*args, c.query_start_loc, 0.2), len(c.q) - pad


def sampling_rows(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, VOCAB, generator=g) * 3
    temperature = torch.tensor([0.0, 0.7, 1.0, 1.3] * n)[:n]
    top_k = torch.tensor([0, 5, 0, 12] * n)[:n]
    top_p = torch.tensor([1.0, 0.9, 0.8, 1.0] * n)[:n]
    min_p = torch.tensor([0.0, 0.0, 0.05, 0.1] * n)[:n]
    seeds = torch.arange(n) * 7 + seed
    offsets = torch.arange(n) + 3
    return logits, temperature, top_k, top_p, min_p, seeds, offsets


def bitmask(rows, seed=1):
    g = torch.Generator().manual_seed(seed)
    words = (VOCAB + 31) // 32
    mask = torch.randint(-(2**31), 2**31 - 1, (rows, words), generator=g, dtype=torch.int64).to(torch.int32)
    mask[:, 0] |= 1  # token 0 always allowed: no row is left empty
    return mask


def run_op_and_body(name, args):
    """(op outputs, body outputs), each on its own copy of the inputs (the attention ops write)."""
    op = getattr(torch.ops.graphrt, name)
    body = npu.graph_safe_bodies()[name]
    copy = lambda xs: [x.clone() if isinstance(x, torch.Tensor) else x for x in xs]  # noqa: E731
    a, b = copy(args), copy(args)
    return (op(*a), a), (body(*b), b)


def test_paged_attention_body_equals_the_op_and_writes_the_same_cache():
    args, valid = attention_args()
    (want, a), (got, b) = run_op_and_body("paged_attention", args)
    torch.testing.assert_close(got[:valid], want[:valid], atol=1e-5, rtol=1e-5)
    for cache in (3, 4):  # the K and V caches, but the null block 0 (where padding writes)
        torch.testing.assert_close(b[cache][1:], a[cache][1:])


def test_mla_attention_body_equals_the_op():
    args, valid = mla_args()
    (want, a), (got, b) = run_op_and_body("mla_attention", args)
    torch.testing.assert_close(got[:valid], want[:valid], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(b[4][1:], a[4][1:])
    torch.testing.assert_close(b[5][1:], a[5][1:])


@pytest.mark.parametrize("with_mask", [False, True])
def test_sample_body_draws_the_ops_tokens(with_mask):
    rows = sampling_rows(8)
    args = (*rows, bitmask(8) if with_mask else None)
    (want, _), (got, _) = run_op_and_body("sample", args)
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])


def test_draft_sample_body_draws_the_ops_tokens():
    (want, _), (got, _) = run_op_and_body("draft_sample", sampling_rows(8, seed=4))
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])


@pytest.mark.parametrize("with_q", [False, True])
def test_rejection_sample_body_keeps_the_ops_tokens(with_q):
    rows, k = 4, 3
    logits, temperature, top_k, top_p, min_p, seeds, offsets = sampling_rows(rows * (k + 1), seed=2)
    per_row = [t[:rows] for t in (temperature, top_k, top_p, min_p, seeds, offsets)]
    drafts = logits.view(rows, k + 1, VOCAB)[:, :k].argmax(-1)  # greedy rows accept them
    drafts[1, 1] = (drafts[1, 1] + 1) % VOCAB
    q = torch.softmax(torch.randn(rows, k, VOCAB), -1).double() if with_q else None
    num = torch.tensor([3, 2, 0, 3])
    args = (drafts, num, q, logits, *per_row, bitmask(rows * (k + 1)))
    (want, _), (got, _) = run_op_and_body("rejection_sample", args)
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])


@pytest.mark.parametrize("indices", [None, torch.tensor([2, 0])])
def test_bitmask_body_masks_like_the_op(indices):
    logits = torch.randn(4, VOCAB)
    (want, _), (got, _) = run_op_and_body("apply_token_bitmask", (logits, bitmask(4), indices))
    assert torch.equal(got, want)


def test_dense_moe_body_equals_the_grouped_op():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 16, generator=g)
    ids = torch.randint(0, 6, (7, 2), generator=g)
    weights = torch.rand(7, 2, generator=g)
    w1, w2 = torch.randn(6, 20, 16, generator=g) / 4, torch.randn(6, 16, 10, generator=g) / 4
    (want, _), (got, _) = run_op_and_body("moe_experts", (x, ids, weights, w1, w2))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_every_body_traces_without_reading_data(monkeypatch):
    """Fake tensors have no data: a body that branches on values or calls .tolist() fails here."""
    rows = sampling_rows(8)
    cases = {
        "paged_attention": attention_args()[0],
        "mla_attention": mla_args()[0],
        "slot_mapping": (torch.arange(6), torch.tensor([0, 0, 1, 1, -1, -1]), torch.tensor([[1, 2], [3, 4]]), 4),
        "apply_token_bitmask": (torch.randn(4, VOCAB), bitmask(4), torch.tensor([1, 3])),
        "sample": (*rows, bitmask(8)),
        "draft_sample": rows,
        "rejection_sample": (
            torch.zeros(2, 3, dtype=torch.long),
            torch.tensor([3, 1]),
            None,
            torch.randn(8, VOCAB),
            *(t[:2] for t in rows[1:]),
            None,
        ),  # fmt: skip
        "moe_experts": (
            torch.randn(3, 8),
            torch.tensor([[0, 1]] * 3),
            torch.rand(3, 2),
            torch.randn(2, 6, 8),
            torch.randn(2, 8, 3),
        ),  # fmt: skip
    }
    q4 = quantize_int4(torch.randn(6, 64))
    cases["dequantize"] = (*q4, torch.float32)
    cases["linear_quantized"] = (torch.randn(3, 64), *q4, None)
    tiles = to_tiles(*quantize_int4(torch.randn(16, 64)))
    cases["dequantize_tiles"] = (tiles, torch.float32)
    cases["linear_tiles"] = (torch.randn(3, 64), tiles, None)
    packed = to_packed(torch.randn(32, 64).bfloat16())
    cases["unpack_bf16"] = (packed,)
    cases["linear_packed_bf16"] = (torch.randn(3, 64).bfloat16(), packed, None)
    assert set(cases) == set(npu.graph_safe_bodies())
    for name, args in cases.items():
        traced = make_fx(npu.graph_safe_bodies()[name], tracing_mode="fake")(*args)
        assert any(n.op == "call_function" for n in traced.graph.nodes), name
    # and a CPU body they stand in for does read data (what the test would catch); its torch path,
    # not the native call that takes plain batches first (an opaque op fake tensors cannot enter)
    monkeypatch.setattr(sampling, "_native_greedy", lambda: None)
    with pytest.raises(Exception, match="data-dependent|Data dependent"):
        make_fx(cpu_sample, tracing_mode="fake")(*rows, None)
