"""The n-gram proposer (prompt lookup): drafts are the tokens that followed the most recent
earlier occurrence of a request's last n tokens, n from prompt_lookup_max down to min."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, k: int, n_max: int, n_min: int) -> None:
        self.k, self.n_max, self.n_min = k, n_max, n_min

    def propose(self, tokens: np.ndarray, k: int | None = None) -> list[int]:
        """Up to ``k`` draft tokens for a sequence ``tokens`` (prompt + output), or none.
        O(len(tokens) · n) integer work per call."""
        k = self.k if k is None else k
        length = len(tokens)
        if k < 1:
            return []
        for n in range(min(self.n_max, length - 1), self.n_min - 1, -1):
            # windows starting before length - n: an earlier occurrence with something after it
            windows = sliding_window_view(tokens[: length - 1], n)
            hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return tokens[start : start + k].tolist()
        return []
