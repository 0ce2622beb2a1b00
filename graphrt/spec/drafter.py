"""Drafter: which running requests get drafts this step, and how many.

A request drafts when it is decoding (its last token is its only uncomputed one), samples
greedily or without top-k / top-p / min-p filters (rejection sampling scores against the
unfiltered distribution), and has room left under max_tokens and max_model_len. A request with a
grammar drafts too: the verify step masks each draft position with the grammar's mask after the
drafts before it. A request whose drafts keep being rejected stops drafting: after ``probe``
drafts with an acceptance rate under ``min_acceptance`` a verify step costs it more than it
saves. And a step takes drafts only when they fill at least half of the verify graph's draft
slots (k a decoding row): the graph costs its k + 1 token slots for every row, so a few drafts
among many rows lose more than they gain (`graphrt bench spec`, ordinary prompts at batch 8, k = 3:
0.82x plain with one draft for every two rows allowed, 0.92x with one a row).
"""

from __future__ import annotations

import numpy as np

from graphrt.spec.config import SpeculativeConfig
from graphrt.spec.ngram import NgramProposer


class Drafter:
    def __init__(self, config: SpeculativeConfig, probe: int = 8, min_acceptance: float = 0.25) -> None:
        self.k = config.num_speculative_tokens
        self.proposer = NgramProposer(self.k, config.prompt_lookup_max, config.prompt_lookup_min)
        self.probe, self.min_acceptance = probe, min_acceptance

    def eligible(self, req, grammar) -> bool:
        p = req.params
        filtered = p.temperature > 0 and (p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0)
        if filtered or req.num_tokens - req.num_computed_tokens != 1:
            return False
        if req.num_draft_tokens >= self.probe and req.num_accepted_tokens < self.min_acceptance * req.num_draft_tokens:
            return False
        return True

    def propose_for(self, running, tracked: dict, max_model_len: int) -> None:
        total = 0
        for req in running:
            req.draft_token_ids = []
            entry = tracked.get(req.request_id)
            if entry is None or not self.eligible(req, entry.grammar):
                continue
            room = min(
                self.k, req.params.max_tokens - len(req.output_token_ids) - 1, max_model_len - req.num_tokens - 1
            )
            if room >= 1:
                req.draft_token_ids = self.proposer.propose(np.asarray(req.all_token_ids, dtype=np.int64), room)
                total += len(req.draft_token_ids)
        decoding = sum(1 for req in running if req.num_tokens - req.num_computed_tokens == 1)
        if 2 * total < decoding * self.k:
            for req in running:
                req.draft_token_ids = []
