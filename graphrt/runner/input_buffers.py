"""InputBuffers: persistent fixed-address tensors of one graph key, loaded in one function.

The host writes them through numpy views of the same memory: a numpy slice assignment costs
well under a microsecond where a torch ``copy_`` or ``fill_`` costs three to four, and a step loads
a dozen buffers, twice each (data, then padding).

Padding rows are neutralised: padding tokens belong to no row (``token_req = -1``, slot -1, so
they write nothing real), padding rows have ``seq_len = 0`` and an empty query, point at the null
block, and sample greedily; their results are dropped.
"""

from __future__ import annotations

import numpy as np
import torch

from graphrt.runner.graph_key import GraphKey
from graphrt.runner.step_batch import StepBatch

ARG_NAMES = (
    "input_ids",
    "positions",
    "token_req",
    "block_tables",
    "seq_lens",
    "query_start_loc",
    "logits_indices",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "seeds",
    "offsets",
    "bitmask",
)


VERIFY_ARG_NAMES = (*ARG_NAMES, "draft_token_ids", "num_drafts")
VERIFY_PROBS_ARG_NAMES = (*VERIFY_ARG_NAMES, "draft_probs")
# an MTP step: each token's final hidden state beside its id, no bitmask (drafts are unconstrained)
MTP_ARG_NAMES = (ARG_NAMES[0], "hidden", *ARG_NAMES[1:-1])


class InputBuffers:
    """``spec_k`` > 0: a verify key's buffers, with K draft slots a row and logits (and grammar
    masks) at K + 1 positions a row. An MTP key's buffers (``hidden``: the hidden size and dtype)
    hold each token's final hidden state instead of a bitmask."""

    def __init__(
        self,
        key: GraphKey,
        max_blocks: int,
        vocab_words: int,
        spec_k: int = 0,
        hidden: tuple | None = None,
        draft_vocab: int = 0,
    ) -> None:
        t, r = key.num_tokens, key.num_reqs
        i64 = dict(dtype=torch.int64)
        self.key = key
        self.spec_k = spec_k if key.kind == "verify" else 0
        verify_names = VERIFY_PROBS_ARG_NAMES if draft_vocab else VERIFY_ARG_NAMES
        self.names = {"verify": verify_names, "mtp": MTP_ARG_NAMES}.get(key.kind, ARG_NAMES)
        positions = r * (self.spec_k + 1)  # logits rows
        if key.kind == "mtp":
            size, dtype = hidden
            self.hidden = torch.zeros(t, size, dtype=dtype)
        self.input_ids = torch.zeros(t, **i64)
        self.positions = torch.zeros(t, **i64)
        self.token_req = torch.full((t,), -1, **i64)
        self.block_tables = torch.zeros(r, max_blocks, **i64)
        self.seq_lens = torch.zeros(r, **i64)
        self.query_start_loc = torch.zeros(r + 1, **i64)  # every row empty until loaded
        self.logits_indices = torch.zeros(positions, **i64)
        self.temperature = torch.zeros(r)
        self.top_k = torch.zeros(r, **i64)
        self.top_p = torch.ones(r)
        self.min_p = torch.zeros(r)
        self.seeds = torch.zeros(r, **i64)
        self.offsets = torch.zeros(r, **i64)
        self.bitmask = torch.full((positions, vocab_words), -1, dtype=torch.int32)
        if self.spec_k:
            self.draft_token_ids = torch.zeros(r, spec_k, **i64)
            self.num_drafts = torch.zeros(r, **i64)
            if draft_vocab:  # the distribution of every draft (MTP)
                self.draft_probs = torch.zeros(r, spec_k, draft_vocab)
        # numpy views of the host-loaded buffers (the same memory as the tensors the graph reads)
        loaded = (*ARG_NAMES, "draft_token_ids", "num_drafts") if self.spec_k else ARG_NAMES
        self.host = {n: getattr(self, n).numpy() for n in loaded}
        self._bitmask_all_ones = True  # nothing but load writes it: a step without grammars skips it

    def load(self, b: StepBatch) -> None:
        """The one copy of a step's host data into the buffers, padding reset first."""
        t, r = b.num_tokens, b.num_reqs
        if t > self.key.num_tokens or r > self.key.num_reqs:
            raise ValueError(f"step of {t} tokens / {r} rows does not fit graph {self.key.name}")
        host = self.host
        _put(host["input_ids"], b.token_ids, 0)
        _put(host["positions"], b.positions, 0)
        _put(host["token_req"], b.token_req, -1)
        tables = host["block_tables"]
        tables[:] = 0
        tables[:r, : b.block_tables.shape[1]] = b.block_tables
        _put(host["seq_lens"], b.seq_lens, 0)
        _put(host["query_start_loc"], b.query_start_loc, t)
        _put(host["logits_indices"], b.logits_indices, 0)
        _put(host["temperature"], b.temperature, 0.0)
        _put(host["top_k"], b.top_k, 0)
        _put(host["top_p"], b.top_p, 1.0)
        _put(host["min_p"], b.min_p, 0.0)
        _put(host["seeds"], b.seeds, 0)
        _put(host["offsets"], b.offsets, 0)
        if b.bitmask is None:
            if not self._bitmask_all_ones:
                host["bitmask"][:] = -1
                self._bitmask_all_ones = True
        else:
            _put(host["bitmask"], b.bitmask, -1)
            self._bitmask_all_ones = False
        if b.hidden is not None:
            self.hidden[: b.hidden.shape[0]].copy_(b.hidden)
            self.hidden[b.hidden.shape[0] :].zero_()
        if self.spec_k:
            _put(host["draft_token_ids"], b.draft_token_ids, 0)
            _put(host["num_drafts"], b.num_drafts, 0)
            if "draft_probs" in self.names:
                self.draft_probs[: b.draft_probs.shape[0]].copy_(b.draft_probs)
                self.draft_probs[b.draft_probs.shape[0] :].zero_()

    def args(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, n) for n in self.names)


def _put(dst: np.ndarray, src: np.ndarray, pad) -> None:
    n = src.shape[0]
    dst[:n] = src
    if n < dst.shape[0]:  # a step that fills its key (the usual decode step) has no padding
        dst[n:] = pad
