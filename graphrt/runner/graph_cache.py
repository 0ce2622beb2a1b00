"""The graph cache: capture sizes, padding and dispatch, and the entry behind every key.

Every step is padded to the next captured size: decode steps (one token per row) by rows, other
steps by tokens (rows padded to ``min(max_num_seqs, tokens)``). Capture sizes and padding rules
live here and nowhere else. A step bigger than every captured size runs eager on its exact size
and is counted as a graph miss; until graphs are compiled or loaded, every key runs eager.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass

import torch

from graphrt.runner.graph_key import GraphKey
from graphrt.runner.input_buffers import InputBuffers
from graphrt.runner.step_batch import StepBatch

StepFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
# A captured graph is bound to its key's buffers, the KV caches and the weights: called bare.
Graph = Callable[[], tuple[torch.Tensor, torch.Tensor]]


def _powers_of_two_up_to(limit: int, start: int = 1) -> tuple[int, ...]:
    sizes, s = [], start
    while s < limit:
        sizes.append(s)
        s *= 2
    return tuple(sizes) + (limit,)


@dataclass(frozen=True)
class CaptureSizes:
    """Graph sizes per step shape. Defaults: powers of two, so padding wastes under half."""

    decode: tuple[int, ...]  # rows (= tokens) of pure decode steps
    mixed: tuple[int, ...]  # tokens of prefill / mixed steps (empty: they run eager, as misses)

    @classmethod
    def default(cls, max_num_seqs: int, max_num_batched_tokens: int) -> CaptureSizes:
        return cls(
            decode=_powers_of_two_up_to(max_num_seqs),
            mixed=_powers_of_two_up_to(max_num_batched_tokens, start=min(16, max_num_batched_tokens)),
        )

    def __post_init__(self) -> None:
        for name in ("decode", "mixed"):
            sizes = getattr(self, name)
            if any(not isinstance(s, int) or s < 1 for s in sizes):
                raise ValueError(f"capture sizes {name}={sizes!r} must be a list of positive ints")
            object.__setattr__(self, name, tuple(sorted(set(sizes))))


class GraphCache:
    def __init__(
        self,
        sizes: CaptureSizes,
        max_num_seqs: int,
        max_blocks: int,
        vocab_words: int,
        spec_k: int = 0,
        mtp_hidden: tuple | None = None,
        draft_vocab: int = 0,
    ) -> None:
        self.sizes = sizes
        self.spec_k = spec_k  # draft tokens a verify row holds; 0: no verify graphs
        self.mtp_hidden = mtp_hidden  # (hidden size, dtype) of MTP steps; None: no MTP graphs
        self.draft_vocab = draft_vocab  # vocabulary of draft distributions verify steps take; 0: none
        # block-table columns of MTP keys: its chained drafts reach k - 1 positions past the last
        # token, past max_model_len too (those columns stay the null block)
        self.mtp_max_blocks = max_blocks
        self.max_num_seqs = max_num_seqs
        self.max_blocks = max_blocks
        self.vocab_words = vocab_words
        self.graphs: dict[GraphKey, Graph] = {}
        self._buffers: dict[GraphKey, InputBuffers] = {}
        self.compiling = False  # True once graphs are expected: eager runs then count as misses
        self.hits = 0
        self.misses = 0

    def keys(self, kind: str = "main") -> list[GraphKey]:
        """Every key to capture, largest first. Verify keys: every decode size's rows, each with
        its last token and K draft slots."""
        if kind == "verify":
            span = self.spec_k + 1
            return sorted(
                {GraphKey(kind, r * span, r) for r in self.sizes.decode if r <= self.max_num_seqs}, reverse=True
            )
        # main and mtp keys: the same sizes (an MTP step covers the tokens the step before computed)
        keys = {GraphKey(kind, r, r) for r in self.sizes.decode if r <= self.max_num_seqs}
        keys |= {GraphKey(kind, t, min(self.max_num_seqs, t)) for t in self.sizes.mixed}
        return sorted(keys, reverse=True)

    def all_keys(self) -> list[GraphKey]:
        return (
            self.keys("main")
            + (self.keys("verify") if self.spec_k else [])
            + (self.keys("mtp") if self.mtp_hidden else [])
        )

    def dispatch(self, batch: StepBatch, kind: str = "main") -> GraphKey:
        return self.key_for(kind, batch.num_tokens, batch.num_reqs)

    def key_for(self, kind: str, t: int, r: int) -> GraphKey:
        """The key a step of ``t`` tokens in ``r`` rows runs under (one token a row: a decode step)."""
        if kind == "verify":  # padded by rows to a decode size, K + 1 token slots a row
            span = self.spec_k + 1
            for size in self.sizes.decode[bisect.bisect_left(self.sizes.decode, r) :]:
                if size <= self.max_num_seqs and size * span >= t:
                    return GraphKey(kind, size * span, size)
            return GraphKey(kind, max(t, r), r)  # bigger than every verify graph: eager
        if t == r:
            i = bisect.bisect_left(self.sizes.decode, r)
            if i < len(self.sizes.decode) and self.sizes.decode[i] <= self.max_num_seqs:
                size = self.sizes.decode[i]
                return GraphKey(kind, size, size)
        i = bisect.bisect_left(self.sizes.mixed, t)
        if i < len(self.sizes.mixed):
            size = self.sizes.mixed[i]
            return GraphKey(kind, size, max(r, min(self.max_num_seqs, size)))
        return GraphKey(kind, t, r)  # bigger than every graph: exact size, eager

    def decode_keys(self, rows: int) -> tuple[GraphKey, GraphKey, GraphKey]:
        """The keys of a step of ``rows`` decoding rows: without drafts (main), with K drafts each
        (verify), and the MTP step after such a verify step (K + 1 tokens a row)."""
        span = self.spec_k + 1
        return (
            self.key_for("main", rows, rows),
            self.key_for("verify", rows * span, rows),
            self.key_for("mtp", rows * span, rows),
        )

    def buffers(self, key: GraphKey) -> InputBuffers:
        if key not in self._buffers:
            width = self.mtp_max_blocks if key.kind == "mtp" else self.max_blocks
            self._buffers[key] = InputBuffers(
                key, width, self.vocab_words, self.spec_k, self.mtp_hidden, self.draft_vocab
            )
        return self._buffers[key]

    def run(self, key: GraphKey, eager: StepFn, kv_caches) -> tuple[torch.Tensor, torch.Tensor]:
        bufs = self._buffers[key]
        graph = self.graphs.get(key)
        if graph is not None:
            self.hits += 1
            return graph()
        if self.compiling:
            self.misses += 1
        return eager(*bufs.args(), kv_caches)
