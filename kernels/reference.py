"""Pure-torch references of every graphrt op: written to be read, not to be fast.

These are the oracle for the device implementations and for the fusion passes. Each function has
the exact signature and semantics of its op; tests compare the ops against these and against naive
per-token loops of their own.
"""

from __future__ import annotations

import torch

from graphrt.kernels.rng import row_uniform

NEG_INF = float("-inf")


# --- KV cache -------------------------------------------------------------------------------


def slot_mapping(
    positions: torch.Tensor, token_req: torch.Tensor, block_tables: torch.Tensor, block_size: int
) -> torch.Tensor:
    """``block_table[req, pos // bs] * bs + pos % bs`` per token; −1 where ``token_req < 0``."""
    out = torch.full_like(positions, -1)
    for t in range(positions.shape[0]):
        r, p = int(token_req[t]), int(positions[t])
        if r >= 0:
            out[t] = int(block_tables[r, p // block_size]) * block_size + p % block_size
    return out


def reshape_and_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """Write row t of k/v into slot ``slots[t]`` of the paged caches; slot −1 writes nothing."""
    block_size = k_cache.shape[1]
    for t in range(k.shape[0]):
        s = int(slots[t])
        if s >= 0:
            k_cache[s // block_size, s % block_size] = k[t]
            v_cache[s // block_size, s % block_size] = v[t]


# --- attention ------------------------------------------------------------------------------


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor | None,  # [T, Hkv, D], written first when given
    v: torch.Tensor | None,
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    slots: torch.Tensor | None,  # [T]
    block_tables: torch.Tensor,  # [R, B]
    seq_lens: torch.Tensor,  # [R]
    query_start_loc: torch.Tensor,  # [R + 1]
    scale: float,
) -> torch.Tensor:  # [T, H, D]; rows of no request are zero
    if k is not None:
        reshape_and_cache(k, v, k_cache, v_cache, slots)
    num_heads, block_size, num_kv_heads = q.shape[1], k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.zeros_like(q)
    for r in range(seq_lens.shape[0]):
        start, end, seq_len = int(query_start_loc[r]), int(query_start_loc[r + 1]), int(seq_lens[r])
        q_len = end - start
        if q_len == 0:
            continue
        slots_r = [int(block_tables[r, j // block_size]) * block_size + j % block_size for j in range(seq_len)]
        flat_k = k_cache.reshape(-1, num_kv_heads, k_cache.shape[3])[slots_r]  # [L, Hkv, D]
        flat_v = v_cache.reshape(-1, num_kv_heads, v_cache.shape[3])[slots_r]
        for i in range(q_len):
            last = seq_len - q_len + i  # the query's own position: it sees keys 0..last
            for h in range(num_heads):
                kh = flat_k[: last + 1, h // group].float()
                vh = flat_v[: last + 1, h // group].float()
                scores = kh @ q[start + i, h].float() * scale
                out[start + i, h] = (torch.softmax(scores, 0) @ vh).to(q.dtype)
    return out


# --- norms and rotary -----------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual' = x + residual``; returns ``(rms_norm(residual'), residual')``."""
    new_residual = x + residual
    return rms_norm(new_residual, weight, eps), new_residual


def rotary_embedding(
    positions: torch.Tensor,  # [T]
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D]
    cos_sin_cache: torch.Tensor,  # [max_pos, rot]: cos in [:rot/2], sin in [rot/2:]
    is_neox: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    rot = cos_sin_cache.shape[1]
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)  # [T, rot/2] each
    cos, sin = cos[:, None, :], sin[:, None, :]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x_rot, x_pass = x[..., :rot].float(), x[..., rot:]
        if is_neox:  # halves: (x[i], x[i + rot/2])
            x1, x2 = x_rot[..., : rot // 2], x_rot[..., rot // 2 :]
            out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        else:  # GPT-J: interleaved pairs (x[2i], x[2i + 1])
            x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
            out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        return torch.cat((out.to(x.dtype), x_pass), dim=-1)

    return rotate(q), rotate(k)


# --- sampling -------------------------------------------------------------------------------


def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | None = None
) -> torch.Tensor:
    """Logits → −inf where the packed bit (xgrammar's layout, bit j of word w is token 32w + j)
    is zero; bitmask row r masks logits row r, for the rows in ``indices`` (or all rows)."""
    out = logits.clone()
    rows = range(bitmask.shape[0]) if indices is None else [int(i) for i in indices]
    vocab = min(logits.shape[1], bitmask.shape[1] * 32)
    for row in rows:
        for tok in range(vocab):
            if not (int(bitmask[row, tok // 32]) >> (tok % 32)) & 1:
                out[row, tok] = NEG_INF
    return out


def processed_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """The distribution a random row draws from: temperature, then the top-k, top-p and min-p
    masks (each a set of kept tokens; at least the most likely token is kept), renormalised."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    keep = probs > 0
    order = torch.argsort(probs, descending=True, stable=True)
    if 0 < top_k < probs.shape[0]:
        keep[order[top_k:]] = False
    if top_p < 1.0:
        sorted_p = probs[order]
        mass_before = torch.cumsum(sorted_p, 0) - sorted_p
        keep[order[mass_before >= top_p]] = False
    if min_p > 0.0:
        keep &= probs >= min_p * probs.max()
    keep[order[0]] = True
    probs = torch.where(keep, probs, 0.0)
    return probs / probs.sum()


def inverse_cdf(probs: torch.Tensor, u: float) -> int:
    """The token whose cumulative-probability interval (in vocabulary order) holds u * total."""
    cdf = torch.cumsum(probs.double(), 0)
    return int(
        torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=cdf.dtype), right=True).clamp(
            max=probs.shape[0] - 1
        )
    )


def sample(
    logits: torch.Tensor,  # [N, V]
    temperature: torch.Tensor,  # [N]; 0 means greedy
    top_k: torch.Tensor,  # [N] int; 0 (or ≥ V) means off
    top_p: torch.Tensor,  # [N]; 1 means off
    min_p: torch.Tensor,  # [N]; 0 means off
    seeds: torch.Tensor,  # [N] int64
    offsets: torch.Tensor,  # [N] int64: position of the token being drawn
    bitmask: torch.Tensor | None = None,  # [N, ceil(V / 32)] int32, applied first
) -> tuple[torch.Tensor, torch.Tensor]:  # tokens [N] int64, logprobs [N] float32
    if bitmask is not None:
        logits = apply_token_bitmask(logits.float(), bitmask)
    n = logits.shape[0]
    tokens = torch.zeros(n, dtype=torch.int64)
    logprobs = torch.zeros(n, dtype=torch.float32)
    for i in range(n):
        row = logits[i].float()
        if float(temperature[i]) == 0.0:
            tok = int(torch.argmax(row))
        else:
            probs = processed_probs(row, float(temperature[i]), int(top_k[i]), float(top_p[i]), float(min_p[i]))
            tok = inverse_cdf(probs, float(row_uniform(seeds[i : i + 1], offsets[i : i + 1], 0)[0]))
        tokens[i] = tok
        logprobs[i] = torch.log_softmax(row, -1)[tok]
    return tokens, logprobs


def rejection_sample(
    draft_token_ids: torch.Tensor,  # [N, K]
    num_draft_tokens: torch.Tensor,  # [N] int: drafts used in each row (≤ K)
    draft_probs: torch.Tensor | None,  # [N, K, V] or None (one-hot drafts, e.g. n-gram)
    target_logits: torch.Tensor,  # [N, K + 1, V]
    temperature: torch.Tensor,  # [N]; 0 means greedy
    top_k: torch.Tensor,  # [N]
    top_p: torch.Tensor,  # [N]
    min_p: torch.Tensor,  # [N]
    seeds: torch.Tensor,  # [N]
    offsets: torch.Tensor,  # [N]: sample offset of position 0; position i draws at offset + i
    bitmask: torch.Tensor | None = None,  # [N, K + 1, ceil(V / 32)]: position i's grammar mask
) -> tuple[torch.Tensor, torch.Tensor]:  # [N, K + 1]: accepted drafts, one more token, −1 after
    n, k_max = draft_token_ids.shape
    out = torch.full((n, k_max + 1), -1, dtype=torch.int64)
    out_lp = torch.zeros((n, k_max + 1), dtype=torch.float32)
    for r in range(n):
        k = int(num_draft_tokens[r])
        params = (float(temperature[r]), int(top_k[r]), float(top_p[r]), float(min_p[r]))
        for i in range(k + 1):
            logits = target_logits[r, i].float()
            if bitmask is not None:
                logits = apply_token_bitmask(logits[None], bitmask[r, i][None])[0]
            seed, off = seeds[r : r + 1], offsets[r : r + 1] + i
            if params[0] == 0.0:
                plain = int(torch.argmax(logits))
                p = None
            else:
                p = processed_probs(logits, *params)
                plain = inverse_cdf(p, float(row_uniform(seed, off, 0)[0]))
            tok = plain  # the token plain decoding samples here: the bonus, or a one-hot verdict
            accepted = False
            if i < k:
                d = int(draft_token_ids[r, i])
                if draft_probs is None or p is None:
                    accepted = d == plain
                else:
                    q = draft_probs[r, i].double()
                    u = float(row_uniform(seed, off, 1)[0])
                    accepted = u < min(1.0, float(p[d]) / max(float(q[d]), 1e-30))
                    if not accepted:
                        residual = (p - q).clamp(min=0)
                        tok = inverse_cdf(
                            residual if float(residual.sum()) > 0 else p, float(row_uniform(seed, off, 2)[0])
                        )
            out[r, i] = draft_token_ids[r, i] if accepted else tok
            out_lp[r, i] = torch.log_softmax(logits, -1)[int(out[r, i])]
            if not accepted:
                break
    return out, out_lp


def mla_attention(
    q_latent, q_pe, latent, k_pe, latent_cache, pe_cache, slots, block_tables, seq_lens, query_start_loc, scale
):
    """Latent attention one query token at a time (caches written first, in place): token t of
    row r attends to the row's first ``seq_len - (qsl[r + 1] - t) + 1`` cache entries."""
    flat_c, flat_r = latent_cache.view(-1, latent_cache.shape[-1]), pe_cache.view(-1, pe_cache.shape[-1])
    for t in range(latent.shape[0]):
        if int(slots[t]) >= 0:
            flat_c[int(slots[t])] = latent[t]
            flat_r[int(slots[t])] = k_pe[t]
    out = torch.zeros_like(q_latent)
    bs = latent_cache.shape[1]
    for r in range(block_tables.shape[0]):
        for t in range(int(query_start_loc[r]), int(query_start_loc[r + 1])):
            n = int(seq_lens[r]) - (int(query_start_loc[r + 1]) - t) + 1
            idx = [int(block_tables[r, j // bs]) * bs + j % bs for j in range(n)]
            keys, keys_pe = flat_c[idx].float(), flat_r[idx].float()  # [n, C], [n, R]
            scores = (q_latent[t].float() @ keys.T + q_pe[t].float() @ keys_pe.T) * scale  # [H, n]
            out[t] = (torch.softmax(scores, -1) @ keys).to(out.dtype)
    return out


def moe_experts(x, topk_ids, topk_weights, w_gate_up, w_down):
    """Each token through each of its experts, one at a time."""
    inter = w_down.shape[2]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            gate, up = (w_gate_up[e] @ x[t]).split(inter)
            out[t] += float(topk_weights[t, j]) * (w_down[e] @ (torch.nn.functional.silu(gate) * up))
    return out
