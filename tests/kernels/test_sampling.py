import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphrt import kernels
from graphrt.kernels import KernelArgumentError, reference


def params(n, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=0):
    return dict(
        temperature=torch.full((n,), float(temperature)),
        top_k=torch.full((n,), top_k, dtype=torch.int64),
        top_p=torch.full((n,), float(top_p)),
        min_p=torch.full((n,), float(min_p)),
        seeds=torch.full((n,), seed, dtype=torch.int64),
        offsets=torch.arange(n, dtype=torch.int64),
    )


def within_bound(counts: torch.Tensor, probs: torch.Tensor, n: int) -> None:
    """Every empirical frequency within 5 standard errors of its probability (plus 1e-3)."""
    freq = counts.double() / n
    bound = 5 * torch.sqrt(probs * (1 - probs) / n) + 1e-3
    assert torch.all((freq - probs).abs() <= bound), f"freq {freq.tolist()} vs probs {probs.tolist()}"


# --- bitmask ---------------------------------------------------------------------------------


@settings(max_examples=20, deadline=None)
@given(
    rows=st.integers(1, 5),
    vocab=st.sampled_from([7, 32, 33, 100]),
    use_indices=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_bitmask_equals_xgrammar_and_naive_loop(rows, vocab, use_indices, seed):
    import xgrammar

    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (rows, words), generator=g, dtype=torch.int64).to(torch.int32)
    indices = torch.randperm(rows, generator=g)[: max(1, rows // 2)] if use_indices else None
    got = kernels.apply_token_bitmask(logits, bitmask, indices)
    want = logits.clone()
    # xgrammar's pure-torch kernel; its "cpu" C++ kernel was seen masking a set bit (vocab 7,
    # 3 rows: row 1, token 1), so it is not the oracle here.
    xgrammar.apply_token_bitmask_inplace(
        want, bitmask, indices=None if indices is None else indices.tolist(), backend="torch_native"
    )
    assert torch.equal(got, want)
    naive = logits.clone()
    for row in range(rows) if indices is None else indices.tolist():
        for tok in range(vocab):
            if not (bitmask[row, tok // 32].item() >> (tok % 32)) & 1:
                naive[row, tok] = float("-inf")
    assert torch.equal(got, naive)
    assert torch.equal(got, reference.apply_token_bitmask(logits, bitmask, indices))


@settings(max_examples=20, deadline=None)
@given(rows=st.integers(1, 5), vocab=st.sampled_from([7, 32, 33, 100]), seed=st.integers(0, 1000))
def test_the_ops_byte_table_mask_equals_the_shifted_bits(rows, vocab, seed):
    from graphrt.kernels.bitmask import mask_logits, unpack_bitmask

    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (rows, words), generator=g, dtype=torch.int64).to(torch.int32)
    bitmask[0] = -1  # an unconstrained row beside constrained ones
    want = logits.masked_fill(~unpack_bitmask(bitmask, vocab), float("-inf"))
    assert torch.equal(mask_logits(logits, bitmask), want)
    assert torch.isinf(want[1:]).any() or rows == 1
    unconstrained = torch.full((rows, words), -1, dtype=torch.int32)
    assert mask_logits(logits, unconstrained) is logits  # the usual step: nothing to mask, skipped


# --- sample ----------------------------------------------------------------------------------


def test_temperature_zero_is_argmax():
    logits = torch.randn(16, 50)
    tokens, logprobs = kernels.sample(logits, **params(16, temperature=0.0))
    assert torch.equal(tokens, logits.argmax(-1))
    torch.testing.assert_close(logprobs, torch.log_softmax(logits, -1).gather(1, tokens[:, None])[:, 0])


def test_the_one_call_greedy_path_takes_plain_batches_and_declines_the_others():
    from graphrt.kernels import NATIVE_ISA

    if NATIVE_ISA is None:
        pytest.skip("the native library is not loaded (GRAPHRT_NATIVE=0 or no compiler)")
    plain = torch.ops.graphrt_native.greedy_sample_plain
    logits = torch.randn(3, 70, generator=torch.Generator().manual_seed(1))
    greedy = torch.zeros(3)
    all_ones = torch.full((3, 3), -1, dtype=torch.int32)
    cleared = all_ones.clone()
    cleared[2, 1] = ~(1 << 5)  # token 37 of row 2 forbidden
    random = torch.tensor([0.0, 0.7, 0.0])
    # greedy rows, with no mask or an all-ones one: the argmax and its log-probability
    for mask in (None, all_ones):
        tokens, logprobs = plain(logits, greedy, mask)
        assert torch.equal(tokens, logits.argmax(-1))
        torch.testing.assert_close(logprobs, torch.log_softmax(logits, -1).gather(1, tokens[:, None])[:, 0])
    # a random row or a cleared grammar bit: declined (empty), for graphrt::sample's other path
    assert plain(logits, random, None)[0].numel() == 0
    assert plain(logits, greedy, cleared)[0].numel() == 0
    # and that path still applies the mask: row 2 never takes token 37
    logits[2, 37] = 100.0
    tokens, _ = kernels.sample(logits, **params(3, temperature=0.0), bitmask=cleared)
    assert tokens[2] != 37 and tokens[2] == logits[2, :37].argmax()


def test_greedy_rows_match_argmax_and_log_softmax_on_ties_nans_and_infinities():
    vocab = 40_000  # over the native kernel's slice: each row is reduced in parts and merged
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(0))
    logits[0, [5, 30_000]] = 50.0  # a tie across the parts: the first index
    logits[1, [7, 35_000]] = float("nan")  # the first NaN, whatever the maximum
    logits[2] = float("-inf")  # nothing allowed: index 0, log-probability NaN
    logits[3, 20_000] = float("inf")
    logits[4, :] = logits[4, :].clamp(max=0.0)
    logits[4, 39_999] = 3.0  # the last index
    logits[5, 100] = 1e30  # all mass on one token: log-probability 0
    tokens, logprobs = kernels.sample(logits, **params(6, temperature=0.0))
    assert tokens.tolist() == logits.argmax(-1).tolist() == [5, 7, 0, 20_000, 39_999, 100]
    want = torch.log_softmax(logits, -1).gather(1, tokens[:, None])[:, 0]
    torch.testing.assert_close(logprobs, want, equal_nan=True)
    assert logprobs[:4].isnan().tolist() == [False, True, True, True] and logprobs[5] == 0.0


@pytest.mark.parametrize("kw", [dict(top_k=3), dict(top_p=0.5), dict(min_p=0.2), dict(top_k=5, top_p=0.8, min_p=0.05)])
def test_no_token_outside_the_filters_is_drawn(kw):
    n, vocab = 4000, 20
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(1)).repeat(n, 1) * 1.5
    tokens, _ = kernels.sample(logits, **params(n, temperature=0.9, **kw))
    probs = torch.softmax(logits[0].double() / 0.9, -1)
    order = probs.argsort(descending=True)
    allowed = set(order.tolist())
    if "top_k" in kw:
        allowed &= set(order[: kw["top_k"]].tolist())
    if "top_p" in kw:
        before = torch.cumsum(probs[order], 0) - probs[order]
        allowed &= set(order[before < kw["top_p"]].tolist())
    if "min_p" in kw:
        allowed &= set(torch.nonzero(probs >= kw["min_p"] * probs.max()).flatten().tolist())
    assert set(tokens.tolist()) <= allowed
    assert len(allowed) > 1 and len(set(tokens.tolist())) > 1  # it really samples


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_distribution_matches_softmax_over_temperature(temperature):
    n, vocab = 40000, 8
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(3)).repeat(n, 1)
    tokens, _ = kernels.sample(logits, **params(n, temperature=temperature, seed=11))
    counts = torch.bincount(tokens, minlength=vocab)
    within_bound(counts, torch.softmax(logits[0].double() / temperature, -1), n)


