"""The unfused torch spellings of graphrt's fused ops: what models write, what passes recognise.

A model that computes attention, slot mapping, norms or sampling with these functions gets the
fused ops in graph mode: each fusion pass traces the function below into its pattern and matches
the traced step graph against it exactly. In eager mode these functions simply run, so eager and
graph mode compute the same thing. Everything here is traceable torch: no host branches on data.
"""

from __future__ import annotations

import torch

from graphrt.kernels.bitmask import unpack_bitmask
from graphrt.kernels.rng import row_uniform
from graphrt.kernels.sampling import draw, filtered_probs, point_masses


def slot_mapping(
    positions: torch.Tensor, token_req: torch.Tensor, block_tables: torch.Tensor, block_size: int
) -> torch.Tensor:
    """``block_table[req, pos // bs] * bs + pos % bs``; −1 where the token is padding."""
    block = block_tables[token_req, positions // block_size]
    slots = block * block_size + positions % block_size
    return torch.where(token_req >= 0, slots, -1)


def _write_gather_mask(k, v, k_cache, v_cache, slots, block_tables, seq_lens, query_start_loc, token_req):
    """The cache write at the slots, each token's K/V gathered through its row's block table
    ([T, L, Hkv, D], in k's dtype), and the causal mask [T, L] of the keys each token may see. A
    cache may hold a narrower dtype than k (a bf16 KV cache under an fp32 model): the write rounds
    to it, the gather widens back."""
    num_tokens = token_req.shape[0]
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    write_at = slots.clamp(min=0)
    k_cache.view(num_blocks * block_size, num_kv_heads, head_dim).index_copy_(0, write_at, k.to(k_cache.dtype))
    v_cache.view(num_blocks * block_size, num_kv_heads, head_dim).index_copy_(0, write_at, v.to(v_cache.dtype))
    blocks = block_tables[token_req]
    keys = k_cache[blocks].reshape(num_tokens, -1, num_kv_heads, head_dim).to(k.dtype)
    values = v_cache[blocks].reshape(num_tokens, -1, num_kv_heads, head_dim).to(v.dtype)
    token = torch.arange(num_tokens, device=k.device)
    last = seq_lens[token_req] - (query_start_loc[token_req + 1] - token)  # [T]
    context = torch.arange(keys.shape[1], device=k.device)
    allowed = context[None, :] <= last[:, None]
    return keys, values, allowed


def attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    slots: torch.Tensor,  # [T], −1 for padding
    block_tables: torch.Tensor,  # [R, B]
    seq_lens: torch.Tensor,  # [R]
    query_start_loc: torch.Tensor,  # [R + 1]
    token_req: torch.Tensor,  # [T], row of each token, −1 for padding
    scale: float,
) -> torch.Tensor:  # [T, H * D]
    """``graphrt::paged_attention`` with its cache write, unfused: write K/V at the slots, gather
    each token's sequence through its row's block table, causal softmax attention.

    Token t of row r sits at key position ``seq_len[r] - (qsl[r + 1] - t)`` and sees keys up to
    it (queries are the last ``query_len`` positions of the sequence); query head h reads kv head
    ``h // (H / Hkv)``. Padding tokens write into the null block 0 and see at least one key, so
    their (discarded) rows stay finite.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    keys, values, allowed = _write_gather_mask(
        k, v, k_cache, v_cache, slots, block_tables, seq_lens, query_start_loc, token_req
    )
    qg = q.reshape(num_tokens, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = torch.einsum("tkgd,tlkd->tkgl", qg, keys).float() * scale
    scores = scores.masked_fill(~allowed[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    out = torch.einsum("tkgl,tlkd->tkgd", probs, values)
    return out.reshape(num_tokens, num_heads * head_dim)


def attention_sdpa(q, k, v, k_cache, v_cache, slots, block_tables, seq_lens, query_start_loc, token_req, scale):
    """The same attention as ``attention``, computed by scaled_dot_product_attention over the
    gathered K/V (grouped-query heads through enable_gqa)."""
    num_tokens, num_heads, head_dim = q.shape
    keys, values, allowed = _write_gather_mask(
        k, v, k_cache, v_cache, slots, block_tables, seq_lens, query_start_loc, token_req
    )
    out = torch.nn.functional.scaled_dot_product_attention(
        q[:, :, None, :],
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=allowed[:, None, None, :],
        scale=scale,
        enable_gqa=True,
    )  # [T, H, 1, D]
    return out.reshape(num_tokens, num_heads * head_dim)


def mla_attention(
    q_latent: torch.Tensor,  # [T, H, C]: q_nope with the key up-projection absorbed
    q_pe: torch.Tensor,  # [T, H, R]: the rotated rope part of the queries
    latent: torch.Tensor,  # [T, C]: this step's normalised latents
    k_pe: torch.Tensor,  # [T, R]: this step's rotated shared rope keys
    latent_cache: torch.Tensor,  # [num_blocks, block_size, 1, C]
    pe_cache: torch.Tensor,  # [num_blocks, block_size, 1, R]
    slots: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    token_req: torch.Tensor,
    scale: float,
) -> torch.Tensor:  # [T, H, C]
    """``graphrt::mla_attention`` unfused: write the latents at the slots, gather each token's
    sequence of latents and rope keys through its row's block table, causal softmax attention in
    latent space (keys: latent and rope key; values: the latent)."""
    num_tokens = token_req.shape[0]
    num_blocks, block_size, _, rank = latent_cache.shape
    rope_dim = pe_cache.shape[3]
    write_at = slots.clamp(min=0)
    latent_cache.view(num_blocks * block_size, rank).index_copy_(0, write_at, latent)
    pe_cache.view(num_blocks * block_size, rope_dim).index_copy_(0, write_at, k_pe)
    blocks = block_tables[token_req]
    keys = latent_cache[blocks].reshape(num_tokens, -1, rank)  # [T, L, C]
    keys_pe = pe_cache[blocks].reshape(num_tokens, -1, rope_dim)  # [T, L, R]
    token = torch.arange(num_tokens, device=latent.device)
    last = seq_lens[token_req] - (query_start_loc[token_req + 1] - token)
    context = torch.arange(keys.shape[1], device=latent.device)
    allowed = context[None, :] <= last[:, None]
    scores = torch.einsum("thc,tlc->thl", q_latent, keys) + torch.einsum("thr,tlr->thl", q_pe, keys_pe)
    scores = scores.float() * scale
    scores = scores.masked_fill(~allowed[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q_latent.dtype)
    return torch.einsum("thl,tlc->thc", probs, keys)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """float32 statistics, cast back before the weight: the order transformers uses."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    new_residual = x + residual
    return rms_norm(new_residual, weight, eps), new_residual


