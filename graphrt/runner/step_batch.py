"""StepBatch: the immutable host data of one step, built by the runner's prepare()."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True, eq=False)
class StepBatch:
    req_ids: tuple[str, ...]  # step order; row r is req_ids[r]
    token_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    token_req: np.ndarray  # [T] int64: row of each token
    block_tables: np.ndarray  # [R, max_blocks] int64
    seq_lens: np.ndarray  # [R] int64: context after this step
    query_start_loc: np.ndarray  # [R + 1] int64
    logits_indices: np.ndarray  # [R] int64: each row's last token ([R·(K+1)] in verify steps)
    temperature: np.ndarray  # [R] float32
    top_k: np.ndarray  # [R] int64
    top_p: np.ndarray  # [R] float32
    min_p: np.ndarray  # [R] float32
    seeds: np.ndarray  # [R] int64
    offsets: np.ndarray  # [R] int64: position of the token each row samples
    bitmask: np.ndarray | None  # [R (·(K+1)), ceil(V / 32)] int32, or None when no row is constrained
    samples: np.ndarray  # [R] bool: does the row's sampled token count (prompt done)?
    draft_token_ids: np.ndarray | None = None  # verify steps: [R, K] int64 (0-padded)
    num_drafts: np.ndarray | None = None  # verify steps: [R] int64
    hidden: torch.Tensor | None = None  # MTP steps: [T, H], each token's final hidden state
    draft_probs: torch.Tensor | None = None  # verify steps with MTP drafts: [R, K, V]
    lora_slots: np.ndarray | None = None  # [R] int64: each row's adapter slot (−1: none)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    @property
    def is_decode(self) -> bool:
        return self.num_tokens == self.num_reqs