def test_top_k_distribution_is_renormalised_softmax():
    n, vocab = 40000, 8
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(4)).repeat(n, 1)
    tokens, _ = kernels.sample(logits, **params(n, top_k=3, seed=5))
    p = torch.softmax(logits[0].double(), -1)
    top = p.argsort(descending=True)[:3]
    want = torch.zeros_like(p)
    want[top] = p[top] / p[top].sum()
    within_bound(torch.bincount(tokens, minlength=vocab), want, n)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**40), neighbours=st.integers(1, 7), where=st.integers(0, 7))
def test_seeded_rows_are_batch_invariant(seed, neighbours, where):
    g = torch.Generator().manual_seed(seed % 1000)
    row = torch.randn(1, 300, generator=g)
    mine = dict(
        temperature=torch.tensor([0.8]),
        top_k=torch.tensor([40]),
        top_p=torch.tensor([0.9]),
        min_p=torch.tensor([0.0]),
        seeds=torch.tensor([seed]),
        offsets=torch.tensor([17]),
    )
    alone, _ = kernels.sample(row, **mine)
    others = torch.randn(neighbours, 300, generator=g) * 3
    pos = where % (neighbours + 1)
    batch = torch.cat((others[:pos], row, others[pos:]))
    n = neighbours + 1

    def mix(key, fill):
        t = fill.clone()
        t[pos] = mine[key][0]
        return t

    bp = dict(
        temperature=mix("temperature", torch.rand(n) * 2),
        top_k=mix("top_k", torch.randint(0, 50, (n,))),
        top_p=mix("top_p", torch.rand(n) * 0.5 + 0.5),
        min_p=mix("min_p", torch.rand(n) * 0.1),
        seeds=mix("seeds", torch.randint(0, 2**40, (n,))),
        offsets=mix("offsets", torch.randint(0, 100, (n,))),
    )
    together, _ = kernels.sample(batch, **bp)
    assert together[pos] == alone[0]


