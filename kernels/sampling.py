"""Sampling ops: ``graphrt::apply_token_bitmask``, ``graphrt::sample``, ``graphrt::rejection_sample``.

Random rows draw by inverse CDF in vocabulary order with one counter-based uniform per row
(``rng.row_uniform``): a row's token depends on its logits, parameters, seed and position only.
The top-k / top-p / min-p filters are sets of kept tokens, so they do not change that order.
"""

from typing import Optional

import torch

from graphrt.kernels import checks
from graphrt.kernels.op_library import define
from graphrt.kernels.rng import row_uniform

# --- bitmask --------------------------------------------------------------------------------


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, ceil(V/32)] int32 → [rows, V] bool (True = allowed); bit j of word w is token 32w+j."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask[:, :, None] >> bits) & 1).bool().reshape(bitmask.shape[0], -1)
    return allowed[:, :vocab_size]


def _apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, indices: Optional[torch.Tensor]) -> torch.Tensor:
    rows = indices.long() if indices is not None else torch.arange(bitmask.shape[0])
    allowed = unpack_bitmask(bitmask[rows], logits.shape[1])
    out = logits.clone()
    out[rows] = out[rows].masked_fill(~allowed, float("-inf"))
    return out


def _apply_token_bitmask_fake(logits, bitmask, indices):
    return torch.empty_like(logits)


define(
    "apply_token_bitmask(Tensor logits, Tensor bitmask, Tensor? indices) -> Tensor",
    _apply_token_bitmask,
    _apply_token_bitmask_fake,
)


def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, indices: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Logits with −inf wherever the packed bitmask has a zero bit (xgrammar's semantics: row r of
    the bitmask masks row r of the logits, for the rows in ``indices``, or all). Returns a new tensor."""
    checks.check_ndim("logits", logits, 2, "[rows, vocab]")
    checks.check_ndim("bitmask", bitmask, 2, "[rows, ceil(vocab / 32)]")
    if bitmask.dtype != torch.int32:
        raise checks.KernelArgumentError(f"bitmask must be int32 (xgrammar's layout), got {bitmask.dtype}")
    checks.check_dim("bitmask", bitmask, 0, logits.shape[0], "rows of logits")
    checks.check_dim("bitmask", bitmask, 1, (logits.shape[1] + 31) // 32, "ceil(vocab / 32) words")
    if indices is not None:
        checks.check_ndim("indices", indices, 1, "[selected rows]")
        checks.check_int("indices", indices)
    return torch.ops.graphrt.apply_token_bitmask(logits, bitmask, indices)


# --- sample ---------------------------------------------------------------------------------


def filtered_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    skip_unused_sort: bool = True,
) -> torch.Tensor:
    """[N, V] float64 distributions after temperature and the top-k / top-p / min-p sets.
    ``skip_unused_sort`` skips the sort when no row filters by rank: a host-side branch, which
    the traceable (graph) form turns off."""
    vocab = logits.shape[1]
    temp = torch.where(temperature > 0, temperature, 1.0).double()
    probs = torch.softmax(logits.double() / temp[:, None], dim=-1)
    keep = probs > 0
    if not skip_unused_sort or bool(((top_k > 0) & (top_k < vocab) | (top_p < 1.0)).any()):
        sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        rank = torch.arange(vocab, device=logits.device)[None, :]
        k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab).long()
        mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        keep_sorted = (rank < k[:, None]) & (mass_before < top_p.double()[:, None]) | (rank == 0)
        keep = keep & torch.zeros_like(keep).scatter(1, order, keep_sorted)
    keep = keep & (probs >= min_p.double()[:, None] * probs.amax(dim=-1, keepdim=True))
    probs = torch.where(keep, probs, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse CDF in vocabulary order: row i's token holds ``u[i] * total`` in its interval."""
    cdf = torch.cumsum(probs.double(), dim=-1)
    target = (u.double() * cdf[:, -1])[:, None]
    return torch.searchsorted(cdf, target, right=True)[:, 0].clamp(max=probs.shape[1] - 1)


def _sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
    bitmask: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = logits.float()
    if bitmask is not None:
        logits = logits.masked_fill(~unpack_bitmask(bitmask, logits.shape[1]), float("-inf"))
    greedy = logits.argmax(dim=-1)
    tokens = greedy
    random = temperature > 0
    if bool(random.any()):  # CPU only: an all-greedy batch needs no softmax
        probs = filtered_probs(logits, temperature, top_k, top_p, min_p)
        tokens = torch.where(random, draw(probs, row_uniform(seeds, offsets, 0)), greedy)
    logprobs = torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None])[:, 0]
    return tokens, logprobs


def _sample_fake(logits, temperature, top_k, top_p, min_p, seeds, offsets, bitmask):
    n = logits.shape[0]
    return (
        torch.empty(n, dtype=torch.int64, device=logits.device),
        torch.empty(n, dtype=torch.float32, device=logits.device),
    )


define(
    "sample(Tensor logits, Tensor temperature, Tensor top_k, Tensor top_p, Tensor min_p, Tensor seeds, "
    "Tensor offsets, Tensor? bitmask) -> (Tensor, Tensor)",
    _sample,
    _sample_fake,
)


