"""fuse_attention in four beats (einsum and SDPA spellings), plus near misses that must not fuse."""

import torch
import torch.nn.functional as F

from graphrt.kernels import canonical
from tests.kernels.paged_batch import make_batch
from tests.passes.recording import RecordingBackend, count

OP = torch.ops.graphrt.paged_attention.default
ROWS = [(13, 13), (9, 1), (17, 6)]  # prefill, decode, chunked continuation


def inputs(pad=2):
    b = make_batch(ROWS, 4, 4, 2, 8, pad_tokens=pad)
    return b, (b.q, b.k, b.v, b.k_cache, b.v_cache, b.slots, b.block_tables, b.seq_lens, b.query_start_loc, b.token_req)


def run_both(fn):
    """(compiled result, eager result, recorder, caches after compiled, caches after eager)."""
    b, args = inputs()
    eager_args = [a.clone() for a in args]
    rec = RecordingBackend()
    got = rec.compile(fn)(*args)
    want = fn(*eager_args)
    return got, want, rec, args, eager_args, b


def real_rows(x, b):
    return x[: b.query_start_loc[-1]]


def einsum_attention(q, k, v, kc, vc, slots, bt, sl, qsl, tr):
    return canonical.attention(q, k, v, kc, vc, slots, bt, sl, qsl, tr, 0.3) * 1


def sdpa_attention(q, k, v, kc, vc, slots, bt, sl, qsl, tr):
    return canonical.attention_sdpa(q, k, v, kc, vc, slots, bt, sl, qsl, tr, 0.3) * 1


def test_einsum_attention_becomes_one_fused_op():
    got, want, rec, args, eager_args, b = run_both(einsum_attention)
    assert count(rec.before, torch.softmax) == 1 and count(rec.before, "index_copy_") == 2
    assert count(rec.after, OP) == 1
    assert count(rec.after, torch.softmax) == 0 and count(rec.after, torch.einsum) == 0
    assert count(rec.after, "index_copy_") == 0  # the write is folded into the op
    torch.testing.assert_close(real_rows(got, b), real_rows(want, b), atol=1e-5, rtol=1e-5)
    # the caches hold the same values at every real slot (padding went to the null block 0)
    assert torch.equal(args[3][1:], eager_args[3][1:]) and torch.equal(args[4][1:], eager_args[4][1:])


def test_sdpa_spelling_is_fused_too():
    got, want, rec, *_, b = run_both(sdpa_attention)
    assert count(rec.before, F.scaled_dot_product_attention) == 1
    assert count(rec.after, OP) == 1 and count(rec.after, F.scaled_dot_product_attention) == 0
    torch.testing.assert_close(real_rows(got, b), real_rows(want, b), atol=1e-5, rtol=1e-5)


def _write_gather(k, v, kc, vc, slots, bt, tr):
    nb, bs, hkv, d = kc.shape
    kc.view(nb * bs, hkv, d).index_copy_(0, slots.clamp(min=0), k)
    vc.view(nb * bs, hkv, d).index_copy_(0, slots.clamp(min=0), v)
    t = tr.shape[0]
    return kc[bt[tr]].reshape(t, -1, hkv, d), vc[bt[tr]].reshape(t, -1, hkv, d)


def tiled_heads(q, k, v, kc, vc, slots, bt, sl, qsl, tr):
    """GQA by tiling (head h reads kv h % Hkv): another head mapping, a near miss."""
    keys, values = _write_gather(k, v, kc, vc, slots, bt, tr)
    t, h = q.shape[0], q.shape[1]
    last = sl[tr] - (qsl[tr + 1] - torch.arange(t))
    allowed = torch.arange(keys.shape[1])[None, :] <= last[:, None]
    g = h // kc.shape[2]
    out = F.scaled_dot_product_attention(
        q[:, :, None, :],
        keys.transpose(1, 2).repeat(1, g, 1, 1),
        values.transpose(1, 2).repeat(1, g, 1, 1),
        attn_mask=allowed[:, None, None, :],
        scale=0.3,
    )
    return out.reshape(t, -1) * 1


def shifted_mask(q, k, v, kc, vc, slots, bt, sl, qsl, tr):
    """Each token also sees the next key: not causal."""
    keys, values = _write_gather(k, v, kc, vc, slots, bt, tr)
    t = q.shape[0]
    last = sl[tr] - (qsl[tr + 1] - torch.arange(t)) + 1
    allowed = torch.arange(keys.shape[1])[None, :] <= last[:, None]
    out = F.scaled_dot_product_attention(
        q[:, :, None, :],
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=allowed[:, None, None, :],
        scale=0.3,
        enable_gqa=True,
    )
    return out.reshape(t, -1) * 1


def test_near_misses_are_left_alone_and_reported():
    for fn in (tiled_heads, shifted_mask):
        got, want, rec, *_, b = run_both(fn)
        assert count(rec.after, OP) == 0, fn.__name__
        assert rec.results["fuse_attention"].matched == 0
        assert rec.results["fuse_attention"].unmatched == 1, "the report must name the unfused attention"
        torch.testing.assert_close(got, want)
        # and fusing it would have been wrong: it differs from the canonical attention
        _, canon_args = inputs()
        canon = einsum_attention(*[a.clone() for a in canon_args])
        assert not torch.allclose(real_rows(want, b), real_rows(canon, b), atol=1e-3)