def sample(
    logits: torch.Tensor,  # [R, V]
    bitmask: torch.Tensor,  # [R, ceil(V / 32)] int32, −1 = every token allowed
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exactly ``graphrt::sample`` with the bitmask applied first: (tokens, logprobs)."""
    logits = logits.float()
    logits = logits.masked_fill(~unpack_bitmask(bitmask, logits.shape[1]), float("-inf"))
    greedy = logits.argmax(dim=-1)
    probs = filtered_probs(logits, temperature, top_k, top_p, min_p, skip_unused_sort=False)
    drawn = draw(probs, row_uniform(seeds, offsets, 0))
    tokens = torch.where(temperature > 0, drawn, greedy)
    logprobs = torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None])[:, 0]
    return tokens, logprobs


def draft_sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A draft model's token and its distribution q [R, V]: for random rows a draw from q (after
    temperature and the filters) on stream 3 (the target's draws use streams 0-2, so drafts never
    share their randomness); for greedy rows the argmax, q all on it."""
    logits = logits.float()
    probs = filtered_probs(logits, temperature, top_k, top_p, min_p, skip_unused_sort=False)
    drawn = draw(probs, row_uniform(seeds, offsets, 3))
    greedy = logits.argmax(dim=-1)
    random = temperature > 0
    q = torch.where(random[:, None], probs, point_masses(greedy, logits))
    return torch.where(random, drawn, greedy), q


def rejection_sample(
    logits: torch.Tensor,  # [R * (K + 1), V]: row r's positions 0..K, row-major
    bitmask: torch.Tensor,  # [R * (K + 1), ceil(V / 32)]: each position's grammar mask
    temperature: torch.Tensor,  # [R]
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor,  # [R]: the sample offset of position 0
    draft_token_ids: torch.Tensor,  # [R, K]
    num_drafts: torch.Tensor,  # [R]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exactly ``graphrt::rejection_sample`` for one-hot drafts: every position sampled as
    ``sample`` samples it, drafts accepted while they equal those tokens; (tokens, logprobs)
    [R, K + 1] with −1 (logprob 0) after each row's last kept token."""
    rows, max_drafts = draft_token_ids.shape
    span = max_drafts + 1
    step = torch.arange(span, device=draft_token_ids.device)
    tokens, logprobs = sample(
        logits,
        bitmask,
        temperature.repeat_interleave(span),
        top_k.repeat_interleave(span),
        top_p.repeat_interleave(span),
        min_p.repeat_interleave(span),
        seeds.repeat_interleave(span),
        (offsets[:, None] + step).reshape(-1),
    )
    tokens, logprobs = tokens.view(rows, span), logprobs.view(rows, span)
    match = (tokens[:, :-1] == draft_token_ids) & (step[None, :-1] < num_drafts[:, None])
    accepted = match.long().cumprod(dim=1).sum(dim=1)
    kept = step[None, :] <= accepted[:, None]
    return torch.where(kept, tokens, -1), torch.where(kept, logprobs, 0.0)


def rejection_sample_by_ratio(
    logits: torch.Tensor,  # [R * (K + 1), V]
    bitmask: torch.Tensor,  # [R * (K + 1), ceil(V / 32)]
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
    draft_token_ids: torch.Tensor,  # [R, K]
    num_drafts: torch.Tensor,
    draft_probs: torch.Tensor,  # [R, K, V]: the distribution each draft was drawn from
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exactly ``graphrt::rejection_sample`` with draft distributions: random rows accept draft d
    with probability min(1, p(d) / q(d)) and at the first rejection draw from the normalised
    residual max(p − q, 0); greedy rows accept while the draft is the argmax; the bonus token is
    the plain draw. (tokens, logprobs) [R, K + 1], −1 (logprob 0) after each row's last token."""
    rows, max_drafts = draft_token_ids.shape
    span = max_drafts + 1
    vocab = logits.shape[1]
    step = torch.arange(span, device=draft_token_ids.device)
    positions = (offsets[:, None] + step).reshape(-1)
    temps = temperature.repeat_interleave(span)
    ks, ps, mins = top_k.repeat_interleave(span), top_p.repeat_interleave(span), min_p.repeat_interleave(span)
    masked = logits.float().masked_fill(~unpack_bitmask(bitmask, vocab), float("-inf"))
    probs = filtered_probs(masked, temps, ks, ps, mins, skip_unused_sort=False)
    drawn = draw(probs, row_uniform(seeds.repeat_interleave(span), positions, 0))
    tokens = torch.where(temps > 0, drawn, masked.argmax(dim=-1)).view(rows, span)  # the plain tokens
    p = probs.view(rows, span, vocab)[:, :-1]
    q = draft_probs.double()
    d = draft_token_ids[..., None]
    ratio = p.gather(2, d)[..., 0] / q.gather(2, d)[..., 0].clamp(min=1e-30)
    u = row_uniform(seeds.repeat_interleave(span), positions, 1).view(rows, span)[:, :-1]
    random = temperature > 0
    ok = torch.where(random[:, None], u < ratio.clamp(max=1.0), draft_token_ids == tokens[:, :-1])
    accepted = (ok & (step[None, :-1] < num_drafts[:, None])).long().cumprod(dim=1).sum(dim=1)
    at = accepted.clamp(max=max_drafts - 1)
    row = torch.arange(rows, device=draft_token_ids.device)
    residual = (p[row, at] - q[row, at]).clamp(min=0)
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p[row, at])
    redraw = draw(residual, row_uniform(seeds, offsets + at, 2))
    out = torch.cat(
        [torch.where(step[None, :-1] < accepted[:, None], draft_token_ids, tokens[:, :-1]), tokens[:, -1:]], 1
    )
    redo = random & (accepted < num_drafts)
    out = out.scatter(1, at[:, None], torch.where(redo, redraw, out.gather(1, at[:, None])[:, 0])[:, None])
    logprobs = torch.log_softmax(masked, dim=-1).view(rows, span, vocab).gather(2, out[..., None])[..., 0]
    kept = step[None, :] <= accepted[:, None]
    return torch.where(kept, out, -1), torch.where(kept, logprobs, 0.0)