def _check_rows(n: int, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        checks.check_ndim(name, t, 1, "[rows]")
        checks.check_dim(name, t, 0, n, "rows of logits")


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
    bitmask: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row. Temperature 0 is greedy; top_k 0 and top_p 1 and min_p 0 are off; a
    packed grammar bitmask (xgrammar's layout, one row per logits row) masks tokens first.
    Returns ``(tokens [N] int64, logprobs [N] float32)``: the log-probability of each chosen token
    under the unfiltered (but masked) distribution softmax(logits)."""
    checks.check_ndim("logits", logits, 2, "[rows, vocab]")
    checks.check_float("logits", logits)
    _check_rows(
        logits.shape[0], temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seeds=seeds, offsets=offsets
    )
    for name, t in (("top_k", top_k), ("seeds", seeds), ("offsets", offsets)):
        checks.check_int(name, t)
    if bitmask is not None:
        checks.check_ndim("bitmask", bitmask, 2, "[rows, ceil(vocab / 32)]")
        checks.check_dim("bitmask", bitmask, 0, logits.shape[0], "rows of logits")
        checks.check_dim("bitmask", bitmask, 1, (logits.shape[1] + 31) // 32, "ceil(vocab / 32) words")
    return torch.ops.graphrt.sample(logits, temperature, top_k, top_p, min_p, seeds, offsets, bitmask)


# --- rejection sampling ---------------------------------------------------------------------


def _rejection_sample(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    draft_probs: Optional[torch.Tensor],
    target_logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
) -> torch.Tensor:
    n, k_max = draft_token_ids.shape
    out = torch.full((n, k_max + 1), -1, dtype=torch.int64)
    target_argmax = target_logits.argmax(dim=-1)  # [N, K+1]
    temp = torch.where(temperature > 0, temperature, 1.0).double()
    p = torch.softmax(target_logits.double() / temp[:, None, None], dim=-1)  # [N, K+1, V]
    steps = torch.arange(k_max + 1)
    u_accept = row_uniform(seeds.repeat_interleave(k_max + 1), (offsets[:, None] + steps).flatten(), 1).view(n, -1)
    drafts, counts, temps = draft_token_ids.tolist(), num_draft_tokens.tolist(), temperature.tolist()
    for r in range(n):
        k = counts[r]
        for i in range(k + 1):
            if temps[r] == 0.0:
                tok = int(target_argmax[r, i])
                out[r, i] = tok
                if i == k or drafts[r][i] != tok:
                    break
                continue
            seed, off = seeds[r : r + 1], offsets[r : r + 1] + i
            if i == k:  # every draft accepted: the bonus token from the target itself
                out[r, i] = draw(p[r, i][None], row_uniform(seed, off, 0))[0]
                break
            d = drafts[r][i]
            if draft_probs is None:  # a greedy draft: its distribution is one-hot at d
                q = torch.zeros_like(p[r, i])
                q[d] = 1.0
                accepted = bool(p[r, i, d] >= u_accept[r, i])
            else:
                q = draft_probs[r, i].double()
                accepted = bool(u_accept[r, i] < torch.clamp(p[r, i, d] / q[d].clamp(min=1e-30), max=1.0))
            if accepted:
                out[r, i] = d
                continue
            residual = (p[r, i] - q).clamp(min=0)
            if not bool(residual.sum() > 0):
                residual = p[r, i]
            out[r, i] = draw(residual[None], row_uniform(seed, off, 2))[0]
            break
    return out


def _rejection_sample_fake(draft_token_ids, num_draft_tokens, draft_probs, target_logits, temperature, seeds, offsets):
    n, k = draft_token_ids.shape
    return torch.empty((n, k + 1), dtype=torch.int64, device=draft_token_ids.device)


define(
    "rejection_sample(Tensor draft_token_ids, Tensor num_draft_tokens, Tensor? draft_probs, "
    "Tensor target_logits, Tensor temperature, Tensor seeds, Tensor offsets) -> Tensor",
    _rejection_sample,
    _rejection_sample_fake,
)


def rejection_sample(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    target_logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
    draft_probs: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Verify K draft tokens per row against the target's K+1 logits (vLLM's semantics).
    Returns [N, K+1]: accepted drafts, then the recovered (or bonus) token, then −1."""
    checks.check_ndim("draft_token_ids", draft_token_ids, 2, "[rows, max_drafts]")
    checks.check_int("draft_token_ids", draft_token_ids)
    n, k = draft_token_ids.shape
    checks.check_ndim("target_logits", target_logits, 3, "[rows, max_drafts + 1, vocab]")
    checks.check_dim("target_logits", target_logits, 0, n, "rows of draft_token_ids")
    checks.check_dim("target_logits", target_logits, 1, k + 1, "max_drafts + 1")
    _check_rows(n, num_draft_tokens=num_draft_tokens, temperature=temperature, seeds=seeds, offsets=offsets)
    if bool((num_draft_tokens > k).any()) or bool((num_draft_tokens < 0).any()):
        raise checks.KernelArgumentError(f"num_draft_tokens {num_draft_tokens.tolist()} must lie in [0, {k}]")
    if draft_probs is not None:
        checks.check_ndim("draft_probs", draft_probs, 3, "[rows, max_drafts, vocab]")
        if draft_probs.shape != (n, k, target_logits.shape[2]):
            raise checks.KernelArgumentError(
                f"draft_probs shape {tuple(draft_probs.shape)} must be {(n, k, target_logits.shape[2])}"
            )
    return torch.ops.graphrt.rejection_sample(
        draft_token_ids, num_draft_tokens, draft_probs, target_logits, temperature, seeds, offsets
    )
