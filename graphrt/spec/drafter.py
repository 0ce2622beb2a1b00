"""Drafter: which running requests get drafts this step, and whether the step verifies at all.

A request drafts when it is decoding (its last token is its only uncomputed one) and has room
left under max_tokens and max_model_len; any sampling (greedy, random, top-k / top-p / min-p)
and any grammar may draft, because the verify step samples every position exactly as a main
step would and keeps drafts only while they equal those tokens.

Whether a step verifies is a cost model. A verify graph scores k + 1 positions for every row,
so a step with drafts costs ``ratio`` times a main step of the same rows (measured as the graphs
run: ``StepTimes``; 1.36 at one row and about 3 at eight on a 2-core CPU, `graphrt bench spec`).
It yields ``rows + E`` tokens where E is the expected number of accepted drafts, so it pays when
``E > rows · (ratio − 1)``. A request's expected accepted drafts out of d is
``a + a² + … + aᵈ`` with ``a`` its acceptance so far (``(accepted + 1) / (drafted + 2)``);
a request that has drafted fewer than ``probe`` tokens counts all its drafts (it is being
probed: without a trial its acceptance cannot be known). Until a verify graph and its main
graph have been timed, ratio counts as 1 (drafts are taken, which times them).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from graphrt.spec.config import SpeculativeConfig
from graphrt.spec.ngram import NgramProposer

# rows → a verify step's time over a main step's at those rows; None while unmeasured
CostRatio = Callable[[int], "float | None"]


class Drafter:
    def __init__(self, config: SpeculativeConfig, cost_ratio: CostRatio | None = None, probe: int = 8) -> None:
        self.k = config.num_speculative_tokens
        self.proposer = NgramProposer(self.k, config.prompt_lookup_max, config.prompt_lookup_min)
        self.cost_ratio = cost_ratio or (lambda rows: None)
        self.probe = probe

    def expected_accepted(self, req, num_drafts: int) -> float:
        if req.num_draft_tokens < self.probe:
            return float(num_drafts)
        a = (req.num_accepted_tokens + 1) / (req.num_draft_tokens + 2)
        return a * (1 - a**num_drafts) / (1 - a)

    def propose_for(self, running, tracked: dict, max_model_len: int) -> None:
        for req in running:
            req.draft_token_ids = []
        decoding = [req for req in running if req.num_tokens - req.num_computed_tokens == 1]
        candidates = [req for req in decoding if req.request_id in tracked]
        if not candidates:
            return
        ratio = self.cost_ratio(len(decoding))
        needed = len(decoding) * ((1.0 if ratio is None else ratio) - 1.0)
        if sum(self.expected_accepted(req, self.k) for req in candidates) <= needed:
            return  # even k drafts a row would not pay: skip the lookups
        expected = 0.0
        for req in candidates:
            room = min(
                self.k, req.params.max_tokens - len(req.output_token_ids) - 1, max_model_len - req.num_tokens - 1
            )
            if room >= 1:
                req.draft_token_ids = self.proposer.propose(np.asarray(req.all_token_ids, dtype=np.int64), room)
                expected += self.expected_accepted(req, len(req.draft_token_ids))
        if expected <= needed:
            for req in candidates:
                req.draft_token_ids = []