@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    temperature=st.sampled_from([0.0, 0.7, 1.3]),
    top_k=st.sampled_from([0, 5]),
    top_p=st.sampled_from([1.0, 0.7]),
    min_p=st.sampled_from([0.0, 0.1]),
)
def test_sample_equals_reference(seed, temperature, top_k, top_p, min_p):
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(seed))
    p = params(6, temperature, top_k, top_p, min_p, seed)
    got, got_lp = kernels.sample(logits, **p)
    want, want_lp = reference.sample(logits, **p)
    assert torch.equal(got, want)
    torch.testing.assert_close(got_lp, want_lp)


def test_bad_sample_arguments():
    with pytest.raises(KernelArgumentError, match="top_k"):
        kernels.sample(torch.randn(2, 5), **{**params(2), "top_k": torch.zeros(3, dtype=torch.long)})
    with pytest.raises(KernelArgumentError, match="seeds"):
        kernels.sample(torch.randn(2, 5), **{**params(2), "seeds": torch.zeros(2)})


# --- rejection sampling ----------------------------------------------------------------------


def greedy_logits(argmaxes: list[list[int]], vocab: int = 10) -> torch.Tensor:
    out = torch.zeros(len(argmaxes), len(argmaxes[0]), vocab)
    for r, row in enumerate(argmaxes):
        for i, tok in enumerate(row):
            out[r, i, tok] = 5.0
    return out


def rs(drafts, counts, logits, temperature=0.0, draft_probs=None, seed=0, **filters):
    n = len(drafts)
    return kernels.rejection_sample(
        torch.tensor(drafts),
        torch.tensor(counts),
        logits,
        torch.full((n,), temperature),
        torch.full((n,), seed, dtype=torch.long),
        torch.zeros(n, dtype=torch.long),
        draft_probs=draft_probs,
        **filters,
    )


def ref_rs(drafts, counts, logits, temperature, seeds, offsets, draft_probs=None, top_k=0, top_p=1.0, bitmask=None):
    n = drafts.shape[0]
    return reference.rejection_sample(
        drafts,
        counts,
        draft_probs,
        logits,
        temperature,
        torch.full((n,), top_k, dtype=torch.long),
        torch.full((n,), top_p),
        torch.zeros(n),
        seeds,
        offsets,
        bitmask,
    )


def test_greedy_rejection_exact_cases():
    logits = greedy_logits([[1, 2, 3, 4], [1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]])
    drafts, counts = [[1, 2, 3], [1, 7, 3], [0, 0, 0], [9, 9, 0]], [3, 3, 0, 2]
    out, logprobs = rs(drafts, counts, logits)
    assert out.tolist() == [
        [1, 2, 3, 4],  # all accepted + bonus
        [1, 2, -1, -1],  # mismatch at 1: target token emitted, rest unused
        [5, -1, -1, -1],  # empty draft: just the target token
        [9, 9, 9, -1],  # two drafts accepted + bonus at position 2
    ]
    assert (logprobs[out < 0] == 0).all() and (logprobs[out >= 0] < 0).all()
    zeros = torch.zeros(4, dtype=torch.long)
    ref = ref_rs(torch.tensor(drafts), torch.tensor(counts), logits, torch.zeros(4), zeros, zeros)
    assert torch.equal(out, ref[0]) and torch.allclose(logprobs, ref[1])


