"""graphrt::mla_attention and graphrt::moe_experts against their one-token-at-a-time references
and the canonical spelling."""

import pytest
import torch

from graphrt import kernels
from graphrt.kernels import KernelArgumentError, canonical, reference
from tests.kernels.paged_batch import make_batch

ROWS = [(9, 9), (6, 1), (12, 5), (17, 1)]  # prefill, decode, chunked continuation, decode
H, RANK, ROPE = 4, 12, 6


def mla_inputs(block_size=4, pad=2, dtype=torch.float32):
    c = make_batch(ROWS, block_size, H, 1, RANK, dtype, pad_tokens=pad, seed=3)
    r = make_batch(ROWS, block_size, H, 1, ROPE, dtype, pad_tokens=pad, seed=3)
    assert torch.equal(c.block_tables, r.block_tables)
    return dict(
        q_latent=c.q,
        q_pe=r.q,
        latent=c.k[:, 0],
        k_pe=r.k[:, 0],
        latent_cache=c.k_cache,
        pe_cache=r.k_cache,
        slots=c.slots,
        block_tables=c.block_tables,
        seq_lens=c.seq_lens,
        query_start_loc=c.query_start_loc,
    ), c.token_req


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_mla_attention_matches_reference_and_canonical(block_size):
    args, token_req = mla_inputs(block_size)
    real = token_req >= 0
    ref_args = {k: v.clone() for k, v in args.items()}
    can_args = {k: v.clone() for k, v in args.items()}
    out = kernels.mla_attention(*args.values(), scale=0.3)
    ref = reference.mla_attention(*ref_args.values(), scale=0.3)
    torch.testing.assert_close(out[real], ref[real], atol=1e-5, rtol=1e-5)
    assert (out[~real] == 0).all()
    for cache in ("latent_cache", "pe_cache"):  # the write, at the same slots
        torch.testing.assert_close(args[cache][1:], ref_args[cache][1:])
    canon = canonical.mla_attention(*can_args.values(), token_req, 0.3)
    torch.testing.assert_close(canon[real], ref[real], atol=1e-5, rtol=1e-5)


def test_mla_attention_bad_arguments():
    args, _ = mla_inputs()
    with pytest.raises(KernelArgumentError, match="q_latent"):
        kernels.mla_attention(args["q_latent"][..., :5], *list(args.values())[1:], scale=1.0)
    bad = dict(args, pe_cache=args["pe_cache"][:3])
    with pytest.raises(KernelArgumentError, match="must share"):
        kernels.mla_attention(*bad.values(), scale=1.0)


def moe_inputs(tokens=7, experts=6, k=2, hidden=16, inter=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=g)
    return (
        x,
        ids,
        weights,
        torch.randn(experts, 2 * inter, hidden, generator=g),
        torch.randn(experts, hidden, inter, generator=g),
    )


@pytest.mark.parametrize("tokens", [1, 7, 40])
def test_moe_experts_matches_the_per_token_reference(tokens):
    args = moe_inputs(tokens)
    torch.testing.assert_close(kernels.moe_experts(*args), reference.moe_experts(*args), atol=1e-4, rtol=1e-5)


def test_moe_experts_bad_arguments():
    x, ids, weights, w1, w2 = moe_inputs()
    with pytest.raises(KernelArgumentError, match=r"topk_ids must lie in \[0, 6\)"):
        kernels.moe_experts(x, ids + 6, weights, w1, w2)
    with pytest.raises(KernelArgumentError, match="w_gate_up shape"):
        kernels.moe_experts(x, ids, weights, w1[:, :5], w2)
    with pytest.raises(KernelArgumentError, match="topk_weights shape"):
        kernels.moe_experts(x, ids, weights[:, :1], w1, w2)
