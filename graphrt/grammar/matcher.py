"""RequestGrammar: one request's xgrammar matcher. It fills the request's row of the step's packed
bitmask before the step and accepts the sampled token after it; it can roll back rejected draft
tokens and fill the rows of the k+1 positions a speculative verify step scores."""

from __future__ import annotations

import numpy as np
import torch


class RequestGrammar:
    def __init__(self, compiled, vocab_size: int, max_rollback_tokens: int = 16) -> None:
        import xgrammar

        self.matcher = xgrammar.GrammarMatcher(compiled, max_rollback_tokens=max_rollback_tokens)
        self.words = (vocab_size + 31) // 32
        self._row = torch.empty((1, self.words), dtype=torch.int32)

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()

    def fill(self, out: np.ndarray) -> bool:
        """Write the allowed-token bits into ``out`` ([words] int32); False if no token is allowed."""
        self.matcher.fill_next_token_bitmask(self._row, 0)
        out[:] = self._row.numpy()[0]
        return bool(out.any())

    def accept(self, token: int) -> bool:
        return self.matcher.accept_token(token)

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)

    def fill_for_draft(self, draft: list[int], out: np.ndarray) -> int:
        """Rows for a verify step: ``out[i]`` is the mask after accepting ``draft[:i]``, for
        i = 0..len(draft). Returns how many draft tokens the grammar accepts (rows past that are
        left all-zero); the matcher ends where it started."""
        accepted = 0
        self.fill(out[0])
        for i, tok in enumerate(draft):
            if not self.matcher.accept_token(tok):
                break
            accepted += 1
            self.fill(out[i + 1])
        out[accepted + 1 :] = 0
        if accepted:
            self.matcher.rollback(accepted)
        return accepted