def test_one_hot_drafts_keep_the_plain_tokens():
    """One-hot drafts are accepted while they equal the token plain sampling draws at that
    position (same seed, same offset): the kept tokens are exactly plain decoding's, whatever
    the drafts — including under top-k / top-p filters."""
    n, k, vocab = 64, 3, 6
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(n, k + 1, vocab, generator=g)
    drafts = torch.randint(0, vocab, (n, k), generator=g)
    counts = torch.randint(0, k + 1, (n,), generator=g)
    seeds, offsets = torch.arange(n), torch.randint(0, 50, (n,), generator=g)
    temperature = torch.where(torch.arange(n) % 4 == 0, 0.0, 0.8)
    top_k, top_p = torch.full((n,), 3), torch.full((n,), 0.9)
    out, logprobs = kernels.rejection_sample(
        drafts, counts, logits, temperature, seeds, offsets, top_k=top_k, top_p=top_p
    )
    span = k + 1
    plain, plain_lp = kernels.sample(
        logits.reshape(-1, vocab),
        temperature.repeat_interleave(span),
        top_k.repeat_interleave(span),
        top_p.repeat_interleave(span),
        torch.zeros(n * span),
        seeds.repeat_interleave(span),
        (offsets[:, None] + torch.arange(span)).reshape(-1),
    )
    plain, plain_lp = plain.view(n, span), plain_lp.view(n, span)
    kept = out >= 0
    assert torch.equal(out[kept], plain[kept]) and torch.allclose(logprobs[kept], plain_lp[kept])
    num_kept = kept.sum(1)
    for r in range(n):  # drafts equal to the plain tokens, then the first difference or the bonus
        a = int(num_kept[r]) - 1
        assert out[r, :a].tolist() == drafts[r, :a].tolist()
        assert a == int(counts[r]) or int(drafts[r, a]) != int(plain[r, a])
    assert (num_kept > 1).any() and (num_kept == 1).any()
    ref = ref_rs(drafts, counts, logits, temperature, seeds, offsets, top_k=3, top_p=0.9)
    assert torch.equal(out, ref[0]) and torch.allclose(logprobs, ref[1])


@pytest.mark.parametrize("with_draft_probs", [True, False])
@pytest.mark.parametrize("top_k", [0, 2])
def test_random_rejection_emits_the_target_distribution(with_draft_probs, top_k):
    n, vocab = 12000, 5
    g = torch.Generator().manual_seed(0)
    target = torch.tensor([2.0, 0.5, 0.0, -1.0, 1.0])
    p = torch.softmax(target.double(), -1)
    if top_k:  # the filtered distribution: the top two tokens, renormalised
        p = torch.where(p >= p.sort(descending=True).values[top_k - 1], p, 0.0)
        p = p / p.sum()
    q = torch.tensor([0.05, 0.6, 0.2, 0.1, 0.05], dtype=torch.double)  # a draft far from the target
    drafts = torch.multinomial(q.float(), n, replacement=True, generator=g)[:, None]
    logits = target.repeat(n, 2, 1)
    dp = q.float().repeat(n, 1, 1) if with_draft_probs else None
    out, _ = kernels.rejection_sample(
        drafts,
        torch.ones(n, dtype=torch.long),
        logits,
        torch.ones(n),
        torch.arange(n),
        torch.zeros(n, dtype=torch.long),
        draft_probs=dp,
        top_k=torch.full((n,), top_k),
    )
    first = out[:, 0]
    if with_draft_probs:
        within_bound(torch.bincount(first, minlength=vocab), p, n)
    else:  # one-hot drafts: the draw given each draft token is the target distribution too
        for d in range(vocab):
            sel = first[drafts[:, 0] == d]
            within_bound(torch.bincount(sel, minlength=vocab), p, sel.numel())
    ref = ref_rs(
        drafts[:200],
        torch.ones(200, dtype=torch.long),
        logits[:200],
        torch.ones(200),
        torch.arange(200),
        torch.zeros(200, dtype=torch.long),
        draft_probs=None if dp is None else dp[:200],
        top_k=top_k,
    )
    assert torch.equal(out[:200], ref[0])


def test_each_position_has_its_own_grammar_mask():
    """Position i is masked with the grammar's mask after i drafts: a draft the mask forbids is
    rejected even when it is the unmasked argmax."""
    logits = greedy_logits([[1, 2, 3]], vocab=40)
    bitmask = torch.full((1, 3, 2), -1, dtype=torch.int32)
    bitmask[0, 1, 0] &= ~(1 << 2)  # position 1 forbids token 2
    out, _ = rs([[1, 2]], [2], logits, bitmask=bitmask)
    assert out[0, 0] == 1 and out[0, 1] != 2 and out[0, 2] == -1
    ref = ref_rs(
        torch.tensor([[1, 2]]),
        torch.tensor([2]),
        logits,
        torch.zeros(1),
        torch.zeros(1, dtype=torch.long),
        torch.zeros(1, dtype=torch.long),
        bitmask=bitmask,
    )
    assert torch.equal(out, ref[0])


