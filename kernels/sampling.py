"""Sampling ops: ``graphrt::sample``, ``graphrt::draft_sample``, ``graphrt::rejection_sample``
(grammar masks first, through ``bitmask.mask_logits``).

Random rows draw by inverse CDF in vocabulary order with one counter-based uniform per row
(``rng.row_uniform``): a row's token depends on its logits, parameters, seed and position only.
The top-k / top-p / min-p filters are sets of kept tokens, so they do not change that order.
"""

import functools
from typing import Optional

import torch

from graphrt.kernels import checks
from graphrt.kernels.bitmask import mask_logits
from graphrt.kernels.op_library import define
from graphrt.kernels.rng import row_uniform

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


@functools.cache
def _native_greedy():
    """The native kernels' greedy sampling, or None where the library is not loaded:
    ``greedy_sample(logits)`` (argmax and its log-probability, one pass over each row) and
    ``greedy_sample_plain(logits, temperature, bitmask)`` (the same, or empty results when a row
    is random or a grammar bit is cleared)."""
    from graphrt.kernels import NATIVE_ISA

    return torch.ops.graphrt_native if NATIVE_ISA is not None else None


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
    native = _native_greedy()
    if native is not None and logits.device.type == "cpu":  # the usual step: one native call
        tokens, logprobs = native.greedy_sample_plain(logits, temperature, bitmask)
        if tokens.shape[0] == logits.shape[0]:
            return tokens, logprobs
    logits = logits.float()
    if bitmask is not None:
        logits = mask_logits(logits, bitmask)
    random = temperature > 0
    any_random = bool(random.any())  # CPU only: an all-greedy batch needs no softmax
    if native is not None and logits.device.type == "cpu" and not any_random:
        return native.greedy_sample(logits)  # a grammar's mask, applied above
    greedy = logits.argmax(dim=-1)
    tokens = greedy
    if any_random:
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


# --- draft sampling --------------------------------------------------------------------------


def _draft_sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = logits.float()
    native = _native_greedy()
    on_cpu = native is not None and logits.device.type == "cpu"
    greedy = native.greedy_sample(logits)[0] if on_cpu else logits.argmax(dim=-1)
    q = point_masses(greedy, logits)
    random = temperature > 0
    if not bool(random.any()):  # CPU only: an all-greedy batch needs no softmax and no draw
        return greedy, q
    probs = filtered_probs(logits, temperature, top_k, top_p, min_p)  # the sort only when a row filters by rank
    tokens = torch.where(random, draw(probs, row_uniform(seeds, offsets, 3)), greedy)
    return tokens, torch.where(random[:, None], probs, q)


