"""fuse_sampling in four beats, plus the same chain over a tensor that is not the logits."""

import torch

from graphrt import kernels
from graphrt.kernels import canonical
from tests.passes.recording import RecordingBackend, count

OP = torch.ops.graphrt.sample.default
N, H, V = 5, 16, 70


def inputs():
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(N, H, generator=g), torch.randn(V, H, generator=g)
    bitmask = torch.full((N, 3), -1, dtype=torch.int32)
    bitmask[2] = torch.tensor([0b110, 0, 0], dtype=torch.int32)  # row 2 may only draw tokens 1 and 2
    params = (
        torch.tensor([0.0, 0.8, 1.0, 1.3, 0.0]),
        torch.tensor([0, 5, 0, 0, 0]),
        torch.tensor([1.0, 1.0, 0.9, 1.0, 1.0]),
        torch.tensor([0.0, 0.0, 0.0, 0.1, 0.0]),
        torch.arange(N) + 7,
        torch.arange(N) * 11,
    )
    return hidden, weight, bitmask, params


def sample_logits(hidden, weight, bitmask, t, k, p, m, s, o):
    logits = torch.nn.functional.linear(hidden, weight)
    return canonical.sample(logits, bitmask, t, k, p, m, s, o)


def sample_other(hidden, weight, bitmask, t, k, p, m, s, o):
    scores = hidden @ weight.T * 2  # not an LM head's output
    return canonical.sample(scores, bitmask, t, k, p, m, s, o)


def test_sampling_chain_becomes_one_op():
    hidden, weight, bitmask, params = inputs()
    rec = RecordingBackend()
    tokens, logprobs = rec.compile(sample_logits)(hidden, weight, bitmask, *params)
    assert count(rec.before, torch.searchsorted) == 1 and count(rec.before, torch.sort) == 1
    assert count(rec.after, OP) == 1
    assert count(rec.after, torch.searchsorted) == 0 and count(rec.after, torch.softmax) == 0
    want_tokens, want_lp = sample_logits(hidden, weight, bitmask, *params)
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(logprobs, want_lp)
    assert int(tokens[2]) in (1, 2)


def test_chain_over_a_non_logits_tensor_is_not_fused():
    hidden, weight, bitmask, params = inputs()
    rec = RecordingBackend()
    tokens, _ = rec.compile(sample_other)(hidden, weight, bitmask, *params)
    assert count(rec.after, OP) == 0 and rec.results["fuse_sampling"].unmatched == 1
    assert torch.equal(tokens, sample_other(hidden, weight, bitmask, *params)[0])


# --- the verify step's chain -----------------------------------------------------------------

REJECT = torch.ops.graphrt.rejection_sample.default
R, K = 3, 2


def verify_inputs():
    g = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(R * (K + 1), H, generator=g), torch.randn(V, H, generator=g)
    greedy = torch.nn.functional.linear(hidden, weight).argmax(-1).view(R, K + 1)
    drafts = greedy[:, :K].clone()
    drafts[1, 1] = (drafts[1, 1] + 1) % V  # row 1: its second draft is wrong
    bitmask = torch.full((R * (K + 1), 3), -1, dtype=torch.int32)
    params = (
        torch.tensor([0.0, 0.0, 0.9]),
        torch.tensor([0, 0, 4]),
        torch.tensor([1.0, 1.0, 0.8]),
        torch.zeros(R),
        torch.arange(R) + 3,
        torch.tensor([5, 9, 2]),
    )
    return hidden, weight, bitmask, params, drafts, torch.tensor([2, 2, 1])


def verify_logits(hidden, weight, bitmask, t, k, p, m, s, o, drafts, num_drafts):
    logits = torch.nn.functional.linear(hidden, weight)
    return canonical.rejection_sample(logits, bitmask, t, k, p, m, s, o, drafts, num_drafts)


def test_verify_chain_becomes_one_rejection_sample():
    hidden, weight, bitmask, params, drafts, num_drafts = verify_inputs()
    rec = RecordingBackend()
    tokens, logprobs = rec.compile(verify_logits)(hidden, weight, bitmask, *params, drafts, num_drafts)
    assert count(rec.before, torch.searchsorted) == 1 and count(rec.before, "cumprod") == 1
    assert count(rec.after, REJECT) == 1 and count(rec.after, OP) == 0
    assert count(rec.after, torch.searchsorted) == 0 and count(rec.after, "cumprod") == 0
    assert rec.results["fuse_sampling"].matched == 1
    want_tokens, want_lp = verify_logits(hidden, weight, bitmask, *params, drafts, num_drafts)
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(logprobs, want_lp)
    assert tokens[0].tolist() == drafts[0].tolist() + [tokens[0, 2].item()]  # both drafts + bonus
    assert tokens[1, 2] == -1 and tokens[1, 0] == drafts[1, 0] and tokens[1, 1] != drafts[1, 1]


def verify_logits_by_ratio(hidden, weight, bitmask, t, k, p, m, s, o, drafts, num_drafts, probs):
    logits = torch.nn.functional.linear(hidden, weight)
    return canonical.rejection_sample_by_ratio(logits, bitmask, t, k, p, m, s, o, drafts, num_drafts, probs)


def test_verify_chain_with_draft_distributions_becomes_one_rejection_sample():
    hidden, weight, bitmask, params, drafts, num_drafts = verify_inputs()
    probs = torch.softmax(torch.randn(R, K, V, generator=torch.Generator().manual_seed(2)), -1)
    rec = RecordingBackend()
    args = (hidden, weight, bitmask, *params, drafts, num_drafts, probs)
    tokens, logprobs = rec.compile(verify_logits_by_ratio)(*args)
    assert count(rec.after, REJECT) == 1 and count(rec.after, OP) == 0 and count(rec.after, torch.searchsorted) == 0
    want_tokens, want_lp = verify_logits_by_ratio(*args)
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(logprobs, want_lp)
    # and both are the op's own result (the kernel's ratio path), row by row
    logits = torch.nn.functional.linear(hidden, weight).view(R, K + 1, V)
    t, k, p, m, s, o = params
    ref, ref_lp = kernels.rejection_sample(
        drafts, num_drafts, logits, t, s, o, draft_probs=probs, top_k=k, top_p=p, min_p=m
    )
    assert torch.equal(tokens, ref)
    torch.testing.assert_close(logprobs, ref_lp)