def test_bad_rejection_arguments():
    with pytest.raises(KernelArgumentError, match="num_draft_tokens"):
        rs([[1, 2]], [3], greedy_logits([[1, 2, 3]]))
    with pytest.raises(KernelArgumentError, match="target_logits"):
        rs([[1, 2]], [2], greedy_logits([[1, 2]]))
    with pytest.raises(KernelArgumentError, match="bitmask shape"):
        rs([[1, 2]], [2], greedy_logits([[1, 2, 3]]), bitmask=torch.full((1, 2, 1), -1, dtype=torch.int32))


def test_sample_applies_the_bitmask_first():
    n, vocab = 64, 40
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(2))
    bitmask = torch.zeros(n, 2, dtype=torch.int32)
    bitmask[:, 0] = 0b1010  # tokens 1 and 3 only
    bitmask[: n // 2] = -1  # the first half unconstrained
    p = params(n, temperature=1.0, seed=4)
    p["temperature"][::2] = 0.0
    tokens, logprobs = kernels.sample(logits, **p, bitmask=bitmask)
    assert set(tokens[n // 2 :].tolist()) <= {1, 3}
    free, _ = kernels.sample(logits[: n // 2], **{k: v[: n // 2] for k, v in p.items()})
    assert torch.equal(tokens[: n // 2], free)
    ref, ref_lp = reference.sample(logits, **p, bitmask=bitmask)
    assert torch.equal(tokens, ref)
    torch.testing.assert_close(logprobs, ref_lp)


def test_draft_sample_greedy_rows_draft_the_argmax_with_all_their_mass_on_it():
    import torch.nn.functional as F

    from graphrt.kernels import canonical

    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    p = {**params(4, top_k=5, seed=3), "temperature": torch.tensor([0.0, 0.8, 0.0, 1.2])}
    tokens, q = kernels.draft_sample(logits, **p)
    greedy = logits.argmax(-1)
    assert tokens[0] == greedy[0] and tokens[2] == greedy[2]
    assert torch.equal(q[[0, 2]], F.one_hot(greedy[[0, 2]], 50).double())
    # random rows: their filtered distribution (5 tokens kept) and a token drawn from it
    assert torch.allclose(q[[1, 3]].sum(-1), torch.ones(2, dtype=torch.float64))
    assert ((q[[1, 3]] > 0).sum(-1) == 5).all() and (q[[1, 3]].gather(1, tokens[[1, 3], None]) > 0).all()
    # an all-greedy batch (no softmax, no draw) gives the same rows; the traced spelling agrees
    t2, q2 = kernels.draft_sample(logits, **{**p, "temperature": torch.zeros(4)})
    assert torch.equal(t2, greedy) and torch.equal(q2, F.one_hot(greedy, 50).double())
    ct, cq = canonical.draft_sample(
        logits, *(p[k] for k in ("temperature", "top_k", "top_p", "min_p", "seeds", "offsets"))
    )
    assert torch.equal(ct, tokens) and torch.allclose(cq, q)


def test_greedy_rows_with_draft_distributions_accept_while_the_draft_is_the_argmax():
    logits = greedy_logits([[1, 2, 3, 4], [5, 6, 7, 8]])
    q = torch.full((2, 3, 10), 0.1, dtype=torch.float64)
    with_q = rs([[1, 2, 9], [5, 0, 7]], [3, 3], logits, draft_probs=q)
    without = rs([[1, 2, 9], [5, 0, 7]], [3, 3], logits)
    assert with_q[0].tolist() == without[0].tolist() == [[1, 2, 3, -1], [5, 6, -1, -1]]
    torch.testing.assert_close(with_q[1], without[1])


def test_bf16_logits_give_what_their_fp32_values_give():
    from graphrt.kernels import NATIVE_ISA

    if NATIVE_ISA is None:
        pytest.skip("the native library is not loaded (GRAPHRT_NATIVE=0 or no compiler)")
    greedy = torch.ops.graphrt_native.greedy_sample
    logits = (4 * torch.randn(4, 40_000, generator=torch.Generator().manual_seed(2))).to(torch.bfloat16)
    logits[1, [9, 33_000]] = 40.0  # a tie across the slices: the first index
    logits[2, [12, 25_000]] = float("nan")
    logits[3, 39_999] = float("inf")
    wide = logits.float()
    # widened a slice at a time (contiguous), or converted whole (a strided view)
    for rows in (logits, logits.T.contiguous().T):
        tokens, logprobs = greedy(rows)
        want_tokens, want_logprobs = greedy(wide)
        assert torch.equal(tokens, want_tokens) and tokens[1:].tolist() == [9, 12, 39_999]
        assert logprobs.dtype == torch.float32
        torch.testing.assert_close(logprobs, want_logprobs, rtol=0, atol=0, equal_nan=True)