def point_masses(tokens: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """[N, V] float64 (``logits``' shape): all of each row's mass on its token (a greedy row's
    draft distribution)."""
    return torch.zeros_like(logits, dtype=torch.float64).scatter(1, tokens[:, None], 1.0)


def _draft_sample_fake(logits, temperature, top_k, top_p, min_p, seeds, offsets):
    n = logits.shape[0]
    return torch.empty(n, dtype=torch.int64, device=logits.device), torch.empty(
        logits.shape, dtype=torch.float64, device=logits.device
    )


define(
    "draft_sample(Tensor logits, Tensor temperature, Tensor top_k, Tensor top_p, Tensor min_p, Tensor seeds, "
    "Tensor offsets) -> (Tensor, Tensor)",
    _draft_sample,
    _draft_sample_fake,
)


def draft_sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A draft model's token a row and the distribution it came from: ``(tokens [N], q [N, V]
    float64)``; random rows draw from q, after temperature and the filters, on a stream of their
    own (3; the target's draws use 0-2); greedy rows take the argmax, their q all on it."""
    checks.check_ndim("logits", logits, 2, "[rows, vocab]")
    checks.check_float("logits", logits)
    _check_rows(
        logits.shape[0], temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seeds=seeds, offsets=offsets
    )
    return torch.ops.graphrt.draft_sample(logits, temperature, top_k, top_p, min_p, seeds, offsets)


# --- rejection sampling ---------------------------------------------------------------------


def _leading_matches(tokens: torch.Tensor, draft_token_ids: torch.Tensor, num_drafts: torch.Tensor) -> torch.Tensor:
    """[N]: how many of each row's drafts agree with its tokens before the first disagreement."""
    step = torch.arange(draft_token_ids.shape[1], device=tokens.device)
    match = (tokens[:, :-1] == draft_token_ids) & (step < num_drafts[:, None])
    return match.long().cumprod(dim=1).sum(dim=1)


def _rejection_sample(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    draft_probs: Optional[torch.Tensor],
    target_logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
    bitmask: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = draft_token_ids.shape
    span = k + 1
    step = torch.arange(span, device=target_logits.device)
    positions = (offsets[:, None] + step).reshape(-1)
    rep = [t.repeat_interleave(span) for t in (temperature, top_k, top_p, min_p, seeds)]
    # every position sampled exactly as a main step samples it: the plain token at that position
    tokens, logprobs = _sample(target_logits, rep[0], rep[1], rep[2], rep[3], rep[4], positions, bitmask)
    tokens, logprobs = tokens.view(n, span), logprobs.view(n, span)
    # one-hot drafts, and any drafts of greedy rows: accepted while they equal the plain tokens
    if draft_probs is None or not bool((temperature > 0).any()):  # (CPU only: a host branch)
        accepted = _leading_matches(tokens, draft_token_ids, num_draft_tokens)
    else:
        tokens, logprobs, accepted = _accept_by_ratio(
            tokens, logprobs, draft_token_ids, num_draft_tokens, draft_probs, target_logits, rep, positions, bitmask
        )
    kept = step <= accepted[:, None]
    return torch.where(kept, tokens, -1), torch.where(kept, logprobs, 0.0)


def _accept_by_ratio(tokens, logprobs, drafts, num_drafts, draft_probs, logits, rep, positions, bitmask):
    """The standard rule for drafts with a distribution q: random rows accept draft d with
    probability min(1, p(d) / q(d)) and, at the first rejection, draw from the normalised residual
    max(p − q, 0); greedy rows accept while the draft is the argmax. p is the filtered target
    distribution the row samples from. The bonus token is the plain draw."""
    n, k = drafts.shape
    span, vocab = k + 1, logits.shape[-1]
    logits = logits.float()
    if bitmask is not None:
        logits = mask_logits(logits, bitmask)
    p = filtered_probs(logits, *rep[:4]).view(n, span, vocab)[:, :k]
    q = draft_probs.double()
    ratio = (p.gather(2, drafts[..., None]) / q.gather(2, drafts[..., None]).clamp(min=1e-30))[..., 0]
    u = row_uniform(rep[4], positions, 1).view(n, span)[:, :k]
    random = rep[0].view(n, span)[:, 0] > 0
    ok = torch.where(random[:, None], u < ratio.clamp(max=1.0), drafts == tokens[:, :-1])
    step = torch.arange(k, device=drafts.device)
    accepted = (ok & (step < num_drafts[:, None])).long().cumprod(dim=1).sum(dim=1)
    # accepted drafts, then at a random row's first rejection a draw from the residual; the
    # plain token stays where nothing was rejected (the bonus) and in greedy rows
    tokens = torch.cat([torch.where(step < accepted[:, None], drafts, tokens[:, :-1]), tokens[:, -1:]], dim=1)
    redo = random & (accepted < num_drafts)
    if bool(redo.any()):
        at = accepted.clamp(max=k - 1)
        rows = torch.arange(n, device=drafts.device)
        residual = (p[rows, at] - q[rows, at]).clamp(min=0)
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p[rows, at])
        seed_at = rep[4].view(n, span)[:, 0]
        drawn = draw(residual, row_uniform(seed_at, positions.view(n, span)[rows, at], 2))
        tokens[rows[redo], at[redo]] = drawn[redo]
    logprobs = torch.log_softmax(logits, dim=-1).view(n, span, vocab).gather(2, tokens[..., None])[..., 0]
    return tokens, logprobs, accepted


def _rejection_sample_fake(
    draft_token_ids,
    num_draft_tokens,
    draft_probs,
    target_logits,
    temperature,
    top_k,
    top_p,
    min_p,
    seeds,
    offsets,
    bitmask,
):
    n, k = draft_token_ids.shape
    return (
        torch.empty((n, k + 1), dtype=torch.int64, device=draft_token_ids.device),
        torch.empty((n, k + 1), dtype=torch.float32, device=draft_token_ids.device),
    )


define(
    "rejection_sample(Tensor draft_token_ids, Tensor num_draft_tokens, Tensor? draft_probs, Tensor target_logits, "
    "Tensor temperature, Tensor top_k, Tensor top_p, Tensor min_p, Tensor seeds, Tensor offsets, Tensor? bitmask) "
    "-> (Tensor, Tensor)",
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
    top_k: Optional[torch.Tensor] = None,
    top_p: Optional[torch.Tensor] = None,
    min_p: Optional[torch.Tensor] = None,
    bitmask: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify up to K draft tokens a row against the target's logits at its K + 1 positions
    (``target_logits`` [N, K + 1, V]; position i scores the token after i drafts, so its grammar
    mask, ``bitmask`` [N, K + 1, ceil(V / 32)], is the one after those drafts). ``offsets`` is each
    row's sample offset at position 0; position i samples at offset + i.

    Every position is sampled exactly as ``sample`` samples a row (temperature, top-k / top-p /
    min-p, seed and offset). Drafts without ``draft_probs`` (one-hot, e.g. n-gram) are accepted
    while they equal those tokens: the standard rule's outcome for a one-hot q (accept with
    probability p(d), else a draw from p without d), drawn so that a row's tokens are exactly the
    ones plain decoding would sample. With ``draft_probs`` [N, K, V] the standard min(1, p/q) rule
    and residual draw apply. Returns ``(tokens, logprobs)``, both [N, K + 1]: the accepted drafts,
    then one more token, then −1 (logprob 0)."""
    checks.check_ndim("draft_token_ids", draft_token_ids, 2, "[rows, max_drafts]")
    checks.check_int("draft_token_ids", draft_token_ids)
    n, k = draft_token_ids.shape
    checks.check_ndim("target_logits", target_logits, 3, "[rows, max_drafts + 1, vocab]")
    checks.check_float("target_logits", target_logits)
    checks.check_dim("target_logits", target_logits, 0, n, "rows of draft_token_ids")
    checks.check_dim("target_logits", target_logits, 1, k + 1, "max_drafts + 1")
    vocab = target_logits.shape[2]
    top_k = torch.zeros(n, dtype=torch.int64) if top_k is None else top_k
    top_p = torch.ones(n) if top_p is None else top_p
    min_p = torch.zeros(n) if min_p is None else min_p
    _check_rows(
        n,
        num_draft_tokens=num_draft_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        seeds=seeds,
        offsets=offsets,
    )
    if bool((num_draft_tokens > k).any()) or bool((num_draft_tokens < 0).any()):
        raise checks.KernelArgumentError(f"num_draft_tokens {num_draft_tokens.tolist()} must lie in [0, {k}]")
    if draft_probs is not None and draft_probs.shape != (n, k, vocab):
        raise checks.KernelArgumentError(f"draft_probs shape {tuple(draft_probs.shape)} must be {(n, k, vocab)}")
    if bitmask is not None:
        words = (vocab + 31) // 32
        if bitmask.shape != (n, k + 1, words):
            raise checks.KernelArgumentError(f"bitmask shape {tuple(bitmask.shape)} must be {(n, k + 1, words)}")
        bitmask = bitmask.reshape(n * (k + 1), words)
    return torch.ops.graphrt.rejection_sample(
        draft_token_ids,
        num_draft_tokens,
        draft_probs,
        target_logits.reshape(n * (k + 1), vocab),
        temperature,
        top_k,
        top_p,
        min_p,
        seeds,
        offsets,
        bitmask,
    )
